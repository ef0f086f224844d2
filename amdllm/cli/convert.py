"""`amdllm convert`: any checkpoint we can read -> safetensors shards + tokenizer.json (amdllm.io.convert)."""
from __future__ import annotations

from amdllm.cli.common import emit
from amdllm.io.convert import convert


def run(args) -> int:
    r = convert(args.model, args.out, dtype=args.dtype, allow_pickle=args.allow_pickle,
                delta_base=args.delta_base, max_shard_size=args.max_shard_size, overwrite=args.overwrite)
    what = f"{args.model} + base {args.delta_base}" if args.delta_base else args.model
    emit(r, args.json, f"wrote {args.out}: {r['tensors']} tensors, {r['bytes'] / 1e9:.2f} GB {r['dtype']} in "
                       f"{len(r['files'])} safetensors file(s), tokenizer.json, from {what} ({r['seconds']:.1f} s)")
    return 0
