#!/usr/bin/env bash
# Session 2026-12-07f's last call: dev/gpu/fault_repro.py's variants, one fresh process each, until DEADLINE; the
# blocking-launch run of the matrix's order last.
#   S=$(date +%s); DEADLINE=$((S+280)) bash dev/gpu/call25.sh OUTDIR
set -u
OUT=${1:?usage: call25.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
one() {  # $1: label, rest: fault_repro.py arguments (env before it in $ENVV)
  fits 40 || return
  PYTHONPATH=$R timeout 70 env ${ENVV:-} $G python dev/gpu/fault_repro.py "${@:2}" > "$OUT/$1.log" 2>&1
  log "$1 rc=$? $(grep -h ': ok (' "$OUT/$1.log" | tail -1)"
}
one a_static_then_ours --batch 64 --variant static_then_ours
one b_ours_only --batch 64 --variant ours_only
one c_static_sync_empty --batch 64 --variant static_sync_empty
one d_static_reset_trees --batch 64 --variant static_reset_trees
one e_static_then_ours_b32 --batch 32 --variant static_then_ours
one f_ours_first --batch 64 --variant ours_then_static_then_ours
ENVV=CUDA_LAUNCH_BLOCKING=1 one g_blocking --batch 64 --variant static_then_ours
log "all done"
archive
