#!/usr/bin/env bash
# LoRA fine-tuning of Llama 3.1 405B (the Felafax recipe) as one command. Every process of the run executes
# this same script: one process per node, each owning its node's 8 GPUs. one_node.sh and slurm.sbatch
# start it; on a cluster without a scheduler, export JAX_COORDINATOR_ADDRESS=node0:12345
# JAX_NUM_PROCESSES=N JAX_PROCESS_ID=i on each node and run it there.
#
# Every setting below can be overridden from the environment (MODEL=... STEPS=... bash train.sh), and
# extra finetune flags go after the script's name. `amdllm finetune` prints the planner's memory per
# device beside XLA's figure for the compiled step before training, and refuses a run the plan says
# does not fit before reading any weight. With --resume a restarted job continues from its last checkpoint.
set -euo pipefail

MODEL=${MODEL:-/data/Llama-3.1-405B}    # HF checkpoint directory (safetensors), on storage every node sees
DATA=${DATA:-data/task_train.jsonl}     # JSONL rows: Alpaca, chat (messages) or plain (text)
OUT=${OUT:-runs/llama-3.1-405b-lora}    # written by process 0 only
MESH=${MESH:-fsdp=8}                    # one node; N nodes: data=N,fsdp=8 (fsdp inside a node)
STEPS=${STEPS:-1000}
BATCH=${BATCH:-16}                      # rows per step, split over the mesh's data x fsdp devices
SEQ=${SEQ:-2048}
RANK=${RANK:-8}
TARGETS=${TARGETS:-q,k,v,o}
AMDLLM=${AMDLLM:-amdllm}                # the command (tests use "python -m amdllm.cli")

$AMDLLM finetune --model "$MODEL" --data "$DATA" --out "$OUT" \
  --mesh "$MESH" --rules fsdp --dtype bfloat16 --remat \
  --rank "$RANK" --targets "$TARGETS" --batch-size "$BATCH" --seq-len "$SEQ" \
  --steps "$STEPS" --lr 2e-4 --save-every 50 --resume "$@"
