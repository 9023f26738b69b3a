#!/usr/bin/env bash
# Session 2026-12-07f's third call: issue 37's A/B rows (ROWS, 5 calls each) on three sides in turns: b360572
# (.pre37/), aa94ce9 (.preaa9/, before the measuring tail of 6114c3f) and this checkout; then again in the reverse
# order while DEADLINE allows.
#   S=$(date +%s); DEADLINE=$((S+400)) bash dev/gpu/call24.sh OUTDIR
set -u
OUT=${1:?usage: call24.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
ROWS=${ROWS:-greedy1 sampled1} SIDES="pre37 preaa9 head" REPEATS=5 timeout $(( DEADLINE - $(date +%s) - 10 )) \
  bash dev/gpu/ab_interleaved.sh "$OUT/ab1" > /dev/null 2>&1
log "end ab1 rc=$?"
fits 170 && ROWS=${ROWS:-greedy1 sampled1} SIDES="head preaa9 pre37" REPEATS=5 \
  timeout $(( DEADLINE - $(date +%s) - 10 )) bash dev/gpu/ab_interleaved.sh "$OUT/ab2" > /dev/null 2>&1
log "end ab2 rc=$?"
rm -f "$OUT"/ab1.tgz "$OUT"/ab2.tgz
log "all done"
archive
