"""The fast paths (amdllm.model.fast) compute what the textbook model (amdllm.model.llama) computes:
logits, LoRA gradients (blocked attention's and SwiGLU's hand-written backward passes, fused projections),
LoRA dropout, GPTQ-packed weights, and per-layer decoding with a KV cache. The tolerance is float32
rounding noise for the model's size (amdllm.model.logit_tolerance)."""
import dataclasses
import re

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from amdllm.config import LlamaConfig
from amdllm import cpu, native
from amdllm.model import fast, llama, lora, narrow, views as views_mod
from amdllm.model import layers as layers_mod
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
    the output (`fast.fuses`): autodiff keeps it for the backward pass, every layer's at once. Read off
    the compiled LoRA gradient: a concatenate of that shape exists exactly where the group is fused."""
    cfg = dataclasses.replace(CFG, hidden_size=128)
    m = lora.apply_lora(Llama(cfg, rngs=nnx.Rngs(0)), rank=4, alpha=8)
    top, layers = to_pure(m)
    lo = {k: v for k, v in layers.items() if "lora" in k}
    base = {k: v for k, v in layers.items() if "lora" not in k}
    toks = jnp.zeros((B, 64), jnp.int32)
    assert fast.fuses(toks.size, cfg.hidden_size) == want
    grad = jax.jit(jax.grad(lambda lo: jnp.sum(fast.forward(cfg, top, {**base, **lo}, toks,
                                                            run=Run(lora_scale=m.lora_scale))[0])))
    hlo = grad.lower(lo).compile().as_text()
    joined = re.search(rf"f32\[(2,)?128,{2 * cfg.intermediate_size}\]\{{[^}}]*\}} concatenate\(", hlo)
    assert bool(joined) == (want and jax.default_backend() == "cpu")


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


@pytest.mark.parametrize("remat", llama.REMAT)
def test_training_over_per_layer_views_equals_the_layer_scan(monkeypatch, remat):
    """`step_views`: the frozen layers as per-layer views (zero-copy) and the layers unrolled give the scan's
    LoRA gradients, in every remat mode and with LoRA dropout (the same per-layer masks)."""
    monkeypatch.setattr(cpu, "runs_on_caller", lambda: True)
    m = model()
    top, layers = to_pure(m)
    lo = {k: v for k, v in layers.items() if "lora" in k}
    base = {k: v for k, v in layers.items() if "lora" not in k}
    views = views_mod.step_views(base)
    assert len(views) == CFG.num_hidden_layers
    assert views[1]["down_proj"].unsafe_buffer_pointer() == np.asarray(base["down_proj"])[1].ctypes.data
    toks, run = tokens(4, 32), Run(lora_scale=m.lora_scale, lora_dropout=0.25, remat=remat)

    def grad(layers_of):
        return jax.jit(jax.grad(lambda lo: jnp.sum(jnp.sin(fast.forward(
            CFG, top, layers_of(lo), toks, run=run, dropout_rng=jax.random.key(3))[0]))))(lo)

    want = grad(lambda lo: {**base, **lo})
    got = grad(lambda lo: [{**v, **{k: x[i] for k, x in lo.items()}} for i, v in enumerate(views)])
    for k in lo:
        scale = float(jnp.abs(want[k]).max())
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), atol=1e-5 * scale, err_msg=k)


def test_step_views_only_for_a_float32_base_on_steps_run_by_the_caller(monkeypatch):
    m = model()
    base = {k: v for k, v in to_pure(m)[1].items() if "lora" not in k}
    monkeypatch.setattr(cpu, "runs_on_caller", lambda: False)
    assert views_mod.step_views(base) is None  # dispatched asynchronously: the scan (module doc of step_views)
    monkeypatch.setattr(cpu, "runs_on_caller", lambda: True)
    assert views_mod.step_views(base) is not None
    bits = narrow.carry_bits(jax.tree.map(lambda a: a.astype(jnp.bfloat16), base))
    # a bf16 base as bits: views where the tile kernel reads them in place
    assert (views_mod.step_views(bits) is not None) == native.tiles_available()
    monkeypatch.setattr(native, "tiles_available", lambda: False)
    assert views_mod.step_views(bits) is None
    assert views_mod.step_views(jax.tree.map(lambda a: a.astype(jnp.bfloat16), base)) is None  # not as bits
    assert views_mod.step_views(narrow.carry_bits(jax.tree.map(lambda a: a.astype(jnp.float16), base))) is None


@pytest.mark.parametrize("kernels_take_all", [True, False])
def test_training_a_bf16_base_over_per_layer_views_equals_the_layer_scan(monkeypatch, kernels_take_all):
    """A bfloat16 base as bits: unrolled over per-layer views (`step_views`), the LoRA gradients of the scan
    (`keep_bits`, `hold_stacked`), both where every product runs on the bits (`narrow.unwidened`: no
    checkpoint) and where XLA widens the kernels (a checkpoint that recomputes the widening)."""
    if not kernels_take_all:  # every product widened in XLA
        monkeypatch.setattr(narrow, "TILES_MIN_ROWS", 10 ** 6)
        monkeypatch.setattr(narrow, "BF16_DOT_MIN_ROWS", 10 ** 6)
        monkeypatch.setattr(narrow, "native_rows_for", lambda w, rows: False)
    cfg = dataclasses.replace(BIG, num_hidden_layers=2)
    m = lora.apply_lora(bf16_model(cfg), rank=4, alpha=8, targets="q,k,v,o,gate,up,down", seed=0)
    top, layers = to_pure(m)
    lo = {k: v for k, v in layers.items() if "lora" in k}
    lo = {k: 0.05 * jax.random.normal(jax.random.key(i), v.shape, v.dtype) if k.endswith("_b") else v
          for i, (k, v) in enumerate(lo.items())}  # non-zero B: A gets a gradient
    top, base = narrow.inference_weights(top, {k: v for k, v in layers.items() if "lora" not in k})
    views = views_mod._views(base)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 64)), jnp.int32)
    assert narrow.unwidened(views[0], toks.size) == (kernels_take_all and cpu.has_bf16_dots())
    run = Run(jnp.bfloat16, lora_scale=m.lora_scale)

    def grad(layers_of):
        return jax.jit(jax.grad(lambda lo: jnp.sum(fast.forward(cfg, top, layers_of(lo), toks, run=run)[0])))(lo)

    want = grad(lambda lo: {**base, **lo})
    got = grad(lambda lo: [{**v, **{k: x[i] for k, x in lo.items()}} for i, v in enumerate(views)])
    for k in lo:
        scale = float(jnp.abs(want[k].astype(jnp.float32)).max())
        np.testing.assert_allclose(np.asarray(got[k], np.float32), np.asarray(want[k], np.float32),
                                   atol=2e-2 * scale, err_msg=k)


def test_the_rope_tables_are_computed_once_not_in_every_consumer(monkeypatch):
    """Over unrolled layers XLA:CPU fuses cos and sin into every rotation of q and k (per head, forward and
    backward) unless the tables are written out first (`held_rope_tables`): then each is evaluated once."""
    monkeypatch.setattr(cpu, "runs_on_caller", lambda: True)
    m = model()
    top, layers = to_pure(m)
    lo = {k: v for k, v in layers.items() if "lora" in k}
    views = views_mod.step_views({k: v for k, v in layers.items() if "lora" not in k})

    def cosines():
        grad = jax.jit(jax.grad(lambda lo: jnp.sum(fast.forward(
            CFG, top, [{**v, **{k: x[i] for k, x in lo.items()}} for i, v in enumerate(views)], tokens(8, 64),
            run=Run(lora_scale=m.lora_scale))[0])))
        return grad.lower(lo).compile().as_text().count("cosine(")

    assert cosines() == 1
    monkeypatch.setattr(fast, "held_rope_tables", layers_mod.rope_tables)
    assert cosines() > 2


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
    views = views_mod.layer_views(layers)
    assert views is not None and len(views) == CFG.num_hidden_layers
    toks = tokens(2, 9)
    out = {}
    for name, fwd, w, cache in (("textbook", llama.forward, layers, llama.init_cache(CFG, 2, 16)),
                                ("fast", fast.forward, views, views_mod.init_cache(CFG, 2, 16, per_layer=True))):
        first, cache = fwd(CFG, top, w, toks[:, :8], cache=cache, cache_index=0, run=run)
        step, cache = fwd(CFG, top, w, toks[:, 8:], cache=cache, cache_index=8, run=run)
        out[name] = (np.asarray(first), np.asarray(step))
    tol = logit_tolerance(CFG, np.abs(out["textbook"][0]).max())
    for a, b in zip(out["textbook"], out["fast"]):
        assert np.abs(a - b).max() <= tol


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
    # decoding: per-layer views of the bits where the native kernel reads them (a few rows; a short prefill
    # without AMX); else the scan (one layer widened at a time)
    views = views_mod.layer_views(blayers, rows=1)
    assert views is not None and views[1]["gate_proj"].bits.unsafe_buffer_pointer() == (
        b.bits.unsafe_buffer_pointer() + b.bits[0].size * 2)
    assert views_mod.layer_views(blayers, rows=narrow.native_max_rows() + 1) is None
    # a short prefill runs over the views too, a longer one scans the stack
    assert views_mod.prefill_layers(blayers, views, narrow.native_max_rows()) is views
    assert views_mod.prefill_layers(blayers, views, narrow.native_max_rows() + 1) is blayers
    # bfloat16 arrays that are not bits (XLA would widen every layer up front): the scan; float32: the views
    assert views_mod.prefill_layers(layers, views_mod.layer_views(layers), 1) is layers
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), layers)
    f32_views = views_mod.layer_views(f32)
    assert f32_views is not None and views_mod.prefill_layers(f32, f32_views, 4096) is f32_views


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
    # bits and plain bf16 arrays take different products (bf16 dots into float32 against widened weights)
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
    # the blocks' arithmetic against the whole head's, both widened: 15 rows would take bf16_dot where the
    # AMX kernel runs (bf16 activations; tests/test_tiles.py checks that path)
    monkeypatch.setattr(narrow, "TILES_MIN_ROWS", narrow.BF16_DOT_MIN_ROWS)
    cfg = dataclasses.replace(BIG, tie_word_embeddings=tied)
    for dtype in (jnp.bfloat16, jnp.float32):
        m = Llama(cfg, rngs=nnx.Rngs(1), param_dtype=dtype, dtype=jnp.float32)
        top, _ = to_pure(m)
        btop, _ = narrow.inference_weights(top, {})
        h = jax.random.normal(jax.random.key(2), (3, 5, cfg.hidden_size))
        t = jax.random.randint(jax.random.key(3), (3, 5), 0, cfg.vocab_size)
        want = llama.head(top, h, jnp.float32)
        for rows in (h, h[:1, -1]):  # many rows, and one (a decode step's `head_product`)
            np.testing.assert_allclose(np.asarray(jax.jit(narrow.head_blocked, static_argnums=2)(btop, rows, jnp.float32)),
                                       np.asarray(llama.head(top, rows, jnp.float32)), rtol=1e-5, atol=1e-5)
        nll = jax.jit(narrow.token_nll_blocked, static_argnums=3)(btop, h, t, jnp.float32)
        np.testing.assert_allclose(np.asarray(nll), np.asarray(llama_token_nll(want, t)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_narrow_head_of_many_rows(tied):
    """A bf16 head times many rows (a training step's): with the tile kernel, one call over the whole table
    (`head_blocked`), else by blocks; either way bf16 operands into float32 sums, the logits and h's
    gradient of the float32 head applied to the bf16-rounded values."""
    cfg = dataclasses.replace(BIG, tie_word_embeddings=tied)
    top, _ = to_pure(Llama(cfg, rngs=nnx.Rngs(1), param_dtype=jnp.bfloat16, dtype=jnp.float32))
    btop, _ = narrow.inference_weights(top, {})
    h = jax.random.normal(jax.random.key(2), (2, 96, cfg.hidden_size)).astype(jnp.bfloat16).astype(jnp.float32)
    w = jax.random.normal(jax.random.key(3), (2, 96, cfg.vocab_size))
    wide = jax.tree.map(lambda a: a.astype(jnp.float32), top)
    f = lambda fn, t: jax.value_and_grad(lambda h: jnp.sum(fn(t, h, jnp.float32) * w))(h)  # noqa: E731
    (got, g_got), (want, g_want) = jax.jit(lambda h: f(narrow.head_blocked, btop))(h), f(llama.head, wide)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g_got), np.asarray(g_want), rtol=1e-2, atol=1e-2)  # dh: bf16 dy


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


def test_decode_step_widens_one_kernel_at_a_time(monkeypatch):
    """XLA:CPU's scheduler widens all of a layer's kernels at the top of the layer, side by side in float32
    (1B bf16 decode step: 254 MB of scratch; 78 MB with this). `Bits.widen_for` reads each kernel after its
    matmul's input and `Bits.after` after the previous projection's output: the scratch is then below half
    the layer's kernels in float32 (and above all of them without it: what this fixes)."""
    from amdllm.infer import generate as gen
    monkeypatch.setattr(native, "available", lambda: False)  # XLA's way (with the kernel nothing is widened)
    m = bf16_model(dataclasses.replace(BIG, intermediate_size=2048, vocab_size=256))
    top, layers = narrow.inference_weights(*to_pure(m))
    layer_f32 = sum(a.bits[0].size * 4 for a in layers.values() if a.bits.ndim == 3)

    def step_scratch():
        gen._COMPILED.clear()
        prefill, step = gen._compiled(m)
        toks, pos, seg, lens = gen.pack_prompts([[1, 2, 3]])
        key, t, p = jax.random.PRNGKey(0), jnp.zeros(1), jnp.ones(1)
        tok, _, cache = prefill(top, layers, toks, pos, seg, key, t, p, cache_len=64)
        args = (top, layers, tok, lens.astype(np.int32), cache, toks.shape[1], 1, key, t, p)
        return step.lower(*args).compile().memory_analysis().temp_size_in_bytes, step(*args)[0]

    scratch, tok = step_scratch()
    monkeypatch.setattr(narrow.Bits, "widen_for", lambda self, x: self.value())
    monkeypatch.setattr(narrow.Bits, "after", lambda self, y: self)
    hoisted, tok_hoisted = step_scratch()
    gen._COMPILED.clear()
    # gate and up share an input: `after` reads up's kernel once gate's output exists
    assert scratch < 0.5 * layer_f32 < layer_f32 < hoisted, (scratch, layer_f32, hoisted)
    assert int(tok[0]) == int(tok_hoisted[0])


# --------------------------------------------------------------------------------------------------
# bf16 dots on CPUs with bf16 instructions
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("transposed", [False, True])
def test_bf16_dot_is_a_bf16_matmul_with_float32_sums(transposed):
    """`narrow.bf16_dot`: x rounded to bf16 times the bf16 kernel, summed in float32 (PyTorch's bf16
    matmul); its backward dx = dy W^T likewise, with dy rounded to bf16. Kernel [in, out] or, transposed
    (a tied head's embedding rows), [out, in]."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((96, 64)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((96, 48)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 48)) * 0.1, jnp.bfloat16)
    bits = jax.lax.bitcast_convert_type(w.T if transposed else w, jnp.uint16)
    r16 = lambda a: np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32), np.float64)  # noqa: E731
    wf = np.asarray(w.astype(jnp.float32), np.float64)
    y, vjp = jax.vjp(lambda x: narrow.bf16_dot(x, bits, transposed), x)
    np.testing.assert_allclose(np.asarray(y), r16(x) @ wf, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(vjp(dy)[0]), r16(dy) @ wf.T, rtol=1e-5, atol=1e-5)


def bf16_dot_count(fn, *args) -> int:
    """How many dots in fn's jaxpr (nested ones included) multiply two bf16 operands into float32: XLA's,
    or the tile kernel's (`native.tiles_times`, on a CPU with AMX or AVX-512 BF16)."""
    def count(jaxpr):
        n = 0
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general":
                n += all(v.aval.dtype == jnp.bfloat16 for v in e.invars) and e.outvars[0].aval.dtype == jnp.float32
            n += e.primitive.name == "ffi_call" and any(
                e.params["target_name"] in by_layout.values() for by_layout in native.TILES_TARGETS.values())
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                n += count(sub)
        return n
    return count(jax.make_jaxpr(fn)(*args).jaxpr)


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


def test_lora_step_on_a_bf16_base_multiplies_in_bf16_where_the_cpu_can(monkeypatch):
    """With bf16 dots (a CPU with AVX-512 BF16 or AMX: `amdllm.cpu.has_bf16_dots`), the frozen bf16 base's
    projections and head run as bf16 x bf16 -> float32 dots, forward and backward, and give the loss and
    LoRA gradients of the widening path (to bf16 rounding: dy is rounded to bf16 as PyTorch's does).
    Decoding's one-row matmuls keep widening (slower as bf16 dots on XLA:CPU)."""
    from amdllm.train.step import loss_fn
    m = bf16_lora_model()
    trained, frozen, batch = bits_step_inputs(m)
    layers = frozen["layers"]
    results, counts = {}, {}
    for on in (False, True):
        monkeypatch.setattr(narrow, "has_bf16_dots", lambda on=on: on)
        grad = lambda tr: jax.value_and_grad(lambda t: loss_fn(t, frozen, batch, model=m))(tr)  # noqa: E731
        results[on] = grad(trained)
        counts[on] = bf16_dot_count(grad, trained)
    # the layer scan's body (7 projections, forward and backward) and the head's backward (attention's
    # einsums and the head's forward are bf16 x bf16 -> float32 either way)
    assert counts[True] - counts[False] >= 2 * 7 + 1, counts
    (l0, g0), (l1, g1) = results[False], results[True]
    assert abs(float(l1) - float(l0)) <= 2e-3 * abs(float(l0))
    for k in g0:
        scale = float(jnp.abs(g0[k]).max())
        np.testing.assert_allclose(np.asarray(g1[k]), np.asarray(g0[k]), atol=3e-2 * scale, err_msg=k)
    q = narrow.Bits(layers["q_proj"].bits[0], jnp.bfloat16)  # has_bf16_dots is still True here
    for rows, want in ((1, 0), (narrow.BF16_DOT_MIN_ROWS, 1)):
        assert bf16_dot_count(q.matmul, jnp.ones((rows, BIG.hidden_size), jnp.bfloat16)) == want, rows


def test_a_bf16_base_hands_its_residuals_to_the_backward_as_bits(monkeypatch):
    """The layer scan stacks each layer's residuals per layer; XLA:CPU widened a bf16 stack to float32 and back
    to write each layer's slice (1B LoRA step: about 1.1 of 9.5 s). `narrow.keep_bits` hands them over as
    uint16: the same loss and LoRA gradients, bit for bit, and no float32 conversion of a stacked buffer."""
    from amdllm.train.step import loss_fn
    cfg = dataclasses.replace(BIG, num_hidden_layers=3)
    m = lora.apply_lora(bf16_model(cfg), rank=4, alpha=8)
    trained, frozen, batch = bits_step_inputs(m)
    grad = jax.jit(jax.value_and_grad(lambda t: loss_fn(t, frozen, batch, model=m)))
    widened_stack = rf"= f32\[{cfg.num_hidden_layers},[^ ]* convert\(%param"  # inside a fusion
    got, hlo = grad(trained), grad.lower(trained).compile().as_text()
    assert not re.search(widened_stack, hlo)
    plain = lambda layer: jax.checkpoint(layer, policy=narrow.keep_all_but_widening, prevent_cse=False)  # noqa: E731
    monkeypatch.setattr(fast, "keep_bits", plain)
    grad = jax.jit(jax.value_and_grad(lambda t: loss_fn(t, frozen, batch, model=m)))
    want, hlo = grad(trained), grad.lower(trained).compile().as_text()
    assert re.search(widened_stack, hlo)  # what this fixes
    assert float(got[0]) == float(want[0])
    for k in want[1]:
        np.testing.assert_array_equal(np.asarray(got[1][k]), np.asarray(want[1][k]), err_msg=k)


def test_one_row_through_a_tied_head_reads_the_table_as_it_lies():
    """A decode step's tied head: XLA:CPU copied the [V, D] table transposed every step for h @ w.T (1 GB at
    the 1B shape); `head_product` multiplies it as it lies. The compiled one-row head holds no [D, V]."""
    V, D = 1000, 64
    top = {"embed_tokens": jax.random.normal(jax.random.key(0), (V, D))}
    h = jax.random.normal(jax.random.key(1), (1, D))
    hlo = jax.jit(narrow.head_blocked, static_argnums=2).lower(top, h, jnp.float32).compile().as_text()
    assert f"f32[{D},{V}]" not in hlo
    np.testing.assert_allclose(np.asarray(narrow.head_blocked(top, h, jnp.float32)),
                               np.asarray(h @ top["embed_tokens"].T), rtol=1e-5, atol=1e-5)


def test_decode_step_options_keep_xla_defaults_for_large_models():
    """Small models decode without XNNPACK/YNNPACK (faster there); from YNN_TRAIN_MIN_HIDDEN up XLA's
    defaults stay, since Eigen alone took 4 s for a 2-row step of the 1B shape (see cpu_compiler_options)."""
    from amdllm import cpu
    assert cpu.cpu_compiler_options("decode", 512) == {"xla_cpu_use_xnnpack": False,
                                                         "xla_cpu_experimental_ynn_fusion_type": ""}
    assert cpu.cpu_compiler_options("decode", cpu.YNN_TRAIN_MIN_HIDDEN) is None


def test_bf16_dots_follow_the_cpu_flags_or_the_override(monkeypatch):
    from amdllm import cpu
    flags = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split()
    for forced, want in (("0", False), ("1", True), ("", any(f in flags for f in cpu.BF16_FLAGS))):
        monkeypatch.setenv("AMDLLM_BF16_DOTS", forced)
        cpu.has_bf16_dots.cache_clear()
        assert cpu.has_bf16_dots() is want
    cpu.has_bf16_dots.cache_clear()
