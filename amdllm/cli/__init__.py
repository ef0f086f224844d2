"""The `amdllm` command: thin. Each subcommand is a module here with `add_cli(subparsers)`; the library
does the work. This layer (with `amdllm.course`) is the only one that knows the embedded default model.

The contract is docs/cli.md: `--model` omitted means the embedded default model; `--json` prints one
JSON object on stdout and nothing else there (progress bars and warnings go to stderr); errors in what
the user passed are one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = ("doctor", "eval", "generate", "finetune", "plan", "quantize", "serve", "convert")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="amdllm", description="Fine-tune and quantize Llama models with JAX.")
    sub = p.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:  # imported by name: `eval` is a builtin, so its module is `evaluate`
        importlib.import_module(f"amdllm.cli.{'evaluate' if name == 'eval' else name}").add_cli(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, KeyError) as e:  # our errors: one clear line, no traceback
        print(f"amdllm {args.command}: error: {e}", file=sys.stderr)
        return 2
