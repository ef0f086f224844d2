"""The `amdllm` command: thin. Each subcommand is a module here with `add_cli(subparsers)`; the library
does the work. This layer (with `amdllm.course`) is the only one that knows the embedded default model.

The contract is docs/cli.md: `--model` omitted means the embedded default model; `--json` prints one
JSON object on stdout and nothing else there (progress bars and warnings go to stderr); errors in what
the user passed are one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

from amdllm import env

SUBCOMMANDS = ("doctor", "eval", "generate", "finetune", "plan", "quantize", "serve", "convert")


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error: the flag at fault and what was expected (argparse prints the whole
    usage block first; `--help` still shows it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="amdllm", description="Fine-tune and quantize Llama models with JAX.")
    sub = p.add_subparsers(dest="command", required=True)  # subcommand parsers are Parsers too
    for name in SUBCOMMANDS:  # imported by name: `eval` is a builtin, so its module is `evaluate`
        importlib.import_module(f"amdllm.cli.{'evaluate' if name == 'eval' else name}").add_cli(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command itself started (not a caller's main([...])): its process is ours to set up
        _with_huge_pages()
    argv = sys.argv[1:] if argv is None else list(argv)
    cluster = _cluster()
    args = build_parser().parse_args(argv)
    prefix = f"amdllm {args.command}"
    warnings.formatwarning = lambda message, *_, **__: f"{prefix}: warning: {message}\n"
    if not cluster.in_child():
        return _run(args, prefix, argv)
    cluster.redirect_native_output()  # one process of several (see amdllm.cli.cluster)
    rc = _run(args, prefix, argv)
    cluster.leave(rc)
    return rc


def _with_huge_pages() -> None:
    """Run this command again, once, with glibc's huge-page malloc where the machine has it and the
    environment does not name it (amdllm.env.hugetlb_env: XLA:CPU's training steps ~10% faster; glibc reads
    GLIBC_TUNABLES only when a process starts). AMDLLM_HUGETLB=0 turns this off; where exec fails, the
    command runs as it is."""
    new_env = env.hugetlb_env(os.environ)
    if new_env is not None:
        try:
            os.execve(sys.executable, [sys.executable, "-m", "amdllm.cli", *sys.argv[1:]], new_env)
        except OSError:
            pass


def _cluster():
    """amdllm.cli.cluster, imported only after _with_huge_pages: it imports JAX (~2 s on 2 cores), which a
    re-executed command would otherwise pay for twice."""
    return importlib.import_module("amdllm.cli.cluster")


def _run(args, prefix: str, argv: list[str]) -> int:
    cluster = _cluster()
    try:
        if not cluster.in_child() and cluster.is_cluster(args):
            return cluster.supervise(argv, prefix, args)
        return int(args.func(args) or 0)
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
