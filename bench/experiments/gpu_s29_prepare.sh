#!/usr/bin/env bash
# The CPU machine's half of gpu_s29_run.sh (issue #19, session 29), from a clean checkout of
# main: session 28's two headers into .s28_headers (the reference kernel), the bookkeeping
# patch applied to the working tree (not committed: it lands only once a device has checked it
# and re-tuned the 8-bit winner), the tuner's wheels into .whl and every cubin the call needs
# into .kcache (sm_90a, here: the device then compiles only the Triton pre-pass).
#   bash bench/experiments/gpu_s29_prepare.sh
# then: carry .kcache .whl;  CALL_LIMIT=540 OUT=$OUT bash bench/experiments/gpu_s29_run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
headers=templates/cuda/include/tilegen/cuda/sm90
mkdir -p .s28_headers
for f in wgmma.cuh lut_attention_8bit.cuh; do git show "HEAD:$headers/$f" > ".s28_headers/$f"; done
if git apply --check bench/experiments/s29_bookkeeping.patch 2>/dev/null; then
    git apply bench/experiments/s29_bookkeeping.patch
else
    git apply --reverse --check bench/experiments/s29_bookkeeping.patch  # applied already
fi
# optuna and what it needs that the GPU image lacks, at the versions installed here
mkdir -p .whl
python3 -m pip download -q --no-deps -d .whl $(python3 -c "
import importlib.metadata as m
for p in ('optuna', 'sqlalchemy', 'alembic', 'colorlog', 'mako', 'markupsafe', 'pyyaml', 'tqdm'):
    print(f'{p}=={m.version(p)}')")
export TILEGEN_CACHE_DIR=$PWD/.kcache
python3 bench/experiments/gpu_s29_bookkeeping.py --prebuild
space=(--space kv_copies=tma,bulk --space consumers=1,2 --space kv_tile=128
       --space pingpong=false --space persistent=false)
python3 bench/experiments/prebuild_cuda_space.py int8_fp8 0 2 "${space[@]}" > /tmp/s29_prebuild0.log &
python3 bench/experiments/prebuild_cuda_space.py int8_fp8 1 2 "${space[@]}" > /tmp/s29_prebuild1.log
wait
python3 bench/experiments/h200_quant_op.py --backend cuda --prebuild --variants kv_copies=bulk
python3 bench/experiments/gpu_s27_probe.py --prebuild --set bulk
# the shipped winners' cubins (the sweep's 16-bit CUDA row among them), with lse and without
python3 - <<'EOF'
import json

import tilegen
from tilegen.backends.cuda.nvcc import compile_cuda
from tilegen.config import KernelConfig
from tilegen.spec import Spec
from tilegen.targets import get_target

doc = json.load(open("tuning_db/winners.json"))
specs = {w["spec_hash"]: w["spec"] for w in doc["workloads"]}
configs = {c["variant"]["config"]: c["config"] for c in doc["candidates"]}
target = get_target("sm_90")
for w in doc["winners"]:
    if w["variant"]["backend"] != "cuda":
        continue
    op = tilegen.load(Spec.from_dict(specs[w["spec_hash"]]),
                      KernelConfig.from_dict(configs[w["variant"]["config"]]), backend="cuda",
                      target="sm_90")
    for lse in (True, False):
        run = op._launch_for(lse)
        compile_cuda(run.source, target, None, run.digest)
    print(f"prebuilt the {w['device_name']} winner {w['variant']['config']}")
EOF
du -sh .kcache .whl
