#!/usr/bin/env bash
# One lent-GPU call: the A/B of issue 37 (bench_matrix's default call before it, .pre37/ = commit b360572 with
# ONLY_OURS=1, then this checkout with HF static, one process each, median of 3; bench_8b at accept 4 both ways), the
# chooser's CUDA tests, a first call with empty caches; beside them, on this host's CPU pinned to cores 0-1 (the GPU
# work on cores 2-15): dev/probes/cpu_steps.py (where a plain step goes against generate's), then CPU matrix rows
# until CPU_DEADLINE (epoch s). PRE8B=0: bench_8b on this checkout only. Every output lands in OUTDIR, and
# OUTDIR.tgz (the device returns few files).
#   CPU_DEADLINE=$(( $(date +%s) + 400 )) bash dev/gpu/ab4_run.sh OUTDIR      (NOCPU=1: no CPU work)
set -u
OUT=${1:?usage: ab4_run.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
C="env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 PYTHONPATH=$R taskset -c 0,1"
[ "${NOCPU:-0}" = 1 ] || (
  $C timeout 200 python dev/probes/cpu_steps.py --out "$OUT/cpu_steps" > "$OUT/cpu_steps.log" 2>&1
  echo "$(date -u +%T) cpu_steps rc=$?" >> "$OUT/cpu.log"
  cpu_rows "${CPUROWS:-greedy1 sampled1 greedy4 sampled4 greedy16 sampled16}" ) &
CPU=$!
mkdir -p .pre37/eagle_mm/zoo/models && cp -r eagle_mm/zoo/models/code-tiny .pre37/eagle_mm/zoo/models/
ROWS=${ROWS:-greedy1 sampled1 greedy4 sampled4 greedy16 sampled16 greedy32 sampled32 greedy64 sampled64}
log "start matrix_pre37"
(cd .pre37 && ONLY_OURS=1 PYTHONPATH=$PWD timeout ${PRE_T:-150} $G python bench/bench_matrix.py --repeats 3 --rows $ROWS \
  --out "$OUT/matrix_pre37.json" > "$OUT/matrix_pre37.log" 2>&1)
log "end matrix_pre37 rc=$?"
log "start matrix_head"
PYTHONPATH=$R timeout ${HEAD_T:-250} $G python bench/bench_matrix.py --repeats 3 --rows $ROWS \
  --methods ${METHODS:-hf_static ours} --out "$OUT/matrix_head.json" > "$OUT/matrix_head.log" 2>&1
log "end matrix_head rc=$?"
ab_8b 100
cuda_tests
log "start cold"
PYTHONPATH=$R timeout 40 $G python dev/gpu/cold_profile.py > "$OUT/cold_greedy.log" 2>&1
log "end cold rc=$?"
wait $CPU 2>/dev/null  # no new CPU row starts after CPU_DEADLINE
log "all done"
tar -czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
