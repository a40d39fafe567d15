#!/usr/bin/env bash
# Session 24: one call for whichever GPU comes. An H200: issue #22's step (gpu_s24_h200.sh,
# WHAT=wan, SELECT=0); any other: the pre-pass and scores variants (gpu_s24_prepass.py).
#   carry .kcache .whl .whl_wan;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s24_any.sh
set -uo pipefail
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "$gpu"
if [[ "$gpu" == *H200* ]]; then
    SELECT=0 WHAT=wan bash bench/experiments/gpu_s24_h200.sh
else
    source bench/experiments/gpu_env.sh
    timeout 150 python3 bench/experiments/gpu_s24_prepass.py --out "$OUT/prepass.json" \
        > "$OUT/prepass.log" 2>&1
    echo "prepass rc $?"; grep -E "^equal|^\| " "$OUT/prepass.log"
fi
