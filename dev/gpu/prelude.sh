# Sourced by the A/B run scripts (ab_run.sh, ab2_run.sh, ab4_run.sh) after `set -u`, with OUT set: makes OUT,
# goes to the repository root (R), and defines log (OUT/steps.log) and G (the GPU work's cores, 2-15; the CPU work
# beside it takes 0-1).
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
R=$PWD
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
log() { echo "$(date -u +%T) $*" | tee -a "$OUT/steps.log"; }
G="taskset -c 2-15"
