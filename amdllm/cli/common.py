"""What every command's `run` shares: printing its result, and the embedded default model (the flags are
`amdllm.cli.parser`'s)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from amdllm.course import default_model_dir


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
