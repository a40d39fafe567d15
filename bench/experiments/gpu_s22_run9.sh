#!/usr/bin/env bash
# Session 22, device run 9 (issues #19, #22): the pre-pass with its statistics from a launch of
# their own (then an option, `quantize_triton(..., stats_first=True)`; since the only path)
# beside the pass that computed them in every program, same process, same bytes checked by
# sha256 (gpu_s22_prepass.py as of commit 00769c5).
#   carry .kcache;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s22_run9.sh
set -uo pipefail
OUT=${OUT:-out/s22_run9}
mkdir -p "$OUT"
source bench/experiments/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python3 bench/experiments/gpu_s22_prepass.py --out "$OUT/prepass.json" > "$OUT/prepass.log" 2>&1
echo "rc $?"; grep -E "^sha|^\| " "$OUT/prepass.log" | cut -c1-260
