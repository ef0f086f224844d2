"""Narrow weights (bfloat16, float16) on XLA:CPU, in plain JAX.

XLA:CPU widens every narrow operand to float32, and hoists that out of the layer scan: a bf16 model would
be held a second time, in float32. So weights that are never differentiated (inference, a frozen LoRA
base) travel into jit as their bits (`Bits`, uint16): the scan slices integers, each layer is widened
where it is used, and the head a vocabulary block at a time. Elsewhere `carry_bits` changes nothing.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from amdllm.model.layers import head as dense_head

HEAD_BLOCK = 8192  # vocabulary rows the head widens at a time


@jax.tree_util.register_pytree_node_class
class Bits:
    """A bfloat16/float16 array carried as its raw bits (uint16). No gradient flows into it."""

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

    @property
    def ndim(self):
        return self.bits.ndim

    def value(self):
        return jax.lax.bitcast_convert_type(self.bits, self.dtype)

    def matmul(self, x2):
        """x2 [M, in] @ these weights [in, out] -> [M, out] in x2's dtype (`layers.linear`)."""
        return x2 @ self.value().astype(x2.dtype)


def is_bits(a) -> bool:
    return isinstance(a, Bits)


def has_bits(tree) -> bool:
    return any(is_bits(a) for a in jax.tree.leaves(tree, is_leaf=is_bits))


def _narrow(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.floating) and jnp.dtype(a.dtype).itemsize == 2


def _bits_view(a):
    """A narrow CPU array's bits as a uint16 jax array sharing its buffer, or None where that would copy."""
    if not isinstance(a, jax.Array) or len(a.sharding.device_set) != 1:
        return None
    host = np.asarray(a).view(np.uint16)  # zero-copy on the CPU
    v = jax.device_put(host, next(iter(a.sharding.device_set)), may_alias=True)
    return Bits(v, a.dtype) if v.unsafe_buffer_pointer() == host.ctypes.data else None


def carry_bits(tree):
    """`tree` with its bfloat16/float16 arrays as `Bits` sharing their memory, on the CPU back end (else,
    or where a view would copy, unchanged). Outside jit, for weights that are never differentiated."""
    if jax.default_backend() != "cpu":
        return tree

    def conv(a):
        if is_bits(a) or not _narrow(a):
            return a
        return _bits_view(a) or a
    return jax.tree.map(conv, tree, is_leaf=is_bits)


def inference_weights(top: dict, layers):
    """(top, layers) for forward passes that do not differentiate them, narrow arrays as `Bits` on a CPU
    (the final norm stays an array). Outside jit."""
    table = {k: carry_bits(v) for k, v in top.items() if k in ("embed_tokens", "lm_head")}
    return {**top, **table}, carry_bits(layers)


def widen(a):
    return a.value() if is_bits(a) else a


def fence(p: dict) -> dict:
    """A layer's parameters as its products read them (`Kernels.weights`): 2-D kernels stay `Bits` (each
    is widened just before its product); norms and a GPTQ projection's packed tensors are widened now."""
    return {k: v if is_bits(v) and v.ndim == 2 else jax.tree.map(widen, v, is_leaf=is_bits) for k, v in p.items()}


def lookup(table, tokens):
    """Embedding rows [B, T, D] (`Kernels.lookup`), gathered from the bits when the table is `Bits`."""
    if is_bits(table):
        return jax.lax.bitcast_convert_type(jnp.take(table.bits, tokens, axis=0), table.dtype)
    return jnp.take(table, tokens, axis=0)


RECOMPUTED = ("convert_element_type", "bitcast_convert_type", "transpose", "dynamic_slice")


def keep_all_but_widening(prim, *_, **__) -> bool:
    """jax.checkpoint policy: keep every residual but the widened weights (a slice, a bitcast, a
    conversion, a transpose: cheap), which the backward redoes; else autodiff keeps the whole stack widened."""
    return prim.name not in RECOMPUTED


def _fold_head(top, h2, dtype, step, carry):
    """carry = step(carry, logits [N, n] float32, start) over the head's vocabulary blocks [start, start+n).
    h2 [N, D]. The blocks are scanned (one compiled body); a remainder runs last."""
    tied = "lm_head" not in top
    w, axis = (top["embed_tokens"], 0) if tied else (top["lm_head"], 1)
    V = w.shape[axis]
    n = max(1, V // HEAD_BLOCK)
    size = V // n

    def logits(start, rows):
        blk = widen(jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, rows, axis=axis), w))
        blk = blk.astype(dtype)
        return jnp.dot(h2, blk.T if tied else blk, preferred_element_type=jnp.float32)  # [N, rows]

    logits = jax.checkpoint(logits, policy=keep_all_but_widening, static_argnums=(1,))
    carry, _ = jax.lax.scan(lambda c, i: (step(c, logits(i * size, size), i * size), None), carry, jnp.arange(n))
    if n * size < V:
        carry = step(carry, logits(n * size, V - n * size), n * size)
    return carry


def head(top: dict, h, dtype):
    """`layers.head` (float32 logits [..., V]), by vocabulary blocks when the head is `Bits`: it is never
    widened whole. Differentiable in h."""
    w = top.get("lm_head", top["embed_tokens"])
    if not is_bits(w):
        return dense_head(top, h, dtype)
    lead, V = h.shape[:-1], w.shape[0 if "lm_head" not in top else 1]
    h2 = h.reshape(-1, h.shape[-1])
    out = _fold_head(top, h2, dtype, lambda o, lg, s: jax.lax.dynamic_update_slice_in_dim(o, lg, s, axis=1),
                     jnp.zeros((h2.shape[0], V), jnp.float32))
    return out.reshape(*lead, V)


def token_nll(top: dict, h, targets, dtype):
    """-log softmax(head(h))[target] per position in float32, never holding [..., V] logits: the head by
    vocabulary blocks with a running logsumexp. h [..., D] (normed), targets [...] int -> [...]."""
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
