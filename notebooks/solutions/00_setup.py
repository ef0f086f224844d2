"""Solutions to the exercises of 00_setup.ipynb. Run: python notebooks/solutions/00_setup.py"""
import json
import os
import subprocess
import sys

# 1. doctor --json: exactly one JSON object on stdout.
out = subprocess.run([sys.executable, "-m", "amdllm.cli", "doctor", "--json"], capture_output=True, text=True,
                     check=True).stdout
report = json.loads(out)
print("1. backend:", report["backend"], "| devices:", len(report["jax"]["devices"]))
# (in a shell: python -m amdllm.cli doctor --json | jq '.backend, (.jax.devices | length)')

# 2. A ROCm plugin whose version differs from jaxlib's: JAX would ignore it and fall back to the CPU.
from amdllm import env  # noqa: E402

facts = env.collect_facts()
jaxlib = facts["versions"]["jaxlib"]
bad = {**facts, "jax_gpu_plugins": {"jax-rocm7-plugin": "0.4.31"}}
print("2.", [w for w in env.diagnose(bad) if "does not match jaxlib" in w][0][:120], "...")
assert any("does not match jaxlib" in w for w in env.diagnose(bad))
assert not any("does not match" in w for w in env.diagnose({**facts, "jax_gpu_plugins": {"jax-rocm7-plugin": jaxlib}}))

# 3. XLA_FLAGS is read when the CPU backend starts: set before, it works; set after the first
#    computation, it is ignored (the backend is already running with 1 device).
code_before = "import jax; print(jax.device_count())"
code_after = ("import os, jax; jax.numpy.zeros(1); "
              "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=4'; print(jax.device_count())")
env_4 = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
env_1 = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
before = subprocess.run([sys.executable, "-c", code_before], env=env_4, capture_output=True, text=True).stdout.strip()
after = subprocess.run([sys.executable, "-c", code_after], env=env_1, capture_output=True, text=True).stdout.strip()
print(f"3. set before import: {before} devices; set after the first computation: {after} device(s)")
assert (before, after) == ("4", "1")
