"""Real English prose with no download: the docstrings of Python's standard library.

The course's stories are generated from templates, so a real pretrained model finds them too easy to
show what 4-bit rounding costs. Every Python has its standard library's documentation, so these two
texts exist on any machine: calibrate on one, score on the other. Only paragraphs that read as prose
are kept (no doctests, little punctuation), and the two module lists do not overlap. The texts depend
on the Python version, so a benchmark records it beside the numbers.
"""
from __future__ import annotations

import importlib
import inspect

CALIBRATION_MODULES = ("argparse", "collections", "json", "logging", "email.message", "http.client",
                       "urllib.request", "unittest", "typing", "asyncio", "subprocess", "threading",
                       "pathlib", "datetime", "decimal", "fractions", "itertools", "functools",
                       "contextlib", "dataclasses")
EVALUATION_MODULES = ("tarfile", "zipfile", "csv", "sqlite3", "random", "statistics", "string", "textwrap",
                      "shutil", "tempfile", "socket", "selectors", "heapq", "bisect", "enum", "abc", "io", "os",
                      "configparser", "difflib")


def prose(modules) -> str:
    """The prose paragraphs of the modules' docstrings and of their public classes' and functions', one
    per line, in a fixed order."""
    out = []
    for name in modules:
        mod = importlib.import_module(name)
        objs = [mod] + [v for k, v in sorted(vars(mod).items()) if not k.startswith("_")
                        and getattr(v, "__module__", None) == mod.__name__
                        and (inspect.isclass(v) or inspect.isfunction(v))]
        for obj in objs:
            for para in (inspect.getdoc(obj) or "").split("\n\n"):
                p = " ".join(para.split())
                # prose: long enough, no doctest, and nearly all letters and spaces
                if len(p) > 80 and ">>>" not in p and sum(c.isalpha() or c == " " for c in p) > 0.9 * len(p):
                    out.append(p)
    return "\n".join(out)


def calibration_text() -> str:
    return prose(CALIBRATION_MODULES)


def evaluation_text() -> str:
    return prose(EVALUATION_MODULES)
