"""What every command shares: printing results, the model flags, and the embedded default model."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from amdllm.course import default_model_dir
from amdllm.infer.generate import DTYPE_CHOICES
from amdllm.parallel.sharding import DEFAULT_RULES, RULES


def emit(obj: dict, as_json: bool, human: str | None = None) -> None:
    """Print a result: one JSON object (with --json) or a human-readable text. A NaN or infinity is not
    JSON: such a result is an error (it names the field), never printed."""
    bad = [k for k, v in obj.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise ValueError(f"the result's {', '.join(bad)} is {obj[bad[0]]} (not finite): the weights or the "
                         "adapter hold NaN or infinite values, or the computation overflowed")
    if as_json:
        sys.stdout.write(json.dumps(obj, allow_nan=False) + "\n")
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
        p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")


def count(minimum: int = 1):
    """argparse type: an integer >= minimum (so --batch-size 0 is refused by name, before any work)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {v}")
        return v
    return parse


def number(minimum: float | None = None, maximum: float | None = None, *, above: bool = False):
    """argparse type: a finite float in [minimum, maximum] ((minimum, maximum] with above=True)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        low_ok = minimum is None or (v > minimum if above else v >= minimum)
        if not math.isfinite(v) or not low_ok or (maximum is not None and v > maximum):
            bounds = ([] if minimum is None else [f"{'>' if above else '>='} {minimum:g}"]) + \
                     ([] if maximum is None else [f"<= {maximum:g}"])
            raise argparse.ArgumentTypeError(f"expected a finite number {' and '.join(bounds)}, got {text}")
        return v
    return parse


def add_run_shape_args(p: argparse.ArgumentParser, *, plan: bool = False) -> None:
    """The options that set a LoRA run's memory and work: `finetune` and `plan` share them, names and
    defaults, so that a plan is the run it describes."""
    p.add_argument("--rank", "--lora-rank", dest="rank", type=count(0 if plan else 1), default=8,
                   help="LoRA rank" + (" (0: plan inference, no training)" if plan else ""))
    p.add_argument("--targets", default="q,k,v,o,gate,up,down", help="LoRA target projections")
    p.add_argument("--batch-size", type=count(), default=8,
                   help="rows per micro-batch, split over the mesh's data and fsdp axes")
    p.add_argument("--grad-accum", type=count(), default=1, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=count(2), default=256, help="tokens per row")
    p.add_argument("--mesh", default=None,
                   help="mesh spec, e.g. fsdp=8 or data=2,fsdp=8 (default: every device on fsdp when >1)")
    p.add_argument("--rules", default=None, choices=sorted(RULES),
                   help=f"sharding rules preset (amdllm.parallel.sharding; default {DEFAULT_RULES})")
    p.add_argument("--remat", nargs="?", const="full", default="none", choices=("none", "dots", "full", "auto"),
                   help="what the backward recomputes: full (the flag alone: each layer from its input, least "
                        "memory), dots (keep the projections' outputs, recompute the rest), auto (the least "
                        "recompute the plan fits), none (default)")
