"""The `amdllm` command: thin. `amdllm.cli.parser` declares every subcommand's flags (standard library only,
so a flag error or `--help` answers at once); each subcommand is a module here with `run(args)`. The
contract is docs/cli.md: `--model` omitted means the embedded default model (this layer and
`amdllm.course` alone know it); `--json` prints one JSON object on stdout and nothing else there; errors
in what the user passed are one line on stderr and exit status 2."""
from __future__ import annotations

import importlib
import os
import sys
import warnings

from amdllm.cli.parser import COMMANDS, build_parser

__all__ = ["main", "build_parser"]


def main(argv: list[str] | None = None) -> int:
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


def _cluster():
    """amdllm.cli.cluster, imported only after the parse: it imports JAX, which a flag error should not wait for."""
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
    except KeyboardInterrupt as e:  # finetune says where it stopped and how to go on
        print(f"{prefix}: interrupted" + (f" {e}" if str(e) else ""), file=sys.stderr)
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
