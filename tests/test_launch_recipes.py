"""The 405B launch recipe is files that run (examples/405b/): `one_node.sh` as one process of 8 devices, and
`slurm.sbatch` under a stand-in `srun` (tests/bin/srun) as 2 tasks of 4 CPU devices that find each other
through SLURM's variables, as on 2 nodes. Scaled down: a small checkpoint and a few steps, same script,
same code path. Every variable the scripts set is documented in the README's 405B section."""
import json
import os
import random
import re
import socket
import subprocess
from pathlib import Path

import pytest

from amdllm.course.cluster import EXAMPLES, amdllm_command, cluster_env
from tests.cluster import make_model

ROOT = Path(__file__).resolve().parents[1]
RECIPE = EXAMPLES / "405b"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("recipe"), hidden=64, intermediate=128, layers=2, heads=8,
                      kv_heads=8)


def settings(model, out, mesh):
    return {"MODEL": model, "DATA": model.parent / "train.jsonl", "OUT": out, "MESH": mesh, "STEPS": 3,
            "BATCH": 8, "SEQ": 64, "AMDLLM": " ".join(amdllm_command())}


def run(argv, env, timeout=600):
    return subprocess.run([str(a) for a in argv], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_one_node_script(model, tmp_path):
    env = cluster_env(8, settings(model, tmp_path / "out", "fsdp=8"))
    p = run(["bash", RECIPE / "one_node.sh", "--no-progress", "--json"], env)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert r["dtype"] == "bfloat16" and r["steps"] == 3 and r["memory"]["processes"] == 1
    assert "memory per device for this step: plan" in p.stderr
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    # --resume in the recipe: the same command again, after the run finished, is refused in one line
    again = run(["bash", RECIPE / "one_node.sh", "--no-progress"], env)
    assert again.returncode == 2 and "already finished" in again.stderr.strip().splitlines()[-1]


def test_slurm_script_under_srun(model, tmp_path):
    port = slurm_port()
    env = cluster_env(4, {**settings(model, tmp_path / "out", "data=2,fsdp=4"), "SLURM_NNODES": 2,
                          "SLURM_JOB_ID": port - 61440 + 4096 * 7})
    env["PATH"] = f"{ROOT / 'tests' / 'bin'}{os.pathsep}{env['PATH']}"
    p = run(["bash", RECIPE / "slurm.sbatch", "--no-progress", "--json", "--init-timeout", "60"], env)
    assert p.returncode == 0, p.stderr[-3000:]
    outs = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert sorted(o["memory"]["process"] for o in outs) == [0, 1] and all(o["memory"]["processes"] == 2 for o in outs)
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()


def slurm_port() -> int:
    """A free port where JAX's SLURM rule puts the coordinator: 61440 + SLURM_JOB_ID % 4096."""
    for port in random.Random(os.getpid()).sample(range(61440, 65536), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port in 61440..65535")


def test_every_variable_the_scripts_set_is_documented():
    section = (ROOT / "docs" / "405b.md").read_text()
    names = set()
    for f in RECIPE.iterdir():
        names |= set(re.findall(r"^#? ?export ([A-Z_]+)=", f.read_text(), re.M))
        names |= set(re.findall(r"^([A-Z_]+)=\$\{", f.read_text(), re.M))
    assert {"HIP_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "MODEL", "MESH"} <= names
    missing = sorted(n for n in names if f"`{n}`" not in section)
    assert not missing, f"set by examples/405b/ but not explained in docs/405b.md: {missing}"
