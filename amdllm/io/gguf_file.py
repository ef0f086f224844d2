"""GGUF files (llama.cpp's and Ollama's format) in: the config, the tokenizer and the tensors of a Llama.

    raw, src = read_gguf("m.gguf"); src.get("model.layers.0.self_attn.q_proj.weight")  # [out, in] float32

`GGUFSource` answers what `TensorSource` does (names, shapes, dtypes, arrays) under Hugging Face names,
so `checkpoint.load` and `convert` read GGUF as they read safetensors. ggml's own `gguf` library
dequantizes, one tensor at a time. llama.cpp interleaves each head's rotary pairs in q and k; reading
puts them back in transformers' half-split order."""
from __future__ import annotations

from pathlib import Path

import gguf
import ml_dtypes
import numpy as np

from amdllm.io.safetensors import CheckpointError

MAGIC = b"GGUF"
# GGUF name -> Hugging Face name ({i}: the layer)
GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
# llama.<key> -> config.json key, as transformers' GGUF reader maps them
CONFIG_KEYS = {
    "block_count": "num_hidden_layers", "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "rope.dimension_count": "head_dim", "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "vocab_size": "vocab_size",
}
TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def has_magic(path) -> bool:
    """Whether `path` is a file that starts with GGUF's magic bytes."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == MAGIC


def is_gguf(path) -> bool:
    """Whether `path` is to be read as GGUF: named `.gguf` (a damaged one then gets read_gguf's error,
    not a directory's) or starting with the magic bytes."""
    return Path(path).suffix.lower() == ".gguf" or has_magic(path)


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        key = ".".join(["blk", "{i}", *parts[2:]])
        return GGUF_NAMES[key].format(i=int(parts[1])) if key in GGUF_NAMES else None
    return GGUF_NAMES.get(gguf_name)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary order (each head's pairs interleaved) -> transformers' (first half, second half)."""
    d = w.shape[0] // heads // 2
    return w.reshape(heads, d, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


class GGUFSource:
    """The Llama tensors of one GGUF file under Hugging Face names, each [out, in] as transformers holds it."""
    config_name = "its GGUF metadata"  # what the tensors are checked against, in error messages

    def __init__(self, path: Path, reader, heads: int, kv_heads: int):
        self.path = path
        self._heads = {"q_proj": heads, "k_proj": kv_heads}
        self._tensors, self._cache = {}, {}
        unknown = []
        for t in reader.tensors:
            hf = _hf_name(t.name)
            if hf is None:
                unknown.append(t.name)
                continue
            kind = t.tensor_type.name
            if kind not in TYPES:
                raise CheckpointError(f"{path}: tensor {t.name} has type {kind}; amdllm reads GGUF tensors of "
                                      f"type {', '.join(TYPES)}")
            self._tensors[hf] = t
        if unknown:
            why = (" (llama3 RoPE scaling stored as a tensor: convert from the safetensors checkpoint instead)"
                   if "rope_freqs.weight" in unknown else "")
            raise CheckpointError(f"{path}: tensors that are not part of a Llama: {', '.join(unknown[:8])}{why}")

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self._tensors[name].shape.tolist()))  # GGUF lists ne0 first

    def dtype(self, name: str) -> np.dtype:
        kind = self._tensors[name].tensor_type.name
        return np.dtype({"F16": np.float16, "BF16": ml_dtypes.bfloat16}.get(kind, np.float32))

    def get(self, name: str) -> np.ndarray:
        if name not in self._cache:  # one tensor dequantized at a time: the caller releases it
            self._cache.clear()
            t = self._tensors[name]
            kind = t.tensor_type.name
            try:
                if kind == "BF16":
                    w = np.asarray(t.data).view(np.uint16).view(ml_dtypes.bfloat16)
                elif kind in ("F32", "F16"):
                    w = np.asarray(t.data)
                else:
                    w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32, copy=False)
                w = w.reshape(self.shape(name))
            except (ValueError, IndexError, TypeError) as e:
                raise CheckpointError(f"{self.path}: tensor {t.name} ({kind}) cannot be read: {e}") from None
            proj = name.split(".")[-2]
            if proj in self._heads:
                w = unpermute(w, self._heads[proj])
            self._cache[name] = w
        return self._cache[name]

    def release(self, name: str, rows: tuple[int, int] | None = None) -> None:
        if rows is None:
            self._cache.pop(name, None)


def _fields(path: Path, reader) -> dict:
    out = {}
    for k, f in reader.fields.items():
        if k.startswith("tokenizer.ggml.") and k.rsplit(".", 1)[1] in ("tokens", "scores", "token_type", "merges"):
            out[k] = len(f.data)  # only the sizes are needed here; transformers reads the vocabulary
            continue
        try:
            out[k] = f.contents()
        except (ValueError, IndexError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: metadata field {k} cannot be read: {e}") from None
    return out


def read_gguf(path) -> tuple[dict, GGUFSource]:
    """(config.json-style dict, GGUFSource) of a Llama GGUF file; every problem is one CheckpointError."""
    path = Path(path)
    if not has_magic(path):
        raise CheckpointError(f"{path}: not a GGUF file (expected the magic bytes 'GGUF' at its start)"
                              if path.is_file() else f"{path}: not found")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, TypeError, OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file (truncated or damaged?): {e}") from None
    meta = _fields(path, reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{path}: general.architecture is {arch!r}; amdllm reads Llama GGUF files ('llama')")
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32"}
    for key, hf in CONFIG_KEYS.items():
        v = meta.get(f"llama.{key}")
        if v is None:
            continue
        if isinstance(v, list):
            raise CheckpointError(f"{path}: llama.{key} differs from layer to layer; amdllm reads one value")
        raw[hf] = v
    if "vocab_size" not in raw and "tokenizer.ggml.tokens" in meta:
        raw["vocab_size"] = meta["tokenizer.ggml.tokens"]
    scaling = meta.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raw["rope_scaling"] = {"rope_type": scaling, "factor": meta.get("llama.rope.scaling.factor")}
    for k in ("bos_token_id", "eos_token_id", "padding_token_id"):
        if f"tokenizer.ggml.{k}" in meta:
            raw[k.replace("padding", "pad")] = meta[f"tokenizer.ggml.{k}"]
    heads = raw.get("num_attention_heads")
    if not isinstance(heads, int) or heads < 1:
        raise CheckpointError(f"{path}: llama.attention.head_count is {heads!r}; expected a whole number of heads")
    src = GGUFSource(path, reader, heads, raw.get("num_key_value_heads") or heads)
    raw["tie_word_embeddings"] = "lm_head.weight" not in src.names()  # llama.cpp omits a tied head
    return raw, src


def gguf_tokenizer(path):
    """The file's tokenizer and chat template, converted by transformers' GGUF reader."""
    from transformers import AutoTokenizer  # (heavy: only where a file's tokenizer is converted)
    path = Path(path)
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise CheckpointError(f"{path}: its tokenizer cannot be read by transformers: {e}") from None
