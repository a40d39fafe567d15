#!/usr/bin/env bash
# The CPU machine's half of gpu_s35_run.sh (issue #19, session 35): a fresh .kcache (the 8-bit
# header changed, so every 8-bit cubin has a new key), session 32's preparation (the tuner's
# wheels, its space, the small checks, the shipped winners), the dynamic-schedule space's points
# (gpu_s35_space.sh) and the fixed-cost probe's variants (gpu_s35_fixed.py).
#   bash bench/experiments/gpu_s35_prepare.sh
# then: carry .kcache .whl;  CALL_LIMIT=540 OUT=$OUT bash bench/experiments/gpu_s35_run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .kcache
bash bench/experiments/gpu_s32_prepare.sh
export TILEGEN_CACHE_DIR=$PWD/.kcache
source bench/experiments/gpu_s35_space.sh
python3 bench/experiments/prebuild_cuda_space.py int8_fp8 0 2 "${SPACE_DYN[@]}" > /tmp/s35_prebuild0.log &
python3 bench/experiments/prebuild_cuda_space.py int8_fp8 1 2 "${SPACE_DYN[@]}" > /tmp/s35_prebuild1.log
wait
grep -h "feasible" /tmp/s35_prebuild0.log
python3 bench/experiments/gpu_s35_fixed.py --prebuild
du -sh .kcache .whl
