"""A run's resumable state under OUT/checkpoints/step_NNNNNN/{state.safetensors, state.json}: each written
as a directory renamed into place, so a kill at any point leaves either the whole checkpoint or none.
What `finetune` refuses about an earlier run in OUT, and what `--resume` may continue, are decided here."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from safetensors import SafetensorError
from safetensors.numpy import load_file
from safetensors.numpy import save as st_save

from amdllm.files import atomic_write_bytes, atomic_write_text, remove_stale
from amdllm.parallel.sharding import put
import amdllm.train.data as data_mod
from amdllm.train.step import TrainingError


def _ckpt_dir(out: Path) -> Path:
    return out / "checkpoints"


def list_checkpoints(out) -> list[Path]:
    d = _ckpt_dir(Path(out))
    found = [p for p in d.glob("step_*") if p.is_dir() and (p / "state.json").is_file()] if d.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def save_checkpoint(out, step: int, lora: dict, opt_state, meta: dict, keep: int) -> Path:
    """Write the resumable state as a directory renamed into place (a crash never leaves half of one).
    lora and opt_state as host arrays (`distributed.gather` them first when they live on a mesh)."""
    final = _ckpt_dir(Path(out)) / f"step_{step:06d}"
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {f"lora/{k}": np.asarray(v) for k, v in lora.items()}
    tensors.update({f"opt/{i:05d}": np.asarray(v) for i, v in enumerate(jax.tree.leaves(opt_state))})
    atomic_write_bytes(tmp / "state.safetensors", st_save(tensors))
    atomic_write_text(tmp / "state.json", json.dumps({**meta, "step": step}, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(out)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, lora_template: dict, opt_template) -> tuple[dict, object, dict]:
    """(lora, opt_state, meta), the arrays placed like the templates' (on a mesh: each process puts only
    the blocks its devices hold)."""
    try:
        t = load_file(str(path / "state.safetensors"))
        meta = json.loads((path / "state.json").read_text())
    except (OSError, ValueError, SafetensorError) as e:
        raise CheckpointUnreadable(f"{path / 'state.safetensors'}: unreadable ({str(e).splitlines()[0]})") \
            from None
    lora = {}
    for k, v in lora_template.items():
        if f"lora/{k}" not in t or t[f"lora/{k}"].shape != v.shape:
            raise TrainingError(f"{path}: LoRA tensor {k} missing or of another shape; the checkpoint "
                                "was written with other LoRA settings")
        lora[k] = _place(t[f"lora/{k}"], v)
    leaves, treedef = jax.tree.flatten(opt_template)
    opt = [_place(t[f"opt/{i:05d}"], leaves[i]) for i in range(len(leaves)) if f"opt/{i:05d}" in t]
    if len(opt) != len(leaves) or any(a.shape != b.shape for a, b in zip(opt, leaves)):
        raise TrainingError(f"{path}: optimizer state does not match this optimizer")
    return lora, jax.tree.unflatten(treedef, opt), meta


class CheckpointUnreadable(TrainingError):
    """A checkpoint whose files cannot be read (cut short by a crash or a full disk)."""


def load_latest(out: Path, lora_template: dict, opt_template):
    """The newest readable checkpoint: (path, lora, opt_state, meta); an unreadable one is named in a
    warning and the one before it is used."""
    found = list_checkpoints(out)
    for path in reversed(found):
        try:
            return (path, *load_checkpoint(path, lora_template, opt_template))
        except CheckpointUnreadable as e:
            warnings.warn(f"{e}; resuming from the checkpoint before it", stacklevel=2)
    raise TrainingError(f"{_ckpt_dir(out)}: none of its {len(found)} checkpoints can be read; remove that "
                        "directory to start the run again")


def remove_leftovers(out: Path) -> None:
    """Partial writes a killed run left: checkpoint directories of processes no longer running, and the
    temporary files `files.atomic_path` renames into place."""
    remove_stale(_ckpt_dir(out).glob(".tmp-step_*-*"))
    for tmp in [*out.glob(".*.tmp"), *_ckpt_dir(out).glob("step_*/.*.tmp")]:
        tmp.unlink(missing_ok=True)


RUN_FILES = ("metrics.jsonl", "checkpoints")  # what a run writes into OUT before its adapter


def resumable(out) -> bool:
    """Whether --resume may continue in `out`: it holds checkpoints, or only what a run killed before its
    first checkpoint leaves (its metrics, partial checkpoint writes, temporary files); that run starts
    again from step 0, as it would have run."""
    out = Path(out)
    if list_checkpoints(out):
        return True
    held = [p for p in out.iterdir() if not (p.name.startswith(".") and p.name.endswith(".tmp"))] \
        if out.is_dir() else []
    ckpts = _ckpt_dir(out)
    partial = all(p.name.startswith(".tmp-step_") for p in ckpts.iterdir()) if ckpts.is_dir() else True
    return all(p.name in RUN_FILES for p in held) and partial


def check_run_dir(out, steps: int, resume: bool) -> None:
    """The refusals `finetune` makes about OUT's earlier run, early (before a model is loaded): checkpoints
    without resume, and a finished run asked to resume."""
    found = list_checkpoints(out)
    if found and not resume:
        raise TrainingError(f"{out}: holds checkpoints of an earlier run; pass resume=True (--resume) "
                            "or use a fresh output directory")
    if found and (Path(out) / "adapter_config.json").is_file():
        try:
            step = json.loads((found[-1] / "state.json").read_text()).get("step", 0)
        except (OSError, ValueError):
            return  # an unreadable checkpoint: the loop falls back past it and says so
        if step >= steps:
            raise TrainingError(f"{found[-1]}: this run already finished its {steps} steps; nothing to resume "
                                f"(its adapter is in {out})")


def data_fingerprint(ds: data_mod.Dataset) -> str:
    """sha256 of the laid-out rows: a resume on other data (even with the same row count) is refused."""
    h = hashlib.sha256()
    for k in ("tokens", "targets", "weights", "segment_ids", "positions"):
        h.update(np.ascontiguousarray(getattr(ds, k)).tobytes())
    return h.hexdigest()


def model_fingerprint(model, frozen) -> dict:
    """What a resume must find unchanged in the model: its config, its weights' dtypes, and (in one
    process) a sha256 of the first row of every frozen weight, so another checkpoint of the same shape
    is told apart without reading it all."""
    leaves = jax.tree.leaves(frozen)
    out = {"config": model.cfg.to_dict(), "dtypes": sorted({str(x.dtype) for x in leaves}),
           "compute_dtype": str(model.dtype), "sample_sha256": None}
    if jax.process_count() == 1:  # a slice of a global array is addressable only in one process
        h = hashlib.sha256()
        for x in leaves:
            h.update(np.ascontiguousarray(np.asarray(x[(0,) * (x.ndim - 1)][:64] if x.ndim else x)).tobytes())
        out["sample_sha256"] = h.hexdigest()
    return out


def model_changes(saved: dict | None, now: dict) -> list[str]:
    """Which of the fingerprint's parts differ (none for a checkpoint written before it was recorded)."""
    if not saved:
        return []
    return [k for k in ("config", "dtypes", "compute_dtype", "sample_sha256")
            if saved.get(k) is not None and now.get(k) is not None and saved.get(k) != now.get(k)]


def _place(host: np.ndarray, like):
    sh = getattr(like, "sharding", None)
    return put(host, sh) if isinstance(sh, NamedSharding) else jnp.asarray(host)


