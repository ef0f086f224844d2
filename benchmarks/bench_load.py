"""Loading: time and peak resident memory to get a checkpoint ready for compute.

amdllm `checkpoint.load` vs `transformers.LlamaForCausalLM.from_pretrained`, same bf16 sharded checkpoint
(297 MiB, written by this script with transformers), each side in a fresh subprocess so peak RSS is its own.
Peak memory is the process's VmHWM (high-water RSS) minus its resident size after imports, against the
checkpoint size (target: <= 1.3x). That figure includes starting the runtime (XLA's CPU client is
created by the first jax array; torch's allocator at import), so each side is also run once doing
nothing but that start-up, and the peak is reported a second time with it subtracted.

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
    """Load `path` (or, for path "-", only start the runtime) and report time and memory."""
    if side == "amdllm":
        import jax
        import jax.numpy as jnp
        import numpy as np
        from amdllm.io import checkpoint
        base = rss_bytes()
        t0, c0 = time.perf_counter(), time.process_time()
        if path == "-":
            # creates the XLA CPU client, as a load's first array does (jnp.zeros would also start the
            # compiler, ~28 MiB more, which a load never does: subtracting that would flatter us)
            jax.device_put(np.zeros(1, np.float32)).block_until_ready()
        else:
            model = checkpoint.load(path, dtype=jnp.bfloat16)
            jax.block_until_ready(jax.tree.leaves(__import__("flax").nnx.state(model)))
        module = checkpoint.__file__
    else:
        import torch
        import transformers
        from transformers import LlamaForCausalLM
        torch.set_num_threads(os.cpu_count() or 1)
        base = rss_bytes()
        t0, c0 = time.perf_counter(), time.process_time()
        if path == "-":
            torch.zeros(1, dtype=torch.bfloat16).add_(1)
        else:
            model = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        module = transformers.__file__
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0  # cpu: all threads
    peak = peak_rss_bytes()
    return {"seconds": seconds, "cpu_seconds": cpu, "peak_rss": peak, "base_rss": base, "delta_rss": peak - base,
            "module": module}


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
    def run(side, where):
        out = subprocess.run([sys.executable, __file__, "--child", side, where],
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        size = write_checkpoint(ckpt)
        runs: dict[str, list[dict]] = {"amdllm": [], "transformers": []}
        idle = {side: run(side, "-") for side in runs}  # runtime start-up alone
        for _ in range(args.repeats):  # alternate sides, fresh process each time
            for side in runs:
                runs[side].append(run(side, str(ckpt)))
    rows = []
    for side, rs in runs.items():
        t = summarize([r["seconds"] for r in rs])
        mem = max(r["delta_rss"] for r in rs)
        rows.append({"side": side, "seconds_median": t["median"], "spread_pct": t["spread_pct"],
                     "cpu_seconds_median": summarize([r["cpu_seconds"] for r in rs])["median"],
                     "peak_delta_MiB": mem / 2**20, "x_checkpoint": mem / size,
                     "runtime_start_MiB": idle[side]["delta_rss"] / 2**20,
                     "x_checkpoint_less_start": (mem - idle[side]["delta_rss"]) / size})
    result = {"checkpoint_bytes": size, "shape": SHAPE, "rows": rows, "runs": runs, "idle": idle,
              "load_average": os.getloadavg(),
              "ratio_time_transformers_over_amdllm": rows[1]["seconds_median"] / rows[0]["seconds_median"],
              "target_peak_x_checkpoint": 1.3, "met": rows[0]["x_checkpoint"] <= 1.3}
    print(f"checkpoint: {size / 2**20:.0f} MiB bf16; amdllm from {runs['amdllm'][0]['module']}; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(table(rows, ["side", "seconds_median", "spread_pct", "cpu_seconds_median", "peak_delta_MiB",
                       "x_checkpoint", "runtime_start_MiB", "x_checkpoint_less_start"]))
    write_json(result, args.out, "load")


if __name__ == "__main__":
    main()
