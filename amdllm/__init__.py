"""amdllm: fine-tune and quantize Llama-family models with JAX. Layers (a module imports its own or lower):
    L0  config, files, env          configuration, atomic file writes, the machine's facts
    L1  model/                      the Llama model, its fast paths, LoRA factors, GPTQ-packed weights
    L2  io/, parallel/, backends/   checkpoints and tokenizers; meshes and the planner; one seam per machine
    L3  quant/, infer/              GPTQ and RTN; generation, perplexity, serving
    L4  train/                      LoRA fine-tuning
    L5  course/, cli/               the course and its default model; the `amdllm` command
Short names, loaded on first use: `from amdllm import checkpoint, course, plots`."""
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
