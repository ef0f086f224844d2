"""Shared set-up for the robustness cases (issue: bad input gets one clear line, faults lose nothing).

Every case drives a real entry point: the `amdllm` command in a subprocess (`amdllm(...)`), the server over
HTTP, or the public Python API. `one_line_error` is the contract every refusal meets: a non-zero exit,
no traceback, and the last stderr line is one `amdllm CMD: error: ...` line naming the culprit.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny import make_hf_checkpoint

TEXT = ("the cat sat on the mat. the dog ran to the park. a bird sang in the tree. "
        "tom had three apples and ann had two pears. the red fox met the blue owl.\n") * 30
ROWS = [{"instruction": f"where is the {a}?", "output": f"the {a} is in the {b}."}
        for a, b in [("cat", "park"), ("dog", "tree"), ("fox", "mat"), ("owl", "park")] * 4]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict:
    """A tiny random Llama checkpoint with its own BPE tokenizer, training rows and a text file."""
    from amdllm.io import tokenizer as T
    root = tmp_path_factory.mktemp("robust")
    (root / "text.txt").write_text(TEXT)
    tok = T.train_bpe([root / "text.txt"], vocab_size=300)  # BOS 0, EOS 1, PAD 2
    ckpt, _ = make_hf_checkpoint(root, name="tiny", vocab_size=320, bos_token_id=0, eos_token_id=1,
                                 pad_token_id=2, max_position_embeddings=128)
    T.save_for_transformers(tok, ckpt)
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return {"root": root, "model": ckpt, "data": data, "text": root / "text.txt"}


def copy_model(tiny: dict, dest: Path) -> Path:
    shutil.copytree(tiny["model"], dest)
    return dest


def amdllm(*args, timeout: float = 300, preexec_fn=None, env=None, raw: bool = False) -> subprocess.CompletedProcess:
    """The `amdllm` command, as a user runs it (a fresh process); raw=True: `args` is the whole command line
    (e.g. `amdllm` under strace)."""
    cmd = [*map(str, args)] if raw else [sys.executable, "-m", "amdllm.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=preexec_fn,
                          env={**os.environ, **(env or {})})


def one_line_error(p: subprocess.CompletedProcess, *culprits: str) -> str:
    """The refusal contract; returns the error line. Each culprit (a file, flag, field) must be named."""
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode not in (0, None), f"exit 0 for a bad input; stderr: {p.stderr[-500:]}"
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert lines, "no message"
    last = lines[-1]
    assert ": error: " in last, last
    for c in culprits:
        assert str(c) in last, f"{c!r} not named in {last!r}"
    return last
