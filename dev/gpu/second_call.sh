#!/usr/bin/env bash
# The lent-GPU call after one_call.sh, about 6 minutes: bench_8b at accept 4 both ways (.pre37/ = commit b360572, then
# this checkout: issue 37's "no row slower" at 8B scale), the chooser's and the graphs' CUDA tests, and the whole
# matrix with the prefill eager under CUDA graphs (crash_probe.py --eager-prefill: does another step fail instead?).
#   bash dev/gpu/second_call.sh OUTDIR
set -u
OUT=${1:?usage: second_call.sh OUTDIR}
OUT=$(realpath -m "$OUT")
source "$(dirname "$0")/prelude.sh"
ab_8b ${B8_T:-100}
cuda_tests
log "start eager_prefill"
PYTHONPATH=$R timeout ${EAGER_T:-130} $G python dev/gpu/crash_probe.py --eager-prefill --trace -- --repeats 3 \
  --methods hf_static ours --out "$OUT/eager_prefill.json" > "$OUT/eager_prefill.log" 2>&1
log "end eager_prefill rc=$?"
log "all done"
archive
