"""`make`'s set-up (requirements/install.py): on a machine whose JAX computes on a GPU or TPU the venv is
built on top of it and the lock's JAX, plugins and PyTorch are left out; elsewhere the CPU set, with
PyTorch's CPU index named (TORCH_INDEX). The stand-in is an interpreter that reports a GPU, run through the
same probe and plan as a real one (`--dry-run` installs nothing). The real index is not reachable here."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INSTALL = REPO / "requirements" / "install.py"


def fake_python(tmp_path: Path, report: dict | None) -> Path:
    """An executable that answers install.py's probe as an interpreter whose JAX sees `report` (or has none)."""
    body = f"print({json.dumps(json.dumps(report))})" if report else "raise SystemExit('No module named jax')"
    p = tmp_path / "python"
    p.write_text(f"#!{sys.executable}\nimport sys\n{body}\n")
    p.chmod(0o755)
    return p


def dry_run(tmp_path, report, *flags, env=None) -> dict:
    r = subprocess.run([sys.executable, str(INSTALL), "--venv", str(tmp_path / "venv"), "--dry-run",
                        "--python", str(fake_python(tmp_path, report)), *flags],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


ROCM = {"backend": "gpu", "version": "0.10.2", "devices": 8, "kind": "AMD Instinct MI300X", "platform": "gpu"}


def test_a_gpu_jax_is_kept_and_the_lock_leaves_it_alone(tmp_path):
    p = dry_run(tmp_path, ROCM)
    assert p["mode"] == "accelerator" and p["system_site_packages"]
    left = {x.split("==")[0] for x in p["left_out_of_the_lock"]}
    assert {"jax", "jaxlib", "torch"} <= left, left
    assert "transformers" not in left and "flax" not in left


@pytest.mark.parametrize("report", [None, {**ROCM, "backend": "cpu", "platform": "cpu", "devices": 1}])
def test_no_accelerator_jax_means_the_cpu_set(tmp_path, report):
    p = dry_run(tmp_path, report)
    assert p["mode"] == "cpu" and not p["system_site_packages"] and not p["left_out_of_the_lock"]
    assert p["torch"] == "torch==2.13.0" and p["torch_index"] == "https://download.pytorch.org/whl/cpu"


def test_accel_cpu_and_the_torch_index_are_one_setting_each(tmp_path):
    p = dry_run(tmp_path, ROCM, "--accel", "cpu", "--torch-index", "https://mirror.example/whl/cpu")
    assert p["mode"] == "cpu" and p["torch_index"] == "https://mirror.example/whl/cpu"
    make = (REPO / "Makefile").read_text()
    assert "TORCH_INDEX ?= https://download.pytorch.org/whl/cpu" in make and "ACCEL   ?= auto" in make
    assert "--accel $(ACCEL) --torch-index $(TORCH_INDEX)" in make


def test_the_probe_reads_a_real_interpreters_jax(tmp_path):
    """The same probe on this interpreter: its JAX runs on the CPU here, so the plan is the CPU set."""
    sys.path.insert(0, str(INSTALL.parent))
    try:
        import install
    finally:
        sys.path.pop(0)
    found = install.probe_jax(sys.executable)
    assert found["backend"] == "cpu" and found["devices"] >= 1
    assert install.plan(found, "auto", tmp_path, install.TORCH_INDEX)["mode"] == "cpu"


def test_an_unreachable_torch_index_is_known_in_seconds_not_retried():
    """Where TORCH_INDEX cannot be reached (no network, as here), install.py goes to pip's configured index
    with one line, instead of pip retrying the dead host for every package."""
    sys.path.insert(0, str(INSTALL.parent))
    try:
        import install
    finally:
        sys.path.pop(0)
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # a port nothing listens on: refused at once
    port = s.getsockname()[1]
    s.close()
    assert install.reachable(f"http://127.0.0.1:{port}/whl/cpu", timeout=5) is False
    assert install.reachable("not a url") is False
    src = INSTALL.read_text()
    assert 'reachable(p["torch_index"])' in src and "cannot be reached" in src
