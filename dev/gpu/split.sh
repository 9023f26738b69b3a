#!/usr/bin/env bash
# Issue 9 on one H200: a ~0.5B Llama-shaped random target (hidden 1024, 16 layers, 128k vocabulary) saved and
# loaded with from_pretrained(device_map=...): embeddings and 12 layers on the GPU, 4 layers, the final norm
# and the lm_head on the CPU (offloaded: weights in host memory, run on the GPU behind accelerate's hooks).
# Greedy speculative == generate in float32 and bfloat16, tokens/s           -> OUT/c_gpu_cpu.json
# Usage: bash dev/gpu/split.sh OUTDIR [--tiny]   (any working directory; at most BUDGET_S, default 55,
# seconds). --tiny: a tiny model on CPU, with disk-offloaded layers in place of the CPU ones.
set -u -o pipefail
OUT=${1:?usage: bash dev/gpu/split.sh OUTDIR [--tiny]}
BUDGET_S=${BUDGET_S:-55}
if [ "${2:-}" = "--tiny" ]; then
  GPU="" ARGS=(--tiny --new-tokens 10 --tree 4 2 6)
else
  GPU=${CUDA_VISIBLE_DEVICES:-0}  # the caller's GPU (all.sh runs this on GPU 1), else GPU 0
  GPU=${GPU%%,*} ARGS=(--shape small --devices cuda:0 cpu --new-tokens 32)
fi

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$REPO" || exit 2
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # nothing is installed: the package is imported from here
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PYTHON:-python3}
SCRATCH=${SCRATCH:-/tmp/eagle_mm_gpu}/split  # the saved target and offload folder: not in OUT
LOG="$OUT/log.txt"
stamp() { date -u +%Y-%m-%dT%H:%M:%S.%3NZ; }
say() { echo "$(stamp) $*" | tee -a "$LOG"; }

say "start split.sh: repo $REPO, out $OUT, scratch $SCRATCH, budget ${BUDGET_S}s; GPUs: $(nvidia-smi -L 2>&1 | tr '\n' ' ')"
rm -rf "$SCRATCH"
mkdir -p "$SCRATCH"
t=$((BUDGET_S - SECONDS - 3))
say "c_gpu_cpu: start, timeout ${t}s"
rc=0
timeout -k 3 "$t" env CUDA_VISIBLE_DEVICES="$GPU" "$PY" bench/bench_split.py "${ARGS[@]}" --split 0.75 \
  --via pretrained --dtypes float32 bfloat16 --work "$SCRATCH" --out "$OUT/c_gpu_cpu.json" >"$OUT/c_gpu_cpu.log" 2>&1 || rc=$?
say "c_gpu_cpu: end rc=$rc after ${SECONDS}s$( ((rc == 124 || rc == 137)) && echo ' TIMED OUT')"
rm -rf "$SCRATCH"
say "done split.sh after ${SECONDS}s"
exit $rc
