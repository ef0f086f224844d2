"""LoRA: attach/merge, and the PEFT round trip against the real `peft` package on `transformers`' Llama."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from amdllm.io import peft as peft_io
from amdllm.io.names import HF_PARENT
from amdllm.model import lora
from amdllm.config import LlamaConfig
from amdllm.model import Llama, LoRAParam

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

HF_CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


def hf_model(seed=0):
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CFG)).eval()
    return m


def ours_from_hf(hf) -> Llama:
    """transformers Llama -> ours: nn.Linear weights [out, in] transposed, layers stacked."""
    cfg = LlamaConfig.from_dict({"model_type": "llama", **HF_CFG})
    m = Llama(cfg, rngs=nnx.Rngs(0))
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    L = cfg.num_hidden_layers
    m.embed_tokens.value = jnp.asarray(sd["model.embed_tokens.weight"])
    m.norm.value = jnp.asarray(sd["model.norm.weight"])
    m.lm_head.value = jnp.asarray(sd["lm_head.weight"].T)
    for name, parent in HF_PARENT.items():
        w = np.stack([sd[f"model.layers.{i}.{parent}.{name}.weight"].T for i in range(L)])
        getattr(m.layers, name).value = jnp.asarray(w)
    for name in ("input_layernorm", "post_attention_layernorm"):
        getattr(m.layers, name).value = jnp.asarray(np.stack([sd[f"model.layers.{i}.{name}.weight"] for i in range(L)]))
    return m


TOKENS = np.random.default_rng(0).integers(0, HF_CFG["vocab_size"], (2, 12))


def our_logits(m):
    return np.asarray(m(jnp.asarray(TOKENS))[0])


def torch_logits(m):
    with torch.no_grad():
        return m(torch.tensor(TOKENS)).logits.float().numpy()


def randomize_b(m, seed=1):
    key = jax.random.key(seed)
    for i, name in enumerate(lora.lora_targets(m)):
        var = getattr(m.layers, name + "_lora_b")
        var.value = 0.05 * jax.random.normal(jax.random.fold_in(key, i), var.shape)


def test_converted_base_matches_transformers():
    hf = hf_model()
    np.testing.assert_allclose(our_logits(ours_from_hf(hf)), torch_logits(hf), atol=1e-4)


def test_init_like_peft_and_starts_equal_to_base():
    m = ours_from_hf(hf_model())
    base = our_logits(m)
    lora.apply_lora(m, rank=4, alpha=8, targets="q,v,down")
    assert lora.lora_targets(m) == ("q_proj", "v_proj", "down_proj")
    a = np.asarray(m.layers.q_proj_lora_a[...])
    assert a.shape == (2, 64, 4) and m.layers.down_proj_lora_a.shape == (2, 96, 4)
    bound = 1 / np.sqrt(64)  # kaiming_uniform(a=sqrt(5)) on [r, in] = U(-1/sqrt(in), 1/sqrt(in))
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.9 * bound
    assert np.all(np.asarray(m.layers.q_proj_lora_b[...]) == 0)
    assert isinstance(m.layers.q_proj_lora_a, LoRAParam)
    assert m.layers.q_proj_lora_a.get_metadata()["axes"] == ("layers", "embed", "lora_rank")
    assert m.layers.down_proj_lora_b.get_metadata()["axes"] == ("layers", "lora_rank", "embed")
    assert m.lora_scale == 2.0
    np.testing.assert_array_equal(our_logits(m), base)
    # PEFT's own init of an [r, in] A has the same distribution (same bound)
    pm = peft.get_peft_model(hf_model(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    pa = pm.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.detach().numpy()
    assert pa.shape == (4, 64) and abs(np.abs(pa).max() - np.abs(a).max()) < 0.1 * bound


def test_save_adapter_then_peft_reproduces_our_logits(tmp_path):
    hf = hf_model()
    m = lora.apply_lora(ours_from_hf(hf), rank=4, alpha=16, seed=3)
    randomize_b(m)
    ours = our_logits(m)
    assert np.abs(ours - torch_logits(hf)).max() > 1e-2  # the adapter really changes the output
    peft_io.save_adapter(m, tmp_path / "ad", base_model_dir="some/base")
    cfg = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 16
    assert cfg["target_modules"] == list(lora.PROJECTIONS) and cfg["task_type"] == "CAUSAL_LM"
    pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "ad")).eval()
    np.testing.assert_allclose(torch_logits(pm), ours, atol=1e-4)


def test_merge_equals_base_plus_adapter_and_peft_merge():
    hf = hf_model()
    m = lora.apply_lora(ours_from_hf(hf), rank=4, alpha=8, targets=("q", "o", "gate", "up"))
    randomize_b(m)
    adapted = our_logits(m)
    merged = lora.merge_lora(m)
    assert lora.lora_targets(merged) == () and merged.lora_scale == 0.0
    assert lora.lora_targets(m) != ()  # merge returns a new model
    assert not any(isinstance(v, LoRAParam) for _, v in nnx.iter_graph(merged))
    np.testing.assert_allclose(our_logits(merged), adapted, atol=1e-5)
    # and equal to PEFT's own merge_and_unload of the same adapter, weight by weight
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        peft_io.save_adapter(m, d)
        pm = peft.PeftModel.from_pretrained(hf, d).merge_and_unload()
    w = pm.model.layers[1].mlp.gate_proj.weight.detach().numpy().T
    np.testing.assert_allclose(np.asarray(merged.layers.gate_proj[...][1]), w, atol=1e-6)


def test_load_peft_written_adapter(tmp_path):
    hf = hf_model()
    pcfg = peft.LoraConfig(r=6, lora_alpha=12, target_modules=["k_proj", "v_proj", "up_proj", "down_proj"],
                           lora_dropout=0.1, task_type="CAUSAL_LM")
    pm = peft.get_peft_model(hf, pcfg)
    torch.manual_seed(5)
    for n, p in pm.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    pm.save_pretrained(str(tmp_path / "p"))
    pm.eval()
    m = peft_io.load_adapter(ours_from_hf(hf_model()), tmp_path / "p")
    assert lora.lora_info(m) == {"rank": 6, "alpha": 12, "dropout": 0.1,
                                 "targets": ("k_proj", "v_proj", "up_proj", "down_proj")}
    np.testing.assert_allclose(our_logits(m), torch_logits(pm), atol=1e-4)


def test_bad_settings_are_clear_errors(tmp_path):
    m = ours_from_hf(hf_model())
    with pytest.raises(lora.LoRAError, match=r"unknown LoRA target module 'qq'.*q,k,v,o,gate,up,down"):
        lora.apply_lora(m, targets="q,qq")
    with pytest.raises(lora.LoRAError, match=r"rank 65 is larger than layer q_proj.*\[64, 64\].*<= 64"):
        lora.apply_lora(m, rank=65, targets="q")
    with pytest.raises(lora.LoRAError, match=r"rank 40 is larger than layer k_proj.*\[64, 32\].*<= 32"):
        lora.apply_lora(m, rank=40, targets="q,k")
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        peft_io.load_adapter(m, tmp_path)
    peft_io.save_adapter(lora.apply_lora(m, rank=2, targets="q"), tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj", "lm_head"]}))
    with pytest.raises(lora.LoRAError, match="adapter_config.json: unknown LoRA target module 'lm_head'"):
        peft_io.load_adapter(m, tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**cfg, "r": 3}))
    with pytest.raises(lora.LoRAError, match=r"q_proj.lora_A.weight has shape \(2, 64\), expected \(3, 64\)"):
        peft_io.load_adapter(m, tmp_path / "a")


@pytest.mark.parametrize("targets", ["q,v,down", "q,k,v,o,gate,up,down"])
def test_fused_projections_match_peft_with_all_or_some_targets(tmp_path, targets):
    """Rows enough for `fast.fuses` take the fused path (q/k/v and gate/up in one matmul each, LoRA A's
    fused when every projection of a group has one): equal to PEFT whichever projections carry LoRA."""
    from amdllm.model.fast import fuses
    tokens = np.random.default_rng(5).integers(0, HF_CFG["vocab_size"], (2, 40))
    assert fuses(tokens.size, HF_CFG["hidden_size"])
    hf = hf_model()
    m = lora.apply_lora(ours_from_hf(hf), rank=4, alpha=8, targets=targets, seed=2)
    randomize_b(m)
    ours = np.asarray(m(jnp.asarray(tokens))[0])
    peft_io.save_adapter(m, tmp_path / "ad")
    pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "ad")).eval()
    with torch.no_grad():
        ref = pm(torch.tensor(tokens)).logits.float().numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_peft_parity_at_the_course_recipe_size(tmp_path):
    """Lesson 03's comparison at its own adapter size: the course model, rank 8 on all seven projections,
    factors trained (not random) on the course task. The tolerance is float32 rounding noise for this
    model's depth and width, scaled by the logits (amdllm.model.logit_tolerance), not a number chosen
    from a quick run; the trained adapter changes the logits by far more than it."""
    from transformers import LlamaForCausalLM

    from amdllm.io import checkpoint
    from amdllm import course, train
    from amdllm.train import data
    from amdllm.model import logit_tolerance
    from amdllm.io.tokenizer import load_tokenizer

    model_dir = course.default_model_dir()
    tok = load_tokenizer(model_dir)
    ds = data.load_dataset(course.task_paths()[0], tok, 256)
    m = lora.apply_lora(checkpoint.load(model_dir), rank=8, alpha=16, targets="q,k,v,o,gate,up,down")
    tokens = jnp.asarray(ds.tokens[:2])
    base = np.asarray(m(tokens)[0])
    train.finetune(m, ds, tmp_path / "ad", train.TrainConfig(steps=10, batch_size=8, seq_len=256, lr=3e-3),
                   base_model_dir=str(model_dir), progress=False)
    ours = np.asarray(m(tokens)[0])
    tol = logit_tolerance(m.cfg, np.abs(ours).max())
    print(f"\nadapter moves the logits by {np.abs(ours - base).max() / tol:.0f}x the tolerance")
    assert np.abs(ours - base).max() > 1000 * tol  # the adapter matters far beyond the tolerance
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "ad")).eval()
    with torch.no_grad():
        ref = pm(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()
    assert np.abs(ref - ours).max() <= tol, (np.abs(ref - ours).max(), tol)
    merged = np.asarray(lora.merge_lora(m)(tokens)[0])
    assert np.abs(merged - ours).max() <= tol, (np.abs(merged - ours).max(), tol)
