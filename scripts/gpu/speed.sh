#!/usr/bin/env bash
# Issue 8 speed figures on one GPU, within 240 s of wall time, torch.compile warm-ups included.
#
#   bash scripts/gpu/speed.sh OUTDIR        (CUDA_VISIBLE_DEVICES picks the GPU)
#
# Runs, each under its own `timeout`:
#   - bench/bench_8b.py: the Llama-3.1-8B-shaped target + 8B EAGLE-3 head, forced acceptance 1..5, modes ceiling,
#     generate eager, ours compiled, ours eager, generate compiled (in that order: the headline figures first).
#     It rewrites OUTDIR/bench_8b.json after every measurement, so a timeout keeps what was measured.
#   - tests/test_static.py -k cuda: the compiled path's tokens equal the eager static path's, on a tiny model.
#     It runs beside the benchmark (niced, few compile threads): the benchmark alone needs most of the budget.
# Writes OUTDIR/speed.log (timestamped progress), bench_8b.json, bench_8b.log, test_static_cuda.log, env.txt.
# SPEED_BENCH_ARGS adds benchmark arguments (e.g. "--tiny" for a dry run of this script on a CPU).
set -u -o pipefail

OUT=${1:?usage: bash scripts/gpu/speed.sh OUTDIR}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-$(command -v python || command -v python3)}
TOTAL=240
START=$(date +%s)
mkdir -p "$OUT"
cd "$ROOT"
left() { echo $((TOTAL - 8 - ($(date +%s) - START))); }
log() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/speed.log"; }

log "start: CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset}, python $PY"
{ nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" 2>&1
} > "$OUT/env.txt" || true

# The CUDA compiled-vs-eager test, in the background (TRITON_INTERPRET=0: tests/conftest.py would otherwise pick the
# Triton interpreter, which cannot run CUDA tensors).
log "test_static cuda: start (limit 200 s)"
( TRITON_INTERPRET=0 TORCHINDUCTOR_COMPILE_THREADS=4 timeout -k 5 200 nice -n 10 "$PY" -m pytest -q -p no:cacheprovider -rs \
    tests/test_static.py -k cuda > "$OUT/test_static_cuda.log" 2>&1
  echo "exit $?" >> "$OUT/test_static_cuda.log" ) &
TEST_PID=$!

BENCH_LIMIT=$(left)
log "bench_8b: start (limit $BENCH_LIMIT s)"
TORCH_LOGS=recompiles timeout -k 5 "$BENCH_LIMIT" "$PY" bench/bench_8b.py --accept 1 2 3 4 5 --new-tokens 128 \
    --out "$OUT/bench_8b.json" ${SPEED_BENCH_ARGS:-} > "$OUT/bench_8b.log" 2>&1
log "bench_8b: exit $? ($(grep -c '"mode"' "$OUT/bench_8b.json" 2>/dev/null || echo 0) rows in bench_8b.json)"

wait "$TEST_PID"
log "test_static cuda: $(tail -n 2 "$OUT/test_static_cuda.log" | tr '\n' ' ')"
log "done"
