#!/usr/bin/env bash
# bench_8b's cycle with the greedy acceptance captured (as shipped since d851088) or eager (as before it), in turns,
# then captured with the torch reference (dev/gpu/accept8b.py): what made the 8B cycle 0.95 ms slower in ab16.
#   bash dev/gpu/call17.sh OUTDIR
set -u
OUT=${1:?usage: call17.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
for v in eager graph eager graph torch; do
  [ "$(date +%s)" -gt "${DEADLINE:-0}" ] && break
  env $([ $v = torch ] && echo EAGLE_MM_VERIFY_BACKEND=torch) PYTHONPATH=$R timeout 45 $G python dev/gpu/accept8b.py \
    "$([ $v = torch ] && echo graph || echo $v)" --accept 4 --modes ceiling ours_default --out "$OUT/8b_$v.json" \
    >> "$OUT/8b_$v.log" 2>&1
  log "end 8b $v rc=$?"
done
archive
