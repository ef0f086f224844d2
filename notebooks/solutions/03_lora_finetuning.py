"""Solutions to the exercises of 03_lora_finetuning.ipynb. Run: python notebooks/solutions/03_lora_finetuning.py

Each run trains for a few minutes on a laptop CPU; STEPS keeps them short.
"""
import json
import tempfile
from pathlib import Path

import jax
import numpy as np

from amdllm.io import checkpoint
from amdllm import course, train
from amdllm.train import data
from amdllm.model import lora
from amdllm.io.tokenizer import load_tokenizer

STEPS, EVAL = 120, 64
model_dir = course.default_model_dir()
tok = load_tokenizer(model_dir)
train_path, heldout_path = course.task_paths()
rows = [json.loads(l) for l in heldout_path.read_text().splitlines()][:EVAL]
ds = data.load_dataset(train_path, tok, 128)


def run(rank=8, targets="q,k,v,o,gate,up,down"):
    model = lora.apply_lora(checkpoint.load(model_dir), rank=rank, alpha=2 * rank, targets=targets)
    n = sum(int(np.prod(v.shape)) for v in lora.lora_params(model).values())
    res = train.finetune(model, ds, Path(tempfile.mkdtemp()) / "a",
                         train.TrainConfig(steps=STEPS, batch_size=16, seq_len=128, lr=2e-3),
                         tokenizer=tok, task_rows=rows, progress=False)
    return n, res["eval"]["task_accuracy"]


# 1. Rank 1, 8, 32 (alpha = 2 * rank keeps the scale alpha/r the same).
for r in (1, 8, 32):
    n, acc = run(rank=r)
    print(f"1. rank {r:>2}: {n:>8,} trained parameters, accuracy {acc:.0%}")

# 2. q,v only.
n, acc = run(targets="q,v")
print(f"2. q,v only: {n:,} trained parameters, accuracy {acc:.0%}")

# 3. Accumulation: 1 x 16 rows == 2 x 8 rows (the loss is normalised over the whole step's tokens).
model = lora.apply_lora(checkpoint.load(model_dir), rank=8, alpha=16)
# make B non-zero so the gradients of A are too
lora.set_lora_params(model, {k: v + 0.01 if k.endswith("_b") else v for k, v in lora.lora_params(model).items()})
results = []
for bs, k in ((16, 1), (8, 2)):
    tc = train.TrainConfig(steps=10, batch_size=bs, grad_accum=k, seq_len=128, lr=1e-3)
    opt, _ = train.make_optimizer(tc)
    lp, frozen = train.split_params(model)
    lp = jax.tree.map(lambda x: x.copy(), lp)
    state = opt.init(lp)
    batch = train.place_batch(train.stack_batch(ds, np.arange(16), k))
    new, _, m = train.make_train_step(model, opt)(lp, state, frozen, batch, jax.random.key(0))
    results.append((float(m["loss"]), new))
(l1, p1), (l2, p2) = results
diff = max(float(abs(p1[n] - p2[n]).max()) for n in p1)
print(f"3. loss 1x16 {l1:.6f} vs 2x8 {l2:.6f}; max difference of the updated factors {diff:.1e}")
assert abs(l1 - l2) < 1e-5 and diff < 1e-5
