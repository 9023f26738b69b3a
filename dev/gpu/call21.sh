#!/usr/bin/env bash
# Session 2026-12-07d's second call: issue 37's A/B rows (ABROWS, REPEATS), then, in the last KEEP seconds (70), the
# cold first call (cold_profile.py, empty caches) and bench_vl7b's default call with its device phases, until DEADLINE.
#   DEADLINE=$(( $(date +%s) + 240 )) bash dev/gpu/call21.sh OUTDIR
set -u
OUT=${1:?usage: call21.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
fits 60 && REPEATS=${REPEATS:-3} ROWS="${ABROWS:-greedy4 sampled4 greedy16}" timeout $(( DEADLINE - $(date +%s) - ${KEEP:-70} )) \
  bash dev/gpu/ab_interleaved.sh "$OUT/ab" > /dev/null 2>&1
rm -rf "$OUT/ab"
log "end ab"
fits 30 && PYTHONPATH=$R timeout 30 $G python dev/gpu/cold_profile.py > "$OUT/cold_greedy.log" 2>&1
log "end cold rc=$?"
fits 20 && PYTHONPATH=$R timeout $(( DEADLINE - $(date +%s) - 3 )) $G python bench/bench_vl7b.py --accept 4 \
  --modes ceiling ours_default --out "$OUT/vl7b.json" > "$OUT/vl7b.log" 2>&1
log "end vl7b rc=$?"
archive
