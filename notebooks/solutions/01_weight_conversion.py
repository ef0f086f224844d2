"""Solutions to the exercises of 01_weight_conversion.ipynb. Run: python notebooks/solutions/01_weight_conversion.py"""
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import torch
from transformers import LlamaForCausalLM

from amdllm.io import checkpoint
from amdllm import course
from amdllm.config import get_preset

model_dir = course.default_model_dir()
src = checkpoint.TensorSource(model_dir)

# 1. The largest tensor, and the share of embeddings + head.
sizes = {n: int(np.prod(src.shape(n))) * src.dtype(n).itemsize for n in src.names()}
big = max(sizes, key=sizes.get)
print(f"1. largest: {big} {src.shape(big)} = {sizes[big] / 1e6:.2f} MB")
model = checkpoint.load(model_dir)
cfg = model.cfg
emb = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
print(f"   embeddings + head: {emb / cfg.num_params():.0%} of this model's parameters")
c8 = get_preset("llama-3.1-8b")
print(f"   Llama 3.1 8B: {2 * c8.vocab_size * c8.hidden_size / c8.num_params():.0%}")

# 2. Sharded save: several files + an index; both loaders read it and nothing changes.
out = Path(tempfile.mkdtemp()) / "sharded"
checkpoint.save(model, out, max_shard_size="1MB", tokenizer_from=model_dir)
print("2.", sorted(p.name for p in out.glob("model*")))
tokens = np.arange(3, 35, dtype=np.int32)[None]
ref = np.asarray(model(jnp.asarray(tokens))[0])
again = np.asarray(checkpoint.load(out)(jnp.asarray(tokens))[0])
with torch.no_grad():
    hf = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
print(f"   amdllm reload diff {np.abs(again - ref).max():.1e}, transformers diff {np.abs(hf - ref).max():.1e}")
assert np.abs(again - ref).max() == 0 and np.abs(hf - ref).max() < 1e-4

# 3. A conversion bug: swap two query heads of layer 0 (what a wrong head permutation does).
hd = cfg.head_dim
q = np.array(model.layers.q_proj[...])                       # [L, D, H*hd]
q[0][:, :hd], q[0][:, hd:2 * hd] = q[0][:, hd:2 * hd].copy(), q[0][:, :hd].copy()
bad = checkpoint.load(model_dir)
bad.layers.q_proj.set_value(jnp.asarray(q))
diff = np.abs(np.asarray(bad(jnp.asarray(tokens))[0]) - ref).max()
print(f"3. with two query heads swapped in layer 0: max logit diff {diff:.2f} (vs ~1e-6) - layer 1 of the plot catches it")
assert diff > 1e-2
