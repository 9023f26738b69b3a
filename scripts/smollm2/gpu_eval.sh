#!/usr/bin/env bash
# bench/bench_real.py on the SmolLM2-135M-Instruct head that gpu_train.sh kept on the same warm machine, within a hard
# budget of script time; $OUT/real.json (rewritten after every prompt, so a cut run keeps what it measured) and
# $OUT/eval.log.
# Run from the repository root, with the gguf package importable:
#   T0=$(date +%s) SMOLLM2_GGUF=~/gguf/SmolLM2-135M-Instruct.Q4_1.gguf OUT=/some/dir bash scripts/smollm2/gpu_eval.sh
# T0 (epoch seconds, default now) is when the call began, so that what ran before this script counts too; BUDGET
# (default 400) is the call's seconds from T0. Extra arguments go to bench_real.py (--humaneval FILE, --phases ...).
set -uo pipefail
: "${SMOLLM2_GGUF:?set SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf}"
: "${OUT:?set OUT to the folder that receives the results}"
T0="${T0:-$(date +%s)}"
END=$((T0 + ${BUDGET:-400}))
KEEP="${SMOLLM2_KEEP:-$HOME/smollm2}"
mkdir -p "$OUT"
if [ ! -f "$KEEP/eagle3/model.safetensors" ]; then
    echo "error: no head in $KEEP/eagle3 (gpu_train.sh keeps it there)"
    exit 2
fi
# The converted GGUF that gpu_train.sh left in the same cache (else this call converts it again, about 10 s).
export EAGLE_MM_CACHE="${EAGLE_MM_CACHE:-${TMPDIR:-/tmp}/eagle_mm_cache}"
export TQDM_MININTERVAL=20 TRANSFORMERS_VERBOSITY=warning TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
cp "$KEEP/manifest.json" "$OUT/train_manifest.json" 2>/dev/null || true
# bench_real.py starts no prompt that would end past its deadline (20 s before the end: its last write); the timeout
# (8 s before the end, then a kill 5 s later) stops a call that hangs, and real.json still holds every finished prompt.
timeout --signal=INT -k 5 "$((END - 8 - $(date +%s)))" "${PYTHON:-python3}" \
    bench/bench_real.py --gguf "$SMOLLM2_GGUF" --head "$KEEP/eagle3" --deadline "$((END - 20))" \
    --accept-cap "${ACCEPT_CAP:-100}" --out "$OUT/real.json" "$@" 2>&1 | tee "$OUT/eval.log" \
    | { tr '\r' '\n' | grep -Ev '(it/s|s/it)[],]' || true; }
status=$?
echo "gpu_eval.sh: $(( $(date +%s) - T0 )) s since T0, exit $status"
ls -la "$OUT"
exit "$status"
