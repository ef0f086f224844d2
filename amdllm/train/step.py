"""One compiled training step and its evaluation twin: LoRA fine-tuning (`finetune`) and, with `full=True`,
pretraining the default model (`amdllm.course.default_model`).

`make_train_step` is one `jax.jit`: K micro-batches under `lax.scan`, gradients of the trained parameters
only (the frozen base is never differentiated), clipping and AdamW inside, the trained state donated.
The loss is sum(NLL * weight) / sum(weight) over the whole batch, so K micro-batches of B rows equal one
batch of K*B rows. A non-finite loss or gradient leaves the parameters untouched."""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from amdllm.model import Llama, LoRAParam, forward, to_pure
from amdllm.model.loss import token_nll
import amdllm.parallel.plan as plan
from amdllm.parallel.sharding import batch_sharding, put
import amdllm.train.data as data_mod


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


def make_optimizer(tc: TrainConfig, decay_mask=None) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Global-norm clipping, then AdamW with warmup + cosine. decay_mask: a pytree of bools like the
    trained parameters (True: apply weight decay), or None for all of them."""
    warmup = tc.warmup if tc.warmup is not None else max(1, tc.steps // 20)
    sched = optax.warmup_cosine_decay_schedule(0.0, tc.lr, min(warmup, tc.steps), max(tc.steps, warmup + 1),
                                               end_value=tc.lr * tc.min_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(tc.clip),
                       optax.adamw(sched, b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay,
                                   mask=decay_mask)), sched


def init_opt_state(optimizer: optax.GradientTransformation, trained):
    """optimizer.init(trained), with each moment split like the parameter it follows and the step count
    replicated, when the parameters live on a mesh: created in place, on one process or several."""
    first = jax.tree.leaves(trained)[0]
    if not isinstance(getattr(first, "sharding", None), NamedSharding):
        return optimizer.init(trained)
    replicated = NamedSharding(first.sharding.mesh, P())
    shardings = optax.tree_map_params(optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, trained),
                                      jax.tree.map(lambda x: x.sharding, trained),
                                      transform_non_params=lambda _: replicated)
    return jax.jit(optimizer.init, out_shardings=shardings)(trained)


# --------------------------------------------------------------------------------------------------
# Parameters: trained (LoRA factors, or everything) vs frozen, as pure dicts
# --------------------------------------------------------------------------------------------------
def split_params(model: Llama, full: bool = False) -> tuple[dict, dict]:
    """(trained, frozen). LoRA: the LoRAParam leaves of the layers (`nnx.split` by type, so only they are
    ever differentiated) and all other weights. full: {"top", "layers"} of every weight, nothing frozen."""
    if full:
        top, layers = to_pure(model)
        return {"top": top, "layers": layers}, {}
    # frozen: every other variable, the base's Params and a GPTQ base's packed tensors (QLoRA)
    _, lora_state, frozen_state = nnx.split(model, LoRAParam, ...)
    lora = nnx.to_pure_dict(lora_state).get("layers", {})
    if not lora:
        raise TrainingError("the model has no LoRA parameters: call amdllm.model.lora.apply_lora first")
    return lora, nnx.to_pure_dict(frozen_state)


def top_and_layers(trained, frozen, full: bool = False) -> tuple[dict, dict]:
    """The (top, layers) that `forward` takes, from the trained and the frozen parameters."""
    if full:
        return trained["top"], trained["layers"]
    top, layers = {k: v for k, v in frozen.items() if k != "layers"}, frozen["layers"]
    return top, {**layers, **trained}


def loss_sums(trained, frozen, batch, rng, *, model: Llama, full: bool = False):
    """(sum of weighted token NLL, sum of weights) for one micro-batch; batch leaves [B, T]."""
    top, layers = top_and_layers(trained, frozen, full)
    run = model.run()
    logits, _ = forward(model.cfg, top, layers, batch["tokens"], positions=batch["positions"],
                        segment_ids=batch["segment_ids"], run=run,
                        dropout_rng=rng if model.lora_dropout > 0 else None)  # [B, T, V] float32
    nll = token_nll(logits, batch["targets"])  # [B, T]; its backward is one pass over [B, T, V]
    w = batch["weights"].astype(jnp.float32)
    return jnp.sum(nll * w), jnp.sum(w)


def loss_fn(trained, frozen, batch, rng=None, *, model: Llama, full: bool = False):
    """Mean NLL over response tokens of one [B, T] batch (what the step minimises)."""
    s, n = loss_sums(trained, frozen, batch, rng, model=model, full=full)
    return s / jnp.maximum(n, 1.0)


def make_train_step(model: Llama, optimizer: optax.GradientTransformation, full: bool = False):
    """jit(step)(trained, opt_state, frozen, batch [K, B, T] leaves, rng) -> (trained, opt_state, metrics).

    trained and opt_state are donated. The compiled function is cached by jit per shapes/shardings.
    """
    sums = partial(loss_sums, model=model, full=full)

    def step(trained, opt_state, frozen, batch, rng):
        K = batch["tokens"].shape[0]
        total_w = jnp.maximum(jnp.sum(batch["weights"].astype(jnp.float32)), 1.0)

        def micro(carry, xs):  # one micro-batch: forward + backward w.r.t. the trained parameters only
            g_acc, l_acc = carry
            mb, k = xs
            # the micro-batch's share of the whole batch's mean, so K micro-batches of B rows give
            # one batch of K*B rows
            mean_part = lambda *a: (lambda s, n: (s / total_w, s))(*sums(*a))  # noqa: E731
            (_, s), g = jax.value_and_grad(mean_part, has_aux=True)(trained, frozen, mb, jax.random.fold_in(rng, k))
            return (jax.tree.map(jnp.add, g_acc, g), l_acc + s), None

        zeros = jax.tree.map(jnp.zeros_like, trained)
        (grads, lsum), _ = jax.lax.scan(micro, (zeros, jnp.zeros((), jnp.float32)), (batch, jnp.arange(K)))
        loss = lsum / total_w
        gnorm = optax.global_norm(grads)
        updates, new_opt = optimizer.update(grads, opt_state, trained)
        new_trained = optax.apply_updates(trained, updates)
        unorm = optax.global_norm(updates)  # finite gradients can still give an update that overflows (--lr)
        ok = jnp.isfinite(loss) & jnp.isfinite(gnorm) & jnp.isfinite(unorm)  # a bad step changes nothing
        keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
        new_trained, new_opt = jax.tree.map(keep, new_trained, trained), jax.tree.map(keep, new_opt, opt_state)
        return new_trained, new_opt, {"loss": loss, "grad_norm": gnorm, "update_norm": unorm, "ok": ok,
                                           "weight": total_w}

    return jax.jit(step, donate_argnums=(0, 1))


def make_eval_step(model: Llama):
    """jit(eval)(lora, frozen, batch [B, T] leaves) -> (sum NLL, sum weights)."""
    return jax.jit(lambda lora, frozen, batch: loss_sums(lora, frozen, batch, None, model=model))


def stack_batch(ds: data_mod.Dataset, idx: np.ndarray, grad_accum: int) -> dict:
    """Rows `idx` as [K, B, T] arrays (micro-batch k = rows k*B..(k+1)*B)."""
    b = ds.take(idx)
    return {k: v.reshape(grad_accum, -1, v.shape[-1]) for k, v in b.items()}


def place_batch(batch: dict, mesh=None, rules=None) -> dict:
    """[K, B, T] host arrays on the devices: with a mesh, rows split over its batch axes, and each process
    transfers only the rows its own devices hold (one process or several)."""
    if mesh is None:
        return {k: jnp.asarray(v) for k, v in batch.items()}
    spec = batch_sharding(mesh, rules, 2).spec  # (batch axes, None) for [B, T]
    sh = NamedSharding(mesh, P(None, *spec))    # [K, B, T]: micro-batch axis whole, rows split
    return {k: put(v, sh) for k, v in batch.items()}


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
# FLOPs, peak and MFU
# --------------------------------------------------------------------------------------------------
def flops_per_token(cfg, lora: dict, seq_len: int) -> float:
    """The planner's LoRA training count (amdllm.parallel.plan): 4N + 12*L*S*q + 6*L*r*sum(in+out) per token.

    4N = frozen matmuls forward (2N) + activation gradients (2N); the frozen weights get NO weight
    gradients, so it is not the 6N of full training. Attention counts the full S x S scores.
    """
    return float(plan.flops_per_token(cfg, seq_len, lora["rank"], lora["targets"])["lora_train"])


def accelerator_name(device=None) -> str:
    """jax device -> the planner's table key ('mi300x', 'h100', 'tpu-v5e', ...) or 'cpu'."""
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
    CPU the measured matmul rate (`plan.measure_cpu_flops`: what this machine can do), else 0 (MFU not reported)."""
    if os.environ.get("AMDLLM_PEAK_FLOPS"):
        return float(os.environ["AMDLLM_PEAK_FLOPS"])
    name = accelerator_name(device)
    return 0.0 if name == "unknown" else plan.peak_flops(name)
