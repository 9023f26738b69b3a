#!/usr/bin/env bash
# Session 2026-12-07d's measuring call (short: the session's device time went to refused starts): bench_8b's A/B in
# the order b360572, head, b360572; the whole matrix with HF static; issue 37's A/B rows (ABROWS) with 5 repeats;
# beside it on cores 0-1 the host CPU's matrix rows (CPUROWS) until CPU_DEADLINE.
#   DEADLINE=$(( $(date +%s) + 470 )) CPU_DEADLINE=$(( $(date +%s) + 400 )) bash dev/gpu/call20.sh OUTDIR
set -u
OUT=${1:?usage: call20.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
fits() { [ $(( $(date +%s) + $1 )) -lt "${DEADLINE:-0}" ]; }
cpu_rows "${CPUROWS:-greedy1 sampled1 greedy4 sampled4 greedy16}" &
CPU=$!
for side in pre37 head pre37b; do
  fits 150 || break
  dir=$R; [ "${side#pre37}" != "$side" ] && dir=$R/.pre37
  (cd "$dir" && PYTHONPATH=$dir timeout 50 $G python bench/bench_8b.py --accept 4 --modes ceiling ours_default \
    --out "$OUT/8b_$side.json" > "$OUT/8b_$side.log" 2>&1)
  log "end 8b $side rc=$?"
done
if fits 120; then
  PYTHONPATH=$R timeout $(( DEADLINE - $(date +%s) - 110 > 175 ? 175 : DEADLINE - $(date +%s) - 110 )) \
    $G python bench/bench_matrix.py --repeats 3 --methods hf_static ours --out "$OUT/matrix_head.json" \
    > "$OUT/matrix_head.log" 2>&1
  log "end matrix_head rc=$?"
fi
fits 40 && REPEATS=5 ROWS="${ABROWS:-sampled1 greedy1}" timeout $(( DEADLINE - $(date +%s) )) bash dev/gpu/ab_interleaved.sh \
  "$OUT/ab" > /dev/null 2>&1
rm -rf "$OUT/ab"
log "end ab"
kill $CPU 2>/dev/null; wait $CPU 2>/dev/null
log "all done"
archive
