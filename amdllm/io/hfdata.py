"""Texts of an evaluation or calibration set, read through the `datasets` library: a Hub name (`NAME` or
`NAME:CONFIG`; `wikitext2` and `c4` are short names), a `save_to_disk` directory, JSON / JSON-lines or
parquet files, or a directory laid out as the Hub's `allenai/c4` (shard 0 of the split, as the GPTQ
reference reads). With HF_HUB_OFFLINE=1 (as under `make`) only the local cache is read. Every failure is
one `DatasetError` naming the dataset and what is missing."""
from __future__ import annotations

import os
from pathlib import Path

ALIASES = {"wikitext2": ("wikitext", "wikitext-2-raw-v1"), "wikitext-2": ("wikitext", "wikitext-2-raw-v1"),
           "c4": ("allenai/c4", None)}
C4_SHARDS = {"train": "en/c4-train.00000-of-01024.json.gz",  # the shards the GPTQ reference reads
             "validation": "en/c4-validation.00000-of-00008.json.gz"}
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".gz": "json", ".parquet": "parquet"}


class DatasetError(ValueError):
    """A dataset that cannot be read as asked; the message names it and what is there instead."""


def is_c4(spec: str) -> bool:
    """Whether `spec` names C4 (the Hub's, or a directory laid out like it): its GPTQ rules differ."""
    p = Path(spec)
    if p.is_dir():
        return any((p / f).is_file() for f in C4_SHARDS.values())
    return spec.lower() in ("c4", "allenai/c4")


def load_texts(spec: str, split: str | None, column: str = "text", *, default_splits=("test", "validation")
               ) -> tuple[list[str], dict]:
    """(texts, info) of `column` in `split` of dataset `spec`. Without `split`, the first of
    `default_splits` the dataset has is read (or its only split)."""
    try:
        import datasets  # the [data] extra: imported when a dataset is read, not by every command
    except ImportError:
        raise DatasetError(f"--dataset {spec}: reading datasets needs the datasets package "
                           "(pip install 'amdllm[data]')") from None
    datasets.disable_progress_bars()
    ds, split = _open(datasets, spec, split, default_splits)
    if column not in ds.column_names:
        raise DatasetError(f"--dataset {spec}: split {split!r} has no column {column!r}; its columns are "
                           f"{ds.column_names} (pass --column)")
    texts = ds[column]
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise DatasetError(f"--dataset {spec}: row {bad} of column {column!r} is {type(texts[bad]).__name__}, "
                           "expected text")
    return texts, {"dataset": spec, "split": split, "column": column, "rows": len(texts)}


def _open(datasets, spec: str, split: str | None, default_splits):
    """(Dataset, split name) for `spec`; errors as DatasetError."""
    p = Path(spec)
    try:
        if p.is_dir() and ((p / "dataset_dict.json").is_file() or (p / "state.json").is_file()):
            return _pick(datasets.load_from_disk(str(p)), spec, split, default_splits)
        if p.is_dir() and is_c4(spec):
            have = [s for s, f in C4_SHARDS.items() if (p / f).is_file()]
            want = split or next((s for s in default_splits if s in have), have[0])
            if want not in have:
                raise DatasetError(f"--dataset {spec}: no split {want!r}; this C4 copy has "
                                   f"{[s for s, f in C4_SHARDS.items() if (p / f).is_file()]}")
            return datasets.load_dataset("json", data_files=str(p / C4_SHARDS[want]), split="train"), want
        if p.exists():
            files = sorted(f for f in (p.rglob("*") if p.is_dir() else [p]) if f.suffix in FILE_BUILDERS)
            builders = {FILE_BUILDERS[f.suffix] for f in files}
            if not files or len(builders) > 1:
                raise DatasetError(f"--dataset {spec}: expected a save_to_disk directory, or JSON/JSON-lines/"
                                   "parquet files (one kind), found "
                                   f"{sorted(f.name for f in p.iterdir())[:8] if p.is_dir() else p.name}")
            ds = datasets.load_dataset(builders.pop(), data_files=[str(f) for f in files], split="train")
            if split not in (None, "train"):
                raise DatasetError(f"--dataset {spec}: files have one split, 'train'; got --split {split}")
            return ds, "train"
        if spec.startswith((".", "/", "~")) or spec.count("/") > 1 or p.suffix in FILE_BUILDERS:
            raise DatasetError(f"--dataset {spec}: no such file or directory")
        name, _, config = spec.partition(":")
        name, config = ALIASES.get(spec.lower(), (name, config or None))
        if name == "allenai/c4":
            want = split or next(s for s in (*default_splits, "validation") if s in C4_SHARDS)
            if want not in C4_SHARDS:
                raise DatasetError(f"--dataset {spec}: no split {want!r}; C4 has {list(C4_SHARDS)}")
            return datasets.load_dataset(name, data_files={want: C4_SHARDS[want]}, split=want), want
        return _pick(datasets.load_dataset(name, config), spec, split, default_splits)
    except DatasetError:
        raise
    except Exception as e:  # datasets raises many types (FileNotFoundError, ConnectionError, its own)
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        hint = (" HF_HUB_OFFLINE is set, so only the local cache is read: run once without it, or pass a "
                "local copy" if offline and not p.exists() else "")
        raise DatasetError(f"--dataset {spec}: cannot be read ({type(e).__name__}: {why}).{hint}") from None


def _pick(ds, spec: str, split: str | None, default_splits):
    """One split of a DatasetDict (or the Dataset itself)."""
    if not hasattr(ds, "keys"):  # one Dataset: its split is whatever it was saved as
        return ds, split or str(getattr(ds, "split", None) or "train")
    have = list(ds.keys())
    if split is None:
        split = next((s for s in default_splits if s in have), have[0] if len(have) == 1 else None)
        if split is None:
            raise DatasetError(f"--dataset {spec}: pass --split; it has {have}")
    if split not in have:
        raise DatasetError(f"--dataset {spec}: no split {split!r}; it has {have}")
    return ds[split], split
