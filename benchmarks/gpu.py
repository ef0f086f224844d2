"""One-shot GPU benchmark (NVIDIA H200/H100 or AMD MI300X), under 8 minutes.

1. LoRA fine-tuning step on a Llama-3.1-8B-shaped model (random bf16 weights, sequence 2048, remat,
   LoRA rank 8 on all seven projections, AdamW): the largest batch that fits, tokens/s and MFU
   (FLOPs per token by amdllm.plan's LoRA count: 4N + attention + LoRA terms; peak = dense bf16 table).
2. Decoding tokens/s (greedy, 128 new tokens, batch 1 and 8) in bf16 and in 4-bit (RTN g128, packed
   int4 dequantized inside the jitted step: the same kernels GPTQ checkpoints use), against the
   memory-bandwidth bound (bytes read per decode step / HBM bandwidth).

    python benchmarks/gpu.py --out $OUT            # on the accelerator
    python benchmarks/gpu.py --tiny --out /tmp/g    # smoke test of the same code on a CPU
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info  # noqa: E402

HBM_BYTES_PER_S = {"h200": 4.8e12, "h100": 3.35e12, "mi300x": 5.3e12, "mi325x": 6.0e12, "mi250x": 3.2e12,
                   "a100": 2.0e12, "cpu": 50e9}


def timed(fn, n):
    import jax
    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n


def lora_step(cfg, seq_len, batches, steps, log):
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from amdllm import lora as lora_mod, plan, train
    from amdllm.model import Llama

    model = Llama(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, remat=True)
    lora_mod.apply_lora(model, rank=8, alpha=16)
    lora, frozen = train.split_params(model)
    tc = train.TrainConfig(steps=100, seq_len=seq_len)
    opt, _ = train.make_optimizer(tc)
    step = train.make_train_step(model, opt)
    fpt = plan.flops_per_token(cfg, seq_len, 8, ("q", "k", "v", "o", "gate", "up", "down"))["lora_train"]
    peak = train.peak_flops()
    for B in batches:
        try:
            rng = jax.random.key(0)
            toks = jax.random.randint(rng, (1, B, seq_len), 0, cfg.vocab_size)
            batch = {"tokens": toks, "targets": toks, "weights": jnp.ones_like(toks, jnp.float32),
                     "positions": jnp.broadcast_to(jnp.arange(seq_len), (1, B, seq_len)),
                     "segment_ids": jnp.ones_like(toks)}
            st = {"lora": lora, "opt": opt.init(lora)}

            def run():
                st["lora"], st["opt"], m = step(st["lora"], st["opt"], frozen, batch, rng)
                return m["loss"]
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            compile_s = time.perf_counter() - t0
            sec = timed(run, steps)
        except Exception as e:  # out of memory at this batch: try the next smaller one
            log(f"batch {B}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        tps = B * seq_len / sec
        res = {"batch": B, "seq_len": seq_len, "step_s": sec, "compile_s": compile_s, "tokens_per_s": tps,
               "flops_per_token": fpt, "flop_formula": "4N + 12*L*S*d_attn + LoRA terms (no frozen weight grads)",
               "peak_flops": peak, "mfu": tps * fpt / peak if peak else None,
               "mfu_6N_count": tps * 6 * cfg.num_params() / peak if peak else None}
        log(json.dumps(res))
        return res
    return {"error": "no batch size fitted"}


def decode(cfg, quant: bool, batches, new_tokens, log):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from amdllm.generate import generate_ids
    from amdllm.gptq import QuantSpec
    from amdllm.gptq_calib import model_bytes, quantize_model
    from amdllm.model import Llama
    from amdllm.train import accelerator_name

    model = Llama(cfg, rngs=nnx.Rngs(1), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    if quant:
        quantize_model(model, None, QuantSpec(bits=4, group_size=128), method="rtn", report=False)
    nbytes = model_bytes(model)
    bw = HBM_BYTES_PER_S.get(accelerator_name(), 0)
    out = []
    for B in batches:
        prompts = np.random.default_rng(0).integers(3, cfg.vocab_size, (B, 32)).tolist()
        generate_ids(model, prompts, new_tokens, eos_ids=())  # compile (same cache bucket as the timed run)
        t0 = time.perf_counter()
        generate_ids(model, prompts, new_tokens, eos_ids=())
        sec = time.perf_counter() - t0
        kv = 2 * cfg.num_hidden_layers * B * (32 + new_tokens) * cfg.kv_dim * 2
        bound = bw / (nbytes + kv) if bw else None  # decode steps/s if every step reads weights + cache once
        r = {"weights": "int4-g128" if quant else "bf16", "batch": B, "tokens_per_s": B * new_tokens / sec,
             "steps_per_s": new_tokens / sec, "model_bytes": nbytes, "bandwidth_bound_steps_per_s": bound,
             "fraction_of_bound": (new_tokens / sec) / bound if bound else None}
        log(json.dumps(r))
        out.append(r)
    del model
    jax.clear_caches()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test on a tiny shape")
    args = ap.parse_args()
    from amdllm.config import LlamaConfig, get_preset
    if args.tiny:
        cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        seq, batches, steps, dec_b, new = 128, [4, 2], 2, [1, 2], 8
    else:
        cfg = get_preset("llama-3.1-8b")
        seq, batches, steps, dec_b, new = 2048, [16, 8, 4, 2, 1], 5, [1, 8], 128
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)
    result = {"machine": machine_info(), "config": cfg.to_dict()}
    t0 = time.perf_counter()
    result["lora_step"] = lora_step(cfg, seq, batches, steps, log)
    import jax
    jax.clear_caches()
    result["decode_bf16"] = decode(cfg, False, dec_b, new, log)
    result["decode_int4"] = decode(cfg, True, dec_b, new, log)
    result["total_s"] = time.perf_counter() - t0
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "config")}, indent=1))


if __name__ == "__main__":
    main()
