"""Perplexity equals the `amdllm eval` protocol (docs/cli.md) computed independently with transformers (torch), to 1e-4
relative: consecutive non-overlapping windows, the short last window kept only with >= 2 tokens."""
from __future__ import annotations

import math

import numpy as np
import pytest

from amdllm.infer.evaluate import evaluate_text, perplexity, windows
from tests.test_generate import ours_from_hf
from tests.tiny import make_hf_model


def reference_perplexity(hf_model, ids, seq_len):
    """The protocol, written out with torch: every window on its own, sum of NLLs over tokens 1..n-1."""
    import torch
    import torch.nn.functional as F
    total, count = 0.0, 0
    for start in range(0, len(ids), seq_len):
        w = ids[start:start + seq_len]
        if len(w) < 2:
            continue
        with torch.no_grad():
            logits = hf_model(input_ids=torch.tensor([w])).logits[0].double()  # [n, V]
        total += F.cross_entropy(logits[:-1], torch.tensor(w[1:]), reduction="sum").item()
        count += len(w) - 1
    return {"perplexity": math.exp(total / count), "nll": total / count, "tokens": count}


@pytest.fixture(scope="module")
def models():
    hf = make_hf_model(seed=1)
    return hf, ours_from_hf(hf)


@pytest.mark.parametrize("n_tokens, seq_len, batch_size", [(300, 64, 3), (257, 64, 8), (40, 64, 8)])
def test_perplexity_equals_transformers_protocol(models, n_tokens, seq_len, batch_size):
    hf, ours = models
    ids = np.random.default_rng(n_tokens).integers(3, 128, n_tokens).tolist()
    got = perplexity(ours, ids, seq_len=seq_len, batch_size=batch_size, progress=False)
    ref = reference_perplexity(hf, ids, seq_len)
    assert got["tokens"] == ref["tokens"]
    assert abs(got["nll"] / ref["nll"] - 1) < 1e-4 and abs(got["perplexity"] / ref["perplexity"] - 1) < 1e-4


def test_windows_follow_the_protocol():
    assert [len(w) for w in windows(list(range(300)), 64)] == [64, 64, 64, 64, 44]
    assert [len(w) for w in windows(list(range(257)), 64)] == [64, 64, 64, 64]  # a 1-token tail predicts nothing
    assert windows(list(range(130)), 64)[2].tolist() == [128, 129]
    with pytest.raises(ValueError, match="seq_len"):
        windows([1, 2, 3], 1)


def test_evaluate_text_tokenizes_whole_text(models):
    from amdllm.io.tokenizer import load_tokenizer
    hf, _ = models
    tok = load_tokenizer("data/tokenizer")
    text = "Once upon a time, there was a little blue cat named Maya. Maya lived in the house. " * 3
    ids = tok(text)["input_ids"]
    assert ids.count(tok.bos_token_id) == 1
    # a model over the tokenizer's vocabulary; the reference sees the same ids
    hf_big = make_hf_model(seed=2, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    ours = ours_from_hf(hf_big)
    got = evaluate_text(ours, tok, text, seq_len=16, progress=False)
    ref = reference_perplexity(hf_big, ids, 16)
    assert got["tokens"] == ref["tokens"] == len(ids) - math.ceil(len(ids) / 16)
    assert abs(got["perplexity"] / ref["perplexity"] - 1) < 1e-4


def test_too_short_is_a_clear_error(models):
    _, ours = models
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(ours, [5], seq_len=16)


def test_sharded_model_evaluates_and_generates_the_same(models):
    """On a data=2,fsdp=2,tensor=2 mesh of the 8 simulated devices (weights sharded by the rules table),
    perplexity and greedy generation equal the unsharded model's: jit follows the weights' shardings."""
    from amdllm.infer.generate import generate_ids
    from amdllm.parallel.sharding import make_mesh, shard_model
    from tests.test_generate import PROMPTS
    hf, ours = models
    ids = np.random.default_rng(5).integers(3, 128, 200).tolist()
    sharded = shard_model(ours_from_hf(hf), make_mesh("data=2,fsdp=2,tensor=2", cfg=ours.cfg))
    assert len(sharded.layers.q_proj[...].sharding.device_set) == 8
    got = perplexity(sharded, ids, seq_len=64, batch_size=4, progress=False)
    want = perplexity(ours, ids, seq_len=64, batch_size=4, progress=False)
    assert got["tokens"] == want["tokens"] and abs(got["perplexity"] / want["perplexity"] - 1) < 1e-5
    assert generate_ids(sharded, PROMPTS, 8, eos_ids=()) == generate_ids(ours, PROMPTS, 8, eos_ids=())


@pytest.mark.parametrize("n_windows, batch_size, want", [(5, 8, [5]), (13, 8, [7, 7]), (16, 8, [8, 8]), (3, 1, [1, 1, 1])])
def test_batches_are_equal_and_never_padded_beyond_the_windows(models, monkeypatch, n_windows, batch_size, want):
    """5 windows at batch 8 run as one batch of 5, not 8 (3 rows of padding were 40% of a 1B eval);
    13 as 7 + 7 (one padding row), not 8 + 8 (three)."""
    from amdllm.infer import evaluate
    _, ours = models
    seen = []
    real = evaluate._nll_fn

    def spy(model):
        fn = real(model)

        def wrapped(top, layers, tokens, seg):
            seen.append(tokens.shape[0])
            return fn(top, layers, tokens, seg)
        return wrapped
    monkeypatch.setattr(evaluate, "_nll_fn", spy)
    ids = np.random.default_rng(0).integers(3, 128, 16 * n_windows).tolist()
    r = perplexity(ours, ids, seq_len=16, batch_size=batch_size, progress=False)
    assert seen == want and r["tokens"] == 15 * n_windows
