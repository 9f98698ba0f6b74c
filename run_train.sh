#!/usr/bin/env bash
# Launch training on this machine: one process per GPU, or 2 CPU processes without a GPU (or
# with --training.device cpu).
#
#   ./run_train.sh                                    # configs/debug_model.toml on NGPU ranks
#   CONFIG_FILE=configs/llama3_8b.toml ./run_train.sh --training.steps 100
#   NGPU=4 ./run_train.sh --parallelism.data_parallel_replicate_degree=2
#
# Variables: NGPU (ranks; default: visible CUDA GPUs, else 2 on CPU), CONFIG_FILE (default
# configs/debug_model.toml), LOG_RANK (ranks whose output is shown, default 0; e.g. 0,1),
# MAX_RESTARTS (in-job restarts after a rank dies or hangs, default 0: torchrun's --max-restarts).
# Every argument is a config override: --section.key value or --section.key=value.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG_FILE="${CONFIG_FILE:-$ROOT/configs/debug_model.toml}"
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export LOG_RANK="${LOG_RANK:-0}"   # read by trainer.train: other ranks' stdout is discarded

# nccl's flight recorder: the last collectives of each rank, dumped when a collective times out
# (to TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>, default /tmp/nccl_trace_rank_<rank>).
export TORCH_NCCL_TRACE_BUFFER_SIZE="${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}"
export TORCH_NCCL_DUMP_ON_TIMEOUT="${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}"

# --check: the launcher checks the config first: a mistake is one line, before any process
# starts. The check also decides the ranks: NGPU if set, else every visible GPU, else 2 CPU
# ranks ([training] device = cpu always means CPU ranks), and NGPU beyond the visible GPUs is a
# config error; and shares the cores out between the ranks (OMP_NUM_THREADS, where unset).
# --rdzv_id: one id per launch, which the restart guard tells launches apart by. A loopback
# endpoint and --local-addr keep the launcher's stores on loopback (trainer/launch.py).
exec "$PYTHON" -m trainer.launch --check --nnodes 1 --nproc_per_node "${NGPU:-}" \
  --max-restarts "${MAX_RESTARTS:-0}" --rdzv_id "local-$$-$(date +%s)" \
  --rdzv_backend c10d --rdzv_endpoint localhost:0 --local-addr 127.0.0.1 \
  -m trainer.train --job.config_file "$CONFIG_FILE" "$@"
