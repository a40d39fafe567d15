#!/usr/bin/env bash
# Session 37 (issue #19), one device call: gpu_s36_run.sh with PROBE_SET=6 (on an H200 the
# 8-bit tune and the sweep, the figure; then, on any card, the codes-early and sat-code
# probes of s37_probes.patch, applied there only), then, on a card other than the H200,
# gpu_s37_ncu_source.sh (per-SASS-instruction stall samples of the 1c K2 V3 and 2c K2 V2 linear
# kernels) with the time left.
# At most 8 files under $OUT. Before the call, on the CPU machine:
#   bash bench/experiments/gpu_s36_prepare.sh   (fresh .kcache, the tune's cubins), then
#   git apply bench/experiments/s37_probes.patch && TILEGEN_CACHE_DIR=$PWD/.kcache \
#     python3 bench/experiments/gpu_s32_probes.py --set 6 --prebuild; git apply -R ...
# Then: carry .kcache .whl;  CALL_LIMIT=560 OUT=$OUT bash bench/experiments/gpu_s37_run.sh
set -uo pipefail
OUT=${OUT:-out/s37_run}
CALL_LIMIT=${CALL_LIMIT:-560}
PROBE_SET=6 TUNE_LIMIT=${TUNE_LIMIT:-420} CALL_LIMIT=$CALL_LIMIT OUT="$OUT" \
    bash bench/experiments/gpu_s36_run.sh
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
left=$((CALL_LIMIT - SECONDS))
if [[ "$gpu" != *H200* ]] && ((left > 150)); then
    OUT="$OUT" timeout $((left - 10)) bash bench/experiments/gpu_s37_ncu_source.sh
fi
