"""Class "a silently different model": config.json is read as transformers 5 reads it, or refused by name.

Each accepted case edits a saved checkpoint's config.json (or its tensors) as a user's file might be, then
compares our logits with `transformers.LlamaForCausalLM.from_pretrained` on the same directory: a RoPE
scaling that is ignored, or a head that is dropped, is an O(1) difference. Each refused case runs
`amdllm eval` in a subprocess and checks the one line that names the field."""
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from tests.robustness.conftest import amdllm, one_line_error
from tests.tiny import hf_logits, make_hf_checkpoint, random_tokens

from amdllm.io import checkpoint

TOL = 1e-4
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

ACCEPTED = {  # config.json keys set (None: removed), as found in the wild
    "default parameters, linear scaling beside them": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "default parameters, llama3 scaling beside them (its theta wins: none, so 10000)": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "rope_scaling": {"type": "llama3", **LLAMA3}},
    "legacy spelling, linear": {"rope_parameters": None, "rope_theta": 500.0,
                                "rope_scaling": {"type": "linear", "factor": 2.0}},
    "llama3 without its original length (max_position_embeddings)": {
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0}},
    "an empty rope_scaling leaves rope_parameters": {
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 50000.0, **LLAMA3}, "rope_scaling": {}},
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    ckpt, _ = make_hf_checkpoint(tmp_path_factory.mktemp("config"))
    return ckpt


def edited(base, tmp_path, keys: dict):
    d = shutil.copytree(base, tmp_path / "model")
    raw = json.loads((d / "config.json").read_text())
    for k, v in keys.items():
        raw.pop(k, None) if v is None else raw.__setitem__(k, v)
    (d / "config.json").write_text(json.dumps(raw))
    return d


def transformers_logits(d, tokens):
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(str(d), attn_implementation="eager").float().eval()
    return hf_logits(hf, tokens)


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_rope_settings_give_transformers_logits(case, base, tmp_path):
    d = edited(base, tmp_path, ACCEPTED[case])
    tokens = random_tokens(2, 96, seed=1)  # past original_max_position_embeddings, where scaling matters
    ours = np.asarray(checkpoint.load(d)(jnp.asarray(tokens))[0])
    ref = transformers_logits(d, tokens)
    plain = np.asarray(checkpoint.load(base)(jnp.asarray(tokens))[0])
    assert np.abs(ref - plain).max() > 100 * TOL, "the case does not change the model: it tests nothing"
    assert np.abs(ours - ref).max() <= TOL, case


def test_a_tied_config_keeps_a_head_the_file_holds(tiny, tmp_path):
    """transformers keeps a checkpoint's own lm_head (unlike the embeddings) even where the config ties."""
    from safetensors.numpy import load_file, save_file
    d, _ = make_hf_checkpoint(tmp_path, tie_word_embeddings=True, vocab_size=320)
    for f in tiny["model"].glob("tokenizer*"):  # convert writes the tokenizer too
        shutil.copyfile(f, d / f.name)
    tensors = load_file(d / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = np.random.default_rng(0).normal(0, 0.08, tensors["model.embed_tokens.weight"]
                                                                .shape).astype(np.float32)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    tokens = random_tokens(2, 16, seed=2)
    with pytest.warns(UserWarning, match="lm_head.weight differs"):
        model = checkpoint.load(d)
    assert np.abs(np.asarray(model(jnp.asarray(tokens))[0]) - transformers_logits(d, tokens)).max() <= TOL
    out = tmp_path / "converted"  # convert writes the head it kept, untied
    assert amdllm("convert", "--model", d, "--out", out).returncode == 0
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert np.abs(np.asarray(checkpoint.load(out)(jnp.asarray(tokens))[0])
                  - transformers_logits(d, tokens)).max() <= TOL


REFUSED = {  # keys set -> what the line must name
    "yarn": ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, ["'yarn'", "not implemented"]),
    "dynamic": ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, ["'dynamic'", "not implemented"]),
    "longrope in rope_parameters": ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
                                    ["'longrope'"]),
    "factor a string": ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, ["rope_scaling.factor", "'2'"]),
    "factor null": ({"rope_scaling": {"rope_type": "llama3", **LLAMA3, "factor": None}},
                    ["rope_scaling.factor", "None"]),
    "factor below 1": ({"rope_scaling": {"rope_type": "linear", "factor": 0.5}}, ["rope_scaling.factor"]),
    "llama3 frequencies reversed": ({"rope_scaling": {"rope_type": "llama3", **LLAMA3, "low_freq_factor": 4.0,
                                                      "high_freq_factor": 1.0}}, ["high_freq_factor"]),
    "rope_scaling a list": ({"rope_scaling": ["linear", 2]}, ["rope_scaling must be an object"]),
    "rope_parameters a string": ({"rope_parameters": "llama3"}, ["rope_parameters must be an object"]),
    "tie a string": ({"tie_word_embeddings": "false"}, ["tie_word_embeddings must be true or false", "'false'"]),
    "bias a string": ({"attention_bias": "false"}, ["attention_bias must be true or false"]),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_settings_we_cannot_honour_are_refused_by_name(case, base, tmp_path):
    keys, named = REFUSED[case]
    d = edited(base, tmp_path, keys)
    text = tmp_path / "t.txt"
    text.write_text("a b c d e f g h " * 8)
    one_line_error(amdllm("eval", "--model", d, "--text", text), "config.json", *named)
