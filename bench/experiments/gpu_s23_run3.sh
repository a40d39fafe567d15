#!/usr/bin/env bash
# Session 23, device run 3 (issue #22): the Wan step as in runs 1 and 2 with the top-k's early
# stop and Q quantized by the prologue (checked against the pre-pass's Q on the GPU), compiled
# rows only (dense, bf16, int8_fp8, dense again), REPS repetitions each (default 3), no profile:
# the session's last device minutes.
#   carry .kcache .whl .whl_wan;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s23_run3.sh
set -uo pipefail
OUT=${OUT:-out/s23_run3}
mkdir -p "$OUT"
source bench/experiments/gpu_env.sh
if ! python3 -c "import diffusers" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/wan .whl_wan/diffusers-*.whl
    export PYTHONPATH=/tmp/wan:$PYTHONPATH
    if ! python3 -c "import diffusers.models" 2>/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/wan .whl_wan/huggingface_hub-*.whl
    fi
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
timeout ${WAN_TIMEOUT:-170} python3 bench/experiments/h200_wan_step.py --out "$OUT/wan_step.json" --no-graph \
    --no-eager --reps ${REPS:-3} > "$OUT/wan_step.log" 2>&1
echo "wan rc $?"
grep -E "^\| |^speedup|^check|^thw|^prologue|compile failed|_compiled" "$OUT/wan_step.log" | cut -c1-160 | head -40
