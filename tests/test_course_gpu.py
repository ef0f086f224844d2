"""The course's GPU smoke test: all six lessons on the accelerator JAX sees, exactly as `make course` runs
them, each lesson's results naming that backend. Skipped where JAX computes on the CPU (here and in CI);
run it on a lent GPU or TPU: `.venv/bin/python -m pytest tests/test_course_gpu.py`."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import jax
import pytest

from amdllm.course import notebooks as nbrun

pytestmark = pytest.mark.skipif(jax.default_backend() == "cpu", reason="needs an accelerator: JAX runs on the CPU")


@pytest.mark.timeout(3600)
def test_the_six_lessons_run_on_the_accelerator():
    out = nbrun.REPO / "build" / "gpu-smoke"
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-m", "amdllm.course.notebooks", "run", "--out", str(out)],
                          cwd=nbrun.REPO, capture_output=True, text=True, timeout=3600)
    recs = json.loads((out / "summary.json").read_text())
    assert [r["name"] for r in recs] == list(nbrun.NOTEBOOKS)
    failed = {r["name"]: r["error"] for r in recs if not r["ok"]}
    assert not failed and proc.returncode == 0, (failed, proc.stderr[-3000:])
    backends = {r["name"]: r["results"]["jax_backend"] for r in recs}
    assert set(backends.values()) == {jax.default_backend()}, backends
    print(proc.stdout)
