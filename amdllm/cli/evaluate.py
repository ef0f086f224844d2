"""`amdllm eval`: perplexity of a text by the protocol in docs/cli.md (amdllm.infer.evaluate)."""
from __future__ import annotations

import sys
from pathlib import Path

from amdllm.cli.common import add_model_args, emit, model_dir
from amdllm.course import heldout_text_path
from amdllm.infer.evaluate import perplexity
from amdllm.infer.generate import load_weights
from amdllm.io.tokenizer import encode_fast


def add_cli(sub) -> None:
    p = sub.add_parser("eval", help="perplexity of a text (protocol: docs/cli.md)")
    add_model_args(p)
    p.add_argument("--text", default=None, help="UTF-8 text file (default: the held-out course text)")
    p.add_argument("--seq-len", type=int, default=256, help="window length in tokens")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.text is None:
        text_path = Path(heldout_text_path())
        what = f"the course's held-out stories ({text_path})"
        if args.model is not None:  # a user's model measured on our stories is rarely what they meant
            print(f"amdllm eval: no --text given: measuring {what}; pass --text FILE for your own text",
                  file=sys.stderr)
    else:
        text_path = Path(args.text)
        what = str(text_path)
    if not text_path.is_file():
        raise FileNotFoundError(f"--text {text_path}: no such file")
    text = text_path.read_text(encoding="utf-8")
    path = model_dir(args.model)
    # tokenized first (a broken tokenizer fails before the weights load), by `tokenizers` itself where the
    # checkpoint has a tokenizer.json: the same ids as transformers, without its import (and torch's)
    ids = encode_fast(path, text)
    model = load_weights(path, args.adapter, args.dtype, args.allow_pickle)
    r = perplexity(model, ids, seq_len=args.seq_len, batch_size=args.batch_size)
    r["text"] = str(text_path)
    emit(r, args.json, f"perplexity {r['perplexity']:.4f}  (nll {r['nll']:.4f} over {r['tokens']} "
                       f"tokens of {what}, seq_len {args.seq_len})")
    return 0
