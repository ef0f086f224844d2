"""The CPU backend (amdllm.backends.cpu) and its seam (amdllm.backends): per-layer views share the stacked
weights' memory, the row kernel computes the widened product, and decoding (generate, the server's engine)
gives the same tokens with the backend on as the core alone gives, which transformers checks elsewhere
(tests/test_generate.py). The backend's module is called directly, so these run with AMDLLM_BACKEND=off
too; the row kernel's tests need a C++ compiler and say so where there is none."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from amdllm import backends
from amdllm.backends import cpu
from amdllm.backends.cpu import native, toolchain
from amdllm.config import LlamaConfig
from amdllm.model import Llama, narrow, to_pure

CFG = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=True, eos_token_id=None)
PROMPTS = [[1, 5, 9, 22, 17], [1, 40], [1, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]


def has_compiler() -> bool:
    return toolchain.compiler() is not None and __import__("platform").system() == "Linux"


needs_kernel = pytest.mark.skipif(not has_compiler(), reason="the row kernel needs a C++ compiler on Linux")


def model(dtype=jnp.float32, cfg=CFG):
    return Llama(cfg, rngs=nnx.Rngs(0), param_dtype=dtype, dtype=dtype)


@pytest.fixture
def backend_on(monkeypatch):
    monkeypatch.setattr(backends, "active", lambda: cpu)


@pytest.fixture
def backend_off(monkeypatch):
    monkeypatch.setattr(backends, "active", lambda: None)


def test_views_share_the_stacked_memory():
    top, layers = to_pure(model())
    views = cpu._views(layers)
    assert views is not None and len(views) == CFG.num_hidden_layers
    for name, stacked in layers.items():
        per = stacked[0].size * stacked.dtype.itemsize
        for i, v in enumerate(views):
            assert v[name].unsafe_buffer_pointer() == stacked.unsafe_buffer_pointer() + i * per, name
            np.testing.assert_array_equal(np.asarray(v[name]), np.asarray(stacked[i]))
    bits = narrow.carry_bits({"w": jnp.arange(4 * 8 * 16, dtype=jnp.bfloat16).reshape(4, 8, 16)})
    v = cpu._views(bits)
    assert v[3]["w"].bits.unsafe_buffer_pointer() == bits["w"].bits.unsafe_buffer_pointer() + 3 * 8 * 16 * 2


def test_prepare_per_dtype():
    """float32: per-layer views for steps and prefills; GPTQ words and bf16 arrays that are not bits: the
    stack (unrolled, XLA would widen or dequantize every layer up front)."""
    top, layers = narrow.inference_weights(*to_pure(model()))
    t, step, max_rows = cpu.prepare(top, layers, rows=8)
    assert isinstance(step, list) and max_rows >= 1 << 20 and t is top
    gptq_like = {**layers, "q_proj": {"qweight": jnp.zeros((3, 8, 64), jnp.int32)}}
    assert cpu.prepare(top, gptq_like, rows=1)[1] is gptq_like


@needs_kernel
def test_prepare_bf16_bits_for_the_row_kernel():
    top, layers = narrow.inference_weights(*to_pure(model(jnp.bfloat16)))
    t, step, max_rows = cpu.prepare(top, layers, rows=4)
    assert isinstance(step, list) and max_rows == cpu.PREFILL_MAX_ROWS
    assert isinstance(step[1]["gate_proj"], cpu.RowBits) and narrow.is_bits(step[1]["input_layernorm"])
    assert step[1]["gate_proj"].bits.unsafe_buffer_pointer() == (
        layers["gate_proj"].bits.unsafe_buffer_pointer() + layers["gate_proj"].bits[0].size * 2)
    assert isinstance(t["lm_head"], cpu.RowBits) and t["lm_head"].transposed  # the tied head, read as [V, D]
    assert cpu.prepare(top, layers, rows=native.MAX_ROWS + 1)[1] is layers  # too many rows: the scan


@needs_kernel
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8, 33, native.MAX_ROWS, native.MAX_ROWS + 5])
def test_row_kernel_equals_the_widened_product(rows, transposed):
    """float32 sums of bf16 weights widened exactly: the float32 product of the widened matrix, to rounding;
    past MAX_ROWS `RowBits` widens and lets XLA multiply."""
    K, N = 96, 200
    w = jax.random.normal(jax.random.key(0), (N, K) if transposed else (K, N)).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (rows, K))
    bits = jax.lax.bitcast_convert_type(w, jnp.uint16)
    got = jax.jit(lambda x, b: cpu.RowBits(b, transposed).matmul(x))(x, bits)
    wide = w.astype(jnp.float32)
    want = x @ (wide.T if transposed else wide)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


def decode(m, backend_fixture_on: bool, monkeypatch, **kw):
    from amdllm.infer.generate import Decoder
    monkeypatch.setattr(backends, "active", (lambda: cpu) if backend_fixture_on else (lambda: None))
    return list(Decoder(m, eos_ids=(), **kw).stream(PROMPTS, 12, return_logits=True))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_generate_with_the_backend_gives_the_core_tokens(monkeypatch, dtype):
    """Greedy ids and logits with the backend (views; for bf16 the row kernel) against the core's scan."""
    if dtype == jnp.bfloat16 and not has_compiler():
        pytest.skip("the row kernel needs a C++ compiler on Linux")
    m = model(dtype)
    on, off = decode(m, True, monkeypatch), decode(m, False, monkeypatch)
    assert [s[0] for s in on] == [s[0] for s in off]
    tol = 2e-5 if dtype == jnp.float32 else 5e-2  # bf16: float32 sums in the kernel, bf16 in XLA's products
    for (_, a), (_, b) in zip(on, off):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol, rtol=0)


def test_engine_with_the_backend_gives_generates_tokens(monkeypatch):
    """The server's engine over per-layer views and a per-layer cache: generate's greedy tokens."""
    import threading
    from amdllm.infer.engine import Engine, Request
    from amdllm.infer.generate import generate_ids
    from amdllm.io.tokenizer import load_tokenizer
    monkeypatch.setattr(backends, "active", lambda: cpu)
    m = model()
    want = generate_ids(m, PROMPTS, 10, eos_ids=())
    eng = Engine(m, load_tokenizer("data/tokenizer"), max_batch=4, eos_ids=())
    try:
        assert eng.per_layer and isinstance(eng.cache.k, tuple)
        got, done = {}, [threading.Event() for _ in PROMPTS]

        def emit(i):
            return lambda kind, v: (got.__setitem__(i, v), done[i].set()) if kind != "delta" else None
        for i, p in enumerate(PROMPTS):
            eng.submit(Request(list(p), 10, emit(i), temperature=0.0))
        for e in done:
            assert e.wait(120)
        assert [got[i]["token_ids"] for i in range(len(PROMPTS))] == want
    finally:
        eng.stop()


def test_compiler_options_for_small_models_only():
    assert cpu.compiler_options("decode", 512) == {"xla_cpu_use_xnnpack": False,
                                                    "xla_cpu_experimental_ynn_fusion_type": ""}
    assert cpu.compiler_options("decode", cpu.SMALL_HIDDEN) is None
    assert cpu.compiler_options("train", 512) is None


def test_the_seam_off_and_on(backend_off):
    top, layers = to_pure(model())
    w = backends.prepare(top, layers, rows=1)
    assert not w.per_layer and w.for_rows(10 ** 6) is w.layers
    assert backends.compiler_options("decode", 64) is None and backends.describe() == {"backend": "none"}
    assert backends.decodes_bf16() is False  # a CPU without the backend decodes bf16 checkpoints in float32


def test_the_backend_is_on_by_default_and_off_by_name(monkeypatch):
    backends.active.cache_clear()
    try:
        monkeypatch.setenv("AMDLLM_BACKEND", "off")
        assert backends.active() is None
        backends.active.cache_clear()
        monkeypatch.delenv("AMDLLM_BACKEND")
        assert backends.active() is cpu  # JAX runs on the CPU here
    finally:
        backends.active.cache_clear()


def test_a_kernel_that_cannot_build_says_so_once_and_decodes_bf16_stacked(monkeypatch, tmp_path):
    """No compiler: one warning naming what is off, `available()` False, and bf16 weights stay stacked
    (the scan), so decoding still works (slower)."""
    monkeypatch.setattr(toolchain, "compiler", lambda: None)
    monkeypatch.setenv("AMDLLM_CACHE", str(tmp_path))  # no library built earlier
    native.available.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert native.available() is False
            assert native.available() is False  # cached: once
        assert len(caught) == 1 and "row kernel is off" in str(caught[0].message) and "compiler" in str(caught[0].message)
        top, layers = narrow.inference_weights(*to_pure(model(jnp.bfloat16)))
        assert cpu.prepare(top, layers, rows=1)[1] is layers and cpu.decodes_bf16() is False
    finally:
        native.available.cache_clear()
