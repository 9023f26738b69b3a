#!/usr/bin/env bash
# The SmolLM2-135M-Instruct recipe from scratch on one GPU (about 410 s on an H200): the target's own answers to
# scripts/smollm2/prompts.jsonl.gz (about 175 s; scripts/smollm2/regenerated.jsonl.gz holds the ones this wrote), the
# EAGLE-3 head trained on them for what --budget leaves (about 150 s of optimizer steps), packaged under $OUT with
# manifest.json. The shipped head was trained by gpu_train_eval.sh instead, on the committed answers for recipe.json's
# full train_seconds. A copy of the head and manifest stays in $SMOLLM2_KEEP (default $HOME/smollm2) for gpu_eval.sh on
# the same warm machine, and the converted GGUF in $EAGLE_MM_CACHE.
# Run from the repository root, with the gguf package importable:
#   SMOLLM2_GGUF=~/gguf/SmolLM2-135M-Instruct.Q4_1.gguf OUT=/some/dir bash scripts/smollm2/gpu_train.sh
# Extra arguments go to recipe.py (--dry-run: every stage at a tiny scale, a CPU check; --max-steps N).
set -euo pipefail
: "${SMOLLM2_GGUF:?set SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf}"
: "${OUT:?set OUT to the folder that receives the results}"
KEEP="${SMOLLM2_KEEP:-$HOME/smollm2}"
mkdir -p "$OUT"
# The GGUF's converted model folder (eagle_mm.hf.gguf) goes outside the checkout and outside $OUT.
export EAGLE_MM_CACHE="${EAGLE_MM_CACHE:-${TMPDIR:-/tmp}/eagle_mm_cache}"
# Progress bars at most every 20 s, and none on the console (recipe.log keeps them): a bar redrawn a thousand
# times would push everything else out of the output's tail.
export TQDM_MININTERVAL=20 TRANSFORMERS_VERBOSITY=warning TOKENIZERS_PARALLELISM=false
status=0
# recipe.py fits its whole run into --budget seconds; the timeout only guards against a hang.
timeout --signal=INT "${TIMEOUT:-412}" "${PYTHON:-python3}" scripts/smollm2/recipe.py --gguf "$SMOLLM2_GGUF" \
    --out "$OUT" --budget "${BUDGET:-395}" "$@" 2>&1 | tee "$OUT/recipe.log" \
    | { tr '\r' '\n' | grep -Ev '(it/s|s/it)[],]' || true; } || status=$?
if [ -f "$OUT/eagle3/model.safetensors" ]; then
    # The device machine empties $OUT before its next command: gpu_eval.sh reads the head from here.
    rm -rf "$KEEP" && mkdir -p "$KEEP" && cp -r "$OUT/eagle3" "$OUT/manifest.json" "$KEEP/"
    # Files come back from the GPU machine at most 16 MiB each: the head's weights travel in 15 MiB parts
    # (install_head.py joins them; model.safetensors.sha256 checks the result).
    (cd "$OUT/eagle3" && sha256sum model.safetensors > model.safetensors.sha256 \
        && split -b 15M -d model.safetensors model.safetensors.part- && rm model.safetensors)
fi
# At most 8 files come back: the trainer's config and log, its held-out evaluation (when recipe.json's eval_holdout asks
# for one) and the answers travel as one archive (manifest.json, recipe.log, details.tar.gz and eagle3/'s config,
# sha256 and two or three parts stay within it).
(cd "$OUT" && details=$(ls train_config.json train_log.jsonl eval.json regenerated.jsonl.gz 2>/dev/null) \
    && [ -n "$details" ] && tar -czf details.tar.gz $details && rm $details) || true
ls -la "$OUT" "$OUT/eagle3" "$KEEP" 2>/dev/null || true
exit "$status"
