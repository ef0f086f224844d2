"""Decoding and prefill: amdllm (jitted KV-cache decode step) vs transformers `generate`, same weights.

Greedy, 128 new tokens (EOS disabled so both sides do the same work), batch 1 and batch 8, float32, on a
31M-parameter Llama (hidden 512, 8 layers, 8 heads / 2 kv heads, MLP 1408, vocab 8192). Also forward
(prefill) throughput on 8 x 256 tokens. Target: decoding >= 2x transformers at batch 1 and at batch 8.

The parent writes one random checkpoint with transformers into a temporary folder; each side then runs
in its own fresh Python process that imports only its own stack (the amdllm process never imports torch,
the transformers one never imports jax; each asserts so), since in one process XLA's and PyTorch's thread
pools fight over the cores. A child loads the checkpoint (float32) and, for each batch size and for the
forward, runs one warm-up call then --repeats timed calls; it prints one JSON line (the times, the token
ids of its last generation) and saves its forward logits for the parent's cross-check. The parent starts
--runs children per side, alternating amdllm, transformers, ... (a "round" is one of each), so a load
change on a shared machine hits both sides. Per row and side: the median over runs of each run's median
time, the spread over runs ((max - min) / median); the ratio of those medians, and the ratio per round.
Checks: both sides generate the same tokens, and the forward logits' largest difference.

    python benchmarks/bench_decode.py [--out bench_results] [--repeats 3] [--runs 3] [--new-tokens 128]
    python benchmarks/bench_decode.py --tiny --new-tokens 8 --repeats 1 --runs 1   # smoke run, ~1 min
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import best_peer, child_plan, run_rounds, summarize, table, write_json  # noqa: E402

SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
TINY = dict(SHAPE, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4)  # --tiny: a smoke test of the script, not a benchmark
PROMPT_LEN = 32
FORWARD = (8, 256)  # the prefill row's token batch
FORWARD_ROW = f"forward {FORWARD[0]}x{FORWARD[1]}"
SIDES = ("amdllm", "transformers")
FORBIDDEN = {"amdllm": "torch", "transformers": "jax"}  # sharing a process is what this layout avoids


def inputs(vocab: int, batches: list[int]) -> tuple[dict[int, np.ndarray], np.ndarray]:
    """The prompts per batch size and the forward tokens: seeded, so both processes draw the same ones."""
    rng = np.random.default_rng(0)
    prompts = {b: rng.integers(3, vocab, (b, PROMPT_LEN)) for b in batches}
    return prompts, rng.integers(3, vocab, FORWARD)


def amdllm_calls(path: str, n: int, prompts: dict, toks: np.ndarray) -> dict:
    """name -> a call that does the timed work; inputs are converted beforehand, outside the timing."""
    import jax
    import jax.numpy as jnp

    from amdllm.infer.generate import generate_ids
    from amdllm.io import checkpoint
    from amdllm.model import forward, to_pure

    model = checkpoint.load(path, dtype=jnp.float32)
    calls = {f"decode batch {b}": (lambda p=p.tolist(): generate_ids(model, p, n, eos_ids=()))
             for b, p in prompts.items()}
    top, layers = to_pure(model)
    fwd = jax.jit(lambda t, l, x: forward(model.cfg, t, l, x)[0])
    jt = jnp.asarray(toks)
    calls[FORWARD_ROW] = lambda: fwd(top, layers, jt).block_until_ready()
    return calls


def transformers_calls(path: str, n: int, prompts: dict, toks: np.ndarray) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def generate(pt):
        with torch.no_grad():
            return hf.generate(pt, attention_mask=torch.ones_like(pt), do_sample=False,
                               max_new_tokens=n, min_new_tokens=n, pad_token_id=0)

    def forward(tt):
        with torch.no_grad():
            return hf(tt).logits

    calls = {f"decode batch {b}": (lambda pt=torch.tensor(p): generate(pt)) for b, p in prompts.items()}
    calls[FORWARD_ROW] = lambda tt=torch.tensor(toks): forward(tt)
    return calls


def time_calls(fn, repeats: int) -> tuple[list[float], object]:
    """One warm-up call (compile, allocator), then `repeats` timed ones -> (seconds, the last output)."""
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


def run_side(side: str, ckpt: str, args) -> dict:
    """The child: every row's times, the generated ids (last run), the forward logits saved beside `ckpt`."""
    prompts, toks = inputs(shape(args)["vocab_size"], batch_sizes(args))
    calls = (amdllm_calls if side == "amdllm" else transformers_calls)(ckpt, args.new_tokens, prompts, toks)
    res = {}
    for name, fn in calls.items():
        times, out = time_calls(fn, args.repeats)
        out = np.asarray(out)  # a jax Array, a torch tensor or lists of ids
        if name == FORWARD_ROW:
            np.save(logits_path(ckpt, side), out)
            res[name] = {"seconds": times, "max_abs_logit": float(np.abs(out).max())}
        else:  # transformers returns prompt + new tokens, amdllm the new ones
            res[name] = {"seconds": times, "tokens": out[:, -args.new_tokens:].tolist()}
    return res


def logits_path(ckpt: str, side: str) -> Path:
    return Path(ckpt).parent / f"logits_{side}.npy"


def shape(args) -> dict:
    return TINY if args.tiny else SHAPE


def batch_sizes(args) -> list[int]:
    return [int(b) for b in args.batches.split(",")]


def write_checkpoint(path: Path, args) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**shape(args), eos_token_id=None, pad_token_id=0)).save_pretrained(path)


def make_row(name: str, runs: dict[str, list[dict]], tokens: int, target: float | None) -> dict:
    """Per side: tokens / the median over runs of each run's median seconds, and the spread over runs; the
    transformers side in its fastest environment for this row (`common.child_plan`)."""
    peer = best_peer(runs, "transformers", lambda r: statistics.median(r[name]["seconds"]))
    per_run = {side: [statistics.median(r[name]["seconds"]) for r in runs[label]]
               for side, label in (("amdllm", "amdllm"), ("transformers", peer))}
    stats = {side: summarize(secs) for side, secs in per_run.items()}
    tps = {side: tokens / s["median"] for side, s in stats.items()}
    return {"what": name, "amdllm_tok_s": tps["amdllm"], "transformers_tok_s": tps["transformers"],
            "ratio": tps["amdllm"] / tps["transformers"],
            "spread_pct": max(s["spread_pct"] for s in stats.values()),
            "amdllm_spread_pct": stats["amdllm"]["spread_pct"],
            "transformers_spread_pct": stats["transformers"]["spread_pct"],
            "ratio_per_round": [t / a for a, t in zip(per_run["amdllm"], per_run["transformers"])],
            "transformers_environment": peer,
            "transformers_tok_s_by_environment": {
                label: tokens / statistics.median(statistics.median(r[name]["seconds"]) for r in rs)
                for label, rs in runs.items() if label != "amdllm"},
            "target": target}


def make_checks(runs: dict[str, list[dict]], names: list[str], ckpt: Path) -> dict:
    last = {side: runs[side if side in runs else next(k for k in runs if k.startswith(side))][-1] for side in SIDES}
    checks = {f"{n.replace('decode ', '').replace(' ', '')}_same_tokens":
              last["amdllm"][n]["tokens"] == last["transformers"][n]["tokens"] for n in names}
    ours, theirs = (np.load(logits_path(str(ckpt), side)) for side in SIDES)
    checks["forward_max_abs_diff"] = float(np.abs(ours - theirs).max())
    checks["forward_max_abs_logit"] = last["transformers"][FORWARD_ROW]["max_abs_logit"]
    return checks


def main() -> None:
    argv = sys.argv[1:]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per row in each process (after 1 warm-up)")
    ap.add_argument("--runs", type=int, default=3, help="processes per side, alternating amdllm, transformers, ...")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tiny", action="store_true", help="hidden 64, 2 layers, vocab 256: checks the script runs")
    ap.add_argument("--child", nargs=2, metavar=("SIDE", "CHECKPOINT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        side, ckpt = args.child
        res = run_side(side, ckpt, args)
        assert FORBIDDEN[side] not in sys.modules, f"the {side} process imported {FORBIDDEN[side]}"
        print(json.dumps(res))
        return

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        write_checkpoint(ckpt, args)
        runs = run_rounds(__file__, child_plan("amdllm", "transformers", "generate"), args.runs, argv, str(ckpt))
        names = [f"decode batch {b}" for b in batch_sizes(args)]
        checks = make_checks(runs, names, ckpt)
    rows = [make_row(n, runs, b * args.new_tokens, 2.0) for n, b in zip(names, batch_sizes(args))]
    rows.append(make_row(FORWARD_ROW, runs, FORWARD[0] * FORWARD[1], None))
    print(table(rows, ["what", "amdllm_tok_s", "transformers_tok_s", "ratio", "amdllm_spread_pct",
                       "transformers_spread_pct", "target"]))
    for r in rows:
        print(f"{r['what']}: ratio per round {', '.join(f'{x:.2f}' for x in r['ratio_per_round'])}; "
              f"transformers in {r['transformers_environment']}")
    print("checks:", checks)
    write_json({"shape": shape(args), "prompt_len": PROMPT_LEN, "new_tokens": args.new_tokens, "runs": args.runs,
                "repeats": args.repeats, "method": "each side in its own process, alternating; per side the median "
                "over runs of each run's median", "load_average": os.getloadavg(), "rows": rows, "checks": checks},
               args.out, "decode")


if __name__ == "__main__":
    main()
