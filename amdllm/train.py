"""LoRA fine-tuning: one compiled step, and the loop around it (progress, metrics, eval, checkpoints).

The step (`make_train_step`) is ONE `jax.jit`: K micro-batches run under `lax.scan` (memory of one
micro-batch), gradients are taken with respect to the LoRA factors only (the frozen weights are
arguments of the loss but never differentiated, so no gradient buffer of their size exists), then
global-norm clipping and AdamW (warmup + cosine) run inside the same computation. The LoRA factors and
optimizer state are donated: updated in place. LoRA weights and optimizer state stay float32 whatever
the compute dtype (bf16 on accelerators). With a mesh, parameters and batches carry shardings and the
same function runs sharded (XLA inserts the FSDP all-gathers / reduce-scatters).

Loss normalisation: the step's loss is sum(token NLL * weight) / sum(weight) over the WHOLE batch
(all K micro-batches), so K micro-batches of B rows give the same update as one batch of K*B rows.
A non-finite loss or gradient leaves the parameters untouched and stops the loop with an error.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from amdllm import data as data_mod
from amdllm import lora as lora_mod
from amdllm.io import atomic_write_bytes, atomic_write_text
from amdllm.model import Llama, LoRAParam, forward, token_nll


class TrainingError(ValueError):
    """The run cannot continue (non-finite loss, incompatible resume state); the message says why."""


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    batch_size: int = 8          # rows per micro-batch
    grad_accum: int = 1          # micro-batches per step (scan inside the step)
    seq_len: int = 256
    lr: float = 2e-4
    warmup: int | None = None    # default: 5% of steps (at least 1)
    min_lr_ratio: float = 0.1    # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.0
    clip: float = 1.0            # global gradient-norm clipping
    b1: float = 0.9
    b2: float = 0.999
    seed: int = 0
    log_every: int = 1
    eval_every: int = 0          # 0: only at the end (when eval data is given)
    save_every: int = 0          # 0: only at the end
    keep: int = 2                # checkpoints kept


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    warmup = tc.warmup if tc.warmup is not None else max(1, tc.steps // 20)
    sched = optax.warmup_cosine_decay_schedule(0.0, tc.lr, min(warmup, tc.steps), max(tc.steps, warmup + 1),
                                               end_value=tc.lr * tc.min_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(tc.clip),
                       optax.adamw(sched, b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay)), sched


# --------------------------------------------------------------------------------------------------
# Parameters: LoRA (trained) vs frozen, as pure dicts
# --------------------------------------------------------------------------------------------------
def split_params(model: Llama) -> tuple[dict, dict]:
    """(lora, frozen): `nnx.split` by type, so only LoRAParam leaves are ever differentiated."""
    _, lora_state, frozen_state = nnx.split(model, LoRAParam, nnx.Param)
    lora = nnx.to_pure_dict(lora_state).get("layers", {})
    if not lora:
        raise TrainingError("the model has no LoRA parameters: call amdllm.lora.apply_lora first")
    return lora, nnx.to_pure_dict(frozen_state)


def loss_sums(lora, frozen, batch, rng, *, model: Llama):
    """(sum of weighted token NLL, sum of weights) for one micro-batch; batch leaves [B, T]."""
    top = {k: v for k, v in frozen.items() if k != "layers"}
    layers = {**frozen["layers"], **lora}
    logits, _ = forward(model.cfg, top, layers, batch["tokens"], positions=batch["positions"],
                        segment_ids=batch["segment_ids"], dtype=model.dtype, remat=model.remat,
                        lora_scale=model.lora_scale, lora_dropout=model.lora_dropout,
                        dropout_rng=rng if model.lora_dropout > 0 else None,
                        act_sharding=getattr(model, "act_sharding", None))  # [B, T, V] float32
    nll = token_nll(logits, batch["targets"])  # [B, T]; its backward is one pass over [B, T, V]
    w = batch["weights"].astype(jnp.float32)
    return jnp.sum(nll * w), jnp.sum(w)


def loss_fn(lora, frozen, batch, rng=None, *, model: Llama):
    """Mean NLL over response tokens of one [B, T] batch (what the step minimises)."""
    s, n = loss_sums(lora, frozen, batch, rng, model=model)
    return s / jnp.maximum(n, 1.0)


def make_train_step(model: Llama, optimizer: optax.GradientTransformation):
    """jit(step)(lora, opt_state, frozen, batch [K, B, T] leaves, rng) -> (lora, opt_state, metrics).

    lora and opt_state are donated. The compiled function is cached by jit per shapes/shardings.
    """
    sums = partial(loss_sums, model=model)

    def step(lora, opt_state, frozen, batch, rng):
        K = batch["tokens"].shape[0]
        total_w = jnp.maximum(jnp.sum(batch["weights"].astype(jnp.float32)), 1.0)

        def micro(carry, xs):  # one micro-batch: forward + backward w.r.t. LoRA only
            g_acc, l_acc = carry
            mb, k = xs
            (s, _), g = jax.value_and_grad(sums, has_aux=True)(lora, frozen, mb, jax.random.fold_in(rng, k))
            return (jax.tree.map(jnp.add, g_acc, g), l_acc + s), None

        zeros = jax.tree.map(jnp.zeros_like, lora)
        (g, lsum), _ = jax.lax.scan(micro, (zeros, jnp.zeros((), jnp.float32)), (batch, jnp.arange(K)))
        grads = jax.tree.map(lambda x: x / total_w, g)
        loss = lsum / total_w
        gnorm = optax.global_norm(grads)
        updates, new_opt = optimizer.update(grads, opt_state, lora)
        new_lora = optax.apply_updates(lora, updates)
        ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)  # a bad step changes nothing
        keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
        new_lora, new_opt = jax.tree.map(keep, new_lora, lora), jax.tree.map(keep, new_opt, opt_state)
        return new_lora, new_opt, {"loss": loss, "grad_norm": gnorm, "ok": ok, "weight": total_w}

    return jax.jit(step, donate_argnums=(0, 1), compiler_options=train_compiler_options())


def train_compiler_options() -> dict | None:
    """XLA options for the training step: on the CPU, dots go to Eigen rather than YNNPACK fusions.

    Same-process A/B on the 31M benchmark step (batch 8 x 256, LoRA r8 on all projections), 14
    timed steps per side: 3.67 -> 3.36 s (1.09x); two shorter runs gave 1.07x and 1.02-1.07x. The
    numbers are the same (equal first-step loss). Nothing changes on accelerators."""
    return {"xla_cpu_experimental_ynn_fusion_type": ""} if jax.default_backend() == "cpu" else None


def make_eval_step(model: Llama):
    """jit(eval)(lora, frozen, batch [B, T] leaves) -> (sum NLL, sum weights)."""
    return jax.jit(lambda lora, frozen, batch: loss_sums(lora, frozen, batch, None, model=model))


def stack_batch(ds: data_mod.Dataset, idx: np.ndarray, grad_accum: int) -> dict:
    """Rows `idx` as [K, B, T] arrays (micro-batch k = rows k*B..(k+1)*B)."""
    b = ds.take(idx)
    return {k: v.reshape(grad_accum, -1, v.shape[-1]) for k, v in b.items()}


def place_batch(batch: dict, mesh=None, rules=None) -> dict:
    if mesh is None:
        return {k: jnp.asarray(v) for k, v in batch.items()}
    from jax.sharding import NamedSharding, PartitionSpec as P
    from amdllm.sharding import batch_sharding
    spec = batch_sharding(mesh, rules, 2).spec  # (batch axes, None) for [B, T]
    sh = NamedSharding(mesh, P(None, *spec))    # [K, B, T]: micro-batch axis whole, rows split
    return {k: jax.device_put(v, sh) for k, v in batch.items()}


def evaluate_loss(model: Llama, lora, frozen, ds: data_mod.Dataset, batch_size: int, eval_step=None,
                  mesh=None, rules=None) -> float:
    """Mean NLL over all response tokens of `ds` (last batch padded with zero-weight rows)."""
    eval_step = eval_step or make_eval_step(model)
    s = n = 0.0
    for start in range(0, len(ds), batch_size):
        idx = np.arange(start, start + batch_size) % len(ds)
        b = ds.take(idx)
        b["weights"] = b["weights"] * (np.arange(start, start + batch_size) < len(ds))[:, None]
        b = place_batch({k: v[None] for k, v in b.items()}, mesh, rules)
        ds_, dn = eval_step(lora, frozen, {k: v[0] for k, v in b.items()})
        s, n = s + float(ds_), n + float(dn)
    return s / max(n, 1.0)


# --------------------------------------------------------------------------------------------------
# Checkpoints: OUT/checkpoints/step_000123/{state.safetensors, state.json}, renamed into place
# --------------------------------------------------------------------------------------------------
def _ckpt_dir(out: Path) -> Path:
    return out / "checkpoints"


def list_checkpoints(out) -> list[Path]:
    d = _ckpt_dir(Path(out))
    found = [p for p in d.glob("step_*") if p.is_dir() and (p / "state.json").is_file()] if d.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def save_checkpoint(out, step: int, lora: dict, opt_state, meta: dict, keep: int) -> Path:
    """Write the resumable state as a directory renamed into place (a crash never leaves half of one)."""
    from safetensors.numpy import save as st_save
    final = _ckpt_dir(Path(out)) / f"step_{step:06d}"
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {f"lora/{k}": np.asarray(v) for k, v in lora.items()}
    tensors.update({f"opt/{i:05d}": np.asarray(v) for i, v in enumerate(jax.tree.leaves(opt_state))})
    atomic_write_bytes(tmp / "state.safetensors", st_save(tensors))
    atomic_write_text(tmp / "state.json", json.dumps({**meta, "step": step}, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(out)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, lora_template: dict, opt_template) -> tuple[dict, object, dict]:
    from safetensors.numpy import load_file
    t = load_file(str(path / "state.safetensors"))
    meta = json.loads((path / "state.json").read_text())
    lora = {}
    for k, v in lora_template.items():
        if f"lora/{k}" not in t or t[f"lora/{k}"].shape != v.shape:
            raise TrainingError(f"{path}: LoRA tensor {k} missing or of another shape; the checkpoint "
                                "was written with other LoRA settings")
        lora[k] = jnp.asarray(t[f"lora/{k}"])
    leaves, treedef = jax.tree.flatten(opt_template)
    opt = [jnp.asarray(t[f"opt/{i:05d}"]) for i in range(len(leaves)) if f"opt/{i:05d}" in t]
    if len(opt) != len(leaves) or any(a.shape != b.shape for a, b in zip(opt, leaves)):
        raise TrainingError(f"{path}: optimizer state does not match this optimizer")
    return lora, jax.tree.unflatten(treedef, opt), meta


def _same_sharding(new: dict, like: dict) -> dict:
    return jax.tree.map(lambda n, o: jax.device_put(n, o.sharding), new, like)


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------
RESUME_KEYS = ("steps", "batch_size", "grad_accum", "seq_len", "lr", "warmup", "min_lr_ratio",
               "weight_decay", "clip", "b1", "b2", "seed")


def finetune(model: Llama, train_ds: data_mod.Dataset, out_dir, tc: TrainConfig = TrainConfig(), *,
             eval_ds: data_mod.Dataset | None = None, tokenizer=None, task_rows=None, task_group_by=None,
             mesh=None, rules=None, resume: bool = False, progress: bool = True, base_model_dir=None) -> dict:
    """Train the LoRA factors already attached to `model` (in place); write the adapter to `out_dir`.
    Evaluations score `task_rows` by exact match (per group too with `task_group_by`, see `task_accuracy`).

    Metrics go to OUT/metrics.jsonl (one line per logged step, and one per evaluation), checkpoints to
    OUT/checkpoints/. Returns a summary dict (losses, evals, throughput, paths).
    """
    from tqdm.auto import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if mesh is not None:
        from amdllm.sharding import shard_model
        shard_model(model, mesh, rules)
    lora, frozen = split_params(model)
    optimizer, schedule = make_optimizer(tc)
    opt_state = optimizer.init(lora)
    global_batch = tc.batch_size * tc.grad_accum
    n_dev = 1 if mesh is None else mesh.size
    info = lora_mod.lora_info(model)
    meta = {"train_config": asdict(tc), "lora": {**info, "targets": list(info["targets"])},
            "data": {"rows": len(train_ds), **train_ds.stats}}
    start, metrics_lines = 0, []
    metrics_path = out / "metrics.jsonl"
    if resume and list_checkpoints(out):
        last = list_checkpoints(out)[-1]
        lora, opt_state, saved = load_checkpoint(last, lora, opt_state)
        diff = {k: (saved["train_config"].get(k), getattr(tc, k)) for k in RESUME_KEYS
                if saved["train_config"].get(k) != getattr(tc, k)}
        if diff or saved["lora"] != meta["lora"] or saved["data"]["rows"] != len(train_ds):
            raise TrainingError(f"{last}: cannot resume with different settings {diff or 'LoRA/data'}; "
                                "resume needs the same data, LoRA and training settings (saved, new)")
        start = saved["step"]
        if metrics_path.is_file():  # drop lines logged after the checkpoint: they will be redone
            metrics_lines = [l for l in metrics_path.read_text().splitlines()
                             if l.strip() and json.loads(l).get("step", 0) <= start]
    elif list_checkpoints(out) and not resume:
        raise TrainingError(f"{out}: holds checkpoints of an earlier run; pass resume=True (--resume) "
                            "or use a fresh output directory")
    if mesh is not None:
        lora = _same_sharding(lora, split_params(model)[0])
    step_fn = make_train_step(model, optimizer)
    eval_step = make_eval_step(model)
    fpt = flops_per_token(model.cfg, info, tc.seq_len)
    peak = peak_flops() * n_dev
    key = jax.random.key(tc.seed)
    evals, losses, last_ckpt = [], [], (list_checkpoints(out) or [None])[-1]

    def write_metrics():
        atomic_write_text(metrics_path, "".join(l + "\n" for l in metrics_lines))

    def run_eval(step):
        rec = {"step": step, "event": "eval"}
        set_lora_copy(model, lora)
        if eval_ds is not None:
            rec["eval_loss"] = evaluate_loss(model, lora, frozen, eval_ds, tc.batch_size, eval_step, mesh, rules)
        if task_rows and tokenizer is not None:
            rec.update(task_accuracy(model, tokenizer, task_rows, group_by=task_group_by))
        evals.append(rec)
        metrics_lines.append(json.dumps(rec))
        write_metrics()
        return rec

    def checkpoint(step):
        nonlocal last_ckpt
        last_ckpt = save_checkpoint(out, step, lora, opt_state, meta, tc.keep)

    if start == 0 and (eval_ds is not None or task_rows):
        run_eval(0)  # the "before" numbers: base model (B = 0, so the adapter is a no-op)
    bar = tqdm(range(start, tc.steps), initial=start, total=tc.steps, desc="finetune", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    tok_s = mfu = 0.0
    t_prev = time.perf_counter()
    for step in bar:
        idx = data_mod.batch_indices(len(train_ds), step, global_batch, tc.seed)
        batch = place_batch(stack_batch(train_ds, idx, tc.grad_accum), mesh, rules)
        lora, opt_state, m = step_fn(lora, opt_state, frozen, batch, jax.random.fold_in(key, step))
        loss = float(m["loss"])  # waits for the step; also the NaN check
        now = time.perf_counter()
        dt, t_prev = now - t_prev, now
        if not bool(m["ok"]):
            write_metrics()
            where = f"last good checkpoint: {last_ckpt}" if last_ckpt else "no checkpoint was written yet"
            raise TrainingError(f"non-finite loss ({loss}) or gradient norm ({float(m['grad_norm'])}) at step "
                                f"{step + 1}; stopped without applying it ({where})")
        positions = global_batch * tc.seq_len
        if step > start:  # the first step includes compilation
            tok_s = positions / dt
            mfu = fpt * tok_s / peak if peak else 0.0
        losses.append(loss)
        n = step + 1
        if n % tc.log_every == 0 or n == tc.steps:
            metrics_lines.append(json.dumps({
                "step": n, "loss": loss, "lr": float(schedule(step)), "grad_norm": float(m["grad_norm"]),
                "tokens_per_second": tok_s, "mfu": mfu, "trained_tokens": float(m["weight"]),
                "step_seconds": dt, "epoch": data_mod.cursor(len(train_ds), n, global_batch)["epoch"]}))
            write_metrics()
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}", mfu=f"{100 * mfu:.1f}%")
        if tc.eval_every and n % tc.eval_every == 0 and n < tc.steps:
            run_eval(n)
        if tc.save_every and n % tc.save_every == 0 and n < tc.steps:
            meta["cursor"] = data_mod.cursor(len(train_ds), n, global_batch)
            checkpoint(n)
    bar.close()
    meta["cursor"] = data_mod.cursor(len(train_ds), tc.steps, global_batch)
    if start < tc.steps:
        checkpoint(tc.steps)
    final_eval = run_eval(tc.steps) if (eval_ds is not None or task_rows) else None
    set_lora_copy(model, lora)
    lora_mod.save_adapter(model, out, base_model_dir=base_model_dir)
    write_metrics()
    return {"steps": tc.steps, "resumed_from": start, "losses": losses,
            "final_loss": losses[-1] if losses else None, "eval": final_eval, "evals": evals,
            "tokens_per_second": tok_s, "mfu": mfu, "flops_per_token": fpt, "peak_flops": peak,
            "adapter_dir": str(out), "metrics": str(metrics_path), "checkpoint": str(last_ckpt),
            "data": train_ds.stats}


def set_lora_copy(model: Llama, lora: dict) -> None:
    """Write copies into the model (the live buffers are donated to the next step)."""
    lora_mod.set_lora_params(model, {k: jnp.array(v, copy=True) for k, v in lora.items()})


# --------------------------------------------------------------------------------------------------
# FLOPs, peak and MFU
# --------------------------------------------------------------------------------------------------
def flops_per_token(cfg, lora: dict, seq_len: int) -> float:
    """The planner's LoRA training count (amdllm.plan): 4N + 12*L*S*q + 6*L*r*sum(in+out) per token.

    4N = frozen matmuls forward (2N) + activation gradients (2N); the frozen weights get NO weight
    gradients, so it is not the 6N of full training. Attention counts the full S x S scores.
    """
    from amdllm import plan
    return float(plan.flops_per_token(cfg, seq_len, lora["rank"], lora["targets"])["lora_train"])


def accelerator_name(device=None) -> str:
    """jax device -> the planner's table key ('mi300x', 'h100', 'tpu-v5e', ...) or 'cpu'."""
    from amdllm import plan
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return "cpu"
    kind = device.device_kind.lower().replace(" ", "").replace("lite", "e")
    for key in plan.PEAK_BF16_TFLOPS:
        if key.replace("-", "") in kind:
            return key
    return "unknown"


def peak_flops(device=None) -> float:
    """Peak FLOP/s of one device: $AMDLLM_PEAK_FLOPS, else the planner's table (dense bf16 peak), else on a
    CPU the measured float32 matmul rate (what this machine can do), else 0 (MFU not reported)."""
    if os.environ.get("AMDLLM_PEAK_FLOPS"):
        return float(os.environ["AMDLLM_PEAK_FLOPS"])
    from amdllm import plan
    name = accelerator_name(device)
    return 0.0 if name == "unknown" else plan.peak_flops(name)


# --------------------------------------------------------------------------------------------------
# Task accuracy and the loss curve
# --------------------------------------------------------------------------------------------------


# Reporting lives in amdllm/train_report.py; re-exported here, where notebooks and scripts look for it.
from amdllm.train_report import plot_loss, read_metrics, task_accuracy  # noqa: E402,F401
