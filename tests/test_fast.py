"""The fast paths (amdllm.model.fast) compute what the textbook model (amdllm.model.llama) computes:
logits, LoRA gradients (blocked attention's and SwiGLU's hand-written backward passes, fused projections),
LoRA dropout, GPTQ-packed weights, and per-layer decoding with a KV cache. The tolerance is float32
rounding noise for the model's size (amdllm.model.logit_tolerance)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from amdllm.config import LlamaConfig
from amdllm.model import fast, llama, lora
from amdllm.model.llama import Llama, Run, logit_tolerance, to_pure
from amdllm.quant import QuantSpec, quantize_model

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def model(targets="q,k,v,o,gate,up,down", seed=0):
    m = lora.apply_lora(Llama(CFG, rngs=nnx.Rngs(seed)), rank=4, alpha=8, targets=targets, seed=seed)
    key = jax.random.key(seed + 1)
    for i, name in enumerate(lora.lora_targets(m)):  # non-zero B, so the adapter changes the output
        var = getattr(m.layers, name + "_lora_b")
        var.value = 0.05 * jax.random.normal(jax.random.fold_in(key, i), var.shape)
    return m


def tokens(B, T, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, (B, T)), jnp.int32)


def both(m, toks, **kw):
    top, layers = to_pure(m)
    run = kw.pop("run", Run(lora_scale=m.lora_scale))
    want = llama.forward(CFG, top, layers, toks, run=run, **kw)[0]
    got = fast.forward(CFG, top, layers, toks, run=run, **kw)[0]
    return np.asarray(want), np.asarray(got)


@pytest.mark.parametrize("targets", ["q,k,v,o,gate,up,down", "q,v,down"])
@pytest.mark.parametrize("B,T", [(1, 8), (4, 32)])  # below and above FUSE_MIN_ROWS (fused on the CPU)
def test_logits_equal_textbook(targets, B, T):
    want, got = both(model(targets), tokens(B, T))
    assert np.abs(got - want).max() <= logit_tolerance(CFG, np.abs(want).max())


def test_lora_gradients_equal_textbook():
    """The backward passes: blocked attention (recomputing), SwiGLU (hand-written), fused matmuls."""
    m = model()
    top, layers = to_pure(m)
    lo = {k: v for k, v in layers.items() if "lora" in k}
    base = {k: v for k, v in layers.items() if "lora" not in k}
    toks = tokens(4, 32)

    def loss(fwd):
        return lambda lo: jnp.sum(jnp.sin(fwd(CFG, top, {**base, **lo}, toks, run=Run(lora_scale=m.lora_scale))[0]))

    want, got = jax.grad(loss(llama.forward))(lo), jax.grad(loss(fast.forward))(lo)
    for k in lo:
        scale = float(jnp.abs(want[k]).max())
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), atol=1e-4 * scale, err_msg=k)


def test_lora_dropout_draws_the_same_masks():
    """Fused projections keep the LoRA A's separate under dropout: each projection draws its own mask."""
    m = model()
    m.lora_dropout = 0.5
    want, got = both(m, tokens(4, 32), run=m.run(), dropout_rng=jax.random.key(7))
    assert np.abs(got - want).max() <= logit_tolerance(CFG, np.abs(want).max())
    no_drop, _ = both(m, tokens(4, 32))
    assert np.abs(no_drop - want).max() > 1e-3  # dropout did act


def test_gptq_packed_weights_equal_textbook():
    m = Llama(CFG, rngs=nnx.Rngs(0))
    windows = np.random.default_rng(0).integers(0, CFG.vocab_size, (4, 64))
    m, _ = quantize_model(m, windows, QuantSpec(bits=4, group_size=32), method="rtn", progress=False)
    want, got = both(m, tokens(4, 32), run=Run())
    assert np.abs(got - want).max() <= logit_tolerance(CFG, np.abs(want).max())


def test_per_layer_decoding_equals_textbook_cache():
    """Prefill then one decode step: the textbook forward with a stacked cache against the fast forward
    with per-layer weight views and a per-layer cache (what `generate` runs on a CPU)."""
    m = model()
    top, layers = to_pure(m)
    run = Run(lora_scale=m.lora_scale)
    views = fast.layer_views(layers)
    assert views is not None and len(views) == CFG.num_hidden_layers
    toks = tokens(2, 9)
    out = {}
    for name, fwd, w, cache in (("textbook", llama.forward, layers, llama.init_cache(CFG, 2, 16)),
                                ("fast", fast.forward, views, fast.init_cache(CFG, 2, 16, per_layer=True))):
        first, cache = fwd(CFG, top, w, toks[:, :8], cache=cache, cache_index=0, run=run)
        step, cache = fwd(CFG, top, w, toks[:, 8:], cache=cache, cache_index=8, run=run)
        out[name] = (np.asarray(first), np.asarray(step))
    tol = logit_tolerance(CFG, np.abs(out["textbook"][0]).max())
    for a, b in zip(out["textbook"], out["fast"]):
        assert np.abs(a - b).max() <= tol
