"""`--dataset` and `--protocol gptq` end to end on the course model, with no network: the course's
stories laid out as the Hub lays out C4 (documents of 1 to 6 stories, one per JSON line, `en/c4-*.json.gz`) and as a
wikitext-like `save_to_disk` set, then `amdllm quantize --dataset C4 --protocol gptq` and `amdllm eval`
of the full and the 4-bit model by both protocols. Each command runs in its own process.

    python benchmarks/standard_sets.py [--out build/standard_sets] [--samples 128] [--seq-len 256]

Prints a table and writes OUT/results.json. The stories are not C4: this checks the path a user takes
with the real sets (docs/cli.md, "Standard sets"); the numbers say nothing about published tables.
"""
from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def amdllm(*args) -> dict:
    p = subprocess.run([sys.executable, "-m", "amdllm.cli", *map(str, args), "--json"], capture_output=True,
                       text=True)
    if p.returncode:
        sys.exit(f"amdllm {' '.join(map(str, args))} failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout)


def build_sets(out: Path) -> tuple[Path, Path]:
    import datasets
    def documents(path):  # 1 to 6 stories each, so some are shorter than a window and some longer, as in C4
        stories = [s for s in (REPO / "data" / path).read_text().splitlines() if s]
        docs, i, n = [], 0, 1
        while i < len(stories):
            docs.append(" ".join(stories[i:i + n]))
            i, n = i + n, n % 6 + 1
        return docs
    train, held = documents("corpus_train.txt"), documents("corpus_heldout.txt")
    c4 = out / "c4-like"
    (c4 / "en").mkdir(parents=True)
    for name, docs in (("c4-train.00000-of-01024.json.gz", train), ("c4-validation.00000-of-00008.json.gz", held)):
        with gzip.open(c4 / "en" / name, "wt") as f:
            f.writelines(json.dumps({"text": d, "url": f"story/{i}"}) + "\n" for i, d in enumerate(docs))
    wiki = out / "wikitext-like"
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": held})}).save_to_disk(str(wiki))
    return c4, wiki


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="build/standard_sets")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    c4, wiki = build_sets(out)
    model = REPO / "data" / "default_model"
    q = amdllm("quantize", "--model", model, "--out", out / "gptq4", "--dataset", c4, "--protocol", "gptq",
               "--samples", args.samples, "--seq-len", args.seq_len, "--bits", 4, "--group-size", 128)
    rows = []
    for name, m in (("fp32", model), ("GPTQ 4-bit g128", out / "gptq4")):
        for ds in (wiki, c4):
            for proto in ("gptq", "amdllm"):
                r = amdllm("eval", "--model", m, "--dataset", ds, "--protocol", proto, "--seq-len", args.seq_len)
                rows.append({"model": name, "dataset": ds.name, "protocol": proto, "perplexity": r["perplexity"],
                             "windows": r["windows"], "predicted_tokens": r["tokens"]})
    (out / "results.json").write_text(json.dumps({"quantize": q, "eval": rows}, indent=1))
    print(f"quantize: {q['calibration']} in {q['seconds']} s")
    print(f"{'model':16s} {'dataset':14s} {'protocol':8s} {'perplexity':>10s} {'windows':>7s} {'tokens':>7s}")
    for r in rows:
        print(f"{r['model']:16s} {r['dataset']:14s} {r['protocol']:8s} {r['perplexity']:10.4f} {r['windows']:7d} "
              f"{r['predicted_tokens']:7d}")


if __name__ == "__main__":
    main()
