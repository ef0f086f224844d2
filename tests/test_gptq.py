"""GPTQ solver and calibration: against a PyTorch transcription of the reference loop, and against RTN."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from amdllm import quant as gptq
from amdllm.quant import GPTQError, QuantSpec, gptq_quantize, reconstruction_error, rtn_quantize


# ------------------------------------------------------------------------------------------------
# IST-DASLab gptq.py::fasterquant + quant.py::Quantizer, transcribed (torch, float32). `quirk_a`:
# group params are read from W (as the block starts), as the reference and GPTQModel do and we do;
# False reads them from W1 (the columns as the block's own updates left them).
# ------------------------------------------------------------------------------------------------
def ref_find_params(x, maxq, sym, mse=False, colw=None):
    tmp = torch.zeros(x.shape[0])
    xmin = torch.minimum(x.min(1)[0], tmp)
    xmax = torch.maximum(x.max(1)[0], tmp)
    if sym:
        xmax = torch.maximum(torch.abs(xmin), xmax)
        tmp = xmin < 0
        if torch.any(tmp):
            xmin[tmp] = -xmax[tmp]
    tmp = (xmin == 0) & (xmax == 0)
    xmin[tmp] = -1
    xmax[tmp] = +1
    scale = (xmax - xmin) / maxq
    # our first addition to the reference: scales are stored fp16, and we choose them as stored (see gptq.py)
    scale = torch.clamp(scale, min=6.2e-5).half().float()
    zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale)
    if mse:  # the reference's search: grid 100, maxshrink 0.8, norm 2.4; `colw` weighs each column (gptq.py)
        best = torch.full([x.shape[0]], float("inf"))
        for i in range(int(0.8 * 100)):
            p = 1 - i / 100
            xmin1, xmax1 = p * xmin, p * xmax
            scale1 = torch.clamp((xmax1 - xmin1) / maxq, min=6.2e-5).half().float()
            zero1 = torch.round(-xmin1 / scale1) if not sym else zero
            q = ref_quantize(x, scale1.unsqueeze(1), zero1.unsqueeze(1), maxq)
            err = torch.sum((q - x).abs().pow(2.4) * (1.0 if colw is None else colw), 1)
            tmp = err < best
            if torch.any(tmp):
                best[tmp], scale[tmp], zero[tmp] = err[tmp], scale1[tmp], zero1[tmp]
    return scale.unsqueeze(1), zero.unsqueeze(1)


def ref_quantize(x, scale, zero, maxq):
    q = torch.clamp(torch.round(x / scale) + zero, 0, maxq)
    return scale * (q - zero)


def ref_gar_perm(diag, groupsize):
    """GPTQModel 7.7's `gar` module, transcribed: within groups by decreasing diag, groups by their max."""
    local_vals, local = torch.sort(diag.view(-1, groupsize), dim=1, descending=True, stable=True)
    order = torch.argsort(local_vals[:, 0], descending=True, stable=True)
    return ((local + (torch.arange(local.shape[0]) * groupsize).view(-1, 1))[order]).reshape(-1)


def ref_fasterquant(W, H, bits, groupsize, sym, actorder, static_groups, percdamp=0.01, blocksize=128,
                    quirk_a=True, gar=False, mse=False):
    """gar: GPTQModel's act_group_aware, which permutes as actorder does, with its own order."""
    W = torch.tensor(np.asarray(W), dtype=torch.float32).clone()
    H = torch.tensor(np.asarray(H), dtype=torch.float32).clone()
    maxq = 2 ** bits - 1
    columns = W.shape[1]
    W_in = W.clone()
    scale, zero = ref_find_params(W, maxq, sym, mse)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    if static_groups:
        groups = [ref_find_params(W[:, i:i + groupsize], maxq, sym, mse) for i in range(0, columns, groupsize)]
    if actorder or gar:
        perm = (torch.argsort(torch.diag(H), descending=True, stable=True) if actorder
                else ref_gar_perm(torch.diag(H), groupsize))
        W = W[:, perm]
        H = H[perm][:, perm]
        invperm = torch.argsort(perm)
    Losses = torch.zeros_like(W)
    Q = torch.zeros_like(W)
    damp = percdamp * torch.mean(torch.diag(H))
    diag = torch.arange(columns)
    H[diag, diag] += damp
    H = torch.linalg.cholesky(H)
    H = torch.cholesky_inverse(H)
    H = torch.linalg.cholesky(H, upper=True)
    Hinv = H
    colw = colw0 = None
    if mse:  # our second addition: the search weighs column j's error by 1 / Hinv[j, j]^2.4, as the solve does
        colw = torch.diag(Hinv) ** -2.4
        colw0 = colw[invperm] if (actorder or gar) else colw
        if groupsize == -1:
            scale, zero = ref_find_params(torch.where(dead[None, :], 0.0, W_in), maxq, sym, mse, colw0)
        if static_groups:
            W0 = torch.where(dead[None, :], 0.0, W_in)
            groups = [ref_find_params(W0[:, i:i + groupsize], maxq, sym, mse, colw0[i:i + groupsize])
                      for i in range(0, columns, groupsize)]
    for i1 in range(0, columns, blocksize):
        i2 = min(i1 + blocksize, columns)
        count = i2 - i1
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Losses1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(count):
            w = W1[:, i]
            d = Hinv1[i, i]
            if groupsize != -1:
                if not static_groups:
                    if (i1 + i) % groupsize == 0:
                        src = W[:, (i1 + i):(i1 + i + groupsize)] if quirk_a else \
                            torch.cat([W1[:, i:], W[:, i2:]], 1)[:, :groupsize]
                        scale, zero = ref_find_params(src, maxq, sym, mse,
                                                      None if colw is None else colw[i1 + i:i1 + i + groupsize])
                else:
                    idx = i1 + i
                    if actorder:
                        idx = perm[idx]
                    scale, zero = groups[idx // groupsize]
            q = ref_quantize(w.unsqueeze(1), scale, zero, maxq).flatten()
            Q1[:, i] = q
            Losses1[:, i] = (w - q) ** 2 / d ** 2
            err1 = (w - q) / d
            W1[:, i:] -= err1.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
            Err1[:, i] = err1
        Q[:, i1:i2] = Q1
        W[:, i2:] -= Err1.matmul(Hinv[i1:i2, i2:])
    if actorder or gar:
        Q = Q[:, invperm]
    return Q.numpy()


def correlated_layer(N=48, K=256, n=2048, seed=0):
    """A layer whose inputs have strongly correlated, unevenly scaled features (like real activations)."""
    rng = np.random.default_rng(seed)
    mix = rng.normal(size=(K, K)) / math.sqrt(K) + np.eye(K)
    X = (rng.normal(size=(n, K)) * rng.uniform(0.2, 3.0, size=K)) @ mix
    W = (rng.normal(size=(N, K)) * 0.05).astype(np.float32)
    H = (2.0 / n) * (X.T @ X)
    return W, H.astype(np.float32)


CASES = [  # (bits, groupsize, sym, actorder, static_groups, act_group_aware[, mse])
    (4, 128, True, False, False, False),
    (4, -1, False, False, False, False),
    (4, 128, True, True, False, False),
    (4, 64, True, True, True, False),
    (8, 128, False, True, False, False),
    (3, 256, True, False, False, False),
    (4, 128, True, False, False, True),
    (4, 64, True, False, False, True),
    (3, 256, False, False, False, True),
    (4, 64, True, False, False, True, True),
    (4, 128, False, True, False, False, True),
    (4, -1, True, False, False, False, True),
]


@pytest.mark.parametrize("bits,G,sym,act,static,gar,mse", [c if len(c) == 7 else (*c, False) for c in CASES])
def test_matches_reference_loop(bits, G, sym, act, static, gar, mse):
    W, H = correlated_layer()
    spec = QuantSpec(bits=bits, group_size=G, sym=sym, act_order=act, static_groups=static, act_group_aware=gar,
                     mse=mse)
    ours = gptq_quantize(W, H, spec)
    ref = ref_fasterquant(W, H, bits, G, sym, act, static, gar=gar, mse=mse)
    step = np.abs(ref).max() / (2 ** bits - 1)
    np.testing.assert_allclose(ours.Q, ref, rtol=0, atol=1e-4 * step)  # same codes, float32 noise
    e_ours, e_ref = reconstruction_error(W, ours.Q, H), reconstruction_error(W, ref, H)
    assert abs(e_ours - e_ref) <= 2e-3 * e_ref
    assert abs(ours.err - e_ours) <= 1e-3 * e_ours  # the solve's own sum of e^2, less the dampening's part
    assert e_ours < reconstruction_error(W, rtn_quantize(W, spec).Q, H)


def test_the_grid_search_rounds_closer_than_the_full_range():
    """RTN with the reference's mse search: each group's grid rounds its weights with no more error
    (in the searched norm) than the full range does, and on heavy-tailed weights with less."""
    W = np.random.default_rng(3).standard_t(3, size=(64, 256)).astype(np.float32) * 0.02
    for G in (-1, 64):
        plain, searched = (rtn_quantize(W, QuantSpec(group_size=G, mse=m)) for m in (False, True))
        e = [np.abs(r.Q - W) ** 2.4 for r in (plain, searched)]
        rows = lambda a: a.reshape(64, -1, 256 if G == -1 else G).sum(-1)  # noqa: E731
        assert np.all(rows(e[1]) <= rows(e[0]) * (1 + 1e-5)) and e[1].sum() < 0.95 * e[0].sum()
        scales, ref = searched.scales, ref_find_params(torch.tensor(W[:, :256 if G == -1 else G]), 15, True, True)[0]
        np.testing.assert_allclose(scales[0], ref.numpy().ravel(), rtol=1e-6)  # the reference's choice


def test_small_groups_take_their_grid_at_the_block_start():
    """G=32 < block 128: a group's grid comes from W as it stands when its block starts (the
    reference's rule, and GPTQModel's), not from the columns the block's own updates have moved."""
    W, H = correlated_layer(seed=1)
    spec = QuantSpec(bits=4, group_size=32, sym=True, act_group_aware=False)
    ours = gptq_quantize(W, H, spec)
    at_start = ref_fasterquant(W, H, 4, 32, True, False, False, quirk_a=True)
    updated = ref_fasterquant(W, H, 4, 32, True, False, False, quirk_a=False)
    differs = lambda ref: np.mean(np.abs(ours.Q - ref) > 1e-6)  # noqa: E731
    # float32 noise may flip one rounding at a code boundary, and the feedback carries it along that row
    assert differs(at_start) < 0.02 and differs(updated) > 0.5, (differs(at_start), differs(updated))
    e_ours, e_ref = reconstruction_error(W, ours.Q, H), reconstruction_error(W, at_start, H)
    assert abs(e_ours - e_ref) <= 2e-3 * e_ref


@pytest.mark.parametrize("G,act,static", [(32, True, False), (128, False, False), (64, True, True), (-1, True, False)])
def test_packed_result_is_the_quantized_weight(G, act, static):
    """codes/scales/zeros/g_idx reproduce Q exactly (fp16 scales are chosen before quantizing)."""
    W, H = correlated_layer(seed=2)
    spec = QuantSpec(bits=4, group_size=G, act_order=act, static_groups=static)
    r = gptq_quantize(W, H, spec)
    deq = np.asarray(gptq.dequantize({k: jnp.asarray(v) for k, v in r.packed(4).items()}))  # [K, N]
    np.testing.assert_array_equal(deq.T, r.Q)
    if act and not static and G != -1:
        assert not np.all(np.diff(r.g_idx) >= 0)  # act-order really permutes the groups
    else:  # the group-aware order (on by default) keeps each group's columns: g_idx stays in order
        np.testing.assert_array_equal(r.g_idx, np.arange(W.shape[1]) // (G if G != -1 else W.shape[1]))
    rt = rtn_quantize(W, spec)
    assert reconstruction_error(W, r.Q, H) < 0.8 * reconstruction_error(W, rt.Q, H)


def test_dead_columns_and_auto_damp():
    W, H = correlated_layer(K=128, seed=3)
    H[5, :] = H[:, 5] = 0.0  # an input channel that never fires
    r = gptq_quantize(W, H, QuantSpec(group_size=-1))
    assert np.all(r.Q[:, 5] == 0) and r.damp == 0.01
    assert abs(r.err - reconstruction_error(W, r.Q, H)) <= 1e-3 * r.err  # a dead column adds nothing
    # indefinite H: fails at percdamp 0.01, must be raised (with a warning) until it factorises
    H2 = H - 0.015 * np.mean(np.diag(H)) * np.eye(128, dtype=np.float32)
    with pytest.warns(UserWarning, match="Cholesky failed"):
        r2 = gptq_quantize(W, H2, QuantSpec(group_size=-1))
    assert 0.01 < r2.damp <= 0.05 and np.all(np.isfinite(r2.Q))
    assert abs(r2.err - reconstruction_error(W, r2.Q, H2)) <= 1e-3 * abs(r2.err)  # the raised dampening's part


def test_bad_settings():
    with pytest.raises(GPTQError, match="bits=5"):
        QuantSpec(bits=5)
    with pytest.raises(GPTQError, match="group_size=48"):
        QuantSpec(group_size=48)
    W, H = correlated_layer(K=96)
    with pytest.raises(GPTQError, match="group_size 64 does not divide in_features 96"):
        gptq_quantize(W, H, QuantSpec(group_size=64))
    with pytest.raises(GPTQError, match="Hessian shape"):
        gptq_quantize(W, H[:64, :64], QuantSpec(group_size=32))
    with pytest.raises(ValueError, match="too few calibration tokens"):
        gptq.calibration_windows(np.arange(10), samples=4, seq_len=32)


def test_paper_bytes_13b_and_405b():
    from amdllm.config import get_preset
    from amdllm.quant.calibrate import devices_needed
    for name in ("vicuna-13b", "llama-2-13b"):
        fp = gptq.paper_bytes(get_preset(name), bits=16)["total_gb"]
        q = gptq.paper_bytes(get_preset(name), bits=4, group_size=128)["total_gb"]
        assert 25 < fp < 28.5 and 6.8 < q < 7.6, (fp, q)
    b405 = get_preset("llama-3.1-405b")
    fp, q = gptq.paper_bytes(b405, bits=16)["total_bytes"], gptq.paper_bytes(b405, 4, 128)["total_bytes"]
    assert 800e9 < fp < 820e9 and 200e9 < q < 225e9
    assert devices_needed(fp) == 5 and devices_needed(q) == 2


def test_capture_layer_is_the_model_layer():
    """The calibration forward (which also returns each projection's input) is the model's own layer."""
    from flax import nnx
    from amdllm import model as M
    from amdllm.config import LlamaConfig
    from amdllm.quant.calibrate import _rope_mask, layer_with_inputs
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    m = M.Llama(cfg, rngs=nnx.Rngs(0))
    _, layers = M.to_pure(m)
    p = {k: v[1] for k, v in layers.items()}
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    cos, sin, mask = _rope_mask(cfg, 2, 8)
    ours, ins = layer_with_inputs(cfg, p, x, cos, sin, mask)
    ref, _ = M.llama.block(cfg, p, x, (cos, sin), mask)  # the textbook block
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-6, atol=1e-6)
    h = M.rms_norm(x, p["input_layernorm"], cfg.rms_norm_eps)
    np.testing.assert_allclose(np.asarray(ins["attn_in"]), np.asarray(h), rtol=1e-6)
    assert ins["down_in"].shape == (2, 8, 64) and ins["o_in"].shape == (2, 8, 32)


@pytest.mark.parametrize("true_sequential", [True, False])
def test_calibration_hessians_match_a_plain_loop(monkeypatch, true_sequential):
    """quantize_model's passes (chunked, attention computed once per layer and reused by the later
    groups: `attention_plan`) hand each projection the Hessian of a plain loop: every group's inputs
    from the whole layer recomputed with the earlier groups already quantized, then the quantized
    layer's output fed to the next layer."""
    from flax import nnx
    from amdllm.quant import calibrate as C
    from amdllm import model as M
    from amdllm.config import LlamaConfig
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    m = M.Llama(cfg, rngs=nnx.Rngs(0))
    top, layers = jax.tree.map(np.asarray, M.to_pure(m))  # copies: quantize_model replaces the layers
    n, T = 10, 16  # one calibration batch of 8 and a remainder of 2
    windows = np.random.default_rng(0).integers(0, 64, size=(n, T))
    from amdllm.quant import gptq as solver  # the module calibration calls through
    seen, real = {}, solver.gptq_quantize

    def spy(W, H, spec, **kw):
        res = real(W, H, spec, **kw)
        seen[kw["where"]] = (np.asarray(H), np.asarray(res.Q))
        return res
    monkeypatch.setattr(solver, "gptq_quantize", spy)
    C.quantize_model(m, windows, QuantSpec(bits=4, group_size=32, true_sequential=true_sequential),
                     progress=False, report=False)
    assert len(seen) == 2 * 7
    x = jnp.asarray(top["embed_tokens"][windows])  # [n, T, D]
    cos, sin, mask = C._rope_mask(cfg, n, T)
    for li in range(2):
        p = {k: jnp.asarray(v[li]) for k, v in layers.items()}
        for grp in C.SEQUENTIAL if true_sequential else (M.PROJECTIONS,):
            ins = C.layer_with_inputs(cfg, p, x, cos, sin, mask)[1]
            for proj in grp:
                H_ours, Q = seen[f"layer {li} {proj}"]
                xin = np.asarray(ins[C.INPUT_OF[proj]], np.float64).reshape(n * T, -1)
                H = 2 * xin.T @ xin / (n * T)
                np.testing.assert_allclose(H_ours, H, rtol=1e-4, atol=1e-5 * np.abs(H).max(), err_msg=proj)
            for proj in grp:  # later groups see this one quantized
                p[proj] = jnp.asarray(seen[f"layer {li} {proj}"][1].T)
        x = C.layer_with_inputs(cfg, p, x, cos, sin, mask)[0]


def test_hessian_inverse_device_path_equals_host_lapack():
    """On an accelerator the factor is computed by XLA (the host LAPACK path, the CPU default, would
    factor Llama-13B-sized Hessians on one CPU thread): both give U with U^T U = (H + damp I)^-1."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((512, 96)).astype(np.float32)
    H = 2 * X.T @ X / 512
    U_host, p_host = gptq.hessian_inverse(H, 0.01, on_host=True)
    U_dev, p_dev = gptq.hessian_inverse(H, 0.01, on_host=False)
    assert p_host == p_dev == 0.01
    np.testing.assert_allclose(np.asarray(U_dev), np.asarray(U_host), rtol=2e-3, atol=2e-4)
    damped = H + 0.01 * np.mean(np.diag(H)) * np.eye(96, dtype=np.float32)
    U = np.asarray(U_dev, np.float64)
    np.testing.assert_allclose(U.T @ U @ damped, np.eye(96), atol=2e-3)
    assert np.allclose(np.tril(U, -1), 0)  # upper triangular
    # a singular Hessian: the device path retries with more dampening, as the host path does
    Hs = np.zeros((8, 8), np.float32); Hs[0, 0] = 1.0  # noqa: E702
    with pytest.raises(GPTQError, match="not positive definite"):
        gptq.hessian_inverse(Hs - np.eye(8, dtype=np.float32), 0.01, on_host=False)


def test_calibration_tokenizer_matches_transformers():
    """`amdllm quantize` reads tokenizer.json with `tokenizers` (no transformers import): same ids, BOS included."""
    from pathlib import Path

    from amdllm.io.tokenizer import encode_fast as _tokenize
    from amdllm.io.tokenizer import load_tokenizer
    d = Path(__file__).resolve().parents[1] / "data"
    text = (d / "corpus_heldout.txt").read_text()[:20000]
    want = np.asarray(load_tokenizer(d / "tokenizer")(text)["input_ids"])
    got = _tokenize(d / "tokenizer", text)
    assert got.shape == want.shape and (got == want).all()


def test_a_bfloat16_model_quantizes_as_its_float32_widening_and_keeps_bf16(tmp_path):
    """A bf16 model is held as bf16 (its layers go to the solver as bits, widened one layer at a time): the
    packed result is exactly the one of the same weights held in float32, and the checkpoint keeps the
    unquantized tensors in bf16 (float16 would turn values beyond its range into inf)."""
    from flax import nnx
    from safetensors.numpy import load_file
    from amdllm import model as M
    from amdllm.config import LlamaConfig
    from amdllm.io.gptq_format import quant_config_dict, save_quantized
    from amdllm.quant import calibrate as C
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    windows = np.random.default_rng(0).integers(1, 64, size=(10, 16))  # row 0 (set to 1e5 below) unused
    spec = QuantSpec(bits=4, group_size=32)
    out = {}
    for dt in (jnp.bfloat16, jnp.float32):
        m = M.Llama(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
        if dt == jnp.float32:  # the same bf16 values, widened
            m = nnx.merge(*(lambda g, s: (g, jax.tree.map(lambda a: a.astype(jnp.float32), s)))(*nnx.split(m)))
        else:
            m.embed_tokens.value = m.embed_tokens.value.at[0, 0].set(1e5)  # beyond float16's 65504
        C.quantize_model(m, windows, spec, progress=False, report=False)
        out[dt] = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(m.layers)))
        if dt == jnp.bfloat16:
            save_quantized(m, tmp_path / "q", quant_config_dict(4, 32, True, False))
            raw = (tmp_path / "q" / "model.safetensors").read_bytes()  # 8-byte header length, JSON header, data
            assert C.model_bytes(m) == len(raw) - 8 - int.from_bytes(raw[:8], "little")  # what quantize reports
    for proj in M.PROJECTIONS:
        for k in ("qweight", "qzeros", "scales", "g_idx"):
            np.testing.assert_array_equal(out[jnp.bfloat16][proj][k], out[jnp.float32][proj][k], err_msg=proj + k)
    t = load_file(tmp_path / "q" / "model.safetensors")
    assert t["model.embed_tokens.weight"].dtype.name == "bfloat16" and float(t["model.embed_tokens.weight"][0, 0]) > 65504  # finite, beyond f16
    assert t["model.layers.0.self_attn.q_proj.scales"].dtype == np.float16
    import json
    assert json.loads((tmp_path / "q" / "config.json").read_text())["torch_dtype"] == "bfloat16"
