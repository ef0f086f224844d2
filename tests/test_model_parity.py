"""Our Llama, loaded from checkpoints that `transformers` saved, gives transformers' logits.

Reference: transformers.LlamaForCausalLM (eager attention, float32) on random tiny models whose
weights are O(0.1) and whose norms are not all ones (tests/tiny.py), so a wrong transpose, a wrong
RoPE frequency or a mis-routed head shows up as an O(1) error, far above the 1e-4 tolerance.
"""
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tiny import LLAMA3_ROPE, hf_logits, make_hf_checkpoint, random_tokens

from amdllm.io import checkpoint

TOL = 1e-4  # float32 max abs difference on logits of magnitude ~2-3

CASES = {
    "gqa": {},                                   # 4 query heads share 2 kv heads
    "mqa": {"num_key_value_heads": 1},
    "mha": {"num_key_value_heads": 4},
    "tied": {"tie_word_embeddings": True},
    "llama3_rope": {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0},
    "head_dim_32": {"head_dim": 32},             # 4 heads x 32 = 128 != hidden 64
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(tmp_path, case):
    ckpt, hf = make_hf_checkpoint(tmp_path, **CASES[case])
    model = checkpoint.load(ckpt)
    # long enough (96 > original_max_position_embeddings=32) for llama3 scaling to change frequencies
    tokens = random_tokens(2, 96, seed=1)
    ours, _ = model(jnp.asarray(tokens))
    ref = hf_logits(hf, tokens)
    diff = float(np.max(np.abs(np.asarray(ours) - ref)))
    print(f"{case}: max|ours - transformers| = {diff:.2e} (logits max {np.abs(ref).max():.2f})")
    assert ours.dtype == jnp.float32 and ours.shape == ref.shape
    assert diff <= TOL


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    ckpt, hf = make_hf_checkpoint(tmp_path_factory.mktemp("parity"))
    return ckpt, hf, checkpoint.load(ckpt)


def test_right_padding_mask(gqa):
    _, hf, model = gqa
    tokens = random_tokens(3, 20, seed=2)
    mask = np.ones_like(tokens)
    mask[1, 14:] = 0   # row 1: 14 real tokens then padding
    mask[2, 5:] = 0    # row 2: 5 real tokens
    tokens = np.where(mask == 1, tokens, 0)
    ours, _ = model(jnp.asarray(tokens), segment_ids=jnp.asarray(mask))
    ref = hf_logits(hf, tokens, attention_mask=mask)
    real = mask.astype(bool)
    diff = float(np.max(np.abs(np.asarray(ours)[real] - ref[real])))
    print(f"right padding: max diff on real tokens = {diff:.2e}")
    assert diff <= TOL
    # padding must not leak: the padded row's real prefix equals the same prefix run alone
    alone = hf_logits(hf, tokens[2:3, :5])
    assert np.max(np.abs(np.asarray(ours)[2, :5] - alone[0])) <= TOL


def test_packed_segments_equal_separate_runs(gqa):
    _, hf, model = gqa
    a, b = random_tokens(1, 9, seed=3)[0], random_tokens(1, 11, seed=4)[0]
    packed = np.concatenate([a, b])[None]
    seg = np.array([[1] * 9 + [2] * 11])
    pos = np.array([list(range(9)) + list(range(11))])  # RoPE restarts with each sequence
    ours, _ = model(jnp.asarray(packed), segment_ids=jnp.asarray(seg), positions=jnp.asarray(pos))
    ours = np.asarray(ours)[0]
    ref_a, ref_b = hf_logits(hf, a[None])[0], hf_logits(hf, b[None])[0]
    sep_a = np.asarray(model(jnp.asarray(a[None]))[0])[0]
    d_hf = max(np.abs(ours[:9] - ref_a).max(), np.abs(ours[9:] - ref_b).max())
    d_self = np.abs(ours[:9] - sep_a).max()
    print(f"packed: max diff vs transformers run separately = {d_hf:.2e}, vs ours separately = {d_self:.2e}")
    assert d_hf <= TOL and d_self <= TOL


@pytest.mark.parametrize("mode", ["bf16_params", "bf16_compute"])
def test_bfloat16_close(gqa, mode):
    ckpt, hf, _ = gqa
    if mode == "bf16_params":
        model = checkpoint.load(ckpt, dtype=jnp.bfloat16)
        assert model.layers.q_proj[...].dtype == jnp.bfloat16
    else:  # float32 master weights, bf16 activations (the training set-up)
        model = checkpoint.load(ckpt, compute_dtype=jnp.bfloat16)
        assert model.layers.q_proj[...].dtype == jnp.float32
    tokens = random_tokens(2, 32, seed=5)
    ours, _ = model(jnp.asarray(tokens))
    ref = hf_logits(hf, tokens)
    ours = np.asarray(ours)
    diff = float(np.max(np.abs(ours - ref)))
    agree = float(np.mean(ours.argmax(-1) == ref.argmax(-1)))
    print(f"{mode}: max diff {diff:.3f} (logits max {np.abs(ref).max():.2f}), argmax agreement {agree:.3f}")
    assert ours.dtype == np.float32 and np.isfinite(ours).all()
    assert diff <= 0.1 and diff > 0  # bf16 rounding is visible but small
    assert agree >= 0.9
