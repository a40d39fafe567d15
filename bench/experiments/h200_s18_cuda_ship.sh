#!/usr/bin/env bash
# Question: Which point of the CUDA family's wgmma space wins the default spec on this GPU, and
# does the shipped default then beat the Gluon winner across the sparsity sweep and on a
# 12-head model? (issue #20, items 4 and the speed bar)
#
# Run on the GPU machine from the repo root, after h200_s17_wgmma.py passed its checks:
#
#   OUT=/some/dir bash bench/experiments/h200_s18_cuda_ship.sh [tune|bench|all]
#
# tune:  every feasible point of [tunable.cuda] (targets/sm_90/target.toml: 31 of 144 for the
#        bf16 spec since session 20; grid sampler over all 144, the infeasible ones pruned
#        before rendering), gated on 2 synthetic captures
#        with outlier heads, the winner merged into tuning_db/winners.json (a copy in $OUT).
# bench: `tilegen bench --sweep --backends cuda,gluon` (the tuned default, each family's
#        winner, the reference, FlexAttention; 8-bit and dense rows left out), then the
#        12-head 720p model at TOPK 31, 78, 187.
# Cubins prebuilt on a CPU (`h200_s17_wgmma.py --prebuild-space`) and carried in
# $TILEGEN_CACHE_DIR skip nvcc; optuna/SQLAlchemy/alembic come as wheels in .whl.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/cuda_ship}
WHAT=${1:-all}
mkdir -p "$OUT"
. bench/experiments/gpu_env.sh
export TILEGEN_DB=$OUT/tuning.sqlite TILEGEN_CACHE_DIR=${TILEGEN_CACHE_DIR:-/tmp/tgc}

if [ "$WHAT" = tune ] || [ "$WHAT" = all ]; then
    SECONDS=0
    python3 -m tilegen.cli tune --backend cuda --sampler grid --trials 144 --seeds 2 \
        --export tuning_db/winners.json --summary "$OUT/summary_cuda.json" 2>&1 \
        | tee "$OUT/tune_cuda.log"
    echo "cuda family: ${SECONDS} s" | tee -a "$OUT/tune_cuda.log"
    cp tuning_db/winners.json "$OUT/winners.json"
    TILEGEN_DB=/nonexistent/tuning.sqlite python3 - <<'PY' | tee -a "$OUT/tune_cuda.log"
import sys
sys.modules["sqlalchemy"] = None
import tilegen
print(f"tilegen.load(Spec()) from the shipped winners alone: {tilegen.load(tilegen.Spec())!r}")
print(f"tilegen.load(Spec(), backend='cuda'): {tilegen.load(tilegen.Spec(), backend='cuda')!r}")
PY
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
    SECONDS=0
    python3 -m tilegen.cli bench --sweep --backends cuda,gluon --quant none --no-dense \
        --json "$OUT/bench_sweep.json" --plot "$OUT/bench_sweep.png" 2>&1 | tee "$OUT/bench.log"
    python3 -m tilegen.cli bench --grid 21,45,80 --heads 12 --topk 31,78,187 \
        --backends cuda,gluon --quant none --no-dense --no-flex \
        --json "$OUT/bench_720p_h12.json" 2>&1 | tee -a "$OUT/bench.log"
    echo "bench: ${SECONDS} s" | tee -a "$OUT/bench.log"
fi
