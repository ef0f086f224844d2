"""Class "resume": a resume trains on exactly what the run was started on, or refuses; what a crash or a
full disk leaves behind never loses a finished step. Through `amdllm finetune` in a subprocess."""
import json
import os
import shutil
import sys

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


def test_resume_with_another_model_or_dtype_is_refused(tiny, run, tmp_path):
    """Same shape, other weights: the sample of every weight's first row tells them apart; and --dtype."""
    from tests.tiny import make_hf_checkpoint
    other, _ = make_hf_checkpoint(tmp_path, name="other", vocab_size=320, bos_token_id=0, eos_token_id=1,
                                  pad_token_id=2, max_position_embeddings=128, seed=7)
    for f in [*tiny["model"].glob("tok*.json"), tiny["model"] / "special_tokens_map.json"]:
        shutil.copy(f, other / f.name)
    out = copy_run(run, tmp_path / "run")
    (out / "adapter_config.json").unlink()
    p = amdllm("finetune", "--model", other, "--data", tiny["data"], "--out", out, *RUN, "--resume")
    one_line_error(p, "cannot resume with different model", "sample_sha256")
    one_line_error(finetune(tiny, out, "--resume", "--dtype", "bfloat16"), "cannot resume with different model",
                   "dtypes")


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


RENAMES = "rename,renameat,renameat2"


def traced_renames(log) -> list[str]:
    """The destination of every rename a traced run made, in order (strace -o LOG lines)."""
    out = []
    for ln in log.read_text().splitlines():
        if "rename" in ln and "= 0" in ln:
            out.append(ln.split('"')[-2])  # the last quoted path: the destination
    return out


@pytest.fixture(scope="module")
def traced(tiny, tmp_path_factory):
    """The uninterrupted run under strace: the renames it makes (each a point a kill can land at) and its
    adapter, the reference every resumed run must equal bit for bit."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed (apt install strace): the kill cannot be injected")
    root = tmp_path_factory.mktemp("killed")
    out, log = root / "ref", root / "strace.log"
    p = amdllm("strace", "-f", "-qq", "-e", f"trace={RENAMES}", "-o", log, sys.executable, "-m", "amdllm.cli",
               "finetune", "--model", tiny["model"], "--data", tiny["data"], "--out", out, *RUN, raw=True)
    assert p.returncode == 0, p.stderr[-2000:]
    return traced_renames(log), stn.load_file(str(out / "adapter_model.safetensors"))


@pytest.mark.parametrize("at", ["the first rename", "the first checkpoint's rename", "the adapter's rename"])
def test_a_run_killed_at_a_rename_resumes_bit_exact(at, tiny, traced, tmp_path):
    """SIGKILL at the k-th rename (strace's fault injection): before anything is saved, as the first
    checkpoint appears, and as the adapter is written. `--resume` then finishes the run, and its adapter
    equals the uninterrupted run's."""
    renames, ref = traced
    k = {"the first rename": 1,
         "the first checkpoint's rename": next(i for i, d in enumerate(renames, 1) if d.endswith("step_000001")),
         "the adapter's rename": next(i for i, d in enumerate(renames, 1)
                                      if d.endswith("adapter_model.safetensors"))}[at]
    out = tmp_path / "run"
    p = amdllm("strace", "-f", "-qq", "-o", os.devnull, "-e", f"trace={RENAMES}", "-e",
               f"inject={RENAMES}:signal=KILL:when={k}", sys.executable, "-m", "amdllm.cli", "finetune",
               "--model", tiny["model"], "--data", tiny["data"], "--out", out, *RUN, raw=True)
    assert p.returncode != 0 and out.is_dir(), f"the kill at rename {k} did not land: {p.stderr[-500:]}"
    p = finetune(tiny, out, "--resume")
    assert p.returncode == 0, p.stderr[-2000:]
    ours = stn.load_file(str(out / "adapter_model.safetensors"))
    assert ours.keys() == ref.keys()
    for name in ref:
        np.testing.assert_array_equal(ours[name], ref[name], err_msg=name)


def test_a_second_finetune_into_a_running_out_is_refused_and_ctrl_c_stops_at_a_step(tiny, tmp_path):
    """While a finetune runs, another into the same --out is refused in one line (no lock: both passed the
    emptiness check, and one adapter replaced the other). Then SIGINT: the step in flight finishes, a
    checkpoint is written, one line says where it stopped, the exit status is 130 (not a crash on the
    way out), and --resume finishes the run."""
    import signal
    import subprocess
    import time
    out = tmp_path / "run"
    run = ["--steps", "3000", "--save-every", "100000", "--log-every", "1", "--batch-size", "2", "--seq-len", "32",
           "--rank", "4", "--no-progress"]
    cmd = [sys.executable, "-m", "amdllm.cli", "finetune", "--model", str(tiny["model"]), "--data",
           str(tiny["data"]), "--out", str(out), *run]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    # the signal goes once training runs: after the first logged step (an event, not a clock)
    while child.poll() is None and not (metrics.is_file() and '"loss"' in metrics.read_text()):
        time.sleep(0.05)
    assert child.poll() is None, f"finished before it could be interrupted: {child.communicate()[1][-1000:]}"
    one_line_error(amdllm("finetune", "--model", tiny["model"], "--data", tiny["data"], "--out", out, *run),
                   "another amdllm command", str(out.name))
    assert child.poll() is None  # the refused one touched nothing: the first is still training
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=300)
    assert child.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "Segmentation" not in err, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert "interrupted after step" in last and "--resume" in last, err[-2000:]
    step = int(last.split("after step ")[1].split()[0])
    assert (out / "checkpoints" / f"step_{step:06d}").is_dir() and 0 < step < 3000
    p = amdllm("finetune", "--model", tiny["model"], "--data", tiny["data"], "--out", out, *run, "--resume")
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(metrics.read_text().splitlines()[-1]).get("step") == 3000
