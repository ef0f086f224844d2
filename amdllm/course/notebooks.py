"""Run the course notebooks headless, and keep them clean in git.

    python -m amdllm.course.notebooks run --out build [--quick] [--only 01,03] [--model smollm2] [--param k=v]
    python -m amdllm.course.notebooks strip [--check] [NOTEBOOK ...]
    python -m amdllm.course.notebooks kernel          # install the `amdllm` Jupyter kernel (make lab does)

`run` executes each notebook with papermill into OUT (the parameters injected after the cell tagged
`parameters`), collects each one's asserted results into OUT/summary.json and prints a summary."""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import re
import resource
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import jax

from amdllm.course.default_model import amdllm_home
from amdllm.course.models import COURSE_MODELS, model_params
from amdllm.course.nbclean import NOTEBOOK_DIR, REPO, settle_progress, strip
from amdllm.files import atomic_write_text

# Imports note: the notebook tooling (papermill, nbformat, ...) is imported where it is used: nbformat alone
# costs seconds (jsonschema), and every notebook's final cell imports this module for `record`.

KERNEL_NAME = "amdllm"
KERNEL_DISPLAY_NAME = "amdllm (.venv)"
NOTEBOOKS = ("00_setup", "01_weight_conversion", "02_mesh_sharding", "03_lora_finetuning",
             "04_gptq_quantization", "05_inference_and_serving")

# Small sizes for `make test` (each notebook also reads `quick`), for the mechanics, not the quality: 04 keeps
# 8 x 256 calibration tokens (GPTQ needs 2 x in_features = 1536) and one batch of held-out windows; 05 packs
# with RTN (lesson 04 tests GPTQ) and trains LoRA just long enough to learn the answer format.
QUICK_PARAMS: dict[str, dict] = {
    "03_lora_finetuning": {"train_steps": 40, "eval_examples": 24},
    "04_gptq_quantization": {"calib_samples": 8, "eval_tokens": 2048},
    "05_inference_and_serving": {"max_new_tokens": 16, "lora_steps": 40, "lora_batch_size": 8,
                                 "quant_method": "rtn"},
}

# Parameters that name files or directories: resolved against the directory the runner was started in.
PATH_PARAMS = ("model_dir", "train_data", "eval_data", "calib_text", "eval_text")

# Which recorded results the summary shows, per notebook: (results key, label, format string or function).
SUMMARY_FIELDS: dict[str, list[tuple[str, str, str]]] = {
    "00_setup": [("backend", "backend", "{}"), ("devices", "devices", "{}"),
                 ("cpu_fallback_warning", "silent-CPU-fallback warning", "{}")],
    "01_weight_conversion": [("model", "model", "{}"),
                             ("max_abs_logit_diff", "parity max |logit diff| vs transformers", "{:.2e}"),
                             ("greedy_match", "greedy tokens equal to transformers", "{}"),
                             ("roundtrip_max_diff", "save->transformers reload max diff", "{:.2e}")],
    "02_mesh_sharding": [("mesh", "mesh", lambda m: ",".join(f"{a}={n}" for a, n in m.items() if n > 1)),
                         ("sharded_max_diff", "sharded vs single-device logits", "{:.2e}"),
                         ("llama405b_mfu_at_35tps", "405B @ 35 tok/s on 8x MI300X: MFU", "{:.2%}")],
    "03_lora_finetuning": [("model", "model", "{}"),
                           ("accuracy_before", "task accuracy before LoRA", "{:.1%}"),
                           ("accuracy_after", "task accuracy after LoRA", "{:.1%}"),
                           ("eval_loss_before", "held-out loss before LoRA", "{:.3f}"),
                           ("eval_loss_after", "held-out loss after LoRA", "{:.3f}"),
                           ("tokens_per_second", "training tokens/s", "{:.0f}"),
                           ("peft_max_diff", "our logits vs peft-loaded adapter", "{:.2e}")],
    "04_gptq_quantization": [("model", "model", "{}"),
                             ("ppl_fp", "perplexity fp32", "{:.4f}"),
                             ("ppl_rtn4", "perplexity RTN 4-bit", "{:.4f}"),
                             ("ppl_gptq4", "perplexity GPTQ 4-bit", "{:.4f}"),
                             ("ppl_rtn3", "perplexity RTN 3-bit", "{:.4f}"),
                             ("ppl_gptq3", "perplexity GPTQ 3-bit", "{:.4f}"),
                             ("size_fp_mb", "size on disk, full precision (MB)", "{:.2f}"),
                             ("size_gptq4_mb", "size GPTQ 4-bit (MB)", "{:.2f}")],
    "05_inference_and_serving": [("model", "model", "{}"),
                                 ("tokens_per_second", "decode tokens/s",
                                  lambda t: " | ".join(f"{k} {v:.0f}" for k, v in t.items())),
                                 ("task_accuracy_int4", "task accuracy int4", "{:.1%}"),
                                 ("task_accuracy_int4_lora", "task accuracy int4 + LoRA", "{:.1%}"),
                                 ("lora_fp_accuracy", "held-out accuracy: LoRA on fp32", "{:.1%}"),
                                 ("fp_lora_on_int4_accuracy", "held-out accuracy: fp-trained LoRA on int4", "{:.1%}"),
                                 ("qlora_accuracy", "held-out accuracy: QLoRA on int4", "{:.1%}"),
                                 ("server_ok", "amdllm serve answered the openai client", "{}")],
}


def record(results_path: str | os.PathLike | None, results: dict) -> None:
    """A notebook's last call: print its key results, with the JAX backend and devices it ran on, and write
    them (JSON) where the runner looks. Returns None (the cell shows nothing more)."""
    devices = jax.devices()
    results = {**results, "jax_backend": jax.default_backend(),
               "jax_devices": f"{len(devices)} x {devices[0].device_kind}"}
    for k, v in results.items():
        print(f"  {k:<32} {v}")
    if results_path:
        atomic_write_text(results_path, json.dumps(results, indent=2, default=float) + "\n")


def declared_parameters(name: str) -> list[str]:
    """The names the notebook's `parameters` cell assigns (what the runner may inject)."""
    cells = json.loads((NOTEBOOK_DIR / f"{name}.ipynb").read_text())["cells"]
    src = next(("".join(c["source"]) for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])), "")
    return re.findall(r"^([A-Za-z_]\w*)\s*=", src, flags=re.M)


def _params_for(name: str, quick: bool, results_path: Path, work_dir: Path, extra: dict | None) -> dict:
    params = {"quick": bool(quick), "results_path": str(results_path), "work_dir": str(work_dir)}
    if quick:
        params.update(QUICK_PARAMS.get(name, {}))
    declared = set(declared_parameters(name))
    for k, v in (extra or {}).items():
        if k not in declared:  # a --param applies to the notebooks that declare it
            continue
        # paths are the caller's: relative to the command's working directory, not the kernel's notebooks/
        params[k] = str(Path(v).resolve()) if k in PATH_PARAMS and isinstance(v, str) and v else v
    return params


def default_compile_cache() -> Path:
    return amdllm_home() / "jax-cache"


@contextlib.contextmanager
def _kernel_env(compile_cache: str | os.PathLike | None):
    """The kernel's environment, set only around its start (the caller, a pytest worker, is not changed):
    this checkout's amdllm importable, offline Hugging Face, the shared compilation cache, text bars."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys([str(REPO), *paths])),
           "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "false"),
           "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
           "TRANSFORMERS_OFFLINE": os.environ.get("TRANSFORMERS_OFFLINE", "1"),
           "MPLBACKEND": os.environ.get("MPLBACKEND", "module://matplotlib_inline.backend_inline"),
           # a saved widget shows "0%" (amdllm.progress); each redraw of a text bar is an output papermill handles
           "AMDLLM_TEXT_PROGRESS": "1", "TQDM_MININTERVAL": os.environ.get("TQDM_MININTERVAL", "5")}
    if compile_cache:
        Path(compile_cache).mkdir(parents=True, exist_ok=True)
        env["JAX_COMPILATION_CACHE_DIR"] = str(compile_cache)
        # JAX only caches compilations slower than 1 s by default; on an unloaded machine many of
        # the lessons' compilations take 0.3-1 s, and there are dozens of them
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _DropParseWarnings(logging.Filter):
    """papermill warns about every parameter line with two '=' (e.g. mesh_spec = "fsdp=4,tensor=2"); its
    parser is only used to list parameters, and the injection works, so the warning is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unable to parse line")


def kernel_spec_dir() -> Path:
    """Where this environment's `amdllm` kernelspec lives (sys.prefix: the venv, not the user's home)."""
    return Path(sys.prefix) / "share" / "jupyter" / "kernels" / KERNEL_NAME


def ensure_kernel() -> Path:
    """Install the `amdllm` kernelspec for this interpreter unless it is there already; returns its dir.

    The spec's argv names sys.executable, so the kernel runs this environment's Python. A spec left by
    another interpreter (a moved or rebuilt venv) is replaced. Concurrent callers serialise on a lock."""

    spec_dir = kernel_spec_dir()
    spec = spec_dir / "kernel.json"

    def current() -> bool:
        try:
            return json.loads(spec.read_text())["argv"][0] == sys.executable
        except (OSError, ValueError, KeyError, IndexError):
            return False

    if current():
        return spec_dir
    spec_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(spec_dir.parent / f".{KERNEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not current():
            from ipykernel.kernelspec import install  # notebook tooling: see the imports note above
            install(kernel_name=KERNEL_NAME, display_name=KERNEL_DISPLAY_NAME, prefix=sys.prefix)
    return spec_dir


def _ipc_kernel_manager(socket_dir: Path):
    """A kernel manager whose kernel listens on UNIX sockets in `socket_dir` instead of TCP ports: only
    this user can reach it, and ipykernel has nothing to warn about (it warns on unencrypted TCP)."""
    from jupyter_client.manager import AsyncKernelManager  # notebook tooling: see the imports note above

    class IPCKernelManager(AsyncKernelManager):
        def __init__(self, **kw):
            super().__init__(transport="ipc", ip=str(socket_dir / "k"), **kw)

    return IPCKernelManager


def _cpu_seconds_of_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)  # the kernel, once it has exited and been waited for
    return r.ru_utime + r.ru_stime


def run_one(name: str, out: str | os.PathLike, *, quick: bool = False, timeout: int = 1200,
            parameters: dict | None = None, compile_cache: str | os.PathLike | None = None) -> dict:
    """Execute notebooks/<name>.ipynb into OUT/<name>.ipynb (OUT relative to the caller's directory) on the
    `amdllm` kernel -> {name, ok, seconds, cpu_seconds (the kernel's, fairer than wall time on a shared
    machine), results, error, executed}; compile_cache: a JAX persistent compilation cache (None: none)."""

    import papermill as pm  # notebook tooling: see the imports note above
    from nbformat.validator import MissingIDFieldWarning
    warnings.filterwarnings("ignore", category=MissingIDFieldWarning)  # papermill's injected cell has no id
    parse_log = logging.getLogger("papermill.translators")
    if not any(isinstance(f, _DropParseWarnings) for f in parse_log.filters):
        parse_log.addFilter(_DropParseWarnings())
    src = NOTEBOOK_DIR / f"{name}.ipynb"
    if not src.exists():
        raise FileNotFoundError(f"{src}: no such notebook (known: {', '.join(NOTEBOOKS)})")
    # absolute: the kernel runs in notebooks/, where a relative OUT would point somewhere else
    out = Path(out).resolve()
    work_dir = out / "work" / name
    shutil.rmtree(work_dir, ignore_errors=True)  # the lesson's scratch space: each run starts from nothing
    work_dir.mkdir(parents=True)
    results_path = out / f"{name}.results.json"
    results_path.unlink(missing_ok=True)  # a stale file must not pass for this run's results
    ensure_kernel()
    t0, cpu0 = time.time(), _cpu_seconds_of_children()
    rec = {"name": name, "ok": False, "seconds": None, "cpu_seconds": None, "results": None, "error": None,
           "executed": str(out / f"{name}.ipynb")}
    # UNIX socket paths are limited to ~100 bytes, so the sockets go in a short temporary directory
    socket_dir = Path(tempfile.mkdtemp(prefix="amdllm-kernel-"))
    try:
        # cwd = notebooks/ so that relative paths in a notebook (solutions/, ../data) work as in Jupyter
        with _kernel_env(compile_cache):
            pm.execute_notebook(str(src), rec["executed"],
                                parameters=_params_for(name, quick, results_path, work_dir, parameters),
                                kernel_name=KERNEL_NAME, cwd=str(NOTEBOOK_DIR), execution_timeout=timeout,
                                progress_bar=False, log_output=False, report_mode=False,
                                kernel_manager_class=_ipc_kernel_manager(socket_dir))
    except Exception as e:
        if hasattr(e, "ename"):  # papermill's PapermillExecutionError: the cell and the exception it raised
            rec["error"] = f"cell [{e.exec_count}]: {e.ename}: {e.evalue}"[:600]
        else:
            msg = str(e).strip().splitlines()
            rec["error"] = " | ".join(line for line in msg[:6] if line.strip())[:600] or type(e).__name__
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)
    settle_progress(rec["executed"])  # a text bar's last state, not all of them
    rec["seconds"] = round(time.time() - t0, 1)
    rec["cpu_seconds"] = round(_cpu_seconds_of_children() - cpu0, 1)
    if results_path.exists():
        rec["results"] = json.loads(results_path.read_text())
    if rec["error"] is None and rec["results"] is None:
        rec["error"] = f"the notebook finished without writing its results to {results_path}"
    rec["ok"] = rec["error"] is None
    return rec


def run(out: str | os.PathLike, *, quick: bool = False, only: list[str] | None = None,
        timeout: int = 1200, parameters: dict | None = None,
        compile_cache: str | os.PathLike | None = None, model: str = "default") -> list[dict]:
    """Run the notebooks in order on `model` (amdllm.course.models); `parameters` override its sizes."""
    names = resolve(only)
    declared = {p for n in names for p in declared_parameters(n)}
    unknown = set(parameters or {}) - declared
    if unknown:
        known = sorted(declared - {"quick", "results_path", "work_dir"})
        raise ValueError(f"--param {', '.join(sorted(unknown))}: no selected notebook has such a parameter "
                         f"(they have: {', '.join(known)})")
    recs, preset = [], model_params(model, Path(out), quick)
    for name in names:
        print(f"[{time.strftime('%H:%M:%S')}] running {name} ...", file=sys.stderr, flush=True)
        rec = run_one(name, out, quick=quick, timeout=timeout, compile_cache=compile_cache,
                      parameters={**preset.get(name, {}), **(parameters or {})})
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {'ok' if rec['ok'] else 'FAILED'} in {rec['seconds']} s "
              f"({rec['cpu_seconds']} CPU-s)", file=sys.stderr, flush=True)
        recs.append(rec)
    atomic_write_text(Path(out) / "summary.json", json.dumps(recs, indent=2, default=str) + "\n")
    return recs


def resolve(only: list[str] | None) -> list[str]:
    """'01' or '01_weight_conversion' -> full names, in course order."""
    if not only:
        return list(NOTEBOOKS)
    names = []
    for key in only:
        hits = [n for n in NOTEBOOKS if n == key or n.split("_")[0] == key.zfill(2)]
        if not hits:
            raise ValueError(f"unknown notebook {key!r}: expected one of {', '.join(NOTEBOOKS)}")
        names += hits
    return names


def parse_params(items: list[str] | None) -> dict:
    """["model_dir=/data/x", "train_steps=300"] -> {"model_dir": "/data/x", "train_steps": 300} (JSON values
    where they parse, strings otherwise)."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--param {item!r}: expected NAME=VALUE, e.g. --param model_dir=/data/llama")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _fmt(value, fmt) -> str:
    try:
        return fmt(value) if callable(fmt) else fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def summary_text(recs: list[dict]) -> str:
    lines = ["amdllm course: results", "=" * 72]
    for rec in recs:
        status = "ok" if rec["ok"] else "FAILED"
        cpu = f"  ({rec['cpu_seconds']:.0f} CPU-s)" if rec.get("cpu_seconds") is not None else ""
        lines.append(f"{rec['name']:<28} {status:>6}  {rec['seconds']:>7.1f} s{cpu}")
        res = rec.get("results") or {}
        for key, label, fmt in SUMMARY_FIELDS.get(rec["name"], []):
            if key in res:
                lines.append(f"    {label:<46} {_fmt(res[key], fmt)}")
        if rec["error"]:
            lines.append(f"    error: {rec['error'][:300]}")
    n_ok = sum(r["ok"] for r in recs)
    total = sum(r["seconds"] or 0 for r in recs)
    ran_on = sorted({f"{res['jax_backend']} ({res['jax_devices']})" for r in recs
                     if "jax_backend" in (res := r.get("results") or {})})
    lines += ["=" * 72, f"{n_ok}/{len(recs)} notebooks ran and passed their checks in {total / 60:.1f} min "
                        f"on JAX {', '.join(ran_on) or 'backend unknown'} "
                        f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m amdllm.course.notebooks", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="execute the course notebooks headless into OUT/")
    r.add_argument("--out", default="build")
    r.add_argument("--quick", action="store_true", help="small sizes (what the tests use)")
    r.add_argument("--only", default=None, help="comma-separated notebooks, e.g. 01,03")
    r.add_argument("--model", default="default", choices=COURSE_MODELS,
                   help="the course's toy, or its real pretrained chat model (amdllm.course.models)")
    r.add_argument("--timeout", type=int, default=1200, help="seconds per cell")
    r.add_argument("--param", action="append", metavar="NAME=VALUE",
                   help="override a notebook parameter (all notebooks), e.g. --param model_dir=/data/llama")
    r.add_argument("--json", action="store_true", help="print summary.json instead of the text summary")
    r.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="JAX persistent compilation cache shared by the kernels (default $AMDLLM_HOME/jax-cache; "
                        "'none' turns it off)")
    sub.add_parser("kernel", help=f"install the '{KERNEL_NAME}' Jupyter kernel for this Python (make lab does)")
    s = sub.add_parser("strip", help="remove outputs/execution counts from notebooks (default: all)")
    s.add_argument("paths", nargs="*")
    s.add_argument("--check", action="store_true", help="only report; exit 1 if any is not clean")
    args = p.parse_args(argv)
    if args.cmd == "run":
        cache = (None if (args.compile_cache or "").lower() == "none"
                 else args.compile_cache or default_compile_cache())
        try:
            recs = run(args.out, quick=args.quick, only=args.only.split(",") if args.only else None,
                       timeout=args.timeout, parameters=parse_params(args.param), compile_cache=cache,
                       model=args.model)
        except (ValueError, OSError) as e:  # a bad --only or --param, an --out that cannot be written
            why = f"{e.filename}: {e.strerror} (--out {args.out})" if getattr(e, "filename", None) else e
            print(f"amdllm.course.notebooks: error: {why}", file=sys.stderr)
            return 2
        print(json.dumps(recs, default=str) if args.json else summary_text(recs))
        return 0 if all(r["ok"] for r in recs) else 1
    if args.cmd == "kernel":
        print(f"kernel '{KERNEL_NAME}' ({sys.executable}) in {ensure_kernel()}")
        return 0
    try:
        found = strip(args.paths or None, check=args.check)
    except (ValueError, OSError) as e:
        print(f"amdllm.course.notebooks: error: {e}", file=sys.stderr)
        return 2
    for path, problems in found.items():
        print(f"{path}: {'; '.join(problems[:5])}{' ...' if len(problems) > 5 else ''}")
    if args.check:
        return 1 if found else 0
    print(f"stripped {len(found)} notebook(s)" if found else "all notebooks already clean")
    return 0


if __name__ == "__main__":
    sys.exit(main())
