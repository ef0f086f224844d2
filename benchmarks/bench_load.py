"""Loading: time and peak resident memory to get a checkpoint ready for compute.

amdllm `checkpoint.load` vs `transformers.LlamaForCausalLM.from_pretrained`, same bf16 sharded checkpoint
(~330 MB, written by this script with transformers), each side in a fresh subprocess so peak RSS is its own.
Peak memory is reported as the process's VmHWM (high-water RSS) minus the resident size after imports, against the checkpoint size
(target: <= 1.3x).

    python benchmarks/bench_load.py [--out bench_results] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import summarize, table, write_json  # noqa: E402

SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)


def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def rss_bytes() -> int:
    return _status("VmRSS")


def peak_rss_bytes() -> int:
    # VmHWM is this process's own high-water mark. (ru_maxrss is not: Linux carries the parent's
    # maximum across fork+exec, so a child of a big parent reports the parent's peak.)
    return _status("VmHWM")


def child(side: str, path: str) -> dict:
    if side == "amdllm":
        import jax
        import jax.numpy as jnp
        from amdllm import checkpoint
        base = rss_bytes()
        t0 = time.perf_counter()
        model = checkpoint.load(path, dtype=jnp.bfloat16)
        jax.block_until_ready(jax.tree.leaves(__import__("flax").nnx.state(model)))
    else:
        import torch
        from transformers import LlamaForCausalLM
        torch.set_num_threads(os.cpu_count() or 1)
        base = rss_bytes()
        t0 = time.perf_counter()
        model = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    return {"seconds": seconds, "peak_rss": peak, "base_rss": base, "delta_rss": peak - base}


def write_checkpoint(path: Path) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="100MB")
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for the JSON result")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", nargs=2, metavar=("SIDE", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        size = write_checkpoint(ckpt)
        runs: dict[str, list[dict]] = {"amdllm": [], "transformers": []}
        for _ in range(args.repeats):  # alternate sides, fresh process each time
            for side in runs:
                out = subprocess.run([sys.executable, __file__, "--child", side, str(ckpt)],
                                     capture_output=True, text=True, check=True)
                runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for side, rs in runs.items():
        t = summarize([r["seconds"] for r in rs])
        mem = max(r["delta_rss"] for r in rs)
        rows.append({"side": side, "seconds_median": t["median"], "spread_pct": t["spread_pct"],
                     "peak_delta_MB": mem / 2**20, "x_checkpoint": mem / size})
    result = {"checkpoint_bytes": size, "shape": SHAPE, "rows": rows, "runs": runs,
              "ratio_time_transformers_over_amdllm": rows[1]["seconds_median"] / rows[0]["seconds_median"],
              "target_peak_x_checkpoint": 1.3, "met": rows[0]["x_checkpoint"] <= 1.3}
    print(f"checkpoint: {size / 2**20:.0f} MB bf16, {len(list(SHAPE))} shape keys")
    print(table(rows, ["side", "seconds_median", "spread_pct", "peak_delta_MB", "x_checkpoint"]))
    write_json(result, args.out, "load")


if __name__ == "__main__":
    main()
