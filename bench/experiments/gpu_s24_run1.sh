#!/usr/bin/env bash
# Session 24, device run 1 (issue #22): the THW layer's selection from the pre-pass's own pooling
# and the scores on the tensor cores (gpu_s24_select.py: checks, pieces, the layer old and new),
# then the Wan step as in session 23's run 3 (compiled rows: dense, bf16, int8_fp8, dense again).
#   carry .kcache .whl .whl_wan;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s24_run1.sh
set -uo pipefail
OUT=${OUT:-out/s24_run1}
mkdir -p "$OUT"
source bench/experiments/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
if [[ "${SELECT:-1}" = 1 ]]; then  # SELECT=0: the step alone
    timeout 150 python3 bench/experiments/gpu_s24_select.py --out "$OUT/select.json" \
        > "$OUT/select.log" 2>&1
    echo "select rc $?"; grep -E "^check|^\| " "$OUT/select.log" | cut -c1-160
fi
[[ "${STEP:-1}" = 1 ]] || exit 0
source bench/experiments/gpu_wan_env.sh
timeout ${WAN_TIMEOUT:-200} python3 bench/experiments/h200_wan_step.py --out "$OUT/wan_step.json" \
    --no-graph --no-eager --reps ${REPS:-3} > "$OUT/wan_step.log" 2>&1
echo "wan rc $?"
grep -E "^\| |^speedup|^check|^thw|compile failed|_compiled" "$OUT/wan_step.log" | cut -c1-200 | head -40
