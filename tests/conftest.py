"""Test set-up shared by every test file.

JAX is told to simulate 8 CPU devices before anything computes, so sharding tests run the real mesh
code paths; unsharded computations simply use device 0.
"""
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
