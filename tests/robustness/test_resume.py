"""Class "resume": a resume trains on exactly what the run was started on, or refuses; what a crash or a
full disk leaves behind never loses a finished step. Through `amdllm finetune` in a subprocess."""
import json
import os
import shutil

import numpy as np
import pytest
import safetensors.numpy as stn

from tests.robustness.conftest import ROWS, amdllm, one_line_error

RUN = ["--steps", "2", "--save-every", "1", "--keep", "3", "--batch-size", "2", "--seq-len", "32", "--rank", "4",
       "--no-progress"]


def finetune(tiny, out, *extra, data=None):
    return amdllm("finetune", "--model", tiny["model"], "--data", data or tiny["data"], "--out", out, *RUN, *extra)


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("resume") / "run"
    p = finetune(tiny, out)
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(c.name for c in (out / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    return out


def copy_run(run, dest):
    shutil.copytree(run, dest)
    return dest


def test_resume_on_other_data_with_the_same_row_count_is_refused(tiny, run, tmp_path):
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({**r, "output": r["output"].replace("the", "a")}) + "\n" for r in ROWS))
    out = copy_run(run, tmp_path / "run")
    for f in ("adapter_config.json", "adapter_model.safetensors"):  # not finished: the data check decides
        (out / f).unlink()
    one_line_error(finetune(tiny, out, "--resume", data=other), "cannot resume with different data", "sha256")


def test_resume_with_other_settings_is_refused(tiny, run, tmp_path):
    out = copy_run(run, tmp_path / "run")
    (out / "adapter_config.json").unlink()
    one_line_error(finetune(tiny, out, "--resume", "--lr", "0.01"), "cannot resume with different lr")


def test_resume_on_a_finished_run_is_one_line(tiny, run, tmp_path):
    out = copy_run(run, tmp_path / "run")
    one_line_error(finetune(tiny, out, "--resume"), "already finished its 2 steps")


def test_a_cut_checkpoint_falls_back_to_the_one_before_and_loses_nothing(tiny, run, tmp_path):
    """The newest checkpoint's state cut short (a full disk, a crash of the storage) and the adapter not
    yet written (the run died after it): --resume warns naming the file, continues from step 1, and the
    adapter equals the uninterrupted run's. A killed save's leftovers (a staging directory of a dead
    process, a temporary file beside the adapter) are removed by the same run."""
    out = copy_run(run, tmp_path / "run")
    state = out / "checkpoints" / "step_000002" / "state.safetensors"
    state.write_bytes(state.read_bytes()[:-200])
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (out / f).unlink()
    dead = out / "checkpoints" / ".tmp-step_000002-999999999"
    dead.mkdir()
    (dead / "state.safetensors").write_bytes(b"half")
    (out / ".adapter_model.safetensors.x1y2.tmp").write_bytes(b"half")
    p = finetune(tiny, out, "--resume")
    assert p.returncode == 0, p.stderr[-2000:]
    warned = [ln for ln in p.stderr.splitlines() if ": warning: " in ln]
    assert any(str(state) in ln and "resuming from the checkpoint before it" in ln for ln in warned), warned
    assert "Traceback" not in p.stderr
    ours = stn.load_file(str(out / "adapter_model.safetensors"))
    ref = stn.load_file(str(run / "adapter_model.safetensors"))
    assert ours.keys() == ref.keys()
    for k in ref:
        np.testing.assert_array_equal(ours[k], ref[k], err_msg=k)  # bit-exact: the step was redone
    assert not dead.exists() and not list(out.glob(".*.tmp"))
    assert sorted(os.listdir(out / "checkpoints")) == ["step_000001", "step_000002"]
