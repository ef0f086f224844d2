"""`amdllm generate`: text from a prompt, greedy or top-p (amdllm.infer.generate)."""
from __future__ import annotations

import jax.numpy as jnp

from amdllm.cli.common import emit, model_dir
from amdllm.infer.generate import generate, load_model


def run(args) -> int:
    model, tokenizer, _ = load_model(model_dir(args.model), args.adapter, args.dtype, args.allow_pickle)
    r = generate(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_p,
                 args.seed)[0]
    r["dtype"] = str(jnp.dtype(model.dtype))  # what --dtype (auto by default) chose
    human = (f"{args.prompt}{r['text']}\n\n[{r['prompt_tokens']} prompt tokens, {r['new_tokens']} new, "
             f"{r['tokens_per_second']:.1f} tokens/s, {r['dtype']}]")
    emit(r, args.json, human)
    return 0
