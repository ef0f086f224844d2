"""`amdllm plan`: memory per device, FLOPs per token and MFU for a model on a mesh (amdllm.parallel.plan)."""
from __future__ import annotations

from pathlib import Path

from amdllm.cli.common import check_context, emit, model_dir
from amdllm.config import PRESETS, LlamaConfig
from amdllm.io.gptq_format import quant_config_of
from amdllm.quant.gptq import check_group_size
from amdllm.parallel.plan import (DEVICE_MEMORY_GB, fewest_devices, format_plan, least_remat, plan,
                                  remat_key)


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
    args.seq_len = check_context(args.seq_len, cfg, args.model or "the default model")
    bits, group_size = args.bits, args.group_size
    qc = quant_config_of(Path(args.model)) if args.model and Path(args.model).is_dir() else None
    if qc:
        bits = qc["bits"] if bits is None else bits
        group_size = qc["group_size"] if group_size is None else group_size
    if group_size is not None and bits is None:
        raise ValueError("--group-size needs --bits (or a GPTQ --model directory)")
    group_size = 128 if group_size is None else group_size
    if bits is not None:  # what `quantize` would refuse is not planned
        check_group_size(cfg, group_size, args.model or "the default model")
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
