#!/usr/bin/env bash
# Issue 37's A/B, row by row in turns: for each row, bench_matrix's default call of each side of SIDES (default
# "pre37 head": .pre37/, commit b360572, with ONLY_OURS=1, then this checkout's with --methods ours; another name X
# runs .X/, an older checkout with --methods ours), one process each, so that a machine slowing down over the run
# falls on every side alike (a whole matrix of one then the other does not). No CPU work beside it.
#   ROWS="greedy1 sampled1" SIDES="pre37 preaa9 head" bash dev/gpu/ab_interleaved.sh OUTDIR
set -u
OUT=${1:?usage: ab_interleaved.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
SIDES=${SIDES:-pre37 head}
for s in $SIDES; do
  [ "$s" = head ] || { mkdir -p ".$s/eagle_mm/zoo/models" && cp -r eagle_mm/zoo/models/code-tiny ".$s/eagle_mm/zoo/models/"; }
done
for r in ${ROWS:-greedy1 sampled1 greedy4 sampled4 greedy16}; do
  log "row $r"
  for s in $SIDES; do
    dir=$R/.$s only="" methods="--methods ours"
    [ "$s" = head ] && dir=$R
    [ "$s" = pre37 ] && only=1 methods=""  # b360572's bench_matrix: ONLY_OURS instead of --methods
    (cd "$dir" && ONLY_OURS=$only PYTHONPATH=$dir timeout 60 $G python bench/bench_matrix.py --repeats ${REPEATS:-3} \
      --rows "$r" $methods --out "$OUT/${s}_$r.json" > "$OUT/${s}_$r.log" 2>&1)
  done
  tar -czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"  # after each row: a run cut short keeps its rows
done
log "all done"
tar -czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
