"""The row kernel (`rows.cc`): a few float32 rows times bfloat16 weights read as they lie, called from XLA
through its FFI. Built on first use (`toolchain`); where it cannot be, `available()` is False and one
warning says why."""
from __future__ import annotations

import ctypes
import functools
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

from amdllm.backends.cpu.toolchain import build

SOURCE = Path(__file__).with_name("rows.cc")
MAX_ROWS = 64  # rows.cc kMaxRows: the most rows of x `rows_times` takes
TARGETS = {False: "amdllm_bf16_rows_kn", True: "amdllm_bf16_rows_nk"}  # by `transposed`
SYMBOLS = {False: "Bf16RowsKn", True: "Bf16RowsNk"}


@functools.cache
def available() -> bool:
    """Whether the kernel runs here: built and registered with XLA (one warning says why not)."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(build(SOURCE)))
        for transposed, name in TARGETS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, SYMBOLS[transposed])), platform="cpu")
    except (RuntimeError, OSError, AttributeError) as e:
        warnings.warn(f"amdllm.backends.cpu: the bf16 row kernel is off ({e}); bfloat16 models decode in "
                      "float32 instead. AMDLLM_BACKEND=off silences this.", RuntimeWarning, stacklevel=2)
        return False
    return True


def rows_times(x2, bits, transposed: bool = False):
    """x2 [M, K] (1 <= M <= MAX_ROWS) times the bfloat16 matrix whose bits (uint16) are `bits` [K, N]
    ([N, K] if transposed: a tied head's embedding table) -> float32 [M, N]. No gradient."""
    if not available():
        raise RuntimeError("amdllm.backends.cpu: the bf16 row kernel is not available here (its warning says why)")
    n = bits.shape[0] if transposed else bits.shape[1]
    out = jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(TARGETS[transposed], out, vmap_method="sequential")(x2.astype(jnp.float32), bits)
