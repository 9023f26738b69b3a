#!/usr/bin/env bash
# code-tiny on one GPU: retrain both draft heads in parallel on the shipped base (target, tokenizer, assistant),
# merge them into one build, then run the benchmark. Results and the new heads land in OUTDIR.
#   bash scripts/gpu/code_tiny.sh OUTDIR                       (the GPU run, ~400 s)
#   CT_SRC=DIR CT_DEVICE=cpu CT_TOY=1 bash scripts/gpu/code_tiny.sh OUTDIR   (a dry run of a --toy build)
set -u
OUT=${1:?usage: code_tiny.sh OUTDIR}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SRC=${CT_SRC:-eagle_mm/zoo/models/code-tiny}; DEV=${CT_DEVICE:-cuda}
TOY=(); BENCH=(--prompts 16 --max-new-tokens 128 --methods generate prompt_lookup assisted eagle_chain eagle_tree eagle3_chain eagle3_tree)
if [ -n "${CT_TOY:-}" ]; then TOY=(--toy); BENCH=(--prompts 2 --max-new-tokens 8 --methods generate eagle_tree eagle3_tree); fi
A=$(mktemp -d)/ct-a; B=$(mktemp -d)/ct-b
cp -r "$SRC" "$A" && cp -r "$SRC" "$B" || exit 1
log() { echo "$(date -u +%T) $*"; }
log "code-tiny: heads start"
(timeout "${CT_HEADS_S:-250}" python3 -m eagle_mm.zoo.code_tiny build --out "$A" --device "$DEV" --stage heads --heads eagle "${TOY[@]}" \
  > "$OUT/ct_eagle.log" 2>&1; log "eagle head rc=$?") &
(timeout "${CT_HEADS_S:-250}" python3 -m eagle_mm.zoo.code_tiny build --out "$B" --device "$DEV" --stage heads --heads eagle3 "${TOY[@]}" \
  > "$OUT/ct_eagle3.log" 2>&1; log "eagle3 head rc=$?") &
wait
python3 -m eagle_mm.zoo.code_tiny merge --out "$A" --from "$B" --heads eagle3 > "$OUT/ct_merge.log" 2>&1
log "merge rc=$? $(cat "$OUT/ct_merge.log" | tail -1)"
rm -rf "$A/.work"; mkdir -p "$OUT/code-tiny"
cp -r "$A/eagle" "$A/eagle3" "$A/manifest.json" "$A/prompts.json" "$OUT/code-tiny/"
timeout "${CT_BENCH_S:-125}" python3 bench/bench_code_tiny.py --zoo-dir "$A" --device "$DEV" "${BENCH[@]}" \
  --out "$OUT/code_tiny_bench.json" > "$OUT/ct_bench.log" 2>&1
log "bench rc=$?"; tail -20 "$OUT/ct_bench.log"
