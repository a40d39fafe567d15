#!/usr/bin/env bash
# Session 22, device run 5: on an H200, the CUDA family tuned for the bf16 default and the sweep with
# the 8-bit rows (gpu_s21_ship.sh, TUNE_8BIT=0: issues #20, #19); on another GPU, the Wan step
# with one compiled step of dense and of the 8-bit layer profiled by kernel (issue #22: where a
# sparse layer's 6.56 ms in the model go, against 5.98 alone).
#   carry .kcache .whl .whl_wan;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s22_run4.sh
set -uo pipefail
OUT=${OUT:-out/s22_run4}
mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
if [[ "$gpu" == *H200* && "${WAN:-0}" != 1 ]]; then
    TUNE_8BIT=0 bash bench/experiments/gpu_s21_ship.sh
else
    WAN_ARGS="--profile" timeout 480 bash bench/experiments/gpu_s21_wan.sh > "$OUT/wan_run.log" 2>&1
    echo "wan rc $?"; grep -E "^profile|^   |^\| |^speedup|^check|^thw" "$OUT/wan_run.log" | cut -c1-220 | head -90
fi
