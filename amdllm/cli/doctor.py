"""`amdllm doctor`: the backend, devices, memory, versions and set-up warnings (amdllm.env), and the amdllm
backend in use (amdllm.backends)."""
from __future__ import annotations

from amdllm import backends
from amdllm.cli.common import emit
from amdllm.env import doctor, format_report


def run(args) -> int:
    r = {**doctor(), "amdllm_backend": backends.describe()}
    emit(r, args.json, format_report(r))
    return 0
