#!/usr/bin/env bash
# One lent-GPU call for the chooser (#36) and the refactor (#37): CUDA tests, per-call costs of repeated default
# calls, the code-tiny matrix, bench_8b; beside them, the CPU matrix on this host's CPU pinned to cores 0-1 (the GPU
# work runs on cores 2-15). Every output lands in OUTDIR.
#   bash dev/gpu/chooser_run.sh OUTDIR [STEPS...]    (steps: cudatests calls matrix 8b 8b_ab prof64 cold;
#   8b_ab: bench_8b at accept 4 from .pre37/, the tree before issue 37, then at this checkout; cpu runs unless
#   NOCPU=1; CPUROWS picks its rows and CPU_DEADLINE, epoch seconds, when it starts no more)
set -u
OUT=${1:?usage: chooser_run.sh OUTDIR [STEPS...]}; shift
STEPS=${*:-cudatests calls matrix 8b}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
log() { echo "$(date -u +%T) $*" | tee -a "$OUT/steps.log"; }
if [ "${NOCPU:-0}" != 1 ]; then
  ( for r in ${CPUROWS:-greedy1 sampled1 greedy4 sampled4 greedy16 sampled16 greedy64 sampled64 greedy32 sampled32}; do
      [ "$(date +%s)" -gt "${CPU_DEADLINE:-0}" ] && break
      CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 taskset -c 0,1 timeout 150 python bench/bench_matrix.py \
        --repeats 2 --rows "$r" --methods hf_eager hf_static ours --out "$OUT/cpu_$r.json" >> "$OUT/cpu.log" 2>&1
      echo "$(date -u +%T) cpu row $r rc=$?" >> "$OUT/cpu.log"
    done ) &
  CPU=$!
fi
G="taskset -c 2-15"
for s in $STEPS; do
  log "start $s"
  case $s in
    cudatests) TRITON_INTERPRET=0 timeout 120 $G python -m pytest -o addopts="" -q -rs tests/test_chooser.py tests/test_graphs.py \
                 tests/test_reliability_threads.py tests/test_engine.py -k "cuda or graphs or chooser or threads" \
                 > "$OUT/cudatests.log" 2>&1 ;;
    calls) timeout 90 $G python dev/gpu/chooser_calls.py --out "$OUT/calls.json" > "$OUT/calls.log" 2>&1 ;;
    matrix) timeout 260 $G python bench/bench_matrix.py --repeats 3 --methods hf_eager hf_static ours \
              --out "$OUT/matrix.json" > "$OUT/matrix.log" 2>&1 ;;
    8b) timeout 110 $G python bench/bench_8b.py --out "$OUT/8b.json" > "$OUT/8b.log" 2>&1 ;;
    8b_ab) (cd .pre37 && PYTHONPATH=$PWD timeout 100 $G python bench/bench_8b.py --accept 4 --modes ceiling ours_default \
              --out "$OUT/8b_pre37.json" > "$OUT/8b_pre37.log" 2>&1)
           timeout 100 $G python bench/bench_8b.py --accept 4 --modes ceiling ours_default --out "$OUT/8b_head.json" \
             > "$OUT/8b_head.log" 2>&1 ;;
    prof64) timeout 90 $G python dev/gpu/profile_engine.py --out "$OUT/prof" --parts batch64 > "$OUT/prof64.log" 2>&1 ;;
    cold) timeout 150 $G python bench/bench_cold.py --out "$OUT/cold.json" > "$OUT/cold.log" 2>&1 ;;
  esac
  log "end $s rc=$?"
done
[ -n "${CPU:-}" ] && wait $CPU
log "all done"
