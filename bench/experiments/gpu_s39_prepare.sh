#!/usr/bin/env bash
# The CPU machine's half of gpu_s39_run.sh (issue #19, session 39): session 35's preparation (a
# fresh .kcache, the tuner's wheels, the tune's space, the shipped winners), the small checks'
# two variants, then the stale-shift probes' cubins (gpu_s32_probes.py --set 8) with
# s39_stale_shift.patch applied and reverted (the device applies it again for the probes only).
# SKIP_S35=1: only the last two.
#   bash bench/experiments/gpu_s39_prepare.sh
# then: carry .kcache .whl;  [PROBE_SET=8] CALL_LIMIT=560 OUT=$OUT bash bench/experiments/gpu_s39_run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
[[ "${SKIP_S35:-0}" == 1 ]] || bash bench/experiments/gpu_s35_prepare.sh
export TILEGEN_CACHE_DIR=$PWD/.kcache
small=$(sed -n 's/^S39_SMALL=//p' bench/experiments/gpu_s39_run.sh | tr -d '"')
python3 bench/experiments/h200_quant_op.py --backend cuda --prebuild --variants "$small"
patch_file=bench/experiments/s39_stale_shift.patch
git apply "$patch_file"
trap 'git apply -R "$patch_file"' EXIT
python3 bench/experiments/gpu_s32_probes.py --set 8 --prebuild
git apply -R "$patch_file"
trap - EXIT
du -sh .kcache
