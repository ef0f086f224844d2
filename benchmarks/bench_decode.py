"""Decoding and prefill: amdllm (jitted KV-cache decode step) vs transformers `generate`, same weights.

Greedy, 128 new tokens (EOS disabled so both sides do the same work), batch 1 and batch 8, float32, on a
31M-parameter Llama (hidden 512, 8 layers, 8 heads / 2 kv heads, MLP 1408, vocab 8192). Also forward
(prefill) throughput on 8 x 256 tokens. Target: decoding >= 2x transformers at batch 1 and at batch 8.

    python benchmarks/bench_decode.py [--out bench_results] [--repeats 3] [--new-tokens 128]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternate, table, write_json  # noqa: E402

SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
PROMPT_LEN = 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from amdllm.io import checkpoint
    from amdllm.infer.generate import generate_ids
    from amdllm.model import to_pure, forward

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SHAPE, eos_token_id=None, pad_token_id=0)).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        model = checkpoint.load(tmp, dtype=jnp.float32)
    n = args.new_tokens
    rng = np.random.default_rng(0)
    rows, checks = [], {}
    for B in [int(b) for b in args.batches.split(",")]:
        prompts = rng.integers(3, SHAPE["vocab_size"], (B, PROMPT_LEN)).tolist()
        pt = torch.tensor(prompts)

        def ours():
            return generate_ids(model, prompts, n, eos_ids=())

        def theirs():
            with torch.no_grad():
                return hf.generate(pt, attention_mask=torch.ones_like(pt), do_sample=False,
                                   max_new_tokens=n, min_new_tokens=n, pad_token_id=0)

        a, b = ours(), theirs()[:, PROMPT_LEN:].tolist()
        checks[f"batch{B}_same_tokens"] = a == b
        stats = alternate({"amdllm": ours, "transformers": theirs}, args.repeats)
        tps = {k: B * n / v["median"] for k, v in stats.items()}
        rows.append({"what": f"decode batch {B}", "amdllm_tok_s": tps["amdllm"],
                     "transformers_tok_s": tps["transformers"], "ratio": tps["amdllm"] / tps["transformers"],
                     "spread_pct": max(v["spread_pct"] for v in stats.values()), "target": 2.0})

    # prefill / forward throughput, 8 x 256 tokens
    toks = rng.integers(3, SHAPE["vocab_size"], (8, 256))
    top, layers = to_pure(model)
    fwd = jax.jit(lambda t, l, x: forward(model.cfg, t, l, x)[0])
    jt, tt = jnp.asarray(toks), torch.tensor(toks)

    def ours_fwd():
        return fwd(top, layers, jt).block_until_ready()

    def theirs_fwd():
        with torch.no_grad():
            return hf(tt).logits

    diff = float(np.abs(np.asarray(ours_fwd()) - theirs_fwd().numpy()).max())
    stats = alternate({"amdllm": ours_fwd, "transformers": theirs_fwd}, args.repeats)
    tps = {k: toks.size / v["median"] for k, v in stats.items()}
    rows.append({"what": "forward 8x256", "amdllm_tok_s": tps["amdllm"], "transformers_tok_s": tps["transformers"],
                 "ratio": tps["amdllm"] / tps["transformers"],
                 "spread_pct": max(v["spread_pct"] for v in stats.values()), "target": None})
    checks["forward_max_abs_diff"] = diff
    print(table(rows, ["what", "amdllm_tok_s", "transformers_tok_s", "ratio", "spread_pct", "target"]))
    print("checks:", checks)
    write_json({"shape": SHAPE, "prompt_len": PROMPT_LEN, "new_tokens": n, "rows": rows, "checks": checks},
               args.out, "decode")


if __name__ == "__main__":
    main()
