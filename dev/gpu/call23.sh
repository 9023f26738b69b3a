#!/usr/bin/env bash
# Session 2026-12-07f's second call: the matrix with every method (HF eager, HF static, ours, ours compile=True) on
# the GPU, in three processes (batch 64 and the ragged row first, in a fresh process: the H100 fault of
# dev/notes/crash-sampled64.md came only after earlier rows), until DEADLINE; beside it on cores 0-1 the host CPU's
# matrix rows CPUROWS until CPU_DEADLINE.
#   S=$(date +%s); DEADLINE=$((S+450)) CPU_DEADLINE=$((S+330)) bash dev/gpu/call23.sh OUTDIR
set -u
OUT=${1:?usage: call23.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
cpu_rows "${CPUROWS:-greedy4 sampled4 greedy16 sampled16 greedy32}" &
CPU=$!
matrix_part b64 170 greedy64 sampled64 ragged16
matrix_part b1 200 greedy1 sampled1 greedy16 sampled16
matrix_part b4 200 greedy4 sampled4 greedy32 sampled32
kill $CPU 2>/dev/null; wait $CPU 2>/dev/null
log "all done"
archive
