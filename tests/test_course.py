"""The course data, its tokenizer and the embedded default model (amdllm.course.corpus, amdllm.io.tokenizer, amdllm.course.default_model).

The default model is committed in data/default_model/ (its recipe takes ~20 minutes on 2 cores); these tests
check that it is today's recipe's build, that the recipe is deterministic, and what the model learned.
"""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from amdllm.course import corpus
from amdllm.course import default_model as course
from amdllm.io.tokenizer import (BOS, EOS, PAD, WRITTEN_FILES as TOKENIZER_FILES, TokenizerError, load_tokenizer,
                                 save_for_transformers, train_bpe)

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data"


KINDS = [set(corpus.ANIMALS), set(corpus.COLORS), set(corpus.PLACES), set(corpus.NUMBERS), set(corpus.NAMES),
         set(corpus.FOODS)]


def words_of(text):
    return re.findall(r"[A-Za-z]+", text)


# --------------------------------------------------------------------------------------------------
# Data and tokenizer
# --------------------------------------------------------------------------------------------------
def test_generator_reproduces_committed_files():
    generated = corpus.generate_all()
    assert sorted(generated) == sorted(corpus.FILES)
    for name, text in generated.items():
        assert (DATA / name).read_text() == text, f"data/{name} is stale: run python -m amdllm.course data"
    assert sum((DATA / n).stat().st_size for n in corpus.FILES) < 4_000_000  # keep the repository small


def test_tokenizer_training_reproduces_committed_files(tmp_path):
    save_for_transformers(train_bpe([DATA / "corpus_train.txt"]), tmp_path)
    for name in TOKENIZER_FILES:
        assert (tmp_path / name).read_bytes() == (DATA / "tokenizer" / name).read_bytes(), name


def test_tokenizer_loads_offline_adds_bos_once_and_round_trips():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DATA / "tokenizer"), local_files_only=True)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS, EOS, PAD)
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    assert tok("hi")["input_ids"][0] == tok.bos_token_id
    line = (DATA / "corpus_heldout.txt").read_text().splitlines()[0]
    for text in (line, "Zoë's café: 3 🦊 foxes\tand\n\nnew lines  "):  # byte-level: any text survives
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
        assert tok.eos_token_id not in ids
        assert tok.decode(ids[1:]) == text
        assert tok.decode(ids, skip_special_tokens=True) == text
    # every word of the world is one token, with and without its leading space (quoted in the stories)
    for w in ("fox", "purple", "squirrel", "Sofia", "eleven", "honey"):
        assert len(tok(" " + w, add_special_tokens=False)["input_ids"]) == 1, w
        assert len(tok("\n" + w, add_special_tokens=False)["input_ids"]) == 2, w
    ours = load_tokenizer(DATA / "tokenizer")
    assert type(ours) is type(tok) and ours(line)["input_ids"] == tok(line)["input_ids"]
    assert 512 < len(tok) <= 4096


def test_loading_a_generic_fast_tokenizer_does_not_import_torch():
    """A tokenizer_config naming PreTrainedTokenizerFast (Llama 3's, ours) loads that class directly:
    `transformers.AutoTokenizer` imports PyTorch, ~0.25 GB in every generate and serve process."""
    code = ("import sys; from amdllm.io.tokenizer import load_tokenizer; "
            f"t = load_tokenizer({str(DATA / 'tokenizer')!r}); print(t('hi')['input_ids'], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[-1] == "False", out


def test_load_tokenizer_errors_name_the_directory(tmp_path):
    with pytest.raises(TokenizerError, match=r"nope: not a directory"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"no tokenizer.json .*config.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=re.escape(str(tmp_path / "tokenizer.json")) + ": could not load"):
        load_tokenizer(tmp_path)


def test_task_rows_are_answerable_by_copying_and_new_to_the_base_model():
    """Each answer is the one word of its kind (color, place, ...) in the input; the format is new."""
    tok = load_tokenizer(DATA / "tokenizer")
    train_p, heldout_p = course.task_paths()
    train = [json.loads(x) for x in train_p.read_text().splitlines()]
    heldout = [json.loads(x) for x in heldout_p.read_text().splitlines()]
    assert (len(train), len(heldout)) == (corpus.TASK_TRAIN_ROWS, corpus.TASK_HELDOUT_ROWS)
    for r in train + heldout:
        assert set(r) == {"instruction", "input", "output"} and all(isinstance(v, str) and v for v in r.values())
        assert r["output"] in words_of(r["input"]), r  # the answer is a word of the input
        kind = next(k for k in KINDS if r["output"] in k)  # ... and the only word of its kind there
        assert sum(w in kind for w in words_of(r["input"])) == 1, r
        assert r["instruction"].endswith("?")
        # a response starts a line; there the answer is 1 token (+ EOS appended by the data template)
        assert len(tok("\n" + r["output"], add_special_tokens=False)["input_ids"]) == 2, r["output"]
    key = lambda r: (r["instruction"], r["input"])  # noqa: E731
    assert not {key(r) for r in heldout} & {key(r) for r in train}
    assert len({key(r) for r in train}) == len(train)
    for rows in (train, heldout):  # every kind of question in both splits
        kinds = {re.sub(r"\b[A-Z][a-z]+\b|\b(" + "|".join(corpus.ANIMALS) + r")\b", "_", r["instruction"])
                 for r in rows}
        assert len(kinds) >= len(corpus.TASK_KINDS)
    # the instruction format never occurs in the pretraining text: no questions at all
    text = (DATA / "corpus_train.txt").read_text()
    assert "?" not in text and "Which" not in text and "What" not in text


def test_locations():
    assert course.data_dir() == DATA
    assert course.heldout_text_path() == DATA / "corpus_heldout.txt"
    assert course.task_paths() == (DATA / "task_train.jsonl", DATA / "task_heldout.jsonl")
    assert course.tokenizer_dir() == DATA / "tokenizer"


_FAKE_BUILDER = """
import os, sys, time
from amdllm.course import default_model as course
def fake_build(target, data=None, progress=True):
    with open(os.environ["BUILD_LOG"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(1.5)  # long enough for the other process to arrive while we hold the lock
    with course._staging(target) as tmp:
        (tmp / "config.json").write_text("{}")
course.build_default_model = fake_build
print(course.cached_model_dir())
"""


def test_concurrent_callers_build_once(tmp_path):
    """Without a current committed model (recipe or data changed), the first caller builds into the cache."""
    env = {**os.environ, "AMDLLM_HOME": str(tmp_path / "home"), "BUILD_LOG": str(tmp_path / "log"),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([sys.executable, "-c", _FAKE_BUILDER], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1] and Path(outs[0]).parent == tmp_path / "home"
    assert Path(outs[0]).name.startswith("default-model-")
    assert len((tmp_path / "log").read_text().split()) == 1  # one process built, the other waited
    assert not [p for p in (tmp_path / "home").iterdir() if p.is_dir() and p.name.startswith(".")]  # no debris


def test_training_recipe_is_deterministic():
    """Two runs of the default model's training step give identical bits: a rebuild reproduces the
    committed weights (on one JAX version and CPU kind). Short runs of the real shape and step."""
    import numpy as np
    from flax import nnx

    tok = load_tokenizer(DATA / "tokenizer")
    cfg = course.model_config(tok)
    tokens = course.token_stream(tok, (DATA / "corpus_train.txt").read_text()[:50_000], seed=0)
    recipe = {**course.TRAIN, "steps": 3, "batch_size": 2, "seq_len": 64, "warmup": 1}
    runs = [course.train(cfg, tokens, progress=False, **recipe) for _ in range(2)]
    assert runs[0][1] == runs[1][1]  # the logged losses
    a, b = (nnx.to_pure_dict(nnx.state(m)) for m, _ in runs)
    import jax
    flat_a, flat_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(flat_a) == len(flat_b) > 0
    for x, y in zip(flat_a, flat_b):
        assert np.array_equal(np.asarray(x), np.asarray(y))


# --------------------------------------------------------------------------------------------------
# The default model (committed in data/default_model/)
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def default_dir():
    return course.default_model_dir()


def test_committed_model_is_the_current_recipe_build(default_dir):
    assert default_dir == DATA / course.COMMITTED, "data/default_model/ is stale: python -m amdllm.course build --commit"
    report = json.loads((default_dir / "build_report.json").read_text())
    assert report["recipe_hash"] == course._recipe_hash(DATA)
    assert report["recipe"] == {"model": course.MODEL, "train": course.TRAIN}
    assert report["weights_sha256"] == course._sha256(default_dir / "model.safetensors")
    for name in TOKENIZER_FILES:  # the checkpoint carries the course tokenizer, unchanged
        assert (default_dir / name).read_bytes() == (DATA / "tokenizer" / name).read_bytes(), name


def test_default_model_is_a_small_gqa_llama_checkpoint(default_dir):
    from amdllm.config import LlamaConfig

    cfg = LlamaConfig.from_json(default_dir)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (8, 2, False)
    assert 2_000_000 < cfg.num_params() < 8_000_000
    tok = load_tokenizer(default_dir)
    assert len(tok) <= cfg.vocab_size and cfg.vocab_size % course.VOCAB_MULTIPLE == 0
    assert (cfg.bos_token_id, cfg.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    gen = json.loads((default_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id
    assert course.default_model_dir() == default_dir  # cached: the second call does not rebuild


def test_default_model_heldout_perplexity_with_transformers(default_dir):
    """The `amdllm eval` protocol (docs/cli.md) computed by transformers on the saved files: the model has learned."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(default_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(default_dir), local_files_only=True)
    ids = tok(course.heldout_text_path().read_text())["input_ids"]
    seq = course.EVAL_SEQ_LEN
    wins = [ids[i:i + seq] for i in range(0, len(ids), seq)]
    wins = [w for w in wins if len(w) >= 2]
    total, count = 0.0, 0
    with torch.no_grad():  # the full windows in one batch, then the shorter last one
        for group in ([w for w in wins if len(w) == seq], [w for w in wins if len(w) < seq]):
            if group:
                x = torch.tensor(group)                                   # [B, T]
                logp = torch.log_softmax(model(x).logits[:, :-1].double(), -1)
                total -= logp.gather(-1, x[:, 1:, None]).sum().item()
                count += x[:, 1:].numel()
    ppl = math.exp(total / count)
    report = json.loads((default_dir / "build_report.json").read_text())
    assert ppl < 10 and ppl < model.config.vocab_size / 100, ppl
    # amdllm's number at build time (JAX, before saving) matches transformers on the saved checkpoint
    np.testing.assert_allclose(report["heldout_perplexity"], ppl, rtol=1e-4)
    assert report["heldout_tokens"] == count


def test_default_model_greedy_continuation_is_corpus_text(default_dir):
    from amdllm.io.checkpoint import load
    from amdllm.infer.generate import generate

    model, tok = load(default_dir), load_tokenizer(default_dir)
    vocab = set(words_of((DATA / "corpus_train.txt").read_text()))
    prompt = "Once upon a time, there was a little purple otter named Hugo."
    r = generate(model, tok, prompt, max_new_tokens=40)[0]
    words = words_of(r["text"])
    assert len(words) >= 15, r["text"]
    assert set(words) <= vocab, (r["text"], set(words) - vocab)
    assert "lived" in words[:2], r["text"]  # in the corpus, a story's second sentence says where the hero lives
    assert r["text"].count(".") >= 2, r["text"]  # whole sentences


def test_default_model_copies_words_but_cannot_answer_the_task(default_dir):
    """What the course task builds on: the base model copies a quoted word of five kinds from earlier in a
    held-out story (the 150-step first recipe never did), but answers no task question (it tells stories)."""
    from amdllm.io.checkpoint import load
    from amdllm.train import task_accuracy

    model, tok = load(default_dir), load_tokenizer(default_dir)
    copied = course.quoted_word_accuracy(model, tok)
    assert set(copied) == set(corpus.QUOTES)
    assert all(copied[k] >= 0.9 for k in ("animal", "place", "number", "name", "food")), copied
    heldout = [json.loads(x) for x in course.task_paths()[1].read_text().splitlines()][:24]
    base = task_accuracy(model, tok, heldout, group_by=corpus.task_kind)
    assert list(base["by_group"]) == ["animal", "color", "place", "number", "name", "food"]  # kinds in turn
    assert base["task_accuracy"] == 0, base["samples"]
