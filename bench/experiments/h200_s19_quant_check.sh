#!/usr/bin/env bash
# Question: does the CUDA 8-bit kernel (issue #19) pass its checks after session 18's swizzle-atom
# fix, and how fast are its 1- and 2-consumer variants against the Gluon 8-bit op and the bf16
# default op, pre-pass included? The small checks run first; the full run only if they pass.
#
#   OUT=/some/dir TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/h200_s19_quant_check.sh
# (cubins prebuilt on a CPU: h200_quant_op.py --backend cuda --prebuild --variants "$VARIANTS")
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/q8}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
VARIANTS=${VARIANTS:-'consumers=2,pingpong=1,k_stages=2,v_stages=2;consumers=2,pingpong=0,k_stages=2,v_stages=2;consumers=1,k_stages=4,v_stages=3;consumers=2,pingpong=1,k_stages=3,v_stages=3'}
timeout 200 python3 bench/experiments/h200_quant_op.py --backend cuda --small-only \
    --out "$OUT/q8_small.json" > "$OUT/q8_small.log" 2>&1
tail -14 "$OUT/q8_small.log"
if ! grep -q "checks passed: \([0-9]*\)/\1$" "$OUT/q8_small.log"; then
    echo "small checks did not all pass: no full run"; exit 1
fi
timeout "${FULL_TIMEOUT:-400}" python3 bench/experiments/h200_quant_op.py --backend cuda \
    --topks 78 --variants "$VARIANTS" --out "$OUT/q8_full.json" > "$OUT/q8_full.log" 2>&1
echo "full run rc $?"
grep -E "^\{'topk'" "$OUT/q8_full.log" | cut -c1-400
tail -40 "$OUT/q8_full.log"
