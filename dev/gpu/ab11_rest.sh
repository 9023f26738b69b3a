#!/usr/bin/env bash
# The second lent-GPU call after ab10_run.sh: bench_8b at accept 4 both ways (.pre37/ = commit b360572, then this
# checkout), the chooser's CUDA tests, a first call with empty caches (cold_profile.py), ab10's crash (greedy64 then
# sampled64 in one process; again with CUDA_LAUNCH_BLOCKING=1 where it fails), then a second interleaved
# A/B pass over ABROWS (the noisy rows of the first); beside them, CPU matrix rows (CPUROWS) on cores 0-1 until
# CPU_DEADLINE (epoch s).
#   CPU_DEADLINE=$(( $(date +%s) + 450 )) CPUROWS="greedy16 sampled16" bash dev/gpu/ab11_rest.sh OUTDIR
set -u
OUT=${1:?usage: ab11_rest.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
[ "${NOCPU:-0}" = 1 ] || cpu_rows "${CPUROWS:-greedy16 sampled16}" &
CPU=$!
log "start cold"
PYTHONPATH=$R timeout 40 $G python dev/gpu/cold_profile.py > "$OUT/cold_greedy.log" 2>&1
log "end cold rc=$?"
log "start repro"  # ab10's matrix aborted (unspecified launch failure) at sampled64's first call, after greedy64
PYTHONPATH=$R timeout 120 $G python bench/bench_matrix.py --repeats 3 --rows greedy64 sampled64 --methods ours \
  --out "$OUT/repro.json" > "$OUT/repro.log" 2>&1
rc=$?; log "end repro rc=$rc"
if [ $rc != 0 ]; then
  PYTHONPATH=$R CUDA_LAUNCH_BLOCKING=1 timeout 150 $G python bench/bench_matrix.py --repeats 3 --rows greedy64 sampled64 \
    --methods ours --out "$OUT/repro_blocking.json" > "$OUT/repro_blocking.log" 2>&1
  log "end repro_blocking rc=$?"
fi
ab_8b 90
cuda_tests
[ -n "${ABROWS:-}" ] && ROWS="$ABROWS" bash dev/gpu/ab_interleaved.sh "$OUT/ab" > /dev/null 2>&1
wait $CPU 2>/dev/null
log "all done"
tar -czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
