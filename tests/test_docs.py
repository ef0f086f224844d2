"""The documentation tells the truth about the repository it ships in.

* docs/cli.md lists, command by command, exactly the flags the `amdllm` parser has;
* every path the README, the docs, BENCHMARKS.md, the notebooks' prose and the docstrings cite in
  backticks or in a markdown link exists in the repository (a user has only the repository), and none
  of them points outside it;
* environment.yml installs the same pinned packages as `make` does (requirements/lock.txt).
"""
from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path

import pytest

from amdllm import cli

REPO = Path(__file__).resolve().parents[1]
# directories the commands write, which a clean clone does not have yet
OUTPUTS = ("build", "build-smollm2", "bench_results", ".venv", "runs", "work", "checkpoints", "merged")
NOT_PATHS = ("rocm/jax", "rocm/pytorch",  # container images
             "allenai/c4", "en/c4-")  # a Hub dataset and files inside it (docs/cli.md, --dataset)
PATHLIKE = re.compile(r"`([A-Za-z0-9_.\-/]+)`|\]\(([A-Za-z0-9_.\-/#]+)\)")
FILE_EXT = (".md", ".py", ".ipynb", ".json", ".jsonl", ".txt", ".yml", ".toml", ".png", ".html", ".safetensors")


def parser_flags() -> dict[str, set[str]]:
    p = cli.build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {s for a in sp._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
            for name, sp in sub.choices.items()}


def test_cli_doc_lists_exactly_the_parser_flags():
    text = (REPO / "docs" / "cli.md").read_text()
    sections = dict(re.findall(r"^## `amdllm (\w+)`\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M))
    flags = parser_flags()
    assert set(sections) == set(flags), (sorted(sections), sorted(flags))
    for name, body in sections.items():
        documented = set(re.findall(r"(--[a-z][a-z0-9-]*)", body))
        assert documented == flags[name], (name, "documented, not in the parser:", documented - flags[name],
                                           "in the parser, not documented:", flags[name] - documented)


def prose_sources() -> list[tuple[Path, str]]:
    """(file, text) of everything a user reads: markdown files, notebook markdown, docstrings."""
    out = [(p, p.read_text()) for p in [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]]
    for nb in sorted((REPO / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        out.append((nb, "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")))
    for py in sorted([*(REPO / "amdllm").rglob("*.py"), *(REPO / "benchmarks").glob("*.py"),
                      *(REPO / "tests").glob("*.py"), *(REPO / "notebooks" / "solutions").glob("*.py")]):
        tree = ast.parse(py.read_text())
        docs = [ast.get_docstring(n) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        out.append((py, "\n".join(d for d in docs if d)))
    return out


def strip_code_blocks(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)  # commands in examples name paths a user makes


def cited_paths(text: str) -> list[str]:
    found = []
    for a, b in PATHLIKE.findall(strip_code_blocks(text)):
        cand = (a or b).split("#")[0].rstrip(".,:;")
        if not cand or cand.startswith(("http", "/", "~", "$", "-")) or "..." in cand:
            continue
        if "/" in cand or cand.endswith((".md", ".ipynb")):
            found.append(cand)
    return found


def test_no_reference_points_outside_the_repository():
    """Notes the developers keep outside the repository are not cited anywhere, comments included."""
    files = [f for f, _ in prose_sources() if f != Path(__file__)] + [REPO / "Makefile", REPO / "environment.yml"]
    bad = [f"{f.relative_to(REPO)}: {needle}" for f in files for needle in
           ("../shared", "DESIGN.md", "anchors_", "cpu_performance_notes", "reference/") if needle in f.read_text()]
    bad += [f"{f.relative_to(REPO)}: {m}" for f in files for m in re.findall(r"anchors? \d+\.\d+", f.read_text())]
    assert not bad, bad


def test_every_cited_relative_path_exists():
    missing = []
    for f, text in prose_sources():
        for cand in cited_paths(text):
            first = cand.split("/")[0]
            if first in OUTPUTS or first.isupper() or "<" in cand or cand.startswith(NOT_PATHS):  # outputs, placeholders
                continue
            if not any((base / cand).exists() for base in (REPO, f.parent, REPO / "amdllm")):
                missing.append(f"{f.relative_to(REPO)}: {cand}")
    assert not missing, missing


def lock() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements" / "lock.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def test_environment_yml_installs_the_lock():
    """One source: environment.yml's pip section takes requirements/lock.txt (and the package), pins
    nothing of its own that could drift from it, and asks for the Python the lock was made on."""
    env = (REPO / "environment.yml").read_text()
    pip_lines = [l.strip()[2:].strip() for l in env.split("- pip:")[1].splitlines() if l.strip().startswith("- ")]
    assert "-r requirements/lock.txt" in pip_lines, pip_lines
    own_pins = [l for l in pip_lines if "==" in l]
    assert not own_pins, f"environment.yml pins packages itself, which can drift from the lock: {own_pins}"
    assert "python=3.11" in env
    pins = lock()
    for pkg in ("papermill", "jax", "jaxlib", "flax", "torch", "transformers", "peft", "ipykernel"):
        assert pkg in pins, f"{pkg} is not pinned in requirements/lock.txt"


@pytest.mark.parametrize("name", ["cli.md", "formats.md"])
def test_docs_exist_and_are_linked_from_the_readme(name):
    assert (REPO / "docs" / name).is_file()
    assert f"docs/{name}" in (REPO / "README.md").read_text()


MEASURED = re.compile(r"#.*\d+(\.\d+)? ?(ms|us|GB/s|tok/s|tokens/s|GFLOP/s|TFLOP/s|x faster|x slower)\b")


def test_sizes_a_reader_can_take_in():
    """README.md at most 150 lines and BENCHMARKS.md 200; a module at most 400 lines, the model file 300; a
    docstring at most 8 lines; no comment in the package states a measured figure (BENCHMARKS.md holds them)."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 150
    assert len((REPO / "BENCHMARKS.md").read_text().splitlines()) <= 200
    bad = []
    for py in sorted((REPO / "amdllm").rglob("*.py")):
        src = py.read_text()
        n, limit = len(src.splitlines()), 300 if py.name == "llama.py" else 400
        if n > limit:
            bad.append(f"{py.relative_to(REPO)}: {n} lines (at most {limit})")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc and len(doc.splitlines()) > 8:
                    bad.append(f"{py.relative_to(REPO)}: the docstring of {getattr(node, 'name', 'the module')} "
                               f"has {len(doc.splitlines())} lines")
        bad += [f"{py.relative_to(REPO)}:{i}: a measured figure in a comment" for i, line in
                enumerate(src.splitlines(), 1) if MEASURED.search(line)]
    assert not bad, "\n".join(bad)
