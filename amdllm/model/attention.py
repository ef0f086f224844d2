"""Grouped-query attention, and a causal version for training that skips the masked half.

Two functions with the same contract, q [B,T,H,hd], k/v [B,S,Hkv,hd], mask [B,T,S] bool -> [B,T,H,hd]:

  * `attention`: the textbook one. Scores [B, Hkv, G, T, S] in float32, masked, softmax, weighted sum.
    The reference the others are tested against (tests/test_attention.py); the model calls those.
  * `causal_attention`: the same numbers when query t can only see keys s <= t (S == T: training,
    evaluation, a prefill without cache), computed in query blocks that skip the key blocks above the
    diagonal (by default 4 query blocks: 10 of 16 score blocks, 62% of the work) and with a hand-written
    backward (flash-attention style): the forward saves only each row's max and normaliser, [B, H, T], and the
    backward recomputes the probabilities from q and k. Autodiff of the textbook version saves the
    float32 probabilities, [B, H, T, S] per layer, which `lax.scan` over layers stacks (zero-filled
    and copied in and out every step); on a 2-core CPU that bookkeeping cost more than recomputing.

`cached_attention` is `attention` over a KV cache laid out head-major, k/v [B, Hkv, S, hd] (decoding),
where query t sees the cache slots the mask says are written. In that layout each (batch, kv head) pair's
keys are one contiguous [S, hd] matrix, the operand a batched matmul wants; with the slot axis first, XLA
transposes the whole cache into that form in every layer of every decode step (31M model, batch 8: ~35%
of the attention time).

The mask still applies inside the computed blocks (packed sequences, padding). A query row whose keys
are all masked (a padding position) gets uniform weights over the keys of its block range instead of
over all S: its output is never read (no real token attends to padding), and it is finite either way.
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so fully masked (padding) rows give uniform weights, never NaN


def _scores(q, k, mask):
    """q [B,t,Hkv,G,hd] (already scaled), k [B,s,Hkv,hd], mask [B,t,s] -> masked float32 [B,Hkv,G,t,s]."""
    s = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    return jnp.where(mask[:, None, None, :, :], s, NEG_INF)


def attention(q, k, v, mask):
    """q [B,T,H,hd], k/v [B,S,Hkv,hd], mask [B,T,S] bool -> [B,T,H,hd]. Grouped-query: H = Hkv * G."""
    B, T, H, hd = q.shape
    Hkv = k.shape[2]
    # scale q, not the [.., T, S] scores: hd/S as many multiplies, forward and backward
    q = q.reshape(B, T, Hkv, H // Hkv, hd) * jnp.asarray(1 / math.sqrt(hd), q.dtype)
    probs = jax.nn.softmax(_scores(q, k, mask), axis=-1).astype(v.dtype)  # float32 softmax
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(B, T, H, hd)


def cached_attention(q, k, v, mask):
    """q [B,T,H,hd], k/v [B,Hkv,S,hd] (a head-major cache), mask [B,T,S] bool -> [B,T,H,hd]."""
    B, T, H, hd = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    # Per (batch, kv head) pair: r = its G query heads x T positions. The scores are computed transposed,
    # [S, hd] keys times the few query rows, and the softmax runs over axis 2: with q as the left operand
    # (scores [r, S]) the cache is the matmul's transposed right operand, which XLA:CPU ran 2x slower.
    qg = q.reshape(B, T, Hkv, G, hd).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, hd)
    qg = qg * jnp.asarray(1 / math.sqrt(hd), q.dtype)
    s = jnp.einsum("bksd,bkrd->bksr", k, qg, preferred_element_type=jnp.float32)  # [B, Hkv, S, G*T]
    s = jnp.where(mask.transpose(0, 2, 1)[:, None, :, None, :], s.reshape(B, Hkv, S, G, T), NEG_INF)
    probs = jax.nn.softmax(s, axis=2).astype(v.dtype).reshape(B, Hkv, S, G * T).swapaxes(2, 3)
    out = jnp.einsum("bkrs,bksd->bkrd", probs, v)                                   # [B, Hkv, G*T, hd]
    return out.reshape(B, Hkv, G, T, hd).transpose(0, 3, 1, 2, 4).reshape(B, T, H, hd)


def query_blocks(T: int, block: int) -> list[tuple[int, int]]:
    """[(start, stop)] query blocks of `block` rows (one block if T does not divide)."""
    if block <= 0 or T <= block or T % block:
        return [(0, T)]
    return [(i, i + block) for i in range(0, T, block)]


def causal_attention(q, k, v, mask, block: int | None = None):
    """`attention` for a causal mask (S == T), by query blocks with a recomputing backward (module doc).

    block: query rows per block; default T/4 (at least 64): 10 of 16 score blocks computed, and at most
    10 block pairs in the program whatever the sequence length (compile time stays flat)."""
    B, T, H, hd = q.shape
    if block is None:
        block = max(64, -(-T // 4))
    assert k.shape[1] == T, f"causal_attention needs S == T (no cache), got k {k.shape} for q {q.shape}"
    Hkv = k.shape[2]
    qg = q.reshape(B, T, Hkv, H // Hkv, hd) * jnp.asarray(1 / math.sqrt(hd), q.dtype)
    return _blocked(qg, k, v, mask, block).reshape(B, T, H, hd)


def _block_fwd(qb, kb, vb, mb):
    s = _scores(qb, kb, mb)                        # [B, Hkv, G, t, s] float32
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - m)
    l = jnp.sum(e, axis=-1, keepdims=True)
    o = jnp.einsum("bkgts,bskd->btkgd", (e / l).astype(vb.dtype), vb)
    return o, m, l


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blocked(qg, k, v, mask, block):
    return _blocked_fwd(qg, k, v, mask, block)[0]


def _blocked_fwd(qg, k, v, mask, block):
    outs, stats = [], []
    for a, b in query_blocks(qg.shape[1], block):  # keys 0..b only: the rest are above the diagonal
        o, m, l = _block_fwd(qg[:, a:b], k[:, :b], v[:, :b], mask[:, a:b, :b])
        outs.append(o)
        stats.append((m, l))
    o = jnp.concatenate(outs, axis=1)
    return o, (qg, k, v, mask, o, stats)


def _blocked_bwd(block, res, do):
    qg, k, v, mask, o, stats = res
    dq, dk, dv = [], jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    # delta_t = sum_d dO * O = sum_s P * dP (the softmax backward's row term), [B, Hkv, G, T]
    delta = jnp.einsum("btkgd,btkgd->bkgt", do.astype(jnp.float32), o.astype(jnp.float32))
    for (a, b), (m, l) in zip(query_blocks(qg.shape[1], block), stats):
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
