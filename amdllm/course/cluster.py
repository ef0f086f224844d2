"""A cluster on one machine: run a command as N processes of D simulated CPU devices each, joined by
JAX's own environment variables over loopback, exactly as N nodes would run it (lesson 02, the tests).

Each process gets `--xla_force_host_platform_device_count=D` added to the caller's XLA_FLAGS (a device
count there is replaced), and JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID; everything else
is the command's own business. On a real cluster the scheduler (srun) or you (one shell per node) start the
processes instead: examples/405b/.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from amdllm.course.nbclean import REPO

EXAMPLES = REPO / "examples"


@dataclass
class Process:
    process_id: int
    returncode: int
    stdout: str
    stderr: str
    seconds: float


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_env(devices: int, extra: dict | None = None) -> dict:
    # the caller's other XLA flags (dumps, optimisation level) reach each process; the device count is ours
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false",
           "XLA_FLAGS": " ".join([*flags, f"{DEVICE_COUNT_FLAG}={devices}"])}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_NUM_CPU_DEVICES"):
        env.pop(k, None)
    return {**env, **{k: str(v) for k, v in (extra or {}).items()}}


def run_local(command: list, *, processes: int = 2, devices: int = 4, env: dict | None = None,
              timeout: float = 900, started: int | None = None, kill_when=None, kill: int = 1,
              cwd=REPO) -> list[Process]:
    """Run `command` (argv) as `processes` processes of `devices` CPU devices each, and wait for all.

    started: launch only the first N (to see what a missing process does). kill_when: a function polled
    every 0.2 s (e.g. "the run's first metrics line exists"); once it returns True, process `kill` and its
    children get SIGKILL. Every process still running at the end, or on any error, is killed."""
    port = free_port()
    procs, t0 = [], time.monotonic()
    try:
        for pid in range(processes if started is None else started):
            extra = {} if processes == 1 else {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                                               "JAX_NUM_PROCESSES": processes, "JAX_PROCESS_ID": pid}
            procs.append(subprocess.Popen([str(c) for c in command], env=cluster_env(devices, {**extra, **(env or {})}),
                                          cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          start_new_session=True))
        while kill_when is not None and time.monotonic() - t0 < timeout:
            if kill_when():
                os.killpg(procs[kill].pid, signal.SIGKILL)  # the process and its supervised child
                break
            time.sleep(0.2)
        out = []
        for i, p in enumerate(procs):
            try:
                o, e = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"process {i} of {processes} did not finish within {timeout} s: "
                                   f"{' '.join(map(str, command))}") from None
            out.append(Process(i, p.returncode, o, e, time.monotonic() - t0))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


def amdllm_command(*args) -> list[str]:
    """argv for the `amdllm` command of this Python (what `amdllm ...` runs once installed)."""
    return [sys.executable, "-m", "amdllm.cli", *map(str, args)]
