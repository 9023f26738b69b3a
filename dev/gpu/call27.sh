#!/usr/bin/env bash
# Written in session 2026-12-07g, not run there (its device time ran out): the matrix rows call26.sh's time limit
# cut (greedy and sampled 16 and 32, HF static and ours, this code), then the H100 fault's row without HF static (HF
# eager and ours), until DEADLINE.
#   S=$(date +%s); DEADLINE=$((S+230)) bash dev/gpu/call27.sh OUTDIR
set -u
OUT=${1:?usage: call27.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
left=$(( DEADLINE - $(date +%s) - 60 ))
PYTHONPATH=$R timeout $left $G python bench/bench_matrix.py --repeats 3 --methods hf_static ours \
  --rows greedy16 sampled16 greedy32 sampled32 --out "$OUT/matrix_b16.json" > "$OUT/matrix_b16.log" 2>&1
log "end matrix_b16 rc=$?"
if fits 40; then
  PYTHONPATH=$R timeout $(( DEADLINE - $(date +%s) - 3 )) $G python bench/bench_matrix.py --repeats 1 \
    --rows greedy64 --methods hf_eager ours --out "$OUT/f_eager_ours.json" > "$OUT/f_eager_ours.log" 2>&1
  log "f_eager_ours rc=$? $(grep -h 'CUDA error' "$OUT/f_eager_ours.log" | head -1)"
fi
log "all done"
archive
