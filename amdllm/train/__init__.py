"""Training: data (JSONL rows -> packed token rows), the compiled step (LoRA, or every weight), the loop, the report.

    from amdllm import train
    train.finetune(model, train.data.load_dataset(path, tokenizer, 256), "runs/lora", train.TrainConfig())
"""
from amdllm.train import data  # noqa: F401
from amdllm.train.checkpoints import list_checkpoints, load_checkpoint, resumable, save_checkpoint  # noqa: F401
from amdllm.train.loop import RESUME_KEYS, finetune, set_lora_copy  # noqa: F401
from amdllm.train.report import plot_loss, read_metrics, task_accuracy  # noqa: F401
from amdllm.train.step import (TrainConfig, TrainingError, accelerator_name, evaluate_loss,  # noqa: F401
                               flops_per_token, loss_fn, loss_sums, make_eval_step, make_optimizer,
                               make_train_step, peak_flops, place_batch, split_params, stack_batch)
