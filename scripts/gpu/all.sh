#!/usr/bin/env bash
# The GPU measurements of a session on a 2-GPU machine (each part writes under OUTDIR/<part>). Together they
# need about 660 s, more than one call's 600 s: run multi.sh with SKIP_B=1 here, or its part b in another call.
#   first     both GPUs: multi.sh (2-GPU training scaling; a target split over 2 GPUs)           <= 270 s
#   then      GPU 0: code_tiny.sh (retrain + merge the code-tiny heads, H200 benchmark)          <= 375 s
#             GPU 1: scenes.sh (build + benchmark scenes-tiny), then split.sh (GPU + CPU split)  <= 320 + 60 s
# Usage: bash scripts/gpu/all.sh OUTDIR      (speed.sh, the 8B benchmark, runs on its own: 240 s on one GPU)
# The device tool brings back only a few files per call, so everything ends up packed in OUTDIR.tar.
set -u
OUT=${1:?usage: all.sh OUTDIR}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.." || exit 1
log() { echo "$(date -u +%T) all.sh: $*" | tee -a "$OUT/all.log"; }
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > "$OUT/gpus.txt" 2>&1
python3 -c "import torch, transformers, triton, accelerate, sys; print(sys.version.split()[0], torch.__version__, \
transformers.__version__, triton.__version__, accelerate.__version__)" > "$OUT/versions.txt" 2>&1
log "start: $(tr '\n' ';' < "$OUT/gpus.txt") $(cat "$OUT/versions.txt")"
timeout 270 bash scripts/gpu/multi.sh "$OUT/multi" > "$OUT/multi.log" 2>&1; log "multi.sh rc=$?"
(CUDA_VISIBLE_DEVICES=0 timeout 375 bash scripts/gpu/code_tiny.sh "$OUT/code_tiny" > "$OUT/code_tiny.log" 2>&1
 log "code_tiny.sh rc=$?") &
(CUDA_VISIBLE_DEVICES=1 timeout 322 bash scripts/gpu/scenes.sh "$OUT/scenes" > "$OUT/scenes.log" 2>&1
 log "scenes.sh rc=$?"
 CUDA_VISIBLE_DEVICES=1 timeout 58 bash scripts/gpu/split.sh "$OUT/split" > "$OUT/split.log" 2>&1
 log "split.sh rc=$?") &
wait
log "done"
tar -C "$(dirname "$OUT")" -cf "$OUT.tar" "$(basename "$OUT")" && rm -rf "$OUT"
