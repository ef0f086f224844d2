"""What a fine-tuning run reports: task accuracy by greedy exact match, the metrics log, the loss plot."""
from __future__ import annotations

import json
import os
from pathlib import Path

from amdllm.infer.generate import generate_ids, tokenizer_eos_ids
from amdllm.io.tokenizer import pad_id as tokenizer_pad_id
import amdllm.train.data as data_mod


def task_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int | None = None,
                  batch_size: int = 64, group_by=None) -> dict:
    """Exact match of greedy generations against the 'output' of Alpaca rows (stripped).

    `group_by(row) -> str` (e.g. `corpus.task_kind`) adds "by_group": {group: accuracy}, in first-seen order.
    """
    rows = [r for r in rows if "output" in r and "instruction" in r]
    if not rows:
        return {}
    prompts = [data_mod.prompt_ids(r, tokenizer) for r in rows]
    if max_new_tokens is None:
        max_new_tokens = 4 + max(len(tokenizer(r["output"], add_special_tokens=False)["input_ids"]) for r in rows)
    pad = tokenizer_pad_id(tokenizer)
    eos = tokenizer_eos_ids(model, tokenizer)
    hits, examples, groups = [], [], {}
    for i in range(0, len(rows), batch_size):
        new = generate_ids(model, prompts[i:i + batch_size], max_new_tokens, eos_ids=eos, pad_id=pad,
                           keep_eos=False)
        for r, ids in zip(rows[i:i + batch_size], new):
            text = tokenizer.decode(ids, skip_special_tokens=True).strip()
            hits.append(text == r["output"].strip())
            if len(examples) < 3:
                examples.append({"expected": r["output"], "got": text})
            if group_by is not None:
                groups.setdefault(group_by(r), []).append(hits[-1])
    out = {"task_accuracy": sum(hits) / len(rows), "task_examples": len(rows), "samples": examples}
    if group_by is not None:
        out["by_group"] = {g: sum(h) / len(h) for g, h in groups.items()}
    return out


def read_metrics(path) -> list[dict]:
    return [json.loads(l) for l in Path(path).read_text().splitlines() if l.strip()]


def plot_loss(metrics, title: str = "LoRA fine-tuning"):
    """Loss curve (train loss per step, eval loss and task accuracy when present). Returns the figure."""
    recs = read_metrics(metrics) if isinstance(metrics, (str, os.PathLike)) else list(metrics)
    train = [r for r in recs if "loss" in r]
    evals = [r for r in recs if r.get("event") == "eval"]
    import matplotlib.pyplot as plt  # ~0.9 s to import: paid by a plot, not by every `amdllm` command
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", lw=1)
    ev = [r for r in evals if "eval_loss" in r]
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    acc = [r for r in evals if "task_accuracy" in r]
    if acc:
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in acc], [r["task_accuracy"] for r in acc], "s--", color="tab:green",
                 label="exact match")
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("held-out exact match")
        ax2.legend(loc="center right")
    ax.legend(loc="upper right")
    fig.tight_layout()
    return fig
