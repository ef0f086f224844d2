"""The tile kernels (`amdllm.native.tiles_times`, `bf16_tiles.cc`: AMX tiles, or AVX-512 BF16's VDPBF16PS):
their products equal float64 sums of the same bf16 values in both layouts, at edge sizes and read from a
stack of layers in place; a LoRA step on a frozen bf16 base runs every base product on the kernel, reads
the stacked weights without slicing them, and gives the loss and LoRA gradients of XLA's bf16 dots. Each
kind is tested where the CPU has it (AMX: Intel Sapphire Rapids and later; AVX-512 BF16: AMD Zen 4 and
later, Intel Cooper Lake and later, AMX CPUs included); elsewhere the tests are skipped, saying so, and
`tiles_kind()` must be None there."""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from amdllm import native
from amdllm.cpu import cpu_flags
from amdllm.model import narrow

KINDS = native.tiles_kinds_of(cpu_flags())  # the faster first
needs_tiles = pytest.mark.skipif(not KINDS, reason="this CPU has neither AMX nor AVX-512 BF16: no tile kernel here")
each_kind = pytest.mark.parametrize("kind", KINDS or ["none"])
TARGETS = {name for by_layout in native.TILES_TARGETS.values() for name in by_layout.values()}


def test_the_kernel_is_the_fastest_this_cpu_has():
    assert native.tiles_kind() == (KINDS[0] if KINDS else None)
    assert native.tiles_kinds_of(["avx2", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"]) == ["amx", "avx512_bf16"]
    assert native.tiles_kinds_of(["avx2", "avx512bw", "avx512_bf16"]) == ["avx512_bf16"]
    assert native.tiles_kinds_of(["avx2", "avx512bw"]) == []


@needs_tiles
@each_kind
@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (5, 7, 3), (13, 33, 47), (33, 65, 47), (64, 96, 8550 // 50),
                                   (256, 2048, 512), (40, 4160, 70), (33, 4111, 47)])
def test_tiles_times_equals_float64_sums_of_the_bf16_values(kind, M, K, N):
    # K a multiple of 32 or not (AMX's nk product reads W where it lies only then); K over 2048 (AMX runs K
    # in chunks of 2048 and adds each chunk's sums to the last's); M and N off the 32-block edges
    rng = np.random.default_rng(M + K + N)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    for transposed in (False, True):
        w = jnp.asarray(rng.standard_normal((N, K) if transposed else (K, N)), jnp.bfloat16)
        want = np.asarray(x, np.float64) @ (np.asarray(w, np.float64).T if transposed else np.asarray(w, np.float64))
        got = jax.jit(native.tiles_times, static_argnums=(2, 4))(x, jax.lax.bitcast_convert_type(w, jnp.uint16),
                                                                 transposed, None, kind)
        assert got.shape == (M, N) and got.dtype == jnp.float32
        # float32 sums of exact bf16 products: float32 rounding of K terms
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-6 * np.sqrt(K) * np.abs(want).max() + 1e-7)


@needs_tiles
@each_kind
@pytest.mark.parametrize("out", [40, 96])  # W^T's K off 32 (packed) and a multiple of 32 (read where it lies)
def test_a_stack_is_read_in_place_at_the_layer_index(kind, out):
    rng = np.random.default_rng(1)
    stack = jnp.asarray(rng.standard_normal((3, 64, out)), jnp.bfloat16)
    bits = jax.lax.bitcast_convert_type(stack, jnp.uint16)
    x = jnp.asarray(rng.standard_normal((70, 64)), jnp.bfloat16)
    run = jax.jit(lambda x, b, i: native.tiles_times(x, b, False, i, kind))
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(run(x, bits, i)),
                                      np.asarray(native.tiles_times(x, bits[i], kind=kind)))
    # the backward's layout on the same stack: x [M, N] . W[i]^T
    y = jnp.asarray(rng.standard_normal((70, out)), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(native.tiles_times(y, bits, True, 2, kind)),
                                  np.asarray(native.tiles_times(y, bits[2].T.copy(), False, kind=kind)))


def tiles_calls(fn, *args) -> list:
    """The tile kernel's calls in fn's jaxpr (nested ones included): each call's weight operand's shape."""
    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "ffi_call" and e.params["target_name"] in TARGETS:
                yield e.invars[1].aval.shape
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                yield from walk(sub)
    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


@needs_tiles
def test_a_lora_step_on_a_bf16_base_runs_on_tiles_reading_the_stack_in_place(monkeypatch):
    from amdllm.train.step import loss_fn
    from tests.test_fast import bf16_lora_model, bits_step_inputs
    m = bf16_lora_model()
    trained, frozen, batch = bits_step_inputs(m)
    grad = lambda tr: jax.value_and_grad(lambda t: loss_fn(t, frozen, batch, model=m))(tr)  # noqa: E731
    shapes = tiles_calls(grad, trained)
    L = m.cfg.num_hidden_layers
    stacked = [s for s in shapes if len(s) == 3]
    # 7 projections, forward and backward, each on the [L, in, out] stack (no slice); the head's blocks 2-D
    assert len(stacked) >= 2 * 7 and all(s[0] == L for s in stacked), shapes
    loss, g = jax.jit(grad)(trained)
    monkeypatch.setattr(native, "tiles_available", lambda: False)  # XLA's bf16 dots, slices and all
    jax.clear_caches()  # custom_vjp functions' traces are cached
    assert not tiles_calls(grad, trained)
    loss0, g0 = jax.jit(grad)(trained)
    # the same bf16 products with float32 sums: only the order of the sums differs
    assert abs(float(loss) - float(loss0)) <= 1e-5 * abs(float(loss0))
    for k in g0:
        np.testing.assert_allclose(np.asarray(g[k]), np.asarray(g0[k]), rtol=0,
                                   atol=1e-3 * float(jnp.abs(g0[k]).max()), err_msg=k)
    jax.clear_caches()


def test_without_amx_or_avx512_bf16_the_kernel_is_off_quietly(monkeypatch):
    import warnings
    monkeypatch.setattr(native, "cpu_flags", lambda: ["avx2", "avx512bw"])
    native.tiles_kind.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert native.tiles_kind() is None and not native.tiles_available()
        scanned, at = narrow.hold_stacked({"w": narrow.Bits(jnp.zeros((2, 8, 16), jnp.uint16), jnp.bfloat16)})
        assert "w" in scanned and at(0) == {}  # the scan slices as before
    finally:
        native.tiles_kind.cache_clear()
