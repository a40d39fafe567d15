#!/usr/bin/env bash
# Session 21, run 6 (issue #19): where the one-consumer 8-bit kernel's warps wait, per SASS
# instruction: Nsight Compute's warp-state samples by source line (SourceCounters) on one launch
# of the default 8-bit kernel (h200_s19_q8_cvt.py --ncu default), exported as CSV.
#   carry .kcache;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s21_ncu_source.sh
set -uo pipefail
OUT=${OUT:-out/s21}
mkdir -p "$OUT"
source bench/experiments/gpu_env.sh
S=bench/experiments/h200_s19_q8_cvt.py
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 ncu -k regex:int8_fp8_bm64 --launch-skip 2 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --section SpeedOfLight \
    --import-source no -o "$OUT/q8_default" python3 $S --ncu default > "$OUT/ncu.log" 2>&1
echo "ncu rc $?"; tail -n 3 "$OUT/ncu.log"
ncu -i "$OUT/q8_default.ncu-rep" --page source --print-source sass --csv 2>/dev/null \
    | gzip > "$OUT/q8_default_sass.csv.gz"
ncu -i "$OUT/q8_default.ncu-rep" --page details --csv > "$OUT/q8_default_details.csv" 2>/dev/null
ls -la "$OUT"
