"""Which model the course runs on: `make course MODEL=smollm2` (the runner's `--model`).

"default" is the embedded toy: fast, and what the tests check the mechanics on. "smollm2" is
SmolLM2-135M-Instruct (`amdllm.course.chat_model`), a real pretrained chat model, with sizes for 135M
parameters. It reads English prose (`amdllm.course.english`) where the toy reads the generated stories,
which a real model finds too easy to show what rounding costs. Lesson 03 trains it on two-digit sums
(`corpus.sum_rows`), as copying one word is too easy for it to show what rank and targets change."""
from __future__ import annotations

from pathlib import Path

from amdllm.course.chat_model import chat_model_dir
from amdllm.course.corpus import jsonl, sum_rows
from amdllm.course.default_model import task_paths
from amdllm.course.english import calibration_text, evaluation_text
from amdllm.files import atomic_write_text

COURSE_MODELS = ("default", "smollm2")

# Per lesson: full sizes, then what --quick changes (the tests). GPTQ needs 2 x in_features calibration
# tokens per projection (down_proj reads 1536 features), so the quick run keeps 12 windows of 256.
# Lesson 05 scores the held-out task rows seven times (two runs' before and after, three models): its
# quick run reads the first QUICK_EVAL_ROWS of them.
QUICK_EVAL_ROWS = 32
SMOLLM2 = {
    "03_lora_finetuning": ({"train_steps": 40, "batch_size": 4, "seq_len": 128, "eval_examples": 60},
                           {"train_steps": 8, "batch_size": 2, "eval_examples": 6}),
    "04_gptq_quantization": ({"group_size": 64, "calib_samples": 32, "eval_tokens": 16384},
                             {"calib_samples": 12, "eval_tokens": 2048}),
    "05_inference_and_serving": ({"group_size": 64, "lora_steps": 40, "lora_batch_size": 4, "calib_samples": 16},
                                 {"lora_steps": 6, "lora_batch_size": 2, "max_new_tokens": 16,
                                  "quant_method": "rtn"}),
}


def model_params(model: str, out: Path, quick: bool) -> dict[str, dict]:
    """{notebook name: parameters} for `model`; its texts and task rows are written under OUT/work/."""
    if model not in COURSE_MODELS:
        raise ValueError(f"--model {model!r}: expected one of {', '.join(COURSE_MODELS)}")
    if model == "default":
        return {}
    work = Path(out).resolve() / "work"
    calib, held = work / "english" / "calibration.txt", work / "english" / "evaluation.txt"
    sums_train, sums_held = work / "sums" / "sums_train.jsonl", work / "sums" / "sums_heldout.jsonl"
    train_rows = sum_rows(2000, seed=1)
    for path, text in ((calib, calibration_text()), (held, evaluation_text()), (sums_train, jsonl(train_rows)),
                       (sums_held, jsonl(sum_rows(200, seed=2, exclude={r["input"] for r in train_rows})))):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
    common = {"model_dir": str(chat_model_dir()), "calib_text": str(calib), "eval_text": str(held)}
    params = {}
    for name in ("01_weight_conversion", "02_mesh_sharding", *SMOLLM2):
        full, small = SMOLLM2.get(name, ({}, {}))
        params[name] = {**common, **full, **(small if quick else {})}
    params["03_lora_finetuning"].update(train_data=str(sums_train), eval_data=str(sums_held))
    if quick:
        task_train, task_held = task_paths()
        first = work / "task" / f"{task_held.stem}_first{QUICK_EVAL_ROWS}.jsonl"
        first.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(first, "".join(task_held.read_text().splitlines(keepends=True)[:QUICK_EVAL_ROWS]))
        params["05_inference_and_serving"].update(train_data=str(task_train), eval_data=str(first))
    return params
