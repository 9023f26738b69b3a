#!/usr/bin/env bash
# The host CPU alone (no GPU work): dev/probes/plain_step_cpu.py --ops pinned to cores 0-1 with 2 threads, on a fresh
# cost folder and again after a default call (its few-row verdicts in force): why the plain step lost to generate
# on the GPU machines' CPUs (ab13: 14 ms a forward against 8.4).
#   bash dev/gpu/host_probe.sh OUTDIR
set -u
OUT=${1:?usage: host_probe.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
C=$HOSTCPU
log "start probes"
$C timeout 75 python dev/probes/plain_step_cpu.py --batch 1 --ops > "$OUT/probe_fresh.log" 2>&1
log "probe fresh rc=$?"
$C timeout 75 python dev/probes/plain_step_cpu.py --batch 1 --ops --after-default > "$OUT/probe_after.log" 2>&1
log "probe after default rc=$?"
archive
