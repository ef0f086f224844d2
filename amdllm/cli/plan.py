"""`amdllm plan`: memory per device, FLOPs per token and MFU for a model on a mesh (amdllm.parallel.plan)."""
from __future__ import annotations

from pathlib import Path

from amdllm.cli.common import count, emit, model_dir, number
from amdllm.config import PRESETS, LlamaConfig
from amdllm.parallel.plan import DEVICE_MEMORY_GB, DTYPE_BYTES, PEAK_BF16_TFLOPS, format_plan, plan
from amdllm.parallel.sharding import DEFAULT_RULES, RULES


def add_cli(sub) -> None:
    p = sub.add_parser("plan", help="memory per device, FLOPs per token and MFU for a model on a mesh")
    p.add_argument("--model", default=None, help="a preset (e.g. llama-3.1-405b) or an HF checkpoint directory")
    p.add_argument("--devices", type=count(), default=8)
    p.add_argument("--accelerator", default="mi300x", help="sets --device-memory and the MFU peak: "
                   + ", ".join(PEAK_BF16_TFLOPS) + ", cpu")
    p.add_argument("--device-memory", type=number(0, above=True), default=None,
                   help="GB per device (default: the accelerator's)")
    p.add_argument("--mesh", default=None, help="e.g. fsdp=8, data=2,fsdp=4 (default: all devices on fsdp)")
    p.add_argument("--rules", default=None, choices=sorted(RULES),
                   help=f"sharding preset: {', '.join(RULES)} (default {DEFAULT_RULES})")
    p.add_argument("--lora-rank", type=count(0), default=0, help="plan LoRA training with this rank (0: no LoRA)")
    p.add_argument("--targets", default="q,k,v,o", help="LoRA target projections")
    p.add_argument("--full-finetune", action="store_true", help="plan full fine-tuning instead")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    p.add_argument("--batch-size", type=count(), default=1)
    p.add_argument("--seq-len", type=count(), default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPE_BYTES))
    p.add_argument("--tokens-per-second", type=number(0, above=True), default=None,
                   help="also report the MFU this implies")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.model is None:
        cfg = LlamaConfig.from_json(model_dir(None))
    elif args.model.lower() in PRESETS:
        cfg = PRESETS[args.model.lower()]
    elif not Path(args.model).exists():
        raise ValueError(f"--model {args.model}: neither a preset ({', '.join(sorted(PRESETS))}) nor a "
                         "checkpoint directory")
    else:
        cfg = LlamaConfig.from_json(args.model)
    acc = args.accelerator.lower()
    mem = args.device_memory if args.device_memory is not None else DEVICE_MEMORY_GB.get(acc)
    if mem is None:
        raise ValueError(f"--device-memory is needed for accelerator {args.accelerator!r}")
    p = plan(cfg, devices=args.devices, device_memory_gb=mem, mesh=args.mesh, rules=args.rules,
             lora_rank=args.lora_rank, lora_targets=tuple(args.targets.split(",")),
             full_finetune=args.full_finetune, batch_size=args.batch_size, seq_len=args.seq_len,
             dtype=args.dtype, optimizer=args.optimizer, accelerator=acc, tokens_per_s=args.tokens_per_second)
    p["model"] = args.model or "default"
    emit(p, args.json, format_plan(p))
    return 0
