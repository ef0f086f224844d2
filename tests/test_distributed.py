"""Multi-host on one machine: several local processes on loopback form one global mesh.

* 2 processes x 4 CPU devices load a checkpoint sharded over all 8 and reproduce the
  single-process logits.
* 4 processes x 2 CPU devices load a ~280 MB float32 checkpoint (fsdp over 8 devices) and each
  process's peak memory during the load is measured: about its quarter, not the model (measured:
  owns 70 MB, peak +92..95 MB anonymous, VmHWM +96..101 MB, for a 279 MB model).
Every child is killed in `finally`, whatever happens.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from amdllm.course.cluster import free_port
from amdllm.io import checkpoint
from amdllm.parallel import distributed
from amdllm.config import LlamaConfig
from amdllm.model import forward, to_pure
from tests.tiny import hf_logits, make_hf_checkpoint, random_tokens

ROOT = Path(__file__).resolve().parents[1]
CHILD = ROOT / "tests" / "dist_child.py"


def _launch(mode, nproc, ndev, ckpt, out, timeout=150):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("XLA_FLAGS", None)
    port = free_port()
    procs = []
    try:
        for pid in range(nproc):
            procs.append(subprocess.Popen(
                [sys.executable, str(CHILD), mode, str(port), str(nproc), str(pid), str(ndev), str(ckpt), str(out)],
                env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + timeout
        results = []
        for p in procs:
            try:
                o, e = p.communicate(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{mode}: a child process did not finish within {timeout}s")
            results.append((p.returncode, o, e))
        bad = [(i, rc, e[-3000:]) for i, (rc, o, e) in enumerate(results) if rc != 0]
        assert not bad, f"child processes failed: {bad}"
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def test_two_processes_give_single_process_logits(tmp_path):
    ckpt, hf = make_hf_checkpoint(tmp_path, max_shard_size="60KB")
    tokens = random_tokens(8, 16)
    np.save(tmp_path / "tokens.npy", tokens)
    t0 = time.monotonic()
    _launch("logits", 2, 4, ckpt, tmp_path)
    elapsed = time.monotonic() - t0
    got = np.load(tmp_path / "logits.npy")
    model = checkpoint.load(ckpt)  # single process, unsharded
    top, layers = to_pure(model)
    want = np.asarray(jax.jit(lambda t, l, x: forward(model.cfg, t, l, x)[0])(top, layers, tokens))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got, hf_logits(hf, tokens), atol=1e-4, rtol=0)
    print(f"2-process run: {elapsed:.1f}s")


def _write_big_checkpoint(path: Path) -> int:
    """A float32 HF checkpoint of ~280 MB, one file per layer, written one tensor at a time."""
    cfg = LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
                      num_attention_heads=16, num_key_value_heads=4)
    path.mkdir()
    cfg.to_json(path)
    specs = checkpoint.hf_tensor_specs(cfg)  # HF name -> (ours, layer, transposed, HF shape)
    files: dict[str, list] = {}
    for name, (_, layer, _, shape) in specs.items():
        fname = f"model-{'extra' if layer is None else f'{layer:05d}'}.safetensors"
        seed = len(files.get(fname, [])) + 17 * (layer or 0)
        fetch = (lambda s=shape, k=seed: np.random.default_rng(k).standard_normal(s, dtype=np.float32) * 0.02)
        files.setdefault(fname, []).append((name, shape, np.float32, fetch))
    weight_map = {}
    for fname, entries in files.items():
        checkpoint.write_safetensors(path / fname, entries)
        weight_map.update({e[0]: fname for e in entries})
    total = cfg.num_params() * 4
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def test_sharded_load_peak_memory(tmp_path):
    total = _write_big_checkpoint(tmp_path / "big")
    _launch("memory", 4, 2, tmp_path / "big", tmp_path)
    mems = [json.loads((tmp_path / f"mem{i}.json").read_text()) for i in range(4)]
    mb = 1e6
    print(f"\nmodel {total / mb:.0f} MB; per process (4 x 2 devices, fsdp=8): " + "; ".join(
        f"owned {m['owned'] / mb:.0f} MB, peak anon +{m['anon_peak_delta'] / mb:.0f} MB, "
        f"VmHWM +{m['hwm_delta'] / mb:.0f} MB" for m in mems))
    for m in mems:
        assert abs(m["owned"] - total / 4) < 0.01 * total  # each process holds its quarter (norms replicated)
        # the load allocates about what the process owns, far below the whole model; VmHWM also
        # counts the mapped file pages the loader touched (it releases them tensor by tensor)
        assert m["anon_peak_delta"] < 0.45 * total, m
        assert m["hwm_delta"] < 0.5 * total, m


def test_detect_sources():
    single = distributed.detect({})
    assert single["source"] == "single" and single["num_processes"] == 1
    env = {"JAX_COORDINATOR_ADDRESS": "h:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"}
    assert distributed.detect(env) == {"source": "env", "coordinator_address": "h:1234", "num_processes": 4,
                                       "process_id": 2}
    slurm = distributed.detect({"SLURM_NTASKS": "16", "SLURM_PROCID": "3", "SLURM_JOB_ID": "9"})
    assert slurm["source"] == "slurm" and slurm["num_processes"] == 16 and slurm["process_id"] == 3
    ompi = distributed.detect({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
                               "JAX_COORDINATOR_ADDRESS": "n0:5555"})
    assert ompi == {"source": "openmpi", "num_processes": 2, "process_id": 1, "coordinator_address": "n0:5555"}
    assert distributed.detect({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"})["source"] == "single"
    with pytest.raises(distributed.DistributedError, match="JAX_PROCESS_ID missing"):
        distributed.detect({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"})
    with pytest.raises(distributed.DistributedError, match="JAX_PROCESS_ID='x' is not an integer"):
        distributed.detect({**env, "JAX_PROCESS_ID": "x"})
    with pytest.raises(distributed.DistributedError, match="pass all of coordinator_address"):
        distributed.initialize("h:1", num_processes=2)
    with pytest.raises(distributed.DistributedError, match="process id 5 is outside 0..3"):
        distributed.initialize(env={**env, "JAX_PROCESS_ID": "5"})
    with pytest.raises(distributed.DistributedError, match="must be host:port"):
        distributed.initialize("localhost", 2, 0)
    assert distributed.initialize(env={})["source"] == "single"  # no cluster: nothing started
