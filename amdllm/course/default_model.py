"""The embedded default model and the course data: locate them, and (re)build the model.

The model is committed in `data/default_model/`: a small Llama trained from scratch on the course corpus
with `amdllm.train.step`, as an HF checkpoint with a build_report.json (the recipe's hash, the weights'
sha256). `default_model_dir()` returns it while the recipe's hash matches, else builds the recipe once
into `$AMDLLM_HOME/default-model-<hash>` (others wait on a file lock). Training is deterministic on one
JAX version and CPU kind: `python -m amdllm.course build --force` says whether a rebuild matches."""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from amdllm.progress import tqdm

from amdllm.config import LlamaConfig
import amdllm.course.corpus as corpus
from amdllm.files import atomic_write_text
from amdllm.infer.evaluate import perplexity
from amdllm.infer.generate import generate_ids
from amdllm.io.checkpoint import save
from amdllm.io.tokenizer import load_tokenizer, pad_id, save_for_transformers, train_bpe
from amdllm.model import Llama
from amdllm.train.step import TrainConfig, make_optimizer, make_train_step, split_params

BUILD_VERSION = 3  # bump when the recipe changes in a way the hashed settings below do not show (3: amdllm.train.step)
# The default model's shape: ~3.5M parameters, 8 query heads sharing 2 key/value heads.
MODEL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5,
             tie_word_embeddings=False)
VOCAB_MULTIPLE = 64  # the embedding rows are padded up to this (shards evenly over 8 or 64 devices)
# Training recipe: 1500 steps x 8 x 256 tokens (about 8 passes over the corpus). A recipe a tenth as long
# never learned to copy a word from its context, so no short LoRA run could teach it the course task.
# seq_len equals the evaluation window, so every position `amdllm eval` uses has been trained.
TRAIN = dict(seed=0, steps=1500, batch_size=8, seq_len=256, lr=3e-3, warmup=75, weight_decay=0.1, clip=1.0)
COMMITTED = "default_model"  # the committed build, under data/
EVAL_SEQ_LEN = 256


class CourseError(RuntimeError):
    """The course data or default model cannot be found or built; the message says where and why."""


# --------------------------------------------------------------------------------------------------
# Locations
# --------------------------------------------------------------------------------------------------
def amdllm_home() -> Path:
    return Path(os.environ.get("AMDLLM_HOME") or Path.home() / ".cache" / "amdllm")


def data_dir() -> Path:
    """The course data directory: $AMDLLM_DATA, else the repository's data/, else a generated copy.

    The generated copy (for an installed package without the repository) is written by the same
    deterministic generator the repository's files come from, so it is byte-identical to them.
    """
    if os.environ.get("AMDLLM_DATA"):
        d = Path(os.environ["AMDLLM_DATA"])
        if not (d / "corpus_train.txt").is_file():
            raise CourseError(f"AMDLLM_DATA={d}: no corpus_train.txt there")
        return d
    repo = Path(__file__).resolve().parents[2] / "data"
    if (repo / "corpus_train.txt").is_file() and (repo / "tokenizer" / "tokenizer.json").is_file():
        return repo
    return _generated_data_dir()


def _generated_data_dir() -> Path:

    key = hashlib.sha256(Path(corpus.__file__).read_bytes()).hexdigest()[:12]
    target = amdllm_home() / f"data-{key}"
    with _locked(target):
        if not target.is_dir():
            with _staging(target) as tmp:
                write_data(tmp)
    return target


def write_data(out: str | os.PathLike) -> list[Path]:
    """Generate every file in data/: the corpus, the task rows, and the tokenizer trained on the corpus."""

    out = Path(out)
    paths = corpus.write_all(out)
    tok = train_bpe([out / "corpus_train.txt"])
    return paths + save_for_transformers(tok, out / "tokenizer")


def heldout_text_path() -> Path:
    """The held-out course text: the default text of `amdllm eval`."""
    return data_dir() / "corpus_heldout.txt"


def task_paths() -> tuple[Path, Path]:
    """(train, held-out) JSONL files of the course instruction task (Alpaca rows)."""
    d = data_dir()
    return d / "task_train.jsonl", d / "task_heldout.jsonl"


def tokenizer_dir() -> Path:
    return data_dir() / "tokenizer"


def _recipe_hash(data: Path) -> str:
    h = hashlib.sha256(json.dumps([BUILD_VERSION, MODEL, VOCAB_MULTIPLE, TRAIN], sort_keys=True).encode())
    for f in (data / "corpus_train.txt", data / "tokenizer" / "tokenizer.json"):
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:12]


def committed_model_dir() -> Path:
    return data_dir() / COMMITTED


def committed_is_current(data: Path | None = None) -> bool:
    """Is data/default_model/ the build of today's recipe and data (by the hash in its report)?"""
    data = data or data_dir()
    report = data / COMMITTED / "build_report.json"
    if not (report.is_file() and (data / COMMITTED / "config.json").is_file()):
        return False
    return json.loads(report.read_text()).get("recipe_hash") == _recipe_hash(data)


def default_model_dir(build: bool = True) -> Path:
    """The default model's HF checkpoint directory: the committed one, or a cached build of the recipe."""
    if committed_is_current():
        return committed_model_dir()
    return cached_model_dir(build)


def cached_model_dir(build: bool = True) -> Path:
    """`$AMDLLM_HOME/default-model-<hash>`, built there (once, under a lock) if missing."""
    data = data_dir()
    target = amdllm_home() / f"default-model-{_recipe_hash(data)}"
    if (target / "config.json").is_file() or not build:
        return target
    with _locked(target):
        if not (target / "config.json").is_file():  # another process may have built it while we waited
            build_default_model(target, data)
    return target


@contextlib.contextmanager
def _locked(target: Path):
    """An exclusive fcntl lock beside `target`: concurrent builders wait instead of building twice."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _staging(target: Path):
    """A temporary directory beside `target`, renamed onto it on success (replacing an old one)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
        if target.exists():  # --force: move the old one aside first; a rename cannot overwrite a dir
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.rename(target, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# Building the default model
# --------------------------------------------------------------------------------------------------
def model_config(tokenizer):
    vocab = -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    return LlamaConfig(vocab_size=vocab, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **MODEL)


def token_stream(tokenizer, text: str, seed: int = 0):
    """The training token stream: `tokenizer(text)` (one story per line), with half the line breaks
    between stories replaced by EOS, chosen by `seed`.

    The held-out text (and `amdllm eval`) separates stories by newlines, so the model must predict
    those; EOS must also be a trained token, or the model could never learn to stop (a fine-tuned
    answer ends with EOS). Splitting the boundaries costs at most ln 2 nats on ~1% of the tokens.
    """
    ids = np.asarray(tokenizer(text)["input_ids"], np.int32)
    nl = tokenizer("\n", add_special_tokens=False)["input_ids"]
    assert len(nl) == 1, f"the tokenizer splits a newline into {nl}"  # true of byte-level BPE
    swap = (ids == nl[0]) & (np.random.default_rng(seed).random(len(ids)) < 0.5)
    return np.where(swap, np.int32(tokenizer.eos_token_id), ids)


def batches(tokens, steps: int, batch_size: int, seq_len: int, seed: int):
    """Random windows of the token stream, deterministic by seed: yields (inputs, targets) [B, T]."""
    rng = np.random.default_rng(seed)
    tokens = np.asarray(tokens, np.int32)
    for _ in range(steps):
        starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
        w = np.stack([tokens[s:s + seq_len + 1] for s in starts])  # [B, T+1]
        yield w[:, :-1], w[:, 1:]


def train(cfg, tokens, *, seed, steps, batch_size, seq_len, lr, warmup, weight_decay, clip,
          progress: bool = True):
    """Train a fresh model on `tokens` with the course's one training step (`amdllm.train.step`, every
    parameter trained: `full=True`); returns (model, losses)."""
    model = Llama(cfg, rngs=nnx.Rngs(seed))
    params, frozen = split_params(model, full=True)
    # no weight decay on norm weights (they start at one and decay would pull them to zero)
    decay_mask = jax.tree_util.tree_map_with_path(lambda p, _: not str(p[-1].key).endswith("norm"), params)
    tc = TrainConfig(steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, warmup=warmup,
                     weight_decay=weight_decay, clip=clip, b1=0.9, b2=0.95, seed=seed)
    optimizer, _ = make_optimizer(tc, decay_mask)
    opt_state = optimizer.init(params)
    step = make_train_step(model, optimizer, full=True)
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (1, batch_size, seq_len))
    ones = np.ones((1, batch_size, seq_len), np.int32)
    rng = jax.random.key(seed)  # unused: no dropout
    losses = []
    bar = tqdm(batches(tokens, steps, batch_size, seq_len, seed), total=steps, desc="default model",
               disable=not progress, file=sys.stderr)
    for i, (x, y) in enumerate(bar):
        batch = {"tokens": x[None], "targets": y[None], "positions": positions, "segment_ids": ones,
                 "weights": ones}  # one micro-batch [1, B, T]
        params, opt_state, metrics = step(params, opt_state, frozen, batch, rng)
        if i % 10 == 0 or i == steps - 1:
            losses.append((i, float(metrics["loss"])))
            bar.set_postfix(loss=f"{losses[-1][1]:.3f}")
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, {**params["top"], "layers": params["layers"]})
    nnx.update(model, state)
    return model, losses


def heldout_perplexity(model, tokenizer, path: Path, seq_len: int = EVAL_SEQ_LEN) -> dict:
    """The `amdllm eval` protocol (docs/cli.md): tokenizer(text), non-overlapping windows, mean NLL of tokens 1..n-1."""
    ids = tokenizer(path.read_text())["input_ids"]
    return dict(perplexity(model, ids, seq_len, progress=False))


def quoted_word_accuracy(model, tokenizer, text: str | None = None, per_kind: int = 24) -> dict[str, float]:
    """What pretraining taught about copying: in held-out stories, how often the model's greedy next
    token after an opening quote is the word the story quotes (`corpus.QUOTES`), per kind of word.

    The course task's answers are copied words of these kinds, so this is what LoRA can build on.
    """
    text = heldout_text_path().read_text() if text is None else text
    out = {}
    for kind, pairs in corpus.quote_prompts(text, per_kind).items():
        if not pairs:
            continue
        new = generate_ids(model, [tokenizer(p)["input_ids"] for p, _ in pairs], 1, eos_ids=(),
                           pad_id=pad_id(tokenizer))
        out[kind] = sum(tokenizer.decode(ids).strip() == word for ids, (_, word) in zip(new, pairs)) / len(pairs)
    return out


def save_checkpoint(model, out: Path, tokenizer_src: Path) -> None:
    """An HF checkpoint directory: config.json, model.safetensors, tokenizer files, generation_config."""
    save(model, out, tokenizer_from=tokenizer_src)
    cfg = model.cfg
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
           "do_sample": False, "max_length": cfg.max_position_embeddings}
    atomic_write_text(out / "generation_config.json", json.dumps(gen, indent=2) + "\n")


def build_default_model(target: Path, data: Path | None = None, progress: bool = True) -> dict:
    """Train and save the default model into `target` (atomically); returns the build report."""
    data = data or data_dir()
    t0, cpu0 = time.perf_counter(), time.process_time()
    tok = load_tokenizer(data / "tokenizer")
    cfg = model_config(tok)
    tokens = token_stream(tok, (data / "corpus_train.txt").read_text(), TRAIN["seed"])
    model, losses = train(cfg, tokens, progress=progress, **TRAIN)
    train_s = time.perf_counter() - t0
    ppl = heldout_perplexity(model, tok, data / "corpus_heldout.txt")
    report = {"recipe_hash": _recipe_hash(data), "params": cfg.num_params(), "vocab_size": cfg.vocab_size,
              "train_tokens": TRAIN["steps"] * TRAIN["batch_size"] * TRAIN["seq_len"],
              "final_loss": losses[-1][1], "heldout_perplexity": ppl["perplexity"],
              "heldout_tokens": ppl["tokens"], "train_seconds": round(train_s, 1),
              "build_seconds": round(time.perf_counter() - t0, 1),
              # CPU seconds of this process: on a busy machine, a fairer measure of the work than wall time
              "build_cpu_seconds": round(time.process_time() - cpu0, 1), "recipe": {"model": MODEL, "train": TRAIN}}
    with _staging(target) as tmp:
        save_checkpoint(model, tmp, data / "tokenizer")
        report["weights_sha256"] = _sha256(tmp / "model.safetensors")
        (tmp / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m amdllm.course", description="The embedded default model.")
    p.add_argument("action", choices=["build", "path", "data"], help="build: (re)build and report; "
                   "path: print the model directory (building if needed); data: regenerate data/")
    p.add_argument("--force", action="store_true", help="rebuild into the cache even if a model exists there "
                   "(slow: build_report.json records how long it took); the report says whether the weights match the committed ones")
    p.add_argument("--commit", action="store_true", help="rebuild from the recipe into data/default_model/")
    args = p.parse_args(argv)
    if args.action == "data":
        for f in write_data(Path(__file__).resolve().parents[2] / "data"):
            print(f"wrote {f}")
        return 0
    if args.action == "path":
        print(default_model_dir())
        return 0
    if args.commit:
        target = Path(__file__).resolve().parents[2] / "data" / COMMITTED
        report = build_default_model(target)  # (no lock file: it would land in data/)
    elif args.force:
        target = cached_model_dir(build=False)
        with _locked(target):
            report = build_default_model(target)
        committed = committed_model_dir() / "build_report.json"
        if committed.is_file():
            report["matches_committed"] = json.loads(committed.read_text())["weights_sha256"] == report["weights_sha256"]
    else:  # `make course` / `make test`: locate (build on first use) and say so in one line
        target = default_model_dir()
        report = json.loads((target / "build_report.json").read_text())
        how = "committed build of the current recipe" if target == committed_model_dir() else "cached build"
        print(f"default model: {_shown(target)} ({how}, {report['params'] / 1e6:.1f}M parameters, "
              f"held-out perplexity {report['heldout_perplexity']:.3f})")
        return 0
    print(json.dumps({"path": str(target), **{k: v for k, v in report.items() if k != "recipe"}}, indent=2))
    return 0


def _shown(path: Path) -> str:
    """A path relative to the working directory when it is under it (data/default_model), else whole."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    raise SystemExit(main())
