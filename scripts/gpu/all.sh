#!/usr/bin/env bash
# The GPU measurements of a session, in three calls of under 600 s (each part under its own limit; plans 1 and 2
# need a 2-GPU machine, plan 3 one GPU):
#   bash scripts/gpu/all.sh OUTDIR 1
#     GPU 0: code_tiny.sh, CT_HEADS=eagle3 (retrain the EAGLE-3 head, merge it, the H200 code-tiny benchmark)  <= 575 s
#            (its benchmark shares the CPU with the scenes build: plan 3 times the shipped build alone)
#     GPU 1: scenes.sh (build scenes-tiny, benchmark it, pack the build)                                        <= 570 s
#   bash scripts/gpu/all.sh OUTDIR 2
#     both GPUs: multi.sh part b (an 8B-shaped target split over the 2 GPUs; part a, 2-GPU training, ran earlier)
#     then GPU 0: bench_verify.py (both verify kernels; tilings at N=64, V=128k)                           <= 120 s
#   bash scripts/gpu/all.sh OUTDIR 3   (one H200, one job at a time: Python-bound timings suffer from any neighbour)
#     the CUDA compiled-vs-eager test; the code-tiny benchmark in float32 (greedy; 8 prompts)             <= 250 s
#     then the 8B forced-acceptance benchmark (bench_8b.py, as in speed.sh)                               <= 200 s
#     then the kernel tests on the GPU (TRITON_INTERPRET=0: both verify kernels, bit-exact)               <= 60 s
#     Its files are written straight into OUTDIR (no tar), so a call cut short keeps what was measured.
#   bash scripts/gpu/all.sh OUTDIR 4   (2 GPUs; packed like plans 1 and 2)
#     GPU 0: the GPU tests (both verify kernels, the static/compiled path), bench_verify.py (+ tilings at N=64,
#            V=128k) and bench_verify_sampling.py                                                            <= 400 s
#     GPU 1: bench_8b.py (with the per-phase cycle times and a profile), then the code-tiny benchmark        <= 560 s
#   bash scripts/gpu/all.sh OUTDIR 5   (2 GPUs; packed like plans 1 and 2)
#     first, alone: bench_8b.py without ours_eager                                                          <= 240 s
#     then GPU 0: the GPU tests; GPU 1: the code-tiny benchmark                                              <= 300 s
# The device tool brings back at most 8 files of 16 MiB, so plans 1 and 2 pack everything in OUTDIR.tar, cut into
# 15 MB parts OUTDIR.tar.part-aa, -ab, ... (cat them back together).
set -u
OUT=${1:?usage: all.sh OUTDIR 1|2|3|4|5}; PLAN=${2:?usage: all.sh OUTDIR 1|2|3|4|5}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
log() { echo "$(date -u +%T) all.sh: $*" | tee -a "$OUT/all.log"; }
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > "$OUT/gpus.txt" 2>&1
python3 -c "import torch, transformers, triton, accelerate, sys; print(sys.version.split()[0], torch.__version__, \
transformers.__version__, triton.__version__, accelerate.__version__)" > "$OUT/versions.txt" 2>&1
log "start plan $PLAN: $(tr '\n' ';' < "$OUT/gpus.txt") $(cat "$OUT/versions.txt")"
case "$PLAN" in
1)
  (CUDA_VISIBLE_DEVICES=0 CT_HEADS=eagle3 CT_HEADS_S=280 CT_BENCH_S=285 timeout 575 bash scripts/gpu/code_tiny.sh \
     "$OUT/code_tiny" > "$OUT/code_tiny.log" 2>&1; log "code_tiny.sh rc=$?") &
  (CUDA_VISIBLE_DEVICES=1 timeout 575 bash scripts/gpu/scenes.sh "$OUT/scenes" > "$OUT/scenes.log" 2>&1
   log "scenes.sh rc=$?") &
  ;;
2)
  SKIP_A=1 timeout 160 bash scripts/gpu/multi.sh "$OUT/multi" > "$OUT/multi.log" 2>&1; log "multi.sh (b) rc=$?"
  CUDA_VISIBLE_DEVICES=0 timeout 60 python3 bench/bench_verify.py --out "$OUT/verify.json" > "$OUT/verify.log" 2>&1
  log "bench_verify rc=$?"
  CUDA_VISIBLE_DEVICES=0 timeout 60 python3 bench/bench_verify.py --tilings --nodes 64 --vocab 128256 \
    --out "$OUT/verify_tilings.json" > "$OUT/verify_tilings.log" 2>&1
  log "bench_verify --tilings rc=$?"
  ;;
3)
  export TRITON_INTERPRET=0  # tests/conftest.py picks the interpreter unless told otherwise
  timeout 60 python3 -m pytest -q -p no:cacheprovider -rs tests/test_static.py -k cuda > "$OUT/tests_cuda.log" 2>&1
  log "test_static cuda rc=$?"
  timeout 250 python3 bench/bench_code_tiny.py --device cuda --dtype float32 --prompts 8 --max-new-tokens 128 \
    --modes greedy --methods generate generate_compiled eagle3_chain_compiled eagle3_tree_compiled eagle3_chain \
    eagle3_tree eagle_chain eagle_tree prompt_lookup assisted eagle3_auto \
    --out "$OUT/code_tiny_h200.json" > "$OUT/code_tiny_h200.log" 2>&1
  log "bench_code_tiny rc=$?"
  TORCH_LOGS=recompiles timeout 200 python3 bench/bench_8b.py --accept 1 2 3 4 5 --new-tokens 128 \
    --out "$OUT/bench_8b.json" > "$OUT/bench_8b.log" 2>&1
  log "bench_8b rc=$?"
  timeout 60 python3 -m pytest -q -p no:cacheprovider -x tests/test_kernels.py >> "$OUT/tests_cuda.log" 2>&1
  log "test_kernels (GPU) rc=$?"
  exit 0
  ;;
4)
  export TRITON_INTERPRET=0
  (export CUDA_VISIBLE_DEVICES=0
   timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/test_kernels.py tests/test_kernels_sampling.py \
     tests/test_static.py > "$OUT/tests_gpu.log" 2>&1; log "GPU tests rc=$?"
   timeout 100 python3 bench/bench_verify.py --out "$OUT/verify.json" > "$OUT/verify.log" 2>&1; log "bench_verify rc=$?"
   timeout 120 python3 bench/bench_verify.py --tilings --nodes 64 --vocab 128256 --out "$OUT/verify_tilings.json" \
     > "$OUT/verify_tilings.log" 2>&1; log "bench_verify --tilings rc=$?"
   timeout 150 python3 bench/bench_verify_sampling.py --out "$OUT/verify_sampling.json" > "$OUT/verify_sampling.log" \
     2>&1; log "bench_verify_sampling rc=$?") &
  (export CUDA_VISIBLE_DEVICES=1
   TORCH_LOGS=recompiles timeout 300 python3 bench/bench_8b.py --accept 1 2 3 4 5 --new-tokens 128 --profile \
     --out "$OUT/bench_8b.json" > "$OUT/bench_8b.log" 2>&1; log "bench_8b rc=$?"
   timeout 250 python3 bench/bench_code_tiny.py --device cuda --dtype float32 --prompts 8 --max-new-tokens 128 \
     --modes greedy --methods generate generate_compiled eagle3_chain_compiled eagle3_tree_compiled eagle3_chain \
     eagle3_tree eagle_chain eagle_tree prompt_lookup assisted \
     --out "$OUT/code_tiny_h200.json" > "$OUT/code_tiny_h200.log" 2>&1; log "bench_code_tiny rc=$?") &
  ;;
5)
  export TRITON_INTERPRET=0
  CUDA_VISIBLE_DEVICES=1 TORCH_LOGS=recompiles timeout 240 python3 bench/bench_8b.py --accept 1 2 3 4 5 \
    --new-tokens 128 --modes ceiling generate_eager ours_compiled generate_compiled verify_forward \
    --out "$OUT/bench_8b.json" > "$OUT/bench_8b.log" 2>&1; log "bench_8b rc=$?"
  (CUDA_VISIBLE_DEVICES=0 timeout 290 python3 -m pytest -q -p no:cacheprovider -rs tests/test_kernels.py \
     tests/test_kernels_sampling.py tests/test_static.py tests/test_stopping.py > "$OUT/tests_gpu.log" 2>&1
   log "GPU tests rc=$?") &
  (CUDA_VISIBLE_DEVICES=1 timeout 290 python3 bench/bench_code_tiny.py --device cuda --dtype float32 --prompts 8 \
     --max-new-tokens 128 --modes greedy --methods generate generate_compiled eagle3_chain_compiled \
     eagle3_tree_compiled eagle3_chain eagle3_tree eagle_chain eagle_tree prompt_lookup assisted \
     --out "$OUT/code_tiny_h200.json" > "$OUT/code_tiny_h200.log" 2>&1; log "bench_code_tiny rc=$?") &
  ;;
*) log "unknown plan $PLAN"; exit 2 ;;
esac
wait
log "done"
tar -C "$(dirname "$OUT")" -cf - "$(basename "$OUT")" | split -b 15m - "$OUT.tar.part-" && rm -rf "$OUT"
