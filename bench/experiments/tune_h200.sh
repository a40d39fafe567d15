#!/usr/bin/env bash
# Question: What is the tuned winner of the default spec on one H200 (shipped in tuning_db/)?
# (issue #3)
#
# Tune the default spec (Wan2.2 VSA fine stage, q (1,39936,40,128) bf16) on one H200 and export
# the winners to tuning_db/winners.json, which tilegen ships so that a fresh install on an H200
# uses them with no tuning.
#
# Usage (from anywhere; extra arguments go to `tilegen tune`):
#   bench/experiments/tune_h200.sh                                   # 40 trials, 2 synthetic captures
#   CAPTURES=/data/captures bench/experiments/tune_h200.sh           # real capture files (+ the outlier one)
#   bench/experiments/tune_h200.sh --space num_stages=1,2,3,4,5      # widen a range for this run
#
# Environment:
#   OUT_DIR   where the DB, the Optuna storage, the logs, the summary and the plot go
#             (default: $OUT if set, else out/tune_h200). Re-running with the same OUT_DIR
#             resumes the study instead of starting over.
#   TRIALS    trials in the study (default 40); CAPTURES (default synthetic); SEEDS (default 2)
#   WHEELS    folder of wheels for a machine without optuna/sqlalchemy (default .whl): when it
#             exists they are installed with pip --no-index --no-deps into /tmp/site.
#
# Results: $OUT_DIR/summary.json (wall time, trial counts, best config, speedups over the
# target default and the reference variant, all from this run), $OUT_DIR/tune.log (progress
# and the final table), $OUT_DIR/history.png (if matplotlib is installed),
# $OUT_DIR/winners.json (a copy of tuning_db/winners.json).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT_DIR=${OUT_DIR:-${OUT:-out/tune_h200}}
TRIALS=${TRIALS:-40}
CAPTURES=${CAPTURES:-synthetic}
SEEDS=${SEEDS:-2}
WHEELS=${WHEELS:-.whl}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"

if [ -d "$WHEELS" ] && ! "$PY" -c "import optuna, sqlalchemy" 2>/dev/null; then
    "$PY" -m pip install --quiet --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export TILEGEN_DB=$OUT_DIR/tuning.sqlite

"$PY" - <<'EOF'
import torch, triton
print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
EOF

SECONDS=0
set +e
"$PY" -m tilegen.tune.cli tune --trials "$TRIALS" --captures "$CAPTURES" --seeds "$SEEDS" \
    --export tuning_db/winners.json --summary "$OUT_DIR/summary.json" \
    --plot "$OUT_DIR/history.png" "$@" 2>&1 | tee "$OUT_DIR/tune.log"
rc=${PIPESTATUS[0]}
set -e
echo "tune_h200: exit $rc, wall ${SECONDS} s (process start to exit)" | tee -a "$OUT_DIR/tune.log"
[ -f tuning_db/winners.json ] && cp tuning_db/winners.json "$OUT_DIR/winners.json"

# The shipped export alone (no DB, no SQLAlchemy) must give the op its winner on this device.
TILEGEN_DB=/nonexistent/tuning.sqlite "$PY" - <<'EOF' | tee -a "$OUT_DIR/tune.log"
import sys
sys.modules["sqlalchemy"] = None
import tilegen
op = tilegen.load(tilegen.Spec())
print(f"tilegen.load(Spec()) without the DB: {op!r}")
EOF
exit "$rc"
