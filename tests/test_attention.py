"""causal_attention (query blocks, recomputing backward) and swiglu (hand-written backward) against the
textbook versions differentiated by JAX: same outputs and gradients, packed segments and padding included."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amdllm.model import fast
from amdllm.model.attention import attention, cached_attention, library_attention
from amdllm.model.fast import causal_attention, query_blocks
from amdllm.model.fast import swiglu_joined as swiglu, swiglu_pair as swiglu2


def _inputs(B=2, T=16, H=4, Hkv=2, hd=8):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, h, hd)), jnp.float32) for h in (H, Hkv, Hkv))
    # row 0: two packed sequences then padding; row 1: left padding
    seg = np.array([[1] * 6 + [2] * 7 + [0] * 3, [0] * 4 + [1] * 12])
    mask = np.tril(np.ones((T, T), bool))[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)
    real = jnp.asarray(seg != 0)[:, :, None, None]
    w = jnp.asarray(rng.normal(size=(B, T, H, hd)), jnp.float32) * real  # a loss that ignores padding rows
    return q, k, v, jnp.asarray(mask), w, real


@pytest.mark.parametrize("block", [4, 8, 16, 5])  # 5: does not divide 16, one block
def test_causal_attention_matches_textbook(block):
    q, k, v, mask, w, real = _inputs()
    ref, got = attention(q, k, v, mask), causal_attention(q, k, v, mask, block_rows=block)
    np.testing.assert_allclose(np.asarray(got * real), np.asarray(ref * real), atol=1e-6)
    assert np.isfinite(np.asarray(got)).all()  # padding rows too
    g_ref = jax.grad(lambda *a: jnp.sum(attention(*a, mask) * w), argnums=(0, 1, 2))(q, k, v)
    g_got = jax.grad(lambda *a: jnp.sum(causal_attention(*a, mask, block_rows=block) * w), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", g_got, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, err_msg=f"d{name}")


def test_causal_attention_skips_blocks_above_the_diagonal():
    assert query_blocks(256, 64) == [(0, 64), (64, 128), (128, 192), (192, 256)]
    assert query_blocks(100, 64) == [(0, 100)]
    # the backward keeps no [.., T, S] probabilities: its residuals are q, k, v, mask, output and row stats
    q, k, v, mask, _, _ = _inputs(T=16)
    res = jax.vjp(lambda q, k, v: causal_attention(q, k, v, mask, block_rows=4), q, k, v)[1]
    sizes = [x.size for x in jax.tree.leaves(res) if hasattr(x, "size")]
    assert max(sizes) <= q.size, sizes


@pytest.mark.parametrize("T", [1, 3])  # a decode step; a prefill chunk of several queries
def test_cached_attention_reads_a_head_major_cache(T):
    q, k, v, _, _, _ = _inputs(T=16)
    S, q = k.shape[1], q[:, -T:]
    rng = np.random.default_rng(1)
    valid = rng.random((2, S)) < 0.8
    valid[:, 0] = True  # every query row sees at least one slot
    # query t (written at slot S-T+t) sees the valid slots up to its own: the mask differs per query row
    mask = jnp.asarray(valid[:, None, :] & (np.arange(S)[None, :] <= S - T + np.arange(T)[:, None])[None])
    ref = attention(q, k, v, mask)  # slot-major k/v [B, S, Hkv, hd]
    got = cached_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-6)


def test_library_attention_matches_textbook():
    """jax.nn.dot_product_attention (XLA's, what runs where cuDNN's cannot be checked: this CPU) with the
    same packed segments and padding: outputs and gradients."""
    q, k, v, mask, w, real = _inputs()
    ref, got = attention(q, k, v, mask), library_attention(q, k, v, mask, "xla")
    np.testing.assert_allclose(np.asarray(got * real), np.asarray(ref * real), atol=1e-6)
    g_ref = jax.grad(lambda *a: jnp.sum(attention(*a, mask) * w), argnums=(0, 1, 2))(q, k, v)
    g_got = jax.grad(lambda *a: jnp.sum(library_attention(*a, mask, "xla") * w), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", g_got, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, err_msg=f"d{name}")


def test_attention_implementation_by_backend(monkeypatch):
    monkeypatch.delenv("AMDLLM_ATTENTION", raising=False)
    assert fast.attention_implementation(jnp.float32) == "blocked"  # the CPU
    assert fast.attention_implementation(jnp.bfloat16) == "blocked"

    class Dev:
        device_kind = "NVIDIA H200"
    monkeypatch.setattr(fast.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(fast.jax, "devices", lambda: [Dev()])
    assert fast.attention_implementation(jnp.bfloat16) == "cudnn"
    assert fast.attention_implementation(jnp.float32) == "blocked"  # cuDNN's takes fp16/bf16 only
    Dev.device_kind = "AMD Instinct MI300X"
    assert fast.attention_implementation(jnp.bfloat16) == "blocked"  # no cuDNN on ROCm
    monkeypatch.setenv("AMDLLM_ATTENTION", "xla")
    assert fast.attention_implementation(jnp.bfloat16) == "xla"
    monkeypatch.setenv("AMDLLM_ATTENTION", "flash")
    with pytest.raises(ValueError, match="AMDLLM_ATTENTION='flash'"):
        fast.attention_implementation(jnp.bfloat16)


def test_swiglu_gradients():
    gu = jnp.asarray(np.random.default_rng(1).normal(size=(5, 12)) * 3, jnp.float32)
    ref = lambda gu: jnp.sum(jnp.sin(jax.nn.silu(gu[:, :6]) * gu[:, 6:]))  # noqa: E731
    np.testing.assert_allclose(float(jnp.sum(jnp.sin(swiglu(gu)))), float(ref(gu)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.grad(lambda x: jnp.sum(jnp.sin(swiglu(x))))(gu)),
                               np.asarray(jax.grad(ref)(gu)), atol=1e-5)
    g2 = jax.grad(lambda g, u: jnp.sum(jnp.sin(swiglu2(g, u))), argnums=(0, 1))(gu[:, :6], gu[:, 6:])
    np.testing.assert_allclose(np.asarray(jnp.concatenate(g2, -1)), np.asarray(jax.grad(ref)(gu)), atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "blocked"])
def test_model_forward_with_each_attention_equals_textbook(monkeypatch, impl):
    """The fast forward with AMDLLM_ATTENTION=impl gives the textbook model's logits on packed rows with
    padding (what the cuDNN choice replaces on an NVIDIA GPU)."""
    from flax import nnx

    from amdllm.config import LlamaConfig
    from amdllm.model import Llama, forward, to_pure
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    top, layers = to_pure(Llama(cfg, rngs=nnx.Rngs(0)))
    seg = jnp.asarray([[1] * 6 + [2] * 7 + [0] * 3, [1] * 16])
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 16)))
    monkeypatch.setenv("AMDLLM_ATTENTION", impl)
    got = jax.jit(lambda t, l: fast.forward(cfg, t, l, tokens, segment_ids=seg)[0])(top, layers)
    ref = forward(cfg, top, layers, tokens, segment_ids=seg)[0]
    real = np.asarray(seg != 0)[:, :, None]
    np.testing.assert_allclose(np.asarray(got) * real, np.asarray(ref) * real, atol=2e-5)
