"""`amdllm convert`: any checkpoint we can read -> safetensors shards + tokenizer.json (amdllm.io.convert)."""
from __future__ import annotations

from amdllm.cli.common import add_pickle_arg, emit
from amdllm.io.convert import DTYPES, convert


def add_cli(sub) -> None:
    p = sub.add_parser("convert", help="rewrite a checkpoint (pickled .bin, SentencePiece, delta weights) as "
                                       "safetensors + tokenizer.json")
    p.add_argument("--model", required=True, help="source checkpoint directory (with --delta-base: the delta)")
    p.add_argument("--out", required=True, help="new directory (refused if it exists and is not empty)")
    add_pickle_arg(p)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="stored dtype (default: the source's; float16 when applying a delta)")
    p.add_argument("--delta-base", default=None,
                   help="base checkpoint the --model delta weights apply to (FastChat's apply_delta rule)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run)


def run(args) -> int:
    r = convert(args.model, args.out, dtype=args.dtype, allow_pickle=args.allow_pickle,
                delta_base=args.delta_base, max_shard_size=args.max_shard_size, overwrite=args.overwrite)
    what = f"{args.model} + base {args.delta_base}" if args.delta_base else args.model
    emit(r, args.json, f"wrote {args.out}: {r['tensors']} tensors, {r['bytes'] / 1e9:.2f} GB {r['dtype']} in "
                       f"{len(r['files'])} safetensors file(s), tokenizer.json, from {what} ({r['seconds']:.1f} s)")
    return 0
