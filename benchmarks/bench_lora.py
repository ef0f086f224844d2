"""LoRA training step: amdllm (one jitted JAX step) vs transformers + peft (PyTorch eager), each in its own process.

Same model shape (random weights), batches, sequence length, LoRA rank/alpha/targets, AdamW, float32, same
machine. Each side runs in a fresh Python process that imports only its own stack (the amdllm child never
imports torch, the peft child never imports jax; it asserts so): in one process XLA's and PyTorch's thread
pools fight over the cores. A child builds the model, runs one untimed warm-up step (compile, allocator),
then --steps timed steps back to back on the same seeded batches, and prints one JSON line. The parent
starts --runs children per side, alternating amdllm, peft, amdllm, peft... (a "round" is one of each), so a
load change on a shared machine hits both sides. Per side: the median over runs of each run's median step
time (tokens/s = token positions processed per second), the spread over runs ((max - min) / median), MFU;
the ratio of those medians, and the ratio per round.

Environments (`common.child_plan`): the amdllm process runs with the glibc malloc tunables `amdllm finetune`
gives itself, and keeps freed blocks in the heap after its warm-up step as the command does once its step is
compiled (`amdllm.heap.keep_heap`); the peft process runs once per round in each distinct GLIBC_TUNABLES of:
none, the parent's, amdllm's, and amdllm's with the heap kept from the start, and the ratio is against its
fastest (all are in the JSON, "peft_by_environment").

MFU = tokens/s * FLOPs/token / peak. FLOPs/token is the planner's LoRA count (amdllm.parallel.plan):
4N + 12*L*S*q + 6*L*r*sum(in+out), N = matmul parameters (lm_head included): forward 2N plus
activation gradients 2N, NO frozen weight gradients. Peak: the planner's table on accelerators; on a
CPU, measured in the run. On a shared VM the float32 matmul rate jumps between ~75 and ~155 GFLOP/s
from one second to the next, so one measurement says more about that second than about the run. Each
amdllm process therefore measures, right after its timed steps, a 1024^3 `jnp.dot` repeated for
`--peak-seconds` (default 1.5 s): its sustained rate over that window, and its best single call. Both
sides' MFU use these amdllm-process peaks:
  mfu          the side's FLOP/s / the median over rounds of the sustained matmul rate
  mfu_vs_best  the side's FLOP/s / the best single matmul of all rounds (the conservative one)

    python benchmarks/bench_lora.py            # the 31M shape (hidden 512, 8 layers, vocab 8192)
    python benchmarks/bench_lora.py --json --steps 3 --runs 2 --hidden 256 --layers 4 --vocab 4096   # quicker
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python benchmarks/bench_lora.py   # as `make bench` runs it
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import TUNABLES, add_lora_shape_args, best_peer, child_plan, run_rounds, summarize  # noqa: E402

SIDES = ("amdllm", "peft")
# a framework each side's process must never load: sharing a process is what this layout avoids
FORBIDDEN = {"amdllm": "torch", "peft": "jax"}


def shape_dict(a) -> dict:
    """The model config as a plain (Hugging Face style) dict: the amdllm child reads it without transformers,
    whose LlamaConfig imports torch."""
    return dict(model_type="llama", vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.mlp,
                num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                max_position_embeddings=max(2048, a.seq), tie_word_embeddings=False, bos_token_id=1,
                eos_token_id=2)


def hf_config(a):  # also used by bench_qlora.py
    from transformers import LlamaConfig
    return LlamaConfig(**{k: v for k, v in shape_dict(a).items() if k != "model_type"}, attn_implementation="sdpa")


def batches(a, n):
    rng = np.random.default_rng(0)
    return [rng.integers(0, a.vocab, (a.batch, a.seq + 1)).astype(np.int32) for _ in range(n)]


def time_steps(one_step, data, after_warmup=lambda: None) -> tuple[list[float], float]:
    """One untimed warm-up step (compile, allocator), then the rest back to back -> (seconds, final loss)."""
    one_step(data[0])
    after_warmup()
    times, loss = [], None
    for w in data[1:]:
        dt, loss = one_step(w)
        times.append(dt)
    return times, loss


def amdllm_child(a) -> dict:
    from amdllm.cpu import run_on_caller
    run_on_caller()  # as `amdllm finetune` does, before anything touches a device
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from amdllm import train
    from amdllm.config import LlamaConfig
    from amdllm.heap import keep_heap
    from amdllm.model import Llama, lora

    cfg = LlamaConfig.from_dict(shape_dict(a))
    model = lora.apply_lora(Llama(cfg, rngs=nnx.Rngs(0)), rank=a.rank, alpha=2 * a.rank, targets=a.targets)
    lo, frozen = train.split_params(model)
    frozen = train.step_frozen(frozen)  # as `finetune` passes them: per-layer views where they pay off
    opt, _ = train.make_optimizer(train.TrainConfig(steps=1000, lr=1e-4, warmup=0))
    step = train.make_train_step(model, opt)
    ones = np.ones((1, a.batch, a.seq), np.int32)
    pos = np.broadcast_to(np.arange(a.seq, dtype=np.int32), (1, a.batch, a.seq))
    # committed like the views (`step_frozen`): else jit compiles the step again for its own outputs
    state = {**jax.device_put({"lo": lo, "opt": opt.init(lo)}, jax.devices()[0]), "i": 0}

    def one_step(w):  # one LoRA step on window batch w [B, T+1]; returns (seconds, loss)
        batch = {"tokens": jnp.asarray(w[None, :, :-1]), "targets": jnp.asarray(w[None, :, 1:]),
                 "weights": jnp.asarray(ones, jnp.float32), "segment_ids": jnp.asarray(ones),
                 "positions": jnp.asarray(pos)}
        t = time.perf_counter()
        state["lo"], state["opt"], m = step(state["lo"], state["opt"], frozen, batch, jax.random.key(state["i"]))
        loss = float(m["loss"])
        state["i"] += 1
        return time.perf_counter() - t, loss

    times, loss = time_steps(one_step, batches(a, a.steps + 1),
                             after_warmup=lambda: state.update(heap_kept=keep_heap()))
    measure = not os.environ.get("AMDLLM_PEAK_FLOPS") and train.accelerator_name() == "cpu"
    return {"step_seconds": times, "final_loss": loss, "params": cfg.num_params(),
            "flops_per_token": train.flops_per_token(cfg, lora.lora_info(model), a.seq),
            "device": jax.devices()[0].device_kind, "accelerator": train.accelerator_name(),
            "matmul": dict(zip(("sustained", "best"), matmul_rates(a.peak_seconds))) if measure else None,
            "peak_flops": None if measure else train.peak_flops(), "glibc_tunables": os.environ.get(TUNABLES, ""),
            "heap_kept": state["heap_kept"]}


def peft_child(a) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config(a))
    targets = [t if t.endswith("_proj") else t + "_proj" for t in a.targets.split(",")]
    model = get_peft_model(model, LoraConfig(r=a.rank, lora_alpha=2 * a.rank, target_modules=targets,
                                             lora_dropout=0.0, task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)

    def one_step(w):
        x = torch.as_tensor(w, dtype=torch.long)
        t = time.perf_counter()
        out = model(input_ids=x[:, :-1], labels=x[:, :-1].clone())  # HF shifts labels inside
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = float(out.loss)
        return time.perf_counter() - t, loss

    times, loss = time_steps(one_step, batches(a, a.steps + 1))
    return {"step_seconds": times, "final_loss": loss, "torch_threads": torch.get_num_threads(),
            "glibc_tunables": os.environ.get(TUNABLES, "")}


def matmul_rates(seconds: float, n: int = 1024) -> tuple[float, float]:
    """(sustained, best single call) float32 FLOP/s of an n^3 `jnp.dot` repeated for `seconds`."""
    import jax
    import jax.numpy as jnp
    x = jnp.ones((n, n), jnp.float32)
    f = jax.jit(jnp.dot)
    f(x, x).block_until_ready()  # compile outside the window
    calls, best, t0 = 0, float("inf"), time.perf_counter()
    while True:
        t = time.perf_counter()
        f(x, x).block_until_ready()
        end = time.perf_counter()
        calls, best = calls + 1, min(best, end - t)
        if end - t0 >= seconds:
            return 2 * n ** 3 * calls / (end - t0), 2 * n ** 3 / best


def mfu(tokens_per_second: float, flops: float, peak: float | None) -> float | None:
    return tokens_per_second * flops / peak if peak else None


def summarize_side(runs: list[dict], tokens: int, flops: float, sustained: float, best: float) -> dict:
    per_run = [statistics.median(r["step_seconds"]) for r in runs]
    s = summarize(per_run)
    tps = tokens / s["median"]
    return {"step_seconds": s["median"], "tokens_per_second": tps, "spread_pct": s["spread_pct"],
            "mfu": mfu(tps, flops, sustained), "mfu_vs_best": mfu(tps, flops, best),
            "step_seconds_per_run": per_run, "step_seconds_all": [r["step_seconds"] for r in runs],
            "final_loss": runs[-1]["final_loss"]}


def report(a, runs: dict[str, list[dict]]) -> dict:
    first = runs["amdllm"][0]
    flops, tokens = first["flops_per_token"], a.batch * a.seq
    rates = [r["matmul"] for r in runs["amdllm"] if r["matmul"]]
    if rates:  # the amdllm processes' peaks serve both sides
        sustained = statistics.median(m["sustained"] for m in rates)
        best = max(m["best"] for m in rates)
    else:
        sustained = best = first["peak_flops"]
    res = {
        "shape": {"params": first["params"], "hidden": a.hidden, "layers": a.layers, "heads": a.heads,
                  "kv_heads": a.kv_heads, "mlp": a.mlp, "vocab": a.vocab},
        "batch": a.batch, "seq_len": a.seq, "rank": a.rank, "targets": a.targets, "steps_timed": a.steps,
        "runs": a.runs, "device": first["device"], "accelerator": first["accelerator"], "cpu_count": os.cpu_count(),
        "flops_per_token": flops, "flops_formula": "4N + 12*L*S*q + 6*L*r*sum(in+out) (no frozen weight grads)",
        "peak_flops": best, "sustained_peak_flops": sustained, "matmul_flops_per_round": rates,
        "peak_method": (f"1024^3 float32 jnp.dot for {a.peak_seconds} s after the timed steps of each amdllm "
                        "process: mfu against the median sustained rate, mfu_vs_best against the best call"
                        if rates else "table or $AMDLLM_PEAK_FLOPS"),
        "method": "each side in its own process, alternating amdllm, peft (in each environment of "
                  "common.child_plan); per side the median over runs of each run's median step; peft: its "
                  "fastest environment",
    }
    peer = best_peer(runs, "peft", lambda r: statistics.median(r["step_seconds"]))
    res["amdllm"] = summarize_side(runs["amdllm"], tokens, flops, sustained, best)
    res["peft"] = summarize_side(runs[peer], tokens, flops, sustained, best)
    res["peft_by_environment"] = {label: {"tokens_per_second": tokens / statistics.median(per_run),
                                          "step_seconds_per_run": per_run}
                                  for label, per_run in ((k, [statistics.median(r["step_seconds"]) for r in v])
                                                         for k, v in runs.items() if k != "amdllm")}
    res["torch_threads"] = runs[peer][0]["torch_threads"]
    res["speedup"] = res["amdllm"]["tokens_per_second"] / res["peft"]["tokens_per_second"]
    res["speedup_per_round"] = [t / j for j, t in zip(res["amdllm"]["step_seconds_per_run"],
                                                      res["peft"]["step_seconds_per_run"])]  # peft / amdllm
    res["glibc_tunables"] = {"amdllm": runs["amdllm"][0]["glibc_tunables"], "peft": runs[peer][0]["glibc_tunables"]}
    res["amdllm_heap_kept"] = [r.get("heap_kept") for r in runs["amdllm"]]  # after the warm-up (heap.keep_heap)
    res["load_average"] = os.getloadavg()
    return res


def print_summary(res: dict) -> None:
    def side(name):
        r = res[name]
        pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        return (f"{r['tokens_per_second']:,.0f} tok/s (MFU {pct(r['mfu'])}, {pct(r['mfu_vs_best'])} of the best "
                f"matmul; spread {r['spread_pct']:.1f}%)")
    print(f"amdllm {side('amdllm')} vs transformers+peft {side('peft')}: {res['speedup']:.2f}x "
          f"(per round: {', '.join(f'{x:.2f}' for x in res['speedup_per_round'])})")
    for label, r in res["peft_by_environment"].items():
        print(f"  {label}: {r['tokens_per_second']:,.0f} tok/s")
    print(f"  {TUNABLES}: {res['glibc_tunables']}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_lora_shape_args(p)
    p.add_argument("--steps", type=int, default=5, help="timed steps per process (after 1 warm-up step)")
    p.add_argument("--runs", type=int, default=3, help="processes per side, alternating amdllm, peft, ...")
    p.add_argument("--peak-seconds", type=float, default=1.5,
                   help="CPU: seconds of matmul per amdllm process for the MFU denominator (module doc)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    a = p.parse_args(argv)

    if a.child:
        res = (amdllm_child if a.child == "amdllm" else peft_child)(a)
        assert FORBIDDEN[a.child] not in sys.modules, f"the {a.child} process imported {FORBIDDEN[a.child]}"
        print(json.dumps(res))
        return 0
    res = report(a, run_rounds(__file__, child_plan("amdllm", "peft", "finetune"), a.runs, argv,
                               describe=lambda r: f"median step {statistics.median(r['step_seconds']):.3f} s"))
    print(json.dumps(res) if a.json else json.dumps(res, indent=2))
    if not a.json:
        print_summary(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
