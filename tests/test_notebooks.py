"""The course notebooks: every one executes headless with quick parameters, and git holds them clean.

Outputs are not compared (training numbers drift); each notebook asserts its own key results in its
final cell and writes them to `results_path`, which the runner reads back.
"""
from __future__ import annotations

import json
import py_compile
from pathlib import Path

import nbformat
import pytest

from amdllm import notebooks as nbrun

PRESENT = [n for n in nbrun.NOTEBOOKS if (nbrun.NOTEBOOK_DIR / f"{n}.ipynb").exists()]


def test_course_notebooks_present():
    """All six lessons exist (a missing one must fail loudly, not be silently skipped)."""
    assert PRESENT == list(nbrun.NOTEBOOKS), f"missing: {sorted(set(nbrun.NOTEBOOKS) - set(PRESENT))}"


@pytest.mark.parametrize("name", PRESENT)
def test_notebook_structure(name):
    """A lesson: title, 'You will learn', one `parameters` cell with quick/results_path, scaling up, exercises."""
    nb = nbformat.read(nbrun.NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)
    md = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    for needle in ("You will learn", "Scaling up", "Exercise"):
        assert needle in md, f"{name}: no '{needle}' section"
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, f"{name}: expected exactly one cell tagged 'parameters', found {len(params)}"
    for var in ("quick", "results_path", *nbrun.QUICK_PARAMS.get(name, {})):
        assert f"{var} =" in params[0].source, f"{name}: parameters cell does not define {var}"
    long_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and len(c.source.splitlines()) > 30]
    assert not long_cells, f"{name}: code cells {long_cells} are long; that code belongs in amdllm"


def test_committed_notebooks_are_stripped():
    found = nbrun.strip(check=True)
    assert not found, "notebooks with outputs (run `python -m amdllm.notebooks strip`): " + json.dumps(found)


def test_strip_removes_outputs(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1+1")])
    nb.cells[0].outputs = [nbformat.v4.new_output("execute_result", data={"text/plain": "2"}, execution_count=1)]
    nb.cells[0].execution_count = 1
    nb.metadata["papermill"] = {"duration": 1.0}
    path = tmp_path / "x.ipynb"
    nbformat.write(nb, path)
    assert len(nbrun.dirty_cells(nbformat.read(path, as_version=4))) == 3
    assert str(path) in nbrun.strip([str(path)], check=True)  # check mode reports...
    assert nbrun.dirty_cells(nbformat.read(path, as_version=4))  # ...and does not modify
    nbrun.strip([str(path)])
    assert nbrun.dirty_cells(nbformat.read(path, as_version=4)) == []


def test_solutions_compile():
    files = sorted((nbrun.NOTEBOOK_DIR / "solutions").glob("*.py"))
    assert files, "notebooks/solutions/ holds no solution files"
    for f in files:
        py_compile.compile(str(f), doraise=True)


def test_runner_reports_a_failing_notebook(tmp_path, monkeypatch):
    """A notebook that raises is reported FAILED with the error, and no stale results are trusted."""
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("quick = False\nresults_path = None", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("raise RuntimeError('parity broken: 0.3 > 1e-4')")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    (tmp_path / "nbs").mkdir()
    nbformat.write(nb, tmp_path / "nbs" / "00_setup.ipynb")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "00_setup.results.json").write_text('{"stale": true}')
    monkeypatch.setattr(nbrun, "NOTEBOOK_DIR", tmp_path / "nbs")
    rec = nbrun.run_one("00_setup", tmp_path / "out", quick=True, timeout=120)
    assert not rec["ok"] and "parity broken" in rec["error"] and rec["results"] is None
    assert "FAILED" in nbrun.summary_text([rec])


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    """One JAX compilation cache for the notebooks of this session (as `make course` shares one): the
    lessons compile the same functions; a fresh directory keeps the run independent of earlier ones."""
    return tmp_path_factory.mktemp("jax-cache")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", PRESENT)
def test_notebook_executes(name, tmp_path, compile_cache):
    rec = nbrun.run_one(name, tmp_path, quick=True, timeout=600, compile_cache=compile_cache)
    assert rec["ok"], f"{name} failed after {rec['seconds']} s: {rec['error']} (executed copy: {rec['executed']})"
    assert rec["results"], f"{name} recorded no results"
    executed = nbformat.read(rec["executed"], as_version=4)
    assert any("injected-parameters" in c.metadata.get("tags", []) for c in executed.cells)


def test_layer_sharding_figure_and_memory_snapshot():
    """The figures the lessons show headless: one panel per projection, and the planner's snapshot that a
    rendered notebook keeps (widget output is not saved); an impossible mesh gives no figure, not a stale one."""
    from amdllm import plots, sharding
    from amdllm.course import MODEL
    from amdllm.config import LlamaConfig
    from amdllm.widgets import MemoryExplorer

    cfg = LlamaConfig(**MODEL, vocab_size=1152)
    fig = plots.layer_sharding(cfg, sharding.make_mesh("fsdp=4,tensor=2"), "fsdp_tp")
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert len(titles) == 7 and titles[0].startswith("q_proj") and "'fsdp', 'tensor'" in titles[0], titles
    explorer = MemoryExplorer(model="llama-3.1-70b", devices=8, mesh="fsdp=8", seq_len=4096)
    assert explorer.snapshot() is explorer.figure and "70.55B" in explorer.text
    explorer.update(mesh="tensor=3")
    assert explorer.last is None and explorer.snapshot() is None
