"""LoRA adapters on disk in PEFT's format: what `peft.PeftModel.from_pretrained` reads, and what it writes.

adapter_config.json (peft_type LORA, r, lora_alpha, lora_dropout, target_modules, bias none) and
adapter_model.safetensors with per-layer `base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight`
[r, in] and `lora_B.weight` [out, r] (docs/formats.md). Our factors are stacked [L, in, r] / [L, r, out]:
saving and loading transpose per layer.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save as st_save

from amdllm.files import atomic_write_bytes, atomic_write_text, read_json
from amdllm.io.names import HF_PARENT
from amdllm.io.safetensors import CheckpointError, load_tensors
from amdllm.model.inputs import expect_model
from amdllm.model.llama import Llama
from amdllm.model.lora import (LoRAError, apply_lora, in_out, lora_info, lora_targets, normalize_targets,
                               set_lora_params)

_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)"
                  r"\.lora_([AB])(?:\.default)?\.weight$")


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
    expect_model(model, "save_adapter")
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
    if not isinstance(cfg, dict):
        bad(f"expected a JSON object of settings, got a {type(cfg).__name__}")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        bad(f"r must be a positive integer (the LoRA rank), got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        bad(f"lora_alpha must be a number, got {alpha!r}")
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
    expect_model(model, "load_adapter")
    cfg = read_adapter_config(adapter_dir)
    r, alpha = int(cfg["r"]), cfg.get("lora_alpha", 8)
    path = Path(adapter_dir) / "adapter_model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (only safetensors adapters are read; .bin is pickled)")
    try:
        tensors = load_tensors(path)  # the checked reader: a truncated file is named, not a Rust panic
    except CheckpointError as e:
        raise LoRAError(f"{e} (a PEFT adapter's weights)") from None
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
        if not np.isfinite(t.astype(np.float32)).all():
            raise LoRAError(f"{path}: tensor {key!r} holds NaN or infinite values")
        found.setdefault((name, ab), {})[i] = t
    apply_lora(model, rank=r, alpha=alpha, dropout=float(cfg.get("lora_dropout", 0.0)),
               targets=cfg["targets"])
    if cfg.get("use_rslora"):  # rsLoRA scales by alpha / sqrt(r)
        model.lora_scale = float(alpha) / math.sqrt(r)
    new = {}
    for name in cfg["targets"]:
        d_in, d_out = in_out(model, name)
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
