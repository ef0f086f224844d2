"""LlamaConfig: the shape of a Llama model, read from and written to Hugging Face `config.json`.

One frozen dataclass carries every number the model, the checkpoint loader and the planner need.
It reads both spellings of RoPE settings that exist in the wild, by transformers 5's rule (a non-empty
`rope_scaling` replaces `rope_parameters`), and writes both, so old and new readers agree with us:
  * transformers < 5:  "rope_theta": 500000.0, "rope_scaling": {"rope_type"|"type": "llama3", ...}
  * transformers >= 5: "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, ...}
A setting we do not implement (a RoPE type, a bias) is refused by name, never ignored.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from amdllm.files import atomic_write_text, read_json

SUPPORTED_MODEL_TYPES = ("llama",)
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class ConfigError(ValueError):
    """A config.json we cannot honour; the message names the file and the setting."""


def _flag(d: dict, key: str, source: str) -> bool:
    """A JSON true/false (absent: false); transformers 5 refuses "false" as a string, and so do we."""
    v = d.get(key, False)
    if not isinstance(v, bool):
        raise ConfigError(f"{source}: {key} must be true or false, got {v!r}")
    return v


def _rope_scaling(rs: dict, max_positions: int) -> dict | None:
    """The RoPE scaling as our RoPE reads it: None for plain RoPE, else a dict with rope_type and its
    numbers, each checked; llama3's original length defaults to max_position_embeddings, as in transformers."""
    rtype = rs.get("rope_type", rs.get("type", "default"))
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"rope_scaling type {rtype!r} is not implemented (amdllm runs "
                          f"{', '.join(SUPPORTED_ROPE_TYPES)}); the model would differ from transformers")
    if rtype == "default":
        return None
    out = {"rope_type": rtype, "factor": rs.get("factor")}
    if rtype == "llama3":
        out.update({k: rs.get(k) for k in LLAMA3_KEYS[1:]})
        if out["original_max_position_embeddings"] is None:
            out["original_max_position_embeddings"] = max_positions
    for k, v in out.items():
        if k != "rope_type" and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                 or v <= 0 or (k == "factor" and v < 1)):
            raise ConfigError(f"rope_scaling.{k} must be a {'number >= 1' if k == 'factor' else 'positive number'}"
                              f" for rope_type {rtype!r}, got {v!r}")
    if rtype == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ConfigError(f"rope_scaling.high_freq_factor ({out['high_freq_factor']}) must be above "
                          f"low_freq_factor ({out['low_freq_factor']})")
    return out


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None -> multi-head (== num_attention_heads)
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    rope_theta: float = 10000.0
    # None (plain RoPE) or a dict like {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    # "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    max_position_embeddings: int = 2048
    torch_dtype: str = "float32"  # dtype the checkpoint is stored in (informational)
    extra: dict = field(default_factory=dict, compare=False, repr=False)  # unknown keys kept for round trips

    def __post_init__(self):
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"{k} must be a positive integer, got {v!r}")
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", max(1, self.hidden_size // self.num_attention_heads))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", _rope_scaling(self.rope_scaling, self.max_position_embeddings))

    # ---- derived sizes ----
    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def eos_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        if e is None:
            return ()
        return tuple(e) if isinstance(e, (list, tuple)) else (int(e),)

    def num_params(self, include_embeddings: bool = True) -> int:
        d, f, L, V = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        per_layer = d * self.q_dim + 2 * d * self.kv_dim + self.q_dim * d + 3 * d * f + 2 * d
        n = L * per_layer + d
        if include_embeddings:
            n += V * d * (1 if self.tie_word_embeddings else 2)
        return n

    def replace(self, **kw) -> "LlamaConfig":
        return dataclasses.replace(self, **kw)

    # ---- HF config.json ----
    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "LlamaConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object of settings, got a {type(d).__name__}")
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"{source}: model_type {mt!r} is not supported; amdllm loads {SUPPORTED_MODEL_TYPES}")
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        bad = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
        if bad:
            raise ConfigError(f"{source}: architectures {bad} not supported; expected {SUPPORTED_ARCHITECTURES}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {act!r} not supported; Llama uses 'silu'")
        for flag in ("attention_bias", "mlp_bias"):
            if _flag(d, flag, source):
                raise ConfigError(f"{source}: {flag}=true is not supported (Llama has no biases)")
        if d.get("pretraining_tp", 1) not in (1, None):
            raise ConfigError(f"{source}: pretraining_tp={d['pretraining_tp']} is not supported; use 1")
        # transformers 5: a non-empty rope_scaling replaces rope_parameters (its theta included)
        key = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
        rope = d.get(key) or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: {key} must be an object or null, got {rope!r}")
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"{source}: missing required keys {missing}")
        known = {f.name for f in dataclasses.fields(cls)}
        extra = {k: v for k, v in d.items() if k not in known and k not in ("rope_parameters", "rope_scaling")}
        kw = {k: _count(d, k, source) for k in required}  # each check names the file itself
        for k in ("num_key_value_heads", "head_dim"):
            kw[k] = None if d.get(k) is None else _count(d, k, source)
        kw.update({k: _token_id(d, k, source) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
        kw.update(rope_theta=_positive(theta, "rope_theta", source),
                  rms_norm_eps=_positive(d.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
                  max_position_embeddings=_count(d, "max_position_embeddings", source, 2048))
        try:  # __post_init__'s checks (heads, RoPE) do not know the file: named here
            return cls(**kw, rope_scaling=scaling, tie_word_embeddings=_flag(d, "tie_word_embeddings", source),
                       torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"), extra=extra)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        except (TypeError, ValueError) as e:  # a setting of the wrong kind deep in a nested object
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "LlamaConfig":
        """Read `path` (a config.json, or a checkpoint directory containing one)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ConfigError(f"{p}: config.json not found (is this a Hugging Face checkpoint directory?)")
        return cls.from_dict(read_json(p, ConfigError), source=str(p))

    def to_dict(self) -> dict[str, Any]:
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope_parameters = {**self.rope_scaling, "rope_theta": self.rope_theta}
        d = dict(self.extra)
        d.update({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False, "mlp_bias": False, "torch_dtype": self.torch_dtype,
            # legacy spelling (transformers < 5, GPTQModel, vLLM) and new spelling (transformers >= 5)
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "rope_parameters": rope_parameters,
        })
        return d

    def to_json(self, path: str | os.PathLike) -> None:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        atomic_write_text(p, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


_L3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
_L32_SCALING = {**_L3_SCALING, "factor": 32.0}

# Published shapes, for planning (no weights). Sources: the models' config.json on the Hugging Face hub.
PRESETS: dict[str, LlamaConfig] = {
    "llama-3.1-8b": LlamaConfig(128256, 4096, 14336, 32, 32, 8, 128, 500000.0, _L3_SCALING, 1e-5, False,
                                128000, [128001, 128008, 128009], None, 131072, "bfloat16"),
    "llama-3.1-70b": LlamaConfig(128256, 8192, 28672, 80, 64, 8, 128, 500000.0, _L3_SCALING, 1e-5, False,
                                 128000, [128001, 128008, 128009], None, 131072, "bfloat16"),
    "llama-3.1-405b": LlamaConfig(128256, 16384, 53248, 126, 128, 8, 128, 500000.0, _L3_SCALING, 1e-5, False,
                                  128000, [128001, 128008, 128009], None, 131072, "bfloat16"),
    "llama-3.2-1b": LlamaConfig(128256, 2048, 8192, 16, 32, 8, 64, 500000.0, _L32_SCALING, 1e-5, True,
                                128000, [128001, 128008, 128009], None, 131072, "bfloat16"),
    "llama-3.2-3b": LlamaConfig(128256, 3072, 8192, 28, 24, 8, 128, 500000.0, _L32_SCALING, 1e-5, True,
                                128000, [128001, 128008, 128009], None, 131072, "bfloat16"),
    "llama-2-7b": LlamaConfig(32000, 4096, 11008, 32, 32, 32, 128, 10000.0, None, 1e-5, False,
                              1, 2, None, 4096, "float16"),
    "llama-2-13b": LlamaConfig(32000, 5120, 13824, 40, 40, 40, 128, 10000.0, None, 1e-5, False,
                               1, 2, None, 4096, "float16"),
    "vicuna-13b": LlamaConfig(32000, 5120, 13824, 40, 40, 40, 128, 10000.0, None, 1e-6, False,
                              1, 2, 0, 2048, "float16"),
}


def _count(d: dict, key: str, source: str, default: int | None = None) -> int:
    """d[key] as a positive integer (JSON's true/false and "4096" are not); the error names the field."""
    v = d.get(key, default)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"{source}: {key} must be a positive integer, got {v!r}")
    return v


def _positive(v, key: str, source: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{source}: {key} must be a positive number, got {v!r}")
    return float(v)


def _token_id(d: dict, key: str, source: str):
    """bos/eos/pad ids: null, a non-negative integer, or (eos) a list of them."""
    v = d.get(key)
    ids = v if isinstance(v, list) else [v]
    if v is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"{source}: {key} must be a non-negative integer (or a list of them), got {v!r}")
    return v


def get_preset(name: str) -> LlamaConfig:
    key = name.lower()
    if key not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[key]
