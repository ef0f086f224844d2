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


def add_lora_shape_args(p) -> None:
    """The LoRA benchmarks' model and run shape (the 31M Llama, batch 8 x 256, rank 8 on all projections)."""
    for flag, default in (("--hidden", 512), ("--layers", 8), ("--heads", 8), ("--kv-heads", 2), ("--mlp", 1408),
                          ("--vocab", 8192), ("--batch", 8), ("--seq", 256), ("--rank", 8)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--targets", default="q,k,v,o,gate,up,down")


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
    (names) or (label, side, env) triples (`child_plan`: one side in several environments). describe(result)
    is printed to stderr after each process."""
    plan = [(p, p, None) if isinstance(p, str) else p for p in plan]
    results = {label: [] for label, _, _ in plan}
    for i in range(runs):
        for label, side, env in plan:
            r = run_child(script, side, argv, *extra, env=env)
            results[label].append(r)
            print(f"round {i + 1}/{runs} {label}: {describe(r)}", file=sys.stderr, flush=True)
    return results


TUNABLES = "GLIBC_TUNABLES"


def with_tunables(environ, tunables: str | None) -> dict:
    """`environ` with GLIBC_TUNABLES set to `tunables` (None or "": unset)."""
    env = {k: v for k, v in environ.items() if k != TUNABLES}
    return {**env, TUNABLES: tunables} if tunables else env


def child_plan(ours: str, peer: str, command: str, environ=None) -> list[tuple[str, str, dict]]:
    """Who runs in which environment: (label, side, env) for `run_rounds`.

    Our side runs in the environment the `amdllm <command>` gives itself (`amdllm.heap.malloc_env`: glibc
    malloc tunables, re-executing itself), so the benchmark times what a user of the command gets. The
    peer runs in each distinct GLIBC_TUNABLES among: none (what a user of the peer has), the parent's
    (`make bench` sets glibc.malloc.hugetlb=1), ours, and for a training command ours with freed blocks
    kept in the heap (`amdllm.heap.HEAP_KEPT`, which `amdllm finetune` sets once its step is compiled:
    `keep_heap`); a report takes the peer's fastest (`best_peer`).
    Why: one environment for both sides is no fair default. On a 2-core Zen 4 VM, hugetlb=1 made
    PyTorch's LoRA step erratic and slower (1.7-2.7 s against 1.76-1.85 s unset), while the kept heap
    made it faster (1.68-1.76 s): docs/benchmark-history.md, "the peer's environment"."""
    from amdllm.heap import HEAP_KEPT, TRAINING_COMMANDS, appended_tunables, malloc_env
    environ = dict(os.environ if environ is None else environ)
    env_ours = malloc_env(environ) or environ
    plan, seen = [(ours, ours, env_ours)], set()
    kept = appended_tunables(env_ours, HEAP_KEPT) if command in TRAINING_COMMANDS else ""
    for tunables in ("", environ.get(TUNABLES, ""), env_ours.get(TUNABLES, ""), kept):
        if tunables not in seen:
            seen.add(tunables)
            plan.append((peer_label(peer, tunables), peer, with_tunables(environ, tunables)))
    return plan


def peer_label(peer: str, tunables: str) -> str:
    return f"{peer} [{TUNABLES}={tunables}]" if tunables else f"{peer} [{TUNABLES} unset]"


def best_peer(runs: dict[str, list[dict]], peer: str, seconds) -> str:
    """The label of the peer's environment with the lowest median over its runs of seconds(result)."""
    labels = [k for k in runs if k == peer or k.startswith(peer + " [")]
    return min(labels, key=lambda k: statistics.median(seconds(r) for r in runs[k]))


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
