#!/usr/bin/env bash
# The H100 crash at sampled batch 64 (dev/notes/crash-sampled64.md) comes in one whole-matrix process of three: run
# the matrix with HF static, traced and checked (crash_probe.py --trace --check), process after process, until one
# faults or DEADLINE (epoch s) is near; each process's log is kept (traced_N.log), then the folder is archived.
#   DEADLINE=$(( $(date +%s) + 540 )) bash dev/gpu/crash_loop.sh OUTDIR
set -u
OUT=${1:?usage: crash_loop.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
i=0
while [ $(( $(date +%s) + 160 )) -lt "${DEADLINE:-0}" ]; do
  i=$((i + 1))
  log "start traced $i"
  PYTHONPATH=$R timeout 150 $G python dev/gpu/crash_probe.py --trace --check -- --repeats 3 --methods hf_static ours \
    --out "$OUT/traced_$i.json" > "$OUT/traced_$i.log" 2>&1
  rc=$?
  log "end traced $i rc=$rc"
  [ $rc != 0 ] && [ $rc != 124 ] && break  # a fault: its log holds the last prefill lookups and any moved address
done
log "all done"
archive
