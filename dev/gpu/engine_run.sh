#!/usr/bin/env bash
# One lent-GPU call for the engine issues: top-k probe, the code-tiny matrix, the cold-start benchmark, tree="auto"
# against the default tree, and a profile of the sampled cycle. Every output lands in OUTDIR; each step has its own
# time limit so that the call ends inside the loan's 10 minutes.
#   bash dev/gpu/engine_run.sh OUTDIR [STEPS...]     (steps: cudatests probe matrix scenes cold auto profile)
set -u
OUT=${1:?usage: engine_run.sh OUTDIR [STEPS...]}; shift
STEPS=${*:-cudatests matrix cold auto profile}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
log() { echo "$(date -u +%T) $*" | tee -a "$OUT/steps.log"; }
for s in $STEPS; do
  log "start $s"
  case $s in
    cudatests) TRITON_INTERPRET=0 timeout 240 python -m pytest -o addopts="" -q -rs tests/test_engine.py::test_graphs_equal_eager_cuda \
                 tests/test_engine.py::test_graphs_sampling_cuda tests/test_engine.py::test_triton_verify_bf16_equals_generate_cuda \
                 tests/test_engine.py::test_graphs_drop_finished_rows_cuda tests/test_engine.py::test_graphs_sampled_batch_cuda \
                 tests/test_graphs.py tests/test_kernels_sampling.py > "$OUT/cudatests.log" 2>&1 ;;
    scenes) timeout 180 python bench/bench_matrix.py --model scenes-tiny --repeats 2 --out "$OUT/scenes.json" \
              > "$OUT/scenes.log" 2>&1 ;;
    probe) timeout 90 python dev/gpu/topk_probe.py > "$OUT/topk_probe.txt" 2>&1 ;;
    matrix) timeout 300 python bench/bench_matrix.py --repeats 2 --out "$OUT/matrix.json" > "$OUT/matrix.log" 2>&1 ;;
    cold) timeout 240 python bench/bench_cold.py --out "$OUT/cold.json" > "$OUT/cold.log" 2>&1 ;;
    auto) timeout 150 python bench/bench_code_tiny.py --device cuda --dtype float32 --prompts 8 --max-new-tokens 128 --modes greedy \
            --methods eagle3_tree eagle3_auto --out "$OUT/auto.json" > "$OUT/auto.log" 2>&1 ;;
    profile) timeout 60 python dev/gpu/profile_engine.py --out "$OUT/profile" --parts code_tiny > "$OUT/profile.log" 2>&1 ;;
  esac
  log "end $s rc=$?"
done
