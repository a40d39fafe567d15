#!/usr/bin/env bash
# Session 37 (issue #19), one device call.
#   On an H200, first: gpu_s34_run.sh (the 8-bit tune over gpu_s32_space.sh's linear-P space,
#   exported to tuning_db/winners.json and copied out; then `tilegen bench --sweep --backends
#   cuda`, the issue's figure), within TUNE_LIMIT seconds.
#   Then, on any card: the sat-code and codes-early probes (gpu_s32_probes.py --set 6, s37_probes.patch
#   applied here only), and on a card other than the H200 gpu_s37_ncu_source.sh (per-SASS-
#   instruction stall samples of the 1c K2 V3 and 2c K2 V2 linear kernels).
# At most 8 files under $OUT. Before the call, on the CPU machine:
#   bash bench/experiments/gpu_s36_prepare.sh   (fresh .kcache, the tune's cubins), then
#   git apply bench/experiments/s37_probes.patch && TILEGEN_CACHE_DIR=$PWD/.kcache \
#     python3 bench/experiments/gpu_s32_probes.py --set 6 --prebuild; git apply -R ...
# Then: carry .kcache .whl;  CALL_LIMIT=560 OUT=$OUT bash bench/experiments/gpu_s37_run.sh
set -uo pipefail
OUT=${OUT:-out/s37_run}
mkdir -p "$OUT"
CALL_LIMIT=${CALL_LIMIT:-560}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "GPU: $gpu"
if [[ "$gpu" == *H200* ]]; then
    CALL_LIMIT=${TUNE_LIMIT:-420} OUT="$OUT" bash bench/experiments/gpu_s34_run.sh
fi
source bench/experiments/gpu_env.sh
export TILEGEN_CACHE_DIR=$PWD/.kcache
left=$((CALL_LIMIT - SECONDS))
if ((left > 90)); then
    git apply bench/experiments/s37_probes.patch 2>/dev/null \
        || patch -p1 < bench/experiments/s37_probes.patch
    timeout $((left - 10)) python3 bench/experiments/gpu_s32_probes.py --set 6 \
        --seeds 0 --out /tmp/probes.json > "$OUT/probes6.log" 2>&1
    echo "probes (set 6): rc $? at $SECONDS s"
    sed -n '/^bf16 default op:/,$p' "$OUT/probes6.log"
    grep -E "rel_l1 .* passed" "$OUT/probes6.log" | cut -c1-200
    git apply -R bench/experiments/s37_probes.patch 2>/dev/null \
        || patch -R -p1 < bench/experiments/s37_probes.patch
fi
left=$((CALL_LIMIT - SECONDS))
if [[ "$gpu" != *H200* ]] && ((left > 150)); then
    OUT="$OUT" timeout $((left - 10)) bash bench/experiments/gpu_s37_ncu_source.sh
fi
