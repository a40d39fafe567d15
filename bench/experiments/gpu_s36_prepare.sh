#!/usr/bin/env bash
# The CPU machine's half of gpu_s36_run.sh (issue #19, session 36): session 35's preparation
# (a fresh .kcache, the tuner's wheels, the tune's space, the shipped winners), then the load
# probes' cubins (gpu_s32_probes.py --set 4) with s36_load_probes.patch applied, and the
# wait-hint probes' (--set 5) with s36_wait_hint.patch, each reverted after (the device applies
# them again for the probes only). SKIP_S35=1: only the probes' cubins.
#   bash bench/experiments/gpu_s36_prepare.sh
# then: carry .kcache .whl;  CALL_LIMIT=540 OUT=$OUT bash bench/experiments/gpu_s36_run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
[[ "${SKIP_S35:-0}" == 1 ]] || bash bench/experiments/gpu_s35_prepare.sh
export TILEGEN_CACHE_DIR=$PWD/.kcache
# each probe set's cubins with its patch applied; the patch is reverted even if a build fails
for set_and_patch in "4 s36_load_probes" "5 s36_wait_hint"; do
    read -r probe_set name <<< "$set_and_patch"
    patch_file=bench/experiments/$name.patch
    git apply "$patch_file"
    trap 'git apply -R "$patch_file"' EXIT
    python3 bench/experiments/gpu_s32_probes.py --set "$probe_set" --prebuild
    git apply -R "$patch_file"
    trap - EXIT
done
du -sh .kcache
