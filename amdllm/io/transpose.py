"""The checkpoint reader's and writers' 2-D transposes (HF stores kernels [out, in], amdllm [in, out]).

numpy copies a transposed view an element at a time along the destination's rows, reading the source a
column at a time; by bands of BAND source rows each read is a short contiguous run, several times faster.
Same-size dtypes are moved as unsigned integers (bfloat16 has no fast numpy copy of its own)."""
from __future__ import annotations

import numpy as np

BAND = 16
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def copy_transposed(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src.T (cast to dst's dtype) for 2-D arrays, any strides."""
    if src.ndim != 2 or dst.shape != src.shape[::-1]:
        dst[...] = src.T
        return
    if dst.dtype == src.dtype and src.dtype.itemsize in UINT:
        u = UINT[src.dtype.itemsize]
        src, dst = src.view(u), dst.view(u)
    for i in range(0, src.shape[0], BAND):
        dst[:, i:i + BAND] = src[i:i + BAND].T


def transposed(a: np.ndarray) -> np.ndarray:
    """A contiguous copy of the 2-D array a.T."""
    t = np.empty(a.shape[::-1], a.dtype)
    copy_transposed(t, a)
    return t
