#!/usr/bin/env bash
# One lent-GPU call: repeated default calls with CUDA_LAUNCH_BLOCKING=1 (a kernel fault is reported at its launch),
# bench_matrix before issue 37 (the tree copied to .pre37/ from commit b360572, code-tiny copied in) and at this
# checkout, in that order, then the CUDA tests one by one (a per-test timeout names a hang); the CPU matrix on cores
# 0-1 beside them. Every output lands in OUTDIR.
#   END=<epoch seconds the call must end by> CPU_DEADLINE=<no CPU row starts after> bash dev/gpu/ab_run.sh OUTDIR
set -u
OUT=${1:?usage: ab_run.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
( for r in ${CPUROWS:-greedy1 sampled1 greedy4 sampled4 greedy16 sampled16 greedy64 sampled32}; do
    [ "$(date +%s)" -gt "${CPU_DEADLINE:-0}" ] && break
    CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=2 PYTHONPATH=$R taskset -c 0,1 timeout 150 python bench/bench_matrix.py \
      --repeats 2 --rows "$r" --methods hf_eager hf_static ours --out "$OUT/cpu_$r.json" >> "$OUT/cpu.log" 2>&1
    echo "$(date -u +%T) cpu row $r rc=$?" >> "$OUT/cpu.log"
  done ) &
CPU=$!
log "start calls"
PYTHONPATH=$R CUDA_LAUNCH_BLOCKING=1 timeout ${CALLS_T:-60} $G python dev/gpu/chooser_calls.py --rows ${CALLROWS:-greedy1 greedy64 sampled64 sampled1} \
  --calls 2 --out "$OUT/calls.json" \
  > "$OUT/calls.log" 2>&1
log "end calls rc=$?"
cp -r eagle_mm/zoo/models/code-tiny .pre37/eagle_mm/zoo/models/
ROWS=${ROWS:-greedy1 sampled1 greedy4 sampled4 greedy16 sampled16 greedy32 sampled32 greedy64 sampled64}
log "start matrix_pre37"
(cd .pre37 && PYTHONPATH=$PWD timeout ${MATRIX_T:-150} $G python bench/bench_matrix.py --repeats ${REPEATS:-2} --rows $ROWS \
  --out "$OUT/matrix_pre37.json" > "$OUT/matrix_pre37.log" 2>&1)
log "end matrix_pre37 rc=$?"
log "start matrix_head"
PYTHONPATH=$R timeout ${MATRIX_T:-150} $G python bench/bench_matrix.py --repeats ${REPEATS:-2} --rows $ROWS --methods hf_eager hf_static ours \
  --out "$OUT/matrix_head.json" > "$OUT/matrix_head.log" 2>&1
log "end matrix_head rc=$?"
T=$(( ${END:-$(( $(date +%s) + 110 ))} - $(date +%s) - 20 )); [ "$T" -gt 90 ] && T=90
log "start cudatests ($T s)"
[ "$T" -gt 20 ] && PYTHONPATH=$R TRITON_INTERPRET=0 timeout $T $G python -m pytest -o addopts="" -v --timeout 40 -p no:cacheprovider \
  tests/test_chooser.py tests/test_graphs.py tests/test_reliability_threads.py tests/test_engine.py \
  -k "cuda or graphs or chooser or threads" > "$OUT/cudatests.log" 2>&1
log "end cudatests rc=$?"
wait $CPU
log "all done"
