"""`amdllm plan`: memory per device, FLOPs per token and MFU for a model on a mesh (amdllm.parallel.plan)."""
from __future__ import annotations

from pathlib import Path

from amdllm.cli.common import add_run_shape_args, count, emit, model_dir, number
from amdllm.config import PRESETS, LlamaConfig
from amdllm.io.gptq_format import quant_config_of
from amdllm.parallel.plan import (DEVICE_MEMORY_GB, DTYPE_BYTES, PEAK_BF16_TFLOPS, fewest_devices, format_plan,
                                  least_remat, plan, remat_key)


def add_cli(sub) -> None:
    p = sub.add_parser("plan", help="memory per device, FLOPs per token and MFU for a model on a mesh")
    p.add_argument("--model", default=None, help="a preset (e.g. llama-3.1-405b) or an HF checkpoint directory")
    p.add_argument("--devices", type=count(), default=8)
    p.add_argument("--accelerator", default="mi300x", help="sets --device-memory and the MFU peak: "
                   + ", ".join(PEAK_BF16_TFLOPS) + ", cpu")
    p.add_argument("--device-memory", type=number(0, above=True), default=None,
                   help="GB per device (default: the accelerator's)")
    add_run_shape_args(p, plan=True)
    p.add_argument("--full-finetune", action="store_true", help="plan full fine-tuning instead")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    p.add_argument("--dtype", default="auto", choices=("auto",) + tuple(DTYPE_BYTES),
                   help="frozen weights and compute (auto: bfloat16, what finetune uses on an accelerator)")
    p.add_argument("--bits", type=int, choices=(2, 4, 8), default=None,
                   help="a GPTQ-packed base (QLoRA): projections at this many bits (default: a GPTQ --model "
                        "directory's own; otherwise unquantized)")
    p.add_argument("--group-size", type=int, default=None,
                   help="GPTQ group size with --bits (default: the directory's, else 128; -1: one group)")
    p.add_argument("--fewest-devices", action="store_true",
                   help="also find the fewest devices (an fsdp=N mesh, the rules' batch split) on which this "
                        "run fits, without remat and with --remat dots and full")
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
    bits, group_size = args.bits, args.group_size
    qc = quant_config_of(Path(args.model)) if args.model and Path(args.model).is_dir() else None
    if qc:
        bits = qc["bits"] if bits is None else bits
        group_size = qc["group_size"] if group_size is None else group_size
    if group_size is not None and bits is None:
        raise ValueError("--group-size needs --bits (or a GPTQ --model directory)")
    group_size = 128 if group_size is None else group_size
    if group_size not in (-1,) and group_size < 1:
        raise ValueError(f"--group-size {group_size}: expected a positive number of input rows, or -1")
    acc = args.accelerator.lower()
    mem = args.device_memory if args.device_memory is not None else DEVICE_MEMORY_GB.get(acc)
    if mem is None:
        raise ValueError(f"--device-memory is needed for accelerator {args.accelerator!r}")
    # the run's shape: what `plan` and `fewest_devices` are asked about alike
    shape = dict(rules=args.rules, lora_rank=args.rank, lora_targets=tuple(args.targets.split(",")),
                 full_finetune=args.full_finetune, batch_size=args.batch_size, seq_len=args.seq_len,
                 dtype="bfloat16" if args.dtype == "auto" else args.dtype, optimizer=args.optimizer, bits=bits,
                 group_size=group_size)
    p = plan(cfg, devices=args.devices, device_memory_gb=mem, mesh=args.mesh, accelerator=acc,
             tokens_per_s=args.tokens_per_second, **shape)
    p["model"] = args.model or "default"
    p["remat"] = (least_remat(p) or "full") if args.remat == "auto" else args.remat
    p["fits_as_run"] = p["fits" + remat_key(p["remat"])]
    human = format_plan(p)
    if args.remat != "none":
        human += f"\nas run (--remat {p['remat']}): {'fits' if p['fits_as_run'] else 'does NOT fit'}"
    if args.fewest_devices:
        p["fewest_devices"] = {key: fewest_devices(cfg, mem, remat=r, **shape) for key, r in
                               (("without_remat", "none"), ("with_remat_dots", "dots"), ("with_remat", "full"))}
        f = {k: v or "none up to 1024" for k, v in p["fewest_devices"].items()}
        human += (f"\nfewest {acc} devices ({mem:g} GB, fsdp=N): {f['without_remat']} without remat, "
                  f"{f['with_remat_dots']} with remat dots, {f['with_remat']} with remat full")
    emit(p, args.json, human)
    return 0
