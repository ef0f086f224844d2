"""The layers of a Llama block, as pure functions over arrays: RMSNorm, rotary position embeddings, a
projection (dense, dense + LoRA, or GPTQ-packed), SwiGLU, and the output head.

Shapes: B batch, T tokens, D hidden, H query heads, Hkv key/value heads, hd head dim, V vocabulary.
Norms, RoPE and logits run in float32 whatever the compute dtype.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from amdllm.config import LlamaConfig
from amdllm.model.qmatmul import packed_matmul


def rms_norm(x, weight, eps):
    """x [..., D] / rms(x) * weight, computed in float32."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)


def rope_inv_freq(cfg: LlamaConfig) -> jax.Array:
    """Inverse frequencies [hd/2]: plain, linear (positions slowed by `factor`), or Llama 3.1's
    frequency-dependent scaling."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    if rs["rope_type"] == "linear":
        return inv / rs["factor"]
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old_len / lo, old_len / hi
    # long wavelengths (low frequencies) are slowed by `factor`; short ones kept; smooth in between
    inv_scaled = jnp.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * inv_scaled / factor + smooth * inv_scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return jnp.where(is_medium, smoothed, inv_scaled)


def rope_tables(cfg: LlamaConfig, positions):
    """positions [B, T] -> (cos, sin), each [B, T, hd] float32."""
    freqs = positions[..., None].astype(jnp.float32) * rope_inv_freq(cfg)   # [B, T, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin):
    """x [B, T, H, hd]; cos/sin [B, T, hd] float32. HF's rotate-half convention (no weight permutation)."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def linear(x, w, lora_a=None, lora_b=None, lora_scale=0.0, dropout=0.0, rng=None):
    """x [..., in] @ kernel [in, out] (+ LoRA). `w` is an array, a dict of packed GPTQ tensors, or an
    object that multiplies itself (`w.matmul(x2)`: narrow weights as bits, a backend's weights)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])                                                  # [rows, in]
    if isinstance(w, dict):
        y = packed_matmul(x2, w, x.dtype)
    elif hasattr(w, "matmul"):
        y = w.matmul(x2)
    else:
        y = x2 @ w.astype(x.dtype)
    if lora_a is not None:
        y = y + lora_delta(x2, lora_a, lora_b, lora_scale, dropout, rng).astype(y.dtype)
    return y.reshape(*lead, y.shape[-1])


def lora_delta(x2, lora_a, lora_b, lora_scale, dropout=0.0, rng=None):
    """scale * (dropout(x2) @ A) @ B for 2-D x2 [rows, in]."""
    if dropout > 0.0 and rng is not None:
        keep = jax.random.bernoulli(rng, 1.0 - dropout, x2.shape)
        x2 = jnp.where(keep, x2 / (1.0 - dropout), 0).astype(x2.dtype)
    return lora_scale * ((x2 @ lora_a.astype(x2.dtype)) @ lora_b.astype(x2.dtype))


def swiglu(gate, up):
    """The MLP's activation: silu(gate) * up, [..., F]."""
    return jax.nn.silu(gate) * up


def head(top: dict, h, dtype):
    """Normed hidden states h [..., D] -> float32 logits [..., V]; a tied model reuses its embeddings."""
    w = top["lm_head"] if "lm_head" in top else top["embed_tokens"].T   # [D, V]
    if hasattr(w, "matmul"):  # a backend's weights (`linear`)
        return w.matmul(h.reshape(-1, h.shape[-1]).astype(jnp.float32)).reshape(*h.shape[:-1], -1)
    return jnp.dot(h, w.astype(dtype), preferred_element_type=jnp.float32)


def constrain(x, sharding):
    """`with_sharding_constraint` inside jit, skipped without a sharding or when `x` does not split evenly
    (a batch of 1 while generating): the constraint is a layout hint, never a reason to fail."""
    if sharding is None:
        return x
    for n, s in zip(x.shape, tuple(sharding.spec)):
        axes = () if s is None else ((s,) if isinstance(s, str) else s)
        if n % math.prod(sharding.mesh.shape[a] for a in axes):
            return x
    return jax.lax.with_sharding_constraint(x, sharding)
