#!/usr/bin/env bash
# Greedy verify kernel on one H200, one call (<= 560 s; PROBE=1 up to 580 s more): the kernel tests on the GPU (TRITON_INTERPRET=0, bit-exact
# against the torch reference; the packed-pair argmax and pdl run only there), the dynamic-cache decode with the
# kernel against generate, then bench_verify.py at every shape (defaults, plus the given variants) and its tilings
# sweep at N=64, V=128k. PROBE=1 adds the probes: bench/probe_walk.py (walk stage clocks, argmax-only tilings),
# bench/probe_pdl.py (what the second launch costs), bench/probe_tma.py (the argmax through TMA loads),
# bench/probe_timeline.py (when each part runs), bench/probe_argmax.py (the argmax launch's variants).
#   bash scripts/gpu/verify.sh OUTDIR ["--variant packed=0,pdl=0 ..."]
set -u
OUT=${1:?usage: verify.sh OUTDIR [variant args]}
VARIANTS=${2:-"--variant wait=grid --variant packed=0,pdl=0 --variant packed=0,pdl=1"}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
log() { echo "$(date -u +%T) verify.sh: $*" | tee -a "$OUT/verify.log"; }
python3 -c "import torch, transformers, triton, sys; print(sys.version.split()[0], torch.__version__, \
transformers.__version__, triton.__version__, torch.cuda.get_device_name(0))" > "$OUT/versions.txt" 2>&1
log "start: $(cat "$OUT/versions.txt")"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_walk.py > "$OUT/test_kernels.log" 2>&1
log "kernel tests rc=$? $(tail -1 "$OUT/test_kernels.log")"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_static.py -k triton_verify >> "$OUT/test_kernels.log" 2>&1
log "decode with the kernel rc=$? $(tail -1 "$OUT/test_kernels.log")"
# shellcheck disable=SC2086
timeout 150 python3 bench/bench_verify.py $VARIANTS --out "$OUT/verify.json" > "$OUT/verify.md" 2>> "$OUT/verify.log"
log "bench rc=$?"
timeout 80 python3 bench/bench_verify.py --nodes 64 --vocab 128256 --tilings --out "$OUT/verify_tilings.json" \
  > "$OUT/verify_tilings.md" 2>> "$OUT/verify.log"; log "tilings rc=$?"
if [ -n "${PROBE:-}" ]; then
  timeout 140 python3 bench/probe_walk.py --nodes 64 --warps 4 --argmax-sweep --out "$OUT/probe.json" 2>> "$OUT/verify.log"
  log "probe rc=$?"
  timeout 120 python3 bench/probe_pdl.py --out "$OUT/probe_pdl.json" 2>> "$OUT/verify.log"; log "probe_pdl rc=$?"
  timeout 120 python3 bench/probe_tma.py --out "$OUT/probe_tma.json" 2>> "$OUT/verify.log"; log "probe_tma rc=$?"
  timeout 100 python3 bench/probe_timeline.py --out "$OUT/probe_timeline.json" 2>> "$OUT/verify.log"
  log "probe_timeline rc=$?"
  timeout 100 python3 bench/probe_argmax.py --out "$OUT/probe_argmax.json" 2>> "$OUT/verify.log"
  log "probe_argmax rc=$?"
fi
