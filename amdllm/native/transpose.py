"""The checkpoint reader's and writers' 2-D transposes (HF stores kernels [out, in], amdllm [in, out]), in
`transpose.cc` through ctypes where it builds, else numpy. A host-side copy: unlike the XLA kernels of
`amdllm.native` it runs whatever JAX's back end is (a GPU machine loads its checkpoints on the CPU too)."""
from __future__ import annotations

import ctypes
import functools
import warnings
from pathlib import Path

import numpy as np

from amdllm.native.toolchain import build, disabled

TRANSPOSE_SOURCE = Path(__file__).with_name("transpose.cc")


@functools.cache
def _transpose_lib():
    """transpose.cc's functions by element size, or None (one warning says why)."""
    if disabled():
        return None
    try:
        lib = ctypes.cdll.LoadLibrary(str(build(TRANSPOSE_SOURCE)))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"amdllm.native: the transpose kernel is off ({e}); checkpoints are transposed by numpy "
                      "(several times slower). AMDLLM_NATIVE=0 silences this.", RuntimeWarning, stacklevel=3)
        return None
    fns = {}
    for size in (2, 4):
        fn = getattr(lib, f"amdllm_transpose_{size}")
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_int64]
        fn.restype = None
        fns[size] = fn
    return fns


def transpose_into(dst: np.ndarray, src: np.ndarray) -> bool:
    """dst[...] = src.T for 2-D arrays of one dtype of 2 or 4 bytes whose rows are strided and whose
    elements are contiguous (any row stride: slices of larger arrays, memory-mapped files), in
    `transpose.cc`. False, having done nothing, where it does not apply or the kernel is not available:
    the caller copies with numpy."""
    size = src.dtype.itemsize
    if (src.ndim != 2 or dst.shape != src.shape[::-1] or dst.dtype != src.dtype or size not in (2, 4)
            or src.strides[1] != size or dst.strides[1] != size or min(src.strides[0], dst.strides[0]) <= 0
            or src.strides[0] % size or dst.strides[0] % size or not dst.flags.writeable):
        return False
    fns = _transpose_lib()
    if fns is None:
        return False
    if src.size:
        fns[size](src.ctypes.data, src.shape[0], src.shape[1], src.strides[0] // size, dst.ctypes.data,
                  dst.strides[0] // size)
    return True


def copy_transposed(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src.T (cast to dst's dtype): `transpose_into` where it applies, else numpy."""
    if not transpose_into(dst, src):
        dst[...] = src.T


def transposed(a: np.ndarray) -> np.ndarray:
    """A contiguous copy of the 2-D array a.T (`copy_transposed`)."""
    t = np.empty(a.shape[::-1], a.dtype)
    copy_transposed(t, a)
    return t
