"""The fast paths, plain JAX. Each replaces one part of the textbook model (`amdllm.model.llama`) and
computes the same numbers (tests/test_fast.py checks each against it); `forward` here is what training,
evaluation, calibration and decoding run:
  * blocked causal attention with a recomputing backward, or cuDNN's on an NVIDIA GPU in bf16/fp16;
  * a SwiGLU backward that keeps only its inputs;
  * fused q/k/v and gate/up projections (XLA:CPU, off a mesh);
  * narrow weights as bits on a CPU (`amdllm.model.narrow`), and per-layer weights (`layer_slices`).
"""
from __future__ import annotations

import math
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from amdllm.config import LlamaConfig
import amdllm.model.llama as llama
import amdllm.model.narrow as narrow
from amdllm.model.attention import _scores, cached_attention, library_attention
from amdllm.model.layers import lora_delta
from amdllm.model.llama import KVCache, Kernels, LoRA, Run, project

FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
FUSE_MIN_ROWS = 64  # below this (decoding), copying the kernels costs more than fewer matmuls save


# --------------------------------------------------------------------------------------------------
# Fused projections
# --------------------------------------------------------------------------------------------------
def fuses(rows: int, in_features: int) -> bool:
    """Whether a group of projections of `rows` rows of width `in_features` runs as one matmul: from
    FUSE_MIN_ROWS rows, and only where the joined kernel [in, sum(out)] is no larger than the output
    [rows, sum(out)] (autodiff keeps every layer's joined kernel for the backward)."""
    return rows >= FUSE_MIN_ROWS and in_features <= rows


def project_group(p: dict, key: str, x, lora: LoRA, fuse: bool, joined: bool = False):
    """The projections FUSED[key] of one input x -> their outputs (a list), as one matmul when fused.

    joined=True: when fused, the one [..., sum(out)] output unsplit (its consumer takes it whole)."""
    names = FUSED[key]
    rows = math.prod(x.shape[:-1])
    x2 = x.reshape(-1, x.shape[-1])  # one 2-D view for all: autodiff keeps it once, not once per projection
    if (not fuse or not fuses(rows, x.shape[-1])
            or any(not isinstance(p[n], jax.Array) or jnp.dtype(p[n].dtype).itemsize < 4 for n in names)):
        # GPTQ words, bits and narrow kernels stay separate: XLA:CPU widens each already
        return [project(p, n, x2, lora).reshape(*x.shape[:-1], -1) for n in names]
    sizes = [p[n].shape[-1] for n in names]
    y = x2 @ jnp.concatenate([p[n] for n in names], axis=-1).astype(x.dtype)            # [rows, sum(out)]
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
    y = checkpoint_name(y.reshape(*x.shape[:-1], y.shape[-1]), llama.PROJECTION_OUTPUT)
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
# The switch, and the forward the hot paths run
# --------------------------------------------------------------------------------------------------
ATTENTION = ("blocked", "xla", "cudnn")


def attention_implementation(dtype) -> str:
    """The attention training, evaluation and prefills run (one of ATTENTION): $AMDLLM_ATTENTION where set;
    else "cudnn" (cuDNN's fused flash attention) on an NVIDIA GPU in fp16/bf16, else our blocked one (cuDNN
    does not run on ROCm nor in float32; XLA's unfused attention keeps [B, H, T, T] probabilities)."""
    chosen = os.environ.get("AMDLLM_ATTENTION", "").strip()
    if chosen:
        if chosen not in ATTENTION:
            raise ValueError(f"AMDLLM_ATTENTION={chosen!r}: expected one of {', '.join(ATTENTION)}")
        return chosen
    nvidia = jax.default_backend() == "gpu" and "nvidia" in jax.devices()[0].device_kind.lower()
    return "cudnn" if nvidia and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) else "blocked"


def kernels(fuse: bool, attention: str = "blocked", bits: bool = False) -> Kernels:
    """The fast kernels; fuse: join q/k/v and gate/up into one matmul each; attention: one of ATTENTION;
    bits: the weights may be `narrow.Bits` (widened where used, never kept widened for a backward)."""
    def mlp(p, h, lora):
        gu = project_group(p, "gate_up", h, lora, fuse, joined=True)
        return swiglu_joined(gu) if not isinstance(gu, list) else swiglu_pair(*gu)

    attend = causal_attention if attention == "blocked" else partial(library_attention, implementation=attention)
    k = Kernels(qkv=lambda p, h, lora: tuple(project_group(p, "qkv", h, lora, fuse)), attend=attend, mlp=mlp,
                attend_cached=cached_attention)
    if bits:
        k = k._replace(weights=narrow.fence, lookup=narrow.lookup, head=narrow.head,
                       checkpoint=partial(jax.checkpoint, policy=narrow.keep_all_but_widening, prevent_cse=False))
    return k


def kernels_for(run: Run, layers=None, top=None) -> Kernels:
    """The fast kernels for `run` over these weights: fused projections on XLA:CPU off a mesh."""
    alone = run.act_sharding is None and jax.default_backend() == "cpu"
    return kernels(fuse=alone, attention=attention_implementation(run.dtype),
                   bits=narrow.has_bits(layers) or narrow.has_bits(top))


def forward(cfg: LlamaConfig, top: dict, layers, tokens, *, run: Run = Run(), **kw):
    """`llama.forward` (same arguments and results) with the fast kernels."""
    return llama.forward(cfg, top, layers, tokens, run=run, kernels=kernels_for(run, layers, top), **kw)


# --------------------------------------------------------------------------------------------------
# Per-layer weights and caches
# --------------------------------------------------------------------------------------------------
def layer_slices(layers) -> list:
    """Stacked layer weights [L, ...] as L per-layer pytrees of the slices a[i]. Inside jit these are static
    slices that XLA reads where they lie (the decode step on a GPU, where a scan copies each layer out of
    the stack first); outside jit each is a copy."""
    L = jax.tree.leaves(layers)[0].shape[0]
    return [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(L)]


def split_cache(cache: KVCache) -> KVCache:
    """A stacked cache as per-layer tuples (a scanned prefill's, for steps over per-layer weights)."""
    if isinstance(cache.k, (tuple, list)):
        return cache
    L = cache.k.shape[0]
    return KVCache(tuple(cache.k[i] for i in range(L)), tuple(cache.v[i] for i in range(L)), cache.valid)


def init_cache(cfg: LlamaConfig, batch: int, max_len: int, dtype=jnp.float32, per_layer: bool = False) -> KVCache:
    """`llama.init_cache`, or with per_layer=True one [B, Hkv, S, hd] array per layer."""
    cache = llama.init_cache(cfg, batch, max_len, dtype)
    return split_cache(cache) if per_layer else cache
