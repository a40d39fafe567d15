#!/usr/bin/env bash
# Question: Which kernel family wins the default spec on the H200 (the shipped winners)? (issues #7
# and #8)
#
# Tune every kernel family of the H200 target on the default spec and merge the winners into
# tuning_db/winners.json (tilegen ships it; `tilegen.load(Spec())` on an H200 then takes the
# fastest family's winner). Run on the GPU machine from the repo root:
#
#   OUT=/some/dir bash bench/experiments/h200_tune_all.sh
#
# The Triton family searches its whole space ([tunable] of targets/sm_90/target.toml, 40
# points); the Gluon family searches its ring depths and packing with the options measured best
# in bench/NOTES.md pinned (Q in registers, Q.K ahead, the P.V wait fence, one consumer per CTA),
# to fit the session's GPU time. Logs and a copy of the merged winners go to $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/tune_all}
mkdir -p "$OUT"
. bench/experiments/gpu_env.sh
export TILEGEN_DB=$OUT/tuning.sqlite TILEGEN_CACHE_DIR=${TILEGEN_CACHE_DIR:-/tmp/tgc}

SECONDS=0
python3 -m tilegen.cli tune --trials 40 --seeds 2 --export tuning_db/winners.json \
    --summary "$OUT/summary_triton.json" 2>&1 | tee "$OUT/tune_triton.log"
echo "triton family: ${SECONDS} s" | tee -a "$OUT/tune_triton.log"
SECONDS=0
python3 -m tilegen.cli tune --backend gluon --trials 12 --seeds 2 \
    --space num_consumers=1 --space q_in_regs=true --space qk_ahead=true \
    --space fence_wait=true --export tuning_db/winners.json \
    --summary "$OUT/summary_gluon.json" 2>&1 | tee "$OUT/tune_gluon.log"
echo "gluon family: ${SECONDS} s" | tee -a "$OUT/tune_gluon.log"
cp tuning_db/winners.json "$OUT/winners.json"

# The shipped file alone (no DB, no SQLAlchemy) must give the op its winner on this device.
TILEGEN_DB=/nonexistent/tuning.sqlite python3 - <<'EOF' | tee -a "$OUT/tune_gluon.log"
import sys
sys.modules["sqlalchemy"] = None
import tilegen
op = tilegen.load(tilegen.Spec())
print(f"tilegen.load(Spec()) from the shipped winners alone: {op!r}")
EOF
