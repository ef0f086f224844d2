"""Generation against transformers: greedy ids equal `generate(do_sample=False)` (single prompts and a
left-padded batch), EOS handling, KV-cache decoding equals recomputing the whole sequence, top-p keeps
the same tokens as transformers' TopPLogitsWarper, sampling is seeded, the decode step compiles once."""
from __future__ import annotations

import tempfile

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from amdllm.infer.generate import Decoder, _compiled, generate_ids, pack_prompts, sample_token
from amdllm.io.checkpoint import load
from tests.tiny import make_hf_model

PROMPTS = [[1, 5, 9, 22, 17], [1, 40], [1, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
N_NEW = 32


def ours_from_hf(hf_model, dtype=jnp.float32):
    """Our Llama with the weights of a transformers LlamaForCausalLM, through the real path: transformers
    saves the checkpoint, `amdllm.io.checkpoint.load` reads it."""
    with tempfile.TemporaryDirectory() as d:
        hf_model.save_pretrained(d)
        return load(d, dtype=dtype)


@pytest.fixture(scope="module")
def models():
    hf = make_hf_model(seed=0)
    return hf, ours_from_hf(hf)


def hf_greedy(hf, prompts, n, eos=None, pad=0):
    """transformers' greedy continuation of a left-padded batch (attention_mask marks the pads)."""
    import torch
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(min_new_tokens=n) if eos is None else {}
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                      eos_token_id=eos, pad_token_id=pad, **kw)
    return out[:, P:].tolist()


def test_greedy_equals_transformers_single_and_batched(models):
    hf, ours = models
    batched = generate_ids(ours, PROMPTS, N_NEW, eos_ids=())
    for p, got in zip(PROMPTS, batched):
        ref = hf_greedy(hf, [p], N_NEW)[0]
        assert got == ref, f"prompt {p}"
        assert generate_ids(ours, [p], N_NEW, eos_ids=())[0] == got  # one row alone == inside a batch
    assert batched == hf_greedy(hf, PROMPTS, N_NEW)  # transformers, left-padded batch


def test_stops_at_eos_per_row(models):
    hf, ours = models
    free = generate_ids(ours, PROMPTS, N_NEW, eos_ids=())
    eos = free[0][4]  # a token row 0 produces at step 5: make it the EOS
    got = generate_ids(ours, PROMPTS, N_NEW, eos_ids=[eos], pad_id=0)
    ref = hf_greedy(hf, PROMPTS, N_NEW, eos=eos, pad=0)
    for row, (g, r, f) in enumerate(zip(got, ref, free)):
        cut = f.index(eos) + 1 if eos in f else len(f)
        assert g == f[:cut], f"row {row}: stops right after its first EOS"
        assert g == r[:len(g)] and all(t == 0 for t in r[len(g):]), f"row {row} vs transformers"
    assert len(got[0]) == 5
    assert generate_ids(ours, PROMPTS[:1], N_NEW, eos_ids=[eos], keep_eos=False)[0] == free[0][:4]


def test_kv_cache_decoding_equals_full_recompute(models):
    _, ours = models
    dec = Decoder(ours, eos_ids=())
    steps = list(dec.stream(PROMPTS, 12, return_logits=True))
    new = np.array([s[0] for s in steps]).T                                  # [B, 12]
    # every row recomputed whole, without a cache: right-padded (causal attention never sees the pads)
    rows = [p + new[b].tolist() for b, p in enumerate(PROMPTS)]
    full = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for b, r in enumerate(rows):
        full[b, :len(r)] = r
    logits, _ = ours(jnp.asarray(full))                                      # [B, T, V]
    for b, p in enumerate(PROMPTS):
        want = np.asarray(logits[b, len(p) - 1:len(p) - 1 + len(steps)])    # predicts each new token
        got = np.stack([np.asarray(s[1][b]) for s in steps])
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_positions_count_real_tokens_only():
    tokens, positions, seg, lens = pack_prompts([[5, 6, 7], [8]], pad_id=0, bucket=8)
    assert tokens.shape == (2, 8) and list(lens) == [3, 1]
    assert tokens[0].tolist() == [0] * 5 + [5, 6, 7] and seg[1].tolist() == [0] * 7 + [1]
    assert positions[0, -3:].tolist() == [0, 1, 2] and positions[1, -1] == 0
    with pytest.raises(ValueError, match="empty prompt"):
        pack_prompts([[1], []])


def test_top_p_keeps_the_same_tokens_as_transformers():
    import torch
    from transformers.generation.logits_process import TopPLogitsWarper
    logits = np.random.default_rng(0).normal(size=(6, 50)).astype(np.float32) * 2
    for top_p in (0.3, 0.9):
        ref = TopPLogitsWarper(top_p)(None, torch.tensor(logits)).numpy()
        kept_ref = np.isfinite(ref)
        # sample many times from each row: every sampled token must be kept by transformers, and every
        # kept token with probability >= 3% must show up
        B = 4000
        tiled = jnp.asarray(np.repeat(logits, B, axis=0))
        toks = np.asarray(jax.jit(sample_token)(tiled, jax.random.PRNGKey(1), jnp.ones(6 * B), jnp.full(6 * B, top_p)))
        toks = toks.reshape(6, B)
        probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
        for r in range(6):
            seen = np.zeros(50, bool)
            seen[toks[r]] = True
            assert not (seen & ~kept_ref[r]).any(), f"row {r}: sampled a token transformers drops"
            assert (seen | ~(kept_ref[r] & (probs[r] >= 0.03))).all()
            # frequencies follow the renormalised nucleus
            p_nuc = np.where(kept_ref[r], probs[r], 0) / probs[r][kept_ref[r]].sum()
            freq = np.bincount(toks[r], minlength=50) / B
            assert np.abs(freq - p_nuc).max() < 0.04


def test_sampling_is_seeded_and_tiny_top_p_is_greedy(models):
    _, ours = models
    kw = dict(temperature=1.0, top_p=1.0, eos_ids=())
    a = generate_ids(ours, PROMPTS, 16, seed=3, **kw)
    assert a == generate_ids(ours, PROMPTS, 16, seed=3, **kw)
    assert a != generate_ids(ours, PROMPTS, 16, seed=4, **kw)
    greedy = generate_ids(ours, PROMPTS, 16, eos_ids=())
    assert a != greedy
    assert generate_ids(ours, PROMPTS, 16, temperature=0.7, top_p=1e-6, seed=5, eos_ids=()) == greedy
    # per-row settings: a greedy row inside a sampled batch is still greedy
    mixed = generate_ids(ours, PROMPTS, 16, temperature=[0.0, 1.0, 0.0], seed=3, eos_ids=())
    assert mixed[0] == greedy[0] and mixed[2] == greedy[2] and mixed[1] == a[1]
    with pytest.raises(ValueError, match="top_p"):
        generate_ids(ours, PROMPTS, 4, top_p=0.0)


def test_decode_step_compiles_once_per_bucket(models):
    _, ours = models
    prefill, step = _compiled(ours)
    generate_ids(ours, [[1, 2, 3]], 8, eos_ids=())
    n_prefill, n_step = prefill._cache_size(), step._cache_size()
    generate_ids(ours, [[1, 2, 3, 4, 5, 6, 7]], 20, eos_ids=())  # other prompt length, same buckets
    assert (prefill._cache_size(), step._cache_size()) == (n_prefill, n_step)


def test_context_limit_is_a_clear_error(tmp_path):
    import pytest
    from amdllm.io import checkpoint
    from amdllm.infer.generate import generate_ids
    from tests.tiny import make_hf_checkpoint
    d, _ = make_hf_checkpoint(tmp_path, max_position_embeddings=32)
    model = checkpoint.load(d)
    with pytest.raises(ValueError, match="max_position_embeddings=32"):
        generate_ids(model, [[1, 2, 3, 4]], max_new_tokens=40)


def test_every_decode_layout_gives_the_scans_tokens(models):
    """The decode step over what the backend gives (per-layer views on a CPU: tests/test_backend_cpu.py), over
    the stacked weights as a scan, and as a loop over static slices (a GPU's default): the same tokens and
    logits."""
    fast = list(Decoder(ours := models[1], eos_ids=()).stream(PROMPTS, 10, return_logits=True))
    scan = list(Decoder(ours, eos_ids=(), per_layer=False, unstack=False).stream(PROMPTS, 10, return_logits=True))
    sliced = list(Decoder(ours, eos_ids=(), per_layer=False, unstack=True).stream(PROMPTS, 10, return_logits=True))
    for other in (fast, sliced):
        assert [s[0] for s in other] == [s[0] for s in scan]
        for (_, a), (_, b) in zip(other, scan):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=0)


def test_sampling_mode_is_static_and_each_mode_gives_the_general_tokens():
    """The sampler's branches are chosen on the host (`sampling_mode`), not by a conditional in the step:
    on a GPU, XLA copies a conditional's predicate back to the host, which then waits for every step
    before launching the next (BENCHMARKS.md, "On a GPU"). Each mode gives the tokens "nucleus" gives."""
    from amdllm.infer.decode import sampling_mode
    assert sampling_mode([0.0, 0.0], [1.0, 0.5]) == "greedy"
    assert sampling_mode([0.0, 0.7], [1.0, 1.0]) == "sample"
    assert sampling_mode([0.0, 0.7], [1.0, 0.9]) == "nucleus"
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 40)) * 2, jnp.float32)
    key = jax.random.PRNGKey(0)
    f = jax.jit(sample_token, static_argnames="mode")
    for temp, top_p in (([0.0] * 3, [1.0] * 3), ([0.0, 0.8, 1.0], [1.0] * 3), ([0.0, 0.8, 1.0], [1.0, 0.5, 1.0])):
        t, p = jnp.asarray(temp), jnp.asarray(top_p)
        mode = sampling_mode(temp, top_p)
        # a compiler property is the point here: the lowered step holds no conditional
        hlo = f.lower(logits, key, t, p, mode=mode).as_text()
        assert "stablehlo.case" not in hlo and "stablehlo.if" not in hlo, mode
        np.testing.assert_array_equal(np.asarray(f(logits, key, t, p, mode=mode)),
                                      np.asarray(f(logits, key, t, p, mode="nucleus")))


def test_greedy_picks_what_argmax_picks_ties_and_nans_included():
    """`first_max` (a max, then the least index reaching it) stands in for jnp.argmax in the sampler: the
    first of tied maxima, the first NaN of a row holding one, a row of -inf, and wide vocabularies."""
    from amdllm.infer.decode import first_max
    rng = np.random.default_rng(0)
    rows = rng.integers(-3, 4, (6, 50)).astype(np.float32)  # small integers: ties everywhere
    rows[1, [7, 30]] = np.nan
    rows[2] = -np.inf
    rows[3, [4, 9]] = np.inf
    for x in (rows, rng.standard_normal((3, 128256)).astype(np.float32), rows[0]):
        got = jax.jit(first_max)(jnp.asarray(x))
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))


def test_forward_takes_per_layer_weights_and_either_cache_layout(models):
    from amdllm.model import forward, init_cache, to_pure
    from amdllm.model.fast import layer_slices
    _, ours = models
    cfg = ours.cfg
    top, layers = to_pure(ours)
    views = layer_slices(layers)
    toks = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 9)), jnp.int32)
    want, _ = forward(cfg, top, layers, toks)
    got, _ = forward(cfg, top, views, toks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    # with a cache: stacked weights x {stacked, per-layer} cache, per-layer weights x both
    outs = {}
    for w_name, w in (("stacked", layers), ("per_layer", views)):
        for c_name in ("stacked", "per_layer"):
            cache = init_cache(cfg, 2, 16, per_layer=c_name == "per_layer")
            logits, cache = forward(cfg, top, w, toks[:, :8], cache=cache, cache_index=0)
            step, cache = forward(cfg, top, w, toks[:, 8:], cache=cache, cache_index=8)
            assert isinstance(cache.k, tuple) == (c_name == "per_layer"), (w_name, c_name)
            # head-major [B, Hkv, S, hd] per layer; the 9 tokens went to slots 0..8 and nowhere else
            k0 = np.asarray(cache.k[0])
            assert k0.shape == (2, cfg.num_key_value_heads, 16, cfg.head_dim), k0.shape
            written = np.abs(k0).sum(axis=(0, 1, 3)) > 0
            assert written[:9].all() and not written[9:].any(), written
            outs[w_name, c_name] = np.asarray(step[:, 0])
    for v in outs.values():
        np.testing.assert_allclose(v, np.asarray(want[:, 8]), atol=5e-5, rtol=0)
