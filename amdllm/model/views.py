"""Per-layer layouts of the stacked layer weights and of the KV cache: zero-copy views on a CPU, static
slices inside a jitted step on a GPU (`layer_slices`).

The model keeps its layers stacked, [L, ...] per parameter, so that `lax.scan` runs them (one compiled
layer, any depth). On a CPU two things pay for that stack:
  * a decode step reads a few rows' worth of work per weight, and XLA copies every layer's slice out of
    the stack first: most of a decode step's time;
  * a training step's scan stacks each layer's residuals into [L, ...] buffers that XLA zero-fills,
    writes a slice at a time and reads back in the backward.
Here the stack is seen as L per-layer dicts of zero-copy views (`layer_views`, `step_views`), which
`amdllm.model.fast.forward` runs as an unrolled loop, and the cache as L per-layer arrays
(`init_cache(per_layer=True)`, `split_cache`). No memory is spent: we check that no view is a copy.
Where that does not hold (an accelerator, a sharded array) the view functions say None and the scan runs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from amdllm import native
import amdllm.cpu as cpu
from amdllm.config import LlamaConfig
import amdllm.model.llama as llama
from amdllm.model.dense import hold_dense
from amdllm.model.llama import KVCache
from amdllm.model.narrow import Bits, bf16_bits, has_bits, native_decodes


def init_cache(cfg: LlamaConfig, batch: int, max_len: int, dtype=jnp.float32, per_layer: bool = False
               ) -> KVCache:
    """`llama.init_cache`, or with per_layer=True one [B, Hkv, S, hd] array per layer (for `layer_views`)."""
    cache = llama.init_cache(cfg, batch, max_len, dtype)
    return split_cache(cache) if per_layer else cache


def layer_slices(layers) -> list:
    """Stacked layer weights [L, ...] as L per-layer pytrees of the slices a[i]. Inside jit these are static
    slices that XLA reads where they lie (the decode step on a GPU: `Decoder(unstack=)`,
    `Engine(unstack=True)`); outside jit each is a copy."""
    L = jax.tree.leaves(layers)[0].shape[0]
    return [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(L)]


def split_cache(cache: KVCache) -> KVCache:
    """A stacked cache as per-layer tuples (inside a jit: one copy; e.g. after a scanned prefill)."""
    if isinstance(cache.k, (tuple, list)):
        return cache
    L = cache.k.shape[0]
    return KVCache(tuple(cache.k[i] for i in range(L)), tuple(cache.v[i] for i in range(L)), cache.valid)


def layer_views(layers: dict, rows: int = 1) -> list[dict] | None:
    """Stacked layer weights [L, ...] as L per-layer dicts that share their memory, or None; for a decode
    step of `rows` rows.

    On the CPU, `jax.device_put` of a numpy view of an array's buffer makes no copy, and we check that it
    did not. None where that does not hold (an accelerator, a sharded array, a copy made): the decode
    step then scans the stacked weights. Narrow weights (`Bits`) are viewed only where every kernel runs
    in the native kernel at this many rows (`narrow.native_rows_for`): unrolled, XLA would widen every
    layer's bits up front, where the scan widens one at a time. Float32 projections come back as
    `dense.Dense` where the float32 row kernel takes `rows` rows (`dense.hold_dense`)."""
    if has_bits(layers) and not _native_at(layers, rows):
        return None
    views = _views(layers)
    return None if views is None else [hold_dense(v, rows) for v in views]


def _views(layers: dict) -> list[dict] | None:
    """Stacked layer weights [L, ...] as L per-layer pytrees of zero-copy views, or None (not a CPU, a
    sharded array, a copy made)."""
    if jax.default_backend() != "cpu":
        return None
    leaves, treedef = jax.tree.flatten(layers)
    if not leaves or any(not isinstance(a, jax.Array) or len(a.sharding.device_set) != 1 for a in leaves):
        return None
    host = [np.asarray(a) for a in leaves]  # zero-copy on the CPU
    devices = [next(iter(a.sharding.device_set)) for a in leaves]
    L, n = leaves[0].shape[0], len(leaves)
    slices = [h[i] for i in range(L) for h in host]
    views = jax.device_put(slices, devices * L)  # one call for all L x n slices: half the time of one each
    if any(v.unsafe_buffer_pointer() != h.ctypes.data for v, h in zip(views, slices)):
        return None  # copied (e.g. a misaligned slice): not worth the memory
    return [jax.tree.unflatten(treedef, views[i * n:(i + 1) * n]) for i in range(L)]


def step_views(layers) -> list[dict] | None:
    """The stacked layer weights of a frozen base as per-layer views (`layer_views`) for a training or
    evaluation step on a CPU, or None where the step scans the stack.

    Why: a scan stacks each layer's residuals into [L, ...] buffers, which XLA zero-fills, writes one slice
    a layer and reads back in the backward. In a profile of the 31M LoRA step that was ~150 ms of 1.55 s
    (zero fills 58, slice writes 57, slice reads 41); unrolled over views each residual is a buffer of its
    own, and no weight is copied out of the stack. Only where the step runs on the calling thread
    (`amdllm.cpu.run_on_caller`): dispatched to XLA's worker thread, the unrolled step's temporaries were
    mapped afresh and faulted in on every other step (1.5 against 2.0-2.8 s).
    A bfloat16 base (as `Bits`) too where the tile kernel runs (`native.tiles_available`): its products
    read each layer's bits where they lie, so nothing is widened (1B LoRA step, 2-core Intel Xeon with
    AMX: 108-116 tokens/s scanned, 117-128 unrolled; docs/benchmark-history.md, "the 1B bf16 step's
    attention and head"). Off for other narrow bases, which the scan widens one layer at a time, and for
    sharded weights. Compile time grows with depth. Same numbers as the scan (tests/test_fast.py);
    docs/benchmark-history.md, "per-layer training step"."""
    if not isinstance(layers, dict) or not cpu.runs_on_caller():
        return None
    if has_bits(layers):
        return _views(layers) if bf16_bits(layers) and native.tiles_available() else None
    # no `hold_dense`: its row kernel is for decoding's few rows
    return _views(layers) if _float32(layers) else None


def _float32(layers) -> bool:
    """Whether every array in `layers` is float32 (no narrow weights, no GPTQ words)."""
    return all(jnp.dtype(a.dtype) == jnp.float32 for a in jax.tree.leaves(layers))


def _native_at(layers, rows: int) -> bool:
    """Whether every stacked narrow kernel in `layers` takes `rows` rows in the native kernel."""
    stacked = [a for a in jax.tree.leaves(layers, is_leaf=lambda a: isinstance(a, Bits)) if isinstance(a, Bits)]
    return all(native_decodes(a.dtype, rows) for a in stacked if a.bits.ndim == 3)


def prefill_layers(layers, views, rows: int):
    """What a prefill of `rows` rows runs over: the per-layer `views` (`layer_views`) of float32 weights, or
    of narrow bits that every kernel takes at this many rows in the native kernel; else the stacked `layers`
    (a scan). Anything XLA would widen or dequantize (other narrow bits, narrow arrays, GPTQ's packed
    words) is scanned: unrolled, XLA does that to every layer up front, where the scan does one at a time.
    Unrolled, each product reads its layer's weights where they lie; the scan copies each layer's slice out
    of the stack first (1B shape, bf16, 2-core EPYC, one 16-token prompt: 0.40 s against 0.82 s scanned,
    and 1.0-1.3 s widening every matrix to float32; the 31M benchmark model in float32 on a 2-core Intel
    Xeon, 8 x 32 prompt tokens: 57 against 64 ms to the first token; docs/benchmark-history.md)."""
    if views is None:
        return layers
    if has_bits(layers):
        return views if _native_at(layers, rows) else layers
    return views if _float32(layers) else layers
