"""`amdllm generate`: text from a prompt, greedy or top-p (amdllm.infer.generate)."""
from __future__ import annotations

import jax.numpy as jnp

from amdllm.cli.common import add_model_args, count, emit, model_dir, number
from amdllm.infer.generate import generate, load_model


def add_cli(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (greedy or top-p sampling)")
    add_model_args(p)
    p.add_argument("--prompt", required=True, help="prompt text, tokenized as tokenizer(prompt)")
    p.add_argument("--max-new-tokens", type=count(0), default=64)
    p.add_argument("--temperature", type=number(0), default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=number(0, 1, above=True), default=1.0)
    p.add_argument("--seed", type=count(0), default=0)
    p.set_defaults(func=run)


def run(args) -> int:
    model, tokenizer, _ = load_model(model_dir(args.model), args.adapter, args.dtype, args.allow_pickle)
    r = generate(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_p,
                 args.seed)[0]
    r["dtype"] = str(jnp.dtype(model.dtype))  # what --dtype (auto by default) chose
    human = (f"{args.prompt}{r['text']}\n\n[{r['prompt_tokens']} prompt tokens, {r['new_tokens']} new, "
             f"{r['tokens_per_second']:.1f} tokens/s, {r['dtype']}]")
    emit(r, args.json, human)
    return 0
