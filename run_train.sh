#!/usr/bin/env bash
# Launch training on this machine: one process per GPU, or 2 CPU processes without a GPU.
#
#   ./run_train.sh                                    # configs/debug_model.toml on NGPU ranks
#   CONFIG_FILE=configs/llama3_8b.toml ./run_train.sh --training.steps 100
#   NGPU=4 ./run_train.sh --parallelism.data_parallel_replicate_degree=2
#
# Variables: NGPU (default: visible CUDA GPUs, else 2), CONFIG_FILE (default
# configs/debug_model.toml), LOG_RANK (ranks whose output is shown, default 0; e.g. 0,1).
# Every argument is a config override: --section.key value or --section.key=value.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG_FILE="${CONFIG_FILE:-$ROOT/configs/debug_model.toml}"
PYTHON="${PYTHON:-python3}"
if [ -z "${NGPU:-}" ]; then
  NGPU=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
      NGPU=$(awk -F, '{print NF}' <<<"$CUDA_VISIBLE_DEVICES")
    else
      NGPU=$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true)
    fi
  fi
  [ "$NGPU" -gt 0 ] || NGPU=2
fi
export LOG_RANK="${LOG_RANK:-0}"   # read by trainer.train: other ranks' stdout is discarded
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# CPU threads per rank: the cores shared out between the ranks (torchrun would force 1).
if [ -z "${OMP_NUM_THREADS:-}" ]; then
  cores=$(nproc 2>/dev/null || echo 1)
  export OMP_NUM_THREADS=$(( cores / NGPU > 0 ? cores / NGPU : 1 ))
fi

# Check the config for this world size first: a mistake is one line, before any process starts.
"$PYTHON" -m trainer.config --check --world-size "$NGPU" --job.config_file "$CONFIG_FILE" "$@"

exec "$PYTHON" -m trainer.launch --nnodes 1 --nproc_per_node "$NGPU" \
  --rdzv_backend c10d --rdzv_endpoint localhost:0 \
  -m trainer.train --job.config_file "$CONFIG_FILE" "$@"
