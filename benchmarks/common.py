"""Shared helpers for the benchmark scripts: run each side in its own processes, alternating (`run_rounds`),
report median and spread, write JSON.

Every script runs both sides on the same machine in the same run (alternating, after a warm-up), so a
ratio is meaningful even on a noisy machine; absolute figures are printed with the machine they came from.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

# where `make .venv/gptqmodel-env/.installed` puts GPTQModel (a venv layered on .venv; see the Makefile)
GPTQMODEL_ENV_PYTHON = Path(__file__).resolve().parents[1] / ".venv" / "gptqmodel-env" / "bin" / "python"
GPTQMODEL_INSTALL = "`make .venv/gptqmodel-env/.installed` installs it, or set AMDLLM_GPTQMODEL_PYTHON"


def find_gptqmodel_python(arg: str | None = None, need: tuple[str, ...] = ("gptqmodel",)
                          ) -> tuple[str | None, str | None, bool]:
    """The interpreter that runs GPTQModel -> (python or None, why not, asked for explicitly).

    Looked for in this order: `arg`, else $AMDLLM_GPTQMODEL_PYTHON (either one is the only candidate:
    asked for explicitly), else .venv/gptqmodel-env/bin/python if it exists, else this interpreter. The
    first candidate that can import every module in `need` wins; None with the reason when none can (a
    caller that was asked explicitly should fail on it, others skip)."""
    given = arg or os.environ.get("AMDLLM_GPTQMODEL_PYTHON")
    if given:
        cands = [given]
    else:
        cands = ([str(GPTQMODEL_ENV_PYTHON)] if GPTQMODEL_ENV_PYTHON.exists() else []) + [sys.executable]
    why = []
    for cand in cands:
        probe = ("import importlib.util, sys; missing = [m for m in sys.argv[1:] if importlib.util.find_spec(m) "
                 "is None]; print(' '.join(missing)); sys.exit(bool(missing))")
        try:
            r = subprocess.run([cand, "-c", probe, *need], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            why.append(f"{cand}: {e}")
            continue
        if r.returncode == 0:
            return cand, None, bool(given)
        why.append(f"{cand} cannot import {r.stdout.strip() or '(probe failed: ' + r.stderr.strip()[-200:] + ')'}")
    return None, "; ".join(why) + f" ({GPTQMODEL_INSTALL})", bool(given)


def machine_info() -> dict:
    import jax
    info = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "python": sys.version.split()[0],
            "platform": platform.platform(), "cpu_count": os.cpu_count(), "jax": jax.__version__,
            "jax_backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()]}
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                                 if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return info


def summarize(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"median": statistics.median(s), "min": s[0], "max": s[-1], "n": len(s),
            "spread_pct": 100.0 * (s[-1] - s[0]) / statistics.median(s) if statistics.median(s) else 0.0}


def alternate(sides: dict, repeats: int, warmup: int = 1) -> dict[str, dict]:
    """Run each side's callable `warmup` times, then `repeats` rounds A, B, A, B...; returns seconds stats."""
    for fn in sides.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: summarize(ts) for name, ts in times.items()}


def run_child(script: str, side: str, argv: list[str], *extra: str, env: dict | None = None) -> dict:
    """`script` again in a fresh process with the parent's flags, `--child side` and `extra` (in `env`, default
    the parent's environment); its last stdout line (JSON) is the result. A failed child stops the benchmark
    with its stderr's tail."""
    proc = subprocess.run([sys.executable, str(Path(script).resolve()), *argv, "--child", side, *extra],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{Path(script).stem}: the {side} process failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_rounds(script: str, plan, runs: int, argv: list[str], *extra: str,
               describe=lambda r: "done") -> dict[str, list[dict]]:
    """`runs` rounds of one child process per entry of `plan`, in order (amdllm, peer, amdllm, ...), so that a
    load change on a shared machine hits every side -> {label: [each process's result]}. `plan` lists sides
    (names) or (label, side, env) triples. describe(result) is printed to stderr after each process."""
    plan = [(p, p, None) if isinstance(p, str) else p for p in plan]
    results = {label: [] for label, _, _ in plan}
    for i in range(runs):
        for label, side, env in plan:
            r = run_child(script, side, argv, *extra, env=env)
            results[label].append(r)
            print(f"round {i + 1}/{runs} {label}: {describe(r)}", file=sys.stderr, flush=True)
    return results


def write_json(result: dict, out: str | os.PathLike | None, name: str) -> Path | None:
    if out is None:
        return None
    path = Path(out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, "machine": machine_info(), **result}, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def table(rows: list[dict], cols: list[str]) -> str:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
    line = " | ".join(c.ljust(w) for c, w in zip(cols, widths))
    sep = "-+-".join("-" * w for w in widths)
    body = "\n".join(" | ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(cols, widths)) for r in rows)
    return f"{line}\n{sep}\n{body}"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return "" if v is None else str(v)
