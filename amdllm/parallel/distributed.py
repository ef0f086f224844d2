"""Several hosts, one program: JAX's own distributed runtime (`initialize` wraps `jax.distributed.initialize`).

The coordinator address, process count and id come from, first match wins: the arguments; the
environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); SLURM or Open MPI, through
JAX's own cluster detection; else a single process. On a CPU the collectives use gloo. After it the same
jitted code runs everywhere (SPMD). `amdllm finetune` does all of this itself; docs/405b.md has the recipe."""
from __future__ import annotations

import os
from typing import Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

from amdllm.parallel.sharding import batch_sharding

ENV_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


class DistributedError(RuntimeError):
    """Inconsistent multi-process settings; the message names the variable or argument."""


def detect(env: Mapping[str, str] | None = None) -> dict:
    """Where this process's distributed settings come from, without starting anything.

    Returns {"source": "args"|"env"|"slurm"|"openmpi"|"single", "coordinator_address",
    "num_processes", "process_id"} (None where JAX's own detection will fill a value in)."""
    env = os.environ if env is None else env
    given = [v for v in ENV_VARS if env.get(v)]
    if given:
        if len(given) < 3 and not (given == ["JAX_COORDINATOR_ADDRESS"] and _cluster(env)):
            missing = [v for v in ENV_VARS if v not in given]
            raise DistributedError(f"{', '.join(given)} set but {', '.join(missing)} missing; set all of "
                                   f"{', '.join(ENV_VARS)} (or none, to use SLURM / Open MPI detection)")
        if len(given) == 3:
            return {"source": "env", "coordinator_address": env["JAX_COORDINATOR_ADDRESS"],
                    "num_processes": _int(env, "JAX_NUM_PROCESSES"),
                    "process_id": _int(env, "JAX_PROCESS_ID")}
    cluster = _cluster(env)
    if cluster:
        return {**cluster, "coordinator_address": env.get("JAX_COORDINATOR_ADDRESS")}
    return {"source": "single", "coordinator_address": None, "num_processes": 1, "process_id": 0}


def _cluster(env) -> dict | None:
    if int(env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1")) or 1) > 1 and "SLURM_PROCID" in env:
        return {"source": "slurm", "num_processes": _int(env, "SLURM_NTASKS" if "SLURM_NTASKS" in env
                                                         else "SLURM_NPROCS"),
                "process_id": _int(env, "SLURM_PROCID")}
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return {"source": "openmpi", "num_processes": _int(env, "OMPI_COMM_WORLD_SIZE"),
                "process_id": _int(env, "OMPI_COMM_WORLD_RANK")}
    return None


def _int(env, name) -> int:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        raise DistributedError(f"environment variable {name}={env.get(name)!r} is not an integer") from None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids=None, timeout_s: int = 300,
               heartbeat_timeout_s: int = 100, env: Mapping[str, str] | None = None) -> dict:
    """Join (or start) the multi-process JAX runtime; a no-op for a single process. Idempotent.

    timeout_s: how long to wait for every process to join (the coordinator must answer, all N must start);
    heartbeat_timeout_s: after this long without a heartbeat a process counts as dead. In both cases JAX's
    runtime ends the process (SIGABRT, with a C++ log); `amdllm.cli.cluster` turns that into one line.
    Returns {"source", "process_id", "num_processes", "local_devices", "global_devices"}."""
    if jax.distributed.is_initialized():
        return _info("already")
    args = (coordinator_address, num_processes, process_id)
    if any(a is not None for a in args):
        if any(a is None for a in args):
            raise DistributedError("initialize(): pass all of coordinator_address, num_processes and "
                                   f"process_id (got {coordinator_address!r}, {num_processes!r}, {process_id!r})")
        found = {"source": "args", "coordinator_address": coordinator_address,
                 "num_processes": int(num_processes), "process_id": int(process_id)}
    else:
        found = detect(env)
    if found["source"] == "single":
        return _info("single")
    n, pid = found["num_processes"], found["process_id"]
    if n is not None and pid is not None and not 0 <= pid < n:
        raise DistributedError(f"process id {pid} is outside 0..{n - 1} ({found['source']})")
    if found["source"] in ("args", "env") and ":" not in str(found["coordinator_address"]):
        raise DistributedError(f"coordinator address {found['coordinator_address']!r} must be host:port")
    if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    jax.distributed.initialize(coordinator_address=found["coordinator_address"],
                               num_processes=found["num_processes"], process_id=found["process_id"],
                               local_device_ids=local_device_ids, initialization_timeout=timeout_s,
                               heartbeat_timeout_seconds=heartbeat_timeout_s)
    return _info(found["source"])


def _info(source: str) -> dict:
    return {"source": source, "process_id": jax.process_index(), "num_processes": jax.process_count(),
            "local_devices": jax.local_device_count(), "global_devices": jax.device_count()}


def shutdown() -> None:
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


def global_batch(local_rows, mesh, rules=None):
    """This process's rows of a batch -> one global jax.Array split over the batch axes.

    Each process passes the rows its own devices will hold (B_global / num_processes of them, in
    process order); single-process this is just `sharding.shard_batch`."""
    local_rows = np.asarray(local_rows)
    return jax.make_array_from_process_local_data(batch_sharding(mesh, rules, local_rows.ndim), local_rows)


def from_process_0(x: float) -> float:
    """Process 0's value of a host number, on every process (a collective with several processes): one
    figure for all, e.g. a peak measured on each host."""
    if jax.process_count() == 1:
        return x
    return float(np.asarray(multihost_utils.broadcast_one_to_all(np.float32(x))))


def gather(x):
    """A (possibly multi-process) global array, or a pytree of them, as numpy on every process (with
    several processes a collective: every process must call it)."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, x)
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(x, tiled=True))
