"""Hugging Face Llama checkpoints in and out: `load(dir) -> Llama`, `save(model, dir)`.

How it works, and why:
  * One table, `NAME_TABLE`, maps every HF tensor name to our parameter. HF stores one tensor per
    layer, nn.Linear weights [out, in]; we store each kind stacked on a leading `layers` axis with
    kernels [in, out]. So HF `model.layers.{i}.self_attn.q_proj.weight` [q, D] is `layers/q_proj[i].T`.
  * safetensors files are memory-mapped and decoded here (8-byte header length, JSON header, raw
    little-endian data): a tensor is a zero-copy numpy view until it is cast, so peak host memory is
    about one stacked parameter plus the model. numpy has no bfloat16; `ml_dtypes` (a jax dependency)
    provides it, so bf16 checkpoints are read and written exactly, without torch.
  * With `shardings`, each parameter is created by `jax.make_array_from_callback`: every device asks
    only for its block, which is read straight from the mapped files (layer range, then a transposed
    2-D slice), so no host ever holds a whole 405B parameter.
  * Every name, shape and file is checked before anything is built, and all problems are reported
    at once in one `CheckpointError` line.
"""
from __future__ import annotations

import json
import mmap
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from amdllm.config import LlamaConfig
from amdllm.io import atomic_path, atomic_write_bytes, atomic_write_text, read_json
from amdllm.model import Llama, param_table


class CheckpointError(ValueError):
    """A checkpoint we cannot read or write; the message names the file / tensor and what was expected."""


# ------------------------------------------------------------------------------------------------
# The name table: (our parameter, HF tensor name ({i} = layer index), HF stores it transposed?)
# ------------------------------------------------------------------------------------------------
NAME_TABLE: tuple[tuple[str, str, bool], ...] = (
    ("embed_tokens",                   "model.embed_tokens.weight",                         False),  # [V, D]
    ("layers/q_proj",                  "model.layers.{i}.self_attn.q_proj.weight",          True),   # [H*hd, D]
    ("layers/k_proj",                  "model.layers.{i}.self_attn.k_proj.weight",          True),   # [Hkv*hd, D]
    ("layers/v_proj",                  "model.layers.{i}.self_attn.v_proj.weight",          True),   # [Hkv*hd, D]
    ("layers/o_proj",                  "model.layers.{i}.self_attn.o_proj.weight",          True),   # [D, H*hd]
    ("layers/gate_proj",               "model.layers.{i}.mlp.gate_proj.weight",             True),   # [F, D]
    ("layers/up_proj",                 "model.layers.{i}.mlp.up_proj.weight",               True),   # [F, D]
    ("layers/down_proj",               "model.layers.{i}.mlp.down_proj.weight",             True),   # [D, F]
    ("layers/input_layernorm",         "model.layers.{i}.input_layernorm.weight",           False),  # [D]
    ("layers/post_attention_layernorm", "model.layers.{i}.post_attention_layernorm.weight", False),  # [D]
    ("norm",                           "model.norm.weight",                                 False),  # [D]
    ("lm_head",                        "lm_head.weight",                                    True),   # [V, D]
)
# Buffers some (older) checkpoints carry that hold no learned weights: skipped silently.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


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
# safetensors, decoded by hand over a memory map
# ------------------------------------------------------------------------------------------------
ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
             "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64,
             "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
ST_NAMES = {np.dtype(v): k for k, v in ST_DTYPES.items()}


class SafetensorsFile:
    """One .safetensors file: header parsed and checked against the file size; tensors as mmap views."""

    def __init__(self, path: Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{self.path}: truncated or not a safetensors file ({size} bytes)")
            n = int.from_bytes(head, "little")
            if n > size - 8 or n > 100_000_000:
                raise CheckpointError(f"{self.path}: truncated or corrupt safetensors file (header of {n} "
                                      f"bytes announced, file has {size} bytes)")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        self.tensors: dict[str, tuple[Any, tuple[int, ...], int, int]] = {}
        end_max = 0
        for name, t in header.items():
            try:
                dt, shape, (b, e) = ST_DTYPES[t["dtype"]], tuple(t["shape"]), t["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: tensor {name!r} has an unreadable header entry {t}") from None
            if e - b != int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize:
                raise CheckpointError(f"{self.path}: tensor {name!r} header is inconsistent "
                                      f"(shape {list(shape)} {t['dtype']} vs {e - b} bytes)")
            self.tensors[name] = (dt, shape, b, e)
            end_max = max(end_max, e)
        if self.data_start + end_max > size:
            raise CheckpointError(f"{self.path}: truncated safetensors file (data ends at byte "
                                  f"{self.data_start + end_max}, file has {size} bytes)")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size else None

    def get(self, name: str) -> np.ndarray:
        """A read-only zero-copy view of tensor `name` (pages are read from disk only when touched)."""
        dt, shape, b, e = self.tensors[name]
        return self._map[self.data_start + b:self.data_start + e].view(dt).reshape(shape)

    def release(self, name: str) -> None:
        """Drop this process's mapped pages of tensor `name` (they stay in the page cache and are
        re-read if touched again), so a sharded load's resident memory is what it owns, not the
        file pages its column slices touched."""
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if self._map is None or advice is None:
            return
        _, _, b, e = self.tensors[name]
        start = (self.data_start + b) // mmap.PAGESIZE * mmap.PAGESIZE  # madvise wants page alignment
        if self.data_start + e > start:
            self._map._mmap.madvise(advice, start, self.data_start + e - start)


class TensorSource:
    """All tensors of a checkpoint directory (one file, index + shards, or opted-in pickles) by name."""

    def __init__(self, path: str | Path, allow_pickle: bool = False):
        self.path = Path(path)
        self._where: dict[str, Any] = {}  # name -> SafetensorsFile or a torch state dict
        single, index = self.path / "model.safetensors", self.path / "model.safetensors.index.json"
        if single.is_file():
            self._add_file(single)
        elif index.is_file():
            for fname in sorted(set(_read_weight_map(index).values())):
                if not (self.path / fname).is_file():
                    raise CheckpointError(f"{index}: shard {fname!r} listed in weight_map is missing")
                self._add_file(self.path / fname)
            for name, fname in _read_weight_map(index).items():
                if name not in self._where:
                    raise CheckpointError(f"{index}: tensor {name!r} is mapped to {fname!r} but that file "
                                          "does not contain it")
        else:
            bins = sorted(self.path.glob("pytorch_model*.bin")) or sorted(self.path.glob("*.bin"))
            if not bins:
                found = sorted(p.name for p in self.path.iterdir()) if self.path.is_dir() else []
                raise CheckpointError(f"{self.path}: no model.safetensors, model.safetensors.index.json or "
                                      f"pytorch_model*.bin found (files: {found})")
            if not allow_pickle:
                raise CheckpointError(
                    f"{bins[0]}: pickled PyTorch weights are refused (a .bin can run arbitrary code when "
                    "loaded); convert to safetensors, or pass allow_pickle=True if you trust the source")
            import torch
            for b in bins:
                try:  # mmap keeps host memory low; legacy (non-zip) pickles cannot be mapped
                    sd = torch.load(b, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:
                    try:
                        sd = torch.load(b, map_location="cpu", weights_only=True)
                    except Exception as e:
                        raise CheckpointError(f"{b}: cannot read PyTorch weights ({type(e).__name__}: "
                                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
                for name in sd:
                    self._where[name] = sd

    def _add_file(self, path: Path):
        f = SafetensorsFile(path)
        for name in f.tensors:
            self._where[name] = f

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        src = self._where[name]
        return src.tensors[name][1] if isinstance(src, SafetensorsFile) else tuple(src[name].shape)

    def dtype(self, name: str) -> np.dtype:
        src = self._where[name]
        return np.dtype(src.tensors[name][0]) if isinstance(src, SafetensorsFile) else _torch_np(src[name]).dtype

    def get(self, name: str) -> np.ndarray:
        src = self._where[name]
        return src.get(name) if isinstance(src, SafetensorsFile) else _torch_np(src[name])

    def release(self, name: str) -> None:
        src = self._where[name]
        if isinstance(src, SafetensorsFile):
            src.release(name)


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        wm = json.loads(index.read_text())["weight_map"]
        assert isinstance(wm, dict)
        return wm
    except (json.JSONDecodeError, KeyError, AssertionError, TypeError):
        raise CheckpointError(f"{index}: not a valid index (expected JSON with a 'weight_map' object)") from None


def _torch_np(t) -> np.ndarray:
    import torch
    if t.dtype == torch.bfloat16:  # numpy has no bf16: reinterpret the bits
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def load_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of one .safetensors file as numpy (bf16 as ml_dtypes.bfloat16); for small files."""
    f = SafetensorsFile(Path(path))
    return {name: np.array(f.get(name)) for name in f.tensors}


# ------------------------------------------------------------------------------------------------
# load
# ------------------------------------------------------------------------------------------------
def _fmt(items: list[str], limit: int = 8) -> str:
    more = f", ... and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def validate(src: TensorSource, cfg: LlamaConfig) -> dict:
    """Check names, shapes and dtypes against `cfg`; raise one CheckpointError listing every problem."""
    specs = hf_tensor_specs(cfg)
    found = set(src.names())
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
        raise CheckpointError(f"{src.path}: checkpoint does not match config.json "
                              f"({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}): " + "; ".join(problems))
    return specs


def _read_block(src: TensorSource, cfg: LlamaConfig, ours: str, index: tuple, dtype) -> np.ndarray:
    """Our parameter `ours` restricted to `index` (a tuple of slices), read from HF tensors, as `dtype`."""
    (hf, tr) = next((h, t) for o, h, t in NAME_TABLE if o == ours)
    shape = param_table(cfg)[ours][0]
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    if not ours.startswith("layers/"):
        view = src.get(hf)  # always a fresh C-ordered copy: never let a device array alias the file map
        out = np.array((view.T if tr else view)[index], dtype=dtype, order="C")
        src.release(hf)
        return out
    layers = range(*index[0].indices(shape[0]))
    rest = index[1:]
    out = None
    for j, i in enumerate(layers):
        view = src.get(hf.format(i=i))      # HF [out, in] (or [D] for norms)
        block = (view.T if tr else view)[rest]  # ours [in, out] block: only these bytes are read
        if out is None:
            out = np.empty((len(layers),) + block.shape, dtype)
        out[j] = block                       # the cast happens here, one layer at a time
        src.release(hf.format(i=i))          # a column slice touched every page: let them go
    return out if out is not None else np.empty((0,) + shape[1:], dtype)


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


def load(path, *, dtype=jnp.float32, compute_dtype=None, mesh=None, rules=None, shardings=None,
         allow_pickle: bool = False, remat: bool = False) -> Llama:
    """Read an HF Llama checkpoint directory into a `Llama` with parameters in `dtype`.

    compute_dtype: activations dtype (default: `dtype`). shardings: {our name: jax Sharding}; or
    `mesh` + `rules` to derive them with `amdllm.sharding.param_shardings`. GPTQ directories (a
    `quantization_config` in config.json) are handed to `amdllm.gptq.load_quantized`.
    """
    path = Path(path)
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory" + ("" if path.exists() else " (not found)"))
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: config.json not found (is this a Hugging Face checkpoint directory?)")
    raw = read_json(cfg_file, CheckpointError)
    if raw.get("quantization_config") or (path / "quantize_config.json").is_file():
        from amdllm.gptq import load_quantized  # GPTQ format lives with the quantizer
        return load_quantized(path, dtype=dtype, compute_dtype=compute_dtype, mesh=mesh, rules=rules,
                              shardings=shardings, remat=remat)
    cfg = LlamaConfig.from_dict(raw, source=str(cfg_file))  # ConfigError names file and setting
    src = TensorSource(path, allow_pickle=allow_pickle)
    validate(src, cfg)
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise CheckpointError(f"dtype={dtype}: parameters must be a floating dtype (float32, bfloat16, float16)")
    model = Llama.abstract(cfg, param_dtype=dtype, dtype=compute_dtype or dtype, remat=remat)
    if shardings is None and mesh is not None:
        from amdllm.sharding import activation_sharding, param_shardings
        shardings = param_shardings(model, mesh, rules)
        model.act_sharding = activation_sharding(mesh, rules)  # activations split by batch
    shardings = _flatten_shardings(shardings)
    table = param_table(cfg)
    for ours in tqdm(table, desc=f"loading {path.name}", leave=False):
        shape = table[ours][0]
        if ours in shardings:
            value = jax.make_array_from_callback(
                shape, shardings[ours], lambda idx, o=ours: _read_block(src, cfg, o, idx, dtype))
        else:
            value = jax.device_put(_read_block(src, cfg, ours, (), dtype))
        owner, attr = (model.layers, ours.split("/")[1]) if ours.startswith("layers/") else (model, ours)
        getattr(owner, attr).set_value(value)
    return model


# ------------------------------------------------------------------------------------------------
# save
# ------------------------------------------------------------------------------------------------
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size) -> int:
    """2_000_000, "2GB" (10^9, like transformers), "500MB", "1GiB" -> bytes."""
    if isinstance(size, (int, np.integer)) and size > 0:
        return int(size)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
    if not m or float(m.group(1)) <= 0:
        raise CheckpointError(f"max_shard_size={size!r}: expected bytes (int) or a size like '2GB', '500MB'")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def write_safetensors(path, entries: list[tuple[str, tuple[int, ...], Any, Callable[[], np.ndarray]]],
                      metadata: dict[str, str] | None = None) -> None:
    """Stream tensors into one .safetensors file, atomically. entries: (name, shape, dtype, fetch);
    `fetch()` is called once per tensor, just before its bytes are written, so only one is in memory."""
    header, offset = {}, 0
    for name, shape, dt, _ in entries:
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
        header[name] = {"dtype": ST_NAMES[np.dtype(dt)], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header = {"__metadata__": dict(metadata or {"format": "pt"}), **header}
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)  # data starts 8-byte aligned, like the reference writer
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(len(hbytes).to_bytes(8, "little"))
        f.write(hbytes)
        for name, shape, dt, fetch in entries:
            a = np.ascontiguousarray(fetch(), dtype=dt)
            if a.shape != tuple(shape):
                raise CheckpointError(f"{path}: tensor {name!r} has shape {list(a.shape)}, header says {list(shape)}")
            f.write(a.tobytes())  # little-endian on every platform JAX supports


def save_tensors(path, tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> None:
    """Write a dict of arrays (numpy or jax, bf16 included) as one .safetensors file."""
    write_safetensors(path, [(k, tuple(np.shape(v)), np.dtype(v.dtype), lambda v=v: np.asarray(v))
                             for k, v in tensors.items()], metadata)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json", "chat_template.jinja")


def _param_value(model: Llama, ours: str):
    owner, attr = (model.layers, ours.split("/")[1]) if ours.startswith("layers/") else (model, ours)
    v = getattr(owner, attr)
    v = v.get_value() if isinstance(v, nnx.Variable) else v
    if not hasattr(v, "dtype") or not jnp.issubdtype(v.dtype, jnp.floating):
        raise CheckpointError(f"parameter {ours} is {type(v).__name__}, not a dense float array (GPTQ-"
                              "quantized?); save quantized models with amdllm.gptq, not checkpoint.save")
    return v


def save(model: Llama, path, *, dtype=None, max_shard_size="2GB", tokenizer_from=None) -> Path:
    """Write `model` as an HF checkpoint directory (config.json + safetensors, sharded above
    `max_shard_size` with model.safetensors.index.json). dtype: storage dtype (default: the model's)."""
    path = Path(path)
    cfg = model.cfg
    limit = parse_size(max_shard_size)
    if any(k.endswith("_lora_a") for k in nnx.to_pure_dict(nnx.state(model.layers))):
        warnings.warn("model has LoRA factors: checkpoint.save writes the base weights only; merge them first "
                      "(amdllm.lora) or save the adapter", stacklevel=2)
    specs = hf_tensor_specs(cfg)
    values = {ours: _param_value(model, ours) for ours in param_table(cfg)}
    out_dt = np.dtype(jnp.dtype(dtype) if dtype is not None else values["embed_tokens"].dtype)
    if out_dt.name not in ("float32", "bfloat16", "float16"):
        raise CheckpointError(f"dtype={out_dt.name}: expected float32, bfloat16 or float16")

    def fetch(ours, layer, tr):
        def f():
            v = values[ours] if layer is None else values[ours][layer]  # one layer: gathers only this slice
            v = np.asarray(jnp.asarray(v).astype(out_dt))
            return v.T if tr else v
        return f

    entries = [(hf, s[3], out_dt, fetch(s[0], s[1], s[2])) for hf, s in specs.items()]
    shards, size = [[]], 0
    for e in entries:  # greedy, in order, like transformers: a new file when the next tensor would overflow
        n = int(np.prod(e[1])) * out_dt.itemsize
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += n
    path.mkdir(parents=True, exist_ok=True)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    for fname, shard in tqdm(list(zip(names, shards)), desc=f"saving {path.name}", leave=False):
        write_safetensors(path / fname, shard, {"format": "pt"})
    index = path / "model.safetensors.index.json"
    if len(shards) > 1:
        total = sum(int(np.prod(e[1])) * out_dt.itemsize for e in entries)
        wm = {e[0]: fname for fname, shard in zip(names, shards) for e in shard}
        atomic_write_text(index, json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=2) + "\n")
    # remove weights of an earlier save in this directory, so no loader picks up stale files
    for old in list(path.glob("model*.safetensors")) + ([index] if len(shards) == 1 else []):
        if old.name not in names and old.exists() and (old.name == index.name or re.fullmatch(
                r"model(-\d{5}-of-\d{5})?\.safetensors", old.name)):
            old.unlink()
    d = cfg.to_dict()
    d["torch_dtype"] = d["dtype"] = out_dt.name  # transformers 4 reads torch_dtype, 5 reads dtype
    atomic_write_text(path / "config.json", json.dumps(d, indent=2, sort_keys=True) + "\n")
    if tokenizer_from is not None:
        _copy_tokenizer(Path(tokenizer_from), path)
    return path


def _copy_tokenizer(src: Path, dst: Path) -> None:
    if not src.is_dir():
        raise CheckpointError(f"tokenizer_from={src}: directory not found")
    copied = [n for n in TOKENIZER_FILES if (src / n).is_file()]
    if not any(n.startswith("tokenizer") for n in copied):
        raise CheckpointError(f"tokenizer_from={src}: no tokenizer files found (expected one of {TOKENIZER_FILES})")
    for n in copied:
        if (src / n).resolve() != (dst / n).resolve():
            atomic_write_bytes(dst / n, (src / n).read_bytes())
