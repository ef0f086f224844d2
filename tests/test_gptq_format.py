"""GPTQ on disk: packing, interop with the format as GPTQModel/AutoGPTQ write it, the quantize CLI, errors.

Every expected value here is computed from the format spec (docs/formats.md) by code written
in this file, independently of amdllm.io.gptq_format.
"""
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from flax import nnx

from amdllm.io import checkpoint
from amdllm import quant as gptq
from amdllm.io import gptq_format as qf
from amdllm import train
from amdllm.model import PROJECTIONS, forward, lora
from amdllm.parallel import sharding as S
from amdllm.io.gptq_format import QuantFormatError
from amdllm.model.quantized import pack_cols, pack_rows, unpack_cols, unpack_rows
from tests.tiny import hf_logits, make_hf_checkpoint

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def spec_pack_rows(codes, bits):  # qweight[r, n] = sum_j (q[p*r + j, n] & mask) << (bits*j)
    p = 32 // bits
    K, N = codes.shape
    out = np.zeros((K // p, N), np.uint64)
    for j in range(p):
        out |= (codes[j::p].astype(np.uint64) & (2 ** bits - 1)) << np.uint64(bits * j)
    return out.astype(np.uint32).view(np.int32)


def spec_unpack_rows(packed, bits):
    p = 32 // bits
    u = packed.view(np.uint32).astype(np.uint64)
    out = np.zeros((u.shape[0] * p, u.shape[1]), np.int64)
    for j in range(p):
        out[j::p] = (u >> np.uint64(bits * j)) & (2 ** bits - 1)
    return out


def spec_dequant(qweight, qzeros, scales, g_idx, bits, fmt):
    """W^T[k, n] = scales[g[k], n] * (q[k, n] - z[g[k], n]); v1 stores z - 1."""
    q = spec_unpack_rows(qweight, bits)
    z = spec_unpack_rows(np.ascontiguousarray(qzeros.T), bits).T
    if fmt == "gptq":
        z = (z + 1) & (2 ** bits - 1)
    return scales.astype(np.float32)[g_idx] * (q - z[g_idx]).astype(np.float32)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_exact(bits):
    for G in (-1, 32, 64, 128):
        _check_pack(bits, G)


def _check_pack(bits, G):
    rng = np.random.default_rng(bits * 1000 + G)
    K, N = 256, 64
    codes = rng.integers(0, 2 ** bits, size=(K, N))
    qw = pack_rows(codes, bits)
    assert qw.dtype == np.int32 and qw.shape == (K * bits // 32, N)
    np.testing.assert_array_equal(qw, spec_pack_rows(codes, bits))
    np.testing.assert_array_equal(np.asarray(unpack_rows(qw, bits)), codes)
    ng = 1 if G == -1 else K // G
    zeros = rng.integers(0, 2 ** bits, size=(ng, N))
    qz = pack_cols(zeros, bits)
    assert qz.shape == (ng, N * bits // 32)
    np.testing.assert_array_equal(np.asarray(unpack_cols(qz, bits)), zeros)
    # act-order: a permuted g_idx; dequantize inside jit equals the spec formula
    g_idx = rng.permutation(np.arange(K) // (K if G == -1 else G)).astype(np.int32)
    scales = rng.uniform(0.001, 0.05, size=(ng, N)).astype(np.float16)
    q = {"qweight": jnp.asarray(qw), "qzeros": jnp.asarray(qz), "scales": jnp.asarray(scales),
         "g_idx": jnp.asarray(g_idx)}
    expect = spec_dequant(qw, qz, scales, g_idx, bits, "gptq_v2")
    np.testing.assert_allclose(np.asarray(jax.jit(gptq.dequantize)(q)), expect, rtol=1e-6)
    x = rng.normal(size=(3, K)).astype(np.float32)
    f = jax.jit(lambda x, q: gptq.quantized_matmul(x, q, jnp.float32))
    np.testing.assert_allclose(np.asarray(f(x, q)), x @ expect, rtol=1e-4, atol=1e-5)
    # a compiler property is the point: the packed int32 words themselves go into the computation
    assert "s32[%d,%d]" % qw.shape in f.lower(x, q).as_text(dialect="hlo")


def _tiny(tmp_path, **kw):
    return make_hf_checkpoint(tmp_path, num_hidden_layers=2, hidden_size=64, intermediate_size=128, **kw)


def _quantized_tiny(tmp_path, spec):
    ckpt, hf = _tiny(tmp_path)
    model = checkpoint.load(ckpt)
    windows = np.random.default_rng(0).integers(0, 128, size=(8, 32))
    model, rows = gptq.quantize_model(model, windows, spec, progress=False)
    return ckpt, hf, model, rows


@pytest.mark.parametrize("sym,act", [(True, True), (False, False)])
def test_our_checkpoint_is_the_format(tmp_path, sym, act):
    spec = gptq.QuantSpec(bits=4, group_size=32, sym=sym, act_order=act)
    ckpt, hf, model, rows = _quantized_tiny(tmp_path, spec)
    assert len(rows) == 14 and sum(r["gptq_err"] for r in rows) < sum(r["rtn_err"] for r in rows)
    qc = qf.quant_config_dict(4, 32, sym, act)
    out = gptq.save_quantized(model, tmp_path / "q", qc)
    fmt = "gptq" if sym else "gptq_v2"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["checkpoint_format"] == fmt
    assert json.loads((out / "quantize_config.json").read_text())["bits"] == 4
    t = load_file(out / "model.safetensors")
    expect = {"model.embed_tokens.weight": ((128, 64), np.float16), "model.norm.weight": ((64,), np.float16),
              "lm_head.weight": ((128, 64), np.float16)}
    for i in range(2):
        for nm in ("input_layernorm", "post_attention_layernorm"):
            expect[f"model.layers.{i}.{nm}.weight"] = ((64,), np.float16)
        for proj in PROJECTIONS:
            K, N = (128, 64) if proj == "down_proj" else (64, 128) if proj in ("gate_proj", "up_proj") else (64, 64)
            if proj in ("k_proj", "v_proj"):
                N = 32  # 2 kv heads x 16
            base = f"model.layers.{i}.{'self_attn' if proj in ATTN else 'mlp'}.{proj}"
            expect.update({base + ".qweight": ((K // 8, N), np.int32), base + ".qzeros": ((K // 32, N // 8), np.int32),
                           base + ".scales": ((K // 32, N), np.float16), base + ".g_idx": ((K,), np.int32)})
    assert {k: (v.shape, v.dtype) for k, v in t.items()} == expect
    if sym:  # symmetric 4-bit v1: every zero stored as 8-1 = 7
        assert np.all(t["model.layers.0.self_attn.q_proj.qzeros"] == 0x77777777)
    layers = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model.layers)))
    for i in range(2):
        for proj in PROJECTIONS:
            base = f"model.layers.{i}.{'self_attn' if proj in ATTN else 'mlp'}.{proj}"
            mine = np.asarray(gptq.dequantize({k: v[i] for k, v in layers[proj].items()}))
            formula = spec_dequant(t[base + ".qweight"], t[base + ".qzeros"], t[base + ".scales"],
                                   t[base + ".g_idx"], 4, fmt)
            np.testing.assert_array_equal(formula, mine)
    # reload through checkpoint.load: same logits as the in-memory quantized model
    back = checkpoint.load(out)
    tokens = np.random.default_rng(1).integers(0, 128, size=(2, 16))
    a, _ = model(jnp.asarray(tokens))
    b, _ = back(jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-2)  # embeddings/norms fp16 on disk


def _write_gptqmodel_style(tmp_path, hf, fmt, sym, rng):
    """A checkpoint as GPTQModel writes it, from the spec: random codes/scales/zeros, act-order g_idx."""
    bits, G = 4, 32
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    t, dense = {}, {}
    for k, v in sd.items():
        if not k.endswith("_proj.weight"):
            t[k] = v.astype(np.float16)
            continue
        base = k[:-len(".weight")]
        N, K = v.shape
        ng = K // G
        codes = rng.integers(0, 16, size=(K, N))
        z = np.full((ng, N), 8) if sym else rng.integers(0, 16, size=(ng, N))
        scales = (np.abs(v).max() / 8 * rng.uniform(0.5, 1.0, size=(ng, N))).astype(np.float16)
        g_idx = rng.permutation(np.arange(K) // G).astype(np.int32)
        stored = (z - 1) & 15 if fmt == "gptq" else z  # "mislabelled": v2 zeros under the "gptq" label
        t[base + ".qweight"] = spec_pack_rows(codes, bits)
        t[base + ".qzeros"] = np.ascontiguousarray(spec_pack_rows(np.ascontiguousarray(stored.T), bits).T)
        t[base + ".scales"] = scales
        t[base + ".g_idx"] = g_idx
        dense[k] = (scales.astype(np.float32)[g_idx] * (codes - z[g_idx])).T  # HF [N, K]
    out = tmp_path / f"gptqmodel_{fmt}"
    out.mkdir()
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf.config.to_dict()
    qc = {"bits": 4, "group_size": G, "desc_act": True, "sym": sym, "lm_head": False, "quant_method": "gptq",
          "checkpoint_format": "gptq" if fmt == "mislabelled" else fmt, "pack_dtype": "int32", "meta": {"quantizer": ["gptqmodel:7.7.0"]}}
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "quantize_config.json").write_text(json.dumps(qc))
    return out, dense


@pytest.mark.parametrize("fmt,sym", [("gptq", True), ("gptq_v2", False), ("gptq_v2", True), ("mislabelled", True)])
def test_loads_gptqmodel_checkpoints(tmp_path, fmt, sym):
    _, hf = _tiny(tmp_path)
    out, dense = _write_gptqmodel_style(tmp_path, hf, fmt, sym, np.random.default_rng(5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = checkpoint.load(out)
    assert any("v2 zeros" in str(w.message) for w in caught) == (fmt == "mislabelled")
    layers = nnx.to_pure_dict(nnx.state(model.layers))
    for k, w in dense.items():
        i, proj = int(k.split(".")[2]), k.split(".")[-2]
        got = np.asarray(gptq.dequantize({n: a[i] for n, a in layers[proj].items()}))
        np.testing.assert_array_equal(got, w.T)
    # transformers with the dequantized weights (fp16-rounded like the checkpoint) gives our logits
    with torch.no_grad():
        for k, p in hf.state_dict().items():
            p.copy_(torch.from_numpy(dense[k] if k in dense else p.numpy().astype(np.float16).astype(np.float32)))
    tokens = np.random.default_rng(2).integers(0, 128, size=(2, 12))
    ours, _ = model(jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(ours), hf_logits(hf, tokens), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("spec,rules", [("fsdp=8", "fsdp"), ("fsdp=4,tensor=2", "fsdp_tp")])
def test_act_order_checkpoint_on_a_mesh_gives_one_devices_logits_and_lora_gradients(tmp_path, spec, rules):
    """A GPTQModel act-order checkpoint loaded split over a mesh (packed words, g_idx, scales and zeros placed
    by the rules) gives one device's logits, and the same LoRA gradients through the packed matmul (QLoRA)."""
    _, hf = _tiny(tmp_path)
    out, _ = _write_gptqmodel_style(tmp_path, hf, "gptq", True, np.random.default_rng(7))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 128, size=(8, 12)))

    def logits_and_grads(mesh):
        model = checkpoint.load(out, mesh=mesh, rules=rules)
        lora.apply_lora(model, rank=2, seed=1, place=None if mesh is None else S.placement(mesh, rules))
        lora.set_lora_params(model, {k: v + 0.05 for k, v in lora.lora_params(model).items() if k.endswith("_b")})
        lo, frozen = train.split_params(model)
        top = {k: v for k, v in frozen.items() if k != "layers"}
        f = lambda lo: forward(model.cfg, top, {**frozen["layers"], **lo}, tokens, run=model.run())[0]  # noqa: E731
        loss, g = jax.jit(jax.value_and_grad(lambda lo: jnp.mean(f(lo) ** 2)))(lo)
        return model, np.asarray(jax.jit(f)(lo)), float(loss), {k: np.asarray(v) for k, v in g.items()}

    _, ref, ref_loss, ref_g = logits_and_grads(None)
    model, got, loss, g = logits_and_grads(S.make_mesh(spec))
    assert model.layers.gate_proj.qweight[...].sharding.spec == S.logical_to_spec(
        ("layers", "embed", "mlp"), rules, mesh=S.make_mesh(spec))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for k in ref_g:
        np.testing.assert_allclose(g[k], ref_g[k], rtol=1e-3, atol=1e-5 * np.abs(ref_g[k]).max())


def test_bad_checkpoints(tmp_path):
    _, hf = _tiny(tmp_path)
    out, _ = _write_gptqmodel_style(tmp_path, hf, "gptq", True, np.random.default_rng(6))
    cfg = json.loads((out / "config.json").read_text())

    def with_config(**qc):
        c = json.loads(json.dumps(cfg))
        c["quantization_config"].update(qc)
        (out / "config.json").write_text(json.dumps(c))

    with_config(checkpoint_format="gptq_marlin")
    with pytest.raises(QuantFormatError, match="checkpoint_format 'gptq_marlin' is unknown"):
        checkpoint.load(out)
    with_config(bits=3)
    with pytest.raises(QuantFormatError, match="bits=3 is not supported"):
        checkpoint.load(out)
    with_config(quant_method="awq")
    with pytest.raises(QuantFormatError, match="quant_method 'awq'"):
        checkpoint.load(out)
    with_config(bits=8)  # qweight packed for 4 bits
    with pytest.raises(QuantFormatError, match="implies 4 bits but the quantization config says bits=8"):
        checkpoint.load(out)
    with_config()
    t = load_file(out / "model.safetensors")
    t["model.layers.1.mlp.down_proj.scales"] = t["model.layers.1.mlp.down_proj.scales"][:2]
    save_file(t, str(out / "model.safetensors"))
    with pytest.raises(QuantFormatError, match=r"model.layers.1.mlp.down_proj.scales has shape \(2, 64\), "
                                               r"expected \(4, 64\)"):
        checkpoint.load(out)


def test_quantize_cli_then_eval(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from amdllm import cli
    ckpt, _ = _tiny(tmp_path, vocab_size=320)
    text = " ".join(f"the cat {i % 7} sat on the mat {i % 5} and ran" for i in range(400))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(ckpt / "tokenizer.json"))
    (tmp_path / "calib.txt").write_text(text)
    out = tmp_path / "q"
    rc = cli.main(["quantize", "--model", str(ckpt), "--out", str(out), "--calib", str(tmp_path / "calib.txt"),
                   "--samples", "8", "--seq-len", "32", "--group-size", "32", "--act-order", "--compare-rtn", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["format"] == "gptq" and res["gptq_err"] < res["rtn_err"]
    assert (out / "tokenizer.json").is_file() and (out / "gptq_report.json").is_file()
    assert isinstance(checkpoint.load(out).layers.q_proj, gptq.QuantLinear)
    (tmp_path / "heldout.txt").write_text(text[:600])
    assert cli.main(["eval", "--model", str(out), "--text", str(tmp_path / "heldout.txt"), "--seq-len", "32",
                     "--json"]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["tokens"] > 10 and 1.0 < ev["perplexity"] < 1000
    assert cli.main(["generate", "--model", str(out), "--prompt", "the cat", "--max-new-tokens", "4", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) >= 1
    bad = ["quantize", "--model", str(ckpt), "--out", str(tmp_path / "bad"), "--calib", str(tmp_path / "calib.txt")]
    assert cli.main(bad + ["--samples", "1", "--seq-len", "16", "--group-size", "32", "--json"]) == 2
    assert "too few calibration tokens: 1 x 16 = 16; need at least 128 (and 256" in capsys.readouterr().err
    assert cli.main(bad + ["--json"]) == 2  # default group size 128 on in_features 64
    err = capsys.readouterr().err  # the sizes at fault, and the flag value that would work
    assert "--group-size 128 does not divide the in_features [64, 128]" in err and "pass --group-size 64" in err
    assert not (tmp_path / "bad").exists()
    # never over its input, even with --overwrite; an earlier result only with --overwrite
    src = {f.name: f.read_bytes() for f in ckpt.iterdir() if f.is_file()}
    again = ["quantize", "--model", str(ckpt), "--calib", str(tmp_path / "calib.txt"), "--method", "rtn",
             "--group-size", "32", "--json", "--out"]
    assert cli.main(again + [str(ckpt), "--overwrite"]) == 2
    assert f"--out {ckpt}: is an input" in capsys.readouterr().err
    assert {f.name: f.read_bytes() for f in ckpt.iterdir() if f.is_file()} == src
    assert cli.main(again + [str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: exists and is not empty" in err and "pass --overwrite" in err
    assert cli.main(again + [str(out), "--overwrite"]) == 0 and json.loads(capsys.readouterr().out)["method"] == "rtn"


def test_bfloat16_model_keeps_bfloat16_tensors(tmp_path):
    """A bfloat16 model's unquantized tensors (embeddings, norms, head) are written in bfloat16, all of
    them, and the config declares it, as GPTQModel keeps the source dtype (float16 would turn bf16 values
    beyond 65504 into inf). numpy files bfloat16 under kind "V", which an `is float` test by kind missed."""
    spec = gptq.QuantSpec(bits=4, group_size=32)
    _, _, model, _ = _quantized_tiny(tmp_path, spec)
    for name in ("embed_tokens", "norm", "lm_head"):
        getattr(model, name).value = getattr(model, name)[...].astype(jnp.bfloat16)
    model.layers.input_layernorm.value = model.layers.input_layernorm[...].astype(jnp.bfloat16)
    out = gptq.save_quantized(model, tmp_path / "q", qf.quant_config_dict(4, 32, True, False))
    t = load_file(out / "model.safetensors")
    for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
              "model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"):
        assert t[k].dtype.name == "bfloat16", k
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = checkpoint.load(out)
    np.testing.assert_array_equal(np.asarray(back.embed_tokens[...]), np.asarray(model.embed_tokens[...], np.float32))
