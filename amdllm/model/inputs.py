"""What the model's entry points accept, checked at the door: a wrong argument (a path where a model is
expected, None for a tokenizer, text where token ids are expected, an id outside the vocabulary) is one
error that says what was expected, not an XLA message or silent garbage (an out-of-range id reads a
clamped embedding row)."""
from __future__ import annotations

import numpy as np

from amdllm.model.llama import Llama


def expect_model(model, where: str):
    """`model` must be an amdllm Llama (a loaded model, not its directory)."""
    if not isinstance(model, Llama):
        hint = " (a path: load it with amdllm.checkpoint.load(path) first)" if isinstance(model, (str, bytes)) \
            or hasattr(model, "__fspath__") else ""
        raise TypeError(f"{where}: expected an amdllm Llama model{hint}, got {type(model).__name__}")
    return model


def expect_tokenizer(tokenizer, where: str):
    """A transformers tokenizer (or anything callable with .decode), e.g. amdllm.tokenizer.load_tokenizer."""
    if tokenizer is None or not callable(tokenizer) or not hasattr(tokenizer, "decode"):
        raise TypeError(f"{where}: expected a tokenizer (amdllm.tokenizer.load_tokenizer(model_dir)), got "
                        f"{type(tokenizer).__name__}")
    return tokenizer


def token_ids(ids, vocab_size: int, where: str) -> np.ndarray:
    """A 1-D sequence of token ids as int32, each in [0, vocab_size)."""
    if isinstance(ids, (str, bytes)) or (isinstance(ids, (list, tuple)) and any(isinstance(t, str) for t in ids)):
        raise TypeError(f"{where}: expected token ids (a list of ints; tokenize text with the tokenizer "
                        "first), got text")
    arr = np.asarray(ids)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{where}: expected integer token ids, got {arr.dtype}")
    arr = arr.reshape(-1).astype(np.int64)
    bad = arr[(arr < 0) | (arr >= vocab_size)]
    if bad.size:
        raise ValueError(f"{where}: token id {int(bad[0])} is outside the model's vocabulary [0, {vocab_size}) "
                         "(a tokenizer that does not belong to this model?)")
    return arr.astype(np.int32)
