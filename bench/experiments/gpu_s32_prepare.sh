#!/usr/bin/env bash
# The CPU machine's half of gpu_s32_run.sh (issue #19, session 32): the tuner's wheels into .whl
# and every cubin the call needs into .kcache (sm_90a, here: the device compiles only the
# Triton pre-pass): gpu_s32_bits.py's variants, the tune's space, the small checks' variants and
# the shipped CUDA winners.
#   bash bench/experiments/gpu_s32_prepare.sh
# then: carry .kcache .whl;  CALL_LIMIT=540 OUT=$OUT bash bench/experiments/gpu_s32_run.sh
# (.kcache/ and .whl/ belong in .git/info/exclude, so that nothing commits them)
set -euo pipefail
cd "$(dirname "$0")/../.."
# optuna and what it needs that the GPU image lacks, for this Python and the image's (3.12)
mkdir -p .whl
pins=$(python3 -c "
import importlib.metadata as m
for p in ('optuna', 'sqlalchemy', 'alembic', 'colorlog', 'mako', 'markupsafe', 'pyyaml', 'tqdm'):
    print(f'{p}=={m.version(p)}')")
python3 -m pip download -q --no-deps -d .whl $pins
python3 -m pip download -q --no-deps -d .whl --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 $pins
export TILEGEN_CACHE_DIR=$PWD/.kcache
python3 bench/experiments/gpu_s32_bits.py --prebuild &
source bench/experiments/gpu_s32_space.sh
python3 bench/experiments/prebuild_cuda_space.py int8_fp8 0 2 "${SPACE[@]}" > /tmp/s32_prebuild0.log &
python3 bench/experiments/prebuild_cuda_space.py int8_fp8 1 2 "${SPACE[@]}" > /tmp/s32_prebuild1.log
wait
grep -h "feasible" /tmp/s32_prebuild0.log
python3 bench/experiments/h200_quant_op.py --backend cuda --prebuild --variants "$SMALL_VARIANTS"
# the shipped winners' cubins (the sweep's 16-bit CUDA row among them), with lse and without
python3 bench/experiments/prebuild_cuda_winners.py
du -sh .kcache .whl
