#!/usr/bin/env bash
# Session 33 (issue #19), one device call. On an H200: the pre-pass against the card's copy
# rate (gpu_s33_prepass.py), then session 32's call (gpu_s32_run.sh: the check, the tune
# over the linear P, the small checks, the sweep). On another
# card nothing, or with TOPK31_TUNE=1 the tune of the TOPK-31 workload
# (bench/specs/int8_fp8_topk31.toml; run 4). Run 2 was the H100's pre-pass probe, run 3 one and
# two consumers at TOPK 31 and 187 (`gpu_s32_bits.py --topk`).
# Before the call, on the CPU machine: bash bench/experiments/gpu_s32_prepare.sh.
# Then: carry .kcache .whl;  CALL_LIMIT=540 OUT=$OUT bash bench/experiments/gpu_s33_run.sh
set -uo pipefail
OUT=${OUT:-out/s33_run}
mkdir -p "$OUT"
CALL_LIMIT=${CALL_LIMIT:-540}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
source bench/experiments/gpu_env.sh
if [[ "$gpu" == *H200* ]]; then
    timeout 120 python3 bench/experiments/gpu_s33_prepass.py --out /tmp/prepass.json \
        > /tmp/prepass.log 2>&1
    echo "prepass: rc $? in $SECONDS s"
    sed -n '/moves/,$p' /tmp/prepass.log
    # without the padded-rows fix: a linear-P winner has finite padded rows already, and the
    # fix would make the H100's winners stale
    CALL_LIMIT=$((CALL_LIMIT - SECONDS)) OUT="$OUT" bash bench/experiments/gpu_s32_run.sh
elif [[ "${TOPK31_TUNE:-0}" == 1 ]]; then
    # another card, asked for (run 4): the H100's own 8-bit winner at TOPK 31 (run 3: one
    # consumer 5% ahead of two there, level at 78 and 187, where the TOPK-78 tune's pick is noise)
    echo "GPU: $gpu"
    source bench/experiments/gpu_s32_space.sh
    export TILEGEN_CACHE_DIR=$PWD/.kcache TILEGEN_DB=/tmp/s33db/tuning.sqlite
    mkdir -p /tmp/s33db
    timeout 300 python3 -m tilegen.cli tune --spec bench/specs/int8_fp8_topk31.toml \
        --backend cuda "${SPACE[@]}" --sampler grid --trials 12 --seeds 2 \
        --export tuning_db/winners.json > "$OUT/tune_topk31.log" 2>&1
    echo "tune int8_fp8 TOPK 31: rc $? at $SECONDS s"
    grep -E "^winner|^trials|merged" "$OUT/tune_topk31.log" | cut -c1-220
    sed -n '/^rank/,/^$/p' "$OUT/tune_topk31.log" | cut -c1-40,170-230
    cp tuning_db/winners.json "$OUT/winners.json"
else
    echo "GPU: $gpu: not an H200, nothing to run (TOPK31_TUNE=1: the TOPK-31 tune)"
fi
