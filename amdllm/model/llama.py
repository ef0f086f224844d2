"""Llama in Flax NNX: readable in one sitting, checked against `transformers` to 1e-5 in float32.

Layout choices (and why):
  * Decoder layers are *stacked*: every per-layer weight has a leading `layers` axis and the stack runs
    under `jax.lax.scan`, so compile time does not grow with depth (126 layers compile like 1).
  * Projection kernels are stored [in, out] (HF stores nn.Linear weights [out, in]); the checkpoint
    loader transposes. Heads are flattened into the last axis (q: [D, H*hd]) so a GPTQ-packed kernel
    has the same 2-D shape as a dense one.
  * Each parameter carries its logical axis names (`axes` metadata, MaxText style); `amdllm.parallel.sharding`
    maps them to mesh axes with one rules table.
  * A projection is dense (an array), dense + LoRA (extra `<name>_lora_a/_lora_b` params), or
    packed int4/int8 (a dict with qweight/qzeros/scales/g_idx, dequantized inside the jitted step):
    one code path, `linear` below, serves all three.
  * Softmax, norms and logits are computed in float32 whatever the compute dtype.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from amdllm.config import LlamaConfig
from amdllm.model.attention import NEG_INF, attention, cached_attention, causal_attention  # noqa: F401 (re-exported)
from amdllm.model.quantized import quantized_matmul

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAParam(nnx.Param):
    """Trainable LoRA factors; everything else is frozen during fine-tuning (filter on this type)."""


def param_table(cfg: LlamaConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Every base parameter: our name -> (shape, logical axes). The one source of truth for shapes."""
    L, D, F, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.q_dim, cfg.kv_dim
    t = {
        "embed_tokens": ((V, D), ("vocab", "embed")),
        "layers/input_layernorm": ((L, D), ("layers", "norm")),
        "layers/q_proj": ((L, D, q), ("layers", "embed", "heads")),
        "layers/k_proj": ((L, D, kv), ("layers", "embed", "kv_heads")),
        "layers/v_proj": ((L, D, kv), ("layers", "embed", "kv_heads")),
        "layers/o_proj": ((L, q, D), ("layers", "heads", "embed")),
        "layers/post_attention_layernorm": ((L, D), ("layers", "norm")),
        "layers/gate_proj": ((L, D, F), ("layers", "embed", "mlp")),
        "layers/up_proj": ((L, D, F), ("layers", "embed", "mlp")),
        "layers/down_proj": ((L, F, D), ("layers", "mlp", "embed")),
        "norm": ((D,), ("norm",)),
    }
    if not cfg.tie_word_embeddings:
        t["lm_head"] = ((D, V), ("embed", "vocab"))
    return t


class Layers(nnx.Module):
    """The stacked decoder layers: attributes are [L, ...] parameters (see `param_table`)."""


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
                 dtype=jnp.float32, remat: bool = False):
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)  # compute dtype
        self.remat = remat
        self.lora_scale = 0.0  # alpha / rank once LoRA is attached (amdllm.model.lora)
        self.lora_dropout = 0.0
        self.act_sharding = None  # [B, T, D] activation sharding, set by amdllm.parallel.sharding.shard_model
        self.layers = Layers()
        key = rngs.params()
        for i, (name, (shape, axes)) in enumerate(param_table(cfg).items()):
            if name.endswith("norm"):  # RMSNorm weights start at one, like transformers
                value = jnp.ones(shape, param_dtype)
            else:  # transformers' LlamaPreTrainedModel: normal(0, initializer_range=0.02)
                value = 0.02 * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
                value = value.astype(param_dtype)
            owner, attr = (self.layers, name.split("/")[1]) if name.startswith("layers/") else (self, name)
            setattr(owner, attr, nnx.Param(value, axes=axes))

    @classmethod
    def abstract(cls, cfg: LlamaConfig, param_dtype=jnp.float32, **kw) -> "Llama":
        """A model whose parameters are ShapeDtypeStructs: shapes without memory, for loaders."""
        return nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0), param_dtype=param_dtype, **kw))

    def __call__(self, tokens, *, positions=None, segment_ids=None, cache=None, cache_index=None,
                 dropout_rng=None, return_hidden: bool = False):
        """tokens [B, T] int -> (logits [B, T, V] float32, new cache or None).

        positions:   [B, T] RoPE positions (default 0..T-1, or cache_index.. with a cache).
        segment_ids: [B, T] int; 0 marks padding, equal ids attend to each other (sequence packing).
        cache:       KVCache from `init_cache`; cache_index: slot where `tokens` are written.
        """
        layer_params = nnx.to_pure_dict(nnx.state(self.layers))
        top = {k: getattr(self, k)[...] for k in ("embed_tokens", "norm", "lm_head") if hasattr(self, k)}
        return forward(self.cfg, top, layer_params, tokens, positions=positions, segment_ids=segment_ids,
                       cache=cache, cache_index=cache_index, dtype=self.dtype, remat=self.remat,
                       lora_scale=self.lora_scale, lora_dropout=self.lora_dropout, dropout_rng=dropout_rng,
                       return_hidden=return_hidden, act_sharding=getattr(self, "act_sharding", None))


# --------------------------------------------------------------------------------------------------
# Pure functions over arrays
# --------------------------------------------------------------------------------------------------
class KVCache(NamedTuple):
    k: Any            # [L, B, Hkv, S, hd], or a tuple of L [B, Hkv, S, hd] (per-layer, see `forward`);
    #                   head-major: each (batch, kv head)'s keys are one [S, hd] matrix (`cached_attention`)
    v: Any            # like k
    valid: jax.Array  # [B, S] bool: slot holds a real (non-padding) token


def init_cache(cfg: LlamaConfig, batch: int, max_len: int, dtype=jnp.float32, per_layer: bool = False
               ) -> KVCache:
    shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
    valid = jnp.zeros((batch, max_len), bool)
    if per_layer:
        L = cfg.num_hidden_layers
        return KVCache(tuple(jnp.zeros(shape, dtype) for _ in range(L)),
                       tuple(jnp.zeros(shape, dtype) for _ in range(L)), valid)
    shape = (cfg.num_hidden_layers, *shape)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), valid)


def split_cache(cache: KVCache) -> KVCache:
    """A stacked cache as per-layer tuples (inside a jit: one copy; e.g. after a scanned prefill)."""
    if isinstance(cache.k, (tuple, list)):
        return cache
    L = cache.k.shape[0]
    return KVCache(tuple(cache.k[i] for i in range(L)), tuple(cache.v[i] for i in range(L)), cache.valid)


def rope_inv_freq(cfg: LlamaConfig) -> jax.Array:
    """Inverse frequencies [hd/2], with Llama 3.1's frequency-dependent scaling when configured."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
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


def apply_rope(x, cos, sin):
    """x [B, T, H, hd]; cos/sin [B, T, hd] float32. HF's rotate-half convention (no weight permutation)."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def rms_norm(x, weight, eps):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)


def linear(x, w, lora_a=None, lora_b=None, lora_scale=0.0, dropout=0.0, rng=None):
    """x [..., in] @ kernel [in, out]. `w` is an array (dense) or a dict of packed GPTQ tensors."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # 2-D matmuls: ~17% faster backward on XLA:CPU than 3-D dot_generals
    if isinstance(w, dict):
        y = quantized_matmul(x2, w, x.dtype)
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


def _proj(p, name, x, lora_scale, dropout, rng, idx):
    r = None if rng is None else jax.random.fold_in(rng, idx)
    return linear(x, p[name], p.get(name + "_lora_a"), p.get(name + "_lora_b"), lora_scale, dropout, r)


# Projections that read the same input: fused into one matmul by key (see `fuse_kernels`).
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
FUSE_MIN_ROWS = 64  # below this (decoding), copying the kernels costs more than fewer matmuls save


def fuse_kernels(layers: dict, rows: int, dropout: float, dropout_rng) -> dict:
    """Layer params (one layer, or stacked) with q/k/v and gate/up kernels (and their LoRA A's) joined along `out`.

    Done at compute time, the stored layout never changes (checkpoints, adapters, GPTQ, sharding rules
    rely on it). One [D, q+2kv] / [D, 2F] matmul runs closer to XLA:CPU's matmul peak than 2-3 smaller
    ones; the concat copies the kernels, ~1/rows of the matmul work. GPTQ dict kernels stay separate,
    and so do the A's under dropout (each projection draws its own mask)."""
    if rows < FUSE_MIN_ROWS:
        return layers
    out = dict(layers)
    for key, names in FUSED.items():
        if all(n in out and not isinstance(out[n], dict) for n in names):
            out[key] = jnp.concatenate([out.pop(n) for n in names], axis=-1)
            if all(n + "_lora_a" in out for n in names) and not (dropout > 0.0 and dropout_rng is not None):
                out[key + "_lora_a"] = jnp.concatenate([out.pop(n + "_lora_a") for n in names], axis=-1)
    return out


def _proj_group(p, key, x, sizes, lora_scale, dropout, rng, idx0, joined=False):
    """The projections FUSED[key] of the same input x -> list of outputs (one matmul when fused).

    joined=True: when the kernels are fused, return the one [..., sum(sizes)] output unsplit (its
    consumer takes it whole, e.g. `swiglu`); otherwise a list as usual."""
    names = FUSED[key]
    rngs = [None if rng is None else jax.random.fold_in(rng, idx0 + i) for i in range(len(names))]
    if key not in p:  # separate kernels: GPTQ, decoding, a mesh, or not on XLA:CPU
        return [linear(x, p[n], p.get(n + "_lora_a"), p.get(n + "_lora_b"), lora_scale, dropout, r)
                for n, r in zip(names, rngs)]
    x2 = x.reshape(-1, x.shape[-1])
    y = x2 @ p[key].astype(x.dtype)
    if key + "_lora_a" in p:  # x @ [A_q A_k A_v] once; each rank-r slice through its own B
        xa = jnp.split(x2 @ p[key + "_lora_a"].astype(x.dtype), len(names), axis=-1)
        delta = jnp.concatenate([a @ p[n + "_lora_b"].astype(x.dtype) for a, n in zip(xa, names)], axis=-1)
        y = y + (lora_scale * delta).astype(y.dtype)
    else:  # A's left separate (dropout: the same masks as unfused `linear`; or LoRA on only some of them)
        start = 0
        for n, r, size in zip(names, rngs, sizes):  # each delta into its own columns
            if n + "_lora_a" in p:
                d = lora_delta(x2, p[n + "_lora_a"], p[n + "_lora_b"], lora_scale, dropout, r)
                y = y.at[:, start:start + size].add(d.astype(y.dtype))
            start += size
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    if joined:
        return y
    return jnp.split(y, [sum(sizes[:i + 1]) for i in range(len(sizes) - 1)], axis=-1)


def _swiglu_grads(g, u, dh):
    g, u, dh = g.astype(jnp.float32), u.astype(jnp.float32), dh.astype(jnp.float32)
    sig = jax.nn.sigmoid(g)
    return dh * u * sig * (1 + g * (1 - sig)), dh * g * sig  # d silu(g)/dg = sig * (1 + g * (1 - sig))


@jax.custom_vjp
def swiglu(gu):
    """silu(gate) * up for gu = [..., 2F], gate then up (the fused gate_up output) -> [..., F].

    A hand-written backward: it saves only its input (autodiff also saves sigmoid(gate), silu(gate)
    and more, which `lax.scan` stacks per layer) and returns d(gu) in the fused layout the gate_up
    matmul's backward reads. `swiglu2`: the same for separate gate and up (unfused kernels)."""
    g, u = jnp.split(gu, 2, axis=-1)
    return jax.nn.silu(g) * u


def _swiglu_bwd(gu, dh):
    return (jnp.concatenate(_swiglu_grads(*jnp.split(gu, 2, axis=-1), dh), axis=-1).astype(gu.dtype),)


swiglu.defvjp(lambda gu: (swiglu(gu), gu), _swiglu_bwd)


@jax.custom_vjp
def swiglu2(g, u):
    return jax.nn.silu(g) * u


def _swiglu2_bwd(res, dh):
    g, u = res
    dg, du = _swiglu_grads(g, u, dh)
    return dg.astype(g.dtype), du.astype(u.dtype)


swiglu2.defvjp(lambda g, u: (swiglu2(g, u), (g, u)), _swiglu2_bwd)


def decoder_layer(cfg, p, x, cos, sin, mask, kv=None, cache_index=None, *, lora_scale=0.0,
                  lora_dropout=0.0, rng=None):
    """One pre-norm Llama block. p: this layer's parameters (no leading axis). x [B, T, D]."""
    B, T, _ = x.shape
    hd, H, Hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    h = rms_norm(x, p["input_layernorm"], cfg.rms_norm_eps)
    q, k, v = _proj_group(p, "qkv", h, (H * hd, Hkv * hd, Hkv * hd), lora_scale, lora_dropout, rng, 0)
    q, k, v = q.reshape(B, T, H, hd), k.reshape(B, T, Hkv, hd), v.reshape(B, T, Hkv, hd)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if kv is not None:  # write the new keys/values into the cache, attend over all its slots
        ck, cv = kv  # [B, Hkv, S, hd]
        k = jax.lax.dynamic_update_slice(ck, k.swapaxes(1, 2).astype(ck.dtype), (0, 0, cache_index, 0))
        v = jax.lax.dynamic_update_slice(cv, v.swapaxes(1, 2).astype(cv.dtype), (0, 0, cache_index, 0))
        kv = (k, v)
        a = cached_attention(q, k.astype(x.dtype), v.astype(x.dtype), mask)
    else:  # no cache: query t sees keys s <= t only, so the blocks above the diagonal are skipped
        a = causal_attention(q, k, v, mask)
    a = a.reshape(B, T, H * hd)
    x = x + _proj(p, "o_proj", a, lora_scale, lora_dropout, rng, 3)
    h = rms_norm(x, p["post_attention_layernorm"], cfg.rms_norm_eps)
    F = cfg.intermediate_size
    gu = _proj_group(p, "gate_up", h, (F, F), lora_scale, lora_dropout, rng, 4, joined=True)
    act = swiglu(gu) if not isinstance(gu, list) else swiglu2(*gu)
    x = x + _proj(p, "down_proj", act, lora_scale, lora_dropout, rng, 6)
    return x, kv


def forward(cfg: LlamaConfig, top: dict, layers: dict, tokens, *, positions=None, segment_ids=None,
            cache: KVCache | None = None, cache_index=None, dtype=jnp.float32, remat=False,
            lora_scale=0.0, lora_dropout=0.0, dropout_rng=None, return_hidden=False, act_sharding=None):
    """The whole model as a pure function. `top`: embed_tokens, norm, lm_head?; `layers`: stacked [L, ...].

    `layers` may instead be a list of L per-layer dicts (`amdllm.infer.generate.layer_views`): the layers then
    run as an unrolled Python loop, which reads each layer's weights where they are. Under `scan`,
    XLA:CPU copies every layer's weight slice out of the stack first, which is most of a decode step
    (31M model, batch 8: 43 -> 24 ms). Compile time then grows with depth: meant for decoding.
    A per-layer cache (tuples, `init_cache(per_layer=True)`) goes with it; a stacked one is restacked.

    act_sharding: a sharding for the [B, T, D] hidden states (`amdllm.parallel.sharding.activation_sharding`);
    without it XLA may split activations like the weights (FSDP's model dimension) and keep whole
    batches on every device."""
    B, T = tokens.shape
    if segment_ids is None:
        segment_ids = jnp.ones((B, T), jnp.int32)
    if positions is None:
        start = 0 if cache_index is None else cache_index
        positions = jnp.broadcast_to(start + jnp.arange(T, dtype=jnp.int32), (B, T))
    x = jnp.take(top["embed_tokens"], tokens, axis=0).astype(dtype)  # [B, T, D]

    freqs = positions[..., None].astype(jnp.float32) * rope_inv_freq(cfg)  # [B, T, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)

    if cache is None:  # causal, within a segment, never onto padding
        causal = jnp.tril(jnp.ones((T, T), bool))
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = causal[None] & same & (segment_ids[:, None, :] != 0)
    else:  # slot s is visible to query t if written and not in the future
        S = cache.valid.shape[1]
        valid = jax.lax.dynamic_update_slice(cache.valid, segment_ids != 0, (0, cache_index))
        slot = jnp.arange(S)[None, None, :]
        mask = (slot <= cache_index + jnp.arange(T)[None, :, None]) & valid[:, None, :]

    # Fuse q/k/v and gate/up per layer inside the loop (one layer's kernels copied at a time), on XLA:CPU
    # only: there it makes fewer, larger matmuls; accelerators' GEMMs are large already and memory is
    # what they are short of. On a mesh, tensor rules split `out`: a concat there would move data.
    fuse = act_sharding is None and jax.default_backend() == "cpu"

    def body(x, xs):
        p, kv, idx = xs
        if fuse:
            p = fuse_kernels(p, B * T, lora_dropout, dropout_rng)
        rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, idx)
        x = constrain(x, act_sharding)
        x, kv = decoder_layer(cfg, p, x, cos, sin, mask, kv, cache_index, lora_scale=lora_scale,
                              lora_dropout=lora_dropout, rng=rng)
        return constrain(x, act_sharding), kv

    if remat:
        body = jax.checkpoint(body, prevent_cse=False)
    kvs = None if cache is None else (cache.k, cache.v)
    if isinstance(layers, (list, tuple)):  # per-layer weights: an unrolled loop, no weight slices
        ks, vs = [], []
        for i, p in enumerate(layers):
            x, kv = body(x, (p, None if kvs is None else (kvs[0][i], kvs[1][i]), i))
            if kv is not None:
                ks.append(kv[0])
                vs.append(kv[1])
        new_kv = None if kvs is None else (tuple(ks), tuple(vs))
        if kvs is not None and not isinstance(kvs[0], (tuple, list)):  # a stacked cache stays stacked
            new_kv = (jnp.stack(ks), jnp.stack(vs))
    else:
        per_layer = kvs is not None and isinstance(kvs[0], (tuple, list))
        if per_layer:  # scanned weights with a per-layer cache: stacked for the scan, split after
            kvs = (jnp.stack(kvs[0]), jnp.stack(kvs[1]))
        x, new_kv = jax.lax.scan(body, x, (layers, kvs, jnp.arange(cfg.num_hidden_layers)))
        if per_layer:
            new_kv = split_cache(KVCache(*new_kv, None))[:2]
    x = rms_norm(x, top["norm"], cfg.rms_norm_eps)
    new_cache = None if cache is None else KVCache(new_kv[0], new_kv[1], valid)
    if return_hidden:  # e.g. a prefill that needs logits at the last position only (not [B, T, V])
        return x, new_cache
    head = top["lm_head"] if "lm_head" in top else top["embed_tokens"].T  # tied: reuse embeddings
    logits = jnp.dot(x, head.astype(dtype), preferred_element_type=jnp.float32)  # [B, T, V] float32
    return logits, new_cache


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


def cross_entropy(logits, targets, weights):
    """Mean token NLL in float32 over positions where weights > 0. logits [B,T,V], targets/weights [B,T]."""
    w = weights.astype(jnp.float32)
    return jnp.sum(token_nll(logits, targets) * w) / jnp.maximum(jnp.sum(w), 1.0)


@jax.custom_vjp
def token_nll(logits, targets):
    """-log softmax(logits)[target] in float32, per position. logits [..., V], targets [...] int."""
    return _nll_fwd(logits, targets)[0]


def _nll_fwd(logits, targets):
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0].astype(jnp.float32)
    return lse - picked, (logits, lse, targets)


def _nll_bwd(res, g):  # softmax - onehot in one pass; autodiff of log_softmax + take_along_axis
    logits, lse, targets = res  # would store log-probs and scatter into a zeroed [..., V] buffer
    onehot = jnp.arange(logits.shape[-1]) == targets[..., None]
    grad = (jnp.exp(logits.astype(jnp.float32) - lse[..., None]) - onehot) * g[..., None]
    return grad.astype(logits.dtype), None


token_nll.defvjp(_nll_fwd, _nll_bwd)


def to_pure(model: Llama) -> tuple[dict, dict]:
    """(top, layers) dicts of raw arrays, for code that calls `forward` directly."""
    top = {k: getattr(model, k)[...] for k in ("embed_tokens", "norm", "lm_head") if hasattr(model, k)}
    return top, nnx.to_pure_dict(nnx.state(model.layers))


def count_params(model: Any) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def logit_tolerance(cfg: LlamaConfig, logit_scale: float) -> float:
    """How far two correct float32 implementations of this model may differ in one logit (absolute).

    Two libraries sum each matmul in their own order. For a reduction of length K the results differ by
    about sqrt(K) * eps relative to the output's scale (rounding errors add like a random walk), with
    eps = 2**-23, float32's unit roundoff times two. A logit sits at the end of about four such matmul
    stages per layer (q/k/v, o, gate/up, down) plus the head, and each layer's error is carried on by the
    residual stream, so the errors add over the 4 L + 1 stages:

        tol = sqrt(max(hidden, intermediate)) * (4 L + 1) * eps * max|logit|

    For the course model (K = 768, L = 4) that is ~5.6e-5 of the largest logit. A real bug (a wrong
    LoRA scale, a missing projection, a transposed weight) changes logits by a sizeable fraction of their
    scale, orders of magnitude above this.
    """
    k = max(cfg.hidden_size, cfg.intermediate_size)
    eps = float(np.finfo(np.float32).eps)
    return float(np.sqrt(k) * (4 * cfg.num_hidden_layers + 1) * eps * max(float(logit_scale), 1.0))
