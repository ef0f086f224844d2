"""Narrow weights (bfloat16, float16) on a CPU, where XLA:CPU widens every bf16 operand to float32.

  * Weights that are not differentiated (inference, a frozen LoRA base) travel as their bits (`carry_bits`,
    `Bits`), so the layer scan slices integers and one layer is widened at a time, not the whole stack.
  * The output head runs by vocabulary blocks (`head_blocked`, `token_nll_blocked`): a 128k-row head
    widened whole is 1 GB, and a batch of windows' [B, T, V] float32 logits as much again.
  * bf16 dots (`bf16_dot`): on a CPU with bf16 instructions (`amdllm.cpu.has_bf16_dots`), a bfloat16
    frozen base is multiplied as bf16 x bf16 -> float32, forward and backward, instead of being widened:
    XLA:CPU runs those dots about 2x faster than float32 (the 1B LoRA step: 43 -> 63-73 tokens/s). From
    BF16_DOT_MIN_ROWS rows up: decoding's one-row products stay widened, which is faster there.
    Where the CPU has AMX tiles, or else AVX-512 BF16, those products run in a C++ kernel instead
    (`amdllm.native.tiles_times`; at the 1B shape about 2x XLA's bf16 dots on AMX, about XLA's speed by
    VDPBF16PS), and it reads the layer scan's stacked weights in place (`hold_stacked`, `HeldBits`): no
    copy of each layer's slice, forward and backward. With AMX from TILES_MIN_ROWS rows up (a short
    prompt's prefill too); by VDPBF16PS from BF16_DOT_MIN_ROWS, as XLA's dots.
  * A few rows (decoding; a short prompt's prefill where there is no AMX: `native_max_rows`) times
    bfloat16 weights run in a C++ kernel that reads the weights as they lie (`amdllm.native.rows_times`;
    `native_rows_for`), where it could be built.
CPU only: elsewhere `carry_bits` leaves arrays as they are. `amdllm.model.fast` composes these into its
kernels (`fence`, `lookup`, the checkpoint policy) and its forward (`head_blocked`).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from amdllm import native
from amdllm.cpu import has_bf16_dots
from amdllm.model.dense import dense_rows_for
from amdllm.model.layers import head as llama_head


HEAD_BLOCK = 8192  # vocabulary rows per head block: [rows, 8192] float32 logits; 64 MB of float32 weights (D 2048)
HEAD_GEMV_MAX_ROWS = 1  # up to this many rows, a tied head multiplies the table as it lies (`head_product`)
BF16_DOT_MIN_ROWS = 64  # below this (decoding), XLA:CPU's bf16 dots lose to widening (1B shape: 2.5 vs 3.2 tokens/s)
# Where the row kernel (`native.rows_times`) runs: with AMX, up to DECODE_MAX_ROWS rows and every product
# of more rows on the tiles, a short prompt's prefill included (docs/benchmark-history.md, "Decoding and
# prefill"); without AMX, up to PREFILL_MAX_ROWS rows, so that a short prompt's prefill does not widen
# each weight matrix into a float32 copy either (`native_max_rows`)
DECODE_MAX_ROWS = 8
PREFILL_MAX_ROWS = 32
TILES_MIN_ROWS = DECODE_MAX_ROWS + 1


@jax.tree_util.register_pytree_node_class
class Bits:
    """A bfloat16/float16 array carried as its raw bits (uint16), so XLA:CPU does not widen it whole.

    XLA:CPU computes almost nothing in bfloat16 (bf16 dots into float32 on CPUs with bf16 instructions,
    `bf16_dot`, are the exception): it widens every narrow operand to float32, slicing included, so
    the layer scan's slice of the stacked weights becomes a slice of a float32 copy of the whole stack,
    which it then hoists out of the loop (a 2.47 GB bf16 1B model evaluated at 7.5 GB). Integers are
    sliced as they are: the scan slices the bits, and `fence` and `widen_for` turn one layer's slice back
    into floats.
    Bits have no gradient: only weights that are not differentiated (a frozen base, inference) use them."""

    def __init__(self, bits, dtype):
        self.bits, self.dtype = bits, jnp.dtype(dtype)

    def tree_flatten(self):
        return (self.bits,), self.dtype

    @classmethod
    def tree_unflatten(cls, dtype, children):
        return cls(children[0], dtype)

    @property
    def shape(self):
        return self.bits.shape

    def value(self):
        return jax.lax.bitcast_convert_type(self.bits, self.dtype)

    def after(self, y):
        """The same bits, read only once y exists (see `widen_for`)."""
        return Bits(self.bits | _zero_of(y, self.bits.dtype), self.dtype)

    def widen_for(self, x):
        """The floats, read only once `x` (the matmul's input) exists. XLA:CPU's scheduler otherwise
        widens all of a layer's kernels at the top of the layer, each into float32, so they sit side by
        side (1B bf16 decode step: 254 MB of scratch, where one MLP kernel is 67 MB). min(u, 0) is 0 for
        any unsigned u, but XLA does not fold it: OR-ing it in is exact and orders the read after x."""
        return jax.lax.bitcast_convert_type(self.bits | _zero_of(x, self.bits.dtype), self.dtype)

    def matmul(self, x2):
        """x2 [M, in] @ these weights [in, out] -> [M, out] in x2's dtype (`layers.linear`). bfloat16, a
        few rows: the native kernel (`native_rows_for`); bfloat16 on a CPU with bf16 dots, many rows:
        multiplied as bfloat16 into float32 (`bf16_dot`); otherwise widened just before the matmul
        (`widen_for`). None of these widens the whole matrix in memory but the last."""
        if native_rows_for(self, x2.shape[0]):
            return native.rows_times(x2, self.bits).astype(x2.dtype)
        if bf16_dots_for(self, x2.shape[0]):
            return bf16_dot(x2, self.bits)
        return x2 @ self.widen_for(x2).astype(x2.dtype)


def _contract(a, bits, b_axis, layer=None):
    """a [M, K] . the bfloat16 matrix whose bits are `bits`, over its axis b_axis (bits [K, N] or [N, K];
    with `layer`, a stack [L, ...] of them and the one to use) -> [M, N]: bf16 operands, float32 sums. In
    the tile kernel where the CPU has AMX or AVX-512 BF16 (`native.tiles_times`: about 2x XLA:CPU's bf16
    dots at the 1B shape's products on AMX, about 1x by VDPBF16PS, and a stack is read in place), else XLA's
    dot."""
    if native.tiles_available():
        return native.tiles_times(a, bits, transposed=b_axis == 1, layer=layer)
    if layer is not None:
        bits = jax.lax.dynamic_index_in_dim(bits, layer, keepdims=False)
    w = jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
    return jax.lax.dot_general(a.astype(jnp.bfloat16), w, (((1,), (b_axis,)), ((), ())),
                               preferred_element_type=jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def bf16_dot(x2, bits, transposed: bool = False, layer=None):
    """x2 [M, K] @ the bfloat16 kernel whose bits are `bits` [K, N] ([N, K] if transposed, as a tied head's
    embedding rows; with `layer`, a stack [L, K, N] and the index of the one to use) -> [M, N] in x2's
    dtype: bf16 operands, float32 accumulation, as PyTorch's bf16 matmuls. On a CPU with bf16
    instructions XLA:CPU runs this 2x faster than float32 (AMX tiles faster still: `_contract`); a bf16 x
    bf16 -> bf16 dot, or a mixed one (autodiff's dx = dy W^T with dy in float32), widens instead. The
    kernel is frozen: the backward gives dx only, in the same form."""
    return _contract(x2, bits, 1 if transposed else 0, layer).astype(x2.dtype)


def _bf16_dot_bwd(transposed, res, dy):
    bits, layer = res
    return _contract(dy, bits, 0 if transposed else 1, layer).astype(dy.dtype), None, None  # [M, K]


bf16_dot.defvjp(lambda x2, bits, transposed, layer: (bf16_dot(x2, bits, transposed, layer), (bits, layer)),
                _bf16_dot_bwd)


@jax.tree_util.register_pytree_node_class
class HeldBits(Bits):
    """One layer of a stack of frozen bfloat16 weights, read in place: `bits` is the whole stack [L, ...]
    and `layer` the index (`hold_stacked`). The layer scan would otherwise copy each layer's slice out of
    the stack before its matmul, forward and backward (1B LoRA step on 2 cores: about 0.9 s of 6). Only the
    tile kernel reads a stack in place (`bf16_dot` with a layer); every other use takes the slice first."""

    def __init__(self, bits, dtype, layer):
        super().__init__(bits, dtype)
        self.layer = layer

    def tree_flatten(self):
        return (self.bits, self.layer), self.dtype

    @classmethod
    def tree_unflatten(cls, dtype, children):
        return cls(children[0], dtype, children[1])

    @property
    def shape(self):
        return self.bits.shape[1:]

    def sliced(self) -> Bits:
        return Bits(jax.lax.dynamic_index_in_dim(self.bits, self.layer, keepdims=False), self.dtype)

    def value(self):
        return self.sliced().value()

    def after(self, y):
        return self.sliced().after(y)

    def widen_for(self, x):
        return self.sliced().widen_for(x)

    def matmul(self, x2):
        if bf16_dots_for(self, x2.shape[0]):
            return bf16_dot(x2, self.bits, False, self.layer)
        return self.sliced().matmul(x2)


def hold_stacked(layers: dict):
    """(the stacked layers to scan, at(i) -> layer i's held weights): where the tile kernel runs
    (`native.tiles_available`: AMX or AVX-512 BF16), the stacked bfloat16 kernels as `HeldBits`, read in
    place by it; `llama.Kernels.hold`."""
    held = {k: v for k, v in layers.items()
            if _is_bits(v) and v.bits.ndim == 3 and v.dtype == jnp.bfloat16} if native.tiles_available() else {}
    scanned = {k: v for k, v in layers.items() if k not in held}
    return scanned, lambda i: {k: HeldBits(v.bits, v.dtype, i) for k, v in held.items()}


def bf16_dots_for(w, rows: int) -> bool:
    """Whether a matmul of `rows` rows by narrow weights `w` runs as `bf16_dot`: from BF16_DOT_MIN_ROWS
    rows, or where the AMX kernel runs it, from TILES_MIN_ROWS (`bf16_dot_min_rows`)."""
    return _is_bits(w) and w.dtype == jnp.bfloat16 and rows >= bf16_dot_min_rows() and has_bf16_dots()


def bf16_dot_min_rows() -> int:
    """The fewest rows `bf16_dot` takes: TILES_MIN_ROWS where the AMX kernel runs (`native.tiles_kind`),
    else BF16_DOT_MIN_ROWS."""
    return TILES_MIN_ROWS if native.tiles_kind() == "amx" else BF16_DOT_MIN_ROWS


def native_rows_for(w, rows: int) -> bool:
    """Whether `rows` rows times the narrow weights `w` run in the native kernel (`native.rows_times`):
    bfloat16 bits, at most `native_max_rows()` rows, and the kernel built here (`native.available`). It reads
    the bf16 weights at 18-20 GB/s on the 2-core Xeon where XLA:CPU's bf16 products read 1.1-2.2 GB/s and
    its float32 ones 13-20 (a [2048, 8192] kernel times one row: 1.6-1.9 ms, widened in XLA 16 ms,
    float32 3.3-3.8 ms; `jax.jit` timings, 8 matrices chained, 2026-12-03)."""
    return _is_bits(w) and w.bits.ndim == 2 and native_decodes(w.dtype, rows)


def native_decodes(dtype, rows: int) -> bool:
    """Whether `rows` rows times bits of `dtype` run in the native kernel (see `native_rows_for`)."""
    return jnp.dtype(dtype) == jnp.bfloat16 and 1 <= rows <= native_max_rows() and native.available()


def native_max_rows() -> int:
    """The most rows a product with bf16 bits sends to the row kernel: DECODE_MAX_ROWS where the AMX
    kernel takes more (`native.tiles_kind`), else PREFILL_MAX_ROWS."""
    return DECODE_MAX_ROWS if native.tiles_kind() == "amx" else min(PREFILL_MAX_ROWS, native.MAX_ROWS)


def unwidened(tree, rows: int) -> bool:
    """Whether a product of `rows` rows by each narrow 2-D kernel in `tree` runs on the bits as they are
    (`bf16_dot`, the row kernel), so that no float32 copy of a weight is made, nor kept for a backward."""
    return all(bf16_dots_for(a, rows) or native_rows_for(a, rows)
               for a in jax.tree.leaves(tree, is_leaf=_is_bits) if _is_bits(a) and a.bits.ndim == 2)


def bf16_bits(tree) -> bool:
    """Whether `tree` carries narrow weights as `Bits`, and all of them bfloat16."""
    bits = [a for a in jax.tree.leaves(tree, is_leaf=_is_bits) if _is_bits(a)]
    return bool(bits) and all(a.dtype == jnp.bfloat16 for a in bits)


def _zero_of(x, dtype):
    """A 0 of `dtype` that XLA computes from x's first element (and cannot fold): ordering, not data."""
    s = jax.lax.stop_gradient(x).reshape(-1)[0]
    u = jax.lax.bitcast_convert_type(s, {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[s.dtype.itemsize])
    return jnp.minimum(u, jnp.zeros_like(u)).astype(dtype)


def _is_bits(a) -> bool:
    return isinstance(a, Bits)


def has_bits(tree) -> bool:
    return any(_is_bits(a) for a in jax.tree.leaves(tree, is_leaf=_is_bits))


def _narrow(a) -> bool:
    return _is_bits(a) or (jnp.issubdtype(a.dtype, jnp.floating) and jnp.dtype(a.dtype).itemsize == 2)


def _bits_view(a):
    """A narrow CPU array's bits as a uint16 jax array sharing its buffer, or None where that cannot be
    had without a copy (then the float array is used as it is)."""
    if not isinstance(a, jax.Array) or len(a.sharding.device_set) != 1:
        return None
    host = np.asarray(a).view(np.uint16)  # zero-copy on the CPU
    v = jax.device_put(host, next(iter(a.sharding.device_set)), may_alias=True)
    return Bits(v, a.dtype) if v.unsafe_buffer_pointer() == host.ctypes.data else None


def carry_bits(tree):
    """`tree` with its bfloat16/float16 arrays as `Bits` sharing their memory, on the CPU back end
    (elsewhere, or where a view would copy, unchanged). Call it outside jit, on weights that are never
    differentiated (a gradient through Bits is zero)."""
    if jax.default_backend() != "cpu":
        return tree

    def conv(a):
        if _is_bits(a) or not _narrow(a):
            return a
        b = _bits_view(a)
        return a if b is None else b
    return jax.tree.map(conv, tree, is_leaf=_is_bits)


def inference_weights(top: dict, layers):
    """(top, layers) for forward passes that do not differentiate them (inference, a frozen base), with
    the stacked layers and the embedding / head tables as `Bits` where narrow on a CPU (the final norm
    stays an array). Outside jit."""
    table = {k: carry_bits(v) for k, v in top.items() if k in ("embed_tokens", "lm_head")}
    return {**top, **table}, carry_bits(layers)


def widen(a):
    """An array, or `Bits` read back as floats: all of it, now."""
    return a.value() if _is_bits(a) else a


def fence(p):
    """A layer's parameters with any `Bits` turned back into floats (`Kernels.weights` of the fast kernels),
    but for the dense 2-D kernels: `layers.linear` widens each of those just before its matmul (`widen_for`).
    (A GPTQ projection's dict of packed tensors is widened here: its scales feed the dequantization.)"""
    return {k: v if isinstance(v, HeldBits) or (_is_bits(v) and v.bits.ndim == 2)
            else jax.tree.map(widen, v, is_leaf=_is_bits) for k, v in p.items()}


RECOMPUTED = ("convert_element_type", "bitcast_convert_type", "transpose", "dynamic_slice", "or", "min")


def keep_all_but_widening(prim, *_, **__) -> bool:
    """jax.checkpoint policy: keep every residual but those of the ops that fetch and widen a weight (a
    slice, the bits read as floats and `widen_for`'s OR, a transpose, a dtype conversion: all cheap),
    which the backward redoes.
    Autodiff would otherwise keep each layer's (and each head block's) widened frozen weights for the
    backward: the whole stack in float32."""
    return prim.name not in RECOMPUTED


def keep_bits(layer):
    """`layer(x, xs)` of the layer scan over a frozen narrow base, as the backward needs it: checkpointed with
    `keep_all_but_widening`, and its bfloat16/float16 residuals handed over as their bits (`Bits`).

    `lax.scan` stacks each layer's residuals into [L, ...] buffers, one dynamic-update-slice per layer.
    XLA:CPU has no bf16 dynamic-update-slice: it widens the whole stacked buffer to float32, writes the
    slice and narrows it back, every layer (1B LoRA step: about 1.1 s of 9.5). Integers are written in
    place."""
    kept = jax.checkpoint(layer, policy=keep_all_but_widening, prevent_cse=False)

    @jax.custom_vjp
    def run(x, xs):
        return kept(x, xs)

    def fwd(x, xs):
        out, pullback = jax.vjp(kept, x, xs)  # pullback: a pytree whose leaves are the residuals
        return out, jax.tree.map(_as_bits, pullback)

    def bwd(res, ct):
        return jax.tree.map(widen, res, is_leaf=_is_bits)(ct)

    run.defvjp(fwd, bwd)
    return run


def _as_bits(a):
    """A bfloat16/float16 array as `Bits`; anything else as it is."""
    if not _narrow(a) or _is_bits(a):
        return a
    return Bits(jax.lax.bitcast_convert_type(a, jnp.uint16), a.dtype)


def lookup(table, tokens):
    """Embedding rows [B, T, D] (`Kernels.lookup`), gathered from the bits when the table is `Bits`."""
    if _is_bits(table):
        return Bits(jnp.take(table.bits, tokens, axis=0), table.dtype).value()
    return jnp.take(table, tokens, axis=0)


def _head_table(top):
    """(the head's weight, its vocabulary axis): the tied embedding [V, D] or lm_head [D, V]."""
    return (top["embed_tokens"], 0) if "lm_head" not in top else (top["lm_head"], 1)


def _fold_head(top, h2, dtype, step, carry):
    """carry = step(carry, logits [N, n] float32, start) over the head's vocabulary blocks [start, start+n);
    h2 [N, D]. The blocks are scanned (one compiled body); a remainder runs last."""
    w, axis = _head_table(top)
    tied = axis == 0
    V = w.shape[axis]
    n = max(1, V // HEAD_BLOCK)
    size = V // n

    def logits(start, rows):
        if bf16_dots_for(w, h2.shape[0]):
            blk = jax.lax.dynamic_slice_in_dim(w.bits, start, rows, axis=axis)
            return bf16_dot(h2.astype(jnp.float32), blk, tied)                           # [N, rows]
        blk = widen(jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, rows, axis=axis), w))
        return head_product(h2, blk.astype(dtype), tied)                                # [N, rows]

    logits = jax.checkpoint(logits, policy=keep_all_but_widening, static_argnums=(1,))
    carry, _ = jax.lax.scan(lambda c, i: (step(c, logits(i * size, size), i * size), None), carry,
                            jnp.arange(n))
    if n * size < V:
        carry = step(carry, logits(n * size, V - n * size), n * size)
    return carry


def head_blocked(top: dict, h, dtype):
    """`layers.head` (float32 logits [..., V]) on a CPU: by vocabulary blocks when the head is narrow, so
    it is never widened whole; a float32 head in one `head_product`, and a bfloat16 one in one call of the
    tile kernel where it runs (`bf16_dot`: the 1B bf16 LoRA step, tied head, 108 -> 123-128 tokens/s on a
    2-core Intel Xeon; docs/benchmark-history.md, "the 1B bf16 step's attention and head"). Differentiable
    in h (and in a plain narrow head; `Bits` get none)."""
    w, axis = _head_table(top)
    if jax.default_backend() != "cpu":
        return llama_head(top, h, dtype)
    lead, D = h.shape[:-1], h.shape[-1]
    h2 = h.reshape(-1, D)
    if native_rows_for(w, h2.shape[0]):  # decoding: the whole table, read once, never widened
        return native.rows_times(h2, w.bits, axis == 0).reshape(*lead, -1)
    if axis == 1 and jnp.dtype(dtype) == jnp.float32 and dense_rows_for(w, h2):  # decoding in float32 (model.dense)
        return native.f32_rows_times(h2, w).reshape(*lead, -1)
    if not _narrow(w):
        return head_product(h2, w.astype(dtype), axis == 0).reshape(*lead, -1)
    if native.tiles_available() and bf16_dots_for(w, h2.shape[0]):
        # the tile kernel reads the whole table where it lies and never widens it: blocks would only add
        # a copy of each block's slice, forward and backward, and the writes into the logits
        return bf16_dot(h2.astype(jnp.float32), w.bits, axis == 0).reshape(*lead, -1)
    V = w.shape[axis]
    out = _fold_head(top, h2, dtype, lambda o, lg, s: jax.lax.dynamic_update_slice_in_dim(o, lg, s, axis=1),
                     jnp.zeros((h2.shape[0], V), jnp.float32))
    return out.reshape(*lead, V)


def head_product(h2, w, tied: bool):
    """h2 [N, D] times the head's weights w ([V, D] tied, else [D, V]) -> float32 logits [N, V], on a CPU.

    A tied head times one row (decoding one sequence) is computed as w [V, D] . h2 [1, D] -> [V, 1], then
    transposed. Written as h2 @ w.T, XLA:CPU copies the whole table transposed before its GEMV, every step
    (1B shape: 1 GB of float32 read and written; 54-78 against 34-50 ms for the head, 2 cores). From 2 rows
    the two forms measured the same; prefill, evaluation and training keep h2 @ w.T, where that copy is
    paid once for many rows."""
    if tied and h2.shape[0] <= HEAD_GEMV_MAX_ROWS:
        return jax.lax.dot_general(w, h2, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).T
    return jnp.dot(h2, w.T if tied else w, preferred_element_type=jnp.float32)


def token_nll_blocked(top: dict, h, targets, dtype):
    """-log softmax(head(h))[target] per position in float32, never holding [..., V] logits: the head by
    vocabulary blocks with a running logsumexp. h [..., D] (normed), targets [...] int -> [...].
    Evaluation only (training's logits go through `token_nll`, which has the backward)."""
    lead, D = h.shape[:-1], h.shape[-1]
    h2, t = h.reshape(-1, D), targets.reshape(-1)

    def step(c, lg, start):
        m, s, picked = c
        m_new = jnp.maximum(m, jnp.max(lg, axis=-1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(lg - m_new[:, None]), axis=-1)
        hit = (t - start)[:, None] == jnp.arange(lg.shape[-1])[None]
        return m_new, s, picked + jnp.sum(jnp.where(hit, lg, 0.0), axis=-1)

    N = h2.shape[0]
    m, s, picked = _fold_head(top, h2, dtype, step, (jnp.full((N,), -jnp.inf, jnp.float32),
                                                     jnp.zeros((N,), jnp.float32), jnp.zeros((N,), jnp.float32)))
    return (m + jnp.log(s) - picked).reshape(lead)
