"""The fast paths. Each replaces one part of the textbook model (`amdllm.model.llama`), computes the same
numbers (tests/test_fast.py checks every one against the textbook), and is on wherever it is faster:
`forward` here is what training, evaluation, calibration and decoding run.

  * Blocked causal attention with a recomputing backward (`causal_attention`): query blocks skip the
    key blocks above the diagonal (10 of 16 score blocks at 4 blocks), and the backward recomputes the
    probabilities from q and k instead of keeping them: autodiff of the textbook version saves float32
    probabilities [B, H, T, T] per layer, which `lax.scan` stacks over the layers. Everywhere but on an
    NVIDIA GPU in fp16/bf16, where cuDNN's fused attention runs instead, and on a CPU, where the same
    algorithm runs in C++ in float32 (`native_attention`, amdllm/native/attention.cc; 2.5-2.9x faster per
    layer on the 31M step's shape; bf16 q, k and v are widened for it) (`attention_implementation`).
  * A hand-written SwiGLU backward (`swiglu_joined`, `swiglu_pair`): it saves only its inputs (autodiff
    also saves sigmoid(gate), silu(gate) and more, stacked per layer by the scan). Everywhere.
  * Fused projections (`qkv`, `mlp` with `fuse=True`): q/k/v and gate/up each as one matmul on
    concatenated kernels (and LoRA A's), which XLA:CPU runs closer to its matmul peak than two or three
    smaller ones; the concat copies the kernels, about 1/rows of the matmul work. On XLA:CPU and off a
    mesh only, and where `fuses` says (enough rows, and a joined kernel no larger than the output, since
    autodiff keeps it): accelerators' matmuls are large already, and on a mesh the tensor rules split
    `out`, where a concat would move data.
  * The decode step's attention over the cache in C++ on a CPU in float32 (`native_cached_attention`,
    amdllm/native/attention.cc; 3.6x XLA's at batch 8 over 192 slots).
  * Per-layer decoding and training: `layers` may be a list of per-layer dicts (`amdllm.model.views`:
    zero-copy views of the stack on a CPU), which run as an unrolled loop (`_unrolled`). A decode step
    then reads each layer's weights where they lie instead of XLA copying every layer's slice out of the
    stack; a training step builds no stacked residuals. CPU only; the scan stays elsewhere.
  * Narrow weights (bfloat16, float16) on a CPU: carried as their bits and widened one layer at a time,
    or multiplied as bf16 where the CPU can; the head by vocabulary blocks (`amdllm.model.narrow`).
The XLA:CPU compiler options the jitted steps use are in `amdllm.cpu`.
"""
from __future__ import annotations

import math
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from amdllm import native
from amdllm.config import LlamaConfig
import amdllm.model.llama as llama
from amdllm.model.attention import _scores, cached_attention, library_attention
from amdllm.model.dense import Dense
from amdllm.model.layers import lora_delta, rms_norm, rope_tables
from amdllm.model.llama import KVCache, Kernels, LoRA, Run, block, embed, project
from amdllm.model.narrow import (Bits, bf16_dots_for, fence, has_bits, head_blocked, hold_stacked,
                                 keep_all_but_widening, keep_bits, lookup, native_rows_for, unwidened)
from amdllm.model.views import split_cache

FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
FUSE_MIN_ROWS = 64  # below this (decoding), copying the kernels costs more than fewer matmuls save


# --------------------------------------------------------------------------------------------------
# Fused projections
# --------------------------------------------------------------------------------------------------
def fuses(rows: int, in_features: int) -> bool:
    """Whether a group of projections of `rows` rows of width `in_features` runs as one matmul (where
    `kernels(fuse=True)`): from FUSE_MIN_ROWS rows, and only where the joined kernel [in, sum(out)] is no
    larger than the output [rows, sum(out)]. Why the second: autodiff keeps each layer's joined kernel for
    the backward pass, every layer's at once. On the 1B shape in float32 at 1 x 256 tokens (in = 2048) that
    was 2.5 GB of the step's 8.7 GB (XLA's figure), with no speed gained (40.5 fused against 42.1 tokens/s);
    on the 31M benchmark's step (2048 rows, in = 512) fusing is 2-3% faster (1.32-1.34 against 1.35-1.38 s
    a step on a 2-core Intel Xeon, in alternating processes; docs/benchmark-history.md, "fused projections
    and memory")."""
    return rows >= FUSE_MIN_ROWS and in_features <= rows


def project_group(p: dict, key: str, x, lora: LoRA, fuse: bool, joined: bool = False):
    """The projections FUSED[key] of one input x -> their outputs (a list), as one matmul when fused.

    joined=True: when fused, the one [..., sum(out)] output unsplit (its consumer takes it whole)."""
    names = FUSED[key]
    rows = math.prod(x.shape[:-1])
    if (not fuse or not fuses(rows, x.shape[-1]) or any(isinstance(p[n], dict) for n in names)  # GPTQ: separate
            or any(jnp.dtype(p[n].dtype).itemsize < 4 for n in names)):  # XLA:CPU widens narrow kernels
        # (a copy each already): a concat would be one more
        # one 2-D view of x for all of them: autodiff then keeps it once for the backward pass, not once per
        # projection (`layers.linear` leaves a 2-D input as it is)
        x2 = x.reshape(-1, x.shape[-1])
        outs = []
        for n in names:  # narrow kernels as bits: each widened after the one before it is used
            widened = isinstance(p[n], Bits) and not (bf16_dots_for(p[n], rows) or native_rows_for(p[n], rows))
            q = {**p, n: p[n].after(outs[-1])} if outs and widened else p
            outs.append(project(q, n, x2, lora))
        return [o.reshape(*x.shape[:-1], o.shape[-1]) for o in outs]
    sizes = [p[n].shape[-1] for n in names]
    x2 = x.reshape(-1, x.shape[-1])
    joined_kernel = jnp.concatenate([p[n].w if isinstance(p[n], Dense) else p[n] for n in names], axis=-1)
    y = x2 @ joined_kernel.astype(x.dtype)                                                # [rows, sum(out)]
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
ATTENTION = ("blocked", "native", "xla", "cudnn")
NATIVE_BLOCK = 32  # query positions per block in attention.cc (31M step: the same speed at 64, slower at 16)


def attention_implementation(dtype) -> str:
    """The attention training, evaluation and prefills run (one of ATTENTION): $AMDLLM_ATTENTION where set;
    else "cudnn" (cuDNN's fused flash attention) on an NVIDIA GPU in fp16/bf16, "native" (`native_attention`)
    on a CPU where the native library builds (float32, or bf16/fp16 widened to it), and our blocked one
    elsewhere: cuDNN's does not run on ROCm (ROCm/jax#604) nor in float32, and on CPUs and TPUs XLA's
    unfused attention keeps [B, H, T, T] float32 probabilities for the backward."""
    chosen = os.environ.get("AMDLLM_ATTENTION", "").strip()
    if chosen:
        if chosen not in ATTENTION:
            raise ValueError(f"AMDLLM_ATTENTION={chosen!r}: expected one of {', '.join(ATTENTION)}")
        return chosen
    nvidia = jax.default_backend() == "gpu" and "nvidia" in jax.devices()[0].device_kind.lower()
    if nvidia and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    if jnp.issubdtype(dtype, jnp.floating) and native.attention_available():  # False off the CPU
        return "native"
    return "blocked"


def _all_float32(*xs) -> bool:  # what amdllm/native/attention.cc takes
    return all(jnp.dtype(x.dtype) == jnp.float32 for x in xs)


def native_attention(q, k, v, mask):
    """`causal_attention` (same arguments and numbers, to float32 rounding) in amdllm/native/attention.cc.
    On the 31M benchmark step's shape (batch 8 x 256, 8 heads over 2 kv heads, head size 64; 2-core AMD
    EPYC Zen 4) a layer's forward and backward took 18 ms against 45-52 ms for the XLA version (`jax.jit`
    timings; docs/benchmark-history.md, "native attention").

    bf16 or fp16 q, k and v are widened to float32 for the kernel and its output narrowed back (their
    gradients too): [B, T, H, hd] copies, small beside the products. The attention is then computed in
    float32 from the narrow inputs, as PyTorch's CPU flash attention accumulates bf16 in float32; XLA:CPU
    would widen every bf16 operand anyway. The 1B bf16 LoRA step: 97.9 -> 108.1 tokens/s on a 2-core
    Intel Xeon (docs/benchmark-history.md, "the 1B bf16 step's attention and head")."""
    wide = tuple(x.astype(jnp.float32) for x in (q, k, v))
    return native.causal_attention(*wide, mask, 1 / math.sqrt(q.shape[-1]), NATIVE_BLOCK).astype(q.dtype)


@jax.custom_vjp
def native_cached_attention(q, k, v, mask):
    """`amdllm.model.attention.cached_attention` (same arguments and numbers, to float32 rounding) in
    amdllm/native/attention.cc when q, k and v are float32, else XLA's. The decode step's attention: at batch
    8 over 192 cache slots (31M model, 2-core AMD EPYC Zen 4) 63 against 229 us a layer (`jax.jit` timings,
    docs/benchmark-history.md, "native attention"). Differentiable through XLA's version (a prefill's)."""
    if not _all_float32(q, k, v):
        return cached_attention(q, k, v, mask)
    return native.cached_attention(q, k, v, mask, 1 / math.sqrt(q.shape[-1]))


def _native_cached_bwd(res, do):
    q, k, v, mask = res
    return (*jax.vjp(lambda q, k, v: cached_attention(q, k, v, mask), q, k, v)[1](do), None)


native_cached_attention.defvjp(lambda q, k, v, mask: (native_cached_attention(q, k, v, mask), (q, k, v, mask)),
                               _native_cached_bwd)


def held_rope_tables(cfg: LlamaConfig, positions):
    """`layers.rope_tables`, each table written to memory once (`native.materialized`, a CPU only): XLA:CPU
    otherwise fuses cos and sin into every rotation of q and k and evaluates them again per head, forward and
    backward (31M benchmark LoRA step: about 40 ms of ~1.5 s; docs/benchmark-history.md, "the per-layer
    training step"). The same numbers."""
    return tuple(native.materialized(t) for t in rope_tables(cfg, positions))


def kernels(fuse: bool, attention: str = "blocked", held_rope: bool = False) -> Kernels:
    """The fast kernels; fuse: join q/k/v and gate/up into one matmul each (see the module doc);
    attention: one of ATTENTION; held_rope: the RoPE tables through `held_rope_tables` (a CPU, no mesh)."""
    def mlp(p, h, lora):
        gu = project_group(p, "gate_up", h, lora, fuse, joined=True)
        return swiglu_joined(gu) if not isinstance(gu, list) else swiglu_pair(*gu)

    attend = {"blocked": causal_attention, "native": native_attention}.get(attention) or partial(
        library_attention, implementation=attention)
    return Kernels(qkv=lambda p, h, lora: tuple(project_group(p, "qkv", h, lora, fuse)),
                   attend=attend, mlp=mlp, weights=fence, lookup=lookup,
                   rope=held_rope_tables if held_rope else rope_tables,
                   attend_cached=native_cached_attention if attention == "native" else cached_attention)


def kernels_for(run: Run, layers=None) -> Kernels:
    attention = attention_implementation(run.dtype)
    if attention == "native" and run.act_sharding is not None:  # XLA cannot split a custom call over a mesh
        attention = "blocked"
    alone = run.act_sharding is None and jax.default_backend() == "cpu"  # XLA:CPU, off a mesh
    k = kernels(fuse=alone, attention=attention, held_rope=alone)
    if has_bits(layers) and isinstance(layers, dict):  # a frozen narrow base, scanned
        k = k._replace(checkpoint=keep_bits, hold=hold_stacked)
    return k


def forward(cfg: LlamaConfig, top: dict, layers, tokens, *, run: Run = Run(), **kw):
    """`llama.forward` (same arguments and results) with the fast kernels. `layers` may also be a list of
    per-layer dicts (`views.layer_views`, `views.step_views`): the layers then run as an unrolled loop,
    with a per-layer cache (tuples, `views.init_cache(per_layer=True)`) or a stacked one; a per-layer
    cache also works with stacked layers (a prefill scans the stacked weights and hands the decode steps
    a per-layer cache)."""
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
    """`llama.forward` over per-layer weights, as a Python loop (compile time grows with depth) -> (the
    normed hidden states, cache). Without a cache each layer keeps what `run.remat` says, as in the scan."""
    x, rope, mask, valid = embed(cfg, top, tokens, positions, segment_ids, cache, cache_index, run.dtype, kernels)

    def layer(x, xs):
        p, kv, rng = xs
        return block(cfg, kernels.weights(p), x, rope, mask, kv, cache_index, kernels=kernels,
                     lora=LoRA(run.lora_scale, run.lora_dropout, rng))

    if cache is None:  # training or evaluation; a decode step is never differentiated
        if not unwidened(layer_list, math.prod(tokens.shape)):
            # a narrow kernel widened in XLA: keep none of the widened copies for the backward
            kernels = kernels._replace(checkpoint=partial(jax.checkpoint, policy=keep_all_but_widening,
                                                          prevent_cse=False))
        layer = llama.remat(layer, run, kernels)
    ks, vs = [], []
    for i, p in enumerate(layer_list):
        rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, i)
        kv = None if cache is None else (cache.k[i], cache.v[i])
        x, kv = layer(x, (p, kv, rng))
        if kv is not None:
            ks.append(kv[0])
            vs.append(kv[1])
    x = rms_norm(x, top["norm"], cfg.rms_norm_eps)
    new = None
    if cache is not None:  # a stacked cache stays stacked
        stacked = not isinstance(cache.k, (tuple, list))
        new = KVCache(jnp.stack(ks) if stacked else tuple(ks), jnp.stack(vs) if stacked else tuple(vs), valid)
    return x, new
