"""The `amdllm` command: thin. `amdllm.cli.parser` declares every subcommand's flags (standard library only,
so that a flag error or `--help` answers at once); each subcommand is a module here with `run(args)`,
imported once its command line has parsed; the library does the work. This layer (with `amdllm.course`)
is the only one that knows the embedded default model.

The contract is docs/cli.md: `--model` omitted means the embedded default model; `--json` prints one
JSON object on stdout and nothing else there (progress bars and warnings go to stderr); errors in what
the user passed are one line on stderr and exit status 2.
"""
from __future__ import annotations

import importlib
import os
import sys
import warnings

from amdllm import heap
from amdllm.cli.parser import COMMANDS, build_parser

__all__ = ["main", "build_parser"]


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command itself started (not a caller's main([...])): its process is ours to set up
        _with_malloc_tunables()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    cluster = _cluster()
    prefix = f"amdllm {args.command}"
    warnings.formatwarning = lambda message, *_, **__: f"{prefix}: warning: {message}\n"
    if not cluster.in_child():
        return _run(args, prefix, argv)
    cluster.redirect_native_output()  # one process of several (see amdllm.cli.cluster)
    rc = _run(args, prefix, argv)
    cluster.leave(rc)
    return rc


def _with_malloc_tunables() -> None:
    """Run this command again, once, with the glibc malloc tunable it wants where the environment does not
    name it (amdllm.heap.malloc_env: huge pages, XLA:CPU's training steps faster; glibc reads GLIBC_TUNABLES
    only when a process starts). AMDLLM_HUGETLB=0 turns this off; where exec fails, the command runs as it
    is. (`finetune` also keeps freed blocks in the heap once its step is compiled: amdllm.heap.keep_heap.)"""
    new_env = heap.malloc_env(os.environ)
    if new_env is not None:
        try:
            os.execve(sys.executable, [sys.executable, "-m", "amdllm.cli", *sys.argv[1:]], new_env)
        except OSError:
            pass


def _cluster():
    """amdllm.cli.cluster, imported only after _with_malloc_tunables and the parse: it imports JAX (~2 s on 2 cores),
    which a re-executed command would otherwise pay for twice, and a flag error would wait for."""
    return importlib.import_module("amdllm.cli.cluster")


def _command(args):
    """The module of the parsed subcommand (it imports JAX and the model)."""
    return importlib.import_module(f"amdllm.cli.{COMMANDS[args.command]}")


def _run(args, prefix: str, argv: list[str]) -> int:
    cluster = _cluster()
    try:
        if not cluster.in_child() and cluster.is_cluster(args):
            return cluster.supervise(argv, prefix, args)
        return int(_command(args).run(args) or 0)
    except (ValueError, FileNotFoundError, KeyError) as e:  # our errors: one clear line, no traceback
        print(f"{prefix}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the system's: permission, disk full, a directory where a file was expected
        where = f"{e.filename}: " if e.filename else ""
        print(f"{prefix}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug of ours: still one line, with the way to see the rest
        lost = cluster.lost_peer(e)
        if lost:
            print(f"{prefix}: error: {lost}", file=sys.stderr)
            return 1
        if os.environ.get("AMDLLM_TRACEBACK"):
            raise
        print(f"{prefix}: internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
              "(AMDLLM_TRACEBACK=1 shows where; please report it)", file=sys.stderr)
        return 1
