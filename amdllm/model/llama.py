"""Llama, the textbook version: one block read top to bottom, checked against `transformers` in float32.

    x = embed(tokens)                                  # [B, T, D]
    for each layer:                                    # pre-norm residual blocks
        x = x + o_proj(attention(rope(q), rope(k), v)) # q/k/v from rms_norm(x); grouped-query attention
        x = x + down_proj(silu(gate(h)) * up(h))       # h = rms_norm(x)
    logits = head(rms_norm(x))                         # [B, T, V] float32
Layers are stacked ([L, ...] per weight, run by `lax.scan`) or a list of per-layer dicts (a loop)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from amdllm.config import LlamaConfig
from amdllm.model.attention import attention, cached_attention
from amdllm.model.layers import apply_rope, constrain, head, linear, rms_norm, rope_tables, swiglu

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LoRAParam = nnx.LoRAParam  # Flax's own: trainable factors; everything else is frozen (filter on the type)


def param_table(cfg: LlamaConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Every base parameter: our name -> (shape, logical axes). Kernels are [in, out] (HF stores
    [out, in]); the axis names are mapped to a mesh by `amdllm.parallel.sharding`'s rules table."""
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


class KVCache(NamedTuple):
    k: Any            # [L, B, Hkv, S, hd] head-major, or a tuple of L [B, Hkv, S, hd] (per-layer weights)
    v: Any            # like k
    valid: jax.Array  # [B, S] bool: the slot holds a real (non-padding) token


def init_cache(cfg: LlamaConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch, max_len), bool))


@dataclass(frozen=True)
class Run:
    """How to run the model (not what it is): compute dtype, remat, LoRA's scale and dropout, and the
    sharding of the [B, T, D] hidden states on a mesh."""
    dtype: Any = jnp.float32
    remat: bool | str = False  # one of REMAT: "none" (False), "dots" or "full" (True); see `remat`
    lora_scale: float = 0.0
    lora_dropout: float = 0.0
    act_sharding: Any = None


class Kernels(NamedTuple):
    """How a block computes its heavy parts: TEXTBOOK below, or `amdllm.model.fast.kernels_for`."""
    qkv: Callable     # (p, h [B,T,D], lora) -> (q [B,T,H*hd], k, v [B,T,Hkv*hd])
    attend: Callable  # (q [B,T,H,hd], k, v [B,T,Hkv,hd], mask [B,T,T]) -> [B,T,H,hd]; no cache
    mlp: Callable     # (p, h [B,T,D], lora) -> silu(h W_gate) * (h W_up) [B,T,F]
    attend_cached: Callable = cached_attention  # (q, k/v [B,Hkv,S,hd] cache, mask [B,T,S]) -> q's shape
    weights: Callable = lambda p: p  # (p) -> p: a layer's parameters, as its products read them
    lookup: Callable = lambda table, tokens: jnp.take(table, tokens, axis=0)  # embedding rows [B, T, D]
    head: Callable = head  # (top, normed h [..., D], dtype) -> float32 logits [..., V]
    checkpoint: Any = None  # (layer) -> layer: what it keeps for the backward where run.remat is "none"


class LoRA(NamedTuple):
    scale: float = 0.0
    dropout: float = 0.0
    rng: Any = None   # a dropout key per layer; each projection folds in its index in PROJECTIONS


PROJECTION_OUTPUT = "proj"  # the name remat="dots" keeps: each projection's output, its LoRA delta added
REMAT = ("none", "dots", "full")


def project(p: dict, name: str, x, lora: LoRA = LoRA()):
    """Layer p's projection `name` applied to x, with its LoRA factors if it has them."""
    rng = None if lora.rng is None else jax.random.fold_in(lora.rng, PROJECTIONS.index(name))
    y = linear(x, p[name], p.get(name + "_lora_a"), p.get(name + "_lora_b"), lora.scale, lora.dropout, rng)
    return checkpoint_name(y, PROJECTION_OUTPUT)


TEXTBOOK = Kernels(
    qkv=lambda p, h, lora: tuple(project(p, n, h, lora) for n in ("q_proj", "k_proj", "v_proj")),
    attend=attention,
    mlp=lambda p, h, lora: swiglu(project(p, "gate_proj", h, lora), project(p, "up_proj", h, lora)))


def block(cfg: LlamaConfig, p: dict, x, rope, mask, kv=None, cache_index=None, *, lora: LoRA = LoRA(),
          kernels: Kernels = TEXTBOOK, tap: Callable = lambda name, a: a):
    """One pre-norm decoder layer. p: its parameters (no layer axis); x [B, T, D] -> (x, kv).

    kv: this layer's cache (k, v) [B, Hkv, S, hd], the new keys/values written at `cache_index`.
    tap(name, a) sees (and may replace) each projection's input: "attn_in", "o_in", "mlp_in", "down_in"
    (GPTQ calibration collects them)."""
    B, T, _ = x.shape
    H, Hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    h = tap("attn_in", rms_norm(x, p["input_layernorm"], cfg.rms_norm_eps))            # [B, T, D]
    q, k, v = kernels.qkv(p, h, lora)
    q = apply_rope(q.reshape(B, T, H, hd), *rope)                                       # [B, T, H, hd]
    k = apply_rope(k.reshape(B, T, Hkv, hd), *rope)                                     # [B, T, Hkv, hd]
    v = v.reshape(B, T, Hkv, hd)
    if kv is None:                     # no cache: the T tokens attend to each other
        a = kernels.attend(q, k, v, mask)
    else:                              # write the new keys/values, attend over every written slot
        ck, cv = kv                                                                     # [B, Hkv, S, hd]
        ck = jax.lax.dynamic_update_slice(ck, k.swapaxes(1, 2).astype(ck.dtype), (0, 0, cache_index, 0))
        cv = jax.lax.dynamic_update_slice(cv, v.swapaxes(1, 2).astype(cv.dtype), (0, 0, cache_index, 0))
        kv = (ck, cv)
        a = kernels.attend_cached(q, ck.astype(x.dtype), cv.astype(x.dtype), mask)
    a = tap("o_in", a.reshape(B, T, H * hd))                                            # [B, T, H*hd]
    x = x + project(p, "o_proj", a, lora)
    h = tap("mlp_in", rms_norm(x, p["post_attention_layernorm"], cfg.rms_norm_eps))
    m = tap("down_in", kernels.mlp(p, h, lora))                                         # [B, T, F]
    return x + project(p, "down_proj", m, lora), kv


def attention_mask(segment_ids, cache: KVCache | None, cache_index):
    """-> (mask [B, T, T or S] bool, the cache's valid slots after this call or None)."""
    if cache is None:  # causal, within a segment (sequence packing), never onto padding (id 0)
        T = segment_ids.shape[1]
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        return jnp.tril(jnp.ones((T, T), bool))[None] & same & (segment_ids[:, None, :] != 0), None
    S, T = cache.valid.shape[1], segment_ids.shape[1]  # a slot is visible if written and not ahead
    valid = jax.lax.dynamic_update_slice(cache.valid, segment_ids != 0, (0, cache_index))
    slot = jnp.arange(S)[None, None, :]
    return (slot <= cache_index + jnp.arange(T)[None, :, None]) & valid[:, None, :], valid


def embed(cfg: LlamaConfig, top: dict, tokens, positions, segment_ids, cache, cache_index, dtype,
          kernels: Kernels = TEXTBOOK):
    """What every layer reads: (x [B, T, D], rope (cos, sin) [B, T, hd], mask, the cache's valid slots)."""
    B, T = tokens.shape
    segment_ids = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids
    if positions is None:
        positions = jnp.broadcast_to((cache_index or 0) + jnp.arange(T, dtype=jnp.int32), (B, T))
    x = kernels.lookup(top["embed_tokens"], tokens).astype(dtype)                       # [B, T, D]
    return (x, rope_tables(cfg, positions), *attention_mask(segment_ids, cache, cache_index))


def remat_mode(remat) -> str:
    """A Run's remat as one of REMAT (False or None: "none"; True: "full")."""
    if remat is None or remat is False:
        return "none"
    if remat is True:
        return "full"
    if remat not in REMAT:
        raise ValueError(f"remat must be one of {', '.join(REMAT)}, got {remat!r}")
    return remat


def remat(layer, run: Run, kernels: Kernels = TEXTBOOK):
    """`layer` wrapped to keep for the backward pass what `run.remat` says: everything ("none"), the
    projections' outputs, recomputing norms, RoPE, attention and SwiGLU ("dots"), or its input ("full")."""
    mode = remat_mode(run.remat)
    if mode == "full":
        return jax.checkpoint(layer, prevent_cse=False)
    if mode == "dots":
        return jax.checkpoint(layer, policy=jax.checkpoint_policies.save_only_these_names(PROJECTION_OUTPUT),
                              prevent_cse=False)
    return layer if kernels.checkpoint is None else kernels.checkpoint(layer)


def forward(cfg: LlamaConfig, top: dict, layers, tokens, *, positions=None, segment_ids=None,
            cache: KVCache | None = None, cache_index=None, run: Run = Run(), dropout_rng=None,
            return_hidden: bool = False, kernels: Kernels = TEXTBOOK):
    """tokens [B, T] -> (logits [B, T, V] float32, or the normed hidden states with return_hidden; cache).

    top: embed_tokens, norm, lm_head?; layers: stacked [L, ...] weights, or a list of per-layer dicts.
    positions [B, T]: RoPE positions (default 0.., from cache_index with a cache); segment_ids [B, T]:
    equal ids attend to each other, 0 is padding; cache: a KVCache written from slot cache_index."""
    x, rope, mask, valid = embed(cfg, top, tokens, positions, segment_ids, cache, cache_index, run.dtype, kernels)

    def layer(x, xs):
        p, kv, i = xs
        rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, i)
        x, kv = block(cfg, kernels.weights(p), constrain(x, run.act_sharding), rope, mask, kv, cache_index,
                      lora=LoRA(run.lora_scale, run.lora_dropout, rng), kernels=kernels)
        return constrain(x, run.act_sharding), kv

    layer = remat(layer, run, kernels)
    kvs = None if cache is None else (cache.k, cache.v)
    if isinstance(layers, (list, tuple)):  # per-layer weights: a loop (compile time grows with depth)
        out = []
        for i, p in enumerate(layers):
            x, kv = layer(x, (p, None if kvs is None else (kvs[0][i], kvs[1][i]), i))
            out.append(kv)
        if kvs is not None:  # the cache keeps its layout: stacked, or one array per layer
            ks, vs = tuple(kv[0] for kv in out), tuple(kv[1] for kv in out)
            kvs = (ks, vs) if isinstance(cache.k, tuple) else (jnp.stack(ks), jnp.stack(vs))
    else:
        per_layer = kvs is not None and isinstance(cache.k, tuple)
        if per_layer:
            kvs = (jnp.stack(kvs[0]), jnp.stack(kvs[1]))
        x, kvs = jax.lax.scan(layer, x, (layers, kvs, jnp.arange(cfg.num_hidden_layers)))
        if per_layer:
            kvs = tuple(tuple(c[i] for i in range(cfg.num_hidden_layers)) for c in kvs)
    x = rms_norm(x, top["norm"], cfg.rms_norm_eps)                                      # [B, T, D]
    cache = None if cache is None else KVCache(kvs[0], kvs[1], valid)
    return (x if return_hidden else kernels.head(top, x, run.dtype)), cache


class Layers(nnx.Module):
    """The stacked decoder layers: attributes are [L, ...] parameters (see `param_table`)."""


class Llama(nnx.Module):
    """The parameters (stacked, with logical axes) and how to run them; `model(tokens)` is `forward`."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
                 dtype=jnp.float32, remat: bool | str = False):
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)  # compute dtype
        self.remat = remat
        self.lora_scale = 0.0          # alpha / rank once LoRA is attached (amdllm.model.lora)
        self.lora_dropout = 0.0
        self.act_sharding = None       # set by amdllm.parallel.sharding.shard_model
        self.layers = Layers()
        key = rngs.params()
        for i, (name, (shape, axes)) in enumerate(param_table(cfg).items()):
            if name.endswith("norm"):  # RMSNorm weights start at one, like transformers
                value = jnp.ones(shape, param_dtype)
            else:  # transformers' LlamaPreTrainedModel: normal(0, initializer_range=0.02)
                value = (0.02 * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)).astype(param_dtype)
            owner, attr = (self.layers, name.split("/")[1]) if name.startswith("layers/") else (self, name)
            setattr(owner, attr, nnx.Param(value, axes=axes))

    @classmethod
    def abstract(cls, cfg: LlamaConfig, param_dtype=jnp.float32, **kw) -> "Llama":
        """A model whose parameters are ShapeDtypeStructs: shapes without memory, for loaders."""
        return nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0), param_dtype=param_dtype, **kw))

    def run(self) -> Run:
        return Run(self.dtype, self.remat, float(self.lora_scale), float(self.lora_dropout), self.act_sharding)

    def __call__(self, tokens, **kw):
        """tokens [B, T] int -> (logits [B, T, V] float32, cache or None); keywords as `forward`."""
        return forward(self.cfg, *to_pure(self), tokens, run=self.run(), **kw)


def to_pure(model: Llama) -> tuple[dict, dict]:
    """(top, layers) dicts of raw arrays, for code that calls `forward` directly."""
    top = {k: getattr(model, k)[...] for k in ("embed_tokens", "norm", "lm_head") if hasattr(model, k)}
    return top, nnx.to_pure_dict(nnx.state(model.layers))


def count_params(model: Any) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def logit_tolerance(cfg: LlamaConfig, logit_scale: float) -> float:
    """How far two correct float32 implementations of this model may differ in one logit (absolute).

    A length-K reduction summed in another order differs by about sqrt(K) * eps of its scale; a logit ends
    about 4 such products a layer plus the head: tol = sqrt(max(D, F)) * (4 L + 1) * eps * max|logit|.
    A real bug (a wrong LoRA scale, a transposed weight) moves logits by orders of magnitude more."""
    k = max(cfg.hidden_size, cfg.intermediate_size)
    eps = float(np.finfo(np.float32).eps)
    return float(np.sqrt(k) * (4 * cfg.num_hidden_layers + 1) * eps * max(float(logit_scale), 1.0))
