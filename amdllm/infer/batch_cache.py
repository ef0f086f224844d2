"""The serving engine's KV cache as a batch: edits of its rows and slots, and how it is held between steps.

A cache part is stacked [L, B, Hkv, S, hd] (a scanned prefill's) or per-layer, a tuple of [B, Hkv, S, hd]
(the decode step's views); each edit here does the same to both. `amdllm.infer.engine` moves rows, shifts
and grows slots with them; `HeldCache` says in which dtype the parts wait between steps.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def row_of(c, row, n=1):
    """Rows [row, row + n) of a cache part."""
    if isinstance(c, tuple):
        return tuple(jax.lax.dynamic_slice_in_dim(x, row, n, axis=0) for x in c)
    return jax.lax.dynamic_slice_in_dim(c, row, n, axis=1)


def put_row(c, sub, row):
    """c with `sub` (a `row_of` result) written at rows [row, row + its rows)."""
    if isinstance(c, tuple):
        return tuple(jax.lax.dynamic_update_slice_in_dim(x, s, row, axis=0) for x, s in zip(c, sub))
    return jax.lax.dynamic_update_slice_in_dim(c, sub, row, axis=1)


def roll_slots(c, m):
    """Every row's slots rolled by m (negative: to the left)."""
    return tuple(jnp.roll(x, m, axis=2) for x in c) if isinstance(c, tuple) else jnp.roll(c, m, axis=3)


def pad_slots(c, n):
    """n more (zero) slots at the end of every row."""
    pad = lambda x, axis: jnp.pad(x, [(0, n if a == axis else 0) for a in range(x.ndim)])  # noqa: E731
    return tuple(pad(x, 2) for x in c) if isinstance(c, tuple) else pad(c, 3)


class HeldCache:
    """How the engine keeps its cache's keys and values between steps: on a CPU, bfloat16/float16 ones as
    their bits (uint16), read back as floats only for the rows a step runs. XLA:CPU has no narrow
    dynamic-update-slice: writing a step's rows back into a bf16 [B, Hkv, S, hd] cache widens the whole
    buffer to float32 and back, per layer; in uint16 it is written in place. The moves, shifts and growth
    that keep the batch in place work on the bits as they are (zero bits are 0.0)."""

    def __init__(self, dtype):
        dt = jnp.dtype(dtype)
        self.narrow = jax.default_backend() == "cpu" and jnp.issubdtype(dt, jnp.floating) and dt.itemsize == 2

    def hold(self, x):
        return jax.lax.bitcast_convert_type(x, jnp.uint16) if self.narrow else x

    def release(self, x, dtype):
        return jax.lax.bitcast_convert_type(x, dtype) if self.narrow else x
