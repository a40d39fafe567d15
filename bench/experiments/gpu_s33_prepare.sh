#!/usr/bin/env bash
# The CPU machine's half of gpu_s33_run.sh: session 32's preparation (the tuner's wheels, the
# cubins of the check, the tune, the small checks and the shipped winners), then the S-ahead
# probes' cubins (gpu_s32_probes.py --set 3) with s33_s_ahead.patch applied, which is reverted
# after (the device applies it again for the probes only).
#   bash bench/experiments/gpu_s33_prepare.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
bash bench/experiments/gpu_s32_prepare.sh
export TILEGEN_CACHE_DIR=$PWD/.kcache
git apply bench/experiments/s33_s_ahead.patch
trap 'git apply -R bench/experiments/s33_s_ahead.patch' EXIT
python3 bench/experiments/gpu_s32_probes.py --set 3 --prebuild
du -sh .kcache
