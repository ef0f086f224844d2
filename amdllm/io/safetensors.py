"""safetensors without a framework: a checked, memory-mapped reader and a streaming, atomic writer.

Reading the header ourselves gives zero-copy numpy views over a memory map (a tensor costs host memory
only for the pages touched, and `release` hands them back); `ml_dtypes` gives numpy bfloat16.
`SafetensorsFile` is one file, checked against its size; `TensorSource` every tensor of a checkpoint
directory (a file, an index and shards, or opted-in pickled weights); `write_safetensors` streams tensors
into a file that appears only when complete. `amdllm.io.checkpoint` re-exports all of this."""
from __future__ import annotations

import json
import mmap
import re
import zipfile
from pathlib import Path
from typing import Any, Callable

import ml_dtypes
import numpy as np
from amdllm.progress import tqdm

from amdllm.files import atomic_path, atomic_write_text


class CheckpointError(ValueError):
    """A checkpoint we cannot read or write; the message names the file / tensor and what was expected."""


ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
             "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64,
             "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
ST_NAMES = {np.dtype(v): k for k, v in ST_DTYPES.items()}


# XLA's CPU client adopts a host buffer as a device buffer without copying only when its data starts on
# a 64-byte boundary; numpy's (malloc's) large buffers start 16 bytes into a page, so they are copied.
ALIGN = 64


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised C-ordered array whose data starts on an ALIGN-byte boundary: filled once, it becomes
    the device buffer (`jax.device_put(a, may_alias=True)` on a CPU) instead of being copied."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(n + ALIGN, np.uint8)
    off = -raw.ctypes.data % ALIGN
    return raw[off:off + n].view(dtype).reshape(shape)


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
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (expected a JSON object, got "
                                  f"{type(header).__name__})")
        self.metadata = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (__metadata__ must be an object)")
        self.data_start = 8 + n
        self.tensors: dict[str, tuple[Any, tuple[int, ...], int, int]] = {}
        for name, t in header.items():
            self.tensors[name] = self._entry(name, t)
        # like the safetensors library: the tensors tile the data exactly, in offset order, with no
        # overlap and no gap (an overlapping entry would read one tensor's bytes as another's)
        at = 0
        for name, (_, _, b, e) in sorted(self.tensors.items(), key=lambda kv: kv[1][2:]):
            if b != at:
                how = "overlap the tensor before" if b < at else "leave a gap after the tensor before"
                raise CheckpointError(f"{self.path}: tensor {name!r} data_offsets [{b}, {e}] {how} (expected it "
                                      f"to start at byte {at})")
            at = e
        if self.data_start + at != size:
            raise CheckpointError(f"{self.path}: {'truncated' if self.data_start + at > size else 'corrupt'} "
                                  f"safetensors file (its tensors end at byte {self.data_start + at}, the file "
                                  f"has {size} bytes)")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size else None

    def _entry(self, name: str, t) -> tuple[Any, tuple[int, ...], int, int]:
        """One header entry, checked: dtype known, shape and offsets non-negative integers that agree."""
        if isinstance(t, dict) and t.get("dtype") is not None and t["dtype"] not in ST_DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {t['dtype']!r} "
                                  f"(expected one of {', '.join(ST_DTYPES)})")
        ok = isinstance(t, dict) and t.get("dtype") in ST_DTYPES and isinstance(t.get("shape"), list) \
            and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2 \
            and all(type(v) is int and v >= 0 for v in [*t["shape"], *t["data_offsets"]])
        if not ok:
            raise CheckpointError(f"{self.path}: tensor {name!r} has an unreadable header entry {t} (expected "
                                  "dtype, shape: [non-negative ints], data_offsets: [begin, end])")
        dt, shape, (b, e) = ST_DTYPES[t["dtype"]], tuple(t["shape"]), t["data_offsets"]
        if e < b or e - b != int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize:
            raise CheckpointError(f"{self.path}: tensor {name!r} header is inconsistent "
                                  f"(shape {list(shape)} {t['dtype']} vs data_offsets [{b}, {e}])")
        return dt, shape, b, e

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][1]

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(self.tensors[name][0])

    def get(self, name: str) -> np.ndarray:
        """A read-only zero-copy view of tensor `name` (pages are read from disk only when touched)."""
        dt, shape, b, e = self.tensors[name]
        return self._map[self.data_start + b:self.data_start + e].view(dt).reshape(shape)

    def release(self, name: str, rows: tuple[int, int] | None = None) -> None:
        """Drop this process's mapped pages of tensor `name`, or of its rows [r0, r1) along axis 0
        (they stay in the page cache and are re-read if touched again), so a load's resident memory
        is what it owns, not the file pages its copies touched."""
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if self._map is None or advice is None:
            return
        _, shape, b, e = self.tensors[name]
        if rows is not None and shape:
            row = (e - b) // shape[0] if shape[0] else 0
            b, e = b + rows[0] * row, b + rows[1] * row
        # madvise wants page alignment; dropping a neighbour's page is harmless (re-read if touched)
        start = (self.data_start + b) // mmap.PAGESIZE * mmap.PAGESIZE
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
                if name not in self._where or self._where[name].path.name != fname:
                    raise CheckpointError(f"{index}: tensor {name!r} is mapped to {fname!r} but that file "
                                          "does not contain it" + (f" ({self._where[name].path.name} does)"
                                                                   if name in self._where else ""))
        else:
            for shard in _torch_shards(self.path, allow_pickle):
                for name in shard.names:
                    self._where[name] = shard

    def _add_file(self, path: Path):
        f = SafetensorsFile(path)
        for name in f.tensors:
            self._where[name] = f

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].shape(name)

    def dtype(self, name: str) -> np.dtype:
        return self._where[name].dtype(name)

    def get(self, name: str) -> np.ndarray:
        return self._where[name].get(name)

    def release(self, name: str, rows: tuple[int, int] | None = None) -> None:
        self._where[name].release(name, rows)


PICKLE_INDEX = "pytorch_model.bin.index.json"


class TorchShard:
    """One pickled PyTorch shard (`torch.save`'s zip format), opened memory-mapped with
    `torch.load(weights_only=True)` (tensors only: no code in the pickle runs) when a tensor is first
    asked for, and closed once every tensor of it has been released, so one shard is open at a time
    when tensors are read shard by shard."""

    def __init__(self, path: Path, names: list[str] | None = None):
        self.path = path
        self._sd, self._meta = None, {}
        self.names = list(names) if names is not None else list(self._open())
        self._pending = set(self.names)

    def _open(self) -> dict:
        if self._sd is None:
            import torch  # optional: only to read pickled .bin shards the user allowed
            try:
                sd = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # torch raises many types (UnpicklingError, RuntimeError, ...)
                raise CheckpointError(f"{self.path}: cannot read PyTorch weights ({type(e).__name__}: "
                                      f"{str(e).splitlines()[0] if str(e) else ''})") from None
            if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
                raise CheckpointError(f"{self.path}: expected a state dict (tensor name -> tensor), "
                                      f"found {type(sd).__name__}")
            self._sd = sd
            self._meta.update({k: (tuple(v.shape), _torch_dtype(v)) for k, v in sd.items()})
        return self._sd

    def _info(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        if name not in self._meta:  # shapes are read once; the file is closed again unless being read
            reading = self._sd is not None
            self._open()
            if not reading:
                self._sd = None
        if name not in self._meta:
            raise CheckpointError(f"{self.path}: tensor {name!r} is listed in {PICKLE_INDEX} but not in this file")
        return self._meta[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info(name)[0]

    def dtype(self, name: str) -> np.dtype:
        return self._info(name)[1]

    def get(self, name: str) -> np.ndarray:
        sd = self._open()
        self._info(name)  # the index may list a tensor the file lacks: one error, in one place
        return _torch_np(sd[name])

    def release(self, name: str, rows=None) -> None:
        if rows is None:
            self._pending.discard(name)
        if not self._pending:
            self._sd = None  # unmaps the file


def _torch_shards(path: Path, allow_pickle: bool) -> list[TorchShard]:
    """The pickled shards of a directory (index + shards, or every pytorch_model*.bin), checked."""
    index = path / PICKLE_INDEX
    if index.is_file():
        wm = _read_weight_map(index)
        files = {}
        for name, fname in wm.items():
            files.setdefault(fname, []).append(name)
        bins = [path / f for f in files]
        for b in bins:
            if not b.is_file():
                raise CheckpointError(f"{index}: shard {b.name!r} listed in weight_map is missing")
    else:
        files = None
        bins = sorted(path.glob("pytorch_model*.bin")) or sorted(path.glob("*.bin"))
    if not bins:
        found = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        raise CheckpointError(f"{path}: no model.safetensors, model.safetensors.index.json or "
                              f"pytorch_model*.bin found (files: {found})")
    if not allow_pickle:
        raise CheckpointError(
            f"{bins[0]}: pickled PyTorch weights are refused (a .bin can run code when loaded without "
            "care): pass --allow-pickle (allow_pickle=True in Python) if you trust the source, or "
            "rewrite it once as safetensors with `amdllm convert --allow-pickle --model SRC --out DST`")
    for b in bins:
        if not zipfile.is_zipfile(b):
            raise CheckpointError(f"{b}: not a zip-format PyTorch file (a legacy pickle from PyTorch < 1.6, "
                                  "or not PyTorch weights): it cannot be memory-mapped or read tensors-only; "
                                  "re-save it with torch.save from PyTorch >= 1.6")
    return [TorchShard(b, files[b.name] if files else None) for b in bins]


def _torch_dtype(t) -> np.dtype:
    import torch  # optional: only for tensors from pickled .bin shards
    return np.dtype(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t[:0].numpy().dtype


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        wm = json.loads(index.read_text())["weight_map"]
        assert isinstance(wm, dict) and all(isinstance(f, str) for f in wm.values())
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, AssertionError, TypeError):
        raise CheckpointError(f"{index}: not a valid index (expected JSON with a 'weight_map' object of "
                              "tensor name -> shard file name)") from None
    for name, fname in wm.items():
        # a shard is a file name in this directory (checked by name, not by resolving links: a Hub cache
        # snapshot's files are links into its blobs/ folder)
        if not fname or Path(fname).is_absolute() or ".." in Path(fname).parts or "\\" in fname:
            raise CheckpointError(f"{index}: tensor {name!r} is mapped to {fname!r}, outside the checkpoint "
                                  "directory (expected a shard file name in it)")
    return wm


def _torch_np(t) -> np.ndarray:
    import torch  # optional: only for tensors from pickled .bin shards
    if t.dtype == torch.bfloat16:  # numpy has no bf16: reinterpret the bits
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def load_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of one .safetensors file as numpy (bf16 as ml_dtypes.bfloat16); for small files."""
    f = SafetensorsFile(Path(path))
    return {name: np.array(f.get(name)) for name in f.tensors}



# ------------------------------------------------------------------------------------------------
# writing
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
            f.write(a.reshape(-1).view(np.uint8).data)  # no copy; little-endian wherever JAX runs


def save_tensors(path, tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> None:
    """Write a dict of arrays (numpy or jax, bf16 included) as one .safetensors file."""
    write_safetensors(path, [(k, tuple(np.shape(v)), np.dtype(v.dtype), lambda v=v: np.asarray(v))
                             for k, v in tensors.items()], metadata)



def write_sharded(path, entries: list[tuple[str, tuple[int, ...], Any, Callable[[], np.ndarray]]],
                  max_shard_size, desc: str | None = None) -> list[str]:
    """Write `entries` (as `write_safetensors`) into directory `path`: model.safetensors, or, above
    `max_shard_size` bytes, model-0000k-of-0000n.safetensors shards plus model.safetensors.index.json.
    Tensors go into files greedily in order, like transformers: a new file when the next would overflow.
    Weight files of an earlier save there are removed, so no loader picks up stale ones. Returns the names."""
    path, limit = Path(path), parse_size(max_shard_size)
    nbytes = lambda e: int(np.prod(e[1], dtype=np.int64)) * np.dtype(e[2]).itemsize  # noqa: E731
    shards, size = [[]], 0
    for e in entries:
        if shards[-1] and size + nbytes(e) > limit:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes(e)
    path.mkdir(parents=True, exist_ok=True)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    for fname, shard in tqdm(list(zip(names, shards)), desc=desc or f"writing {path.name}", leave=False):
        write_safetensors(path / fname, shard, {"format": "pt"})
    index = path / "model.safetensors.index.json"
    if len(shards) > 1:
        wm = {e[0]: fname for fname, shard in zip(names, shards) for e in shard}
        meta = {"metadata": {"total_size": sum(map(nbytes, entries))}, "weight_map": wm}
        atomic_write_text(index, json.dumps(meta, indent=2) + "\n")
    for old in list(path.glob("model*.safetensors")) + ([index] if len(shards) == 1 else []):
        if old.name not in names and old.exists() and (old.name == index.name or re.fullmatch(
                r"model(-\d{5}-of-\d{5})?\.safetensors", old.name)):
            old.unlink()
    return names
