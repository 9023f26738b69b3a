#!/usr/bin/env bash
# Session 2026-12-07b's last measuring call (commit d851088 and its docs): the greedy acceptance's Triton kernel
# against its torch reference in CUDA graphs (accept_probe.py); the cold first call twice (cold_profile.py, empty
# caches: as shipped, then with EAGLE_MM_VERIFY_BACKEND=torch, no Triton build); bench_8b's A/B in the order
# b360572, head, b360572 (a GPU that slows over the run falls on both); the whole matrix with HF static; issue
# 37's A/B rows (ABROWS, default sampled1 greedy1) with 5 repeats (a call that decodes without a tree to measure it is one of five,
# not one of three). Beside it on cores 0-1: plain_step_cpu.py --batch 4 --ops --after-default (the host CPU lost greedy
# batch 4: the probe's few-row verdicts there),
# then CPU matrix rows until CPU_DEADLINE.
#   DEADLINE=$(( $(date +%s) + 575 )) CPU_DEADLINE=$(( $(date +%s) + 420 )) bash dev/gpu/call16.sh OUTDIR
set -u
OUT=${1:?usage: call16.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
C=$HOSTCPU
(
  $C timeout 150 python dev/probes/plain_step_cpu.py --batch 4 --new-tokens 64 --ops --after-default > "$OUT/probe_b4.log" 2>&1
  echo "$(date -u +%T) probe b4 rc=$?" >> "$OUT/cpu.log"
  cpu_rows "greedy4 greedy1 sampled1"
) &
CPU=$!
log "start accept probe"
PYTHONPATH=$R timeout 40 $G python dev/gpu/accept_probe.py > "$OUT/accept_probe.log" 2>&1
log "end accept probe rc=$?"
PYTHONPATH=$R timeout 40 $G python dev/gpu/cold_profile.py > "$OUT/cold_greedy.log" 2>&1
log "end cold rc=$?"
EAGLE_MM_VERIFY_BACKEND=torch PYTHONPATH=$R timeout 40 $G python dev/gpu/cold_profile.py > "$OUT/cold_torch.log" 2>&1
log "end cold torch rc=$?"
measure_tail 200 115 60
wait $CPU 2>/dev/null
log "all done"
archive
