#!/usr/bin/env bash
# Issue 37's A/B, row by row in turns: for each row, bench_matrix's default call of .pre37/ (commit b360572,
# ONLY_OURS=1) then this checkout's (--methods ours), one process each, so that a machine slowing down over the run
# falls on both sides alike (a whole matrix of one then the other does not). No CPU work beside it.
#   ROWS="greedy1 sampled1" bash dev/gpu/ab_interleaved.sh OUTDIR
set -u
OUT=${1:?usage: ab_interleaved.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
mkdir -p .pre37/eagle_mm/zoo/models && cp -r eagle_mm/zoo/models/code-tiny .pre37/eagle_mm/zoo/models/
for r in ${ROWS:-greedy1 sampled1 greedy4 sampled4 greedy16}; do
  log "row $r"
  (cd .pre37 && ONLY_OURS=1 PYTHONPATH=$PWD timeout 60 $G python bench/bench_matrix.py --repeats ${REPEATS:-3} \
    --rows "$r" --out "$OUT/pre37_$r.json" > "$OUT/pre37_$r.log" 2>&1)
  PYTHONPATH=$R timeout 60 $G python bench/bench_matrix.py --repeats ${REPEATS:-3} --rows "$r" --methods ours \
    --out "$OUT/head_$r.json" > "$OUT/head_$r.log" 2>&1
  tar -czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"  # after each row: a run cut short keeps its rows
done
log "all done"
tar -czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
