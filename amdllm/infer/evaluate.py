"""Perplexity by the protocol of `amdllm eval` (docs/cli.md), so numbers compare across tools and notebooks:
tokenize the whole text as `tokenizer(text)`; cut consecutive windows of `seq_len` tokens (a last one of
at least 2 kept); each window predicts its tokens 1..n-1; nll is the mean over all predicted tokens and
perplexity exp(nll). Windows go at most `batch_size` at a time, in equal batches padded to one shape, so
the jitted function compiles once."""
from __future__ import annotations

import json
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from amdllm.progress import tqdm

from amdllm.infer.decode import inference_run
from amdllm.model import forward, to_pure
from amdllm.model.narrow import inference_weights, token_nll
from amdllm.model.inputs import expect_model, expect_tokenizer
from amdllm.model.inputs import token_ids as check_ids

_COMPILED: dict = {}


def windows(token_ids: Sequence[int], seq_len: int) -> list[np.ndarray]:
    """The protocol's windows: consecutive, non-overlapping, last one kept if it has >= 2 tokens."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (a window predicts tokens 1..n-1), got {seq_len}")
    ids = np.asarray(token_ids, np.int32).reshape(-1)
    out = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    return [w for w in out if len(w) >= 2]


def _nll_fn(model):
    """Jitted (top, layers, tokens [B, T], segment_ids [B, T]) -> (sum of NLL, count) over the batch."""
    cfg = model.cfg
    key = (json.dumps(cfg.to_dict(), sort_keys=True, default=str), str(model.dtype),
           float(model.lora_scale), getattr(model, "act_sharding", None))
    if key not in _COMPILED:
        run = inference_run(model)

        @jax.jit
        def nll_sum(top, layers, tokens, segment_ids):
            h, _ = forward(cfg, top, layers, tokens, segment_ids=segment_ids, run=run, return_hidden=True)
            nll = token_nll(top, h[:, :-1], tokens[:, 1:], run.dtype)  # [B, T-1], no [B, T, V] logits
            w = (segment_ids[:, 1:] != 0).astype(jnp.float32)  # a target is real iff its slot is
            return jnp.sum(nll * w), jnp.sum(w)

        _COMPILED[key] = nll_sum
    return _COMPILED[key]


def perplexity(model, token_ids: Sequence[int], seq_len: int | None = None, batch_size: int = 8,
               progress: bool = True) -> dict:
    """token ids (the whole tokenized text) -> {"perplexity", "nll", "tokens"} by the protocol above.
    seq_len: the window (default 256, or the model's context if shorter)."""
    expect_model(model, "perplexity")
    token_ids = check_ids(token_ids, model.cfg.vocab_size, "perplexity")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    limit = model.cfg.max_position_embeddings
    seq_len = min(256, limit) if seq_len is None else seq_len
    if seq_len > limit:
        raise ValueError(f"seq_len {seq_len} is beyond the model's context (max_position_embeddings={limit})")
    wins = windows(token_ids, seq_len)
    if not wins:
        raise ValueError(f"need at least 2 tokens to measure perplexity, got {len(token_ids)}")
    return perplexity_of_windows(model, wins, batch_size, progress)


def perplexity_of_windows(model, wins: Sequence[np.ndarray], batch_size: int = 8, progress: bool = True) -> dict:
    """{"perplexity", "nll", "tokens"} over windows of token ids (each predicts its tokens 1..n-1 from the
    ones before, within the window): the mean NLL of every predicted token. `amdllm.infer.protocols`
    makes the windows of the named protocols; `perplexity` makes ours."""
    expect_model(model, "perplexity_of_windows")
    if not wins:
        raise ValueError("no windows to measure")
    limit = model.cfg.max_position_embeddings
    wins = [check_ids(w, model.cfg.vocab_size, "perplexity") for w in wins]
    T = max(len(w) for w in wins)  # a text shorter than seq_len needs no longer batch
    if T > limit:
        raise ValueError(f"a window of {T} tokens is beyond the model's context (max_position_embeddings={limit})")
    fn = _nll_fn(model)
    top, layers = inference_weights(*to_pure(model))  # narrow weights as bits on a CPU (model.narrow)
    total, count = 0.0, 0.0
    n_batches = -(-len(wins) // batch_size)
    batch_size = -(-len(wins) // n_batches)  # equal batches: padding rows only where the split is uneven
    starts = range(0, len(wins), batch_size)
    for s in tqdm(starts, desc="perplexity", unit="batch", disable=not progress or len(starts) < 2):
        tokens = np.zeros((batch_size, T), np.int32)
        seg = np.zeros((batch_size, T), np.int32)
        for r, w in enumerate(wins[s:s + batch_size]):
            tokens[r, :len(w)] = w
            seg[r, :len(w)] = 1
        nll, n = fn(top, layers, tokens, seg)
        total += float(nll)  # accumulate across batches in float64 on the host
        count += float(n)
    nll = total / count
    return {"perplexity": math.exp(nll), "nll": nll, "tokens": int(count)}


def evaluate_text(model, tokenizer, text: str, seq_len: int | None = None, batch_size: int = 8,
                  progress: bool = True) -> dict:
    """Perplexity of `text`, tokenized whole as `tokenizer(text)`."""
    expect_tokenizer(tokenizer, "evaluate_text")
    if not isinstance(text, str):
        raise TypeError(f"evaluate_text: expected text (a str), got {type(text).__name__}; token ids go to "
                        "perplexity")
    ids = tokenizer(text)["input_ids"]
    return perplexity(model, ids, seq_len=seq_len, batch_size=batch_size, progress=progress)
