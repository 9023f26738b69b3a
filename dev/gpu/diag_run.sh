#!/usr/bin/env bash
# One lent-GPU call: forced trees against the chooser's predictions (tree_costs.py), then the sampled batch-64
# first call alone with CUDA_LAUNCH_BLOCKING=1 (a kernel fault reported at its launch), then greedy 64 and sampled 64
# in one process as the matrix runs them. Every output lands in OUTDIR.
#   bash dev/gpu/diag_run.sh OUTDIR
set -u
OUT=${1:?usage: diag_run.sh OUTDIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
log() { echo "$(date -u +%T) $*" | tee -a "$OUT/steps.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
log "start costs"
timeout ${COSTS_T:-200} python dev/gpu/tree_costs.py --rows ${COSTROWS:-greedy1 greedy16 greedy32 sampled16} \
  --trees none 3/1/3 4/2/6 4/4/16 3/8/48 5/8/64 --out "$OUT/costs.json" > "$OUT/costs.log" 2>&1
log "end costs rc=$?"
log "start s64 blocking"
CUDA_LAUNCH_BLOCKING=1 timeout ${S64_T:-120} python -X faulthandler dev/gpu/chooser_calls.py --rows sampled64 --calls 2 \
  > "$OUT/s64_blocking.log" 2>&1
log "end s64 blocking rc=$?"
log "start g64 s64"
timeout ${GS_T:-90} python -X faulthandler dev/gpu/chooser_calls.py --rows greedy64 sampled64 --calls 2 \
  > "$OUT/g64_s64.log" 2>&1
log "end g64 s64 rc=$?"
log "all done"
