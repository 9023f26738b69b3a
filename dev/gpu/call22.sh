#!/usr/bin/env bash
# Session 2026-12-07e's second call: on the GPU the whole matrix with HF static (at most 175 s), issue 37's A/B rows
# (ABROWS, REPEATS), the cold first call (cold_profile.py) and bench_vl7b's default call, until DEADLINE; beside it on
# cores 0-1 the host CPU: host_plain.py (no tree against HF eager, profiled), then the matrix rows CPUROWS until
# CPU_DEADLINE.
#   S=$(date +%s); DEADLINE=$((S+400)) CPU_DEADLINE=$((S+380)) bash dev/gpu/call22.sh OUTDIR
set -u
OUT=${1:?usage: call22.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
( $HOSTCPU timeout 150 python dev/gpu/host_plain.py > "$OUT/host_plain.log" 2>&1
  cpu_rows "${CPUROWS:-greedy1 sampled1 sampled16 greedy32 sampled32 greedy64 sampled64 ragged16}" ) &
CPU=$!
if fits 150; then
  PYTHONPATH=$R timeout $(( DEADLINE - $(date +%s) - 130 > 175 ? 175 : DEADLINE - $(date +%s) - 130 )) \
    $G python bench/bench_matrix.py --repeats 3 --methods hf_static ours --out "$OUT/matrix_head.json" \
    > "$OUT/matrix_head.log" 2>&1
  log "end matrix_head rc=$?"
fi
fits 100 && REPEATS=${REPEATS:-5} ROWS="${ABROWS:-sampled1 greedy1}" timeout $(( DEADLINE - $(date +%s) - 70 )) \
  bash dev/gpu/ab_interleaved.sh "$OUT/ab" > /dev/null 2>&1
log "end ab"
fits 30 && PYTHONPATH=$R timeout 30 $G python dev/gpu/cold_profile.py > "$OUT/cold_greedy.log" 2>&1
log "end cold rc=$?"
fits 20 && PYTHONPATH=$R timeout $(( DEADLINE - $(date +%s) - 3 )) $G python bench/bench_vl7b.py --accept 4 \
  --modes ceiling ours_default --out "$OUT/vl7b.json" > "$OUT/vl7b.log" 2>&1
log "end vl7b rc=$?"
kill $CPU 2>/dev/null; wait $CPU 2>/dev/null
log "all done"
archive
