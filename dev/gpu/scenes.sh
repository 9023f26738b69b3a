#!/usr/bin/env bash
# Build scenes-tiny on one GPU, benchmark it, and pack the build for shipping; ends within SCENES_TOTAL s of wall time.
#
#   bash dev/gpu/scenes.sh OUTDIR        (CUDA_VISIBLE_DEVICES picks the GPU)
#   SCENES_TOTAL=S SCENES_BUILD_LIMIT=B: other time limits; SCENES_BUILD_ARGS="--set training.max_seconds=300": any
#   build arguments. The whole default build (~11 min) is more than one lent-GPU call: run the base stage, then
#   the heads on a copy of it: SCENES_FROM=DIR SCENES_BUILD_ARGS="--stage heads" (DIR: a build, e.g. the zoo's).
#
# Writes to OUTDIR: build.log, manifest.json, bench.json + bench.log (when the build completed), status.txt, and
# the build directory as scenes-tiny.tar.part-aa, -ab, ... (15 MB each; `cat OUTDIR/scenes-tiny.tar.part-* | tar
# -C eagle_mm/zoo/models/scenes-tiny -xf -` unpacks it). The build saves each stage as it ends, so a timeout during
# the heads still leaves the VLM (manifest.json says what is complete).
set -u -o pipefail

OUT=${1:?usage: bash dev/gpu/scenes.sh OUTDIR}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-$(command -v python || command -v python3)}
BUILD=/tmp/scenes-tiny
DEVICE=${SCENES_DEVICE:-cuda}  # SCENES_DEVICE=cpu SCENES_BUILD_ARGS=--toy: a dry run of this script on a CPU
TOTAL=${SCENES_TOTAL:-570}              # the whole script
BUILD_LIMIT=${SCENES_BUILD_LIMIT:-520}  # the build alone (the default config plans for ~480 s)
START=$(date +%s)
mkdir -p "$OUT"
cd "$ROOT"
left() { echo $((TOTAL - ($(date +%s) - START))); }

rm -rf "$BUILD"
if [ -n "${SCENES_FROM:-}" ]; then cp -r "$SCENES_FROM" "$BUILD" || exit 1; fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/status.txt" 2>&1 || true
timeout -k 5 "$BUILD_LIMIT" "$PY" -m eagle_mm.zoo.scenes_tiny build --out "$BUILD" --seed 0 --device "$DEVICE" \
    ${SCENES_BUILD_ARGS:-} > "$OUT/build.log" 2>&1
echo "build exit $? after $(( $(date +%s) - START )) s" >> "$OUT/status.txt"
[ -f "$BUILD/manifest.json" ] && cp "$BUILD/manifest.json" "$OUT/manifest.json"

# The bench needs a complete build and the time left after it (tar takes a second or two).
BENCH_LIMIT=$(( $(left) - 10 ))
if grep -q '"complete": true' "$BUILD/manifest.json" 2>/dev/null && [ "$BENCH_LIMIT" -gt 25 ]; then
    EXAMPLES=24
    [ "$BENCH_LIMIT" -lt 60 ] && EXAMPLES=8
    timeout -k 3 "$BENCH_LIMIT" "$PY" bench/bench_scenes_tiny.py --path "$BUILD" --device "$DEVICE" \
        --examples "$EXAMPLES" --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
    echo "bench exit $? (examples $EXAMPLES, limit $BENCH_LIMIT s) after $(( $(date +%s) - START )) s" >> "$OUT/status.txt"
else
    echo "bench skipped: build incomplete or ${BENCH_LIMIT} s left" >> "$OUT/status.txt"
fi

if [ -d "$BUILD" ]; then
    tar -C "$BUILD" --exclude=./.work -cf - . | split -b 15m - "$OUT/scenes-tiny.tar.part-"
fi
echo "done after $(( $(date +%s) - START )) s" >> "$OUT/status.txt"
