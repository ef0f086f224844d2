"""amdllm: fine-tune and quantize Llama-family models with JAX, on AMD GPUs, TPUs and laptop CPUs."""
__version__ = "0.1.0"
