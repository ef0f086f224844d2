"""What the CPU back end needs to run fast, in one place: XLA:CPU compiler options for the jitted decode and
training steps, and one OpenBLAS thread for GPTQ's small host-side factorisations. (The model's own CPU fast paths,
fused projections and per-layer decoding, are in `amdllm.model.fast`.)"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os

import jax
from jax._src import xla_bridge  # whether JAX's back ends have started: no public API says


YNN_TRAIN_MIN_HIDDEN = 1024
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def has_bf16_dots() -> bool:
    """Whether XLA:CPU multiplies bfloat16 fast here: a CPU with bf16 instructions (AVX-512 BF16 or AMX),
    where its bf16 x bf16 -> float32 dots (YNNPACK) ran a [256, 2048] x [2048, 8192] product at 565
    GFLOP/s against 282 in float32 (2 cores, 2026-12-02; PyTorch's bf16: 740). On a CPU without them
    (AVX2) XLA widens to float32 instead, which is faster there. AMDLLM_BF16_DOTS=0 or 1 overrides."""
    forced = os.environ.get("AMDLLM_BF16_DOTS", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if jax.default_backend() != "cpu":
        return False
    return any(f in cpu_flags() for f in BF16_FLAGS)


def cpu_flags() -> list[str]:
    """The instruction-set flags /proc/cpuinfo lists for this CPU (empty where it cannot be read)."""
    try:
        return next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    except OSError:
        return []


def cpu_compiler_options(kind: str, hidden_size: int = 0, narrow: bool = False) -> dict | None:
    """XLA:CPU options for a jitted "decode" or "train" step (None elsewhere: nothing changes there).

    decode: XLA:CPU hands dots to XNNPACK/YNNPACK, which pays off for large matmuls but not for a small
    model's decode step (31M benchmark model, hidden 512, batch 8: 97 ms a step with XNNPACK, 37 ms without;
    with per-layer views, leaving the YNNPACK fusions off too, ~23 ms). From hidden_size
    YNN_TRAIN_MIN_HIDDEN up XLA's defaults stay: without YNNPACK, Eigen multiplies a few rows by a 128k
    vocabulary head pathologically slowly (1B shape, float32, 2 cores: a decode step of 2 rows took 4.1-4.6
    s, of 8 rows 2.0 s, against 0.41-0.50 and 0.83 s with the defaults; 1 row 0.26-0.30 s either way).
    train: the YNNPACK fusions win on large kernels and lose on small ones. A model with hidden_size below
    YNN_TRAIN_MIN_HIDDEN sends its dots to Eigen instead: the 31M benchmark step (hidden 512) ~1.07x
    faster, unless its frozen base is bfloat16 on a CPU with bf16 dots (narrow=True): those need
    YNNPACK. At hidden 2048 (the 1B shape, batch 1 x 256, r8, 2 cores) XLA's defaults are: 15.2 against
    9.0 tokens/s with a bf16 base, 15.1 against 8.2 in float32 (BENCHMARKS.md, 1B section)."""
    if jax.default_backend() != "cpu":
        return None
    if kind == "decode":
        small = hidden_size < YNN_TRAIN_MIN_HIDDEN
        return {"xla_cpu_use_xnnpack": False, "xla_cpu_experimental_ynn_fusion_type": ""} if small else None
    if kind == "train":
        small = hidden_size < YNN_TRAIN_MIN_HIDDEN and not (narrow and has_bf16_dots())
        return {"xla_cpu_experimental_ynn_fusion_type": ""} if small else None
    raise ValueError(f"kind must be 'decode' or 'train', got {kind!r}")


ASYNC_DISPATCH = "jax_cpu_enable_async_dispatch"


def run_on_caller() -> bool:
    """Have XLA:CPU run each computation on the thread that calls it (no asynchronous dispatch), if JAX's
    back ends have not started yet (the setting is read once, when the CPU client is made); returns
    whether this process runs that way (`runs_on_caller`). `amdllm finetune` asks for it before anything
    touches a device: a training step's loop waits for each step's loss anyway, so nothing overlaps that
    dispatch would have hidden, and the per-layer training step (`amdllm.model.views.step_views`) needs it.
    Computations over several devices are dispatched as before."""
    if not xla_bridge.backends_are_initialized():
        jax.config.update(ASYNC_DISPATCH, False)
        return True
    return runs_on_caller()


def runs_on_caller() -> bool:
    """Whether this process's CPU client runs computations on the calling thread: the setting as it was
    when the back ends started (`run_on_caller`); False before they start."""
    return xla_bridge.backends_are_initialized() and _made_synchronous()


@functools.cache
def _made_synchronous() -> bool:  # asked once the client exists: the setting it was made with
    return not jax.config.values[ASYNC_DISPATCH]


@contextlib.contextmanager
def one_blas_thread():
    """Run the host factorisation on one OpenBLAS thread (numpy's and scipy's bundled copies; the
    same symbols threadpoolctl uses, which .venv does not have). With the default thread count each
    call left OpenBLAS threads spinning that took the cores from XLA: `quantize_model` on the course
    model took 2.4x the CPU time (46.7 vs 19.6 CPU-s). One thread also makes the factor independent
    of the machine's core count (OpenBLAS's blocking changes the float32 rounding)."""
    found = []
    for path in sorted({ln.split()[-1] for ln in open("/proc/self/maps") if "openblas" in ln.lower()}
                       if os.path.exists("/proc/self/maps") else ()):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for pre, suf in (("", ""), ("", "64_"), ("scipy_", ""), ("scipy_", "64_")):
            get, set_ = (getattr(lib, f"{pre}openblas_{f}_num_threads{suf}", None) for f in ("get", "set"))
            if get is not None and set_ is not None:
                found.append((set_, get()))
                set_(1)
    try:
        yield
    finally:
        for set_, n in found:
            set_(n)
