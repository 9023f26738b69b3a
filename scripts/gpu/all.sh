#!/usr/bin/env bash
# Every GPU measurement of one session in one call on a 2-GPU machine (each part writes under OUTDIR/<part>):
#   0-200 s   both GPUs: multi.sh (2-GPU training scaling, a target split over 2 GPUs)
#   then      GPU 0: code_tiny.sh (retrain + merge the code-tiny heads, H200 benchmark)
#             GPU 1: speed.sh (8B-scale forced-acceptance benchmark), then split.sh (a target split GPU + CPU)
# Usage: bash scripts/gpu/all.sh OUTDIR
set -u
OUT=${1:?usage: all.sh OUTDIR}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.." || exit 1
log() { echo "$(date -u +%T) all.sh: $*" | tee -a "$OUT/all.log"; }
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > "$OUT/gpus.txt" 2>&1
python3 -c "import torch, transformers, triton, accelerate, sys; print(sys.version.split()[0], torch.__version__, \
transformers.__version__, triton.__version__, accelerate.__version__)" > "$OUT/versions.txt" 2>&1
log "start: $(cat "$OUT/gpus.txt" | tr '\n' ';') $(cat "$OUT/versions.txt")"
log "multi.sh"; timeout 205 bash scripts/gpu/multi.sh "$OUT/multi" > "$OUT/multi.log" 2>&1; log "multi.sh rc=$?"
(CUDA_VISIBLE_DEVICES=0 timeout 385 bash scripts/gpu/code_tiny.sh "$OUT/code_tiny" > "$OUT/code_tiny.log" 2>&1
 log "code_tiny.sh rc=$?") &
(CUDA_VISIBLE_DEVICES=1 timeout 245 bash scripts/gpu/speed.sh "$OUT/speed" > "$OUT/speed.log" 2>&1
 log "speed.sh rc=$?"
 CUDA_VISIBLE_DEVICES=1 timeout 75 bash scripts/gpu/split.sh "$OUT/split" > "$OUT/split.log" 2>&1
 log "split.sh rc=$?") &
wait
log "done"
