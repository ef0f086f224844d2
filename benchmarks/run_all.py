"""`make bench`: run every comparison benchmark in turn (each in its own process) and collect the JSON.

Target: all of them in under 15 minutes on 2 CPU cores; ARGS holds the trimmed settings that keep
`make bench` inside it (each script's own defaults are for a longer, quieter run). The summary gives each
script's wall and CPU seconds and the load average around it: on a shared machine wall time alone misleads.

    python benchmarks/run_all.py --out bench_results [--only load,gptq]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = {  # name -> script; each takes --out DIR and writes DIR/<name>.json
    "load": "bench_load.py",
    "gptq": "bench_gptq.py",
    "serve": "bench_serve.py",
    "qlora": "bench_qlora.py",
}
ARGS = {  # extra arguments under `make bench` (the settings BENCHMARKS.md's figures were taken with)
    "load": ["--repeats", "2"],
    "gptq": ["--samples", "64"],
    "qlora": ["--rounds", "2"],  # ~3 min on 2 cores: 4 finetune processes of the 31M shape, the peft row
}
BUDGET_S = 15 * 60


def run_one(name: str, script: Path, out: Path) -> int:
    """Run one script; one without --out (it prints its JSON on stdout with --json) is saved by us."""
    cmd = [sys.executable, str(script)] + ARGS.get(name, [])
    if '"--out"' in script.read_text():
        return subprocess.run(cmd + ["--out", str(out)]).returncode
    proc = subprocess.run(cmd + ["--json"], stdout=subprocess.PIPE, text=True)
    print(proc.stdout, end="", flush=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        out.mkdir(parents=True, exist_ok=True)
        result = {"benchmark": name, **json.loads(lines[-1])}
        (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    return proc.returncode if lines else (proc.returncode or 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("--only", default=None, help="comma-separated subset of " + ",".join(BENCHES))
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        ap.error(f"--only: unknown benchmark(s) {','.join(unknown)}; choose from {','.join(BENCHES)}")
    status = {}
    for name in names:
        script = HERE / BENCHES[name]
        if not script.exists():
            status[name] = "missing"
            continue
        print(f"=== {name} ({script.name}) ===", flush=True)
        load0, t0 = os.getloadavg()[0], time.perf_counter()
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        rc = run_one(name, script, Path(args.out))
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
        status[name] = {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), "cpu_seconds": round(cpu, 1),
                        "load_average_before_after": [round(load0, 2), round(os.getloadavg()[0], 2)]}
        print(f"=== {name}: {json.dumps(status[name])}", flush=True)  # survives an interrupted run
    total = sum(s["seconds"] for s in status.values() if isinstance(s, dict))
    status["total"] = {"seconds": round(total, 1), "budget_seconds": BUDGET_S, "within_budget": total <= BUDGET_S,
                       "cpu_count": os.cpu_count()}
    print(json.dumps(status, indent=1))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "run_all.json").write_text(json.dumps(status, indent=1) + "\n")
    return 0 if all(isinstance(s, dict) and s.get("rc", 0) == 0 for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
