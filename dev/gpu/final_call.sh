#!/usr/bin/env bash
# The session's one measuring call, about 9.5 minutes on a fresh machine: the first default call (cold_profile.py);
# issue 37's A/B row by row (ab_interleaved.sh, .pre37/ = commit b360572); the whole matrix with HF static (the
# figures); bench_8b at accept 4 (ab_8b; PRE8B=1 runs b360572's first); bench_vl7b's default call with its
# per-phase table. Beside it on cores 0-1 of the host CPU: dev/probes/plain_step_cpu.py --ops on a fresh cost folder
# and after a default call, then CPU matrix rows until CPU_DEADLINE. A step is skipped when fewer seconds than it
# needs are left before DEADLINE; COLD=0 skips the first call's profiles (a fresh process, then one more with generate's
# first call before ours).
#   DEADLINE=$(( $(date +%s) + 570 )) CPU_DEADLINE=$(( $(date +%s) + 480 )) bash dev/gpu/final_call.sh OUTDIR
set -u
OUT=${1:?usage: final_call.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
lscpu > "$OUT/lscpu.txt" 2>&1
C=$HOSTCPU
(
  $C timeout 120 python dev/probes/plain_step_cpu.py --batch 1 --ops > "$OUT/probe_fresh.log" 2>&1
  echo "$(date -u +%T) probe fresh rc=$?" >> "$OUT/cpu.log"
  $C timeout 150 python dev/probes/plain_step_cpu.py --batch 1 --ops --after-default > "$OUT/probe_after.log" 2>&1
  echo "$(date -u +%T) probe after default rc=$?" >> "$OUT/cpu.log"
  cpu_rows "${CPUROWS:-greedy1 sampled1 greedy4}"
) &
CPU=$!
if [ "${COLD:-1}" = 1 ]; then
  log "start cold"
  PYTHONPATH=$R timeout 40 $G python dev/gpu/cold_profile.py > "$OUT/cold_greedy.log" 2>&1
  log "end cold rc=$?"
  PYTHONPATH=$R timeout 40 $G python dev/gpu/cold_profile.py --generate-first > "$OUT/cold_after_generate.log" 2>&1
  log "end cold after generate rc=$?"
fi
log "start ab"
ROWS=${ABROWS:-greedy4 greedy1 sampled1 sampled4 greedy16} bash dev/gpu/ab_interleaved.sh "$OUT/ab" > /dev/null 2>&1
rm -rf "$OUT/ab"  # kept as ab.tgz
log "end ab"
if fits 100; then
  log "start matrix_head"
  PYTHONPATH=$R timeout $(( ${DEADLINE} - $(date +%s) - 150 > 140 ? 140 : ${DEADLINE} - $(date +%s) - 150 )) \
    $G python bench/bench_matrix.py --repeats 3 --methods hf_static ours --out "$OUT/matrix_head.json" \
    > "$OUT/matrix_head.log" 2>&1
  log "end matrix_head rc=$?"
fi
fits 100 && PRE8B=${PRE8B:-0} ab_8b 60
if fits 60; then
  log "start vl7b"
  PYTHONPATH=$R timeout $(( ${DEADLINE} - $(date +%s) - 5 )) $G python bench/bench_vl7b.py --accept 4 \
    --modes ceiling ours_default --out "$OUT/vl7b.json" > "$OUT/vl7b.log" 2>&1
  log "end vl7b rc=$?"
fi
wait $CPU 2>/dev/null
log "all done"
archive
