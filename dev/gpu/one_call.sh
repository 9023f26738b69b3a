#!/usr/bin/env bash
# One lent-GPU call of about 9 minutes, for a session with one call's time: the first default call on the fresh
# machine (cold_profile.py), the whole matrix with HF static traced and checked (crash_probe.py --trace --check: the
# H100 crash's probe, dev/notes/crash-sampled64.md), issue 37's A/B row by row (ab_interleaved.sh, .pre37/ from
# make_pre37.sh), the whole matrix with HF static untouched (the figures), then bench_8b's default call with its
# per-phase device table; beside them CPU matrix rows on cores
# 0-1 until CPU_DEADLINE (epoch s).
#   CPU_DEADLINE=$(( $(date +%s) + 480 )) bash dev/gpu/one_call.sh OUTDIR
set -u
OUT=${1:?usage: one_call.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
log "start cold"
PYTHONPATH=$R timeout 40 $G python dev/gpu/cold_profile.py > "$OUT/cold_greedy.log" 2>&1
log "end cold rc=$?"
# On the host CPU first: the plain step against generate, profiled (ab13's host ran it at 1.6x generate's time).
[ "${NOCPU:-0}" = 1 ] || ($HOSTCPU timeout 120 \
  python dev/probes/plain_step_cpu.py --batch 1 > "$OUT/plain_step_cpu.log" 2>&1;
  cpu_rows "${CPUROWS:-greedy1 sampled1 greedy4}") &
CPU=$!
log "start traced_checked"
PYTHONPATH=$R timeout ${TRACED_T:-150} $G python dev/gpu/crash_probe.py --trace --check -- --repeats 3 \
  --methods hf_static ours --out "$OUT/traced.json" > "$OUT/traced.log" 2>&1
log "end traced_checked rc=$?"
log "start interleaved"
ROWS=${ABROWS:-greedy1 sampled1 greedy4 sampled4 greedy16} bash dev/gpu/ab_interleaved.sh "$OUT/ab" > /dev/null 2>&1
log "end interleaved"
log "start matrix_head"
PYTHONPATH=$R timeout ${HEAD_T:-140} $G python bench/bench_matrix.py --repeats 3 --methods hf_static ours \
  --out "$OUT/matrix_head.json" > "$OUT/matrix_head.log" 2>&1
log "end matrix_head rc=$?"
log "start 8b"  # the default call at 8B shape, with its per-phase device table (profile=True)
PYTHONPATH=$R timeout ${B8_T:-80} $G python bench/bench_8b.py --accept 4 --modes ceiling ours_default \
  --out "$OUT/8b_head.json" > "$OUT/8b_head.log" 2>&1
log "end 8b rc=$?"
wait $CPU 2>/dev/null
log "all done"
archive  # the device brings back a limited count of files (ab13 lost its traced log and matrix to it)
