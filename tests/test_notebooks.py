"""The course notebooks: every one executes headless with quick parameters, run exactly as `make course`
runs them (the same command, the same working directory, a relative --out; only XLA's optimisation level
and PyTorch's thread count are the test session's, tests/conftest.py), and git holds them clean.

Outputs are not compared (training numbers drift); each notebook asserts its own key results in its
final cell and writes them to `results_path`, which the runner reads back.
"""
from __future__ import annotations

import json
import os
import py_compile
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import nbformat
import pytest

from amdllm.course import nbclean
from amdllm.course import notebooks as nbrun

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
    for var in ("quick", "results_path", "work_dir", *nbrun.QUICK_PARAMS.get(name, {})):
        assert f"{var} =" in params[0].source, f"{name}: parameters cell does not define {var}"
    long_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and len(c.source.splitlines()) > 30]
    assert not long_cells, f"{name}: code cells {long_cells} are long; that code belongs in amdllm"


def test_notebooks_use_the_kernel_the_runner_and_make_lab_install():
    """One kernel name everywhere: the notebooks' kernelspec, the runner's, and the Makefile's `lab`."""
    for name in PRESENT:
        nb = nbformat.read(nbrun.NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)
        assert nb.metadata["kernelspec"]["name"] == nbrun.KERNEL_NAME, name
    makefile = (nbrun.REPO / "Makefile").read_text()
    assert "amdllm.course.notebooks kernel" in makefile.split("\nlab:")[1].split("\n\n")[0]
    spec = json.loads((nbrun.ensure_kernel() / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable


def test_params_are_resolved_for_the_kernel_and_checked(tmp_path, monkeypatch):
    """A relative --param path is the caller's (the kernel runs in notebooks/), a parameter goes only to the
    notebooks that declare it, and one that none declares is an error naming it."""
    monkeypatch.chdir(tmp_path)
    p = nbrun._params_for("03_lora_finetuning", False, tmp_path / "r.json", tmp_path / "w",
                          {"model_dir": "mine/llama", "train_data": "t.jsonl", "rank": 4})
    assert p["model_dir"] == str(tmp_path / "mine" / "llama") and p["train_data"] == str(tmp_path / "t.jsonl")
    assert p["rank"] == 4
    assert "train_data" not in nbrun._params_for("01_weight_conversion", False, tmp_path / "r.json",
                                                 tmp_path / "w", {"train_data": "t.jsonl"})
    with pytest.raises(ValueError, match="--param trian_data: no selected notebook"):
        nbrun.run(tmp_path / "out", only=["03"], parameters={"trian_data": "t.jsonl"})


def test_committed_notebooks_are_stripped():
    found = nbclean.strip(check=True)
    assert not found, "notebooks with outputs (run `python -m amdllm.course.notebooks strip`): " + json.dumps(found)


def test_strip_removes_outputs(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1+1")])
    nb.cells[0].outputs = [nbformat.v4.new_output("execute_result", data={"text/plain": "2"}, execution_count=1)]
    nb.cells[0].execution_count = 1
    nb.metadata["papermill"] = {"duration": 1.0}
    path = tmp_path / "x.ipynb"
    nbformat.write(nb, path)
    assert len(nbclean.dirty_cells(nbformat.read(path, as_version=4))) == 3
    assert str(path) in nbclean.strip([str(path)], check=True)  # check mode reports...
    assert nbclean.dirty_cells(nbformat.read(path, as_version=4))  # ...and does not modify
    nbclean.strip([str(path)])
    assert nbclean.dirty_cells(nbformat.read(path, as_version=4)) == []


def test_saved_progress_bars_show_their_last_state(tmp_path):
    """Each redraw of a text bar arrives as its own stream output; the saved notebook keeps the last."""
    stream = lambda name, text: nbformat.v4.new_output("stream", name=name, text=text)  # noqa: E731
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("train()")])
    nb.cells[0].outputs = [stream("stderr", "plan: 1 GB\n"), stream("stderr", "run:   0%|  | 0/2"),
                           stream("stderr", "run:  50%|# | 1/2"), stream("stderr", "run: 100%|##| 2/2"),
                           stream("stderr", "\n"), stream("stdout", "kept"), stream("stdout", " too\n")]
    path = tmp_path / "x.ipynb"
    nbformat.write(nb, path)
    nbclean.settle_progress(path)
    texts = [o.text for o in nbformat.read(path, as_version=4).cells[0].outputs]
    assert texts == ["plan: 1 GB\n", "run: 100%|##| 2/2", "\n", "kept", " too\n"], texts  # nothing else lost


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


def run_like_make_course(only: str, compile_cache, params: dict | None = None, timeout: int = 900,
                         model: str = "default"):
    """`python -m amdllm.course.notebooks run --out build/... --quick` from the repository root, as `make course`
    runs it: a relative --out, resolved by the runner against the command's working directory while the
    kernels run in notebooks/. Returns (summary records, the relative out dir); the caller removes it."""
    out = Path("build") / f"pytest-{only}-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "amdllm.course.notebooks", "run", "--out", str(out), "--quick", "--only", only,
           "--compile-cache", str(compile_cache), "--model", model]
    for k, v in (params or {}).items():
        cmd += ["--param", f"{k}={v}"]
    env = {**os.environ, "PYTHONPATH": str(nbrun.REPO)}
    proc = subprocess.run(cmd, cwd=nbrun.REPO, env=env, capture_output=True, text=True, timeout=timeout)
    summary = nbrun.REPO / out / "summary.json"
    assert summary.is_file(), f"no {out}/summary.json (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    assert not (nbrun.NOTEBOOK_DIR / out).exists(), "results landed under notebooks/, the kernel's directory"
    return json.loads(summary.read_text()), out, proc


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", PRESENT)
def test_notebook_executes(name, compile_cache):
    recs, out, proc = run_like_make_course(name.split("_")[0], compile_cache)
    try:
        rec = recs[0]
        assert rec["ok"] and proc.returncode == 0, (f"{name} failed after {rec['seconds']} s: {rec['error']} "
                                                    f"(executed copy: {rec['executed']})")
        assert rec["results"], f"{name} recorded no results"
        executed = nbformat.read(rec["executed"], as_version=4)
        assert any("injected-parameters" in c.metadata.get("tags", []) for c in executed.cells)
        assert "Passed unknown parameter" not in proc.stderr, proc.stderr  # every injected name is a parameter
        assert "without encryption" not in proc.stderr, proc.stderr        # the kernel talks over IPC
        assert set(os.listdir(nbrun.REPO / out)) <= {f"{name}.ipynb", f"{name}.results.json", "summary.json", "work"}
    finally:
        shutil.rmtree(nbrun.REPO / out, ignore_errors=True)


def test_layer_sharding_figure_and_memory_snapshot():
    """The figures the lessons show headless: one panel per projection, and the planner's snapshot that a
    rendered notebook keeps (widget output is not saved); an impossible mesh gives no figure, not a stale one."""
    from amdllm.course import plots
    from amdllm.parallel import sharding
    from amdllm.course import MODEL
    from amdllm.config import LlamaConfig
    from amdllm.course.widgets import MemoryExplorer

    cfg = LlamaConfig(**MODEL, vocab_size=1152)
    fig = plots.layer_sharding(cfg, sharding.make_mesh("fsdp=4,tensor=2"), "fsdp_tp")
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert len(titles) == 7 and titles[0].startswith("q_proj") and "'fsdp', 'tensor'" in titles[0], titles
    explorer = MemoryExplorer(model="llama-3.1-70b", devices=8, mesh="fsdp=8", seq_len=4096)
    assert explorer.snapshot() is explorer.figure and "70.55B" in explorer.text
    explorer.update(mesh="tensor=3")
    assert explorer.last is None and explorer.snapshot() is None


@pytest.mark.timeout(900)
@pytest.mark.parametrize("accelerators", [1, 2])
def test_lesson_02_on_fewer_than_8_devices(accelerators, compile_cache):
    """Lesson 02 where JAX has 1 or 2 devices to offer (`accelerators` stands in for a 1- or 2-GPU machine):
    its meshes go on 8 simulated CPU devices beside them, it says so in one line, and every check passes."""
    recs, out, proc = run_like_make_course("02", compile_cache, {"accelerators": accelerators})
    try:
        rec = recs[0]
        assert rec["ok"] and proc.returncode == 0, rec["error"]
        assert rec["results"]["jax_backend"] == "cpu" and rec["results"]["mesh"] == {"data": 1, "fsdp": 4, "tensor": 2}
        text = "".join(o.get("text", "") for c in nbformat.read(rec["executed"], as_version=4).cells
                       if c.cell_type == "code" for o in c.get("outputs", []))
        assert f"only {accelerators} cpu device(s) here: the meshes use 8 simulated CPU devices instead" in text
    finally:
        shutil.rmtree(nbrun.REPO / out, ignore_errors=True)


def test_the_summary_names_the_backend_and_devices_each_lesson_ran_on():
    recs = [{"name": n, "ok": True, "seconds": 1.0, "cpu_seconds": 1.0, "error": None,
             "results": {"jax_backend": "gpu", "jax_devices": "1 x NVIDIA H100"}} for n in ("00_setup", "01_x")]
    assert "on JAX gpu (1 x NVIDIA H100)" in nbrun.summary_text(recs).splitlines()[-1]
