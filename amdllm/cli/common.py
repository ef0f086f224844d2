"""What every command's `run` shares: printing its result, and the embedded default model (the flags are
`amdllm.cli.parser`'s)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from amdllm.course import default_model_dir
from amdllm.io.gguf_file import is_gguf


def emit(obj: dict, as_json: bool, human: str | None = None) -> None:
    """Print a result: one JSON object (with --json) or a human-readable text. A NaN or infinity is not
    JSON: such a result is an error (it names the field), never printed."""
    bad = [k for k, v in obj.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise ValueError(f"the result's {', '.join(bad)} is {obj[bad[0]]} (not finite): the weights or the "
                         "adapter hold NaN or infinite values, or the computation overflowed")
    text = json.dumps(obj, allow_nan=False) if as_json else human if human is not None else json.dumps(obj, indent=2)
    if sys.stdout is None:  # started with stdout closed (`>&-`)
        raise ValueError("stdout is closed: the result has nowhere to go (redirect it instead, e.g. > out.json)")
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except OSError as e:  # a closed pipe, a full disk behind a redirect
        raise ValueError(f"stdout: the result could not be written ({e.strerror or e})") from None


def model_dir(arg: str | None) -> Path:
    """--model: the directory given, else the embedded default model (built on first use). A GGUF file
    is refused with the one command that makes it a directory (commands read directories, convert files)."""
    if arg is not None and is_gguf(arg):
        raise ValueError(f"--model {arg}: a GGUF file; `amdllm convert --model {arg} --out DIR` writes it "
                         "as a checkpoint directory, which this command reads")
    return Path(arg) if arg is not None else default_model_dir()


DEFAULT_SEQ_LEN = 256


def check_context(seq_len: int | None, cfg, path) -> int:
    """--seq-len (None: 256, or the model's context where that is shorter) within the model's context:
    beyond it RoPE positions were never trained, and work and memory grow with it unbounded."""
    if seq_len is None:
        return min(DEFAULT_SEQ_LEN, cfg.max_position_embeddings)
    if seq_len > cfg.max_position_embeddings:
        raise ValueError(f"--seq-len {seq_len} is beyond {path}'s context (max_position_embeddings="
                         f"{cfg.max_position_embeddings})")
    return seq_len
