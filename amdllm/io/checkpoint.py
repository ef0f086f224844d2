"""Hugging Face Llama checkpoints in and out: `load(dir) -> Llama`, `save(model, dir)`.

One table (`NAME_TABLE`) maps every HF tensor to our stacked parameter ([out, in] becomes [in, out]).
Each parameter's destination is allocated once, aligned so that `jax.device_put` adopts it, and every
tensor is cast and transposed straight into it a slab at a time, its file pages released as it goes: host
memory stays about the model's size. With `shardings` each device reads only its own block from the
mapped files. Every name, shape and file is checked first; all problems come in one `CheckpointError`."""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from amdllm.progress import tqdm

from amdllm.config import LlamaConfig
from amdllm.files import atomic_write_text, read_json
from amdllm.io.gguf_file import is_gguf, read_gguf
from amdllm.io.gptq_format import is_quantized, load_quantized
from amdllm.io.checks import check_finite, check_layer_count, keep_file_head
from amdllm.io.names import IGNORED_SUFFIXES, NAME_TABLE, TOKENIZER_FILES
from amdllm.io.tokenizer import copy_tokenizer
from amdllm.model.llama import Llama, param_table
from amdllm.io.transpose import copy_transposed, transposed
from amdllm.parallel.sharding import activation_sharding, param_shardings
from amdllm.io.safetensors import (ST_DTYPES, ST_NAMES, CheckpointError, SafetensorsFile, TensorSource,
                                   aligned_empty, load_tensors, parse_size, save_tensors, write_safetensors,
                                   write_sharded)

# the reader / writer are re-exported: `checkpoint.TensorSource`, `checkpoint.save_tensors`, ... keep working
__all__ = ["NAME_TABLE", "IGNORED_SUFFIXES", "TOKENIZER_FILES", "hf_tensor_specs", "validate", "load", "save",
           "CheckpointError", "ST_DTYPES", "ST_NAMES", "SafetensorsFile", "TensorSource", "load_tensors",
           "parse_size", "save_tensors", "write_safetensors"]




def hf_tensor_specs(cfg: LlamaConfig) -> dict[str, tuple[str, int | None, bool, tuple[int, ...]]]:
    """HF name -> (our name, layer index or None, transposed, HF shape), in HF (layer-major) order."""
    ours = param_table(cfg)
    specs: dict[str, tuple[str, int | None, bool, tuple[int, ...]]] = {}

    def add(name, hf, layer, tr):
        shape = ours[name][0][1:] if layer is not None else ours[name][0]
        specs[hf.format(i=layer)] = (name, layer, tr, tuple(reversed(shape)) if tr else tuple(shape))

    # transformers' order (embeddings, layer 0 .. L-1, final norm, head), so a shard holds whole layers
    add(*NAME_TABLE[0][:2], None, NAME_TABLE[0][2])
    for i in range(cfg.num_hidden_layers):
        for name, hf, tr in NAME_TABLE:
            if name.startswith("layers/"):
                add(name, hf, i, tr)
    for name, hf, tr in NAME_TABLE[-2:]:
        if name in ours:  # no lm_head when embeddings are tied
            add(name, hf, None, tr)
    return specs


# ------------------------------------------------------------------------------------------------
# load
# ------------------------------------------------------------------------------------------------
def _fmt(items: list[str], limit: int = 8) -> str:
    more = f", ... and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def validate(src: TensorSource, cfg: LlamaConfig) -> dict:
    """Check names, shapes and dtypes against `cfg`; raise one CheckpointError listing every problem."""
    found = set(src.names())
    check_layer_count(found, cfg.num_hidden_layers, src.path, CheckpointError)
    specs = hf_tensor_specs(cfg)
    missing = [n for n in specs if n not in found]
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()  # tied: transformers skips it
    unexpected = sorted(n for n in found - set(specs) if n not in ignorable and not n.endswith(IGNORED_SUFFIXES))
    bad_shape = [f"{n} expected {list(s[3])} found {list(src.shape(n))}"
                 for n, s in specs.items() if n in found and tuple(src.shape(n)) != s[3]]
    bad_dtype = [f"{n} ({src.dtype(n)})" for n in specs if n in found and not np.issubdtype(src.dtype(n), np.floating)
                 and src.dtype(n) != ml_dtypes.bfloat16]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_fmt(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_fmt(unexpected)}")
    if bad_shape:
        problems.append(f"wrong shapes: {_fmt(bad_shape)}")
    if bad_dtype:
        problems.append(f"non-float tensors: {_fmt(bad_dtype)}")
    if problems:
        raise CheckpointError(f"{src.path}: checkpoint does not match {getattr(src, 'config_name', 'config.json')} "
                              f"({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}): " + "; ".join(problems))
    return specs


SLAB_BYTES = 8 << 20  # HF rows copied per step; their file pages are released before the next step


def _copy_into(out: np.ndarray, src: TensorSource, name: str, tr: bool, index: tuple) -> None:
    """out[...] = (HF tensor `name`, transposed if `tr`)[index], cast to out.dtype. A 2-D tensor is
    copied a slab of HF rows at a time and each slab's file pages are released once copied, so the
    pages touched never add more than SLAB_BYTES to the peak (a transposed column block reads them all)."""
    view = src.get(name)  # a view of the mapped file: copied, never aliased (pages are released below)
    if view.ndim != 2:
        out[...] = view[index]
        src.release(name)
        return
    row_sl, col_sl = (index[1], index[0]) if tr else index  # HF rows are our columns when transposed
    rows = range(*row_sl.indices(view.shape[0]))
    if rows.step != 1:  # never asked for by jax; correct, just not slab by slab
        out[...] = (view.T if tr else view)[index]
        src.release(name)
        return
    step = max(1, SLAB_BYTES // max(1, view.shape[1] * view.dtype.itemsize))
    # a cast and a transpose: transposed as stored into one slab-sized buffer, then cast along its rows
    tmp = (np.empty((out.shape[0], min(step, len(rows))), view.dtype)
           if tr and view.dtype != out.dtype and view.dtype.itemsize in (2, 4) else None)
    for k in range(0, len(rows), step):
        r0, r1 = rows.start + k, min(rows.stop, rows.start + k + step)
        slab = view[r0:r1, col_sl]
        if tr:  # a strided copy straight into `out`
            dst = out[:, k:k + r1 - r0]
            if tmp is None:
                copy_transposed(dst, slab)
            else:
                copy_transposed(tmp[:, :r1 - r0], slab)
                dst[...] = tmp[:, :r1 - r0]
        else:
            out[k:k + r1 - r0] = slab
        src.release(name, (r0, r1))
    src.release(name)


def _read_block(src: TensorSource, cfg: LlamaConfig, ours: str, index: tuple, dtype) -> np.ndarray:
    """Our parameter `ours` restricted to `index` (a tuple of slices), read from HF tensors, as `dtype`,
    in a fresh ALIGN-aligned buffer that jax may adopt as is."""
    (hf, tr) = next((h, t) for o, h, t in NAME_TABLE if o == ours)
    shape = param_table(cfg)[ours][0]
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    block = tuple(len(range(*sl.indices(n))) for sl, n in zip(index, shape))
    out = aligned_empty(block, dtype)
    if not ours.startswith("layers/"):
        _copy_into(out, src, hf, tr, index)
        check_finite(out, src.path, hf)
        return out
    for j, i in enumerate(range(*index[0].indices(shape[0]))):  # the stacked buffer, one layer at a time
        _copy_into(out[j], src, hf.format(i=i), tr, index[1:])
        check_finite(out[j], src.path, hf.format(i=i))
    return out


def _flatten_shardings(sh) -> dict[str, Any]:
    """Accept {"layers/q_proj": s}, {("layers", "q_proj"): s}, nested dicts or an nnx.State."""
    if sh is None:
        return {}
    if isinstance(sh, nnx.State):
        sh = sh.to_pure_dict()
    flat = {}

    def walk(prefix, d):
        for k, v in d.items():
            key = "/".join(map(str, k)) if isinstance(k, tuple) else str(k).replace(".", "/")
            key = f"{prefix}/{key}" if prefix else key
            if isinstance(v, dict):
                walk(key, v)
            else:
                flat[key] = v
    walk("", dict(sh))
    return flat


def read_config(path: Path, role: str = "") -> dict:
    """config.json of checkpoint directory `path` as a dict; errors name the directory (and the flag)."""
    where = f"{role} {path}" if role else str(path)
    if not path.is_dir():
        raise CheckpointError(f"{where}: not a checkpoint directory" + ("" if path.exists() else " (not found)"))
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{where}: config.json not found (is this a Hugging Face checkpoint directory?)")
    raw = read_json(path / "config.json", CheckpointError)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path / 'config.json'}: expected a JSON object of settings, got a "
                              f"{type(raw).__name__}")
    return raw


def stored_dtype(path: Path) -> str:
    """The dtype config.json says the weights are stored in ("float32" when it says none)."""
    raw = read_config(path)
    return str(raw.get("torch_dtype") or raw.get("dtype") or "float32")


def load(path, *, dtype=jnp.float32, compute_dtype=None, mesh=None, rules=None, shardings=None,
         allow_pickle: bool = False, remat: bool = False) -> Llama:
    """Read an HF Llama checkpoint directory (or a llama.cpp `.gguf` file) into a `Llama` in `dtype`.

    compute_dtype: activations dtype (default: `dtype`). shardings: {our name: jax Sharding}; or
    `mesh` + `rules` to derive them with `amdllm.parallel.sharding.param_shardings`. GPTQ directories
    (a `quantization_config` in config.json) are handed to `amdllm.io.gptq_format.load_quantized`.
    """
    path = Path(path)
    if is_gguf(path):  # llama.cpp's: metadata as config, tensors dequantized
        raw, src = read_gguf(path)
        cfg = LlamaConfig.from_dict(raw, source=f"{path} (GGUF metadata)")
    else:
        raw = read_config(path)
        if is_quantized(path, raw):
            return load_quantized(path, dtype=dtype, compute_dtype=compute_dtype, mesh=mesh, rules=rules,
                                  shardings=shardings, remat=remat)
        cfg = LlamaConfig.from_dict(raw, source=str(path / "config.json"))  # ConfigError names file and setting
        src = TensorSource(path, allow_pickle=allow_pickle)
    cfg = keep_file_head(cfg, src, path)
    validate(src, cfg)
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise CheckpointError(f"dtype={dtype}: parameters must be a floating dtype (float32, bfloat16, float16)")
    model = Llama.abstract(cfg, param_dtype=dtype, dtype=compute_dtype or dtype, remat=remat)
    if shardings is None and mesh is not None:
        shardings = param_shardings(model, mesh, rules)
        model.act_sharding = activation_sharding(mesh, rules)  # activations split by batch
    shardings = _flatten_shardings(shardings)
    table = param_table(cfg)
    for ours in tqdm(table, desc=f"loading {path.name}", leave=False, disable=jax.process_index() != 0):
        shape = table[ours][0]
        if ours in shardings:
            value = jax.make_array_from_callback(
                shape, shardings[ours], lambda idx, o=ours: _read_block(src, cfg, o, idx, dtype))
        else:
            value = jax.device_put(_read_block(src, cfg, ours, (), dtype), may_alias=True)
        owner, attr = (model.layers, ours.split("/")[1]) if ours.startswith("layers/") else (model, ours)
        getattr(owner, attr).set_value(value)
    return model


# ------------------------------------------------------------------------------------------------
# save
# ------------------------------------------------------------------------------------------------
def _param_value(model: Llama, ours: str):
    owner, attr = (model.layers, ours.split("/")[1]) if ours.startswith("layers/") else (model, ours)
    v = getattr(owner, attr)
    v = v.get_value() if isinstance(v, nnx.Variable) else v
    if not hasattr(v, "dtype") or not jnp.issubdtype(v.dtype, jnp.floating):
        raise CheckpointError(f"parameter {ours} is {type(v).__name__}, not a dense float array (GPTQ-"
                              "quantized?); save quantized models with amdllm.io.gptq_format.save_quantized")
    return v


def save(model: Llama, path, *, dtype=None, max_shard_size="2GB", tokenizer_from=None) -> Path:
    """Write `model` as an HF checkpoint directory (config.json + safetensors, sharded above
    `max_shard_size` with model.safetensors.index.json). dtype: storage dtype (default: the model's)."""
    path = Path(path)
    cfg = model.cfg
    limit = parse_size(max_shard_size)
    if any(k.endswith("_lora_a") for k in nnx.to_pure_dict(nnx.state(model.layers))):
        warnings.warn("model has LoRA factors: checkpoint.save writes the base weights only; merge them first "
                      "(amdllm.model.lora) or save the adapter", stacklevel=2)
    specs = hf_tensor_specs(cfg)
    values = {ours: _param_value(model, ours) for ours in param_table(cfg)}
    out_dt = np.dtype(jnp.dtype(dtype) if dtype is not None else values["embed_tokens"].dtype)
    if out_dt.name not in ("float32", "bfloat16", "float16"):
        raise CheckpointError(f"dtype={out_dt.name}: expected float32, bfloat16 or float16")

    def fetch(ours, layer, tr):
        def f():
            v = values[ours] if layer is None else values[ours][layer]  # one layer: gathers only this slice
            v = np.asarray(jnp.asarray(v).astype(out_dt))
            return transposed(v) if tr else v  # contiguous, as the writer wants it
        return f

    entries = [(hf, s[3], out_dt, fetch(s[0], s[1], s[2])) for hf, s in specs.items()]
    write_sharded(path, entries, limit, desc=f"saving {path.name}")
    d = cfg.to_dict()
    d["torch_dtype"] = d["dtype"] = out_dt.name  # transformers 4 reads torch_dtype, 5 reads dtype
    atomic_write_text(path / "config.json", json.dumps(d, indent=2, sort_keys=True) + "\n")
    if tokenizer_from is not None:
        copy_tokenizer(Path(tokenizer_from), path)
    return path
