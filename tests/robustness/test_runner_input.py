"""The notebook runner's bad input: one line naming the file, exit 2, no traceback."""
import subprocess
import sys


def runner(*args):
    return subprocess.run([sys.executable, "-m", "amdllm.course.notebooks", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def one_line(p, *named):
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("amdllm.course.notebooks: error: "), last
    for n in named:
        assert n in last, (n, last)


def test_strip_names_a_missing_or_non_notebook_file(tmp_path):
    one_line(runner("strip", tmp_path / "missing.ipynb"), str(tmp_path / "missing.ipynb"), "no such notebook")
    bad = tmp_path / "bad.ipynb"
    bad.write_text("not json\n")
    one_line(runner("strip", bad), str(bad), "not a Jupyter notebook")
    assert bad.read_text() == "not json\n"  # the input is left as it was


def test_run_names_an_out_that_cannot_be_written(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("")
    one_line(runner("run", "--out", f / "x", "--only", "00"), "Not a directory", f"--out {f / 'x'}")
