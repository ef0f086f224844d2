"""benchmarks/gpu.py, the one prepared script a lent GPU runs (BENCHMARKS.md, "On a GPU"), end to end on the
CPU at its tiny shape: device time is scarce, so a phase that broke since the last GPU run must show here,
not there. Its numbers on a CPU mean nothing; that each phase ran, and ran the kernels it names, does."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("ceilings", "qmatmul", "decode_bf16", "decode_int4_pallas", "lora_step_dots", "serve_engine",
          "decode_int4_xla4", "lora_step", "lora_step_blocked", "decode_int4")  # gpu.py's default --phases


def test_the_gpu_script_runs_every_phase_at_its_tiny_shape(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "benchmarks/gpu.py", "--tiny", "--out", str(tmp_path), "--budget-s",
                           "1200"], cwd=REPO, capture_output=True, text=True, env=env, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu.json").read_text())
    broken = {p: result.get(p) for p in PHASES if not result.get(p) or "error" in result[p]
              or "skipped" in result[p]}
    assert not broken, broken
    routes = {r["route"]: r for r in result["qmatmul"]}
    pallas = [r for k, r in routes.items() if k.startswith("pallas_")]
    assert pallas and all(r["rel_err_vs_reference"] is not None and r["rel_err_vs_reference"] < 1e-2 for r in pallas)
    assert any(k.endswith("_bits") for k in routes)  # the kernel with codes read through 2^23's bits, timed too
    for phase in ("decode_bf16", "decode_int4_pallas", "decode_int4_xla4", "decode_int4", "serve_engine"):
        assert all(r["tokens_per_s_decode"] > 0 for r in result[phase]), phase
    for phase in ("lora_step", "lora_step_dots", "lora_step_blocked"):
        assert result[phase]["tokens_per_s"] > 0 and result[phase]["mfu"] > 0, phase
