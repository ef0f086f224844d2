"""`amdllm eval`: perplexity of a text by the protocol in docs/cli.md (amdllm.infer.evaluate)."""
from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp

from amdllm.cli.common import check_context, emit, model_dir
from amdllm.cli.datasets import read_dataset
from amdllm.config import LlamaConfig
from amdllm.course import heldout_text_path
from amdllm.files import read_text
from amdllm.infer.evaluate import perplexity_of_windows
from amdllm.infer.generate import load_weights
from amdllm.infer.protocols import eval_windows
from amdllm.io.tokenizer import encoder
from amdllm.parallel.sharding import make_mesh


def run(args) -> int:
    dataset = read_dataset(args, ("test", "validation"))
    if dataset is not None:
        texts, rule, source = dataset
        what = f"{args.dataset} ({source['split']})"
    else:
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
        texts, rule, source = [read_text(text_path)], "wikitext2", {"text": str(text_path)}
    path = model_dir(args.model)
    cfg = LlamaConfig.from_json(path)  # before the text is tokenized
    args.seq_len = check_context(args.seq_len, cfg, path)
    # tokenized first (a broken tokenizer fails before the weights load), by `tokenizers` itself where the
    # checkpoint has a tokenizer.json: the same ids as transformers, without its import (and torch's)
    wins, report = eval_windows(texts, encoder(path), args.seq_len, args.protocol, rule)
    mesh = None if args.mesh is None else make_mesh(args.mesh, cfg=LlamaConfig.from_json(path), rules=args.rules)
    model = load_weights(path, args.adapter, args.dtype, args.allow_pickle, mesh=mesh, rules=args.rules,
                         decoding=False)
    r = {**perplexity_of_windows(model, wins, batch_size=args.batch_size), **source, **report,
         "dtype": str(jnp.dtype(model.dtype))}  # what --dtype (auto by default) chose
    emit(r, args.json, f"perplexity {r['perplexity']:.4f}  (nll {r['nll']:.4f} over {r['tokens']} "
                       f"tokens of {what}, seq_len {args.seq_len}, {args.protocol} protocol, {r['dtype']})")
    return 0
