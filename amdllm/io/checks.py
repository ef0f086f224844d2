"""What every loaded checkpoint must satisfy, dense or GPTQ alike: tensors for exactly the layers the config
names (checked on the names, before anything is allocated), weights that hold no NaN or infinity, and the
file's own head kept where transformers keeps it. One rule each, shared by both loaders."""
from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np

from amdllm.io.safetensors import CheckpointError


def check_layer_count(names, layers: int, where, error: type[Exception]) -> None:
    """The file must hold tensors for every layer 0 .. num_hidden_layers-1. Checked on the names alone,
    before any per-layer table is built: a config that claims 2e7 layers is refused at once. (Layers
    beyond the config's are the loaders' "unexpected tensors".)"""
    held = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.") and n.split(".")[2].isdigit()}
    if sum(1 for h in held if h < layers) == layers:
        return
    span = f"layers {min(held)}-{max(held)} ({len(held)} in all)" if held else "no layers"
    raise error(f"{where}: config.json says num_hidden_layers={layers}, but the file holds tensors for {span}")


# a 2-byte float is NaN or infinite exactly when its exponent bits are all ones
EXPONENT_BITS = {np.dtype(ml_dtypes.bfloat16): np.uint16(0x7F80), np.dtype(np.float16): np.uint16(0x7C00)}
FINITE_CHUNK = 1 << 22  # elements checked at a time: the check's temporary stays a few MB


def check_finite(a: np.ndarray, where, name: str, error: type[Exception] = CheckpointError) -> None:
    """A NaN or infinity in the weights is refused at load, naming the tensor (it would otherwise come
    out as a perplexity of NaN, or empty text). One pass, in chunks."""
    flat = np.ascontiguousarray(a).reshape(-1)
    exponent = EXPONENT_BITS.get(flat.dtype)  # 2-byte floats: integer ops (ml_dtypes' isfinite is slow)
    for k in range(0, flat.size, FINITE_CHUNK):
        chunk = flat[k:k + FINITE_CHUNK]
        bad = ((chunk.view(np.uint16) & exponent).max(initial=0) == exponent if exponent is not None
               else not np.isfinite(chunk).all())
        if bad:
            raise error(f"{where}: tensor {name} holds NaN or infinite values")


def same_bytes(a: np.ndarray, b: np.ndarray, slab: int = 8 << 20) -> bool:
    """Whether two (memory-mapped) tensors are equal byte for byte, compared a slab of rows at a time."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    step = max(1, slab // max(1, a[:1].nbytes))
    return all(a[r:r + step].tobytes() == b[r:r + step].tobytes() for r in range(0, a.shape[0], step))


def keep_file_head(cfg, tensors, where):
    """`cfg` (a LlamaConfig), untied where it ties but the file still holds an lm_head.weight unlike the
    embeddings (`tensors`: name -> array, or a TensorSource or GGUFSource): transformers keeps that
    head, with a warning, and so do we."""
    source = hasattr(tensors, "release")  # a TensorSource or a GGUFSource, not a dict
    names = set(tensors.names()) if source else set(tensors)
    if not cfg.tie_word_embeddings or "lm_head.weight" not in names:
        return cfg
    get = tensors.get if source else tensors.__getitem__
    same = same_bytes(get("lm_head.weight"), get("model.embed_tokens.weight"))
    if source:  # the pages the comparison touched go back
        tensors.release("lm_head.weight")
        tensors.release("model.embed_tokens.weight")
    if same:
        return cfg
    warnings.warn(f"{where}: tie_word_embeddings is true, but the file's lm_head.weight differs from the "
                  "embeddings: that head is kept, as transformers keeps it", stacklevel=3)
    return cfg.replace(tie_word_embeddings=False)


