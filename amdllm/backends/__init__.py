"""The seam between the plain-JAX core and what one kind of machine adds (today: `amdllm.backends.cpu`).

`prepare(top, layers, rows=)` hands a decoder its weights as this machine's kernels read them; the
queries below it say what else the backend changes. The CPU backend is on wherever JAX runs on the CPU;
AMDLLM_BACKEND=off runs the core alone. Nothing outside this folder imports a backend but this module.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import jax

from amdllm.backends import cpu
from amdllm.model.narrow import inference_weights


@functools.cache
def active():
    """The backend module for this process's JAX platform, or None (the core alone)."""
    if os.environ.get("AMDLLM_BACKEND", "").strip().lower() in ("off", "0", "none") or jax.default_backend() != "cpu":
        return None
    return cpu


@dataclass(frozen=True)
class Prepared:
    """A decoder's weights: `layers` for its steps (stacked, or per-layer), `stacked` for a prefill of
    more than `max_rows` rows (`for_rows`)."""
    top: dict
    layers: Any
    stacked: Any
    max_rows: int

    @property
    def per_layer(self) -> bool:
        return isinstance(self.layers, list)

    def for_rows(self, rows: int):
        return self.layers if rows <= self.max_rows else self.stacked


def prepare(top: dict, layers: dict, *, rows: int) -> Prepared:
    """The weights a decode step of `rows` rows reads (outside jit): narrow arrays as bits on a CPU
    (`narrow.inference_weights`), then whatever the backend does with them."""
    top, layers = inference_weights(top, layers)
    backend = active()
    if backend is None:
        return Prepared(top, layers, layers, 1 << 30)
    step_top, step_layers, max_rows = backend.prepare(top, layers, rows)
    return Prepared(step_top, step_layers, layers, max_rows if isinstance(step_layers, list) else 1 << 30)


def compiler_options(kind: str, hidden_size: int) -> dict | None:
    """XLA options for a jitted step of `kind` ("decode"), or None."""
    backend = active()
    return None if backend is None else backend.compiler_options(kind, hidden_size)


def decodes_bf16() -> bool:
    """Whether bfloat16 weights decode at least as fast as float32 here (`--dtype auto` keeps them)."""
    backend = active()
    return jax.default_backend() != "cpu" if backend is None else backend.decodes_bf16()


def describe() -> dict:
    """What `amdllm doctor` reports: the backend in use and its parts."""
    backend = active()
    return {"backend": "none"} if backend is None else backend.describe()
