"""Rewrite a checkpoint as users should keep it: safetensors shards plus tokenizer.json.

`convert` reads whatever `TensorSource` can (safetensors, or pickled `.bin` shards with allow_pickle) or
a llama.cpp `.gguf` file (dequantized; float32 unless its tensors are float16 or bfloat16),
writes every tensor under its Hugging Face name in the dtype asked for, one tensor in memory at a time,
and saves the tokenizer through transformers. Delta weights (Vicuna v0) follow FastChat's `apply_delta`:
target = delta + base in float16, a larger delta vocabulary keeping the base's first rows; the target
takes the delta's config and tokenizer."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from amdllm.config import LlamaConfig
from amdllm.files import atomic_write_text, check_output_dir, staged_dir
from amdllm.io.checkpoint import is_quantized, read_config, validate
from amdllm.io.checks import keep_file_head
from amdllm.io.gguf_file import gguf_tokenizer, is_gguf, read_gguf
from amdllm.io.names import TOKENIZER_FILES
from amdllm.io.safetensors import CheckpointError, TensorSource, write_sharded
from amdllm.io.tokenizer import load_tokenizer

DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "float32": np.dtype(np.float32)}
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")  # rows = tokens: a delta may add some


def dense_config(path: Path, role: str) -> tuple[dict, LlamaConfig]:
    """(raw config.json, LlamaConfig) of a dense checkpoint directory; errors name the file."""
    raw = read_config(path, role)
    if is_quantized(path, raw):
        raise CheckpointError(f"{path / 'config.json'}: a quantized (GPTQ) checkpoint; convert rewrites dense ones")
    return raw, LlamaConfig.from_dict(raw, source=str(path / "config.json"))  # names the file and the setting


def check_cast(out: np.ndarray, a: np.ndarray, name: str, src: Path) -> None:
    """Refuse a cast that made finite weights infinite (float16 ends at 65504, bfloat16 does not)."""
    if out.dtype != a.dtype and not np.isfinite(out).all() and np.isfinite(a).all():
        raise CheckpointError(f"{src}: tensor {name} holds values up to {float(np.abs(a).max()):.4g}, beyond "
                              f"{out.dtype.name}'s range: --dtype {out.dtype.name} would write inf (use "
                              "bfloat16 or float32)")


def check_delta(delta: TensorSource, base: TensorSource, names: list[str]) -> None:
    """Every delta tensor has a base tensor of the same shape, except that the vocabulary tensors may
    have more rows in the delta. One error naming the first tensor and file at fault."""
    have = set(base.names())
    for n in names:
        if n not in have:
            raise CheckpointError(f"--delta-base {base.path}: has no tensor {n!r}, which the delta {delta.path} has")
        d, b = tuple(delta.shape(n)), tuple(base.shape(n))
        ok = (d[1:] == b[1:] and d[0] >= b[0]) if n in VOCAB_TENSORS else d == b
        if not ok:
            rule = "the same width and at least as many rows" if n in VOCAB_TENSORS else "the same shape"
            raise CheckpointError(f"{delta.path}: delta tensor {n!r} has shape {list(d)} but the base "
                                  f"{base.path} has {list(b)} (a delta needs {rule})")


def apply_delta(delta: np.ndarray, base: np.ndarray) -> np.ndarray:
    """FastChat's rule, in float16 as FastChat computes it: delta + base over the base's rows."""
    out = np.array(delta, dtype=np.float16)
    out[:base.shape[0]] += np.asarray(base, dtype=np.float16)
    return out


def convert(src, out, *, dtype: str | None = None, allow_pickle: bool = False, delta_base=None,
            max_shard_size="5GB", overwrite: bool = False) -> dict:
    """Write checkpoint `src` (with `delta_base`: the target of delta weights `src`) to `out` as
    safetensors + tokenizer.json. dtype: float16 | bfloat16 | float32 (default: the stored one; float16
    for a delta, as FastChat). Returns a report: tensors, bytes, files, dtype, seconds."""
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    gguf = is_gguf(src)
    if gguf:  # its metadata is the config
        raw, source = read_gguf(src)
        cfg = LlamaConfig.from_dict(raw, source=f"{src} (GGUF metadata)")
    else:
        raw, cfg = dense_config(src, "--model")
        source = None
    check_output_dir(out, [("--model", src), ("--delta-base", delta_base)], command="convert", overwrite=overwrite)
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    source = source or TensorSource(src, allow_pickle=allow_pickle)
    cfg = keep_file_head(cfg, source, src)
    raw = {**raw, "tie_word_embeddings": cfg.tie_word_embeddings}  # the head kept is written, and untied
    names = list(validate(source, cfg))  # every tensor checked against config.json first, in HF order
    base = None
    if delta_base is not None:
        _, base_cfg = dense_config(Path(delta_base), "--delta-base")
        base = TensorSource(delta_base, allow_pickle=allow_pickle)
        validate(base, base_cfg)
        check_delta(source, base, names)
    tokenizer = gguf_tokenizer(src) if gguf else load_tokenizer(src)  # before the weights: a broken tokenizer fails in a second, not after them
    out_dt = DTYPES[dtype] if dtype else (np.dtype(np.float16) if base is not None else source.dtype(names[0]))

    def entry(n):
        def fetch():  # called by the writer just before tensor n's bytes are written
            try:  # a copy in the output dtype (one tensor in memory), so that the source pages can go
                a = apply_delta(source.get(n), base.get(n)) if base is not None else source.get(n)
                out_a = a.astype(out_dt, copy=base is None)  # a delta result is already a fresh array
                check_cast(out_a, a, n, src)
                return out_a
            finally:  # the file pages this tensor touched go back (they would count in the resident size)
                source.release(n)
                if base is not None:
                    base.release(n)
        return (n, tuple(source.shape(n)), out_dt, fetch)

    with staged_dir(out) as staging:  # the output appears whole, or not at all
        files = write_sharded(staging, [entry(n) for n in names], max_shard_size, desc=f"converting {src.name}")
        raw = {**raw, "torch_dtype": out_dt.name, "dtype": out_dt.name}  # transformers 4 / 5 spellings
        atomic_write_text(staging / "config.json", json.dumps(raw, indent=2) + "\n")
        for n in () if gguf else TOKENIZER_FILES:  # generation config, chat template, the original tokenizer files
            if (src / n).is_file():
                shutil.copyfile(src / n, staging / n)
        tokenizer.save_pretrained(str(staging))  # tokenizer.json, converted if need be
    return {"model": str(src), "out": str(out), "delta_base": None if base is None else str(delta_base),
            "dtype": out_dt.name, "tensors": len(names), "files": files,
            "bytes": sum(int(np.prod(source.shape(n), dtype=np.int64)) * out_dt.itemsize for n in names),
            "seconds": round(time.perf_counter() - t0, 2)}
