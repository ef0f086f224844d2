#!/usr/bin/env bash
# Llama 3.1 405B LoRA on one node of 8x MI300X: one process that owns all 8 GPUs (mesh fsdp=8).
# Run from the repository root:  MODEL=/data/Llama-3.1-405B bash examples/405b/one_node.sh
set -euo pipefail

# ROCm and JAX settings (each can be overridden from the environment)
export HIP_VISIBLE_DEVICES=${HIP_VISIBLE_DEVICES:-0,1,2,3,4,5,6,7}  # the GPUs this process owns
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}  # JAX's share of each GPU (default 0.75)
export HSA_FORCE_FINE_GRAIN_PCIE=${HSA_FORCE_FINE_GRAIN_PCIE:-1}    # RCCL: fine-grained memory for GPU-to-GPU copies
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}   # RCCL reads NCCL_* names; INFO prints the rings and channels it builds

exec bash "$(dirname "$0")/train.sh" "$@"
