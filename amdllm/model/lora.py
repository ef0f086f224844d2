"""LoRA on the stacked Llama: attach fresh factors, read and set them, merge them into the weights.

A LoRA-adapted projection computes  y = x @ W + (alpha / r) * (dropout(x) @ A) @ B  (`layers.linear`),
A [L, in, r] and B [L, r, out]; PEFT stores per layer lora_A.weight [r, in] and lora_B.weight [out, r],
so export is a transpose (amdllm.io.peft). Initialisation is PEFT's default: A as nn.Linear initialises
its weight, B = 0, so the adapted model starts exactly equal to the base."""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from amdllm.model.inputs import expect_model
from amdllm.model.llama import PROJECTIONS, Llama, LoRAParam, param_table

ALL_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


class LoRAError(ValueError):
    """A LoRA setting or adapter file that cannot be used; the message names it and what was expected."""


def normalize_targets(targets) -> tuple[str, ...]:
    """'q,k,v' or ['q_proj', 'gate'] -> ('q_proj', 'k_proj', ...) in the model's order."""
    if isinstance(targets, str):
        targets = [t for t in targets.split(",") if t.strip()]
    out = []
    for t in targets:
        name = t.strip()
        name = name if name.endswith("_proj") else name + "_proj"
        if name not in PROJECTIONS:
            raise LoRAError(f"unknown LoRA target module {t!r}; expected some of "
                            f"{','.join(ALL_TARGETS)} (or their *_proj names)")
        out.append(name)
    if not out:
        raise LoRAError("no LoRA target modules given; expected some of " + ",".join(ALL_TARGETS))
    return tuple(p for p in PROJECTIONS if p in out)


def in_out(model: Llama, name: str) -> tuple[int, int]:
    shape, _ = param_table(model.cfg)["layers/" + name]
    return shape[1], shape[2]


def lora_targets(model: Llama) -> tuple[str, ...]:
    return tuple(p for p in PROJECTIONS if hasattr(model.layers, p + "_lora_a"))


def lora_info(model: Llama) -> dict:
    """rank, alpha, dropout, targets of the attached adapter (derived from the parameters themselves)."""
    targets = lora_targets(model)
    if not targets:
        raise LoRAError("the model has no LoRA parameters (call apply_lora or load_adapter first)")
    r = int(getattr(model.layers, targets[0] + "_lora_a").shape[-1])
    alpha = model.lora_scale * r
    alpha = int(round(alpha)) if abs(alpha - round(alpha)) < 1e-6 else alpha
    return {"rank": r, "alpha": alpha, "dropout": float(model.lora_dropout), "targets": targets}


def remove_lora(model: Llama) -> Llama:
    for p in lora_targets(model):
        delattr(model.layers, p + "_lora_a")
        delattr(model.layers, p + "_lora_b")
    model.lora_scale, model.lora_dropout = 0.0, 0.0
    return model


def apply_lora(model: Llama, rank: int = 8, alpha: float = 16, dropout: float = 0.0,
               targets=ALL_TARGETS, seed: int = 0, place=None) -> Llama:
    """Attach fresh LoRA factors (float32) to `model` in place and return it. Replaces any existing ones.

    place: (name, shape, logical axes) -> a jax Sharding (`amdllm.parallel.sharding.placement(mesh, rules)`):
    each factor is then created already split over the mesh, every device drawing only its block. The
    values do not depend on it (JAX's random bits are the same however the array is split)."""
    expect_model(model, "apply_lora")
    names = normalize_targets(targets)
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"LoRA rank must be a positive integer, got {rank!r}")
    if not 0.0 <= dropout < 1.0:
        raise LoRAError(f"LoRA dropout must be in [0, 1), got {dropout}")
    for name in names:
        d_in, d_out = in_out(model, name)
        if rank > min(d_in, d_out):
            raise LoRAError(f"LoRA rank {rank} is larger than layer {name} allows: its kernel is "
                            f"[{d_in}, {d_out}], so the rank must be <= {min(d_in, d_out)}")
    remove_lora(model)
    table = param_table(model.cfg)
    key = jax.random.key(seed)
    for i, name in enumerate(names):
        (L, d_in, d_out), (lax_, in_ax, out_ax) = table["layers/" + name]
        bound = 1.0 / math.sqrt(d_in)  # kaiming_uniform(a=sqrt(5)) on an [r, in] weight: gain/sqrt(fan_in)*sqrt(3)
        shape_a, axes_a = (L, d_in, rank), (lax_, in_ax, "lora_rank")
        shape_b, axes_b = (L, rank, d_out), (lax_, "lora_rank", out_ax)
        draw = partial(jax.random.uniform, jax.random.fold_in(key, i), shape_a, jnp.float32, -bound, bound)
        zeros = partial(jnp.zeros, shape_b, jnp.float32)
        if place is not None:
            draw = jax.jit(draw, out_shardings=place(f"layers/{name}_lora_a", shape_a, axes_a))
            zeros = jax.jit(zeros, out_shardings=place(f"layers/{name}_lora_b", shape_b, axes_b))
        setattr(model.layers, name + "_lora_a", LoRAParam(draw(), axes=axes_a))
        setattr(model.layers, name + "_lora_b", LoRAParam(zeros(), axes=axes_b))
    model.lora_scale = float(alpha) / rank
    model.lora_dropout = float(dropout)
    return model


def lora_params(model: Llama) -> dict:
    """{'q_proj_lora_a': [L, in, r], ...}: the trainable state as a pure dict."""
    return {k: v for k, v in nnx.to_pure_dict(nnx.state(model.layers, LoRAParam)).items()}


def set_lora_params(model: Llama, params: dict) -> Llama:
    for k, v in params.items():
        var = getattr(model.layers, k)
        if tuple(var.shape) != tuple(v.shape):
            raise LoRAError(f"LoRA tensor {k}: shape {tuple(v.shape)}, model expects {tuple(var.shape)}")
        var.value = v
    return model


def merge_lora(model: Llama) -> Llama:
    """A new plain model with W <- W + (alpha/r) * A @ B (computed in float32, stored in W's dtype)."""
    expect_model(model, "merge_lora")
    targets = lora_targets(model)
    merged = nnx.clone(model)
    for name in targets:
        w = getattr(merged.layers, name)
        if not isinstance(w, nnx.Variable):  # a GPTQ projection is a dict of packed tensors
            raise LoRAError(f"cannot merge LoRA into {name}: it is quantized; merge into the "
                            "full-precision base and quantize the merged model instead")
        a = getattr(model.layers, name + "_lora_a")[...]
        b = getattr(model.layers, name + "_lora_b")[...]
        delta = model.lora_scale * jnp.einsum("lir,lro->lio", a, b, precision="highest")  # [L, in, out]
        w.value = (w[...].astype(jnp.float32) + delta).astype(w.dtype)
    return remove_lora(merged)
