"""The lessons on the course's real pretrained chat model, SmolLM2-135M-Instruct, at quick sizes: what
`make course MODEL=smollm2` runs (`amdllm.course.models`), through the same runner and checks. The
toy shows the mechanics; this shows they hold on real weights, a real tokenizer and its chat template.
"""
from __future__ import annotations

import shutil

import pytest

from amdllm.course import notebooks as nbrun
from amdllm.course.chat_model import chat_model_dir
from tests.test_notebooks import run_like_make_course


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    chat_model_dir()  # converted once, before the lessons (the wheel is installed at set-up: never a skip)
    return tmp_path_factory.mktemp("jax-cache-real")


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("lesson", ["01", "03", "04", "05"])
def test_lesson_on_the_real_model(lesson, compile_cache):
    recs, out, proc = run_like_make_course(lesson, compile_cache, model="smollm2", timeout=1200)
    try:
        rec = recs[0]
        assert rec["ok"] and proc.returncode == 0, f"{rec['name']} on SmolLM2: {rec['error']}"
        res = rec["results"]
        assert res["model"].startswith("smollm2-135m-instruct"), res  # it ran on the model it was given
        if lesson == "03":
            assert res["eval_loss_after"] < res["eval_loss_before"], res
        if lesson == "04":  # 4-bit visibly costs a real model, and GPTQ less than RTN
            assert res["ppl_rtn4"] > 1.02 * res["ppl_fp"] and res["ppl_gptq4"] < res["ppl_rtn4"], res
    finally:
        shutil.rmtree(nbrun.REPO / out, ignore_errors=True)
