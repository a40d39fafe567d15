#!/usr/bin/env bash
# Session 21 (issue #22): the Wan2.2-A14B-shaped step with the 8-bit layer on THW tokens
# (tilegen.ops.block_sparse_attention_8bit_thw), beside SDPA (cuDNN) and the bf16 layer; eager
# and regional compile. diffusers comes from wheels carried in .whl_wan (the image has none):
#   carry .kcache .whl_wan .whl;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s21_wan.sh
set -euo pipefail
source bench/experiments/gpu_env.sh
source bench/experiments/gpu_wan_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
python3 bench/experiments/h200_wan_step.py --out "$OUT/wan_step.json" --no-graph ${WAN_ARGS:-} 2>&1 \
    | tee "$OUT/wan_step.log"
