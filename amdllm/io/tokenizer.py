"""Tokenizers: load any Hugging Face tokenizer directory (tokenizer.json, or a SentencePiece
tokenizer.model that transformers converts, as for Llama 2 and Vicuna); train the course's byte-level BPE.

The course tokenizer is GPT-2/Llama-3 style byte-level BPE (every byte string is encodable, so any
prompt template works), with Llama 3's special-token names: `<|begin_of_text|>` (BOS, added by
`tokenizer(text)` through the tokenizer.json post-processor, exactly once), `<|end_of_text|>` (EOS)
and `<|pad|>`. The files written are the three that `transformers.AutoTokenizer` reads offline.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from amdllm.files import atomic_write_bytes, atomic_write_text
from amdllm.io.names import TOKENIZER_FILES
from amdllm.io.safetensors import CheckpointError

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)  # ids 0, 1, 2
WRITTEN_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")  # save_for_transformers


class TokenizerError(ValueError):
    """A directory without a usable tokenizer; the message names the directory and what is missing."""


def load_tokenizer(path: str | os.PathLike):
    """A fast `transformers` tokenizer from a checkpoint or tokenizer directory (offline): its tokenizer.json,
    else its SentencePiece tokenizer.model converted by transformers (the ids `AutoTokenizer` gives)."""
    # transformers costs seconds to import: loaded when a tokenizer is, not by every command that imports us
    from transformers import PreTrainedTokenizerBase

    p = Path(path)
    if not p.is_dir():
        raise TokenizerError(f"{p}: not a directory (expected a checkpoint or tokenizer directory)")
    what = p / "tokenizer.json"
    if not what.is_file():
        what = p / "tokenizer.model"  # SentencePiece (Llama 2, Vicuna): transformers converts it
        if not what.is_file():
            found = sorted(f.name for f in p.iterdir())
            raise TokenizerError(f"{p}: no tokenizer.json or SentencePiece tokenizer.model; found {found}")
        _check_sentencepiece(what)
    try:
        if _plain_fast(p):
            from transformers import PreTrainedTokenizerFast  # what AutoTokenizer picks for this config
            tok = PreTrainedTokenizerFast.from_pretrained(str(p), local_files_only=True)
        else:
            from transformers import AutoTokenizer  # imports PyTorch: only where a specific class is named
            tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # transformers raises many types; one line naming the file is what helps
        msg = str(e).splitlines()[0] if str(e) else ""
        raise TokenizerError(f"{what}: could not load the tokenizer: {type(e).__name__}: {msg}") from None
    if not isinstance(tok, PreTrainedTokenizerBase) or not getattr(tok, "is_fast", False):
        raise TokenizerError(f"{p}: loaded {type(tok).__name__}, expected a fast (tokenizer.json) tokenizer")
    return tok


def _plain_fast(p: Path) -> bool:
    """True when tokenizer_config.json names the generic fast class (Llama 3's and the course's) for a
    tokenizer.json and no remote code: AutoTokenizer then loads exactly that class. Loading it directly
    skips `transformers.AutoTokenizer`, whose import pulls in PyTorch (its memory, in every generate and
    serve process)."""
    try:
        cfg = json.loads((p / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return ((p / "tokenizer.json").is_file() and isinstance(cfg, dict) and "auto_map" not in cfg
            and cfg.get("tokenizer_class") in ("PreTrainedTokenizerFast", "TokenizersBackend"))


def _check_sentencepiece(path: Path) -> None:
    """A SentencePiece model file that sentencepiece itself can open (else one line naming the file)."""
    try:
        import sentencepiece  # optional until a SentencePiece tokenizer is read (a compiled extension)
    except ImportError:
        raise TokenizerError(f"{path}: reading a SentencePiece tokenizer needs the sentencepiece package "
                             "(pip install sentencepiece protobuf)") from None
    try:
        sentencepiece.SentencePieceProcessor(model_proto=path.read_bytes())
    except Exception:  # RuntimeError or a protobuf DecodeError, depending on the damage
        raise TokenizerError(f"{path}: not a valid SentencePiece model (sentencepiece cannot parse it; "
                             f"{path.stat().st_size} bytes)") from None


def pad_id(tokenizer) -> int:
    """The tokenizer's pad id, else 0. Llama tokenizers often define none; padded positions are masked
    (attention, loss), so any id works, and 0 keeps embedding lookups in range."""
    return int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else 0


def train_bpe(text_files: list[str | os.PathLike], vocab_size: int = 2048):
    """A `tokenizers.Tokenizer`: byte-level BPE trained on `text_files`, BOS added by its post-processor.

    On a small closed world the merges run out before `vocab_size` (every word becomes one token);
    the trainer then stops early, which is fine.
    """

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(f) for f in text_files], trainer)
    bos_id = tok.token_to_id(BOS)
    # Llama 3 convention: BOS in front of every sequence; no EOS appended (generation decides that).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, bos_id)])
    return tok


def save_for_transformers(tok, out_dir: str | os.PathLike) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json atomically.

    No `model_max_length`: tokenizing a whole text (the perplexity protocol, the training stream)
    is normal here, and the model's limit lives in config.json (max_position_embeddings).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                        "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "added_tokens_decoder": added,
    }
    files = {
        "tokenizer.json": tok.to_str(pretty=True) + "\n",
        "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
        "special_tokens_map.json": json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD},
                                              indent=2) + "\n",
    }
    for name, text in files.items():
        atomic_write_text(out / name, text)
    return [out / n for n in files]


def copy_tokenizer(src: str | os.PathLike, dst: str | os.PathLike, required: bool = True) -> None:
    """Copy a checkpoint's tokenizer files (`TOKENIZER_FILES`, those present) into `dst`, atomically.
    required: a source without any tokenizer file is an error (else nothing is copied)."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise CheckpointError(f"tokenizer_from={src}: directory not found")
    copied = [n for n in TOKENIZER_FILES if (src / n).is_file()]
    if required and not any(n.startswith("tokenizer") for n in copied):
        raise CheckpointError(f"tokenizer_from={src}: no tokenizer files found (expected one of {TOKENIZER_FILES})")
    for n in copied:
        if (src / n).resolve() != (dst / n).resolve():
            atomic_write_bytes(dst / n, (src / n).read_bytes())


def encoder(model_dir: str | os.PathLike):
    """A function text -> token ids (int32 numpy), as `load_tokenizer(model_dir)(text)["input_ids"]` gives
    them (BOS included where the tokenizer adds it), read by `tokenizers` itself where the checkpoint has a
    tokenizer.json: the same ids without importing transformers (~5 s of a command's start). A directory
    without tokenizer.json gets load_tokenizer's tokenizer (or its error naming what is missing)."""
    f = Path(model_dir) / "tokenizer.json"
    if not f.is_file():  # a SentencePiece directory (converted by transformers), or a TokenizerError
        tok = load_tokenizer(model_dir)
        return lambda text: np.asarray(tok(text)["input_ids"], np.int32)
    try:
        tok = Tokenizer.from_file(str(f))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise TokenizerError(f"{f}: could not load the tokenizer: {str(e).splitlines()[0] if str(e) else e!r}") \
            from None
    return lambda text: np.asarray(tok.encode(text).ids, np.int32)


def encode_fast(model_dir: str | os.PathLike, text: str):
    """Token ids of `text` by the checkpoint's tokenizer (see `encoder`)."""
    return encoder(model_dir)(text)
