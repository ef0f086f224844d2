"""The fast paths. Each replaces one part of the textbook model (`amdllm.model.llama`), computes the same
numbers (tests/test_fast.py checks every one against the textbook), and is on wherever it is faster:
`forward` here is what training, evaluation, calibration and decoding run.

  * Blocked causal attention with a recomputing backward (`causal_attention`): query blocks skip the
    key blocks above the diagonal (10 of 16 score blocks at 4 blocks), and the backward recomputes the
    probabilities from q and k instead of keeping them: autodiff of the textbook version saves float32
    probabilities [B, H, T, T] per layer, which `lax.scan` stacks over the layers. Everywhere.
  * A hand-written SwiGLU backward (`swiglu_joined`, `swiglu_pair`): it saves only its inputs (autodiff
    also saves sigmoid(gate), silu(gate) and more, stacked per layer by the scan). Everywhere.
  * Fused projections (`qkv`, `mlp` with `fuse=True`): q/k/v and gate/up each as one matmul on
    concatenated kernels (and LoRA A's), which XLA:CPU runs closer to its matmul peak than two or three
    smaller ones; the concat copies the kernels, about 1/rows of the matmul work. On XLA:CPU and off a
    mesh only, and from FUSE_MIN_ROWS rows up: accelerators' matmuls are large already, and on a mesh
    the tensor rules split `out`, where a concat would move data.
  * Per-layer decoding (`layer_views` + the unrolled loop in `forward`): on a CPU, a decode step reads
    each layer's weights where they lie instead of XLA copying every layer's slice out of the stack
    (most of a decode step's time); zero-copy views, so no memory is spent. CPU only.
  * Narrow weights (bfloat16, float16) on a CPU, where XLA widens them to float32 for every op: weights
    that are not differentiated travel as their bits (`carry_bits`, `Bits`), so one layer is widened at
    a time, not the whole stack; inference runs the output head by vocabulary blocks (`head_blocked`,
    `token_nll_blocked`): a 128k-row head widened whole is 1 GB, and a batch of windows' [B, T, V]
    float32 logits as much again. CPU only.
  * bf16 dots (`bf16_dot`): on a CPU with bf16 instructions (`amdllm.cpu.has_bf16_dots`), a bfloat16
    frozen base is multiplied as bf16 x bf16 -> float32, forward and backward, instead of being widened:
    XLA:CPU runs those dots about 2x faster than float32 (the 1B LoRA step: 43 -> 63-73 tokens/s). From
    BF16_DOT_MIN_ROWS rows up: decoding's one-row products stay widened, which is faster there.
The XLA:CPU compiler options the jitted steps use are in `amdllm.cpu`.
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from amdllm.config import LlamaConfig
from amdllm.cpu import has_bf16_dots
import amdllm.model.llama as llama
from amdllm.model.attention import _scores
from amdllm.model.layers import head as llama_head, lora_delta, rms_norm
from amdllm.model.llama import KVCache, Kernels, LoRA, Run, block, embed, project

FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
FUSE_MIN_ROWS = 64  # below this (decoding), copying the kernels costs more than fewer matmuls save


# --------------------------------------------------------------------------------------------------
# Fused projections
# --------------------------------------------------------------------------------------------------
def project_group(p: dict, key: str, x, lora: LoRA, fuse: bool, joined: bool = False):
    """The projections FUSED[key] of one input x -> their outputs (a list), as one matmul when fused.

    joined=True: when fused, the one [..., sum(out)] output unsplit (its consumer takes it whole)."""
    names = FUSED[key]
    rows = math.prod(x.shape[:-1])
    if (not fuse or rows < FUSE_MIN_ROWS or any(isinstance(p[n], dict) for n in names)  # GPTQ: separate
            or any(jnp.dtype(p[n].dtype).itemsize < 4 for n in names)):  # XLA:CPU widens narrow kernels
        # (a copy each already): a concat would be one more
        # one 2-D view of x for all of them: autodiff then keeps it once for the backward pass, not once per
        # projection (`layers.linear` leaves a 2-D input as it is)
        x2 = x.reshape(-1, x.shape[-1])
        outs = []
        for n in names:  # narrow kernels as bits: each widened after the one before it is used
            widened = isinstance(p[n], Bits) and not bf16_dots_for(p[n], rows)
            q = {**p, n: p[n].after(outs[-1])} if outs and widened else p
            outs.append(project(q, n, x2, lora))
        return [o.reshape(*x.shape[:-1], o.shape[-1]) for o in outs]
    sizes = [p[n].shape[-1] for n in names]
    x2 = x.reshape(-1, x.shape[-1])
    y = x2 @ jnp.concatenate([p[n] for n in names], axis=-1).astype(x.dtype)           # [rows, sum(out)]
    rngs = [None if lora.rng is None else jax.random.fold_in(lora.rng, llama.PROJECTIONS.index(n)) for n in names]
    with_a = [n + "_lora_a" in p for n in names]
    if all(with_a) and not (lora.dropout > 0.0 and lora.rng is not None):
        # x @ [A_q A_k A_v] once; each rank-r slice through its own B
        a = jnp.concatenate([p[n + "_lora_a"] for n in names], axis=-1).astype(x.dtype)
        xa = jnp.split(x2 @ a, len(names), axis=-1)
        delta = jnp.concatenate([s @ p[n + "_lora_b"].astype(x.dtype) for s, n in zip(xa, names)], axis=-1)
        y = y + (lora.scale * delta).astype(y.dtype)
    elif any(with_a):  # A's left separate (dropout draws one mask per projection; or LoRA on some only)
        start = 0
        for n, r, size, has in zip(names, rngs, sizes, with_a):
            if has:
                d = lora_delta(x2, p[n + "_lora_a"], p[n + "_lora_b"], lora.scale, lora.dropout, r)
                y = y.at[:, start:start + size].add(d.astype(y.dtype))
            start += size
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    if joined:
        return y
    return jnp.split(y, np.cumsum(sizes[:-1]).tolist(), axis=-1)


# --------------------------------------------------------------------------------------------------
# SwiGLU with a hand-written backward
# --------------------------------------------------------------------------------------------------
def _swiglu_grads(g, u, dh):
    g, u, dh = g.astype(jnp.float32), u.astype(jnp.float32), dh.astype(jnp.float32)
    sig = jax.nn.sigmoid(g)
    return dh * u * sig * (1 + g * (1 - sig)), dh * g * sig  # d silu(g)/dg = sig * (1 + g * (1 - sig))


@jax.custom_vjp
def swiglu_joined(gu):
    """silu(gate) * up for gu = [..., 2F] (the fused gate_up output, gate first) -> [..., F]; the
    backward returns d(gu) in that fused layout, which the gate_up matmul's backward reads."""
    g, u = jnp.split(gu, 2, axis=-1)
    return jax.nn.silu(g) * u


def _swiglu_joined_bwd(gu, dh):
    return (jnp.concatenate(_swiglu_grads(*jnp.split(gu, 2, axis=-1), dh), axis=-1).astype(gu.dtype),)


swiglu_joined.defvjp(lambda gu: (swiglu_joined(gu), gu), _swiglu_joined_bwd)


@jax.custom_vjp
def swiglu_pair(g, u):
    """silu(g) * u for separate gate and up (unfused kernels), the same backward."""
    return jax.nn.silu(g) * u


def _swiglu_pair_bwd(res, dh):
    g, u = res
    dg, du = _swiglu_grads(g, u, dh)
    return dg.astype(g.dtype), du.astype(u.dtype)


swiglu_pair.defvjp(lambda g, u: (swiglu_pair(g, u), (g, u)), _swiglu_pair_bwd)


# --------------------------------------------------------------------------------------------------
# Blocked causal attention with a recomputing backward (flash-attention style)
# --------------------------------------------------------------------------------------------------
def query_blocks(T: int, block_rows: int) -> list[tuple[int, int]]:
    """[(start, stop)] query blocks of `block_rows` rows (one block if T does not divide)."""
    if block_rows <= 0 or T <= block_rows or T % block_rows:
        return [(0, T)]
    return [(i, i + block_rows) for i in range(0, T, block_rows)]


def causal_attention(q, k, v, mask, block_rows: int | None = None):
    """`attention` when query t sees keys s <= t only (S == T: training, evaluation, a prefill without
    cache), by query blocks; q [B,T,H,hd], k/v [B,T,Hkv,hd], mask [B,T,T] -> [B,T,H,hd].

    block_rows: default T/4 (at least 64): at most 10 block pairs whatever the sequence length (compile
    time stays flat). The mask still applies inside the computed blocks (packing, padding); a padding
    row whose keys are all masked gets uniform weights over its block range (its output is never read)."""
    B, T, H, hd = q.shape
    block_rows = block_rows or max(64, -(-T // 4))
    assert k.shape[1] == T, f"causal_attention needs S == T (no cache), got k {k.shape} for q {q.shape}"
    Hkv = k.shape[2]
    qg = q.reshape(B, T, Hkv, H // Hkv, hd) * jnp.asarray(1 / math.sqrt(hd), q.dtype)
    return _blocked(qg, k, v, mask, block_rows).reshape(B, T, H, hd)


def _block_fwd(qb, kb, vb, mb):
    s = _scores(qb, kb, mb)                        # [B, Hkv, G, t, s] float32
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - m)
    l = jnp.sum(e, axis=-1, keepdims=True)
    o = jnp.einsum("bkgts,bskd->btkgd", (e / l).astype(vb.dtype), vb)
    return o, m, l


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blocked(qg, k, v, mask, block_rows):
    return _blocked_fwd(qg, k, v, mask, block_rows)[0]


def _blocked_fwd(qg, k, v, mask, block_rows):
    outs, stats = [], []
    for a, b in query_blocks(qg.shape[1], block_rows):  # keys 0..b only: the rest are above the diagonal
        o, m, l = _block_fwd(qg[:, a:b], k[:, :b], v[:, :b], mask[:, a:b, :b])
        outs.append(o)
        stats.append((m, l))
    o = jnp.concatenate(outs, axis=1)
    return o, (qg, k, v, mask, o, stats)


def _blocked_bwd(block_rows, res, do):
    qg, k, v, mask, o, stats = res
    dq, dk, dv = [], jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    # delta_t = sum_d dO * O = sum_s P * dP (the softmax backward's row term), [B, Hkv, G, T]
    delta = jnp.einsum("btkgd,btkgd->bkgt", do.astype(jnp.float32), o.astype(jnp.float32))
    for (a, b), (m, l) in zip(query_blocks(qg.shape[1], block_rows), stats):
        qb, kb, vb, dob = qg[:, a:b], k[:, :b], v[:, :b], do[:, a:b]
        p = jnp.exp(_scores(qb, kb, mask[:, a:b, :b]) - m) / l          # recomputed, [B, Hkv, G, t, s]
        dv = dv.at[:, :b].add(jnp.einsum("bkgts,btkgd->bskd", p.astype(dob.dtype), dob,
                                         preferred_element_type=jnp.float32))
        dp = jnp.einsum("btkgd,bskd->bkgts", dob, vb, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta[..., a:b, None])).astype(qb.dtype)
        dq.append(jnp.einsum("bkgts,bskd->btkgd", ds, kb))
        dk = dk.at[:, :b].add(jnp.einsum("bkgts,btkgd->bskd", ds, qb, preferred_element_type=jnp.float32))
    return jnp.concatenate(dq, axis=1), dk.astype(k.dtype), dv.astype(v.dtype), None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


# --------------------------------------------------------------------------------------------------
# Narrow weights on a CPU: widened one layer / one vocabulary block at a time
# --------------------------------------------------------------------------------------------------
HEAD_BLOCK = 8192  # vocabulary rows per head block: [rows, 8192] float32 logits; 64 MB of float32 weights (D 2048)
BF16_DOT_MIN_ROWS = 64  # below this (decoding), XLA:CPU's bf16 dots lose to widening (1B shape: 2.5 vs 3.2 tokens/s)


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
        """x2 [M, in] @ these weights [in, out] -> [M, out] in x2's dtype (`layers.linear`). bfloat16 on a
        CPU with bf16 dots: multiplied as bfloat16 into float32 (`bf16_dot`), never widened; otherwise
        widened just before the matmul (`widen_for`)."""
        if bf16_dots_for(self, x2.shape[0]):
            return bf16_dot(x2, self.bits)
        return x2 @ self.widen_for(x2).astype(x2.dtype)


def _contract(a, b, b_axis):
    """a [M, K] . b over b's axis b_axis (b [K, N] or [N, K]) -> [M, N]: bf16 operands, float32 sums."""
    return jax.lax.dot_general(a.astype(jnp.bfloat16), b, (((1,), (b_axis,)), ((), ())),
                               preferred_element_type=jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def bf16_dot(x2, bits, transposed: bool = False):
    """x2 [M, K] @ the bfloat16 kernel whose bits are `bits` [K, N] ([N, K] if transposed, as a tied head's
    embedding rows) -> [M, N] in x2's dtype: bf16 operands, float32 accumulation, as PyTorch's bf16
    matmuls. On a CPU with bf16 instructions XLA:CPU runs this 2x faster than float32; a bf16 x bf16 ->
    bf16 dot, or a mixed one (autodiff's dx = dy W^T with dy in float32), widens instead. The kernel is
    frozen: the backward gives dx only, in the same form."""
    w = jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
    return _contract(x2, w, 1 if transposed else 0).astype(x2.dtype)


def _bf16_dot_bwd(transposed, bits, dy):
    w = jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
    return _contract(dy, w, 0 if transposed else 1).astype(dy.dtype), None                # [M, K]


bf16_dot.defvjp(lambda x2, bits, transposed: (bf16_dot(x2, bits, transposed), bits), _bf16_dot_bwd)


def bf16_dots_for(w, rows: int) -> bool:
    """Whether a matmul of `rows` rows by narrow weights `w` runs as `bf16_dot`."""
    return _is_bits(w) and w.dtype == jnp.bfloat16 and rows >= BF16_DOT_MIN_ROWS and has_bf16_dots()


def _zero_of(x, dtype):
    """A 0 of `dtype` that XLA computes from x's first element (and cannot fold): ordering, not data."""
    s = jax.lax.stop_gradient(x).reshape(-1)[0]
    u = jax.lax.bitcast_convert_type(s, {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[s.dtype.itemsize])
    return jnp.minimum(u, jnp.zeros_like(u)).astype(dtype)


def _is_bits(a) -> bool:
    return isinstance(a, Bits)


def _has_bits(tree) -> bool:
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
    return {k: v if _is_bits(v) and v.bits.ndim == 2 else jax.tree.map(widen, v, is_leaf=_is_bits)
            for k, v in p.items()}


RECOMPUTED = ("convert_element_type", "bitcast_convert_type", "transpose", "dynamic_slice", "or", "min")


def keep_all_but_widening(prim, *_, **__) -> bool:
    """jax.checkpoint policy: keep every residual but those of the ops that fetch and widen a weight (a
    slice, the bits read as floats and `widen_for`'s OR, a transpose, a dtype conversion: all cheap),
    which the backward redoes.
    Autodiff would otherwise keep each layer's (and each head block's) widened frozen weights for the
    backward: the whole stack in float32."""
    return prim.name not in RECOMPUTED


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
        blk = blk.T if tied else blk                                                     # [D, rows]
        return jnp.dot(h2, blk.astype(dtype), preferred_element_type=jnp.float32)       # [N, rows]

    logits = jax.checkpoint(logits, policy=keep_all_but_widening, static_argnums=(1,))
    carry, _ = jax.lax.scan(lambda c, i: (step(c, logits(i * size, size), i * size), None), carry,
                            jnp.arange(n))
    if n * size < V:
        carry = step(carry, logits(n * size, V - n * size), n * size)
    return carry


def head_blocked(top: dict, h, dtype):
    """`layers.head` (float32 logits [..., V]) by vocabulary blocks when the head is narrow on a CPU, so
    it is never widened whole. Differentiable in h (and in a plain narrow head; `Bits` get none)."""
    w, axis = _head_table(top)
    if jax.default_backend() != "cpu" or not _narrow(w):
        return llama_head(top, h, dtype)
    lead, D = h.shape[:-1], h.shape[-1]
    h2 = h.reshape(-1, D)
    V = w.shape[axis]
    out = _fold_head(top, h2, dtype, lambda o, lg, s: jax.lax.dynamic_update_slice_in_dim(o, lg, s, axis=1),
                     jnp.zeros((h2.shape[0], V), jnp.float32))
    return out.reshape(*lead, V)


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


# --------------------------------------------------------------------------------------------------
# The switch, and the forward the hot paths run
# --------------------------------------------------------------------------------------------------
def kernels(fuse: bool) -> Kernels:
    """The fast kernels; fuse: join q/k/v and gate/up into one matmul each (see the module doc)."""
    def mlp(p, h, lora):
        gu = project_group(p, "gate_up", h, lora, fuse, joined=True)
        return swiglu_joined(gu) if not isinstance(gu, list) else swiglu_pair(*gu)

    return Kernels(qkv=lambda p, h, lora: tuple(project_group(p, "qkv", h, lora, fuse)),
                   attend=causal_attention, mlp=mlp, weights=fence, lookup=lookup)


def kernels_for(run: Run, layers=None) -> Kernels:
    k = kernels(fuse=run.act_sharding is None and jax.default_backend() == "cpu")
    if _has_bits(layers):  # a frozen narrow base
        k = k._replace(policy=keep_all_but_widening)
    return k


def forward(cfg: LlamaConfig, top: dict, layers, tokens, *, run: Run = Run(), **kw):
    """`llama.forward` (same arguments and results) with the fast kernels. `layers` may also be a list of
    per-layer dicts (`layer_views`): the layers then run as an unrolled loop, with a per-layer cache
    (tuples, `init_cache(per_layer=True)`) or a stacked one; a per-layer cache also works with stacked
    layers (a prefill scans the stacked weights and hands the decode steps a per-layer cache)."""
    k = kernels_for(run, layers)
    cache = kw.get("cache")
    per_layer_cache = cache is not None and isinstance(cache.k, (tuple, list))
    want_hidden = kw.pop("return_hidden", False)
    if isinstance(layers, (list, tuple)):
        h, new = _unrolled(cfg, top, layers, tokens, run=run, kernels=k, **kw)
    elif per_layer_cache:
        kw["cache"] = KVCache(jnp.stack(cache.k), jnp.stack(cache.v), cache.valid)
        h, new = llama.forward(cfg, top, layers, tokens, run=run, kernels=k, return_hidden=True, **kw)
        new = split_cache(new)
    else:
        h, new = llama.forward(cfg, top, layers, tokens, run=run, kernels=k, return_hidden=True, **kw)
    return (h if want_hidden else head_blocked(top, h, run.dtype)), new


def _unrolled(cfg, top, layer_list, tokens, *, positions=None, segment_ids=None, cache=None,
              cache_index=None, run: Run = Run(), dropout_rng=None, kernels=None):
    """`llama.forward` over per-layer weights, as a Python loop (compile time grows with depth: for
    decoding) -> (the normed hidden states, cache)."""
    x, rope, mask, valid = embed(cfg, top, tokens, positions, segment_ids, cache, cache_index, run.dtype,
                                 kernels.lookup)
    ks, vs = [], []
    for i, p in enumerate(layer_list):
        rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, i)
        kv = None if cache is None else (cache.k[i], cache.v[i])
        x, kv = block(cfg, kernels.weights(p), x, rope, mask, kv, cache_index, kernels=kernels,
                      lora=LoRA(run.lora_scale, run.lora_dropout, rng))
        if kv is not None:
            ks.append(kv[0])
            vs.append(kv[1])
    x = rms_norm(x, top["norm"], cfg.rms_norm_eps)
    new = None
    if cache is not None:  # a stacked cache stays stacked
        stacked = not isinstance(cache.k, (tuple, list))
        new = KVCache(jnp.stack(ks) if stacked else tuple(ks), jnp.stack(vs) if stacked else tuple(vs), valid)
    return x, new


# --------------------------------------------------------------------------------------------------
# Per-layer decoding on a CPU
# --------------------------------------------------------------------------------------------------
def init_cache(cfg: LlamaConfig, batch: int, max_len: int, dtype=jnp.float32, per_layer: bool = False
               ) -> KVCache:
    """`llama.init_cache`, or with per_layer=True one [B, Hkv, S, hd] array per layer (for `layer_views`)."""
    cache = llama.init_cache(cfg, batch, max_len, dtype)
    return split_cache(cache) if per_layer else cache


def split_cache(cache: KVCache) -> KVCache:
    """A stacked cache as per-layer tuples (inside a jit: one copy; e.g. after a scanned prefill)."""
    if isinstance(cache.k, (tuple, list)):
        return cache
    L = cache.k.shape[0]
    return KVCache(tuple(cache.k[i] for i in range(L)), tuple(cache.v[i] for i in range(L)), cache.valid)


def layer_views(layers: dict) -> list[dict] | None:
    """Stacked layer weights [L, ...] as L per-layer dicts that share their memory, or None.

    On the CPU, `jax.device_put` of a numpy view of an array's buffer makes no copy, and we check that it
    did not. None where that does not hold (an accelerator, a sharded array, a copy made): the decode
    step then scans the stacked weights."""
    if jax.default_backend() != "cpu":
        return None
    if _has_bits(layers):
        return None  # unrolled, XLA would widen every layer's bits up front; the scan widens one at a time
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
