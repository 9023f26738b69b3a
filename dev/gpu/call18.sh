#!/usr/bin/env bash
# bench_8b (accept 4) of this checkout, b360572 (.pre37/), this checkout: the greedy acceptance without processors
# eager again (loop.py), against the 0.95 ms a cycle ab15 and ab16 measured with it captured.
#   DEADLINE=$(( $(date +%s) + 150 )) bash dev/gpu/call18.sh OUTDIR
set -u
OUT=${1:?usage: call18.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
for side in head pre37 head2; do
  [ "$(date +%s)" -gt "${DEADLINE:-0}" ] && break
  dir=$R; [ $side = pre37 ] && dir=$R/.pre37
  (cd "$dir" && PYTHONPATH=$dir timeout 45 $G python bench/bench_8b.py --accept 4 --modes ceiling ours_default \
    --out "$OUT/8b_$side.json" > "$OUT/8b_$side.log" 2>&1)
  log "end 8b $side rc=$?"
done
archive
