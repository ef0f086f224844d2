"""Files in and out: safetensors, Hugging Face checkpoints (dense and GPTQ), PEFT adapters, tokenizers,
and the one table of Hugging Face names."""
