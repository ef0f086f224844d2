"""QLoRA: LoRA trained on a frozen GPTQ-packed base. The packed matmul's backward, the step on one device
and on an fsdp=8 mesh, the packed bytes the planner counts, resume, the adapter, and bad input."""
import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from amdllm import quant, train
from amdllm.cli import main
from amdllm.config import PRESETS, LlamaConfig
from amdllm.io import checkpoint, peft
from amdllm.io.tokenizer import WRITTEN_FILES as TOKENIZER_FILES
from amdllm.model import Llama, lora, to_pure
from amdllm.model.quantized import QuantLinear, dequantize, pack_cols, pack_rows, quantized_matmul
from amdllm.parallel import plan as PL, sharding as S

CFG = dict(model_type="llama", vocab_size=1152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2)
GROUP = 32


def gptq_dir(tmp_path, seed=0):
    """A random Llama (the course tokenizer's vocabulary) quantized 4-bit g32 (RTN) and saved as a GPTQ v1
    checkpoint with the course tokenizer; its dense source in tmp_path/fp."""
    cfg = LlamaConfig.from_dict(CFG)
    m = Llama(cfg, rngs=nnx.Rngs(seed))
    m.lm_head.value = 10 * m.lm_head[...]  # O(1) logits: something to learn
    checkpoint.save(m, tmp_path / "fp")
    q, _ = quant.quantize_model(checkpoint.load(tmp_path / "fp"), None, quant.QuantSpec(bits=4, group_size=GROUP),
                                method="rtn", progress=False)
    out = quant.save_quantized(q, tmp_path / "gptq", quant.quant_config_dict(4, GROUP, True, False))
    for f in TOKENIZER_FILES:
        shutil.copy(Path(__file__).resolve().parents[1] / "data" / "tokenizer" / f, out / f)
    return out


def token_rows(n=64, seed=0, seq_len=32):
    """Sorting rows as a token dataset: prompt, separator, the sorted tokens and EOS (trained)."""
    rng = np.random.default_rng(seed)
    ex = []
    for _ in range(n):
        a = rng.integers(3, 200, 6).tolist()
        ex.append(([0] + a + [250] + sorted(a) + [1], [0] * 8 + [1] * 7))
    return train.data.build_dataset(ex, seq_len)


def test_packed_matmul_backward_equals_autodiff_with_act_order():
    """quantized_matmul's hand-written backward (the kernel dequantized again, never kept) gives autodiff's
    input gradient, with an act-order g_idx (a gather), and no gradient for the packed words or scales."""
    rng = np.random.default_rng(0)
    K, N, G = 64, 48, 16
    codes = rng.integers(0, 16, (K, N))
    zeros = rng.integers(0, 16, (K // G, N))
    g = rng.permutation(np.repeat(np.arange(K // G), G)).astype(np.int32)  # act-order: groups out of order
    q = {"qweight": jnp.asarray(pack_rows(codes, 4)), "qzeros": jnp.asarray(pack_cols(zeros, 4)),
         "scales": jnp.asarray(rng.uniform(0.01, 0.05, (K // G, N)).astype(np.float16)), "g_idx": jnp.asarray(g)}
    x = jnp.asarray(rng.normal(size=(5, K)).astype(np.float32))
    dy = jnp.asarray(rng.normal(size=(5, N)).astype(np.float32))
    w = dequantize(q)
    np.testing.assert_array_equal(np.asarray(w), (codes - zeros[g]) * np.asarray(q["scales"], np.float32)[g])
    ours = jax.vjp(lambda x: quantized_matmul(x, q), x)[1](dy)[0]
    ref = jax.vjp(lambda x: x @ w, x)[1](dy)[0]
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-6, atol=1e-6)
    g_scales = jax.grad(lambda s: jnp.sum(quantized_matmul(x, {**q, "scales": s})))(q["scales"].astype(jnp.float32))
    assert not np.any(np.asarray(g_scales)), "the packed base must get no gradient"


def test_packed_base_is_never_dequantized_whole():
    """XLA's memory for the compiled QLoRA step (16 layers, no remat) stays far below the dense float32 base,
    and dequantizing adds less than one dense layer to the same LoRA step on the float model: layers are
    dequantized one projection at a time inside the scan, forward and backward, never as a stack. (Plain
    autodiff of the dequantizing matmul keeps every layer's dense kernel for the backward pass: 80 MB here,
    more than the base; `quantized_matmul`'s own backward dequantizes again instead.)"""
    cfg = LlamaConfig.from_dict({**CFG, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 16})
    temps = {}
    for kind in ("fp", "int4"):
        m = Llama(cfg, rngs=nnx.Rngs(0))
        dense = sum(to_pure(m)[1][p].nbytes for p in lora.PROJECTIONS)  # float32 projections of all layers
        if kind == "int4":
            m, _ = quant.quantize_model(m, None, quant.QuantSpec(bits=4, group_size=128), method="rtn", progress=False)
        lora.apply_lora(m, rank=4, targets=lora.ALL_TARGETS)
        opt = train.make_optimizer(train.TrainConfig(steps=1))[0]
        lo, frozen = train.split_params(m)
        if kind == "int4":
            assert isinstance(frozen["layers"]["q_proj"], dict) and frozen["layers"]["q_proj"]["qweight"].dtype == jnp.int32
        batch = train.place_batch(train.stack_batch(token_rows(4), np.arange(1), 1))
        compiled = train.make_train_step(m, opt).lower(lo, opt.init(lo), frozen, batch, jax.random.key(0)).compile()
        temps[kind] = compiled.memory_analysis().temp_size_in_bytes
    layer = dense / cfg.num_hidden_layers
    print(f"dense float32 projections {dense / 1e6:.1f} MB ({layer / 1e6:.1f} MB a layer); the step's temporaries: "
          f"LoRA {temps['fp'] / 1e6:.1f} MB, QLoRA {temps['int4'] / 1e6:.1f} MB")
    assert temps["int4"] < dense / 3, (temps, dense)   # measured 17.2 of 63 MB
    assert temps["int4"] - temps["fp"] < layer, (temps, layer)  # measured 17.2 MB both


def test_planner_counts_the_packed_bytes_held(tmp_path):
    """plan(bits=4) == the bytes a loaded GPTQ model holds on one device, unsharded and on fsdp=8 (the
    group axis of scales/zeros too few to split there: replicated, as the loader does)."""
    d = gptq_dir(tmp_path)
    cfg = LlamaConfig.from_json(d)
    for spec, rules in ((None, None), ("fsdp=8", "fsdp"), ("fsdp=4,tensor=2", "fsdp_tp")):
        mesh = None if spec is None else S.make_mesh(spec)
        m = checkpoint.load(d, mesh=mesh, rules=rules)
        dev0 = jax.devices()[0]
        held = sum(sum(s.data.nbytes for s in a.addressable_shards if s.device == dev0)
                   for a in jax.tree.leaves(nnx.state(m)))
        p = PL.plan(cfg, devices=1 if mesh is None else 8, device_memory_gb=1, mesh=spec, rules=rules,
                    dtype="float32", bits=4, group_size=GROUP)
        assert p["per_device_bytes"]["weights"] == held, (spec, p["per_device_bytes"]["weights"], held)
        if mesh is not None:
            qw = m.layers.q_proj.qweight[...]
            assert qw.sharding.spec == S.logical_to_spec(("layers", "embed", "heads"), rules, mesh=mesh)
            assert len({str(s.index) for s in qw.addressable_shards}) > 1  # really split


@pytest.mark.parametrize("targets", ["q,k,v,o", "q,k,v,o,gate,up,down"])
def test_planner_vs_xla_qlora_step(targets, monkeypatch):
    """The plan of a QLoRA step (bits=4) vs XLA's memory_analysis of the compiled step, on the course model's
    shape, 4 x 256 tokens, float32: within 20% with and without remat, the LoRA plan's tolerance
    (tests/test_plan.py), with XLA's attention as there. `-s` prints plan / XLA."""
    monkeypatch.setenv("AMDLLM_ATTENTION", "blocked")
    cfg = LlamaConfig.from_dict({**CFG, "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 768,
                                 "num_hidden_layers": 4, "num_attention_heads": 8})
    batch = train.place_batch(train.stack_batch(token_rows(80, seq_len=256), np.arange(4), 1))
    for remat in (False, True):
        m, _ = quant.quantize_model(Llama(cfg, rngs=nnx.Rngs(0)), None, quant.QuantSpec(bits=4, group_size=128),
                                    method="rtn", progress=False)
        m.remat = remat
        lora.apply_lora(m, rank=8, targets=targets)
        opt = train.make_optimizer(train.TrainConfig(steps=1))[0]
        lo, frozen = train.split_params(m)
        c = train.make_train_step(m, opt).lower(lo, opt.init(lo), frozen, batch, jax.random.key(0)).compile()
        a = c.memory_analysis()
        xla = a.argument_size_in_bytes + a.output_size_in_bytes + a.temp_size_in_bytes - a.alias_size_in_bytes
        p = PL.plan(cfg, devices=1, device_memory_gb=1, dtype="float32", lora_rank=8, lora_targets=targets.split(","),
                    batch_size=4, seq_len=256, bits=4, group_size=128, accelerator="cpu")
        ratio = p["total_bytes_remat" if remat else "total_bytes"] / xla
        print(f"QLoRA {targets} remat={remat}: plan / XLA = {ratio:.3f}")
        assert 0.8 < ratio < 1.2, (remat, ratio)


def test_qlora_cli_fsdp8_equals_one_device_and_resumes(tmp_path):
    """`amdllm finetune --model GPTQ_DIR`: the loss on an fsdp=8 mesh equals one device's, remat and grad
    accumulation on; resume continues the run exactly; the packed words reach the step as int32; the
    plan matches XLA's memory; the adapter names the GPTQ base and loads on it."""
    d = gptq_dir(tmp_path)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"instruction": f"What is {i} plus {i % 7}?", "output": str(i + i % 7)}) + "\n"
                            for i in range(48)))
    common = ["finetune", "--model", str(d), "--data", str(rows), "--steps", "4", "--batch-size", "8",
              "--grad-accum", "2", "--seq-len", "32", "--remat", "--lr", "1e-2", "--no-progress", "--json",
              "--save-every", "2", "--keep", "5"]

    def run(out, *extra):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(common + ["--out", str(out), *extra]) == 0
        return json.loads(buf.getvalue().strip().splitlines()[-1])

    one = run(tmp_path / "one", "--mesh", "fsdp=1")
    eight = run(tmp_path / "eight", "--mesh", "fsdp=8", "--rules", "fsdp")
    l1 = [r["loss"] for r in train.read_metrics(tmp_path / "one" / "metrics.jsonl")]
    l8 = [r["loss"] for r in train.read_metrics(tmp_path / "eight" / "metrics.jsonl")]
    np.testing.assert_allclose(l8, l1, rtol=2e-5)
    assert l1[-1] < l1[0]
    for res in (one, eight):
        q = next(v for k, v in res["frozen_in_step"].items() if k.endswith("q_proj/qweight"))
        assert q["dtype"] == "int32", q
        assert res["memory"]["plan_bytes_per_device"] > 0  # planned with the packed bytes (test below: vs XLA)
    # resume: the state at step 2, continued, gives the uninterrupted losses
    (tmp_path / "two" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "one" / "checkpoints" / "step_000002", tmp_path / "two" / "checkpoints" / "step_000002")
    shutil.copy(tmp_path / "one" / "metrics.jsonl", tmp_path / "two" / "metrics.jsonl")
    resumed = run(tmp_path / "two", "--mesh", "fsdp=1", "--resume")
    assert resumed["resumed_from"] == 2
    l2 = [r["loss"] for r in train.read_metrics(tmp_path / "two" / "metrics.jsonl")]
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    cfg = json.loads((tmp_path / "one" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(d)
    base = checkpoint.load(d)
    adapted = peft.load_adapter(nnx.clone(base), tmp_path / "one")
    assert isinstance(adapted.layers.q_proj, QuantLinear) and lora.lora_info(adapted)["rank"] == 8
    tokens = jnp.asarray(np.arange(3, 35)[None])
    assert float(jnp.max(jnp.abs(adapted(tokens)[0] - base(tokens)[0]))) > 1e-3  # the adapter does something


@pytest.mark.parametrize("case", ["3-bit", "awq", "merge"])
def test_bad_quantized_bases_are_one_line(tmp_path, capsys, case):
    d = gptq_dir(tmp_path)
    for name in ("config.json", "quantize_config.json"):
        p = d / name
        raw = json.loads(p.read_text())
        qc = raw["quantization_config"] if name == "config.json" else raw
        qc.update({"3-bit": {"bits": 3}, "awq": {"quant_method": "awq"}, "merge": {}}[case])
        p.write_text(json.dumps(raw))
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": "1 2 3"}) + "\n")
    extra = ["--merge"] if case == "merge" else []
    capsys.readouterr()  # the set-up's progress bars
    rc = main(["finetune", "--model", str(d), "--data", str(rows), "--out", str(tmp_path / "out"), *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    want = {"3-bit": "bits=3 is not supported by the packed format.*amdllm quantize --bits 4",
            "awq": "quant_method 'awq' is not supported.*amdllm quantize",
            "merge": "--merge with a quantized base.*merge it into the full-precision model"}[case]
    assert re.search(want, err), err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_405b_in_4_bits_needs_two_mi300x():
    """The README's QLoRA row: Llama 3.1 405B, rank 8 on q,k,v,o, batch 16 x 64 (Felafax's), 192 GB devices:
    8 MI300X in bf16 and 2 in GPTQ 4-bit g128 (packed weights 217 GB against 812 GB)."""
    cfg = PRESETS["llama-3.1-405b"]
    shape = dict(lora_rank=8, lora_targets=("q", "k", "v", "o"), batch_size=16, seq_len=64, dtype="bfloat16",
                 rules="fsdp")
    assert PL.fewest_devices(cfg, 192, **shape) == 8
    assert PL.fewest_devices(cfg, 192, bits=4, group_size=128, **shape) == 2
    assert PL.fewest_devices(cfg, 192, remat=True, bits=4, group_size=128, **{**shape, "batch_size": 8,
                                                                               "seq_len": 2048}) == 2
    p = PL.plan(cfg, devices=2, device_memory_gb=192, mesh="fsdp=2", bits=4, group_size=128, **shape)
    assert round(p["weights_bytes_total"] / 1e9, 1) == 217.2 and round(p["total_gb"], 1) == 155.6
    # the packed bytes are the format's: 4 bits a weight, per group of 128 an fp16 scale and a 4-bit zero
    paper = quant.paper_bytes(cfg, 4, 128)["total_bytes"]
    assert abs(p["weights_bytes_total"] - paper) / paper < 1e-6, (p["weights_bytes_total"], paper)


def test_loading_a_gptq_checkpoint_allocates_about_the_model(tmp_path):
    """The packed words are read from the memory-mapped file into the buffers that become the device arrays:
    the load allocates about the bytes the model holds (measured 1.01x of 162 MB), not the file's tensors
    copied beside a stacked copy (1.76x before). Measured in a fresh process, whose allocator has no freed
    memory to hand back."""
    cfg = LlamaConfig.from_dict({**CFG, "vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 2816,
                                 "num_hidden_layers": 16, "num_attention_heads": 8})
    q, _ = quant.quantize_model(Llama(cfg, rngs=nnx.Rngs(0)), None, quant.QuantSpec(bits=4, group_size=128),
                                method="rtn", progress=False)
    d = quant.save_quantized(q, tmp_path / "gptq", quant.quant_config_dict(4, 128, True, False))
    probe = (
        "import json, sys, jax\n"
        "from flax import nnx\n"
        "from amdllm.io import checkpoint\n"
        "from amdllm.train.loop import rss_now\n"
        "jax.devices()\n"
        "before = rss_now()\n"
        "leaves = jax.tree.leaves(nnx.state(checkpoint.load(sys.argv[1])))\n"
        "jax.block_until_ready(leaves)\n"
        "print(json.dumps({'grew': rss_now() - before, 'held': sum(a.nbytes for a in leaves)}))\n")
    out = subprocess.run([sys.executable, "-c", probe, str(d)], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"the load allocated {r['grew'] / 1e6:.0f} MB for {r['held'] / 1e6:.0f} MB of weights")
    assert r["held"] > 150e6 and r["grew"] < 1.25 * r["held"], r
