"""What `--dataset`, `--split` and `--column` read, for `eval` and `quantize` (`amdllm.cli.parser` declares them)."""
from __future__ import annotations

from amdllm.io.hfdata import is_c4, load_texts


def read_dataset(args, default_splits: tuple[str, ...]) -> tuple[list[str], str, dict] | None:
    """(texts, the GPTQ rule for them, what was read) of --dataset; None without one (then --split and
    --column, which choose a part of a dataset, are refused)."""
    if args.dataset is None:
        if args.split is not None or args.column != "text":
            raise ValueError("--split and --column choose a part of a --dataset; pass --dataset too")
        return None
    texts, info = load_texts(args.dataset, args.split, args.column, default_splits=default_splits)
    return texts, "c4" if is_c4(args.dataset) else "wikitext2", info
