"""`make bench`: run every comparison benchmark in turn (each in its own process) and collect the JSON.

    python benchmarks/run_all.py --out bench_results [--only lora,decode]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = {  # name -> script; each takes --out DIR and writes DIR/<name>.json
    "lora": "bench_lora.py",
    "decode": "bench_decode.py",
    "load": "bench_load.py",
    "gptq": "bench_gptq.py",
    "serve": "bench_serve.py",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("--only", default=None, help="comma-separated subset of " + ",".join(BENCHES))
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(BENCHES)
    status = {}
    for name in names:
        script = HERE / BENCHES[name]
        if not script.exists():
            status[name] = "missing"
            continue
        print(f"=== {name} ({script.name}) ===", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run([sys.executable, str(script), "--out", args.out]).returncode
        status[name] = {"rc": rc, "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(status, indent=1))
    return 0 if all(isinstance(s, dict) and s["rc"] == 0 for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
