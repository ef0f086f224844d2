"""LoRA on the stacked Llama: attach, merge, and save/load adapters in PEFT's format.

A LoRA-adapted projection computes  y = x @ W + (alpha / r) * (dropout(x) @ A) @ B  (model.linear).
Here A is [L, in, r] and B is [L, r, out] (one pair per stacked layer, same leading axis as W);
PEFT stores the same factors per layer as lora_A.weight [r, in] and lora_B.weight [out, r]
(nn.Linear layout), so export is a per-layer transpose and nothing else.

Initialisation follows PEFT's default (`init_lora_weights=True`): A as nn.Linear initialises its
[r, in] weight, kaiming_uniform(a=sqrt(5)) i.e. U(-1/sqrt(in), 1/sqrt(in)), and B = 0, so the
adapted model starts exactly equal to the base.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from amdllm.io import atomic_write_bytes, atomic_write_text, read_json
from amdllm.model import PROJECTIONS, Llama, LoRAParam, param_table

ALL_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# PEFT / transformers module path of each projection inside a decoder layer
HF_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)"
                  r"\.lora_([AB])(?:\.default)?\.weight$")


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


def _in_out(model: Llama, name: str) -> tuple[int, int]:
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
               targets=ALL_TARGETS, seed: int = 0) -> Llama:
    """Attach fresh LoRA factors (float32) to `model` in place and return it. Replaces any existing ones."""
    names = normalize_targets(targets)
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"LoRA rank must be a positive integer, got {rank!r}")
    if not 0.0 <= dropout < 1.0:
        raise LoRAError(f"LoRA dropout must be in [0, 1), got {dropout}")
    for name in names:
        d_in, d_out = _in_out(model, name)
        if rank > min(d_in, d_out):
            raise LoRAError(f"LoRA rank {rank} is larger than layer {name} allows: its kernel is "
                            f"[{d_in}, {d_out}], so the rank must be <= {min(d_in, d_out)}")
    remove_lora(model)
    table = param_table(model.cfg)
    key = jax.random.key(seed)
    for i, name in enumerate(names):
        (L, d_in, d_out), (lax_, in_ax, out_ax) = table["layers/" + name]
        bound = 1.0 / math.sqrt(d_in)  # kaiming_uniform(a=sqrt(5)) on an [r, in] weight: gain/sqrt(fan_in)*sqrt(3)
        a = jax.random.uniform(jax.random.fold_in(key, i), (L, d_in, rank), jnp.float32, -bound, bound)
        setattr(model.layers, name + "_lora_a", LoRAParam(a, axes=(lax_, in_ax, "lora_rank")))
        setattr(model.layers, name + "_lora_b",
                LoRAParam(jnp.zeros((L, rank, d_out), jnp.float32), axes=(lax_, "lora_rank", out_ax)))
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


# --------------------------------------------------------------------------------------------------
# PEFT adapter files
# --------------------------------------------------------------------------------------------------
def peft_tensors(model: Llama) -> dict[str, np.ndarray]:
    """Our stacked factors as PEFT's per-layer tensors (float32 numpy)."""
    out = {}
    for name in lora_targets(model):
        a = np.asarray(getattr(model.layers, name + "_lora_a")[...], np.float32)  # [L, in, r]
        b = np.asarray(getattr(model.layers, name + "_lora_b")[...], np.float32)  # [L, r, out]
        for i in range(a.shape[0]):
            base = f"base_model.model.model.layers.{i}.{HF_PARENT[name]}.{name}"
            out[base + ".lora_A.weight"] = np.ascontiguousarray(a[i].T)  # [r, in]
            out[base + ".lora_B.weight"] = np.ascontiguousarray(b[i].T)  # [out, r]
    return out


def save_adapter(model: Llama, out_dir, base_model_dir=None) -> Path:
    """Write OUT/adapter_config.json and OUT/adapter_model.safetensors (PEFT LoRA format), atomically."""
    from safetensors.numpy import save as st_save

    info = lora_info(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": info["rank"], "lora_alpha": info["alpha"],
        "lora_dropout": info["dropout"], "target_modules": list(info["targets"]), "bias": "none",
        "base_model_name_or_path": None if base_model_dir is None else str(base_model_dir),
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None, "layers_to_transform": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }
    atomic_write_bytes(out / "adapter_model.safetensors",
                       st_save(peft_tensors(model), metadata={"format": "pt"}))
    atomic_write_text(out / "adapter_config.json", json.dumps(config, indent=2) + "\n")
    return out


def read_adapter_config(adapter_dir) -> dict:
    path = Path(adapter_dir) / "adapter_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no adapter_config.json (expected a PEFT LoRA adapter directory)")
    cfg = read_json(path, LoRAError)
    def bad(what):
        raise LoRAError(f"{path}: {what}")
    if cfg.get("peft_type") != "LORA":
        bad(f"peft_type is {cfg.get('peft_type')!r}, expected 'LORA'")
    if cfg.get("bias", "none") != "none":
        bad(f"bias is {cfg.get('bias')!r}; only 'none' is supported")
    for key in ("use_dora", "fan_in_fan_out"):
        if cfg.get(key):
            bad(f"{key} is true; amdllm supports plain LoRA only")
    for key in ("rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save"):
        if cfg.get(key):
            bad(f"{key} is set ({cfg[key]!r}); amdllm supports one rank/alpha for all layers")
    tm = cfg.get("target_modules")
    if isinstance(tm, str):
        bad(f"target_modules is a pattern {tm!r}; expected a list of projection names")
    if not tm:
        bad("target_modules is missing or empty")
    try:
        cfg["targets"] = normalize_targets([t.split(".")[-1] for t in tm])
    except LoRAError as e:
        bad(str(e))
    return cfg


def load_adapter(model: Llama, adapter_dir) -> Llama:
    """Attach a PEFT LoRA adapter (ours or one PEFT wrote) to `model` in place and return it."""
    from safetensors.numpy import load_file

    cfg = read_adapter_config(adapter_dir)
    r, alpha = int(cfg["r"]), cfg.get("lora_alpha", 8)
    path = Path(adapter_dir) / "adapter_model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (only safetensors adapters are read; .bin is pickled)")
    tensors = load_file(str(path))
    L = model.cfg.num_hidden_layers
    found: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(f"{path}: tensor {key!r} is not a LoRA factor of a decoder projection")
        i, parent, name, ab = int(m[1]), m[2], m[3], m[4]
        if name not in HF_PARENT or HF_PARENT[name] != parent or name not in cfg["targets"]:
            raise LoRAError(f"{path}: tensor {key!r} is not among target_modules {list(cfg['targets'])}")
        if i >= L:
            raise LoRAError(f"{path}: tensor {key!r} is for layer {i}, the model has {L} layers")
        found.setdefault((name, ab), {})[i] = t
    apply_lora(model, rank=r, alpha=alpha, dropout=float(cfg.get("lora_dropout", 0.0)),
               targets=cfg["targets"])
    if cfg.get("use_rslora"):  # rsLoRA scales by alpha / sqrt(r)
        model.lora_scale = float(alpha) / math.sqrt(r)
    new = {}
    for name in cfg["targets"]:
        d_in, d_out = _in_out(model, name)
        for ab, want in (("A", (r, d_in)), ("B", (d_out, r))):
            layers = found.get((name, ab), {})
            missing = [i for i in range(L) if i not in layers]
            if missing:
                raise LoRAError(f"{path}: no lora_{ab} tensor for {name} in layers {missing}")
            for i in range(L):
                if tuple(layers[i].shape) != want:
                    raise LoRAError(f"{path}: layers.{i}.{HF_PARENT[name]}.{name}.lora_{ab}.weight has "
                                    f"shape {tuple(layers[i].shape)}, expected {want}")
            stacked = np.stack([layers[i].astype(np.float32).T for i in range(L)])  # [L, in, r] / [L, r, out]
            new[f"{name}_lora_{ab.lower()}"] = jnp.asarray(stacked)
    return set_lora_params(model, new)
