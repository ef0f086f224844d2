"""Grouped-query attention: H query heads share Hkv key/value heads in groups of G = H / Hkv.

  * `attention`: q [B,T,H,hd], k/v [B,S,Hkv,hd], mask [B,T,S] bool -> [B,T,H,hd], scores in float32.
  * `cached_attention`: the same over a head-major KV cache, k/v [B, Hkv, S, hd]: each (row, kv head)'s
    keys one contiguous [S, hd] matrix, which a batched matmul reads as it lies.
  * `library_attention`: `jax.nn.dot_product_attention`, "xla" or "cudnn" (NVIDIA GPUs, fp16/bf16).
A query row whose keys are all masked (padding) gets uniform weights instead of NaN; it is never read."""
from __future__ import annotations

import math

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
    # (scores [r, S]) the cache is the matmul's transposed right operand, which XLA:CPU ran slower.
    qg = q.reshape(B, T, Hkv, G, hd).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, hd)
    qg = qg * jnp.asarray(1 / math.sqrt(hd), q.dtype)
    s = jnp.einsum("bksd,bkrd->bksr", k, qg, preferred_element_type=jnp.float32)  # [B, Hkv, S, G*T]
    s = jnp.where(mask.transpose(0, 2, 1)[:, None, :, None, :], s.reshape(B, Hkv, S, G, T), NEG_INF)
    probs = jax.nn.softmax(s, axis=2).astype(v.dtype).reshape(B, Hkv, S, G * T).swapaxes(2, 3)
    out = jnp.einsum("bkrs,bksd->bkrd", probs, v)                                   # [B, Hkv, G*T, hd]
    return out.reshape(B, Hkv, G, T, hd).transpose(0, 3, 1, 2, 4).reshape(B, T, H, hd)


def library_attention(q, k, v, mask, implementation: str | None = None):
    """q [B,T,H,hd], k/v [B,S,Hkv,hd], mask [B,T,S] bool -> [B,T,H,hd], by jax.nn.dot_product_attention with
    `implementation` "xla" or "cudnn" (None: JAX's choice). Packing and padding stay in the mask; cuDNN
    applies an arbitrary mask as a bias, so it reads [B, 1, T, S] per layer where its causal mask alone
    would read nothing."""
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation=implementation)
