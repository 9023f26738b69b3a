#!/usr/bin/env bash
# One call of about 7 minutes: on the host CPU (cores 0-1, no GPU work on them), why the plain step lost to generate
# there (ab13: 14 ms a forward against 8.4): lscpu, then dev/probes/plain_step_cpu.py --ops on a fresh cost folder and
# again after a default call (--after-default: its probe's few-row verdicts in force), then CPU matrix rows until
# CPU_DEADLINE; beside it on the GPU, issue 37's A/B at greedy 4 and
# greedy 1 (ab_interleaved.sh: the chooser's one run of another width), then crash_loop's traced whole matrix until
# DEADLINE (epoch s).
#   DEADLINE=... CPU_DEADLINE=... bash dev/gpu/host_cpu.sh OUTDIR
set -u
OUT=${1:?usage: host_cpu.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
lscpu > "$OUT/lscpu.txt" 2>&1
C="env CUDA_VISIBLE_DEVICES= PYTHONPATH=$R taskset -c 0,1"
(
  $C OMP_NUM_THREADS=2 timeout 150 python dev/probes/plain_step_cpu.py --batch 1 --ops > "$OUT/probe_t2.log" 2>&1
  echo "$(date -u +%T) probe t2 rc=$?" >> "$OUT/cpu.log"
  $C OMP_NUM_THREADS=2 timeout 150 python dev/probes/plain_step_cpu.py --batch 1 --ops --after-default \
    > "$OUT/probe_after.log" 2>&1
  echo "$(date -u +%T) probe after default rc=$?" >> "$OUT/cpu.log"
  cpu_rows "${CPUROWS:-greedy1 sampled1}"
) &
CPU=$!
log "start ab"
ROWS=${ABROWS:-greedy4 greedy1} bash dev/gpu/ab_interleaved.sh "$OUT/ab" > /dev/null 2>&1
log "end ab"
i=0
while [ $(( $(date +%s) + 160 )) -lt "${DEADLINE:-0}" ]; do
  i=$((i + 1))
  log "start traced $i"
  PYTHONPATH=$R timeout 150 $G python dev/gpu/crash_probe.py --trace --check -- --repeats 3 --methods hf_static ours \
    --out "$OUT/traced_$i.json" > "$OUT/traced_$i.log" 2>&1
  rc=$?
  log "end traced $i rc=$rc"
  [ $rc != 0 ] && [ $rc != 124 ] && break
done
wait $CPU 2>/dev/null
log "all done"
rm -rf "$OUT/ab"  # ab_interleaved.sh archived it as ab.tgz
archive
