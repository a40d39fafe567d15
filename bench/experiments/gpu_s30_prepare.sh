#!/usr/bin/env bash
# The CPU machine's half of gpu_s30_run.sh (issue #19, session 30): a kernel change in the
# working tree checked against the shipped kernel, HEAD's. HEAD's tree is unpacked into .s28
# with its cubins in .s28/.kcache, the tuner's wheels go into .whl, and every cubin the call
# needs into .kcache (sm_90a, here: the device then compiles only the Triton pre-pass). Session
# 30 ran it at 19f3d9b with its kernel change applied as a patch (landed in the next commit).
#   bash bench/experiments/gpu_s30_prepare.sh
# then: carry .kcache .whl .s28;  CALL_LIMIT=540 OUT=$OUT bash bench/experiments/gpu_s30_run.sh
# (.kcache/, .whl/ and .s28/ belong in .git/info/exclude, so that nothing commits them)
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .s28 && mkdir -p .s28/.kcache
git archive HEAD | tar -x -C .s28
# optuna and what it needs that the GPU image lacks, at the versions installed here
# (for this Python and for the GPU image's, 3.12: bench/experiments/gpu_env.sh takes the ones
# that install there)
mkdir -p .whl
pins=$(python3 -c "
import importlib.metadata as m
for p in ('optuna', 'sqlalchemy', 'alembic', 'colorlog', 'mako', 'markupsafe', 'pyyaml', 'tqdm'):
    print(f'{p}=={m.version(p)}')")
python3 -m pip download -q --no-deps -d .whl $pins
python3 -m pip download -q --no-deps -d .whl --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 $pins
check=bench/experiments/gpu_s30_check.py
PYTHONPATH=$PWD/.s28 TILEGEN_CACHE_DIR=$PWD/.s28/.kcache python3 $check --role ref --prebuild &
export TILEGEN_CACHE_DIR=$PWD/.kcache
python3 $check --role new --prebuild
wait
space=(--space kv_copies=tma,bulk --space consumers=1 --space kv_tile=128
       --space pingpong=false --space persistent=false --space q_in_kernel=true,false)
python3 bench/experiments/prebuild_cuda_space.py int8_fp8 0 2 "${space[@]}" > /tmp/s30_prebuild0.log &
python3 bench/experiments/prebuild_cuda_space.py int8_fp8 1 2 "${space[@]}" > /tmp/s30_prebuild1.log
wait
grep -h "feasible" /tmp/s30_prebuild0.log
python3 bench/experiments/h200_quant_op.py --backend cuda --prebuild \
    --variants "q_in_kernel=1;q_in_kernel=1,kv_copies=bulk"
# the shipped winners' cubins (the sweep's 16-bit CUDA row among them), with lse and without
python3 bench/experiments/prebuild_cuda_winners.py
du -sh .kcache .whl .s28
