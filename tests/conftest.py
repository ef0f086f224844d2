"""Test set-up shared by every test file.

JAX is told to simulate 8 CPU devices before anything computes, so sharding tests run the real mesh
code paths; unsharded computations simply use device 0. XLA's LLVM optimisation level is 1 (below).
"""
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The tests check what is computed, not how fast. Much of their time on 2 cores is XLA compiling small
# functions, and much of that is LLVM optimising the generated loops. Level 1 (of 0-3; XLA defaults to 3) keeps
# XLA's own HLO optimisations and the library kernels that do the matrix products; on 2 cores it took
# tests/test_fast.py, test_plan.py, test_train.py and test_qlora.py from 405 to 263 s and lesson 05's quick
# run from 172 to 140 s (level 0 compiles a little faster but runs the notebooks' training far slower). The
# notebooks and `amdllm` processes the tests start inherit it; `make course` and the benchmarks do not.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=1".strip()
# PyTorch's OpenMP threads spin while they wait for each other, and under pytest-xdist they share the cores
# with the other worker's threads: two 2-thread PyTorch processes side by side on 2 cores took 228 s each for
# tests/foreign.py's 15 s training, and 15 s each with one thread. So the reference sides (transformers,
# peft) run on one thread per worker here, and so do the processes the tests start.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
