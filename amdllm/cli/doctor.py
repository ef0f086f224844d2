"""`amdllm doctor`: the backend, devices, memory, versions and set-up warnings (amdllm.env)."""
from __future__ import annotations

from amdllm.cli.common import emit
from amdllm.env import doctor, format_report


def run(args) -> int:
    r = doctor()
    emit(r, args.json, format_report(r))
    return 0
