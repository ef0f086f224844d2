"""amdllm: fine-tune and quantize Llama-family models with JAX, on AMD GPUs, TPUs and laptop CPUs.

The package is layered; a module imports only from its own layer or lower ones (tests/test_imports.py):

    L0  config, files, env, heap,   configuration, atomic file writes, the machine's facts, glibc's malloc
        cpu                         for XLA:CPU, CPU back-end options
    L0  native/                     C++ kernels XLA calls on a CPU: bf16 weights times a few rows (decoding)
                                    or many (AMX tiles: training, evaluation)
    L1  model/                      the Llama model, LoRA factors, GPTQ-packed weights
    L2  io/, parallel/              checkpoints, adapters, tokenizers; meshes, rules, the planner
    L3  quant/, infer/              GPTQ and RTN; generation, perplexity, serving
    L4  train/                      LoRA fine-tuning (it evaluates by generating)
    L5  course/, cli/               the course and its default model; the `amdllm` command

The modules a lesson uses most are also reachable from here, loaded on first use:
`from amdllm import checkpoint, course, plots` (amdllm.io.checkpoint, amdllm.course, amdllm.course.plots).
"""
import importlib

__version__ = "0.1.0"

_SHORT = {  # short name -> module, for notebooks and user code; the package itself imports full paths
    "checkpoint": "amdllm.io.checkpoint", "tokenizer": "amdllm.io.tokenizer", "peft": "amdllm.io.peft",
    "gptq_format": "amdllm.io.gptq_format", "lora": "amdllm.model.lora", "sharding": "amdllm.parallel.sharding",
    "plan": "amdllm.parallel.plan", "distributed": "amdllm.parallel.distributed", "generate": "amdllm.infer.generate",
    "evaluate": "amdllm.infer.evaluate", "serve": "amdllm.infer.serve", "data": "amdllm.train.data",
    "corpus": "amdllm.course.corpus", "plots": "amdllm.course.plots", "widgets": "amdllm.course.widgets",
    "notebooks": "amdllm.course.notebooks",
}


def __getattr__(name: str):
    if name in _SHORT:
        module = importlib.import_module(_SHORT[name])
        globals()[name] = module
        return module
    raise AttributeError(f"module 'amdllm' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_SHORT])
