#!/usr/bin/env bash
# One lent-GPU call narrowing the H100 crash at sampled batch 64 (dev/notes/crash-sampled64.md), about 8 minutes:
#   1. greedy64 then sampled64 with HF static in one process (is HF static enough to bring it on?)
#   2. the whole matrix, ours only (are the earlier rows enough?)
#   3. the whole matrix with HF static, traced and checked (crash_probe.py --trace --check)
#   4. the same with the prefill eager (--eager-prefill): does another step fail then?
# Beside them, CPU matrix rows on cores 0-1 (prelude.sh's cpu_rows) until CPU_DEADLINE (epoch s).
#   CPU_DEADLINE=$(( $(date +%s) + 450 )) bash dev/gpu/crash_run.sh OUTDIR
set -u
OUT=${1:?usage: crash_run.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
[ "${NOCPU:-0}" = 1 ] || cpu_rows "${CPUROWS:-greedy1 sampled1}" &
CPU=$!
M="bench/bench_matrix.py --repeats 3"
P="dev/gpu/crash_probe.py"
log "start two_rows_static"
PYTHONPATH=$R timeout 110 $G python $M --rows greedy64 sampled64 --methods hf_static ours --out "$OUT/two_static.json" \
  > "$OUT/two_static.log" 2>&1
log "end two_rows_static rc=$?"
log "start matrix_ours"
PYTHONPATH=$R timeout 100 $G python $M --methods ours --out "$OUT/matrix_ours.json" > "$OUT/matrix_ours.log" 2>&1
log "end matrix_ours rc=$?"
log "start traced_checked"
PYTHONPATH=$R timeout 170 $G python $P --trace --check -- --repeats 3 --methods hf_static ours \
  --out "$OUT/traced.json" > "$OUT/traced.log" 2>&1
log "end traced_checked rc=$?"
which compute-sanitizer > "$OUT/sanitizer.txt" 2>&1; ls /usr/local/cuda*/bin >> "$OUT/sanitizer.txt" 2>&1
log "start eager_prefill"
PYTHONPATH=$R timeout 130 $G python $P --eager-prefill --trace -- --repeats 3 --methods hf_static ours \
  --out "$OUT/eager_prefill.json" > "$OUT/eager_prefill.log" 2>&1
log "end eager_prefill rc=$?"
wait $CPU 2>/dev/null
log "all done"
