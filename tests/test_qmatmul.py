"""The fused dequantizing matmuls (amdllm.model.qmatmul) against the reference, on the CPU.

The Pallas kernel runs in Pallas' interpreter here (the same kernel body a GPU runs), and is lowered
through Triton for CUDA and ROCm without a GPU (jax.export), so an op Triton cannot take fails here, not
on the lease. Expected values come from the reference dequantization (`quantized.dequantize`, itself
tested against the format spec in test_gptq_format.py) in float32.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amdllm import quant as gptq
from amdllm.io import checkpoint
from amdllm.io import gptq_format as qf
from amdllm.model import PROJECTIONS, forward, lora
from amdllm.model import qmatmul as Q
from amdllm.model.quantized import pack_cols, pack_rows
from amdllm import train
from tests.tiny import make_hf_checkpoint


def random_layer(K, N, bits, group_size, act_order, seed=0):
    """One layer's GPTQ tensors (v2 zeros) with random codes, zeros and scales; act-order shuffles g_idx."""
    r = np.random.default_rng(seed)
    G = K // group_size
    g = np.arange(K) // group_size
    if act_order:
        g = g[r.permutation(K)]
    return {"qweight": pack_rows(r.integers(0, 2 ** bits, (K, N)), bits),
            "qzeros": pack_cols(r.integers(0, 2 ** bits, (G, N)), bits),
            "scales": (r.random((G, N)) * 0.02 + 0.001).astype(np.float16), "g_idx": g.astype(np.int32)}


def reference(x, q):
    return np.asarray(Q.reference_matmul(jnp.asarray(x, jnp.float32), {k: jnp.asarray(v) for k, v in q.items()}))


CASES = [  # M, K, N, bits, group size, act-order: decode rows and prefill rows
    (1, 256, 128, 4, 128, False), (3, 512, 256, 4, 64, True), (16, 256, 64, 4, 32, True),
    (40, 256, 256, 4, 128, True), (2, 256, 128, 8, 32, False), (1, 256, 128, 2, 128, False),
    (5, 256, 128, 4, 256, False),    # per-channel: one group of all K rows
]


@pytest.mark.parametrize("M,K,N,bits,gs,act", CASES)
def test_pallas_kernel_equals_the_reference(M, K, N, bits, gs, act):
    q = random_layer(K, N, bits, gs, act)
    x = np.random.default_rng(1).standard_normal((M, K)).astype(np.float32)
    sorted_q, perm = Q.sort_act_order(q)
    assert (perm is not None) == act
    assert np.array_equal(sorted_q["g_idx"], np.arange(K) // gs)
    xs = x[:, perm] if act else x
    ref = reference(x, q)
    # the default split of K over programs, and none; decode rows also through the GEMV kernel
    for ks, gemv_rows in ((None, Q.GEMV_MAX_ROWS), (1, Q.GEMV_MAX_ROWS)) + (((None, M),) if M > 1 else ()):
        got = Q.pallas_matmul(jnp.asarray(xs), jnp.asarray(sorted_q["qweight"]), jnp.asarray(sorted_q["qzeros"]),
                              jnp.asarray(sorted_q["scales"]), bits=bits, group_size=Q.group_size_of(sorted_q),
                              k_splits=ks, gemv_rows=gemv_rows, interpret=True)
        assert got.shape == (M, N) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        # codes read as floats through 2^23's bits: the same products, bit for bit
        bits_read = Q.pallas_matmul(jnp.asarray(xs), jnp.asarray(sorted_q["qweight"]),
                                    jnp.asarray(sorted_q["qzeros"]), jnp.asarray(sorted_q["scales"]), bits=bits,
                                    group_size=Q.group_size_of(sorted_q), k_splits=ks, gemv_rows=gemv_rows,
                                    interpret=True, dequant="bits")
        np.testing.assert_array_equal(np.asarray(bits_read), np.asarray(got))
    # in half precision (what a GPU runs): to fp16 rounding of the inputs and the output
    got16 = Q.pallas_matmul(jnp.asarray(xs, jnp.float16), jnp.asarray(sorted_q["qweight"]),
                            jnp.asarray(sorted_q["qzeros"]), jnp.asarray(sorted_q["scales"]), bits=bits,
                            group_size=Q.group_size_of(sorted_q), interpret=True)
    ref16 = reference(x.astype(np.float16), q)
    np.testing.assert_allclose(np.asarray(got16, np.float32), ref16, rtol=2e-3, atol=2e-3 * np.abs(ref16).max())


@pytest.mark.parametrize("act", [False, True])
def test_int4_route_equals_the_reference(act):
    q = random_layer(512, 128, 4, 128, act, seed=2)
    x = np.random.default_rng(3).standard_normal((6, 512)).astype(np.float32)
    sorted_q, perm = Q.sort_act_order(q)
    q4 = Q.to_int4({k: jnp.asarray(v) for k, v in sorted_q.items()})
    assert q4["codes"].dtype == jnp.uint4 and q4["codes"].shape == (512, 128)
    got = Q.int4_matmul(jnp.asarray(x[:, perm] if act else x), q4)
    ref = reference(x, q)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_groups_that_cannot_be_put_in_order_are_refused():
    q = random_layer(256, 64, 4, 64, False)
    q["g_idx"] = np.zeros(256, np.int32)  # every row in group 0 of 4
    with pytest.raises(Q.QuantFormatError, match="group order"):
        Q.sort_act_order(q)
    with pytest.raises(ValueError, match="tile"):
        Q.plan_blocks(1, 256, 36, 4, 64)  # N has no power-of-two factor of 8 words


@pytest.mark.parametrize("M,K,N", [(1, 4096, 4096), (8, 14336, 4096), (256, 4096, 14336)])
def test_kernel_lowers_through_triton_for_cuda_and_rocm(M, K, N):
    """The Llama-3.1-8B shapes (decode rows, a batch of 8, a prefill block) lower to Triton IR for both GPU
    platforms: every op in the kernel has a Triton lowering rule (compiling that IR needs the GPU)."""
    from jax import export
    args = (jax.ShapeDtypeStruct((M, K), jnp.bfloat16), jax.ShapeDtypeStruct((K // 8, N), jnp.int32),
            jax.ShapeDtypeStruct((K // 128, N // 8), jnp.int32), jax.ShapeDtypeStruct((K // 128, N), jnp.float16))
    for dequant in Q.DEQUANT:
        f = jax.jit(lambda x, a, b, c: Q.pallas_matmul(x, a, b, c, bits=4, group_size=128, dequant=dequant))
        for platform in ("cuda", "rocm"):
            exp = export.export(f, platforms=[platform], disabled_checks=[
                export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
            assert "xla.gpu.triton" in exp.mlir_module()


def _act_order_model(tmp_path):
    ckpt, _ = make_hf_checkpoint(tmp_path, num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    model = checkpoint.load(ckpt)
    windows = np.random.default_rng(0).integers(0, 128, size=(8, 32))
    spec = gptq.QuantSpec(bits=4, group_size=32, sym=False, act_order=True)
    return gptq.quantize_model(model, windows, spec, progress=False)[0], spec


def test_prepared_models_give_the_references_logits_gradients_and_checkpoint(tmp_path):
    """A quantized act-order model prepared for each route: the same logits and LoRA gradients (QLoRA) as
    the reference route, and save_quantized writes the same checkpoint as before it was prepared.
    2 x 8 tokens: up to DECODE_ROWS rows run the Pallas kernel (more take the reference)."""
    from flax import nnx
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 128, size=(2, 8)))
    assert tokens.size <= Q.DECODE_ROWS
    model, spec = _act_order_model(tmp_path)
    untouched, for_int4 = nnx.clone(model), nnx.clone(model)
    qc = qf.quant_config_dict(4, 32, spec.sym, spec.act_order)
    before = gptq.save_quantized(model, tmp_path / "before", qc)

    def logits_and_grads(model):
        lora.apply_lora(model, rank=2, seed=1)
        lora.set_lora_params(model, {k: v + 0.05 for k, v in lora.lora_params(model).items() if k.endswith("_b")})
        lo, frozen = train.split_params(model)
        top = {k: v for k, v in frozen.items() if k != "layers"}
        f = lambda lo: forward(model.cfg, top, {**frozen["layers"], **lo}, tokens, run=model.run())[0]  # noqa: E731
        loss, g = jax.jit(jax.value_and_grad(lambda lo: jnp.mean(f(lo) ** 2)))(lo)
        return np.asarray(jax.jit(f)(lo)), float(loss), g

    ref, ref_loss, ref_g = logits_and_grads(untouched)
    pallas = Q.prepare_kernels(model, "pallas")
    assert pallas.layers.q_proj.perm[...].shape == (2, 64)  # act-order: a permutation per layer
    got, loss, g = logits_and_grads(pallas)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for k in ref_g:
        np.testing.assert_allclose(np.asarray(g[k]), np.asarray(ref_g[k]), rtol=1e-3,
                                   atol=1e-5 * np.abs(np.asarray(ref_g[k])).max())
    after = gptq.save_quantized(pallas, tmp_path / "after", qc)
    from safetensors.numpy import load_file
    a, b = load_file(before / "model.safetensors"), load_file(after / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    with pytest.raises(Q.QuantFormatError, match="groups in order"):
        Q.prepare_kernels(for_int4, "int4")


def test_int4_route_in_a_model(tmp_path):
    ckpt, _ = make_hf_checkpoint(tmp_path, num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    model = checkpoint.load(ckpt)
    windows = np.random.default_rng(0).integers(0, 128, size=(8, 32))
    spec = gptq.QuantSpec(bits=4, group_size=32, sym=True, act_order=False)
    model = gptq.quantize_model(model, windows, spec, progress=False)[0]
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 128, size=(2, 12)))
    ref = np.asarray(model(tokens)[0])
    Q.prepare_kernels(model, "int4")
    assert model.layers.up_proj.codes[...].dtype == jnp.uint4
    assert all(not hasattr(getattr(model.layers, p), "qweight") for p in PROJECTIONS)
    np.testing.assert_allclose(np.asarray(model(tokens)[0]), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_decoding_loads_a_gptq_model_for_the_default_route(tmp_path, monkeypatch):
    """`load_weights` prepares a GPTQ checkpoint for `default_route()` (the Pallas kernel on a GPU, the
    reference here); AMDLLM_QMATMUL chooses another, and greedy decoding gives the reference's tokens."""
    from amdllm.infer.generate import generate_ids, load_weights
    model, spec = _act_order_model(tmp_path)
    ckpt = gptq.save_quantized(model, tmp_path / "q", qf.quant_config_dict(4, 32, spec.sym, spec.act_order))
    assert Q.default_route() == "xla"
    plain = load_weights(ckpt, dtype="float32")
    assert not hasattr(plain.layers.q_proj, "perm")
    monkeypatch.setenv("AMDLLM_QMATMUL", "pallas")
    prepared = load_weights(ckpt, dtype="float32")
    assert prepared.layers.q_proj.perm[...].shape == (2, 64)
    prompts = [[5, 6, 7], [9, 10]]
    want = generate_ids(plain, prompts, 6, eos_ids=())
    assert generate_ids(prepared, prompts, 6, eos_ids=()) == want
    # the int4 route needs groups in order: an act-order model loads anyway, on the reference route, and says so
    monkeypatch.setenv("AMDLLM_QMATMUL", "int4")
    with pytest.warns(UserWarning, match=r"layers/\w+_proj: the int4 route needs groups in order.*reference route"):
        kept = load_weights(ckpt, dtype="float32")
    assert not hasattr(kept.layers.q_proj, "codes") and not hasattr(kept.layers.q_proj, "perm")
    assert generate_ids(kept, prompts, 6, eos_ids=()) == want
    monkeypatch.setenv("AMDLLM_QMATMUL", "cuda")
    with pytest.raises(ValueError, match="AMDLLM_QMATMUL='cuda': expected one of xla, pallas, int4"):
        Q.default_route()
