"""`amdllm doctor`: the backend, devices, memory, versions and set-up warnings (amdllm.env)."""
from __future__ import annotations

from amdllm.cli.common import emit
from amdllm.env import doctor, format_report


def add_cli(sub) -> None:
    p = sub.add_parser("doctor", help="backend, devices, memory, versions and set-up warnings")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run)


def run(args) -> int:
    r = doctor()
    emit(r, args.json, format_report(r))
    return 0
