"""The training loop around the compiled step: progress, metrics, evaluation, checkpoints, resume.

`finetune` trains the LoRA factors already attached to a model and writes, under OUT: the PEFT adapter,
metrics.jsonl (one JSON object per logged step and per evaluation) and resumable checkpoints
(checkpoints/step_NNNNNN, each written as a directory renamed into place). Formats: docs/formats.md.
"""
from __future__ import annotations

import contextlib
import json
import resource
import signal
import statistics
import sys
import threading
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import jax
import jax.numpy as jnp
from amdllm.progress import tqdm

from amdllm.files import atomic_write_text
from amdllm.io.peft import save_adapter
from amdllm.model import Llama
import amdllm.model.lora as lora_mod
from amdllm.model.narrow import inference_weights
from amdllm.model.inputs import expect_model
from amdllm.parallel import distributed
from amdllm.parallel.sharding import batch_ways, shard_model
import amdllm.train.data as data_mod
from amdllm.train.checkpoints import (check_run_dir, data_fingerprint, list_checkpoints, load_latest,
                                      model_changes, model_fingerprint, remove_leftovers, save_checkpoint)
from amdllm.train.report import task_accuracy
from amdllm.train.step import (TrainConfig, TrainingError, evaluate_loss, flops_per_token, init_opt_state,
                               make_eval_step, make_optimizer, make_train_step, peak_flops, place_batch,
                               split_params, stack_batch)


class _StopRequest:
    requested = False


@contextlib.contextmanager
def interrupt_between_steps():
    """The first Ctrl-C (SIGINT) asks the loop to stop after the step in flight; a second interrupts at
    once. A KeyboardInterrupt raised inside a compiled call can leave XLA's threads mid-work, and the
    process then crashes on its way out instead of exiting 130. One process of several keeps the
    default (the supervisor forwards the signal to all, and they must stop together)."""
    stop = _StopRequest()
    if threading.current_thread() is not threading.main_thread() or jax.process_count() > 1:
        yield stop
        return

    def handler(signum, frame):
        if stop.requested:
            raise KeyboardInterrupt
        stop.requested = True
        print("\nstopping after this step (Ctrl-C again stops now, without a checkpoint)", file=sys.stderr)

    old = signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, old)


def check_batch_splits(batch_size: int, mesh, rules=None) -> None:
    if mesh is not None and batch_size % batch_ways(mesh, rules):
        raise TrainingError(f"--batch-size {batch_size} does not split over the mesh's "
                            f"{batch_ways(mesh, rules)} batch shards ({dict(mesh.shape)}): pass a multiple of "
                            f"{batch_ways(mesh, rules)}, or a --mesh with fewer data/fsdp devices")


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------
RESUME_KEYS = ("steps", "batch_size", "grad_accum", "seq_len", "lr", "warmup", "min_lr_ratio",
               "weight_decay", "clip", "b1", "b2", "seed")


def finetune(model: Llama, train_ds: data_mod.Dataset, out_dir, tc: TrainConfig = TrainConfig(), *,
             eval_ds: data_mod.Dataset | None = None, tokenizer=None, task_rows=None, task_group_by=None,
             mesh=None, rules=None, resume: bool = False, progress: bool = True, base_model_dir=None,
             planned_bytes: int | None = None) -> dict:
    """Train the LoRA factors already attached to `model` (in place); write the adapter to `out_dir`.

    Metrics go to OUT/metrics.jsonl, checkpoints to OUT/checkpoints/; evaluations score `task_rows` by exact
    match (`task_accuracy`). Returns a summary (losses, evals, the median tokens/s and MFU, memory, paths).
    With several processes every process calls this with the same arguments and a mesh over all devices;
    process 0 alone writes. `planned_bytes`: the planner's figure, printed beside XLA's before training."""
    out = Path(out_dir)
    expect_model(model, "finetune")
    lead = jax.process_index() == 0
    for name, ds in (("training", train_ds), ("evaluation", eval_ds)):
        if ds is not None and len(ds) and int(ds.tokens.max()) >= model.cfg.vocab_size:
            raise TrainingError(f"the {name} data holds token id {int(ds.tokens.max())}, outside the model's "
                                f"vocabulary [0, {model.cfg.vocab_size}): the tokenizer does not belong to "
                                "this model")
    check_batch_splits(tc.batch_size, mesh, rules)
    check_run_dir(out, tc.steps, resume)
    if task_rows and jax.process_count() > 1:
        warnings.warn("exact match needs generation, which runs in one process: skipped in this "
                      f"{jax.process_count()}-process run (the held-out loss is still measured); score the "
                      "adapter afterwards with one process", stacklevel=2)
        task_rows = None
    if lead:
        out.mkdir(parents=True, exist_ok=True)
    if mesh is not None:
        shard_model(model, mesh, rules)  # a no-op for what was loaded or created in place
    lora, frozen = split_params(model)
    model_fp = model_fingerprint(model, frozen)  # the weights as loaded, before any backend's views
    # a narrow frozen base travels as bits on a CPU (one layer widened at a time; amdllm.model.narrow)
    top, layers = inference_weights({k: v for k, v in frozen.items() if k != "layers"}, frozen.get("layers", {}))
    frozen = {**top, "layers": layers} if frozen else frozen
    optimizer, schedule = make_optimizer(tc)
    opt_state = init_opt_state(optimizer, lora)
    global_batch = tc.batch_size * tc.grad_accum
    n_dev = 1 if mesh is None else mesh.size
    info = lora_mod.lora_info(model)
    meta = {"train_config": asdict(tc), "lora": {**info, "targets": list(info["targets"])},
            "data": {"rows": len(train_ds), **train_ds.stats, "sha256": data_fingerprint(train_ds)},
            "model": model_fp}
    start, metrics_lines = 0, []
    metrics_path = out / "metrics.jsonl"
    if lead:
        remove_leftovers(out)
    if resume and list_checkpoints(out):
        last, lora, opt_state, saved = load_latest(out, lora, opt_state)
        diff = {k: (saved["train_config"].get(k), getattr(tc, k)) for k in RESUME_KEYS
                if saved["train_config"].get(k) != getattr(tc, k)}
        if saved["lora"] != meta["lora"]:
            diff["lora"] = (saved["lora"], meta["lora"])
        if saved["data"].get("sha256") != meta["data"]["sha256"]:
            diff["data"] = (f"{saved['data']['rows']} rows, sha256 {str(saved['data'].get('sha256'))[:12]}",
                            f"{len(train_ds)} rows, sha256 {meta['data']['sha256'][:12]}")
        changed = model_changes(saved.get("model"), meta["model"])
        if changed:
            diff["model"] = f"its {', '.join(changed)} differ from the run's (another --model or --dtype?)"
        if diff:
            raise TrainingError(f"{last}: cannot resume with different {', '.join(diff)} (saved, new: "
                                f"{diff}); resume needs the same data, LoRA and training settings")
        start = saved["step"]
        if start >= tc.steps and (out / "adapter_config.json").is_file():
            raise TrainingError(f"{last}: this run already finished its {tc.steps} steps; nothing to resume "
                                f"(its adapter is in {out})")
        if metrics_path.is_file():  # drop lines logged after the checkpoint: they will be redone
            metrics_lines = [l for l in metrics_path.read_text().splitlines()
                             if l.strip() and json.loads(l).get("step", 0) <= start]
    eval_step = make_eval_step(model)
    fpt = flops_per_token(model.cfg, info, tc.seq_len)
    peak = distributed.from_process_0(peak_flops()) * n_dev  # one peak for the run (a CPU's is measured)
    key = jax.random.key(tc.seed)
    evals, losses, last_ckpt = [], [], (list_checkpoints(out) or [None])[-1]

    def next_batch(step):
        idx = data_mod.batch_indices(len(train_ds), step, global_batch, tc.seed)
        return place_batch(stack_batch(train_ds, idx, tc.grad_accum), mesh, rules)

    # compiled once, ahead of the loop: XLA's own memory figure for this step, beside the planner's
    step_fn = make_train_step(model, optimizer).lower(lora, opt_state, frozen, next_batch(start),
                                                      jax.random.fold_in(key, start)).compile()
    memory = {"xla_bytes_per_device": compiled_bytes(step_fn), "plan_bytes_per_device": planned_bytes,
              "weights_bytes_this_process": local_bytes(frozen), "process": jax.process_index(),
              "processes": jax.process_count()}
    frozen_in_step = step_inputs(step_fn, frozen)
    if lead:
        print(memory_line(memory), file=sys.stderr)

    def write_metrics():
        if lead:
            atomic_write_text(metrics_path, "".join(l + "\n" for l in metrics_lines))

    def run_eval(step):
        rec = {"step": step, "event": "eval"}
        if eval_ds is not None:
            rec["eval_loss"] = evaluate_loss(model, lora, frozen, eval_ds, tc.batch_size, eval_step, mesh, rules)
        if task_rows and tokenizer is not None:
            set_lora_copy(model, lora)
            rec.update(task_accuracy(model, tokenizer, task_rows, group_by=task_group_by))
        evals.append(rec)
        metrics_lines.append(json.dumps(rec))
        write_metrics()
        return rec

    def checkpoint(step):
        nonlocal last_ckpt
        host = distributed.gather((lora, opt_state))  # every process takes part; process 0 writes
        if lead:
            last_ckpt = save_checkpoint(out, step, *host, meta, tc.keep)

    if start == 0 and (eval_ds is not None or task_rows):
        run_eval(0)  # the "before" numbers: base model (B = 0, so the adapter is a no-op)
    bar = tqdm(range(start, tc.steps), initial=start, total=tc.steps, desc="finetune",
               disable=not (progress and lead), file=sys.stderr, dynamic_ncols=True)
    tok_s = mfu = 0.0
    rates = []  # tokens/s of every timed step: the result reports their median, not the last step's
    t_prev = time.perf_counter()
    with interrupt_between_steps() as stop:
        for step in bar:
            lora, opt_state, m = step_fn(lora, opt_state, frozen, next_batch(step), jax.random.fold_in(key, step))
            loss = float(m["loss"])  # waits for the step; also the NaN check
            dt = time.perf_counter() - t_prev  # t_prev: set after the previous step's evaluation and checkpoint
            if not bool(m["ok"]):
                write_metrics()
                where = f"last good checkpoint: {last_ckpt}" if last_ckpt else "no checkpoint was written yet"
                raise TrainingError(f"non-finite loss ({loss}), gradient norm ({float(m['grad_norm'])}) or update "
                                    f"norm ({float(m['update_norm'])}, --lr {tc.lr:g}) at step {step + 1}; stopped "
                                    f"without applying it ({where})")
            positions = global_batch * tc.seq_len
            if step > start:  # the first step's time includes the batch's first transfer
                tok_s = positions / dt
                mfu = fpt * tok_s / peak if peak else 0.0
                rates.append(tok_s)
            losses.append(loss)
            n = step + 1
            if n % tc.log_every == 0 or n == tc.steps:
                metrics_lines.append(json.dumps({
                    "step": n, "loss": loss, "lr": float(schedule(step)), "grad_norm": float(m["grad_norm"]),
                    "tokens_per_second": tok_s, "mfu": mfu, "trained_tokens": float(m["weight"]),
                    "step_seconds": dt, "epoch": data_mod.cursor(len(train_ds), n, global_batch)["epoch"]}))
                write_metrics()
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}", mfu=f"{100 * mfu:.1f}%", refresh=False)
            if tc.eval_every and n % tc.eval_every == 0 and n < tc.steps:
                run_eval(n)
            if tc.save_every and n % tc.save_every == 0 and n < tc.steps:
                meta["cursor"] = data_mod.cursor(len(train_ds), n, global_batch)
                checkpoint(n)
            if stop.requested:  # Ctrl-C: stop here, at a step boundary, with a checkpoint to resume from
                meta["cursor"] = data_mod.cursor(len(train_ds), n, global_batch)
                checkpoint(n)
                write_metrics()
                bar.close()
                raise KeyboardInterrupt(f"after step {n} of {tc.steps}; checkpoint {last_ckpt} "
                                        "(run the same command with --resume to continue)")
            t_prev = time.perf_counter()  # the next step's time leaves out this one's evaluation and checkpoint
    bar.close()
    meta["cursor"] = data_mod.cursor(len(train_ds), tc.steps, global_batch)
    if start < tc.steps:
        checkpoint(tc.steps)
    final_eval = run_eval(tc.steps) if (eval_ds is not None or task_rows) else None
    if jax.process_count() > 1:  # the trained factors, whole, on every process; process 0 writes them
        lora_mod.set_lora_params(model, distributed.gather(lora))
    else:
        set_lora_copy(model, lora)
    if lead:
        save_adapter(model, out, base_model_dir=base_model_dir)
    write_metrics()
    memory["peak_rss_bytes"] = peak_rss()
    if rates:
        tok_s = statistics.median(rates)
        mfu = fpt * tok_s / peak if peak else 0.0
    return {"steps": tc.steps, "resumed_from": start, "losses": losses,
            "final_loss": losses[-1] if losses else None, "eval": final_eval, "evals": evals,
            "tokens_per_second": tok_s, "mfu": mfu, "flops_per_token": fpt, "peak_flops": peak,
            "adapter_dir": str(out), "metrics": str(metrics_path), "checkpoint": str(last_ckpt),
            "data": train_ds.stats, "memory": memory, "frozen_in_step": frozen_in_step}


def compiled_bytes(compiled) -> int | None:
    """XLA's memory for one device of a compiled computation: arguments + outputs + temporaries - the
    donated arguments reused as outputs (the figure tests/test_plan.py compares the planner with)."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def step_inputs(compiled, frozen) -> dict:
    """How the compiled step receives the frozen weights, read from the compiled step itself: per array,
    its dtype (on a CPU a bfloat16 weight travels as its uint16 bits, model.fast), partition spec and
    the block one device holds."""
    shardings = compiled.input_shardings[0][2]  # arguments: (lora, opt_state, frozen, batch, rng)
    out = {}
    for (path, sh), x in zip(jax.tree_util.tree_flatten_with_path(shardings)[0], jax.tree.leaves(frozen)):
        name = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
        out[name] = {"dtype": str(x.dtype), "shape": list(x.shape),
                                           "spec": str(getattr(sh, "spec", "")),
                                           "device_shape": list(sh.shard_shape(x.shape))}
    return out


def local_bytes(tree) -> int:
    """Bytes of the arrays' blocks held by this process's devices."""
    total = 0
    for leaf in jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "addressable_shards")):
        shards = getattr(leaf, "addressable_shards", None)
        total += sum(s.data.nbytes for s in shards) if shards else int(getattr(leaf, "nbytes", 0))
    return total


def memory_line(m: dict) -> str:
    gb = lambda b: "n/a" if b is None else f"{b / 1e9:.3f} GB"  # noqa: E731
    ratio = (f" (XLA / plan = {m['xla_bytes_per_device'] / m['plan_bytes_per_device']:.2f})"
             if m["plan_bytes_per_device"] and m["xla_bytes_per_device"] else "")
    return (f"memory per device for this step: plan {gb(m['plan_bytes_per_device'])}, XLA "
            f"{gb(m['xla_bytes_per_device'])}{ratio}; frozen weights held by process {m['process']} of "
            f"{m['processes']}: {gb(m['weights_bytes_this_process'])}")


def rss_now(field: str = "RssAnon") -> int:
    """This process's resident memory now, in bytes (Linux /proc; 0 elsewhere). RssAnon (the default) is
    what it allocated; VmRSS adds the file pages it has mapped (the kernel's page cache, shared)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return 0


def peak_rss() -> int:
    """This process's peak resident memory so far, in bytes (Linux reports kilobytes)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def set_lora_copy(model: Llama, lora: dict) -> None:
    """Write copies into the model (the live buffers are donated to the next step)."""
    lora_mod.set_lora_params(model, {k: jnp.array(v, copy=True) for k, v in lora.items()})
