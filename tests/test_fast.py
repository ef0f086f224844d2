"""The fast paths (amdllm.model.fast) compute what the textbook model (amdllm.model.llama) computes:
logits, LoRA gradients (blocked attention's and SwiGLU's hand-written backward passes, fused projections),
LoRA dropout, GPTQ-packed weights, per-layer decoding with a KV cache, and narrow weights carried as bits
(amdllm.model.narrow). The tolerance is float32 rounding noise for the model's size (logit_tolerance)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from amdllm.config import LlamaConfig
from amdllm.model import fast, llama, lora, narrow
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


@pytest.mark.parametrize("B,want", [(1, False), (2, True)])  # 64 rows < in = 128 <= 128 rows
def test_a_joined_kernel_only_where_no_larger_than_its_output(B, want):
    """q/k/v and gate/up run as one matmul each only where the joined kernel [in, sum(out)] is no larger than
    the output (`fast.fuses`: autodiff keeps it for the backward pass); fused or not, the textbook's numbers."""
    cfg = dataclasses.replace(CFG, hidden_size=128)
    m = lora.apply_lora(Llama(cfg, rngs=nnx.Rngs(0)), rank=4, alpha=8)
    toks = jnp.zeros((B, 64), jnp.int32)
    assert fast.fuses(toks.size, cfg.hidden_size) == want
    assert not fast.fuses(fast.FUSE_MIN_ROWS - 1, 1)
    top, layers = to_pure(m)
    want_logits = llama.forward(cfg, top, layers, toks, run=m.run())[0]
    got = fast.forward(cfg, top, layers, toks, run=m.run())[0]
    assert np.abs(np.asarray(got - want_logits)).max() <= logit_tolerance(cfg, float(jnp.abs(want_logits).max()))


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


@pytest.mark.parametrize("fwd", [llama.forward, fast.forward], ids=["textbook", "fast"])
def test_remat_modes_give_the_same_lora_gradients(fwd):
    """Run.remat "dots" (keep the projections' outputs) and "full" (keep each layer's input) recompute what
    "none" keeps: the same LoRA gradients, to float32 rounding."""
    m = model()
    top, layers = to_pure(m)
    lo = {k: v for k, v in layers.items() if "lora" in k}
    base = {k: v for k, v in layers.items() if "lora" not in k}
    toks = tokens(4, 32)
    grads = {r: jax.jit(jax.grad(lambda lo, r=r: jnp.sum(jnp.sin(
        fwd(CFG, top, {**base, **lo}, toks, run=Run(lora_scale=m.lora_scale, remat=r))[0]))))(lo)
        for r in llama.REMAT}
    for r in ("dots", "full"):
        for k in lo:
            scale = float(jnp.abs(grads["none"][k]).max())
            np.testing.assert_allclose(np.asarray(grads[r][k]), np.asarray(grads["none"][k]), atol=1e-5 * scale,
                                       err_msg=f"{r}: {k}")
    with pytest.raises(ValueError, match="remat must be one of"):
        llama.remat_mode("some")


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
    """Prefill then one decode step: the textbook forward with a stacked cache against the fast forward over
    per-layer weights (`layer_slices`, a GPU's decode step) with a per-layer cache, and over stacked weights
    with a per-layer cache (a scanned prefill before per-layer steps)."""
    m = model()
    top, layers = to_pure(m)
    run = Run(lora_scale=m.lora_scale)
    per_layer = fast.layer_slices(layers)
    assert len(per_layer) == CFG.num_hidden_layers
    toks = tokens(2, 9)
    out = {}
    for name, fwd, w, cache in (("textbook", llama.forward, layers, llama.init_cache(CFG, 2, 16)),
                                ("per_layer", fast.forward, per_layer, fast.init_cache(CFG, 2, 16, per_layer=True)),
                                ("stacked", fast.forward, layers, fast.init_cache(CFG, 2, 16, per_layer=True))):
        first, cache = fwd(CFG, top, w, toks[:, :8], cache=cache, cache_index=0, run=run)
        step, cache = fwd(CFG, top, w, toks[:, 8:], cache=cache, cache_index=8, run=run)
        assert isinstance(cache.k, tuple) == (name != "textbook")
        out[name] = (np.asarray(first), np.asarray(step))
    tol = logit_tolerance(CFG, np.abs(out["textbook"][0]).max())
    for name in ("per_layer", "stacked"):
        for a, b in zip(out["textbook"], out[name]):
            assert np.abs(a - b).max() <= tol, name


# --------------------------------------------------------------------------------------------------
# Narrow (bfloat16) weights on a CPU: carried as bits, widened one layer / one head block at a time
# --------------------------------------------------------------------------------------------------
BIG = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=512, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=True)


def bf16_model(cfg=BIG):
    return Llama(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)


def test_bits_share_memory_and_read_back_exactly():
    m = bf16_model()
    top, layers = to_pure(m)
    btop, blayers = narrow.inference_weights(top, layers)
    b = blayers["gate_proj"]
    assert isinstance(b, narrow.Bits) and b.bits.dtype == jnp.uint16
    assert b.bits.unsafe_buffer_pointer() == layers["gate_proj"].unsafe_buffer_pointer()  # no copy
    assert not isinstance(btop["norm"], narrow.Bits)  # norms stay arrays
    np.testing.assert_array_equal(np.asarray(b.value()), np.asarray(layers["gate_proj"]))
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), layers)
    assert narrow.carry_bits(f32) is not f32 and not narrow.has_bits(narrow.carry_bits(f32))  # float32 as it is


def test_evaluation_of_narrow_weights_widens_one_layer_at_a_time():
    """XLA:CPU widens bfloat16 operands to float32 and hoists that out of the layer scan: the whole stack
    in float32 as scratch. With the weights as bits the scratch stays below one float32 copy of the
    stack, and the NLL is what the full-logits computation gives."""
    from amdllm.infer import evaluate
    m = bf16_model()
    top, layers = to_pure(m)
    fn = evaluate._nll_fn(m)
    toks = tokens(2, 64) % BIG.vocab_size
    seg = jnp.ones_like(toks)
    stack_f32 = sum(a.size * 4 for a in jax.tree.leaves(layers))
    plain = fn.lower(top, layers, toks, seg).compile().memory_analysis().temp_size_in_bytes
    btop, blayers = narrow.inference_weights(top, layers)
    bits = fn.lower(btop, blayers, toks, seg).compile().memory_analysis().temp_size_in_bytes
    assert plain > stack_f32 > 2 * bits, (plain, stack_f32, bits)  # the first: what this fixes
    np.testing.assert_allclose(np.asarray(fn(btop, blayers, toks, seg)), np.asarray(fn(top, layers, toks, seg)),
                               rtol=1e-4)
    logits = fast.forward(BIG, top, layers, toks, run=Run(jnp.bfloat16))[0]
    want = float(jnp.sum(llama_token_nll(logits[:, :-1], toks[:, 1:])))
    assert abs(float(fn(btop, blayers, toks, seg)[0]) - want) <= 1e-4 * abs(want)


def llama_token_nll(logits, targets):
    from amdllm.model import token_nll
    return token_nll(logits, targets)


@pytest.mark.parametrize("tied", [True, False])
def test_blocked_head_and_nll_equal_the_whole_head(monkeypatch, tied):
    """By vocabulary blocks, with a remainder block (1000 = 3 x 333 + 1), tied or not, narrow or not."""
    monkeypatch.setattr(narrow, "HEAD_BLOCK", 300)
    cfg = dataclasses.replace(BIG, tie_word_embeddings=tied)
    for dtype in (jnp.bfloat16, jnp.float32):
        m = Llama(cfg, rngs=nnx.Rngs(1), param_dtype=dtype, dtype=jnp.float32)
        top, _ = to_pure(m)
        btop, _ = narrow.inference_weights(top, {})
        assert narrow.has_bits(btop) == (dtype == jnp.bfloat16)
        h = jax.random.normal(jax.random.key(2), (3, 5, cfg.hidden_size))
        t = jax.random.randint(jax.random.key(3), (3, 5), 0, cfg.vocab_size)
        want = llama.head(top, h, jnp.float32)
        for rows in (h, h[:1, -1]):  # many rows, and one (a decode step's)
            np.testing.assert_allclose(np.asarray(jax.jit(narrow.head, static_argnums=2)(btop, rows, jnp.float32)),
                                       np.asarray(llama.head(top, rows, jnp.float32)), rtol=1e-5, atol=1e-5)
        nll = jax.jit(narrow.token_nll, static_argnums=3)(btop, h, t, jnp.float32)
        np.testing.assert_allclose(np.asarray(nll), np.asarray(llama_token_nll(want, t)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_narrow_head_is_differentiable_in_h(tied):
    """A bf16 head times many rows (a training step's), by blocks: the logits and h's gradient of the head
    applied to the bf16 values."""
    cfg = dataclasses.replace(BIG, tie_word_embeddings=tied)
    top, _ = to_pure(Llama(cfg, rngs=nnx.Rngs(1), param_dtype=jnp.bfloat16, dtype=jnp.float32))
    btop, _ = narrow.inference_weights(top, {})
    h = jax.random.normal(jax.random.key(2), (2, 96, cfg.hidden_size))
    w = jax.random.normal(jax.random.key(3), (2, 96, cfg.vocab_size))
    wide = jax.tree.map(lambda a: a.astype(jnp.float32), top)
    f = lambda fn, t: jax.value_and_grad(lambda h: jnp.sum(fn(t, h, jnp.float32) * w))(h)  # noqa: E731
    (got, g_got), (want, g_want) = jax.jit(lambda h: f(narrow.head, btop))(h), f(llama.head, wide)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g_got), np.asarray(g_want), rtol=1e-4, atol=1e-4)


def test_greedy_decoding_of_narrow_weights_equals_the_plain_path():
    """`generate` on bf16 weights (bits, scanned decode step) gives the ids of a plain argmax loop over the
    textbook forward in bfloat16 (no cache), and the same logits to bf16 rounding."""
    from amdllm.infer.generate import generate_ids
    m = bf16_model(dataclasses.replace(BIG, num_hidden_layers=2))
    prompt = [5, 17, 42, 7]
    got = generate_ids(m, [prompt], 6, eos_ids=())[0]
    ids = list(prompt)
    top, layers = to_pure(m)
    for _ in range(6):
        logits = llama.forward(m.cfg, top, layers, jnp.asarray([ids]), run=Run(jnp.bfloat16))[0]
        ids.append(int(jnp.argmax(logits[0, -1])))
    assert got == ids[len(prompt):]


def bits_step_inputs(m, T: int = 64):
    """(LoRA factors, the frozen base with its narrow weights as `Bits`, a [2, T] batch): what `loss_fn`
    takes for model m, as `finetune` hands them to the step on a CPU."""
    from amdllm.train.step import split_params
    trained, frozen = split_params(m)
    top, layers = narrow.inference_weights({k: v for k, v in frozen.items() if k != "layers"}, frozen["layers"])
    toks = tokens(2, T) % m.cfg.vocab_size
    batch = {"tokens": toks, "targets": jnp.roll(toks, -1, 1), "positions": jnp.broadcast_to(jnp.arange(T), (2, T)),
             "segment_ids": jnp.ones_like(toks), "weights": jnp.ones(toks.shape, jnp.float32)}
    return trained, {**top, "layers": layers}, batch


def bf16_lora_model(layers: int = 2):
    """BIG with `layers` layers in bfloat16, LoRA rank 4 on every projection, B factors drawn (not zero),
    so that the LoRA gradients of A are not zero either."""
    m = lora.apply_lora(bf16_model(dataclasses.replace(BIG, num_hidden_layers=layers)), rank=4, alpha=8)
    key = jax.random.key(3)
    for i, name in enumerate(lora.lora_targets(m)):
        var = getattr(m.layers, name + "_lora_b")
        var.value = 0.05 * jax.random.normal(jax.random.fold_in(key, i), var.shape)
    return m


def test_lora_step_on_a_bits_base_keeps_no_widened_stack():
    """A frozen bf16 base as bits, the step in float32 (`finetune` on a CPU): the LoRA gradients of the same
    base widened to float32, and no widened copy of the stack in XLA's scratch: no more than with a float32
    base (the same activations), and a stack less than with the bf16 arrays as they are (which XLA:CPU
    widens whole, and autodiff would keep widened: `narrow.keep_all_but_widening`)."""
    from amdllm.train.step import loss_fn
    m = bf16_lora_model(layers=4)
    m.dtype = jnp.dtype(jnp.float32)
    trained, frozen, batch = bits_step_inputs(m)
    assert narrow.has_bits(frozen["layers"])
    grad = jax.jit(jax.grad(lambda t, f: loss_fn(t, f, batch, model=m)))
    plain = jax.tree.map(lambda a: a.value() if narrow.is_bits(a) else a, frozen, is_leaf=narrow.is_bits)
    wide = jax.tree.map(lambda a: a.astype(jnp.float32), plain)
    got, want = grad(trained, frozen), grad(trained, wide)
    for k in trained:
        scale = float(jnp.abs(want[k]).max())
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), atol=1e-4 * scale, err_msg=k)
    stack_f32 = sum(v.bits.size * 4 for v in frozen["layers"].values() if narrow.is_bits(v))
    temp = {n: grad.lower(trained, f).compile().memory_analysis().temp_size_in_bytes
            for n, f in (("bits", frozen), ("float32", wide), ("bf16", plain))}
    assert temp["bits"] <= temp["float32"] and temp["bf16"] - temp["bits"] > stack_f32, (temp, stack_f32)
