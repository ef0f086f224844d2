"""A C++ kernel that XLA calls (XLA's FFI): a few float32 rows times bfloat16 weights, read as they lie.

Decoding multiplies one row, or a few, by every weight matrix, so a decode step takes as long as reading
the weights. XLA:CPU has no fast bfloat16 matrix-vector product (1.1-2.2 GB/s of weights on a 2-core Xeon
with AVX-512 BF16, against about 20 GB/s for float32; docs/benchmark-history.md, "Decoding and prefill"),
so a bf16 checkpoint decoded in float32 (twice the bytes) or widened every layer for every token.
`bf16_rows.cc` widens each weight in a register on its way into a float32 multiply-add: half the bytes of a
float32 product and the same sums, since bfloat16 -> float32 is exact.

`rows_times(x2, bits)` is the entry point; `amdllm.model.narrow` decides where it runs. The library is
compiled on first use with the host's C++ compiler (`$CXX`, else g++ or c++; about 5 s, once per
machine) into `$AMDLLM_CACHE/native` (default ~/.cache/amdllm/native) and loaded from there afterwards.
Where it cannot be built (no compiler, another platform) `available()` is False, one warning says why, and
decoding keeps XLA's way. `AMDLLM_NATIVE=0` turns it off (to compare the two).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

from amdllm.cpu import cpu_flags


SOURCE = Path(__file__).with_name("bf16_rows.cc")
MAX_ROWS = 8  # bf16_rows.cc kMaxRows
TARGETS = {False: "amdllm_bf16_rows_kn", True: "amdllm_bf16_rows_nk"}  # by `transposed`
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")


def cache_dir() -> Path:
    root = os.environ.get("AMDLLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "amdllm")
    return Path(root) / "native"


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def library_name(cxx: str) -> str:
    """The built library's file name: one per source, jaxlib, compiler and CPU (-march=native code may not
    run on another CPU that shares the cache directory)."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), jaxlib.__version__.encode(), cxx.encode(), " ".join(FLAGS).encode(),
                 platform.machine().encode(), " ".join(sorted(cpu_flags())).encode()):
        key.update(part)
        key.update(b"\0")
    return f"bf16_rows-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """The compiled library's path, compiled now if it is not in the cache. Raises RuntimeError with the
    reason (one line) where it cannot be built."""
    if platform.system() != "Linux":
        raise RuntimeError(f"built on Linux only, this is {platform.system()}")
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, g++, c++ or clang++)")
    out = cache_dir() / library_name(cxx)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)  # same directory: the rename is atomic
    os.close(fd)
    try:
        cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            first = next((ln for ln in done.stderr.splitlines() if "error" in ln), done.stderr.strip()[:200])
            raise RuntimeError(f"{Path(cxx).name} failed on {SOURCE.name}: {first}")
        os.replace(tmp, out)  # several processes building at once: each renames a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def available() -> bool:
    """Whether the kernel runs here: the CPU back end, AMDLLM_NATIVE not 0, and the library built and
    registered with XLA (a warning says why not, once)."""
    if os.environ.get("AMDLLM_NATIVE", "").strip() == "0" or jax.default_backend() != "cpu":
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
        jax.ffi.register_ffi_target(TARGETS[False], jax.ffi.pycapsule(lib.Bf16RowsKn), platform="cpu")
        jax.ffi.register_ffi_target(TARGETS[True], jax.ffi.pycapsule(lib.Bf16RowsNk), platform="cpu")
    except (RuntimeError, OSError, AttributeError) as e:
        warnings.warn(f"amdllm.native: the bf16 row kernel is off ({e}); bfloat16 weights are decoded "
                      "through XLA, which widens them to float32 every token (slower). AMDLLM_NATIVE=0 "
                      "silences this.", RuntimeWarning, stacklevel=2)
        return False
    return True


def _call(x2, bits, transposed: bool):
    if not available():  # also what registers the kernel with XLA, once per process
        raise RuntimeError("amdllm.native: the bf16 row kernel is not available here (its warning says why)")
    n = bits.shape[0] if transposed else bits.shape[1]
    out = jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(TARGETS[transposed], out, vmap_method="sequential")(x2.astype(jnp.float32), bits)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rows_times(x2, bits, transposed: bool = False):
    """x2 [M, K] (1 <= M <= MAX_ROWS) times the bfloat16 matrix whose bits (uint16) are `bits` [K, N]
    ([N, K] if transposed, as a tied head's embedding table) -> float32 [M, N]. The weights are frozen:
    the backward gives x2's gradient only, by the other layout's kernel on the same bits. Where the kernel
    is not `available()`, a RuntimeError."""
    return _call(x2, bits, transposed)


def _rows_times_bwd(transposed, res, dy):
    bits, like = res  # like: an empty array of x2's dtype
    return _call(dy, bits, not transposed).astype(like.dtype), None  # [M, N] . W^T -> [M, K]


rows_times.defvjp(lambda x2, bits, transposed: (_call(x2, bits, transposed), (bits, x2[:0, :0])), _rows_times_bwd)
