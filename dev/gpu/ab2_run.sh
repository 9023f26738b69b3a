#!/usr/bin/env bash
# One lent-GPU call, the A/B of issue 37 with the median of 3: the CUDA tests, then bench_matrix's default call
# before issue 37 (.pre37/: commit b360572's eagle_mm and bench, ours alone, ONLY_OURS=1) and at this checkout (HF
# eager, HF static, ours), one process each, then a first call with empty caches under cProfile; beside them the
# CPU matrix on this host's CPU pinned to cores 0-1 (the GPU work on cores 2-15). Every output lands in OUTDIR.
#   CPU_DEADLINE=<epoch s> bash dev/gpu/ab2_run.sh OUTDIR   (NOCPU=1: no CPU rows; METHODS: the head's methods;
#   TESTS_T, PRE_T, HEAD_T: time limits; OUTDIR.tgz holds it all)
set -u
OUT=${1:?usage: ab2_run.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
[ "${NOCPU:-0}" = 1 ] || ( for r in ${CPUROWS:-greedy1 sampled1 greedy4 sampled4 greedy16 sampled16 greedy64 sampled32}; do
    [ "$(date +%s)" -gt "${CPU_DEADLINE:-0}" ] && break
    CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=2 PYTHONPATH=$R taskset -c 0,1 timeout 150 python bench/bench_matrix.py \
      --repeats 2 --rows "$r" --methods hf_eager hf_static ours --out "$OUT/cpu_$r.json" >> "$OUT/cpu.log" 2>&1
    echo "$(date -u +%T) cpu row $r rc=$?" >> "$OUT/cpu.log"
  done ) &
CPU=$!  # (with NOCPU=1: the last background job, none)
log "start cudatests"
PYTHONPATH=$R TRITON_INTERPRET=0 timeout ${TESTS_T:-90} $G python -m pytest -o addopts="" -q -rs --timeout 40 -p no:cacheprovider \
  tests/test_kernels.py tests/test_chooser.py tests/test_graphs.py tests/test_reliability_threads.py \
  tests/test_engine.py -k "cuda or graphs or chooser or threads or kernels" > "$OUT/cudatests.log" 2>&1
log "end cudatests rc=$?"
mkdir -p .pre37/eagle_mm/zoo/models && cp -r eagle_mm/zoo/models/code-tiny .pre37/eagle_mm/zoo/models/
ROWS=${ROWS:-greedy1 sampled1 greedy4 sampled4 greedy16 sampled16 greedy32 sampled32 greedy64 sampled64}
log "start matrix_pre37"
(cd .pre37 && ONLY_OURS=1 PYTHONPATH=$PWD timeout ${PRE_T:-150} $G python bench/bench_matrix.py --repeats 3 --rows $ROWS \
  --out "$OUT/matrix_pre37.json" > "$OUT/matrix_pre37.log" 2>&1)
log "end matrix_pre37 rc=$?"
log "start matrix_head"
PYTHONPATH=$R timeout ${HEAD_T:-250} $G python bench/bench_matrix.py --repeats 3 --rows $ROWS \
  --methods ${METHODS:-hf_eager hf_static ours} --out "$OUT/matrix_head.json" > "$OUT/matrix_head.log" 2>&1
log "end matrix_head rc=$?"
log "start cold"
PYTHONPATH=$R timeout 40 $G python dev/gpu/cold_profile.py > "$OUT/cold_greedy.log" 2>&1
log "end cold rc=$?"
[ -n "${CPU:-}" ] && { kill $CPU 2>/dev/null; wait $CPU 2>/dev/null; }
log "all done"
tar -czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"  # one file back: the device returns at most 8
