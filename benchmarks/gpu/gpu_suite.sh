#!/usr/bin/env bash
# One command on a GPU machine: for each shape, the memory plan's verdict, then
# bench_train.py with compile off and on (nccl, bf16, synthetic data: no tokenizer or
# `datasets` needed); each run appends to benchmarks/results.jsonl; a table at the end.
#
#   benchmarks/gpu/gpu_suite.sh              # paths, moe, debug, 1b, 1b-flex, 3b and 8b
#   OUT=$OUT benchmarks/gpu/gpu_suite.sh hybrid  # Gated DeltaNet vs GQA layer, 4k-128k (bench_linear_attention.py)
#   benchmarks/gpu/gpu_suite.sh 1b           # one shape; STEPS=50 WARMUP=15 to change the run
#   VARIANTS_1B="compile float8-rowwise" benchmarks/gpu/gpu_suite.sh 1b
#   OUT=$OUT benchmarks/gpu/gpu_suite.sh ahead   # the speed levers and the side-by-side, ~9 min
#   OUT=$OUT benchmarks/gpu/gpu_suite.sh levers  # 1B b7: the baseline, then each unmeasured lever
#                                            # (no resharding, Muon's step, max-autotune)
#   benchmarks/gpu/gpu_suite.sh mla              # MLA + YaRN under every attention kernel vs fp32
#   OUT=$OUT benchmarks/gpu/gpu_suite.sh suite   # the test suite at -n 8 (SUITE_N), each result
#                                            # streamed to $OUT/suite/suite.log (a cut-off keeps names)
# 1b: compiled bf16 (production), eager, float8 tensorwise and rowwise; 1b-flex: block_causal
# with FlexAttention and with SDPA on the stdlib corpus's documents; 3b: Llama 3.2 3B with and
# without FSDP2 CPU offload; paths: every CUDA path's functional check (benchmarks/gpu/gpu_paths.py)
# and the nccl flight recorder read back (benchmarks/gpu/gpu_flight_recorder.py); moe: grouped GEMM
# against the per-expert loop in bf16, a whole Qwen3-30B-A3B MoE layer's throughput, and a
# debugmodel-moe step against a dense model of equal active size (benchmarks/parallel/bench_moe.py).
# With 2+ GPUs it also runs the debug model at FSDP 2 and TP 2 (eager, compiled, async TP).
#
# 8b is the 8B model on ONE GPU: fp32 master weights, grads and AdamW state alone are
# ~90 GiB, so the plan says it does not fit an 80 GB H100 at all; on an H200 it needs full
# AC and the fused AdamW. Shapes the plan rejects are skipped, with the plan's verdict shown.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PYTHON="${PYTHON:-python3}"
STEPS="${STEPS:-30}"
WARMUP="${WARMUP:-10}"
CONFIG=configs/debug_model.toml
COMMON="--data.dataset synthetic --training.global_batch_size -1 --training.mixed_precision_param bfloat16"
VOCAB="--model.vocab_size 128256"
# 1b: the production settings of configs/llama3_1b.toml (compile, fused AdamW, chunked loss,
# bf16), overriding only what one GPU and a short benchmark force: one microbatch per step
# (global batch -1), no checkpoint writes, synthetic tokens; the local batch is the plan's
# largest that fits this GPU (LOCAL_BATCH=N to choose).
CONFIG_1B=configs/llama3_1b.toml
COMMON_1B="--data.dataset synthetic --training.global_batch_size -1 --checkpoint.enable false"

declare -A SHAPE=(
  [debug]=""
  [1b]=""
  [1b-flex]=""
  [3b]=""
  [paths]=""
  [moe]=""
  [hybrid]=""
  [mla]=""
  [ahead]=""
  [suite]=""
  [levers]=""
  [8b]="--model.flavor 8B $VOCAB --training.seq_len 4096 --training.local_batch_size 1 --activation_checkpoint.mode full --optimizer.implementation fused"
)

gpu_kind() {  # the plan's --gpu name for this machine's GPU
  local name
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  case "$name" in
    *H200*) echo h200 ;; *H100*PCIe*) echo h100-pcie ;; *H100*) echo h100 ;;
    *A100*80GB*) echo a100 ;; *A100*) echo a100-40gb ;; *L40S*) echo l40s ;; *B200*) echo b200 ;;
    *) echo h100 ;;
  esac
}

plan_batch() {  # the plan's largest local batch for config overrides "$@" on this GPU
  "$PYTHON" -m trainer.plan --config "$CONFIG_1B" --ngpu 1 --gpu "$GPU" "$@" \
    | sed -n 's/^largest local_batch_size that fits: \([0-9]*\).*/\1/p'
}

traced_peak() {  # the traced dry run's peak (eager), held against the measured max_memory_allocated
  "$PYTHON" -m trainer.plan --config "$CONFIG_1B" --ngpu 1 --gpu "$GPU" "$@" --trace \
    | grep -E "^traced|peak \(at|^trace verdict"
}

bench() {  # bench LABEL OVERRIDES...: one bench_train.py run of the 1B config's production settings
  local label=$1; shift
  echo "=== $label"
  "$PYTHON" benchmarks/training/bench_train.py --config "$CONFIG_1B" --ngpu 1 --steps "$STEPS" \
    --warmup "$WARMUP" --label "$label" -- "$@" || echo "=== $label FAILED (rc $?)"
}

run_big() {
  local shape=$1 batch
  # shellcheck disable=SC2206
  local common=($COMMON_1B)
  case "$shape" in
    1b)  # bf16 compiled (production), eager, float8 tensorwise and rowwise, at the plan's batch
      batch="${LOCAL_BATCH:-$(plan_batch "${common[@]}")}"
      echo "=== 1b: production config, local batch $batch"
      traced_peak "${common[@]}" --training.local_batch_size "$batch"
      for v in ${VARIANTS_1B:-compile eager float8-tensorwise float8-rowwise}; do
        case "$v" in
          compile) bench "1b-prod-b$batch" "${common[@]}" --training.local_batch_size "$batch" ;;
          eager) bench "1b-eager-b$batch" "${common[@]}" --training.local_batch_size "$batch" \
                   --compile.enable false ;;
          float8-*) bench "1b-$v-b$batch" "${common[@]}" --training.local_batch_size "$batch" \
                      --float8.enable true --float8.recipe "${v#float8-}" ;;
        esac
      done ;;
    1b-flex)  # block_causal on real documents (stdlib corpus): FlexAttention against SDPA's mask
      local docs=(--data.dataset stdlib --training.global_batch_size -1 --checkpoint.enable false
                  --model.attn_mask_type block_causal)
      batch="${LOCAL_BATCH:-$(plan_batch "${docs[@]}" --model.attn_implementation flex)}"
      for impl in flex sdpa; do
        bench "1b-block-causal-$impl-b$batch" "${docs[@]}" --model.attn_implementation "$impl" \
          --training.local_batch_size "$batch"
      done ;;
    3b)  # Llama 3.2 3B: FSDP2 CPU offload against none, at the plan's batch without offload
      local three=("${common[@]}" --model.flavor llama3.2-3B)
      batch="${LOCAL_BATCH:-$(plan_batch "${three[@]}")}"
      traced_peak "${three[@]}" --training.local_batch_size "$batch"
      bench "3b-b$batch" "${three[@]}" --training.local_batch_size "$batch"
      # offload steps take ~8 s (host AdamW over 3.2B params): fewer of them
      STEPS="${OFFLOAD_STEPS:-8}" WARMUP="${OFFLOAD_WARMUP:-3}" bench "3b-offload-b$batch" \
        "${three[@]}" --training.local_batch_size "$batch" --parallelism.fsdp_offload cpu ;;
    moe)  # MoE kernels and a Qwen3-30B-A3B layer (one process, bf16)
      "$PYTHON" benchmarks/parallel/bench_moe.py --device cuda --dtype bfloat16 --tokens 16384 \
        --layer-tokens 16384 --repeats 5 --float8 || echo "=== moe FAILED (rc $?)"
      # float8 experts against bf16 over 50 training steps (loss within 1e-2)
      "$PYTHON" benchmarks/gpu/float8_moe_train.py --steps 50 || echo "=== moe float8 FAILED (rc $?)" ;;
    mla)  # DeepSeek-V3's MLA with YaRN under each SDPA backend and FlexAttention, against an
          # fp32 reference: outputs, gradients, QK-clip maxima and times (~1 min)
      "$PYTHON" benchmarks/gpu/gpu_mla_attention.py --heads "${MLA_HEADS:-16}" --seq 4096 \
        || echo "=== mla FAILED (rc $?)" ;;
    hybrid)  # one Gated DeltaNet layer against one GQA layer at 4k, 32k, 128k
      "$PYTHON" benchmarks/training/bench_linear_attention.py --device cuda --dtype bfloat16 \
        --seqs 4096 32768 131072 || echo "=== hybrid FAILED (rc $?)" ;;
    paths)  # every CUDA path once, functional (20 steps each), and the flight recorder
      STEPS=20 "$PYTHON" benchmarks/gpu/gpu_paths.py || echo "=== paths FAILED (rc $?)"
      run_big mla
      "$PYTHON" benchmarks/gpu/gpu_flight_recorder.py | tail -2 ;;
  esac
}

ahead_bench() {  # ahead_bench LABEL OVERRIDES...: a 1B run; its output also to $LOGS/LABEL.log
  local label=$1; shift
  bench "$label" "${common[@]}" "$@" 2>&1 | tee "$LOGS/$label.log" | grep -E \
    "said|losses|tokens/s|MFU|step time|max_active|FAILED|Error|error" | cut -c1-400
}

run_ahead() {  # each lever against this trainer's baseline and torchtitan, one call
  # shellcheck disable=SC2206
  local common=($COMMON_1B) budget=${AHEAD_BUDGET:-520} b=${LOCAL_BATCH:-7} fit
  LOGS=${OUT:-/tmp}/ahead; mkdir -p "$LOGS"
  echo "=== ahead: $(nvidia-smi --query-gpu=name --format=csv,noheader) | torch $("$PYTHON" -c 'import torch;print(torch.__version__)')"
  "$PYTHON" benchmarks/training/bench_sdpa.py --flavor 1B --batch "$b" --seq 4096 --repeats 10
  # the new default (model.sdpa_backends auto: cuDNN first on Hopper), one step profiled
  ahead_bench "1b-auto-b$b" --training.local_batch_size "$b" --profiling.enable_profiling true \
    --profiling.profile_freq 15 --profiling.save_traces_folder /tmp/prof_auto
  "$PYTHON" benchmarks/training/profile_summary.py /tmp/prof_auto/iteration_15/rank0_trace.json --top 12 \
    | tee "$LOGS/profile_auto.txt" | head -30
  if [ -d .tt ] && [ $SECONDS -lt $((budget - 330)) ]; then  # torchtitan's best batch (6)
    OURS=" " TT="${TT_BATCHES:-6}" OUT=$LOGS bash .tt/side_by_side.sh 2>&1 | tail -3
  fi
  [ $SECONDS -lt $((budget - 240)) ] && ahead_bench "1b-flash-b$b" \
    --training.local_batch_size "$b" --model.sdpa_backends flash,efficient,math
  fit=$(sed -n 's/.*largest local_batch_size that fits [0-9]* GiB is \([0-9]*\).*/\1/p' \
        "$LOGS/1b-auto-b$b.log" | head -1)
  [ -n "$fit" ] && [ "$fit" != "$b" ] && [ $SECONDS -lt $((budget - 160)) ] && \
    ahead_bench "1b-auto-b$fit" --training.local_batch_size "$fit"
  [ $SECONDS -lt $((budget - 80)) ] && ahead_bench "1b-float8-b$b" \
    --training.local_batch_size "$b" --float8.enable true --float8.recipe tensorwise
  grep -h '"bench": "train"' benchmarks/results.jsonl | tail -6 > "$LOGS/results.jsonl"
}

run_levers() {  # levers built on CPU, not yet timed on a GPU, each beside the baseline
  # shellcheck disable=SC2206
  local common=($COMMON_1B) budget=${LEVERS_BUDGET:-540} b=${LOCAL_BATCH:-7}
  LOGS=${OUT:-/tmp}/levers; mkdir -p "$LOGS"
  ahead_bench "1b-base-b$b" --training.local_batch_size "$b"
  # one GPU: no memory to save by resharding the blocks after forward, 16 re-gathers to save
  [ $SECONDS -lt $((budget - 300)) ] && ahead_bench "1b-noreshard-b$b" \
    --training.local_batch_size "$b" --parallelism.fsdp_reshard_after_forward never
  # Muon's whole step beside AdamW's (bf16 Newton-Schulz over the blocks' matrices)
  [ $SECONDS -lt $((budget - 240)) ] && ahead_bench "1b-muon-b$b" \
    --training.local_batch_size "$b" --optimizer.name Muon
  [ $SECONDS -lt $((budget - 200)) ] && ahead_bench "1b-autotune-b$b" \
    --training.local_batch_size "$b" --compile.mode max-autotune-no-cudagraphs
  grep -h '"bench": "train"' benchmarks/results.jsonl | tail -4 > "$LOGS/results.jsonl"
}

run_suite() {  # the suite on the GPU machine; -v names each test as it ends
  LOGS=${OUT:-/tmp}/suite; mkdir -p "$LOGS"
  timeout "${SUITE_BUDGET:-540}" "$PYTHON" -u -m pytest -n "${SUITE_N:-8}" -p no:cacheprovider \
    -v -rfE --durations=15 tests > "$LOGS/suite.log" 2>&1
  echo "=== suite: rc $? (124: cut off at ${SUITE_BUDGET:-540} s)"
  grep -E "(FAILED|ERROR) tests/" "$LOGS/suite.log" | sed "s/^\[gw[0-9]*\] \[ *[0-9]*%\] //" | sort -u | head -40
  tail -2 "$LOGS/suite.log"
}

GPU=$(gpu_kind)
START=$(date +%Y-%m-%dT%H:%M:%S)
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(paths moe debug 1b 1b-flex 3b 8b)
for shape in "${shapes[@]}"; do
  [ -n "${SHAPE[$shape]+x}" ] || { echo "unknown shape $shape (paths, mla, moe, hybrid, debug, 1b, 1b-flex, 3b, 8b, ahead, levers, suite)"; exit 2; }
  case "$shape" in 1b|1b-flex|3b|paths|moe|hybrid|mla) run_big "$shape"; continue ;;
    ahead) run_ahead; continue ;; suite) run_suite; continue ;;
    levers) run_levers; continue ;; esac
  echo "=== $shape: memory plan on $GPU"
  # shellcheck disable=SC2086
  plan=$("$PYTHON" -m trainer.plan --config "$CONFIG" --ngpu 1 --gpu "$GPU" $COMMON ${SHAPE[$shape]})
  echo "$plan" | grep -E "^(model|peak|verdict|throughput)|peak:"
  if echo "$plan" | grep -q "DOES NOT FIT"; then
    echo "=== $shape: skipped (the plan says it does not fit)"; continue
  fi
  for compile in false true; do
    echo "=== $shape: compile=$compile"
    # shellcheck disable=SC2086
    "$PYTHON" benchmarks/training/bench_train.py --config "$CONFIG" --ngpu 1 --steps "$STEPS" \
      --warmup "$WARMUP" --label "$shape-compile-$compile" -- $COMMON ${SHAPE[$shape]} \
      --compile.enable "$compile" || echo "=== $shape compile=$compile FAILED (rc $?)"
  done
done

# Tensor parallelism needs 2+ GPUs (nccl refuses two ranks on one GPU): the debug model at
# FSDP 2, TP 2, TP 2 with compile and TP 2 with compile + async TP, same global batch.
NGPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$NGPUS" -ge 2 ]; then
  for tp in "fsdp2:" "tp2:--parallelism.tensor_parallel_degree 2" \
            "tp2-compile:--parallelism.tensor_parallel_degree 2 --compile.enable true" \
            "tp2-async:--parallelism.tensor_parallel_degree 2 --compile.enable true --parallelism.enable_async_tensor_parallel true"; do
    echo "=== ${tp%%:*}: debug model on 2 GPUs"
    # shellcheck disable=SC2086
    "$PYTHON" benchmarks/training/bench_train.py --config "$CONFIG" --ngpu 2 --steps "$STEPS" \
      --warmup "$WARMUP" --label "debug-${tp%%:*}" -- $COMMON --training.global_batch_size 8 \
      ${tp#*:} || echo "=== ${tp%%:*} FAILED (rc $?)"
  done
else
  echo "=== tensor parallelism: skipped (needs 2 GPUs; this machine has $NGPUS)"
fi

"$PYTHON" - "$START" <<'EOF'
import json, sys
print(f"\n{'run':<22}{'tok/s/dev':>12}{'MFU %':>8}{'step s':>9}{'p90 s':>8}"
      f"{'active GiB':>12}{'plan GiB':>10}{'plan err':>10}")
for line in open("benchmarks/results.jsonl"):
    r = json.loads(line)
    if r.get("bench") != "train" or r["time"][:19] < sys.argv[1]:
        continue
    mem = r["peak_memory_gib"].get("max_active(GiB)", float("nan"))
    mfu = r["mfu_pct"] if r["mfu_pct"] is not None else float("nan")
    print(f"{r['label']:<22}{r['tokens_per_s_per_device']:>12,.0f}{mfu:>8.1f}"
          f"{r['step_time_s']['median']:>9.3f}{r['step_time_s']['p90']:>8.3f}{mem:>12.2f}"
          f"{r['plan_peak_gib']:>10.2f}{r.get('plan_error_pct', float('nan')):>+9.1f}%")
EOF
