"""`amdllm finetune`: LoRA training from the command line (amdllm.train.loop; flags and file I/O here)."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from amdllm.cli import cluster
from amdllm.cli.cluster import cluster_of
from amdllm.cli.common import check_context, emit
from amdllm.cli.common import model_dir as resolve_model_dir
from amdllm.config import LlamaConfig
from amdllm.io import checkpoint
from amdllm.io.gptq_format import quant_config_of
from amdllm.files import atomic_write_text, check_output_dir, output_lock
from amdllm.io.templates import TEMPLATE_FILE, use_chat_template
from amdllm.io.tokenizer import load_tokenizer
from amdllm.model import lora as lora_mod
from amdllm.parallel.plan import GB, device_memory, least_remat, remat_key
from amdllm.parallel.plan import plan as plan_run
from amdllm.parallel.sharding import make_mesh, placement
from amdllm.train import data as data_mod
from amdllm.train.checkpoints import check_run_dir, resumable
from amdllm.train.loop import TrainConfig, check_batch_splits, finetune, rss_now


def run(args) -> int:
    if cluster_of(args)["source"] != "single":  # several processes share --out; process 0 writes it
        return _run(args)
    check_out(args, contents=False)  # an --out inside an input is refused before a lock file is made
    with output_lock(args.out, "finetune"):
        return _run(args)


def check_out(args, contents: bool = True) -> str:
    """Before anything is loaded: --out is no input, and (contents) an earlier adapter or run in it is
    replaced only when asked -> the model directory."""
    model_dir = resolve_model_dir(args.model)
    inputs = [("--model", model_dir), ("--data", args.data), ("--eval-data", args.eval_data),
              ("--chat-template", args.chat_template)]
    check_output_dir(args.out, inputs, command="finetune", overwrite=args.overwrite,
                     allowed=not contents or (args.resume and resumable(args.out)))
    if contents:
        check_run_dir(args.out, args.steps, args.resume)
    return model_dir


def _run(args) -> int:
    model_dir = check_out(args)  # under the lock: what --out holds is checked by the one writing it
    several = cluster_of(args)["source"] != "single"
    # a GPTQ base (QLoRA): its quantization config is checked here, before the data and the weights
    quant = quant_config_of(Path(model_dir))
    if args.merge and quant:
        raise ValueError(f"--merge with a quantized base ({model_dir} is GPTQ {quant['bits']}-bit): the adapter "
                         "cannot be folded into packed integer weights; merge it into the full-precision model "
                         "and quantize the result, or serve the adapter on the GPTQ model "
                         "(`amdllm serve --model GPTQ_DIR --adapter OUT`)")
    if args.merge and several:
        raise ValueError("--merge with several processes: the merged model would be gathered whole into one; "
                         "merge the adapter afterwards in one process (docs/cli.md, 'Several processes')")
    cfg = LlamaConfig.from_json(model_dir)
    args.seq_len = check_context(args.seq_len, cfg, model_dir)
    # the data is read and tokenized before the weights load: a bad row costs seconds, not a model load
    tok = use_chat_template(load_tokenizer(model_dir), args.chat_template)
    ds = data_mod.load_dataset(args.data, tok, args.seq_len, pack=not args.no_pack, too_long=args.too_long)
    eval_ds = rows = None
    if args.eval_data:
        eval_ds = data_mod.load_dataset(args.eval_data, tok, args.seq_len, pack=not args.no_pack,
                                        too_long=args.too_long)
        rows = eval_ds.rows
    cluster.join(args)  # several processes: JAX's runtime first, before anything touches a device
    dtype = args.dtype
    compute = dtype
    if dtype == "auto":  # docs/cli.md: bfloat16 on an accelerator; on a CPU the step computes in float32,
        # over a bfloat16 base held as it is stored (half the memory; XLA:CPU widens bf16 products anyway)
        on_cpu = jax.default_backend() == "cpu"
        stored = checkpoint.stored_dtype(Path(model_dir))
        dtype = "bfloat16" if not on_cpu or (stored == "bfloat16" and not quant) else "float32"
        compute = "float32" if on_cpu else dtype
    spec = args.mesh or ("auto" if jax.device_count() > 1 else None)
    mesh = make_mesh(spec, cfg=cfg, rules=args.rules) if spec else None
    check_batch_splits(args.batch_size, mesh, args.rules)
    planned, remat = check_plan(args, cfg, mesh, dtype, quant)
    rss_before = rss_now()
    # the frozen base straight into the mesh, in the dtype asked for: each device reads only its blocks;
    # LoRA factors and AdamW state are float32, created already split (amdllm.model.lora)
    model = checkpoint.load(model_dir, dtype=jnp.dtype(dtype), compute_dtype=jnp.dtype(compute), remat=remat,
                            allow_pickle=args.allow_pickle, mesh=mesh, rules=args.rules)
    lora_mod.apply_lora(model, rank=args.rank, alpha=args.alpha, dropout=args.dropout, targets=args.targets,
                        seed=args.seed, place=None if mesh is None else placement(mesh, args.rules))
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    rss_loaded = rss_now()
    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum,
                     seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay,
                     clip=args.clip, seed=args.seed, log_every=args.log_every, eval_every=args.eval_every,
                     save_every=args.save_every, keep=args.keep)
    res = finetune(model, ds, args.out, tc, eval_ds=eval_ds, tokenizer=tok, task_rows=rows, mesh=mesh,
                   rules=args.rules, resume=args.resume, progress=not args.no_progress,
                   base_model_dir=str(model_dir), planned_bytes=planned)
    if getattr(tok, "chat_template", None) and jax.process_index() == 0:  # `serve --adapter OUT` renders alike
        atomic_write_text(Path(args.out) / TEMPLATE_FILE, tok.chat_template)
    if args.merge:
        merged = lora_mod.merge_lora(model)
        res["merged_dir"] = str(checkpoint.save(merged, Path(args.out) / "merged", tokenizer_from=model_dir))
    res.pop("losses")
    res["dtype"], res["compute_dtype"], res["remat"] = dtype, compute, remat
    res["memory"].update(anon_before_load_bytes=rss_before, anon_after_load_bytes=rss_loaded)
    loss = "n/a (resumed at the end)" if res["final_loss"] is None else f"{res['final_loss']:.4f}"
    human = (f"trained {res['steps']} steps: loss {loss}, "
             f"{res['tokens_per_second']:,.0f} tokens/s, MFU {100 * res['mfu']:.1f}%; adapter in {args.out}")
    if res.get("eval"):
        human += "\n" + json.dumps(res["eval"])
    emit(res, args.json, human)
    return 0


def check_plan(args, cfg, mesh, dtype: str, quant: dict | None) -> tuple[int, str]:
    """(the planner's per-device bytes for this run, its remat mode: --remat auto becomes the least recompute
    that fits); a run the plan says cannot fit is refused before any weight is read. quant: a GPTQ base's
    quantization config (QLoRA: the packed bytes are planned)."""
    if args.device_memory is not None:
        have, where = args.device_memory * GB, "--device-memory"
    else:
        have, where = device_memory()
    sizes = None if mesh is None else dict(mesh.shape)
    p = plan_run(cfg, devices=1 if mesh is None else mesh.size, device_memory_gb=have / GB, mesh=sizes,
                 rules=args.rules, lora_rank=args.rank, lora_targets=tuple(args.targets.split(",")),
                 batch_size=args.batch_size, seq_len=args.seq_len, dtype=dtype,
                 accelerator="cpu" if jax.default_backend() == "cpu" else None,
                 bits=quant and quant["bits"], group_size=quant["group_size"] if quant else 128)
    remat = (least_remat(p) or "full") if args.remat == "auto" else args.remat
    key = remat_key(remat)
    need = p["total_bytes" + key]
    if not p["fits" + key]:
        lighter = least_remat(p)  # what fits keeps less than what does not: a later mode of REMAT
        hint = f"--remat {lighter} would fit; " if lighter else ""
        parts = ", ".join(f"{k} {v:.2f}" for k, v in p["per_device_gb"].items()
                          if v and (k == "activations" + key or not k.startswith("activations")))
        raise ValueError(f"the plan needs {need / GB:.2f} GB per device ({parts}) and a device has "
                         f"{have / GB:.2f} GB ({where}): {hint}use more devices, a smaller --batch-size or "
                         "--seq-len, or --device-memory if that figure is wrong (`amdllm plan` takes the same "
                         "options)")
    return int(need), remat
