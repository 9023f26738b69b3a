#!/usr/bin/env bash
# Session 2026-12-07d's measuring call (short: the session's device time went to refused starts): bench_8b's A/B in
# the order b360572, head, b360572; the whole matrix with HF static; issue 37's A/B rows (ABROWS) with 5 repeats;
# beside it on cores 0-1 the host CPU's matrix rows (CPUROWS) until CPU_DEADLINE.
#   DEADLINE=$(( $(date +%s) + 470 )) CPU_DEADLINE=$(( $(date +%s) + 400 )) bash dev/gpu/call20.sh OUTDIR
set -u
OUT=${1:?usage: call20.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
cpu_rows "${CPUROWS:-greedy1 sampled1 greedy4 sampled4 greedy16}" &
CPU=$!
measure_tail 150 110 40
kill $CPU 2>/dev/null; wait $CPU 2>/dev/null
log "all done"
archive
