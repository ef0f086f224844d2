"""What every command shares: printing results, the model flags, and the embedded default model."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from amdllm.course import default_model_dir
from amdllm.infer.generate import DTYPES


def emit(obj: dict, as_json: bool, human: str | None = None) -> None:
    """Print a result: one JSON object (with --json) or a human-readable text."""
    if as_json:
        sys.stdout.write(json.dumps(obj) + "\n")
    else:
        print(human if human is not None else json.dumps(obj, indent=2))


def model_dir(arg: str | None) -> Path:
    """--model: the directory given, else the embedded default model (built on first use)."""
    return Path(arg) if arg is not None else default_model_dir()


def add_pickle_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-pickle", action="store_true",
                   help="read pickled pytorch_model*.bin weights (tensors only, with torch.load("
                        "weights_only=True)); for sources you trust. `amdllm convert` rewrites them once")


def add_model_args(p: argparse.ArgumentParser, dtype: bool = True) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded model)")
    p.add_argument("--adapter", default=None, help="PEFT LoRA adapter directory to apply")
    add_pickle_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    if dtype:
        p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
