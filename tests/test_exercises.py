"""The lessons' exercise checks (`amdllm.course.exercises.check`): the answers they expect agree with
the libraries the course compares itself with (peft, safetensors) and with the lessons' own tools, a
right answer passes, a wrong one fails with a hint, and None only says what form the answer takes."""
import math

import jax
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from transformers import LlamaForCausalLM

from amdllm import course
from amdllm.config import LlamaConfig
from amdllm.course import exercises
from amdllm.course.exercises import EXERCISES, check
from amdllm.parallel import sharding

HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def model_dir():
    return course.default_model_dir()


def _peft_count(model_dir, rank, targets):
    base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    return peft_model.get_nb_trainable_parameters()[0]


def test_lora_counts_are_peft_s(model_dir):
    truth = EXERCISES["03.1"].truth(model_dir)
    assert truth == {r: _peft_count(model_dir, r, HF_TARGETS) for r in (1, 8, 32)}
    assert EXERCISES["03.2"].truth(model_dir) == {8: _peft_count(model_dir, 8, ["q_proj", "v_proj"])}
    assert len(set(truth.values())) == 3  # the answers differ


def test_largest_tensor_is_what_safetensors_reads(model_dir):
    sizes = {}
    for f in model_dir.glob("*.safetensors"):
        with safe_open(f, "np") as st:
            sizes.update({n: st.get_tensor(n).nbytes for n in st.keys()})
    name, nbytes = EXERCISES["01.1"].truth(model_dir)
    assert sizes[name] == nbytes == max(sizes.values())


def test_presets_follow_the_sharding_table_on_a_real_mesh(model_dir):
    """The planner's byte count that 02.1 uses is the one the lesson's sharding table shows."""
    cfg = LlamaConfig.from_json(model_dir / "config.json")
    devices = jax.devices()[:8]
    per = {}
    for rules, axes in exercises.PRESET_MESHES.items():
        mesh = sharding.make_mesh(axes, devices=devices)
        per[rules] = sum(r["bytes_per_device"] for r in sharding.sharding_table(cfg, mesh, rules))
    least, none_moved = EXERCISES["02.1"].truth(model_dir)
    assert set(least) == {r for r, b in per.items() if b == min(per.values())}
    assert none_moved == "dp" and per["dp"] == max(per.values())


def _right(key, model_dir):
    truth = EXERCISES[key].truth(model_dir)
    if key == "02.1":
        return truth[0][0], truth[1]
    if key == "03.3":
        return 2.5, 2.5 + 1e-7, 1e-7
    if key == "05.1":
        return "the seed", "greedy decoding"
    return truth


WRONG = {"00.1": ("tpu", 3), "00.3": (4, 4), "01.1": ("model.norm.weight", 10), "02.1": ("dp", "fsdp"),
         "02.3": (1, 1), "03.1": {1: 1, 8: 8, 32: 32}, "03.2": {8: 1}, "03.3": (2.5, 2.6, 0.1),
         "04.2": {-1: 1, 64: 2, 32: 3}, "05.1": ("temperature", "top_k")}


@pytest.mark.parametrize("key", sorted(EXERCISES))
def test_a_right_answer_passes_and_a_wrong_one_gets_a_hint(key, model_dir, capsys):
    assert check(key, None, model_dir=model_dir) is None
    assert "no answer yet. Expected:" in capsys.readouterr().out
    assert check(key, _right(key, model_dir), model_dir=model_dir) is True
    assert capsys.readouterr().out.strip() == f"{key}: right."
    assert check(key, WRONG[key], model_dir=model_dir) is False
    assert "not yet. Hint:" in capsys.readouterr().out
    assert check(key, "nonsense", model_dir=model_dir) is False  # a malformed answer is just wrong


def test_bytes_on_paper_grow_as_groups_shrink(model_dir):
    b = EXERCISES["04.2"].truth(model_dir)
    assert b[-1] < b[64] < b[32] and all(math.isfinite(v) for v in b.values())


def test_an_unknown_exercise_is_named():
    with pytest.raises(KeyError, match="no check for exercise '9.9'"):
        check("9.9", 1)
