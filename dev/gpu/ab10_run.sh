#!/usr/bin/env bash
# One lent-GPU call of about 9 minutes: issue 37's A/B row by row in turns (ab_interleaved.sh: .pre37/ from
# make_pre37.sh, then this checkout, one process each), then this checkout's whole matrix with HF static; beside them,
# on this host's CPU pinned to cores 0-1 (the GPU work on cores 2-15), CPU matrix rows until CPU_DEADLINE (epoch s).
#   CPU_DEADLINE=$(( $(date +%s) + 500 )) bash dev/gpu/ab10_run.sh OUTDIR
set -u
OUT=${1:?usage: ab10_run.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
[ "${NOCPU:-0}" = 1 ] || cpu_rows "${CPUROWS:-greedy1 sampled1 greedy4 sampled4 greedy16 sampled16}" &
CPU=$!
log "start interleaved"
ROWS=${ABROWS:-greedy1 sampled1 greedy4 sampled4 greedy16} bash dev/gpu/ab_interleaved.sh "$OUT/ab" > /dev/null 2>&1
log "end interleaved"
ROWS=${ROWS:-greedy1 sampled1 greedy4 sampled4 greedy16 sampled16 greedy32 sampled32 greedy64 sampled64}
log "start matrix_head"
PYTHONPATH=$R timeout ${HEAD_T:-250} $G python bench/bench_matrix.py --repeats 3 --rows $ROWS \
  --methods ${METHODS:-hf_static ours} --out "$OUT/matrix_head.json" > "$OUT/matrix_head.log" 2>&1
log "end matrix_head rc=$?"
wait $CPU 2>/dev/null
log "all done"
tar -czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
