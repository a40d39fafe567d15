#!/usr/bin/env bash
# Session 33 (issue #19), one device call. On an H200: the pre-pass against the card's copy
# rate (gpu_s33_prepass.py), then session 32's call (gpu_s32_run.sh: the padded-rows fix
# applied first, the check, the tune over the linear P, the small checks, the sweep). On another
# card (run 2 was the H100's pre-pass): one and two consumers with the linear P at TOPK 31 and
# 187.
# Before the call, on the CPU machine: bash bench/experiments/gpu_s32_prepare.sh, once on this
# tree and once with s31_padded_rows.patch applied (both source states' cubins in .kcache).
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
    PADDED_PATCH=bench/experiments/s31_padded_rows.patch CALL_LIMIT=$((CALL_LIMIT - SECONDS)) \
        OUT="$OUT" bash bench/experiments/gpu_s32_run.sh
else
    # not the bar's card: the H100 winner's choice across TOPKs (its tune saw TOPK 78 only,
    # where one and two consumers came level; session 32's sweep read two consumers behind at
    # TOPK 31)
    echo "GPU: $gpu"
    export TILEGEN_CACHE_DIR=$PWD/.kcache
    for topk in 31 187; do
        timeout 150 python3 bench/experiments/gpu_s32_bits.py --only "1c K2 V3 linear,2c K2 V2 linear" \
            --seeds "" --topk $topk --out "$OUT/topk$topk.json" > "$OUT/topk$topk.log" 2>&1
        echo "TOPK $topk: rc $? at $SECONDS s"
        sed -n '/^| variant/,$p' "$OUT/topk$topk.log"
    done
fi
