#!/usr/bin/env bash
# Session 2026-12-07g's second call, until DEADLINE: issue 37's A/B rows with 21 calls a side (ab21's 5 calls gave
# both runs the same five seeds: sampled acceptance per call ranges 2.5-3.4 there); the matrix rows of call23.sh
# (every method) with this code; then the H100 fault (dev/notes/crash-sampled64.md), which came at bench_matrix's
# greedy batch 64 in a fresh process three times in a row (ab19, ab20, ab21) but never from dev/gpu/fault_repro.py:
# that row alone, one fresh process each: as is, with blocking launches, without HF eager, ours alone. Beside it on
# cores 0-1 the host CPU's rows CPUROWS until CPU_DEADLINE.
#   S=$(date +%s); DEADLINE=$((S+540)) CPU_DEADLINE=$((S+330)) bash dev/gpu/call26.sh OUTDIR
set -u
OUT=${1:?usage: call26.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
cpu_rows "${CPUROWS:-greedy32 greedy1 sampled1 greedy4 greedy16}" &
CPU=$!
ROWS="sampled1 greedy1" SIDES="pre37 head" REPEATS=21 timeout 120 bash dev/gpu/ab_interleaved.sh "$OUT/ab" \
  > /dev/null 2>&1
log "end ab rc=$?"
rm -f "$OUT/ab.tgz"
MIN_LEFT=60 matrix_part b1 150 greedy1 sampled1 greedy16 sampled16
MIN_LEFT=60 matrix_part b4 130 greedy4 sampled4 greedy32 sampled32
one() {  # $1: label, rest: bench_matrix arguments (env before it in $ENVV)
  fits 45 || return
  PYTHONPATH=$R timeout 70 env ${ENVV:-} $G python bench/bench_matrix.py --repeats 1 --rows greedy64 "${@:2}" \
    --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1
  log "$1 rc=$? $(grep -h 'CUDA error' "$OUT/$1.log" | head -1)"
}
ENVV=CUDA_LAUNCH_BLOCKING=1 one f_blocking
one f_static_ours --methods hf_static ours
one f_ours --methods ours
one f_all
kill $CPU 2>/dev/null; wait $CPU 2>/dev/null
log "all done"
archive
