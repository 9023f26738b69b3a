#!/usr/bin/env bash
# Issue 10 on a 2 x H200 machine, in at most BUDGET_S (default 265) seconds plus a few of clean-up:
#   b) a Llama-3.1-8B-shaped target split over both GPUs (half the layers each, accelerate dispatch_model):
#      greedy speculative == generate in float32 and bfloat16, tokens/s     -> OUT/b_split_2gpu.json
#   a) the EAGLE-3 trainer under accelerate launch on 2 GPUs, then on 1 GPU (one bf16 8B target per process,
#      the reference corpus, 30 steps of 2048 tokens per process): tokens/s, scaling, loss, head loads
#                                                                          -> OUT/a_train.json (+ a_gpu{1,2}.json)
# Usage: bash dev/gpu/multi.sh OUTDIR [--tiny]   (any working directory; SKIP_A=1 / SKIP_B=1 skip a part). Logs: OUTDIR/log.txt (timestamped
# start/end/rc of every part), OUTDIR/<part>.log (each part's output). Each part runs under its own timeout.
# --tiny: the same steps with tiny models on CPU (CPU + disk-offloaded layers for b; gloo for the 2 processes).
set -u -o pipefail
OUT=${1:?usage: bash dev/gpu/multi.sh OUTDIR [--tiny]}
BUDGET_S=${BUDGET_S:-265}
if [ "${2:-}" = "--tiny" ]; then
  SHAPE=tiny MP=no GPU2="" GPU1="" SPLIT=(--tiny --new-tokens 10 --tree 4 2 6)
else
  GPU2=${CUDA_VISIBLE_DEVICES:-0,1}  # the caller's choice of two GPUs, if it made one
  SHAPE=8b MP=bf16 GPU1=${GPU2%%,*} SPLIT=(--shape 8b --devices cuda:0 cuda:1 --new-tokens 64)
fi

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$REPO" || exit 2
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # nothing is installed: the package is imported from here
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
PY=${PYTHON:-python3}
# Checkpoints (~8 GB a run, deleted after it): in RAM (/dev/shm) when it has room, so that no disk throttles them.
if [ -z "${SCRATCH:-}" ]; then
  shm_kb=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}')
  SCRATCH=/tmp/eagle_mm_gpu
  ((${shm_kb:-0} > 40 * 1024 * 1024)) && SCRATCH=/dev/shm/eagle_mm_gpu
fi
SCRATCH=$SCRATCH/multi
LOG="$OUT/log.txt"
DEADLINE=$((SECONDS + BUDGET_S))
stamp() { date -u +%Y-%m-%dT%H:%M:%S.%3NZ; }
say() { echo "$(stamp) $*" | tee -a "$LOG"; }
gpus() { nvidia-smi --query-gpu=index,memory.used --format=csv,noheader 2>/dev/null | tr '\n' ' '; }

# run NAME CAP_S CMD...: CMD under `timeout` min(CAP_S, seconds left), output in OUT/NAME.log, outcome in log.txt.
run() {
  local name=$1 cap=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  local t=$((cap < left ? cap : left)) rc=0 t0=$SECONDS
  if ((t < 10)); then say "$name: SKIPPED, ${left}s left"; return 125; fi
  say "$name: start, timeout ${t}s: $*"
  timeout -k 3 "$t" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  say "$name: end rc=$rc after $((SECONDS - t0))s$( ((rc == 124 || rc == 137)) && echo ' TIMED OUT'); GPU MiB used: $(gpus)"
  return $rc
}

# A launch that timed out may leave workers behind (torchrun starts them in their own sessions); each worker
# wrote its pid to RUN_DIR/pid.RANK.
kill_recorded() {
  local f
  for f in "$1"/pid.*; do
    [ -f "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null && say "killed leftover worker $(cat "$f") ($f)"
  done
  return 0
}

launch() {  # launch NAME CAP_S NPROC VISIBLE: the trainer bench under accelerate launch
  local name=$1 cap=$2 n=$3 visible=$4 multi=()
  ((n > 1)) && multi=(--multi_gpu --main_process_port 29517)
  rm -rf "$SCRATCH/$name"
  mkdir -p "$SCRATCH/$name"
  run "$name" "$cap" env CUDA_VISIBLE_DEVICES="$visible" "$PY" -m accelerate.commands.launch ${multi[@]+"${multi[@]}"} \
    --num_processes "$n" --num_machines 1 --mixed_precision "$MP" --dynamo_backend no \
    bench/bench_multi_gpu.py worker "$SCRATCH/prep" "$SCRATCH/$name" --result "$OUT/$name.json"
  local rc=$?
  ((rc != 0)) && kill_recorded "$SCRATCH/$name"
  cp "$SCRATCH/$name/head/train_log.jsonl" "$OUT/$name.train_log.jsonl" 2>/dev/null
  rm -rf "$SCRATCH/$name"  # its checkpoint and head (~8 GB); the result JSON has what was measured
  return $rc
}

say "start multi.sh: repo $REPO, out $OUT, scratch $SCRATCH, budget ${BUDGET_S}s; GPUs: $(nvidia-smi -L 2>&1 | tr '\n' ' ')"
rm -rf "$SCRATCH/prep"
mkdir -p "$SCRATCH"

# The training data (CPU only) is prepared while part b runs on the GPUs.
data_pid=
[ -n "${SKIP_A:-}" ] || run a_data 60 "$PY" bench/bench_multi_gpu.py data "$SCRATCH/prep" --shape "$SHAPE" --max-processes 2 &
[ -n "${SKIP_A:-}" ] || data_pid=$!

# b needs more than 75 s (it timed out building the float32 copy on 2026-11-29); SKIP_B=1 skips it.
[ -n "${SKIP_B:-}" ] || run b_split_2gpu 150 env CUDA_VISIBLE_DEVICES="$GPU2" "$PY" bench/bench_split.py "${SPLIT[@]}" --via dispatch \
  --dtypes float32 bfloat16 --work "$SCRATCH/b" --out "$OUT/b_split_2gpu.json"
rm -rf "$SCRATCH/b"

data_rc=0
[ -n "$data_pid" ] && { wait "$data_pid"; data_rc=$?; }
[ -f "$SCRATCH/prep/prep.json" ] && cp "$SCRATCH/prep/prep.json" "$OUT/a_prep.json"
if [ -n "${SKIP_A:-}" ]; then
  say "a: skipped (SKIP_A)"
elif ((data_rc == 0)); then
  launch a_gpu2 70 2 "$GPU2"
  launch a_gpu1 60 1 "$GPU1"
  run a_report 20 "$PY" bench/bench_multi_gpu.py report "$OUT/a_train.json" "$OUT/a_gpu1.json" "$OUT/a_gpu2.json"
else
  say "a: data preparation failed (rc=$data_rc); training runs skipped"
fi
rm -rf "$SCRATCH"
say "done multi.sh after ${SECONDS}s; results: $(cd "$OUT" && ls *.json 2>/dev/null | tr '\n' ' ')"
