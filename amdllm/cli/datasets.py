"""`--dataset`, `--split`, `--column` and `--protocol`, as `eval` and `quantize` both take them."""
from __future__ import annotations

import argparse

from amdllm.infer.protocols import PROTOCOLS
from amdllm.io.hfdata import is_c4, load_texts


def add_dataset_args(p: argparse.ArgumentParser, source, *, what: str, default_split: str,
                     protocol_help: str) -> None:
    """`--dataset` joins the mutually exclusive `source` group (beside --text or --calib)."""
    source.add_argument("--dataset", default=None,
                        help=f"{what}, by Hub name (wikitext2, c4, NAME[:CONFIG]) or local path (save_to_disk "
                             "directory, JSON/JSON-lines/parquet files, a C4 shard layout)")
    p.add_argument("--split", default=None, help=f"the dataset's split (default: {default_split})")
    p.add_argument("--column", default="text", help="the dataset's text column (default: text)")
    p.add_argument("--protocol", choices=PROTOCOLS, default="amdllm", help=protocol_help)


def read_dataset(args, default_splits: tuple[str, ...]) -> tuple[list[str], str, dict] | None:
    """(texts, the GPTQ rule for them, what was read) of --dataset; None without one (then --split and
    --column, which choose a part of a dataset, are refused)."""
    if args.dataset is None:
        if args.split is not None or args.column != "text":
            raise ValueError("--split and --column choose a part of a --dataset; pass --dataset too")
        return None
    texts, info = load_texts(args.dataset, args.split, args.column, default_splits=default_splits)
    return texts, "c4" if is_c4(args.dataset) else "wikitext2", info
