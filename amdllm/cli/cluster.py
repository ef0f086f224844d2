"""One `amdllm` command as several processes: joining JAX's runtime, and a supervisor.

A command that trains on a mesh joins JAX's distributed runtime when the environment describes a cluster
or `--coordinator`, `--num-processes` and `--process-id` are given (`amdllm.parallel.distributed`). When a
peer dies or the coordinator does not answer, JAX's runtime ends the process from C++ (SIGABRT): so a
multi-process command runs itself as a child whose native output goes to a log, and the parent turns an
ending the child could not report into one line naming what happened and the log."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import jax

from amdllm.parallel import distributed

CHILD_ENV = "AMDLLM_CLUSTER_DIR"  # set in the child: the directory of its native log and status files


def cluster_of(args) -> dict:
    """{"source", "coordinator_address", "num_processes", "process_id"} from the flags, else the environment."""
    flags = {"--coordinator": args.coordinator, "--num-processes": args.num_processes,
             "--process-id": args.process_id}
    if any(v is not None for v in flags.values()):
        missing = [k for k, v in flags.items() if v is None]
        if missing:
            raise ValueError(f"{', '.join(k for k, v in flags.items() if v is not None)} given without "
                             f"{', '.join(missing)}: pass all three (or none, to read the environment)")
        if ":" not in args.coordinator:
            raise ValueError(f"--coordinator {args.coordinator!r}: expected HOST:PORT (process 0's address)")
        if args.process_id >= args.num_processes:
            raise ValueError(f"--process-id {args.process_id} is outside 0..{args.num_processes - 1} "
                             f"(--num-processes {args.num_processes})")
        return {"source": "flags", "coordinator_address": args.coordinator,
                "num_processes": args.num_processes, "process_id": args.process_id}
    try:
        return distributed.detect()
    except distributed.DistributedError as e:
        raise ValueError(str(e)) from None


def is_cluster(args) -> bool:
    return hasattr(args, "init_timeout") and cluster_of(args)["source"] != "single"


# --------------------------------------------------------------------------------------------------
# The parent: run the command as a child, and say in one line how a runtime-ended child ended
# --------------------------------------------------------------------------------------------------
def supervise(argv: list[str], prefix: str, args) -> int:
    c = cluster_of(args)
    work = Path(tempfile.mkdtemp(prefix="amdllm-process-"))
    child = subprocess.Popen([sys.executable, "-m", "amdllm.cli", *argv], env={**os.environ, CHILD_ENV: str(work)})
    old = {s: signal.signal(s, lambda n, _f: child.send_signal(n)) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        rc = child.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if (work / "ended").is_file() or rc in (0, 130):  # the child said what happened itself
        shutil.rmtree(work, ignore_errors=True)
        return rc
    who = f"process {c['process_id'] if c['process_id'] is not None else '?'} of {c['num_processes'] or '?'}"
    log = work / "native.log"
    if not (work / "joined").is_file():
        where = c["coordinator_address"] or "the address SLURM / Open MPI gives"
        if c["process_id"] == 0:  # process 0 is the coordinator: it waited for the others
            msg = (f"{who} could not join the run within --init-timeout {args.init_timeout} s: it is the "
                   f"coordinator ({where}), and fewer than {c['num_processes'] or 'all'} processes joined it")
        else:
            msg = (f"{who} could not join the run within --init-timeout {args.init_timeout} s: the coordinator "
                   f"{where} did not answer, or fewer than {c['num_processes'] or 'all'} processes started")
    else:
        msg = (f"{who} stopped: {_reason(log, rc)}; the run cannot go on without every process (the lost one's "
               f"own output says why it ended)")
    print(f"{prefix}: error: {msg} (JAX's log: {log})", file=sys.stderr)
    return 1


def _reason(log: Path, rc: int) -> str:
    text = log.read_text(errors="replace") if log.is_file() else ""
    if "stopped sending heartbeats" in text:
        return "another process stopped answering (no heartbeat within --heartbeat-timeout)"
    if "Socket closed" in text or "UNAVAILABLE" in text or "Connection reset" in text:
        return "the connection to another process (or to the coordinator, process 0) was lost"
    if rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        return f"it was ended by {name} (out of memory, or the scheduler, or a user)"
    return f"it ended with status {rc} without saying why"


# --------------------------------------------------------------------------------------------------
# The child
# --------------------------------------------------------------------------------------------------
def in_child() -> bool:
    return bool(os.environ.get(CHILD_ENV))


def redirect_native_output() -> None:
    """In the child: file descriptors 1 and 2 (what C++ writes to) go to the log; Python's sys.stdout and
    sys.stderr keep the terminal. Before anything starts JAX's backend."""
    work = Path(os.environ[CHILD_ENV])
    log = os.open(work / "native.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    out, err = os.dup(1), os.dup(2)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout = os.fdopen(out, "w", buffering=1)
    sys.stderr = os.fdopen(err, "w", buffering=1)


def mark(name: str) -> None:
    if in_child():
        (Path(os.environ[CHILD_ENV]) / name).touch()


def join(args) -> dict:
    """Start JAX's distributed runtime when there is a cluster (a no-op otherwise); before any device use."""
    c = cluster_of(args)
    if c["source"] == "single":
        return distributed.initialize(env={})
    info = distributed.initialize(c["coordinator_address"], c["num_processes"], c["process_id"],
                                  timeout_s=args.init_timeout, heartbeat_timeout_s=args.heartbeat_timeout) \
        if c["source"] == "flags" else \
        distributed.initialize(timeout_s=args.init_timeout, heartbeat_timeout_s=args.heartbeat_timeout)
    mark("joined")
    return info


def lost_peer(e: Exception) -> str | None:
    """One line for a collective that failed because another process went away (gloo notices a closed
    connection before JAX's heartbeat does), else None."""
    text = str(e)
    if not in_child() or not any(k in text for k in ("Gloo", "Connection reset", "Connection closed",
                                                     "Socket closed")):
        return None
    c = {"process_id": jax.process_index(), "num_processes": jax.process_count()}
    detail = next((ln.strip() for ln in text.splitlines() if "error" in ln.lower()), text.splitlines()[0])
    return (f"process {c['process_id']} of {c['num_processes']} stopped: another process went away during a "
            f"collective ({detail[-160:]}); the run cannot go on without every process (the lost one's own "
            "output says why it ended)")


def leave(rc: int) -> None:
    """In a multi-process child: end now. An error in one process must not wait at JAX's shutdown barrier
    for peers still running (they stop at their next collective, after --heartbeat-timeout)."""
    mark("ended")
    sys.stdout.flush()
    sys.stderr.flush()
    if rc != 0:
        os._exit(rc)
    distributed.shutdown()
