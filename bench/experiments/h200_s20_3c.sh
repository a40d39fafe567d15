#!/usr/bin/env bash
# Session 20 (issues #19, #20): the 8-bit kernel's small checks (LUT, partial cubes, counts,
# batch 2 with dead consumers past the grid, fp16, mask, a bad index) for $SMALL (knobs, as
# h200_quant_op.py --variants takes them: run 1 consumers=3, run 3 kv_tile=128), then
# h200_s19_q8_cvt.py's checks (the outlier head, check 4) and times of the 8-bit and bf16
# variants $Q8 and $BF16 beside the Gluon ops, one process.
#   OUT=/some/dir TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/h200_s20_3c.sh
# (cubins prebuilt on a CPU: h200_s19_q8_cvt.py --prebuild --only "$Q8" --bf16 "$BF16";
#  h200_quant_op.py --backend cuda --prebuild --variants "$SMALL")
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/s20}
mkdir -p "$OUT"
source bench/experiments/gpu_env.sh
Q8=${Q8:-default,kv64,3c,k128_2c}
BF16=${BF16:-bf16_default,bf16_3c_k2v1,bf16_3c_k1v1}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm --format=csv,noheader
timeout "${SMALL_LIMIT:-200}" python3 bench/experiments/h200_quant_op.py --backend cuda \
    --small-only --variants "${SMALL:-consumers=3}" --out "$OUT/q8_small.json" > "$OUT/q8_small.log" 2>&1
echo "small rc $?"; grep -A40 "^checks passed" "$OUT/q8_small.log" | head -24
timeout "${TIME_LIMIT:-330}" python3 bench/experiments/h200_s19_q8_cvt.py --only "$Q8" \
    --bf16 "$BF16" --out "$OUT/q8_3c.json" > "$OUT/q8_3c.log" 2>&1
echo "variants rc $?"; tail -24 "$OUT/q8_3c.log"
