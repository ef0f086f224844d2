"""The `amdllm` command: thin. Each subcommand lives in its module as `add_cli(subparsers)`.

The contract (docs/cli.md): `--model` omitted means the embedded default model; `--json` prints one
JSON object on stdout and nothing else there (progress bars and warnings go to stderr).
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys

# subcommand -> module that defines `add_cli(subparsers)`; modules are imported only when listed here.
SUBCOMMANDS = {
    "doctor": "amdllm.env",
    "eval": "amdllm.evaluate",
    "generate": "amdllm.generate",
    "finetune": "amdllm.finetune",
    "plan": "amdllm.plan",
    "quantize": "amdllm.gptq",
    "serve": "amdllm.serve",
}


def emit(obj: dict, as_json: bool, human: str | None = None) -> None:
    """Print a result: one JSON object (with --json) or a human-readable text."""
    if as_json:
        sys.stdout.write(json.dumps(obj) + "\n")
    else:
        print(human if human is not None else json.dumps(obj, indent=2))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="amdllm", description="Fine-tune and quantize Llama models with JAX.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, module in SUBCOMMANDS.items():
        importlib.import_module(module).add_cli(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, KeyError) as e:  # our errors: one clear line, no traceback
        print(f"amdllm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
