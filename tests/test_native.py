"""The native row kernels (`amdllm.native`, rows.cc): the bf16 one's products equal XLA's on the widened
weights, forward and backward; a bf16 decode step runs it on per-layer views and never widens a kernel;
decoding a bf16 checkpoint this way agrees with transformers in bfloat16; the float32 one's products equal
XLA's, forward and backward, and a float32 decode step runs every projection and the head through it;
`--dtype auto` picks what it documents; and a kernel that cannot be built costs a warning, not a failure.
The training loss's kernel (cross_entropy.cc) equals XLA's loss and gradient, and a float32 LoRA step runs
it and the attention kernel and equals the step without them.
(Greedy float32 decoding against transformers, which now runs the float32 kernel: tests/test_generate.py.)"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from amdllm import native
from amdllm.native import toolchain
from amdllm.native import transpose as host
from amdllm.infer.generate import Decoder, load_weights, resolve_dtype
from amdllm.model import Run, forward, init_cache, to_pure
from amdllm.model.dense import Dense
from amdllm.model.views import layer_views, prefill_layers
from amdllm.model.narrow import Bits, inference_weights, native_max_rows
from tests.tiny import make_hf_checkpoint


def test_the_kernel_is_built_here():
    """make test runs on Linux with a C++ compiler: the kernel must build (a warning names why if not)."""
    assert native.available(), "the native kernel did not build: see the RuntimeWarning above"


@pytest.mark.parametrize("K,N", [(48, 40), (64, 33), (7, 5), (2048, 520)])
def test_rows_times_equals_xla_on_the_widened_weights(K, N):
    rng = np.random.default_rng(K + N)
    w = jnp.asarray(rng.standard_normal((K, N)), jnp.bfloat16)
    bits, bits_t = (jax.lax.bitcast_convert_type(a, jnp.uint16) for a in (w, w.T))
    for M in (1, 3, 5, 6, 9, 32):  # kn_any: groups of up to 5 rows; nk_any: up to 8
        x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
        want = np.asarray(x @ w.astype(jnp.float32))
        scale = np.abs(want).max()
        for got in (native.rows_times(x, bits), jax.jit(native.rows_times, static_argnums=2)(x, bits_t, True)):
            assert got.shape == (M, N) and got.dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(got), want, atol=2e-6 * scale, rtol=0)
        # the backward: x's gradient by the other layout's kernel, in x's dtype
        dy = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
        for xb in (x, x.astype(jnp.bfloat16)):
            got = jax.vjp(lambda a: native.rows_times(a, bits), xb)[1](dy)[0]
            want_dx = np.asarray(dy @ w.astype(jnp.float32).T)
            assert got.dtype == xb.dtype
            np.testing.assert_allclose(np.asarray(got, np.float32), want_dx,
                                       atol=(2e-6 if xb.dtype == jnp.float32 else 1e-2) * np.abs(want_dx).max())


def test_rows_times_gives_the_same_bits_every_call():
    """The threads claim bands of W's rows as they come free; the sums must not depend on which thread took
    which band, or greedy decoding of the same prompt could choose differently between two runs."""
    rng = np.random.default_rng(3)
    bits = jax.lax.bitcast_convert_type(jnp.asarray(rng.standard_normal((4096, 256)), jnp.bfloat16), jnp.uint16)
    x = jnp.asarray(rng.standard_normal((1, 4096)), jnp.float32)
    step = jax.jit(native.rows_times)
    first = np.asarray(step(x, bits))
    for _ in range(50):
        np.testing.assert_array_equal(np.asarray(step(x, bits)), first)


@pytest.mark.parametrize("K,N", [(48, 40), (64, 33), (7, 5), (1408, 520), (40, 8192)])
def test_f32_rows_times_equals_xla(K, N):
    """Every row count the kernel takes (its sums are held in registers per row count), column counts that
    end in a partial block, a single vector and single columns; the gradients are XLA's own."""
    rng = np.random.default_rng(K * N)
    w = jnp.asarray(rng.standard_normal((K, N)), jnp.float32)
    step = jax.jit(native.f32_rows_times)
    for M in range(1, native.F32_MAX_ROWS + 1):
        x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        got = step(x, w)
        assert got.shape == (M, N) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-6 * np.abs(want).max(), rtol=0)
        np.testing.assert_array_equal(np.asarray(step(x, w)), np.asarray(got))  # the same bits every call
    dy = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
    dx, dw = jax.vjp(native.f32_rows_times, x, w)[1](dy)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(dy @ w.T), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(x.T @ dy), rtol=1e-6, atol=1e-6)


def test_a_float32_decode_step_runs_every_kernel_through_the_f32_kernel(tmp_path):
    """Per-layer views of a float32 model hold its projections as `Dense` for up to F32_MAX_ROWS rows: the
    step's seven projections per layer and its [D, V] head are custom calls, and no float32 dot of a kernel
    is left to XLA. More rows keep plain arrays (XLA's dots)."""
    d, _ = make_hf_checkpoint(tmp_path, dtype="float32", seed=6)
    model = load_weights(d, dtype="float32")
    cfg = model.cfg
    top, layers = inference_weights(*to_pure(model))
    B = native.F32_MAX_ROWS
    views = layer_views(layers, rows=B)
    assert isinstance(views[0]["q_proj"], Dense) and not isinstance(views[0]["input_layernorm"], Dense)
    assert not isinstance(layer_views(layers, rows=B + 1)[0]["q_proj"], Dense)
    cache = init_cache(cfg, B, 8, model.dtype, per_layer=True)
    tok = jnp.ones((B, 1), jnp.int32)
    text = jax.jit(lambda t, v, c: forward(cfg, t, v, tok, cache=c, cache_index=0, run=Run(model.dtype))
                   ).lower(top, views, cache).as_text()
    assert text.count("@amdllm_f32_rows_kn(") == 7 * cfg.num_hidden_layers + 1
    assert text.count("@amdllm_attention_cached(") == cfg.num_hidden_layers  # attention.cc over the cache
    assert not re.search(rf"dot_general[^\n]*tensor<{cfg.hidden_size}x\d+xf32>", text)


@pytest.fixture(scope="module", params=[False, True], ids=["lm_head", "tied"])
def bf16_ckpt(request, tmp_path_factory):
    """A bf16 checkpoint with its own head [D, V] (the kn kernel) or tied to the embedding [V, D] (nk)."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("native"), dtype="bfloat16", seed=5,
                              tie_word_embeddings=request.param)


@pytest.mark.parametrize("tokens", [1, "prefill"])
def test_a_bf16_decode_step_reads_every_kernel_through_the_native_kernel(bf16_ckpt, tokens):
    """One token, or a prefill of as many tokens as the kernel takes (`native_max_rows`: a short prompt
    where there is no AMX), through per-layer views of the bits: every projection and the tied head are
    custom calls; no 2-D kernel's bits are read back as floats (that would be XLA widening it)."""
    d, _ = bf16_ckpt
    model = load_weights(d, dtype="bfloat16")
    cfg = model.cfg
    top, layers = inference_weights(*to_pure(model))
    views = layer_views(layers, rows=2)
    assert views is not None and isinstance(views[0]["q_proj"], Bits)
    assert layer_views(layers, rows=native_max_rows() + 1) is None  # beyond the kernel: the scan widens
    T = 1 if tokens == 1 else native_max_rows()
    assert prefill_layers(layers, views, T) is views
    cache = init_cache(cfg, 1, 2 * T, model.dtype, per_layer=True)
    tok = jnp.ones((1, T), jnp.int32)
    text = jax.jit(lambda t, v, c: forward(cfg, t, v, tok, cache=c, cache_index=0, run=Run(model.dtype))
                   ).lower(top, views, cache).as_text()
    calls = text.count("@amdllm_bf16_rows_kn(")
    assert calls == 7 * cfg.num_hidden_layers + (0 if cfg.tie_word_embeddings else 1), calls
    assert text.count("@amdllm_bf16_rows_nk(") == (1 if cfg.tie_word_embeddings else 0)
    assert not re.search(r"bitcast_convert[^\n]*tensor<\d+x\d+xui16>", text)


def test_bf16_decoding_agrees_with_transformers_in_bfloat16(bf16_ckpt):
    """Greedy decoding of a bf16 checkpoint held in bf16 (the native kernel) against transformers' own
    bf16 model on the same prompt: each step's logits agree to bf16's precision, and so do the tokens;
    the same decode through XLA (the kernel off) gives the same tokens."""
    import torch
    d, hf = bf16_ckpt
    model = load_weights(d, dtype="bfloat16")
    prompt = [1, 5, 9, 22, 17, 3]
    steps = list(Decoder(model, eos_ids=()).stream([prompt], 12, return_logits=True))
    ours = [s[0][0] for s in steps]
    hf16 = hf.to(torch.bfloat16)
    ids = torch.tensor([prompt + ours])
    with torch.no_grad():
        ref = hf16(ids).logits[0, len(prompt) - 1:-1].float().numpy()              # the logits of each step
    got = np.stack([np.asarray(s[1][0]) for s in steps])
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() < 0.03 * scale, np.abs(got - ref).max() / scale
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_bf16_decoding_gives_the_same_tokens_with_the_kernel_off(bf16_ckpt):
    """The kernel changes how the weights are read, not the arithmetic: XLA's widened products (a fresh
    process with AMDLLM_NATIVE=0) decode the same greedy tokens."""
    d, _ = bf16_ckpt
    code = ("import sys, json; from amdllm.infer.generate import Decoder, load_weights; "
            f"m = load_weights({str(d)!r}, dtype='bfloat16'); "
            "print(json.dumps([s[0] for s in Decoder(m, eos_ids=()).stream([[1, 5, 9, 22, 17, 3]], 12)]))")
    outs = [subprocess.run([sys.executable, "-c", code], env={**os.environ, "AMDLLM_NATIVE": flag},
                           capture_output=True, text=True, check=True).stdout for flag in ("1", "0")]
    assert outs[0] == outs[1]


def test_dtype_auto_picks_what_it_documents(bf16_ckpt, tmp_path, monkeypatch):
    d, _ = bf16_ckpt
    f32, _ = make_hf_checkpoint(tmp_path, dtype="float32", name="f32")
    assert resolve_dtype("auto", f32) == "float32" and resolve_dtype("auto", f32, decoding=False) == "float32"
    assert resolve_dtype("auto", d) == "bfloat16" and resolve_dtype("auto", d, decoding=False) == "bfloat16"
    assert resolve_dtype("float32", d) == "float32"
    monkeypatch.setattr(native, "available", lambda: False)
    assert resolve_dtype("auto", d) == "float32"  # decoding without the kernel: XLA widens bf16 every token
    assert resolve_dtype("auto", d, decoding=False) == "bfloat16"
    with pytest.raises(ValueError, match="--dtype must be one of"):
        resolve_dtype("float16", d)


def test_a_kernel_that_cannot_be_built_is_a_warning_and_xla_decodes(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv("AMDLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(toolchain, "compiler", lambda: "/bin/false")
    native.available.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="row kernel is off .*false failed on rows.cc"):
            assert not native.available()
        stacked = {"w": Bits(jnp.zeros((2, 8, 16), jnp.uint16), jnp.bfloat16)}
        assert layer_views(stacked, rows=1) is None
    finally:
        native.available.cache_clear()
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.tmp*"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int32"])
@pytest.mark.parametrize("rows,cols", [(64, 64), (130, 67), (1, 9), (8, 1), (7, 3), (2048, 520)])
def test_transpose_into_equals_numpy(dtype, rows, cols):
    """The loader's transpose: any row strides (a column slice of a memory-mapped tensor, a column block of
    the destination), ragged edges beyond the 8 x 8 and 4 x 4 tiles, bit for bit."""
    rng = np.random.default_rng(rows * cols)
    big = rng.integers(0, 2**16, (rows + 3, cols + 5)).astype(np.uint16 if dtype in ("bfloat16", "float16")
                                                             else np.uint32).view(jnp.dtype(dtype))
    src = big[2:2 + rows, 3:3 + cols]  # strided rows, offset start
    out = np.zeros((cols, rows + 11), src.dtype)
    assert host.transpose_into(out[:, 4:4 + rows], src)
    assert out[:, 4:4 + rows].view(np.uint8).tobytes() == np.ascontiguousarray(src.T).view(np.uint8).tobytes()
    assert not out[:, :4].view(np.uint8).any() and not out[:, 4 + rows:].view(np.uint8).any()  # nothing else


def test_a_transpose_kernel_that_cannot_be_built_is_a_warning_and_numpy_transposes(tmp_path, monkeypatch):
    monkeypatch.setenv("AMDLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(toolchain, "compiler", lambda: "/bin/false")
    host._transpose_lib.cache_clear()
    try:
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        with pytest.warns(RuntimeWarning, match="transpose kernel is off .*false failed on transpose.cc"):
            assert not host.transpose_into(np.empty((4, 3), np.float32), a)
        assert np.array_equal(host.transposed(a), a.T) and host.transposed(a).flags.c_contiguous
    finally:
        host._transpose_lib.cache_clear()


def test_transpose_into_declines_what_it_does_not_do():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert not host.transpose_into(np.empty((4, 3), np.float64), a)  # a cast
    assert not host.transpose_into(np.empty((3, 4), np.float32), a)  # not the transposed shape
    assert not host.transpose_into(np.empty((4, 3), np.int8), a.astype(np.int8))  # 1-byte elements
    assert not host.transpose_into(np.empty((2, 3), np.float32), a[:, ::2])  # elements not contiguous
    assert not host.transpose_into(np.empty((4, 3), np.float32), a[::-1])  # rows backwards


@pytest.mark.parametrize("unstack", [False, True], ids=["views", "unstacked"])
def test_the_engine_holds_a_bf16_cache_as_bits_and_decodes_as_generate(bf16_ckpt, unstack):
    """The server's engine keeps a bf16 cache as uint16 bits between steps (`batch_cache.HeldCache`: XLA:CPU
    widens a whole bf16 buffer to write one row) and reads floats back for the rows a step runs. Three
    requests at once (rows joining, finishing and moving) give each prompt's tokens from `generate`, with
    the step over per-layer views or (unstack=True, as on a GPU) over static slices of the stacked weights."""
    import threading
    from amdllm.infer.engine import Engine, Request
    from amdllm.io.tokenizer import load_tokenizer
    d, _ = bf16_ckpt
    model = load_weights(d, dtype="bfloat16")
    prompts, lengths = [[1, 5, 9, 22], [1, 40, 41], [1, 7, 8, 9, 10, 11]], [10, 4, 7]
    want = [[s[0] for s in Decoder(model, eos_ids=()).stream([p], n)] for p, n in zip(prompts, lengths)]
    eng = Engine(model, load_tokenizer("data/tokenizer"), max_batch=4, max_len=64, eos_ids=(), pad_id=0,
                 unstack=unstack)
    try:
        assert (eng.views is None) == unstack and isinstance(eng.cache.k, tuple)
        assert eng.held.narrow and all(a.dtype == jnp.uint16 for a in jax.tree.leaves((eng.cache.k, eng.cache.v)))
        got, done = {}, [threading.Event() for _ in prompts]

        def emit_for(i):
            def emit(kind, payload):
                if kind in ("done", "error"):
                    got[i] = payload
                    done[i].set()
            return emit
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            eng.submit(Request(p, n, emit_for(i), temperature=0.0))
        assert all(e.wait(300) for e in done)
    finally:
        eng.stop()
    assert [got[i]["token_ids"] for i in range(3)] == want


@pytest.mark.parametrize("N,V", [(1, 7), (13, 100), (64, 1000), (8, 8192)])
def test_token_nll_equals_xla(N, V):
    """cross_entropy.cc's loss and gradient equal `loss.token_nll`'s (XLA) to float32 rounding: rows and
    vocabularies that are not multiples of the vector width or the chunk, targets at both ends of the
    vocabulary, logits far from 0 (the row max is subtracted), a weighted sum as the cotangent."""
    from amdllm.model.loss import token_nll
    rng = np.random.default_rng(N * V)
    logits = jnp.asarray(rng.standard_normal((N, V)) * 20 + 50, jnp.float32)
    targets = rng.integers(0, V, (N,))
    targets[0], targets[-1] = 0, V - 1
    targets = jnp.asarray(targets, jnp.int32)
    w = jnp.asarray(rng.random(N), jnp.float32)
    got, want = (jax.jit(jax.value_and_grad(lambda x, f=f: jnp.sum(f(x, targets) * w)))(logits)
                 for f in (native.token_nll, token_nll))
    np.testing.assert_allclose(np.asarray(native.token_nll(logits, targets)), np.asarray(token_nll(logits, targets)),
                               rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=1e-6)
    assert np.allclose(np.asarray(got[1]).sum(-1), 0.0, atol=1e-5)  # softmax - onehot sums to 0 in a row


def test_the_float32_lora_step_runs_attention_and_the_loss_in_the_kernels(monkeypatch):
    """A float32 LoRA step on the CPU calls attention.cc forward and backward (one each, inside the layer
    scan) and cross_entropy.cc forward and backward, and its loss, gradient norm and updated LoRA weights
    equal the step that runs both in XLA."""
    from flax import nnx

    from amdllm import train
    from amdllm.config import LlamaConfig
    from amdllm.model import Llama, lora
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = lora.apply_lora(Llama(cfg, rngs=nnx.Rngs(0)), rank=4, alpha=8, targets="q,k,v,o,gate,up,down")
    rng = np.random.default_rng(0)
    seg = np.array([[1] * 20 + [2] * 8 + [0] * 4, [1] * 32])[None]
    batch = {"tokens": jnp.asarray(rng.integers(0, 96, (1, 2, 32))),
             "targets": jnp.asarray(rng.integers(0, 96, (1, 2, 32))),
             "weights": jnp.asarray(seg != 0, jnp.float32), "segment_ids": jnp.asarray(seg),
             "positions": jnp.asarray(np.broadcast_to(np.arange(32), (1, 2, 32)))}
    out = {}
    kernels = {"native": ["amdllm_attention_bwd", "amdllm_attention_fwd", "amdllm_cross_entropy_bwd",
                          "amdllm_cross_entropy_fwd"], "blocked": []}
    real = native.cross_entropy_available
    for impl in ("native", "blocked"):
        monkeypatch.setenv("AMDLLM_ATTENTION", impl)
        monkeypatch.setattr(native, "cross_entropy_available", real if impl == "native" else lambda: False)
        lo, frozen = train.split_params(model)
        opt, _ = train.make_optimizer(train.TrainConfig(steps=10, lr=1e-2, warmup=0))
        step = train.make_train_step(model, opt)
        state = opt.init(lo)
        hlo = step.lower(lo, state, frozen, batch, jax.random.key(0)).compile().as_text()
        calls = re.findall(r'custom_call_target="(amdllm_(?:attention|cross_entropy)_\w+)"', hlo)
        assert sorted(calls) == kernels[impl], calls
        out[impl] = step(jax.tree.map(jnp.copy, lo), jax.tree.map(jnp.copy, state), frozen, batch,
                         jax.random.key(0))  # copies: the step donates them
    (lo_n, _, m_n), (lo_b, _, m_b) = out["native"], out["blocked"]
    np.testing.assert_allclose(float(m_n["loss"]), float(m_b["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m_n["grad_norm"]), float(m_b["grad_norm"]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(lo_n), jax.tree.leaves(lo_b)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_materialized_is_a_copy_xla_cannot_fuse_through(monkeypatch):
    """`materialized` returns its input's bits through copy.cc (a custom call in the compiled HLO); with the
    kernels off it is the input itself."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5, 8)), jnp.float32)
    f = jax.jit(lambda a: native.materialized(jnp.cos(a)) * 2)
    assert 'custom_call_target="amdllm_copy_f32"' in f.lower(x).compile().as_text()
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(jax.jit(lambda a: jnp.cos(a) * 2)(x)))
    assert native.materialized(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16  # float32 only
    monkeypatch.setattr(native, "copy_available", lambda: False)
    assert native.materialized(x) is x
