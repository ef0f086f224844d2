"""The CPU backend: what decoding on XLA:CPU gains beyond the plain-JAX core (BENCHMARKS.md, "The CPU
backend", has both figures). `amdllm.backends` is the only caller.

  * per-layer zero-copy views of the stacked weights: a decode step reads each layer where it lies, where
    a scan copies each layer's slice out of the stack first;
  * the bf16 row kernel (`native`, C++): a few rows times bfloat16 weights, read as bfloat16;
  * XLA:CPU's options for a small model's decode step (XNNPACK off).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from amdllm.backends.cpu import native
from amdllm.model.narrow import has_bits, is_bits

PREFILL_MAX_ROWS = 32  # a prefill of up to this many rows runs over the row kernel; more rows scan
SMALL_HIDDEN = 1024    # below this hidden size XNNPACK slows a decode step; above, XLA's defaults win


@jax.tree_util.register_pytree_node_class
class RowBits:
    """bfloat16 weights [K, N] (or a tied table [N, K], `transposed`) as bits, whose products of a few
    rows run in the row kernel; more rows widen them first (`layers.linear` calls `matmul`)."""

    def __init__(self, bits, transposed: bool = False):
        self.bits, self.transposed = bits, transposed

    def tree_flatten(self):
        return (self.bits,), self.transposed

    @classmethod
    def tree_unflatten(cls, transposed, children):
        return cls(children[0], transposed)

    @property
    def shape(self):
        return self.bits.shape[::-1] if self.transposed else self.bits.shape

    def matmul(self, x2):
        if x2.shape[0] <= native.MAX_ROWS:
            return native.rows_times(x2, self.bits, self.transposed).astype(x2.dtype)
        w = jax.lax.bitcast_convert_type(self.bits, jnp.bfloat16).astype(x2.dtype)
        return x2 @ (w.T if self.transposed else w)


def _views(layers: dict) -> list[dict] | None:
    """Stacked weights [L, ...] as L per-layer dicts of zero-copy views, or None (a sharded array, a copy)."""
    leaves, treedef = jax.tree.flatten(layers)
    if not leaves or any(not isinstance(a, jax.Array) or len(a.sharding.device_set) != 1 for a in leaves):
        return None
    host = [np.asarray(a) for a in leaves]  # zero-copy on the CPU
    devices = [next(iter(a.sharding.device_set)) for a in leaves]
    L, n = leaves[0].shape[0], len(leaves)
    slices = [h[i] for i in range(L) for h in host]
    views = jax.device_put(slices, devices * L, may_alias=True)
    if any(v.unsafe_buffer_pointer() != h.ctypes.data for v, h in zip(views, slices)):
        return None  # copied (e.g. a misaligned slice): not worth the memory
    return [jax.tree.unflatten(treedef, views[i * n:(i + 1) * n]) for i in range(L)]


def _kernel_bits(a) -> bool:
    return is_bits(a) and a.ndim == 3 and a.dtype == jnp.bfloat16


def prepare(top: dict, layers: dict, rows: int) -> tuple[dict, list | dict, int]:
    """(top, layers a decode step of `rows` rows runs, the most rows a prefill runs over them too) from
    inference weights (`narrow.inference_weights`). Float32 layers become per-layer views. bfloat16 ones
    too where the row kernel runs, their kernels as `RowBits`; other narrow or GPTQ weights stay stacked:
    unrolled, XLA would widen or dequantize every layer up front, where the scan does one at a time."""
    leaves = jax.tree.leaves(layers, is_leaf=is_bits)
    if not has_bits(layers):
        float32 = all(jnp.dtype(a.dtype) == jnp.float32 for a in leaves)
        views = _views(layers) if float32 else None
        return top, (layers if views is None else views), (0 if views is None else 1 << 30)
    kernels = [a for a in leaves if is_bits(a) and a.ndim == 3]
    if not (all(_kernel_bits(a) for a in kernels) and rows <= native.MAX_ROWS and native.available()):
        return top, layers, 0
    raw = jax.tree.map(lambda a: a.bits if _kernel_bits(a) else a, layers, is_leaf=is_bits)
    views = _views(raw)
    if views is None:
        return top, layers, 0
    views = [{k: RowBits(v) if _kernel_bits(layers[k]) else v for k, v in p.items()} for p in views]
    table, tied = (top["embed_tokens"], True) if "lm_head" not in top else (top["lm_head"], False)
    if is_bits(table) and table.dtype == jnp.bfloat16:
        top = {**top, "lm_head": RowBits(table.bits, transposed=tied)}  # the head through the row kernel
    return top, views, PREFILL_MAX_ROWS


def compiler_options(kind: str, hidden_size: int) -> dict | None:
    """XLA:CPU options for a jitted decode step: XNNPACK and its fusions off for a small model."""
    if kind == "decode" and hidden_size < SMALL_HIDDEN:
        return {"xla_cpu_use_xnnpack": False, "xla_cpu_experimental_ynn_fusion_type": ""}
    return None


def decodes_bf16() -> bool:
    """Whether bfloat16 weights decode fast here (the row kernel runs), so `--dtype auto` keeps them."""
    return native.available()


def describe() -> dict:
    return {"backend": "cpu", "row_kernel": native.available()}

