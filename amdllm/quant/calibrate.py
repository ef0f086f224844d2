"""GPTQ through a whole model: calibration layer by layer, reports, paper sizes.

As the reference (IST-DASLab `llama.py::llama_sequential`): embed the calibration windows once, then for
each decoder layer accumulate every linear's input second moment H = 2/n sum x x^T (streamed batch by
batch), quantize the layer's linears true-sequentially (q,k,v -> o -> gate,up -> down) and feed the
quantized layer's outputs to the next layer. The attention output is computed once a layer and kept
for the later groups (`attention_plan`)."""
from __future__ import annotations

import functools
import json
import math
import warnings
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from amdllm.progress import tqdm

from amdllm import model as M
import amdllm.model.fast as fast
import amdllm.model.narrow as narrow
from amdllm.model.inputs import expect_model
from amdllm.model.llama import attention_mask
from amdllm.config import LlamaConfig
from amdllm.model.quantized import QuantLinear, group_count, packed_logical_axes
import amdllm.quant.gptq as gptq
from amdllm.quant.gptq import GPTQError

MIN_CALIBRATION_TOKENS = 128  # fewer is a slip (--samples 1 --seq-len 16), not a calibration set

UNFUSED = fast.kernels(fuse=False)
# which captured input feeds which projection; and the true-sequential order
INPUT_OF = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "o_in",
            "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "down_in"}
SEQUENTIAL = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
ATTN_INPUTS = ("q_proj", "k_proj", "v_proj")  # what the attention output depends on


def layer_with_inputs(cfg, p, x, cos, sin, mask, attn=None):
    """The model's own decoder block (`amdllm.model.block`), also returning each projection's input.

    The block's tap collects them. attn: this x's attention output [B, T, H*hd] (the o_proj input) when
    already known: the tap substitutes it, so q/k/v and attention become dead code that XLA drops
    (true-sequential calibration reuses it for the groups after o_proj, whose inputs q/k/v no longer
    change). The projections stay separate (unfused), each quantized on its own."""
    ins = {}

    def tap(name, a):
        ins[name] = attn if (name == "o_in" and attn is not None) else a
        return ins[name]

    x, _ = M.block(cfg, p, x, (cos, sin), mask, kernels=UNFUSED, tap=tap)
    return x, ins


def attention_plan(groups) -> tuple[list[tuple[bool, bool]], bool]:
    """Which calibration passes can reuse the layer's attention output -> ([(reuse, keep)] per group,
    forward reuses). The attention output depends on q/k/v only: the first pass after they are quantized
    keeps it, and every later pass of the layer reads it instead of computing attention again (once a layer,
    not four times, for one more activation array held). Without true-sequential nothing is reused."""
    plan, have = [], False
    for grp in groups:
        changes_attn = any(g in ATTN_INPUTS for g in grp)  # quantizing this group makes it stale
        keep = not have and bool({INPUT_OF[g] for g in grp} - {"attn_in"}) and not changes_attn
        plan.append((have, keep))
        have = (have or keep) and not changes_attn
    return plan, have


def check_samples(samples: int, distinct: int, seq_len: int) -> None:
    """More windows than the text has distinct ones repeat it and only cost memory: the text bounds the work."""
    if samples > distinct:
        raise ValueError(f"--samples {samples}: the calibration text holds only {distinct:,} distinct windows of "
                         f"{seq_len} tokens; pass --samples {distinct} or fewer, or a longer text")


def calibration_windows(token_ids, samples: int, seq_len: int, seed: int = 0) -> np.ndarray:
    """`samples` windows [samples, seq_len] at random starts (reproducible by seed) in a token stream."""
    ids = np.asarray(token_ids, np.int32).reshape(-1)
    if samples < 1 or seq_len < 2:
        raise ValueError(f"calibration needs samples >= 1 and seq_len >= 2 (got {samples}, {seq_len})")
    if ids.size < seq_len:
        raise ValueError(f"too few calibration tokens: the text has {ids.size} tokens, one window of "
                         f"--seq-len {seq_len} needs {seq_len}; give a longer --calib file or a smaller --seq-len")
    check_samples(samples, ids.size - seq_len + 1, seq_len)
    starts = np.random.default_rng(seed).integers(0, ids.size - seq_len + 1, size=samples)
    return np.stack([ids[s:s + seq_len] for s in starts])


def _rope_mask(cfg, B, T):
    """RoPE tables and the causal mask of B calibration windows of T tokens: (cos, sin, mask)."""
    cos, sin = M.rope_tables(cfg, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)))
    mask, _ = attention_mask(jnp.ones((B, T), jnp.int32), None, None)
    return cos, sin, mask


@functools.lru_cache(maxsize=4)
def _calibration_fns(cfg_json: str):
    """(second_moments, forward, layer_params, hessian, rope_mask), jitted once per model config and kept across
    `quantize_model` calls (notebook 04 quantizes the same model four times; closures made inside the
    call were compiled again by every call). The key is the config as JSON: the config holds a dict,
    so it is not hashable."""
    cfg = LlamaConfig.from_dict(json.loads(cfg_json))

    @functools.partial(jax.jit, static_argnames=("keep",))
    def second_moments(p, xs, attn, Hs, cos, sin, mask, keep=False):
        """Hs + sum over the chunk of x x^T, for each input in Hs -> (Hs, the chunk's attention
        outputs if keep, else None). attn: those outputs when known (`attention_plan`), else None."""
        # only Hs (and attn if kept) leave the loop, so tracing drops what those inputs do not need
        # (e.g. the whole layer but the first norm for q/k/v): true-sequential groups do not pay a
        # full forward each
        def step(Hs, xa):
            ins = layer_with_inputs(cfg, p, xa[0], cos, sin, mask, attn=xa[1])[1]
            return {k: h + ins[k].reshape(-1, h.shape[0]).T @ ins[k].reshape(-1, h.shape[0])
                    for k, h in Hs.items()}, (ins["o_in"] if keep else None)
        return jax.lax.scan(step, Hs, (xs, attn))  # attn None: an empty pytree, x alone

    # the layer's output may take the kept attention outputs' buffer (same shape when H*hd = D): the
    # loop then holds two activation arrays at a time, as it did before attention was kept
    same = cfg.num_attention_heads * cfg.head_dim == cfg.hidden_size

    @functools.partial(jax.jit, donate_argnums=(2,) if same else ())
    def forward(p, xs, attn, cos, sin, mask):
        return jax.lax.map(lambda xa: layer_with_inputs(cfg, p, xa[0], cos, sin, mask, attn=xa[1])[0],
                           (xs, attn))

    @jax.jit
    def layer_params(layers, li):
        """Layer li of the stacked params, float32, and its kernels transposed to the reference's
        [out, in]: one compile, not an eager slice or transpose compiled per shape."""
        # narrow weights come as `narrow.Bits`: one layer is sliced from the bits and widened (XLA:CPU would
        # widen the whole stack to slice it)
        p = {k: narrow.widen(jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, li, keepdims=False), v))
             .astype(jnp.float32) for k, v in layers.items()}
        return p, {k: p[k].T for k in M.PROJECTIONS}

    @jax.jit
    def hessian(h, ntok):  # H = 2/n sum x x^T, as the reference scales it (GPTQ itself is scale-free)
        return 2.0 * h / ntok

    rope_mask = jax.jit(functools.partial(_rope_mask, cfg), static_argnums=(0, 1))
    return second_moments, forward, layer_params, hessian, rope_mask


def _compile_ahead(fns, spec, layers, chunks, consts, groups, plan, fwd_reuse, rtn: bool) -> dict:
    """Start compiling, on 2 background threads, every function the GPTQ layer loop will call, in the
    order it needs them -> {key: future}; `_ready` waits for one before its first call.

    XLA compiles a function on one core, and the loop's compiles happen one after another on first
    use, so the other cores sat idle for that time. An
    ahead-of-time `lower().compile()` fills jit's cache (a later call with the same shapes does not
    compile again). A job that fails costs nothing: the call then compiles as before. plan, fwd_reuse:
    the loop's `attention_plan(groups)`, so that the jobs are the calls the loop makes."""
    second_moments, forward, layer_params, hessian, _ = fns
    S = jax.ShapeDtypeStruct
    f32 = jnp.float32
    p = jax.eval_shape(layer_params, layers, 0)[0]
    jobs = {"layer_params": (layer_params, (layers, 0), {})}
    kw = gptq.core_kwargs(spec)
    attn = lambda xs: S(xs.shape[:-1] + (p["o_proj"].shape[0],), f32)  # noqa: E731 -- [m, b, T, H*hd]
    for gi, (grp, (reuse, keep)) in enumerate(zip(groups, plan)):
        for ci, (xs, c) in enumerate(zip(chunks, consts)):
            Hs = {INPUT_OF[g]: S((p[g].shape[0],) * 2, f32) for g in grp}
            jobs[("sm", gi, ci)] = (second_moments, (p, S(xs.shape, f32), attn(xs) if reuse else None, Hs, *c),
                                    {"keep": keep})
        for g in grp:
            K, N = p[g].shape
            jobs.setdefault(("hess", K), (hessian, (S((K, K), f32), f32(1)), {}))
            jobs.setdefault(("mend", K), (gptq._mend_dead, (S((K, K), f32),), {}))
            jobs.setdefault(("core", N, K), (gptq._gptq_core, (S((N, K), f32), S((K, K), f32), S((K,), bool),
                                                               S((K,), jnp.int32)), kw))
            if rtn:  # the report's RTN comparison
                jobs.setdefault(("err", N, K), (gptq._rtn_error, (S((N, K), f32), S((K, K), f32), f32(1)),
                                                gptq.errors_kwargs(spec, K)))
    for ci, (xs, c) in enumerate(zip(chunks, consts)):
        jobs[("fwd", ci)] = (forward, (p, S(xs.shape, f32), attn(xs) if fwd_reuse else None, *c), {})
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="amdllm-compile")
    futures = {key: pool.submit(lambda f=f, a=a, k=k: f.lower(*a, **k).compile())
               for key, (f, a, k) in jobs.items()}
    pool.shutdown(wait=False)
    return futures


def _ready(futures: dict, *keys) -> None:
    for key in keys:
        f = futures.pop(key, None)
        if f is not None:
            try:
                f.result()
            except Exception:  # noqa: BLE001 -- a shape this guess got wrong compiles on first call
                pass


def quantize_model(model, windows, spec, *, method: str = "gptq", batch_size: int = 8,
                   progress: bool = True, report: bool = True, compare_rtn: bool = True):
    """Quantize every projection of `model` (dense, float) in place -> (model, rows).

    windows [n, T] int tokens (ignored for RTN). rows (GPTQ with report): one dict per (layer,
    projection) with the per-token reconstruction error ||WX-QX||^2 of GPTQ, which the solve yields
    for free (`QuantResult.err`), and with compare_rtn that of RTN on the same inputs: one more
    [N, K] x [K, K] product per linear (about 15% of the run at the 1B shape), so `amdllm quantize`
    asks for it only with --compare-rtn.
    """
    expect_model(model, "quantize_model")
    if method not in ("gptq", "rtn"):
        raise GPTQError(f"method {method!r} is not supported; expected 'gptq' or 'rtn'")
    cfg = model.cfg
    top, layers = M.to_pure(model)
    for proj in M.PROJECTIONS:
        if isinstance(layers.get(proj), dict) or proj + "_lora_a" in layers:
            raise GPTQError(f"layers.{proj} is already quantized or has LoRA attached; quantize a plain "
                            "float model (merge adapters first)")
        spec.groups(layers[proj].shape[1], f"layers.{proj} (in_features)")
    L = cfg.num_hidden_layers
    packed = {proj: [] for proj in M.PROJECTIONS}
    rows = []
    fns = _calibration_fns(json.dumps(cfg.to_dict(), sort_keys=True))
    second_moments, forward, layer_params, hessian, rope_mask = fns
    chunks = consts = None
    ntok = 0
    if method == "gptq":
        windows = np.asarray(windows, np.int32)
        n, T = windows.shape
        if windows.min() < 0 or windows.max() >= cfg.vocab_size:
            raise GPTQError(f"calibration token ids span [{windows.min()}, {windows.max()}] but the model's "
                            f"vocab_size is {cfg.vocab_size}: tokenizer and model do not match")
        full_rank = 2 * max(layers[p].shape[1] for p in M.PROJECTIONS)
        if n * T < MIN_CALIBRATION_TOKENS:
            raise GPTQError(f"too few calibration tokens: {n} x {T} = {n * T}; need at least "
                            f"{MIN_CALIBRATION_TOKENS} (and {full_rank}, twice the largest in_features, for "
                            "full-rank Hessians)")
        if n * T < full_rank:  # GPTQModel and AutoGPTQ run too: dampening keeps H invertible
            warnings.warn(f"{n} x {T} = {n * T} calibration tokens, fewer than {full_rank} (twice the largest "
                          "in_features): some Hessians are rank-deficient, held up by dampening only, and GPTQ "
                          "may gain little over RTN there; more --samples help", stacklevel=2)
        bs = min(batch_size, n)
        cos, sin, mask = rope_mask(bs, T)
        emb = np.asarray(top["embed_tokens"])  # rows gathered on the host, then widened: not the whole table
        # the activations as chunks [m, b, T, D] (the full batches stacked, then the remainder), each
        # chunk one compiled call looping over its batches: one call per batch cost a dispatch each
        full = n // bs * bs
        chunks = [jnp.asarray(emb[windows[:full].reshape(n // bs, bs, T)].astype(np.float32))]
        if n > full:
            chunks.append(jnp.asarray(emb[windows[full:][None]].astype(np.float32)))

        # RoPE tables and mask sliced to each chunk's batch once, not per group and layer
        consts = [(cos[:xs.shape[1]], sin[:xs.shape[1]], mask[:xs.shape[1]]) for xs in chunks]
        ntok = n * T

    layers = narrow.carry_bits(layers)
    groups = SEQUENTIAL if spec.true_sequential else (M.PROJECTIONS,)
    plan, fwd_reuse = attention_plan(groups)
    futures = (_compile_ahead(fns, spec, layers, chunks, consts, groups, plan, fwd_reuse, report and compare_rtn)
               if method == "gptq" else {})
    try:
        bar = tqdm(total=L * 7, desc=f"{method} {spec.bits}-bit", disable=not progress)
        for li in range(L):
            _ready(futures, "layer_params")
            p, Wt = layer_params(layers, li)                       # Wt: kernels as the reference's [N, K]
            attn = [None] * len(chunks or ())                     # per chunk, once kept (attention_plan)
            for gi, (grp, (reuse, keep)) in enumerate(zip(groups, plan)):
                if method == "gptq":
                    Hs = {INPUT_OF[g]: np.zeros((p[g].shape[0],) * 2, np.float32) for g in grp}
                    for ci, (xs, c) in enumerate(zip(chunks, consts)):
                        _ready(futures, ("sm", gi, ci))
                        Hs, a = second_moments(p, xs, attn[ci] if reuse else None, Hs, *c, keep=keep)
                        if keep:
                            attn[ci] = a
                    _ready(futures, *{("hess", h.shape[0]) for h in Hs.values()})
                    Hs = {k: hessian(h, jnp.float32(ntok)) for k, h in Hs.items()}
                for proj in grp:
                    W = Wt[proj]                                       # ours [K, N] -> reference [N, K]
                    where = f"layer {li} {proj}"
                    if method == "gptq":
                        H = Hs[INPUT_OF[proj]]
                        N, K = W.shape
                        _ready(futures, ("mend", K), ("core", N, K), ("err", N, K))
                        res = gptq.gptq_quantize(W, H, spec, where=where)
                        if report:  # H / 2: the raw second moment
                            rows.append({"layer": li, "proj": proj, "gptq_err": 0.5 * res.err, "damp": res.damp})
                            if compare_rtn:
                                rows[-1]["rtn_err"] = gptq.rtn_error(W, H, spec, h_scale=0.5)
                    else:
                        res = gptq.rtn_quantize(W, spec)
                    p[proj] = jax.device_put(np.ascontiguousarray(res.Q.T))  # later groups/layers see quantized
                    # kept packed: the dense Q and int codes of every layer were another model in float32
                    packed[proj].append(np.asarray(res.Q) if spec.bits == 3 else res.packed(spec.bits))
                    bar.update(1)
            if method == "gptq":  # the quantized layer's outputs are the next layer's inputs
                _ready(futures, *[("fwd", ci) for ci in range(len(chunks))])
                chunks = [forward(p, xs, a if fwd_reuse else None, *c) for xs, a, c in zip(chunks, attn, consts)]
        bar.close()
    finally:  # an error mid-way: do not leave compiles queued
        for f in futures.values():
            f.cancel()
    _install(model, packed, spec.bits)
    return model, rows


def _install(model, packed, bits):
    """Replace each stacked projection of model.layers by a QuantLinear (or a dense fake-quant kernel
    for 3-bit, which the packed format does not cover)."""

    for proj, per in packed.items():  # per layer: Q [N, K] (3-bit) or QuantResult.packed's dict
        (_, axes) = M.param_table(model.cfg)["layers/" + proj]
        if bits == 3:
            dtype = getattr(model.layers, proj)[...].dtype
            setattr(model.layers, proj, nnx.Param(jax.device_put(np.stack([q.T for q in per])
                                                                 .astype(dtype)), axes=axes))
            continue
        # device_put: jnp.asarray compiles a program per shape
        setattr(model.layers, proj, QuantLinear(**{k: jax.device_put(np.stack([d[k] for d in per]))
                                                   for k in per[0]}, axes=packed_logical_axes(axes)))


# --------------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------------
def model_bytes(model) -> int:
    """Bytes of every array the model holds on the device (packed words count as packed)."""

    arrays = [x for x in jax.tree.leaves(nnx.state(model)) if hasattr(x, "nbytes")]
    return int(sum(x.size * _bits(x.dtype) // 8 for x in arrays))


def _bits(dtype) -> int:
    """Bits per element: 4 for (u)int4, whose arrays report a byte each in .nbytes."""
    return jnp.iinfo(dtype).bits if jnp.issubdtype(dtype, jnp.integer) else jnp.dtype(dtype).itemsize * 8


def paper_bytes(cfg, bits: int = 4, group_size: int = 128, fp_bytes: int = 2) -> dict:
    """Weight bytes on paper: projections at `bits` (+ fp16 scale and packed zero per group per
    output, + int32 g_idx), embeddings/norms/lm_head at fp_bytes. bits >= 16 means unquantized."""
    L, D, F, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes = [(D, cfg.q_dim), (D, cfg.kv_dim), (D, cfg.kv_dim), (cfg.q_dim, D), (D, F), (D, F), (F, D)]
    lin = 0.0
    for K, N in shapes:
        if bits >= 16:
            lin += K * N * fp_bytes
        else:
            ng = group_count(K, group_size)
            lin += K * N * bits / 8 + ng * N * (2 + bits / 8) + 4 * K
    other = (V * D * (1 if cfg.tie_word_embeddings else 2) + (2 * L + 1) * D) * fp_bytes
    total = L * lin + other
    return {"bits": bits, "group_size": group_size, "linear_bytes": L * lin, "other_bytes": other,
            "total_bytes": total, "total_gb": total / 1e9}


def devices_needed(total_bytes: float, device_gb: float = 192.0, usable: float = 0.9) -> int:
    """Devices for the weights alone, keeping (1-usable) of each for activations/KV cache."""
    return math.ceil(total_bytes / (device_gb * 1e9 * usable))
