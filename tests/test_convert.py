"""Checkpoints as users download them (tests/vicuna.py builds Vicuna's layout: pickled float16 shards, a
SentencePiece tokenizer, no tokenizer.json), read with --allow-pickle, rewritten by `amdllm convert`, and
delta weights applied by FastChat's rule. transformers is the reference for every number."""
from __future__ import annotations

import json

import pytest

from amdllm import cli
from amdllm.io.tokenizer import load_tokenizer
from tests.test_evaluate import reference_perplexity
from tests.test_generate import hf_greedy
from tests.vicuna import DATA, make_vicuna_layout, train_sentencepiece, write_sentencepiece_tokenizer

TEXT = "\n".join((DATA / "corpus_heldout.txt").read_text().splitlines()[:6]) + "\n"
SEQ = 64
HELDOUT = str(DATA / "corpus_heldout.txt")


@pytest.fixture(scope="module")
def sp_model():
    return train_sentencepiece()


@pytest.fixture(scope="module")
def vicuna(tmp_path_factory, sp_model):
    d = tmp_path_factory.mktemp("vicuna") / "vicuna-tiny"
    return d, make_vicuna_layout(d, sp_model, seed=1)


def cli_json(capfd, argv):
    rc = cli.main(argv + ["--json"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    return json.loads(out.strip().splitlines()[-1])


def cli_error(capfd, argv) -> str:
    """The command fails with exit 2 and exactly one line on stderr; returns that line."""
    rc = cli.main(argv)
    _, err = capfd.readouterr()
    lines = [ln.split("\r")[-1] for ln in err.splitlines()]  # a progress bar ends in "\r" + blanks
    lines = [ln for ln in lines if ln.strip()]
    assert rc == 2 and len(lines) == 1, (rc, err)
    return lines[0]


def hf_perplexity(model_dir, seq_len=SEQ):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import torch
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(str(model_dir))(TEXT)["input_ids"]
    return reference_perplexity(hf, ids, seq_len), hf


def test_sentencepiece_ids_equal_transformers_and_sentencepiece(tmp_path, sp_model):
    """A directory with only tokenizer.model loads; its ids are transformers' (legacy true and false) and,
    on plain text, SentencePiece's own with BOS in front."""
    import sentencepiece as spm
    from transformers import AutoTokenizer
    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    text = (DATA / "corpus_heldout.txt").read_text()[:20_000]
    for legacy in (True, False):
        d = tmp_path / f"legacy-{legacy}"
        write_sentencepiece_tokenizer(d, sp_model, legacy=legacy)
        ours = load_tokenizer(d)
        ref = AutoTokenizer.from_pretrained(str(d))
        assert (ours.bos_token_id, ours.eos_token_id, ours.unk_token_id, ours.pad_token_id) == (1, 2, 0, None)
        assert ours(text)["input_ids"] == ref(text)["input_ids"] == [1] + sp.encode(text)
        # after a special token is where legacy changes the result
        tricky = "Hello</s> world.<s>Sam"
        assert ours(tricky)["input_ids"] == ref(tricky)["input_ids"]


def test_pickled_shards_refused_without_the_flag(vicuna, capfd):
    d, _ = vicuna
    line = cli_error(capfd, ["eval", "--model", str(d), "--text", HELDOUT])
    assert "pytorch_model-00001-of-00002.bin" in line and "--allow-pickle" in line and "amdllm convert" in line


def test_eval_allow_pickle_equals_transformers(vicuna, tmp_path, capfd):
    d, _ = vicuna
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    r = cli_json(capfd, ["eval", "--model", str(d), "--allow-pickle", "--text", str(text), "--seq-len", str(SEQ)])
    ref, _ = hf_perplexity(d)
    assert r["tokens"] == ref["tokens"]
    assert abs(r["perplexity"] / ref["perplexity"] - 1) < 1e-4


def test_convert_writes_what_transformers_loads(vicuna, tmp_path, capfd):
    """convert: safetensors + tokenizer.json, no pickle; transformers gives the same perplexity on it, and
    `generate` on the converted directory gives transformers' greedy ids."""
    d, hf = vicuna
    out = tmp_path / "converted"
    r = cli_json(capfd, ["convert", "--model", str(d), "--out", str(out), "--allow-pickle"])
    assert r["dtype"] == "float16" and r["files"] == ["model.safetensors"]
    assert (out / "tokenizer.json").is_file() and not list(out.glob("*.bin"))
    ref, hf_conv = hf_perplexity(out)
    ref_pickled, _ = hf_perplexity(d)
    assert ref == ref_pickled  # the same weights and ids, bit for bit
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    ours = cli_json(capfd, ["eval", "--model", str(out), "--text", str(text), "--seq-len", str(SEQ)])
    assert abs(ours["perplexity"] / ref["perplexity"] - 1) < 1e-4
    prompt = "Once upon a time, Tom"
    g = cli_json(capfd, ["generate", "--model", str(out), "--prompt", prompt, "--max-new-tokens", "12"])
    ids = load_tokenizer(out)(prompt)["input_ids"]
    assert g["token_ids"] == hf_greedy(hf_conv, [ids], 12, eos=2)[0]
    # bf16 on request; the source is never written over; an existing output needs --overwrite
    r = cli_json(capfd, ["convert", "--model", str(out), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16"])
    assert r["dtype"] == "bfloat16"
    assert "convert never writes over its input" in cli_error(capfd, ["convert", "--model", str(out), "--out", str(out)])
    assert "--overwrite" in cli_error(capfd, ["convert", "--model", str(out), "--out", str(tmp_path / "bf16")])


def fastchat_apply_delta(base_hf, delta_hf):
    """FastChat's rule (fastchat/model/apply_delta.py), written out: float16, delta + base, where the
    embedding and head of the delta may have extra rows and only the first rows get the base."""
    import torch
    base = {k: v.to(torch.float16) for k, v in base_hf.state_dict().items()}
    target = {}
    for name, param in delta_hf.state_dict().items():
        param = param.to(torch.float16).clone()
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            b = base[name]
            param[:b.shape[0], :b.shape[1]] += b
        else:
            param += base[name]
        target[name] = param
    return target


def test_delta_weights_give_fastchats_target(tmp_path, sp_model, capfd):
    """A delta with one extra token: convert --delta-base gives exactly FastChat's target, which
    transformers loads."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    base_hf = make_vicuna_layout(tmp_path / "llama", sp_model, seed=2)
    delta_hf = make_vicuna_layout(tmp_path / "delta", sp_model, seed=3, extra_tokens=1, std=0.01)
    out = tmp_path / "target"
    cli_json(capfd, ["convert", "--model", str(tmp_path / "delta"), "--delta-base", str(tmp_path / "llama"),
                     "--out", str(out), "--allow-pickle"])
    want = fastchat_apply_delta(base_hf, delta_hf)
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == torch.float16 and torch.equal(got[name], want[name]), name
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert hf.config.vocab_size == 641 and torch.equal(hf.lm_head.weight.to(torch.float16), want["lm_head.weight"])


def test_bad_inputs_get_one_line_naming_the_file(tmp_path, sp_model, vicuna, capfd):
    d, hf = vicuna
    # a legacy (non-zip) pickle
    legacy = tmp_path / "legacy"
    from tests.vicuna import save_pickled_shards
    save_pickled_shards(hf, legacy, legacy_format=True)
    write_sentencepiece_tokenizer(legacy, sp_model)
    line = cli_error(capfd, ["eval", "--model", str(legacy), "--allow-pickle", "--text", HELDOUT])
    assert "legacy" in line and "pytorch_model-0000" in line
    # a corrupt SentencePiece file
    bad_sp = tmp_path / "bad-sp"
    write_sentencepiece_tokenizer(bad_sp, sp_model[: len(sp_model) // 3] + b"\x00garbage")
    for f in ("config.json", "pytorch_model.bin.index.json", "pytorch_model-00001-of-00002.bin",
              "pytorch_model-00002-of-00002.bin"):
        (bad_sp / f).write_bytes((d / f).read_bytes())
    line = cli_error(capfd, ["eval", "--model", str(bad_sp), "--allow-pickle", "--text", HELDOUT])
    assert str(bad_sp / "tokenizer.model") in line
    # a delta whose shapes differ from the base beyond the vocabulary
    other = tmp_path / "wider"
    from tests.tiny import make_hf_model
    from tests.vicuna import SP_VOCAB, save_pickled_shards as save
    save(make_hf_model(seed=4, vocab_size=SP_VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                       bos_token_id=1, eos_token_id=2, pad_token_id=None), other)
    write_sentencepiece_tokenizer(other, sp_model)
    line = cli_error(capfd, ["convert", "--model", str(other), "--delta-base", str(d), "--out",
                             str(tmp_path / "x"), "--allow-pickle"])
    assert str(other) in line and "model.embed_tokens.weight" in line and "shape" in line
    assert not (tmp_path / "x").exists()
    # a --delta-base that is not Llama
    notllama = tmp_path / "gpt2"
    notllama.mkdir()
    (notllama / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    line = cli_error(capfd, ["convert", "--model", str(d), "--delta-base", str(notllama), "--out",
                             str(tmp_path / "y"), "--allow-pickle"])
    assert str(notllama / "config.json") in line and "gpt2" in line
