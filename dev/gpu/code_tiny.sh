#!/usr/bin/env bash
# code-tiny on one GPU: retrain draft heads in parallel on the shipped base (target, tokenizer, assistant), merge
# them into one build, then run the benchmark. Results and the new heads land in OUTDIR.
#   bash dev/gpu/code_tiny.sh OUTDIR                       (both heads, then the bench, ~400 s)
#   CT_HEADS=eagle3 bash dev/gpu/code_tiny.sh OUTDIR       (only the EAGLE-3 head; the EAGLE head is the shipped one)
#   CT_SRC=DIR CT_DEVICE=cpu CT_TOY=1 bash dev/gpu/code_tiny.sh OUTDIR   (a dry run of a --toy build)
# CT_HEADS_S / CT_BENCH_S: time limits of the head builds and of the bench (the bench saves after every row).
set -u
OUT=${1:?usage: code_tiny.sh OUTDIR}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SRC=${CT_SRC:-eagle_mm/zoo/models/code-tiny}; DEV=${CT_DEVICE:-cuda}; HEADS=(${CT_HEADS:-eagle eagle3})
TOY=(); BENCH=(--prompts 16 --max-new-tokens 128)  # every method, greedy first
if [ -n "${CT_TOY:-}" ]; then TOY=(--toy); BENCH=(--prompts 2 --max-new-tokens 8 --methods generate eagle_tree eagle3_tree); fi
WORK=$(mktemp -d); A=$WORK/ct
cp -r "$SRC" "$A" || exit 1
log() { echo "$(date -u +%T) $*"; }
log "code-tiny: heads ${HEADS[*]} start"
for h in "${HEADS[@]}"; do
  cp -r "$SRC" "$WORK/$h" || exit 1
  (timeout "${CT_HEADS_S:-250}" python3 -m eagle_mm.zoo.code_tiny build --out "$WORK/$h" --device "$DEV" --stage heads \
    --heads "$h" "${TOY[@]}" > "$OUT/ct_$h.log" 2>&1; log "$h head rc=$?") &
done
wait
for h in "${HEADS[@]}"; do
  python3 -m eagle_mm.zoo.code_tiny merge --out "$A" --from "$WORK/$h" --heads "$h" > "$OUT/ct_merge_$h.log" 2>&1
  log "merge $h rc=$? $(tail -1 "$OUT/ct_merge_$h.log")"
done
rm -rf "$A/.work"; mkdir -p "$OUT/code-tiny"
cp -r "$A/eagle" "$A/eagle3" "$A/manifest.json" "$A/prompts.json" "$OUT/code-tiny/"
timeout "${CT_BENCH_S:-125}" python3 bench/bench_code_tiny.py --zoo-dir "$A" --device "$DEV" "${BENCH[@]}" \
  --out "$OUT/code_tiny_bench.json" > "$OUT/ct_bench.log" 2>&1
log "bench rc=$?"; tail -30 "$OUT/ct_bench.log"
