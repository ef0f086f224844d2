"""Float32 weights times a few rows on a CPU: a decode step's products in the native kernel.

Decoding a float32 model multiplies B rows (one per sequence) by every weight matrix. XLA:CPU's float32
dots of 8 rows read the weights at about half the rate of one row's (10-16 against 24-28 GB/s on a
2-core AMD EPYC Zen 4), so a batch of 8 took twice as long a step as one sequence; `native.f32_rows_times`
keeps the sums in registers down a band of the weights' rows instead (31M benchmark model, same CPU: an
8-row step 9.9-10.3 -> 8.0-8.5 ms; a 1-row step unchanged within the noise, about 4.9 ms;
docs/benchmark-history.md, "float32 decoding").

  * `hold_dense`: a decode step's per-layer float32 kernels (`amdllm.model.views.layer_views`) as `Dense`,
    which `layers.linear` hands its rows (`Dense.matmul`).
  * `dense_rows_for`: whether a product runs there; the output head asks it too (`narrow.head_blocked`).
Up to `native.F32_MAX_ROWS` rows, float32 operands, on the CPU back end where the kernel was built; XLA's
dot otherwise. Differentiable (`native.f32_rows_times`), though only inference wraps its weights.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from amdllm import native
from amdllm.model.llama import PROJECTIONS


@jax.tree_util.register_pytree_node_class
class Dense:
    """A float32 kernel [in, out] whose products with a few rows run in the native kernel."""

    def __init__(self, w):
        self.w = w

    def tree_flatten(self):
        return (self.w,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(children[0])

    @property
    def shape(self):
        return self.w.shape

    @property
    def dtype(self):
        return self.w.dtype

    def matmul(self, x2):
        """x2 [M, in] @ w [in, out] -> [M, out] in x2's dtype (`layers.linear`)."""
        if dense_rows_for(self.w, x2):
            return native.f32_rows_times(x2, self.w)
        return x2 @ self.w.astype(x2.dtype)


def dense_rows_for(w, x2) -> bool:
    """Whether x2 [M, K] times w [K, N] runs in `native.f32_rows_times`: both float32, 1 <= M <=
    F32_MAX_ROWS, on the CPU back end, and the kernel built here (`native.available`)."""
    return (getattr(w, "ndim", 0) == 2 and w.dtype == jnp.float32 and x2.dtype == jnp.float32
            and 1 <= x2.shape[0] <= native.F32_MAX_ROWS and jax.default_backend() == "cpu" and native.available())


def hold_dense(layer: dict, rows: int) -> dict:
    """One layer's parameters with its float32 projection kernels as `Dense`, where a product of `rows`
    rows runs in the native kernel; the rest (LoRA factors, norms, narrow or GPTQ kernels) as they are."""
    probe = jax.ShapeDtypeStruct((rows, 1), jnp.float32)
    return {k: Dense(v) if k in PROJECTIONS and dense_rows_for(v, probe) else v for k, v in layer.items()}
