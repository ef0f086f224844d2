"""A checkpoint laid out as Vicuna and Llama 2 releases are, built locally (no network):

    pytorch_model-00001-of-00002.bin, pytorch_model-00002-of-00002.bin   (torch.save, float16)
    pytorch_model.bin.index.json
    config.json                      (LlamaForCausalLM, MHA like Llama 2 7B/13B, torch_dtype float16)
    tokenizer.model                  (SentencePiece BPE with byte fallback; <unk>=0, <s>=1, </s>=2)
    tokenizer_config.json            (LlamaTokenizer), special_tokens_map.json;  no tokenizer.json

The SentencePiece model is trained with `sentencepiece` on the course text, with Llama's settings.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

from tests.tiny import make_hf_model

DATA = Path(__file__).resolve().parents[1] / "data"
SP_VOCAB = 640


def train_sentencepiece(vocab_size: int = SP_VOCAB) -> bytes:
    import sentencepiece as spm
    lines = (DATA / "corpus_train.txt").read_text().splitlines()[:4000]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, byte_fallback=True, split_digits=True, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, add_dummy_prefix=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, minloglevel=2)
    return buf.getvalue()


def write_sentencepiece_tokenizer(out: Path, sp_model: bytes, legacy: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.model").write_bytes(sp_model)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": None, "add_bos_token": True, "add_eos_token": False, "legacy": legacy,
        "model_max_length": 2048, "clean_up_tokenization_spaces": False}, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2))


def save_pickled_shards(hf_model, out: Path, legacy_format: bool = False) -> None:
    """state dict -> two torch.save shards in float16 + pytorch_model.bin.index.json, and config.json."""
    import torch
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.float16).contiguous() for k, v in hf_model.state_dict().items()}
    names = list(sd)
    half = len(names) // 2
    wm = {}
    for k, part in enumerate((names[:half], names[half:])):
        fname = f"pytorch_model-{k + 1:05d}-of-00002.bin"
        torch.save({n: sd[n] for n in part}, out / fname, _use_new_zipfile_serialization=not legacy_format)
        wm.update({n: fname for n in part})
    total = sum(v.numel() * 2 for v in sd.values())
    (out / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": wm}, indent=2))
    cfg = hf_model.config.to_dict()
    cfg.update(torch_dtype="float16", dtype="float16", architectures=["LlamaForCausalLM"])
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))


def make_vicuna_layout(out: Path, sp_model: bytes, *, seed: int = 0, extra_tokens: int = 0,
                       legacy: bool = False, std: float = 0.08):
    """Write the layout into `out`; returns the transformers model (float32, with the float16-rounded
    weights that were saved). extra_tokens: rows beyond the SentencePiece vocabulary (a delta's new tokens)."""
    import torch
    hf = make_hf_model(seed=seed, std=std, vocab_size=SP_VOCAB + extra_tokens, num_key_value_heads=4,
                       bos_token_id=1, eos_token_id=2, pad_token_id=None, max_position_embeddings=512)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.float16).to(torch.float32))
    save_pickled_shards(hf, out)
    write_sentencepiece_tokenizer(out, sp_model, legacy=legacy)
    return hf
