"""A QLoRA adapter in the ecosystem: what `amdllm finetune --model GPTQ_DIR` writes loads in peft on top of the
same GPTQ checkpoint as transformers + GPTQModel load it on the CPU, and gives amdllm's perplexity.

Everything is made here: the course default model quantized by `amdllm quantize` (GPTQ 4-bit g128, sym, no
act-order: a GPTQ v1 checkpoint), a short QLoRA run on it, then the held-out course text measured by
`amdllm eval --dtype float32` and, in GPTQModel's interpreter (benchmarks/common.py finds it, as the
benchmarks do), by transformers' `AutoModelForCausalLM.from_pretrained` (GPTQModel's `gptq_torch` kernel,
float32) + `peft.PeftModel.from_pretrained`, with the protocol of `amdllm eval` written again on
transformers' tokenizer (benchmarks/bench_qlora.py, `peft_side`, which reports the same comparison).

Skipped without GPTQModel's interpreter (`make .venv/gptqmodel-env/.installed`), or without optimum in it:
transformers' GPTQ loader and peft's `dispatch_gptq` both require optimum.
"""
import json

import pytest
from safetensors.numpy import load_file

from amdllm import course
from benchmarks.bench_qlora import (PEFT_NEEDS, PPL_TOLERANCE, QLORA_LR, QLORA_STEPS, amdllm_cli,
                                    peft_reference, rel)
from benchmarks.common import find_gptqmodel_python

PROJECTIONS = 7  # q, k, v, o, gate, up, down: finetune's default targets, every one a GPTQ linear


def gptqmodel_python() -> str:
    python, why, explicit = find_gptqmodel_python(need=PEFT_NEEDS)
    if python is None and explicit:  # $AMDLLM_GPTQMODEL_PYTHON names an interpreter that cannot: say so loudly
        pytest.fail(f"AMDLLM_GPTQMODEL_PYTHON: {why}")
    if python is None and find_gptqmodel_python()[0] is not None:  # GPTQModel is there, optimum (or peft) not
        pytest.skip(f"{why.split(' (')[0]}: transformers' GPTQ loader and peft's dispatch_gptq (peft.import_utils."
                    "is_gptqmodel_available) both require optimum>=1.24; install it into GPTQModel's interpreter "
                    "(pip install --no-deps optimum==2.3.0: pure Python, its dependencies are there)")
    if python is None:
        pytest.skip(f"no interpreter with {', '.join(PEFT_NEEDS)} for the peft + GPTQModel side: {why}")
    return python


def test_qlora_adapter_in_peft_on_gptqmodel_gives_our_perplexity(tmp_path):
    python = gptqmodel_python()
    gptq, adapter, text = tmp_path / "gptq", tmp_path / "qlora", course.heldout_text_path()
    q, _ = amdllm_cli(["quantize", "--out", str(gptq), "--bits", "4", "--group-size", "128", "--samples", "16"])
    assert (q["method"], q["bits"], q["group_size"], q["sym"], q["act_order"], q["format"]) == \
        ("gptq", 4, 128, True, False, "gptq")
    f, _ = amdllm_cli(["finetune", "--model", str(gptq), "--data", str(course.task_paths()[0]), "--out",
                       str(adapter), "--steps", str(QLORA_STEPS), "--lr", str(QLORA_LR), "--no-progress"])
    assert f["steps"] == QLORA_STEPS
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(gptq) and cfg["peft_type"] == "LORA"
    tensors = load_file(adapter / "adapter_model.safetensors")
    b = [v for k, v in tensors.items() if "lora_B" in k]
    assert b and max(float(abs(v).max()) for v in b) > 1e-3, "lora_B is still (near) zero: nothing to compare"

    evals = ["eval", "--model", str(gptq), "--dtype", "float32", "--text", str(text)]
    ours, _ = amdllm_cli(evals + ["--adapter", str(adapter)])
    ours_base, _ = amdllm_cli(evals)
    # the adapter really moves the perplexity, so agreeing on it is not agreeing on the base twice
    assert rel(ours["perplexity"], ours_base["perplexity"]) > 1e-2, (ours, ours_base)

    ref = peft_reference(python, gptq, adapter, text, seq_len=ours["window_tokens"], batch_size=8)
    layers = json.loads((gptq / "config.json").read_text())["num_hidden_layers"]
    # peft wrapped every GPTQ linear (GPTQModel's QuantLinear) with a LoRA layer, and loaded the trained B
    assert ref["quant_linears"] == ref["lora_wrapped"] == PROJECTIONS * layers, ref
    assert ref["lora_wrapper"] == "GPTQLoraLinear" and ref["kernels"] == ["TorchLinear"], ref
    assert ref["lora_B_max_abs"] == pytest.approx(max(float(abs(v).max()) for v in b), rel=1e-6)
    # the same windows: transformers' tokenizer and our encoder give the same ids, the protocol the same count
    assert (ref["windows"], ref["adapter"]["tokens"], ref["base"]["tokens"]) == \
        (ours["windows"], ours["tokens"], ours_base["tokens"])
    assert rel(ref["adapter"]["perplexity"], ref["base"]["perplexity"]) > 1e-2, ref
    assert rel(ours_base["perplexity"], ref["base"]["perplexity"]) <= PPL_TOLERANCE, (ours_base, ref["base"])
    assert rel(ours["perplexity"], ref["adapter"]["perplexity"]) <= PPL_TOLERANCE, (ours, ref["adapter"])
