"""One-shot GPU benchmark (NVIDIA H200/H100 or AMD MI300X), under 8 minutes.

0. Ceilings measured in the same run: a bf16 8192^3 `jnp.dot` (matmul peak) and a large device copy
   (HBM bandwidth, bytes read + written).
1. LoRA fine-tuning step on a Llama-3.1-8B-shaped model (random bf16 weights, sequence 2048, remat,
   LoRA rank 8 on all seven projections, AdamW): the largest batch whose compiled step fits (checked with
   XLA's memory analysis before running), tokens/s and MFU. FLOPs per token by amdllm.parallel.plan's LoRA count
   (4N + attention + LoRA terms: no weight gradients for frozen weights); MFU against the datasheet dense
   bf16 peak (amdllm.parallel.plan's table) and against the matmul rate measured in step 0.
2. One projection's 4-bit matmul by each route of amdllm.model.qmatmul (the reference that dequantizes
   the whole kernel, XLA's uint4 route, the Pallas kernel over a few tilings) against bf16 dense, at 1, 8
   and 256 rows on the 8B gate/up and down shapes: seconds, error against the reference, and the fraction
   of the copy bandwidth on the bytes each must read.
3. Decoding tokens/s (greedy, 64 new tokens after a 32-token prompt, batch 1 and 8) with bf16 weights and
   with 4-bit packed weights (GPTQ v1 layout, group 128, random codes: the same `QuantLinear` kernels a
   GPTQ checkpoint loads into, without spending the lease on quantizing 8B parameters), once per route
   (`prepare_kernels`), against the memory-bandwidth bound: decode steps/s if every step read the weights
   and the KV cache once. Each runs its layers two ways: the scan over stacked weights that `generate`
   runs on a GPU, and an unrolled loop over per-layer copies (`decode`). `--profile-dir` traces one batch-1
   call of each and summarizes the device's kernels (`summarize_trace`).
Phases run in the order ceilings, qmatmul, decode_bf16, decode_int4_pallas, lora_step_dots (1 above with
`remat="dots"`: each layer keeps its projections' outputs and recomputes only norms, RoPE, attention and
SwiGLU, instead of the whole layer), decode_int4_xla4, lora_step (1 above: the backend's attention, cuDNN's
on NVIDIA in bf16; its "attention" field says which), lora_step_blocked (remat full with amdllm's blocked
attention), decode_int4 (the reference route); `--phases` picks, `--budget-s` skips what is left.
4. serve_engine (after lora_step_dots): the server's engine decoding bf16 at `--engine-batches` concurrent
   requests (default 1, 8 and 32), with its step scanning the stacked layers (as `amdllm serve` runs it) and
   over static slices (`Engine(unstack=True)`), twice per batch: with and without compilation.
5. course (only when named in --phases): the six lessons run on the device exactly as `make course` runs
   them (`--quick` with --tiny), each lesson's seconds and the JAX backend its results name.

Results are written to OUT/gpu.json after every phase, so a run cut short still reports what it measured.

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python benchmarks/gpu.py --out $OUT   # on the accelerator
    python benchmarks/gpu.py --tiny --out /tmp/g                               # CPU smoke test, same code
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info  # noqa: E402

# Datasheet HBM bandwidth (bytes/s) by amdllm.parallel.plan accelerator key.
HBM_BYTES_PER_S = {"h200": 4.8e12, "h100": 3.35e12, "mi300x": 5.3e12, "mi325x": 6.0e12, "mi250x": 3.2e12,
                   "a100": 2.0e12}
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def timed(fn, n):
    import jax
    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n


def ceilings(tiny: bool, log) -> dict:
    """Measured matmul FLOP/s (bf16) and copy bandwidth (bytes read + written per second)."""
    import jax
    import jax.numpy as jnp
    n = 512 if tiny else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    dot = jax.jit(lambda a, b: a @ b)
    sec = timed(lambda: dot(a, b), 10)
    m = (1 << 20) if tiny else (1 << 30)                      # 2 GiB of bf16 on the accelerator
    x = jnp.ones((m,), jnp.bfloat16)
    copy = jax.jit(lambda x: x * 2)                           # reads m, writes m elements
    csec = timed(lambda: copy(x), 10)
    del a, b, x
    r = {"matmul_n": n, "matmul_flops": 2 * n ** 3 / sec, "copy_bytes": 4 * m, "copy_bytes_per_s": 4 * m / csec}
    log(json.dumps(r))
    return r


def lora_step(cfg, seq_len, batches, steps, measured_peak, log, attention: str | None = None, remat: str = "full"):
    """attention: force one of amdllm.model.fast.ATTENTION (AMDLLM_ATTENTION); None: the backend's choice."""
    import os

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from amdllm.model.fast import attention_implementation
    if attention:
        os.environ["AMDLLM_ATTENTION"] = attention
    else:
        os.environ.pop("AMDLLM_ATTENTION", None)
    attention = attention_implementation(jnp.bfloat16)
    from amdllm.model import lora as lora_mod
    from amdllm.parallel import plan
    from amdllm import train
    from amdllm.model import Llama

    model = Llama(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, remat=remat)
    lora_mod.apply_lora(model, rank=8, alpha=16)
    lora, frozen = train.split_params(model)
    opt, _ = train.make_optimizer(train.TrainConfig(steps=100, seq_len=seq_len))
    step = train.make_train_step(model, opt)
    fpt = plan.flops_per_token(cfg, seq_len, 8, LORA_TARGETS)["lora_train"]
    peak = train.peak_flops()
    dev = jax.devices()[0]
    limit = (dev.memory_stats() or {}).get("bytes_limit") if hasattr(dev, "memory_stats") else None
    tried = []
    for B in batches:
        rng = jax.random.key(0)
        toks = jax.random.randint(rng, (1, B, seq_len), 0, cfg.vocab_size)
        batch = {"tokens": toks, "targets": toks, "weights": jnp.ones_like(toks, jnp.float32),
                 "positions": jnp.broadcast_to(jnp.arange(seq_len), (1, B, seq_len)),
                 "segment_ids": jnp.ones_like(toks)}
        st = {"lora": lora, "opt": opt.init(lora)}
        try:
            t0 = time.perf_counter()
            compiled = step.lower(st["lora"], st["opt"], frozen, batch, rng).compile()
            compile_s = time.perf_counter() - t0
            ma = compiled.memory_analysis()
            need = None if ma is None else (ma.temp_size_in_bytes + ma.argument_size_in_bytes
                                            + ma.output_size_in_bytes - ma.alias_size_in_bytes)
            tried.append({"batch": B, "compile_s": compile_s, "bytes_needed": need, "bytes_limit": limit})
            if need and limit and need > 0.97 * limit:
                log(f"batch {B}: needs {need / 2**30:.1f} GiB > {limit / 2**30:.1f} GiB available; smaller")
                continue

            def run():
                st["lora"], st["opt"], m = compiled(st["lora"], st["opt"], frozen, batch, rng)
                return m["loss"]
            sec = timed(run, steps)
        except Exception as e:  # out of memory at this batch: try the next smaller one
            log(f"batch {B}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            tried.append({"batch": B, "error": str(e).splitlines()[0][:300]})
            continue
        tps = B * seq_len / sec
        res = {"batch": B, "seq_len": seq_len, "remat": remat, "attention": attention, "step_s": sec,
               "tokens_per_s": tps,
               "compile_s": compile_s, "bytes_needed": need,
               "flops_per_token": fpt, "flop_formula": "4N + 12*L*S*d_attn + LoRA terms (no frozen weight grads)",
               "peak_flops_datasheet": peak, "mfu": tps * fpt / peak if peak else None,
               "peak_flops_measured_matmul": measured_peak, "mfu_vs_measured_matmul": tps * fpt / measured_peak,
               "mfu_6N_count": tps * 6 * cfg.num_params() / peak if peak else None, "tried": tried}
        log(json.dumps(res))
        return res
    return {"error": "no batch size fitted", "tried": tried}


def random_int4(model, group_size=128, seed=0):
    """Replace every projection by a 4-bit packed QuantLinear holding random codes (GPTQ v1 layout)."""
    import jax
    import jax.numpy as jnp
    from amdllm import model as M
    from amdllm.model.quantized import QuantLinear
    key = jax.random.key(seed)
    for i, proj in enumerate(M.PROJECTIONS):
        L, K, N = getattr(model.layers, proj)[...].shape
        G = K // group_size
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        bits = lambda k, shape: jax.lax.bitcast_convert_type(jax.random.bits(k, shape, jnp.uint32), jnp.int32)  # noqa: E731
        setattr(model.layers, proj, QuantLinear(
            qweight=bits(k1, (L, K // 8, N)), qzeros=bits(k2, (L, G, N // 8)),
            scales=jnp.full((L, G, N), 0.01, jnp.float16),
            g_idx=jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32) // group_size, (L, K))))
    return model


def per_layer_copies(layers: dict) -> list[dict]:
    """Stacked layer weights [L, ...] as L per-layer dicts, copied on the device (the weights' memory twice).
    The CPU backend makes such views without copying (`amdllm.backends.cpu`); this lets a GPU run the same
    unrolled decode step, to see what the layer scan costs there."""
    from amdllm.model.fast import layer_slices
    return layer_slices(layers)  # outside jit: each slice is a copy


def summarize_trace(trace_dir: str, steps: int, top: int = 12) -> dict:
    """What a profile of `steps` decode steps says, from the trace's device planes: per line (a GPU stream,
    or XLA's ops / modules lines), how many events, their summed duration and the span they cover, and the
    costliest event names; device busy time per step against the traced wall time per step."""
    import glob
    from jax.profiler import ProfileData
    files = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))
    if not files:
        return {"error": f"no .xplane.pb under {trace_dir}"}
    data = ProfileData.from_file(files[-1])
    out = {"file": files[-1], "planes": []}
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        lines = []
        for line in plane.lines:
            evs = [(e.name, e.duration_ns, e.start_ns) for e in line.events]
            if not evs:
                continue
            by = {}
            for name, dur, _ in evs:
                n, t = by.get(name, (0, 0.0))
                by[name] = (n + 1, t + dur)
            busy = sum(d for _, d, _ in evs)
            span = max(st + d for _, d, st in evs) - min(st for _, _, st in evs)
            lines.append({"line": line.name, "events": len(evs), "busy_ms": busy / 1e6, "span_ms": span / 1e6,
                          "busy_ms_per_step": busy / 1e6 / steps, "events_per_step": len(evs) / steps,
                          "top": [{"name": k[:160], "count": n, "ms": t / 1e6}
                                  for k, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]]})
        out["planes"].append({"plane": plane.name, "lines": lines})
    return out


def decode(cfg, quant: bool, batches, new_tokens, bandwidth, log, route: str = "xla",
           variants=("scan", "sliced", "unrolled"), profile_dir: str | None = None):
    """Greedy decoding tokens/s per batch size and per way of running the layers: "scan" (the step scans the
    stacked weights), "sliced" (`Decoder(unstack=True)`: an unrolled loop over static slices of the stacked
    weights, inside the step) and "unrolled" (per-layer copies of the weights, an unrolled loop, as
    `generate` does on a CPU with zero-copy views). The steady rate counts from the third
    step on (`Decoder.tokens_per_second`), so the first call's compilation is not in it. With profile_dir,
    a second call at batch 1 of each variant is traced and summarized (`summarize_trace`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from amdllm.infer import generate as G
    from amdllm.quant.calibrate import model_bytes
    from amdllm.model import Llama
    from amdllm.model.qmatmul import prepare_kernels
    from amdllm.train import accelerator_name

    model = Llama(cfg, rngs=nnx.Rngs(1), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    if quant:
        random_int4(model)
        prepare_kernels(model, route)           # the packed words as the route reads them (model.qmatmul)
    nbytes = model_bytes(model)  # uint4 codes counted at half a byte: what the route should read
    stats = jax.devices()[0].memory_stats() or {}
    in_use = stats.get("bytes_in_use")  # what the device holds (a uint4 array stored a byte per code shows)
    sheet = HBM_BYTES_PER_S.get(accelerator_name())
    label = f"int4-g128 ({route})" if quant else "bf16"
    out = []
    real_prepare = G.backends.prepare
    copies = {}

    def unrolled_prepare(top, layers, *, rows):
        import dataclasses
        w = real_prepare(top, layers, rows=rows)
        key = id(jax.tree.leaves(layers)[0])
        if key not in copies:
            copies.clear()
            copies[key] = per_layer_copies(w.stacked)
        return dataclasses.replace(w, layers=copies[key], max_rows=1 << 30)
    try:
        for variant in variants:
            G.backends.prepare = unrolled_prepare if variant == "unrolled" else real_prepare
            for B in batches:
                prompts = np.random.default_rng(0).integers(3, cfg.vocab_size, (B, 32)).tolist()
                dec = G.Decoder(model, eos_ids=(), per_layer=variant == "unrolled", unstack=variant == "sliced")
                t0 = time.perf_counter()
                G.generate_ids(model, prompts, new_tokens, eos_ids=(), decoder=dec)  # compiles, then steady
                first = time.perf_counter() - t0
                steady = dec.tokens_per_second()                      # decode only (from step 3), tokens/s
                kv = 2 * cfg.num_hidden_layers * B * (32 + new_tokens) * cfg.kv_dim * 2
                step_bytes = nbytes + kv
                r = {"weights": label, "layers": variant, "batch": B, "new_tokens": new_tokens,
                     "first_call_s_incl_compile": first, "tokens_per_s_decode": steady,
                     "steps_per_s_decode": steady / B if steady else None, "model_bytes": nbytes,
                     "device_bytes_in_use": in_use,
                     "bound_steps_per_s_measured_bw": bandwidth / step_bytes,
                     "bound_steps_per_s_datasheet_bw": sheet / step_bytes if sheet else None}
                r["fraction_of_measured_bound"] = r["steps_per_s_decode"] / r["bound_steps_per_s_measured_bw"] \
                    if steady else None
                if profile_dir and B == 1 and variant != "unrolled":  # the same call again (compiled), traced
                    d = f"{profile_dir}/{route if quant else 'bf16'}_{variant}"
                    try:
                        opts = jax.profiler.ProfileOptions()
                        opts.python_tracer_level = 0  # the device's kernels and XLA's host side, no Python frames
                        jax.profiler.start_trace(d, profiler_options=opts)
                        G.generate_ids(model, prompts, new_tokens, eos_ids=(), decoder=dec)
                        jax.profiler.stop_trace()
                        r["profile"] = summarize_trace(d, new_tokens)
                    except Exception as e:  # a profiler that does not run here must not lose the timings
                        r["profile"] = {"error": f"{type(e).__name__}: {e}"[:300]}
                log(json.dumps({k: v for k, v in r.items() if k != "profile"}))
                out.append(r)
    finally:
        G.backends.prepare = real_prepare
        copies.clear()
    del model
    jax.clear_caches()
    return out


def qmatmul_routes(cfg, bandwidth, log, tiny: bool):
    """One projection's matmul, 4-bit g128, by each route of amdllm.model.qmatmul: decode rows (1 and 8) and
    a prefill block (256 rows), on the 8B shapes [4096 -> 14336] (gate/up) and [14336 -> 4096] (down); the
    Pallas kernel over a few tilings (block_n, k_splits); bf16 dense alongside. Reports seconds and the
    fraction of the copy bandwidth each achieves on the bytes it must read (weights + x)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from amdllm.model import qmatmul as Q
    from amdllm.model.quantized import pack_cols, pack_rows
    interpret = jax.default_backend() == "cpu"  # the --tiny smoke test: Pallas' interpreter
    shapes = [(256, 512), (512, 256)] if tiny else [(cfg.hidden_size, cfg.intermediate_size),
                                                    (cfg.intermediate_size, cfg.hidden_size)]
    rng = np.random.default_rng(0)
    out = []
    for K, N in shapes:
        G = K // 128
        q = {"qweight": jnp.asarray(pack_rows(rng.integers(0, 16, (K, N)), 4)),
             "qzeros": jnp.asarray(pack_cols(rng.integers(0, 16, (G, N)), 4)),
             "scales": jnp.asarray(rng.random((G, N)) * 0.01, jnp.float16),
             "g_idx": jnp.asarray(np.arange(K) // 128, jnp.int32)}
        q4 = Q.to_int4(q)
        dense = jax.random.normal(jax.random.key(0), (K, N), jnp.bfloat16)
        qbytes = K * N // 2 + G * N * 2 + G * N // 2
        for M in (1, 8, 256):
            x = jax.random.normal(jax.random.key(M), (M, K), jnp.bfloat16)
            ref = np.asarray(Q.reference_matmul(x, q), np.float32)
            runs = {"bf16_dense": (jax.jit(lambda x, w: x @ w), (x, dense), 2 * K * N),
                    "xla_dequant": (jax.jit(lambda x, q: Q.packed_matmul(x, q, x.dtype)), (x, q), qbytes),
                    "xla_int4": (jax.jit(Q.int4_matmul), (x, q4), qbytes)}
            # (block_n, k_splits, num_warps, gemv_rows): the GEMV kernel at decode rows, and at 8 rows also the
            # tensor-core kernel (gemv_rows=0: 8 rows padded to a 16-row tile)
            if M == 1:
                tilings = [(None, None, 4, 16), (64, 1, 4, 16), (128, 1, 4, 16), (128, 2, 4, 16), (256, 1, 8, 16),
                           (32, 8, 4, 16), (64, 4, 4, 16), (128, 4, 8, 16)]
            elif M <= 16:
                tilings = [(None, None, 4, 16), (32, 8, 4, 16), (64, 1, 4, 16), (None, None, 4, 0),
                           (64, 1, 4, 0), (128, 1, 4, 0), (64, 4, 4, 0), (128, 2, 8, 0)]
            else:
                tilings = [(None, None, 4, 16), (128, 1, 4, 16), (64, 1, 4, 16), (128, 1, 8, 16)]
            # and the codes read as floats through 2^23's bits (`qmatmul.codes_as_float`), not yet run on a GPU,
            # on the default tiling and run 5's best ones (benchmarks/results/gpu_h200_run5.json)
            bits_read = {1: [(None, None, 4, 16), (128, 4, 8, 16), (64, 4, 4, 16)],
                         8: [(None, None, 4, 0), (64, 4, 4, 0)]}.get(M, [(None, None, 4, 16)])
            for bn, ks, nw, gr, dq in [t + ("convert",) for t in tilings] + [t + ("bits",) for t in bits_read]:
                f = jax.jit(lambda x, a, b, c, bn=bn, ks=ks, nw=nw, gr=gr, dq=dq: Q.pallas_matmul(
                    x, a, b, c, bits=4, group_size=128, block_n=bn, k_splits=ks, num_warps=nw, gemv_rows=gr,
                    interpret=interpret, dequant=dq))
                kind = "gemv" if M <= gr else "dot"
                runs[f"pallas_{kind}_bn{bn or 'auto'}_ks{ks or 'auto'}_w{nw}" + ("_bits" if dq == "bits" else "")] = (
                    f, (x, q["qweight"], q["qzeros"], q["scales"]), qbytes)
            for name, (f, args, nbytes) in runs.items():
                try:
                    got = np.asarray(f(*args), np.float32)
                    err = None if name == "bf16_dense" else \
                        float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6))
                    sec = timed(lambda: f(*args), 20)
                    r = {"K": K, "N": N, "M": M, "route": name, "seconds": sec, "rel_err_vs_reference": err,
                         "fraction_of_copy_bw": (nbytes + M * K * 2) / sec / bandwidth}
                except Exception as e:  # a tiling Triton refuses: record it, go on
                    r = {"K": K, "N": N, "M": M, "route": name, "error": f"{type(e).__name__}: {e}"[:300]}
                log(json.dumps(r))
                out.append(r)
    return out


class _IdTokenizer:
    """What the engine asks of a tokenizer, for random weights: ids are the text (no vocabulary to load)."""
    eos_token_id = pad_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def serve_engine(cfg, batches, new_tokens, bandwidth, log, quant_route: str | None = None,
                 variants=("scan", "sliced")):
    """The server's continuous-batching engine (`amdllm.infer.engine.Engine`, as `amdllm serve` runs it) on
    the same model as `decode`: B requests of a 32-token prompt and `new_tokens` greedy tokens submitted
    together; tokens/s over the decode steps after the first two (the prefills and the compilation of each
    step shape excluded), and the time of the whole first round (compilation included). Engine.warmup
    compiles the batch-1 step first. Each variant runs the step's layers one way: "scan" (the server's
    default) or "sliced" (`Engine(unstack=True)`: static slices of the stacked weights, as `generate` does
    on a GPU)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from amdllm.model import Llama
    from amdllm.model.qmatmul import prepare_kernels
    from amdllm.quant.calibrate import model_bytes

    model = Llama(cfg, rngs=nnx.Rngs(1), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    if quant_route:
        random_int4(model)
        prepare_kernels(model, quant_route)
    nbytes = model_bytes(model)
    out = []
    for variant in variants:
        out += _engine_rounds(cfg, model, variant, batches, new_tokens, bandwidth, nbytes, quant_route, log)
    del model
    jax.clear_caches()
    return out


def _engine_rounds(cfg, model, variant, batches, new_tokens, bandwidth, nbytes, quant_route, log):
    import threading
    import numpy as np
    from amdllm.infer.engine import Engine, Request
    engine = Engine(model, _IdTokenizer(), max_batch=max(batches), max_len=32 + new_tokens + 64, eos_ids=(),
                    unstack=variant == "sliced")
    out = []
    try:
        t0 = time.perf_counter()
        engine.warmup()
        warm = time.perf_counter() - t0
        for B in batches:
            for round_ in ("first", "second"):  # the first compiles this batch's step shape, the second is warm
                prompts = np.random.default_rng(B).integers(3, cfg.vocab_size, (B, 32)).tolist()
                stamps, done = [], threading.Event()
                left = [B]

                def emit(kind, payload, stamps=stamps, done=done, left=left):
                    if kind == "delta":
                        stamps.append((time.perf_counter(), len(payload["token_ids"])))
                    else:
                        left[0] -= 1
                        if left[0] == 0:
                            done.set()
                steps0 = engine.stats["decode_steps"]
                t0 = time.perf_counter()
                for ids in prompts:
                    engine.submit(Request(ids, new_tokens, emit))
                done.wait(1200)
                wall = time.perf_counter() - t0
                steps = engine.stats["decode_steps"] - steps0
                # steady: tokens after each row's first two, over the time they took
                times = sorted(t for t, _ in stamps)
                skip = 2 * B
                rate = (sum(n for _, n in stamps) - skip) / max(times[-1] - times[skip - 1], 1e-9) \
                    if len(times) > skip else None
                kv = 2 * cfg.num_hidden_layers * B * engine.cache.valid.shape[1] * cfg.kv_dim * 2
                r = {"weights": f"int4-g128 ({quant_route})" if quant_route else "bf16", "layers": variant, "batch": B,
                     "round": round_, "new_tokens": new_tokens, "wall_s": wall, "decode_steps": steps,
                     "tokens_per_s_decode": rate, "steps_per_s_decode": rate / B if rate else None,
                     "warmup_s_incl_compile": warm, "model_bytes": nbytes,
                     "bound_steps_per_s_measured_bw": bandwidth / (nbytes + kv)}
                log(json.dumps(r))
                out.append(r)
    finally:
        engine.stop()
    return out


def course(out: str | None, tiny: bool, log) -> dict:
    """The six lessons on this machine's JAX, as `make course` runs them (the notebook runner in its own
    process; --quick sizes with --tiny): per lesson ok, seconds and the backend its results name."""
    import subprocess
    import tempfile
    where = Path(out or tempfile.mkdtemp()) / "course"
    cmd = [sys.executable, "-m", "amdllm.course.notebooks", "run", "--out", str(where)] + (["--quick"] if tiny else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    summary = where / "summary.json"
    recs = json.loads(summary.read_text()) if summary.is_file() else []
    r = {"seconds": time.perf_counter() - t0, "returncode": proc.returncode, "summary": proc.stdout[-1500:],
         "lessons": [{"name": x["name"], "ok": x["ok"], "seconds": x["seconds"], "error": x["error"],
                      "jax_backend": (x.get("results") or {}).get("jax_backend"),
                      "jax_devices": (x.get("results") or {}).get("jax_devices")} for x in recs]}
    log(json.dumps({k: v for k, v in r.items() if k != "summary"}))
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test on a tiny shape")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip later phases past this many seconds")
    ap.add_argument("--lora-batches", default=None, help="comma-separated batch sizes to try, largest first")
    ap.add_argument("--decode-variants", default="scan,sliced,unrolled", help="ways to run the layers (decode)")
    ap.add_argument("--profile-dir", default=None, help="trace one batch-1 decode per phase and variant here")
    ap.add_argument("--engine-batches", default=None, help="concurrent requests for serve_engine (default 1,8,32)")
    ap.add_argument("--phases", default="ceilings,qmatmul,decode_bf16,decode_int4_pallas,lora_step_dots,"
                                        "serve_engine,decode_int4_xla4,lora_step,lora_step_blocked,decode_int4")
    args = ap.parse_args()
    from amdllm.config import LlamaConfig, get_preset
    if args.tiny:
        cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        seq, batches, dots_batches, steps, dec_b, new, eng_b = 128, [4, 2], [2], 2, [1, 2], 8, [1, 2]
    else:
        cfg = get_preset("llama-3.1-8b")
        # remat dots keeps every projection's output: batch 16 x 2048 needs 137.5 GiB by amdllm.parallel.plan,
        # over the H200's, so its search starts at 8 (76.7 GiB) instead of compiling a batch that cannot fit
        seq, batches, dots_batches, steps, dec_b, new, eng_b = 2048, [16, 8, 4, 2, 1], [8, 4, 2, 1], 3, [1, 8], 64, [1, 8, 32]
    if args.engine_batches:
        eng_b = [int(b) for b in args.engine_batches.split(",")]
    if args.lora_batches:
        batches = dots_batches = [int(b) for b in args.lora_batches.split(",")]
    t0 = time.perf_counter()
    lines = []

    def log(s):
        print(f"[{time.perf_counter() - t0:6.1f}s] {s}", flush=True)
        lines.append(s)
    result = {"machine": machine_info(), "config": cfg.to_dict()}

    def save():
        result["total_s"] = time.perf_counter() - t0
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "gpu.json").write_text(json.dumps(result, indent=2) + "\n")

    import jax
    dec_kw = {"profile_dir": args.profile_dir, "variants": tuple(args.decode_variants.split(","))}
    bw = lambda: result["ceilings"]["copy_bytes_per_s"]  # noqa: E731
    phases = {"ceilings": lambda: ceilings(args.tiny, log),
              "qmatmul": lambda: qmatmul_routes(cfg, bw(), log, args.tiny),
              "lora_step": lambda: lora_step(cfg, seq, batches, steps, result["ceilings"]["matmul_flops"], log),
              "lora_step_dots": lambda: lora_step(cfg, seq, dots_batches, steps, result["ceilings"]["matmul_flops"],
                                                  log, remat="dots"),
              "lora_step_blocked": lambda: lora_step(cfg, seq, batches, steps, result["ceilings"]["matmul_flops"],
                                                     log, "blocked"),
              "decode_bf16": lambda: decode(cfg, False, dec_b, new, bw(), log, **dec_kw),
              "decode_int4": lambda: decode(cfg, True, dec_b, new, bw(), log, "xla", **dec_kw),
              "decode_int4_pallas": lambda: decode(cfg, True, dec_b, new, bw(), log, "pallas", **dec_kw),
              "decode_int4_xla4": lambda: decode(cfg, True, dec_b, new, bw(), log, "int4", **dec_kw),
              "serve_engine": lambda: serve_engine(cfg, eng_b, new, bw(), log),
              "course": lambda: course(args.out, args.tiny, log)}
    import os
    result["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    wanted = ["ceilings"] + [p for p in args.phases.split(",") if p != "ceilings"]
    unknown = [p for p in wanted if p not in phases]
    if unknown:
        ap.error(f"--phases: unknown {','.join(unknown)}; choose from {','.join(phases)}")
    for name in wanted:
        fn = phases[name]
        if time.perf_counter() - t0 > args.budget_s:
            result[name] = {"skipped": f"time budget of {args.budget_s:.0f} s spent"}
            log(f"{name}: skipped (budget)")
            continue
        try:
            result[name] = fn()
        except Exception as e:  # record and go on: one broken phase must not lose the others
            import traceback
            traceback.print_exc()
            result[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        jax.clear_caches()
        gc.collect()  # the phase's model (16 GB at 8B) must be gone before the next one is built
        save()
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "config")}, indent=1))


if __name__ == "__main__":
    main()
