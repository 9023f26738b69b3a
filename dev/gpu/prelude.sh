# Sourced by the run scripts of dev/gpu/ after `set -u`, with OUT set: makes OUT, writes the GPU's name to
# OUT/gpu.txt, goes to the repository root (R), and defines log (OUT/steps.log), archive (OUT into OUT.tgz, the one
# file the device brings back), G (the GPU work's cores, 2-15) and HOSTCPU (the CPU work beside it, on 0-1).
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
R=$PWD
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
log() { echo "$(date -u +%T) $*" | tee -a "$OUT/steps.log"; }
archive() { tar -czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")" && rm -rf "$OUT"; }
G="taskset -c 2-15"
# The host CPU's work: no GPU, 2 threads, cores 0-1 (the variables before taskset: after it they read as the command).
HOSTCPU="env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 PYTHONPATH=$R taskset -c 0,1"
# CPU matrix rows beside the GPU work (CPU_REPEATS timed calls, 3 by default: with 2, one call that drafted where it
# lost was half the median on the hosts): each row of $1 in a process of its own on cores 0-1, until CPU_DEADLINE (epoch
# s), into OUT/cpu_ROW.json and OUT/cpu.log. Run it in the background: `cpu_rows "greedy1 sampled1" &`.
cpu_rows() {
  local r C=$HOSTCPU
  for r in $1; do
    [ "$(date +%s)" -gt "${CPU_DEADLINE:-0}" ] && break
    $C timeout 150 python bench/bench_matrix.py --repeats ${CPU_REPEATS:-3} --rows "$r" --methods hf_eager hf_static ours \
      --out "$OUT/cpu_$r.json" >> "$OUT/cpu.log" 2>&1
    echo "$(date -u +%T) cpu row $r rc=$?" >> "$OUT/cpu.log"
  done
}
# bench_8b at accept 4: .pre37/ (commit b360572; skipped with PRE8B=0), then this checkout; $1: seconds each.
ab_8b() {
  log "start 8b_ab"
  [ "${PRE8B:-1}" = 1 ] && (cd .pre37 && PYTHONPATH=$PWD timeout "$1" $G python bench/bench_8b.py --accept 4 \
    --modes ceiling ours_default --out "$OUT/8b_pre37.json" > "$OUT/8b_pre37.log" 2>&1)
  PYTHONPATH=$R timeout "$1" $G python bench/bench_8b.py --accept 4 --modes ceiling ours_default \
    --out "$OUT/8b_head.json" > "$OUT/8b_head.log" 2>&1
  log "end 8b_ab rc=$?"
}
# The chooser's and the graphs' CUDA tests, into OUT/cudatests.log.
cuda_tests() {
  log "start cudatests"
  PYTHONPATH=$R TRITON_INTERPRET=0 timeout ${TESTS_T:-90} $G python -m pytest -o addopts="" -q -rs -p no:cacheprovider \
    tests/test_chooser.py tests/test_graphs.py -k "cuda or graphs or chooser or capture" > "$OUT/cudatests.log" 2>&1
  log "end cudatests rc=$?"
}
# Seconds left before DEADLINE (epoch s) exceed $1.
fits() { [ $(( $(date +%s) + $1 )) -lt "${DEADLINE:-0}" ]; }
# The measuring tail of call16.sh and call20.sh: bench_8b at accept 4 in the order b360572, head, b360572 (each while
# $1 seconds are left), the whole matrix with HF static (at most 175 s, leaving $2), issue 37's A/B rows (ABROWS,
# 5 repeats, while $3 seconds are left).
measure_tail() {
  local side dir
  for side in pre37 head pre37b; do
    fits "$1" || break
    dir=$R; [ "${side#pre37}" != "$side" ] && dir=$R/.pre37
    (cd "$dir" && PYTHONPATH=$dir timeout 50 $G python bench/bench_8b.py --accept 4 --modes ceiling ours_default \
      --out "$OUT/8b_$side.json" > "$OUT/8b_$side.log" 2>&1)
    log "end 8b $side rc=$?"
  done
  if fits 120; then
    PYTHONPATH=$R timeout $(( DEADLINE - $(date +%s) - $2 > 175 ? 175 : DEADLINE - $(date +%s) - $2 )) \
      $G python bench/bench_matrix.py --repeats 3 --methods hf_static ours --out "$OUT/matrix_head.json" \
      > "$OUT/matrix_head.log" 2>&1
    log "end matrix_head rc=$?"
  fi
  fits "$3" && REPEATS=5 ROWS="${ABROWS:-sampled1 greedy1}" timeout $(( DEADLINE - $(date +%s) )) \
    bash dev/gpu/ab_interleaved.sh "$OUT/ab" > /dev/null 2>&1
  rm -rf "$OUT/ab"
  log "end ab"
}
# The GPU matrix's rows in a process of their own, every method, 3 timed calls, into OUT/matrix_$1.json and .log:
# $1 a name, $2 the most seconds, the rest the rows; within DEADLINE (skipped where fewer than MIN_LEFT, 30, are left).
matrix_part() {
  local name=$1 most=$2 left; shift 2
  left=$(( DEADLINE - $(date +%s) - 5 ))
  [ "$left" -lt "${MIN_LEFT:-30}" ] && return
  PYTHONPATH=$R timeout $(( left < most ? left : most )) $G python bench/bench_matrix.py --repeats 3 --rows "$@" \
    --out "$OUT/matrix_$name.json" > "$OUT/matrix_$name.log" 2>&1
  log "end matrix_$name rc=$?"
}
