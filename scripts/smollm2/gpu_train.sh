#!/usr/bin/env bash
# GPU call 1 of the SmolLM2-135M-Instruct recipe (about 7 of its 9 minutes on one H200): the target's own answers
# to scripts/smollm2/prompts.jsonl.gz, the EAGLE-3 head trained on them, packaged under $OUT with manifest.json.
# Run from the repository root, with the gguf package importable:
#   SMOLLM2_GGUF=~/gguf/SmolLM2-135M-Instruct.Q4_1.gguf OUT=/some/dir bash scripts/smollm2/gpu_train.sh
# Extra arguments go to recipe.py (--dry-run: every stage at a tiny scale, a CPU check; --max-steps N).
set -euo pipefail
: "${SMOLLM2_GGUF:?set SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf}"
: "${OUT:?set OUT to the folder that receives the results}"
mkdir -p "$OUT"
# The GGUF's converted model folder (eagle_mm.target.gguf) goes outside the checkout and outside $OUT.
export EAGLE_MM_CACHE="${EAGLE_MM_CACHE:-${TMPDIR:-/tmp}/eagle_mm_cache}"
# Progress bars at most every 20 s, and none on the console (recipe.log keeps them): a bar redrawn a thousand
# times would push everything else out of the output's tail.
export TQDM_MININTERVAL=20 TRANSFORMERS_VERBOSITY=warning TOKENIZERS_PARALLELISM=false
status=0
# recipe.py fits its training into --budget seconds; the timeout only guards against a hang.
timeout --signal=INT "${TIMEOUT:-525}" "${PYTHON:-python3}" scripts/smollm2/recipe.py --gguf "$SMOLLM2_GGUF" \
    --out "$OUT" --budget "${BUDGET:-465}" "$@" 2>&1 | tee "$OUT/recipe.log" \
    | { tr '\r' '\n' | grep -Ev '(it/s|s/it)[],]' || true; } || status=$?
# Files come back from the GPU machine at most 16 MiB each: the head's weights travel in 15 MiB parts
# (join them with `cat model.safetensors.part-* > model.safetensors`; model.safetensors.sha256 checks the result).
if [ -f "$OUT/eagle3/model.safetensors" ]; then
    (cd "$OUT/eagle3" && sha256sum model.safetensors > model.safetensors.sha256 \
        && split -b 15M -d model.safetensors model.safetensors.part- && rm model.safetensors)
fi
ls -la "$OUT" "$OUT/eagle3" 2>/dev/null || true
exit "$status"
