"""Class "data loss": no command writes over its input, or over an earlier result without --overwrite,
and a write that fails part-way (here: a file-size limit, as a full disk) leaves the earlier result whole.
Every case runs the `amdllm` command in a subprocess and then checks the files byte for byte."""
import hashlib
import resource

import pytest

from tests.robustness.conftest import amdllm, copy_model, one_line_error

QUANT = ["--method", "rtn", "--group-size", "32"]


def digest(d):
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture
def model(tiny, tmp_path):
    return copy_model(tiny, tmp_path / "model")


@pytest.mark.parametrize("cmd", ["quantize", "convert", "finetune"])
def test_out_equal_to_the_model_is_refused_even_with_overwrite(cmd, tiny, model):
    before = digest(model)
    extra = {"quantize": QUANT, "convert": [], "finetune": ["--data", tiny["data"], "--steps", "1"]}[cmd]
    for flags in ([], ["--overwrite"]):
        if cmd == "convert" and flags:
            continue  # convert has no --overwrite: an existing --out is always refused
        one_line_error(amdllm(cmd, "--model", model, "--out", model, *extra, *flags), "--out", "input")
    assert digest(model) == before


@pytest.mark.parametrize("cmd", ["quantize", "convert", "finetune"])
def test_out_around_or_inside_the_model_is_refused_even_with_overwrite(cmd, tiny, tmp_path):
    """The parent of --model (it holds the model) and a folder inside --model: containment either way."""
    parent = tmp_path / "parent"
    model = copy_model(tiny, parent / "model")
    (parent / "notes.txt").write_text("the user's own file beside the model")
    before = digest(parent)
    extra = {"quantize": QUANT, "convert": [], "finetune": ["--data", tiny["data"], "--steps", "1"]}[cmd]
    flags = [] if cmd == "convert" else ["--overwrite"]
    one_line_error(amdllm(cmd, "--model", model, "--out", parent, *extra, *flags), "--out", "holds an input",
                   "--model")
    one_line_error(amdllm(cmd, "--model", model, "--out", model / "out", *extra, *flags), "--out",
                   "lies inside an input", "--model")
    assert digest(parent) == before


def test_an_out_that_holds_the_calibration_text_is_refused(tiny, model, tmp_path):
    out = tmp_path / "q"
    out.mkdir()
    calib = out / "calib.txt"
    calib.write_text(tiny["text"].read_text())
    before = digest(out)
    one_line_error(amdllm("quantize", "--model", model, "--out", out, "--calib", calib, "--group-size", "32",
                          "--samples", "2", "--seq-len", "16", "--overwrite"), "--out", "--calib")
    assert digest(out) == before


@pytest.mark.parametrize("flag", ["--data", "--eval-data", "--chat-template"])
def test_finetune_never_writes_into_the_folder_of_its_data_or_template(flag, tiny, model, tmp_path):
    """A run's folder that holds the data (--data R/metrics.jsonl --out R --overwrite), or the template."""
    run = tmp_path / "run"
    run.mkdir()
    held = run / ("template.jinja" if flag == "--chat-template" else "rows.jsonl")
    held.write_text("{{ messages[0]['content'] }}" if flag == "--chat-template" else tiny["data"].read_text())
    before = digest(run)
    data = [] if flag == "--data" else ["--data", tiny["data"]]
    one_line_error(amdllm("finetune", "--model", model, *data, flag, held, "--out", run, "--steps", "1",
                          "--overwrite"), "--out", flag)
    assert digest(run) == before


def test_an_earlier_quantized_result_is_kept_unless_overwrite(tiny, model, tmp_path):
    out = tmp_path / "q"
    assert amdllm("quantize", "--model", model, "--out", out, *QUANT).returncode == 0
    first = digest(out)
    one_line_error(amdllm("quantize", "--model", model, "--out", out, *QUANT, "--bits", "8"), "--out",
                   "--overwrite")
    assert digest(out) == first
    p = amdllm("quantize", "--model", model, "--out", out, *QUANT, "--bits", "8", "--overwrite")
    assert p.returncode == 0, p.stderr[-2000:]
    assert digest(out) != first


def test_an_earlier_adapter_without_checkpoints_is_kept(tiny, model, tmp_path):
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "adapter_model.safetensors").write_bytes(b"an earlier adapter")
    (out / "adapter_config.json").write_text("{}")
    before = digest(out)
    for flags in ([], ["--resume"]):  # --resume continues checkpoints; there are none to continue here
        one_line_error(amdllm("finetune", "--model", model, "--data", tiny["data"], "--out", out, "--steps", "1",
                              *flags), "--out", "--overwrite")
    assert digest(out) == before


def test_a_failed_overwrite_leaves_the_earlier_result_whole(tiny, model, tmp_path):
    """--overwrite with a write that fails part-way (a file-size limit: EFBIG, as ENOSPC on a full disk):
    the earlier model.safetensors is still the earlier one, byte for byte, and no temporary file is left."""
    out = tmp_path / "q"
    assert amdllm("quantize", "--model", model, "--out", out, *QUANT).returncode == 0
    first = digest(out)
    size = (out / "model.safetensors").stat().st_size

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, size // 2))
    p = amdllm("quantize", "--model", model, "--out", out, *QUANT, "--bits", "8", "--overwrite", preexec_fn=limit)
    one_line_error(p, "File too large", str(out / "model.safetensors"))
    assert digest(out) == first


def test_a_kill_between_the_two_renames_of_an_overwrite_keeps_the_earlier_result(tiny, model, tmp_path):
    """SIGKILL (strace's fault injection) at the rename that moves the new result into place, just after
    the earlier one was moved aside: the next command puts the earlier result back, whole, and treats
    it as any existing --out (refused without --overwrite), instead of deleting it as a leftover."""
    import os
    import shutil
    import sys
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed (apt install strace): the kill cannot be injected")
    out = tmp_path / "q"
    assert amdllm("quantize", "--model", model, "--out", out, *QUANT).returncode == 0
    first = digest(out)
    saved = tmp_path / "saved"
    shutil.copytree(out, saved)
    cmd = [sys.executable, "-m", "amdllm.cli", "quantize", "--model", model, "--out", out, *QUANT, "--bits", "8",
           "--overwrite"]
    # a traced run counts the renames; the one onto --out follows the one that moves it aside
    log = tmp_path / "renames.log"
    trace = ["strace", "-f", "-qq", "-e", "trace=rename,renameat,renameat2"]
    assert amdllm(*trace, "-o", log, *cmd, raw=True).returncode == 0
    done = [ln.split('"')[-2] for ln in log.read_text().splitlines() if "rename" in ln and "= 0" in ln]
    k = done.index(str(out)) + 1
    shutil.rmtree(out)
    shutil.copytree(saved, out)
    p = amdllm(*trace, "-o", os.devnull, "-e", f"inject=rename,renameat,renameat2:signal=KILL:when={k}", *cmd,
               raw=True)
    assert p.returncode != 0 and not out.exists(), f"the kill did not land between the renames: {p.stderr[-500:]}"
    assert list(tmp_path.glob(".q.old-*")), sorted(x.name for x in tmp_path.iterdir())
    one_line_error(amdllm("quantize", "--model", model, "--out", out, *QUANT), "--out", "--overwrite")
    assert digest(out) == first and not list(tmp_path.glob(".q.old-*"))
