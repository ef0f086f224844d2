"""The LoRA train step and loop: accumulation, resume, sharding, frozen weights, memory, NaN, CLI."""
import json
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from amdllm.train import data
from amdllm.model import lora
from amdllm.io import peft
from amdllm import train
from amdllm.train import loop as train_loop
from amdllm.config import LlamaConfig
from amdllm.model import Llama
from amdllm.model.fast import FUSED, fuses

CFG = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2)


def tiny_model(seed=0, rank=4, dtype=jnp.float32, lora_seed=None, **cfg):
    m = Llama(LlamaConfig.from_dict({**CFG, **cfg}), rngs=nnx.Rngs(seed), dtype=dtype)
    m.lm_head.value = 10 * m.lm_head[...]  # O(1) logits (init std 0.02 caps them near 1: nothing to learn)
    return lora.apply_lora(m, rank=rank, alpha=8, seed=seed if lora_seed is None else lora_seed)


def sort_task(n=48, seq_len=32, seed=0):
    """'sort these numbers': prompt tokens, a separator, the sorted tokens (trained), EOS (trained)."""
    rng = np.random.default_rng(seed)
    ex = []
    for _ in range(n):
        a = rng.integers(3, 60, 5).tolist()
        ex.append(([0] + a + [100] + sorted(a) + [1], [0] * 7 + [1] * 6))
    return data.build_dataset(ex, seq_len)


def one_step(model, ds, idx, grad_accum, tc=train.TrainConfig(lr=1e-2, warmup=0), opt=None):
    lo, frozen = train.split_params(model)
    opt = opt or train.make_optimizer(tc)[0]
    step = train.make_train_step(model, opt)
    batch = train.place_batch(train.stack_batch(ds, idx, grad_accum))
    new, opt_state, m = step(lo, opt.init(lo), frozen, batch, jax.random.key(0))
    return new, opt_state, m


def test_grad_accumulation_equals_one_big_batch():
    ds = sort_task()
    # unequal trained-token counts per row would break a naive mean-of-means: make them unequal
    ds.weights[1, :] = 0
    ds.weights[1, 5] = 1
    idx = np.arange(8)
    import optax
    sgd = optax.sgd(1.0)  # new = old - gradient: compares the accumulated gradients themselves
    a, _, ma = one_step(tiny_model(), ds, idx, grad_accum=1, opt=sgd)
    b, _, mb = one_step(tiny_model(), ds, idx, grad_accum=4, opt=sgd)
    np.testing.assert_allclose(float(ma["loss"]), float(mb["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(ma["grad_norm"]), float(mb["grad_norm"]), rtol=1e-5)
    for k in a:
        np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    # (SGD with lr 1 compares the gradients themselves: an update per micro-batch, or a mean of per-micro-batch
    # means, would differ here; clipping and AdamW then see the same gradients and the same norm)
    # and the loss is the plain mean NLL over response tokens of the whole batch
    m = tiny_model()
    lo, frozen = train.split_params(m)
    full = float(train.loss_fn(lo, frozen, {k: jnp.asarray(v) for k, v in ds.take(idx).items()}, model=m))
    np.testing.assert_allclose(float(ma["loss"]), full, rtol=1e-6)


def test_bf16_compute_keeps_float32_lora_and_adam_state():
    new, opt_state, m = one_step(tiny_model(dtype=jnp.bfloat16), sort_task(), np.arange(4), 2)
    assert all(v.dtype == jnp.float32 for v in new.values())
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(opt_state) if x.ndim > 0)
    assert np.isfinite(float(m["loss"]))


def _dot_shapes(hlo: str) -> set:
    import re
    return {tuple(map(int, d.split(","))) for d in re.findall(r"= f32\[([0-9,]+)\]\{[^}]*\} dot\(", hlo)}


def test_only_lora_is_differentiated_no_full_size_gradient_buffers():
    """In the compiled step no matmul produces a frozen kernel's shape (a weight gradient would be
    x^T @ dy of exactly that shape), and the outputs are LoRA-sized; a full fine-tuning step on the
    same model, compiled the same way, has those matmuls -- so the check can fail."""
    m = tiny_model(vocab_size=128, hidden_size=256, intermediate_size=1024)  # layers dominate
    ds = data.build_dataset([([0] + list(range(3, 19)), [0] * 9 + [1] * 8)] * 4, 16)
    lo, frozen = train.split_params(m)
    opt, _ = train.make_optimizer(train.TrainConfig())
    batch = train.place_batch(train.stack_batch(ds, np.arange(4), 1))
    lora_step = train.make_train_step(m, opt).lower(lo, opt.init(lo), frozen, batch, jax.random.key(0)).compile()

    def full_step(params, batch):  # gradient w.r.t. the frozen weights too, for contrast
        mb = {k: v[0] for k, v in batch.items()}
        return jax.grad(lambda p: train.loss_fn(p["lora"], p["frozen"], mb, model=m))(params)
    full = jax.jit(full_step).lower({"lora": lo, "frozen": frozen}, batch).compile()
    rows = batch["tokens"].shape[1] * batch["tokens"].shape[2]
    fused = dict(frozen["layers"])
    if fuses(rows, m.cfg.hidden_size):  # q/k/v and gate/up as one matmul each
        for key, names in FUSED.items():
            fused[key] = jnp.concatenate([fused.pop(n) for n in names], axis=-1)
    kernels = {tuple(v.shape[1:]) for k, v in fused.items() if v.ndim == 3}
    kernels |= {frozen["lm_head"].shape}  # [D, V]
    # a compiler property is the point: which products the compiled step computes
    assert kernels <= _dot_shapes(full.as_text())  # the contrast: weight gradients are dots of these shapes
    assert not kernels & _dot_shapes(lora_step.as_text())
    frozen_bytes = sum(x.nbytes for x in jax.tree.leaves(frozen))
    lora_bytes = sum(x.nbytes for x in jax.tree.leaves(lo))
    assert full.memory_analysis().output_size_in_bytes >= frozen_bytes
    assert lora_step.memory_analysis().output_size_in_bytes < 3 * lora_bytes + 4096  # LoRA + 2 Adam moments


def test_finetune_loss_falls_frozen_bit_identical_metrics_and_adapter(tmp_path, monkeypatch):
    late = [0.0]  # each evaluation moves the loop's clock on by 1000 s: no step's time may include it
    clock, evaluate = time.perf_counter, train_loop.evaluate_loss

    def slow_evaluate(*args, **kwargs):
        late[0] += 1000
        return evaluate(*args, **kwargs)
    monkeypatch.setattr(train_loop.time, "perf_counter", lambda: clock() + late[0])
    monkeypatch.setattr(train_loop, "evaluate_loss", slow_evaluate)
    m = tiny_model()
    rng = np.random.default_rng(0)  # random prompts, one fixed answer: learnable in a few LoRA steps
    ds = data.build_dataset([([0] + rng.integers(3, 60, 6).tolist() + [100, 7, 8, 9, 1], [0] * 8 + [1] * 4)
                             for _ in range(48)], 32)
    before = {k: np.asarray(v).copy() for k, v in jax.tree.leaves_with_path(train.split_params(m)[1])}
    tc = train.TrainConfig(steps=40, batch_size=8, lr=2e-2, warmup=2, eval_every=20, save_every=20, keep=1)
    res = train.finetune(m, ds, tmp_path, tc, eval_ds=ds, progress=False)
    assert np.mean(res["losses"][-5:]) < 0.5 * np.mean(res["losses"][:3])
    after = {k: np.asarray(v) for k, v in jax.tree.leaves_with_path(train.split_params(m)[1])}
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])
    recs = train.read_metrics(tmp_path / "metrics.jsonl")
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 41))
    assert {"step", "loss", "lr", "tokens_per_second", "mfu", "grad_norm"} <= steps[-1].keys()
    assert steps[-1]["tokens_per_second"] > 0 and 0 < steps[-1]["mfu"]
    assert late[0] == 3000 and max(r["step_seconds"] for r in steps) < 1000  # step 21 came after an evaluation
    assert steps[0]["lr"] == 0.0 and steps[2]["lr"] == pytest.approx(2e-2)  # warmup then cosine
    evals = [r for r in recs if r.get("event") == "eval"]
    assert [r["step"] for r in evals] == [0, 20, 40] and evals[-1]["eval_loss"] < evals[0]["eval_loss"] + 0.5
    assert [p.name for p in train.list_checkpoints(tmp_path)] == ["step_000040"]  # keep=1
    loaded = peft.load_adapter(tiny_model(seed=0), tmp_path)
    tokens = jnp.asarray(ds.tokens[:2])
    np.testing.assert_allclose(np.asarray(loaded(tokens)[0]), np.asarray(m(tokens)[0]), atol=1e-5)
    fig = train.plot_loss(tmp_path / "metrics.jsonl")
    assert len(fig.axes[0].lines) == 2


def test_resume_matches_uninterrupted_run(tmp_path):
    ds = sort_task()
    tc = train.TrainConfig(steps=6, batch_size=4, grad_accum=2, lr=1e-2, warmup=1, save_every=3, keep=5)
    full = train.finetune(tiny_model(rank=2), ds, tmp_path / "a", tc, progress=False)
    # an interrupted run: the state it had written at step 3 (its metrics file already went further)
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_000003", tmp_path / "b" / "checkpoints" / "step_000003")
    shutil.copy(tmp_path / "a" / "metrics.jsonl", tmp_path / "b" / "metrics.jsonl")
    with pytest.raises(train.TrainingError, match="holds checkpoints of an earlier run"):
        train.finetune(tiny_model(rank=2), ds, tmp_path / "b", tc, progress=False)
    with pytest.raises(train.TrainingError, match=r"different lr.*'lr': \(0.01, 0.02\)"):
        train.finetune(tiny_model(rank=2), ds, tmp_path / "b", train.TrainConfig(**{**tc.__dict__, "lr": 2e-2}),
                       resume=True, progress=False)
    resumed = train.finetune(tiny_model(rank=2, lora_seed=7), ds, tmp_path / "b", tc, resume=True, progress=False)
    assert resumed["resumed_from"] == 3
    np.testing.assert_allclose(resumed["losses"], full["losses"][3:], rtol=0, atol=1e-6)
    la = [r["loss"] for r in train.read_metrics(tmp_path / "a" / "metrics.jsonl")]
    lb = [r["loss"] for r in train.read_metrics(tmp_path / "b" / "metrics.jsonl")]
    assert len(lb) == 6 and np.allclose(la, lb, atol=1e-6)


def test_sharded_step_on_8_devices_equals_one_device():
    from amdllm.parallel.sharding import make_mesh, shard_model
    assert jax.device_count() == 8
    ds = sort_task()
    idx = np.arange(8)
    a, _, ma = one_step(tiny_model(), ds, idx, grad_accum=1)
    mesh = make_mesh("fsdp=8")
    m = shard_model(tiny_model(), mesh)
    lo, frozen = train.split_params(m)
    assert len(frozen["layers"]["gate_proj"].sharding.device_set) == 8
    opt, _ = train.make_optimizer(train.TrainConfig(lr=1e-2, warmup=0))
    batch = train.place_batch(train.stack_batch(ds, idx, 1), mesh)
    assert len(batch["tokens"].sharding.device_set) == 8
    b, _, mb = train.make_train_step(m, opt)(lo, opt.init(lo), frozen, batch, jax.random.key(0))
    np.testing.assert_allclose(float(mb["loss"]), float(ma["loss"]), rtol=1e-5)
    for k in a:
        np.testing.assert_allclose(np.asarray(b[k]), np.asarray(a[k]), atol=1e-5, err_msg=k)


def test_nan_loss_stops_with_clear_error_and_last_good_checkpoint_intact(tmp_path):
    ds = sort_task(n=64)
    ds.weights[5, 3] = np.nan  # one poisoned row: the loss of the step that draws it is NaN
    bad_step = next(s for s in range(100) if 5 in data.batch_indices(len(ds), s, 4, 0))
    assert bad_step >= 2
    tc = train.TrainConfig(steps=20, batch_size=4, lr=1e-2, save_every=1, keep=2)
    with pytest.raises(train.TrainingError, match=rf"non-finite loss \(nan\).*at step {bad_step + 1}; "
                                                  rf"stopped.*last good checkpoint: .*step_{bad_step:06d}"):
        train.finetune(tiny_model(), ds, tmp_path, tc, progress=False)
    ck = train.list_checkpoints(tmp_path)
    assert ck[-1].name == f"step_{bad_step:06d}"
    from safetensors.numpy import load_file
    assert all(np.isfinite(v).all() for v in load_file(str(ck[-1] / "state.safetensors")).values())
    assert not (tmp_path / "adapter_model.safetensors").exists()


def cli_checkpoint(tmp_path):
    """A tiny HF checkpoint with the course tokenizer, and tmp_path/d.jsonl -> (its directory, the HF model)."""
    from tests.tiny import make_hf_checkpoint
    from amdllm.io.tokenizer import WRITTEN_FILES as TOKENIZER_FILES
    from pathlib import Path
    ckpt, hf = make_hf_checkpoint(tmp_path, vocab_size=1152, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    tok_dir = Path(__file__).resolve().parents[1] / "data" / "tokenizer"
    for f in TOKENIZER_FILES:
        shutil.copy(tok_dir / f, ckpt / f)
    rows = [{"instruction": f"What is {i} plus one?", "output": str(i + 1)} for i in range(12)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ckpt, hf


def test_the_finetune_command_plans_its_step(tmp_path):
    """`amdllm finetune` on one CPU device: XLA's memory for its compiled step stays near the plan's."""
    ckpt, _ = cli_checkpoint(tmp_path)
    r = subprocess.run([sys.executable, "-m", "amdllm.cli", "finetune", "--model", str(ckpt), "--data",
                        str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "out"), "--steps", "2", "--rank", "4",
                        "--batch-size", "4", "--seq-len", "64", "--no-progress", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert "layers/q_proj" in res["frozen_in_step"] and res["compute_dtype"] == "float32"
    assert 0.8 < res["memory"]["xla_bytes_per_device"] / res["memory"]["plan_bytes_per_device"] < 1.25, res["memory"]


def test_cli_finetune_writes_peft_adapter_metrics_and_merged_checkpoint(tmp_path, capsys):
    import torch
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from amdllm import cli
    ckpt, hf = cli_checkpoint(tmp_path)
    out = tmp_path / "out"
    rc = cli.main(["finetune", "--model", str(ckpt), "--data", str(tmp_path / "d.jsonl"), "--out", str(out),
                   "--steps", "3", "--rank", "4", "--targets", "q,v,down", "--batch-size", "4", "--seq-len", "64",
                   "--mesh", "fsdp=1", "--lr", "1e-2", "--merge", "--remat", "auto", "--no-progress", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)  # exactly one JSON object on stdout
    assert res["steps"] == 3 and res["merged_dir"] == str(out / "merged")
    assert res["remat"] == "none"  # auto: it fits without recomputing anything
    assert len(train.read_metrics(out / "metrics.jsonl")) == 3
    # the plan is the run: `amdllm plan` with the same options gives the figure finetune printed beside XLA's
    assert cli.main(["plan", "--model", str(ckpt), "--devices", "1", "--mesh", "fsdp=1", "--accelerator", "cpu",
                     "--device-memory", "16", "--dtype", "float32", "--rank", "4", "--targets", "q,v,down",
                     "--batch-size", "4", "--seq-len", "64", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["total_bytes"] == res["memory"]["plan_bytes_per_device"]
    assert 0.8 < res["memory"]["xla_bytes_per_device"] / planned["total_bytes"] < 1.25, res["memory"]
    # a run the plan says cannot fit is refused before any weight is read
    rc = cli.main(["finetune", "--model", str(ckpt), "--data", str(tmp_path / "d.jsonl"), "--out",
                   str(tmp_path / "nofit"), "--device-memory", "0.001", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "the plan needs" in err and "--device-memory" in err and not (tmp_path / "nofit").exists()
    between = (planned["total_bytes"] + planned["total_bytes_dots"]) / 2 / 1e9  # fits only with --remat dots
    rc = cli.main(["finetune", "--model", str(ckpt), "--data", str(tmp_path / "d.jsonl"), "--out",
                   str(tmp_path / "nofit"), "--device-memory", f"{between:.6f}", "--dtype", "float32", "--rank", "4",
                   "--targets", "q,v,down", "--batch-size", "4", "--seq-len", "64", "--mesh", "fsdp=1",
                   "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "--remat dots would fit" in err and not (tmp_path / "nofit").exists(), err
    tokens = torch.tensor(np.random.default_rng(0).integers(3, 1152, (2, 10)))
    with torch.no_grad():
        base_logits = hf(tokens).logits.numpy()  # before PEFT injects the adapter into `hf` in place
        peft_logits = PeftModel.from_pretrained(hf, str(out)).eval()(tokens).logits.numpy()
        merged = LlamaForCausalLM.from_pretrained(str(out / "merged")).eval()
        merged_logits = merged(tokens).logits.numpy()
    np.testing.assert_allclose(merged_logits, peft_logits, atol=1e-4)
    assert np.abs(peft_logits - base_logits).max() > 1e-4  # training changed it
    # --dtype bfloat16: the frozen base stays bf16 (the merged checkpoint is saved in it), LoRA stays float32
    from safetensors.numpy import load_file
    assert cli.main(["finetune", "--model", str(ckpt), "--data", str(tmp_path / "d.jsonl"), "--out",
                     str(tmp_path / "bf16"), "--steps", "1", "--rank", "4", "--targets", "q", "--batch-size", "4",
                     "--seq-len", "64", "--dtype", "bfloat16", "--mesh", "fsdp=1", "--merge", "--no-progress",
                     "--json"]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "bf16" / "merged" / "config.json").read_text())["dtype"] == "bfloat16"
    assert {str(v.dtype) for v in load_file(str(tmp_path / "bf16" / "adapter_model.safetensors")).values()} == {"float32"}
    # 8 devices, no --mesh: all on fsdp, so a batch of 4 cannot split; one line naming the flags, nothing written
    assert cli.main(["finetune", "--model", str(ckpt), "--data", str(tmp_path / "d.jsonl"), "--out",
                     str(tmp_path / "o3"), "--batch-size", "4", "--no-progress"]) == 2
    assert "--batch-size 4 does not split over the mesh's 8 batch shards" in capsys.readouterr().err
    assert not (tmp_path / "o3").exists()
    assert cli.main(["finetune", "--model", str(ckpt), "--data", str(tmp_path / "d.jsonl"), "--out",
                     str(tmp_path / "o2"), "--targets", "q,zz", "--no-progress"]) == 2
    assert "unknown LoRA target module 'zz'" in capsys.readouterr().err
    # an earlier adapter in --out is replaced only with --overwrite; --out is never the model
    kept = tmp_path / "kept"
    kept.mkdir()
    shutil.copy(out / "adapter_model.safetensors", kept / "adapter_model.safetensors")
    again = ["finetune", "--model", str(ckpt), "--data", str(tmp_path / "d.jsonl"), "--steps", "1", "--rank", "4",
             "--targets", "q", "--batch-size", "4", "--seq-len", "64", "--mesh", "fsdp=1", "--no-progress", "--out"]
    assert cli.main(again + [str(kept)]) == 2
    err = capsys.readouterr().err
    assert f"--out {kept}: exists and is not empty (adapter_model.safetensors); pass --overwrite" in err
    assert (kept / "adapter_model.safetensors").read_bytes() == (out / "adapter_model.safetensors").read_bytes()
    assert cli.main(again + [str(ckpt), "--overwrite"]) == 2 and "is an input" in capsys.readouterr().err
    assert cli.main(again + [str(kept), "--overwrite", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 1
