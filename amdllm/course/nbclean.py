"""Committed notebooks carry no outputs, execution counts or run metadata: find what is dirty, and strip it.
`python -m amdllm.course.notebooks strip [--check]` is the command (tests/test_notebooks.py checks the repository).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from amdllm.files import atomic_write_text

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = REPO / "notebooks"
_RUN_METADATA = ("papermill", "widgets", "execution")


def dirty_cells(nb) -> list[str]:
    """Why this notebook is not clean: one line per offending cell/field (empty list = clean)."""
    problems = [f"notebook metadata '{k}'" for k in _RUN_METADATA if k in nb.metadata]
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if cell.get("outputs"):
            problems.append(f"cell {i}: has outputs")
        if cell.get("execution_count") is not None:
            problems.append(f"cell {i}: execution_count {cell.execution_count}")
        if any(k in cell.metadata for k in _RUN_METADATA):
            problems.append(f"cell {i}: run metadata")
    return problems


def strip_notebook(nb):
    for k in _RUN_METADATA:
        nb.metadata.pop(k, None)
    for cell in nb.cells:
        for k in _RUN_METADATA:
            cell.metadata.pop(k, None)
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    return nb


def notebook_paths(paths: list[str] | None = None) -> list[Path]:
    if paths:
        return [Path(p) for p in paths]
    return sorted(NOTEBOOK_DIR.glob("*.ipynb")) + sorted((NOTEBOOK_DIR / "solutions").glob("*.ipynb"))


def strip(paths: list[str] | None = None, check: bool = False) -> dict[str, list[str]]:
    """Strip (or with check=True only inspect) notebooks; returns {path: problems found}."""
    import nbformat  # costs seconds (jsonschema): imported when stripping, not by the runner's every user

    found = {}
    for path in notebook_paths(paths):
        if not Path(path).is_file():
            raise ValueError(f"{path}: no such notebook file")
        try:
            nb = nbformat.read(path, as_version=4)
        except (ValueError, KeyError, AttributeError) as e:  # nbformat's NotJSONError is a ValueError
            raise ValueError(f"{path}: not a Jupyter notebook ({str(e).splitlines()[0][:120]})") from None
        problems = dirty_cells(nb)
        if problems:
            found[str(path)] = problems
            if not check:
                atomic_write_text(path, nbformat.writes(strip_notebook(nb)) + "\n")
    return found


def settle_progress(path: str | Path) -> None:
    """An executed notebook's text progress bars as their last state. The kernel sends each redraw of a
    bar ("desc:  40%|####  | 4/10 ...", no newline) as its own stream output; a redraw that the next
    output of the same stream redraws again is dropped, so each viewer shows what a terminal would."""
    if not Path(path).is_file():  # the notebook failed before papermill wrote it
        return
    bar = re.compile(r"\r?[^\n]*\d+%\|[^\n]*")
    nb = json.loads(Path(path).read_text())
    for cell in nb.get("cells", []):
        outs = cell.get("outputs", [])
        redraw = [o.get("output_type") == "stream" and bar.fullmatch("".join(o["text"])) is not None for o in outs]
        cell["outputs"] = [o for i, o in enumerate(outs) if not (redraw[i] and i + 1 < len(outs) and redraw[i + 1]
                                                                 and outs[i + 1]["name"] == o["name"])]
    atomic_write_text(path, json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
