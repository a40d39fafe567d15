#!/usr/bin/env bash
# Session 32 (issue #19), one device call: the 8-bit softmax's P without MUFU (p_exp "linear")
# and its row sum on the tensor cores (row_sum "mma"):
#   1. gpu_s32_bits.py: the variants checked (quantized rule, check 4 against the emulation of
#      each one's own P, lse against the oracle) and timed beside the bf16 default op;
#   2. the 8-bit kernel tuned on this card over gpu_s32_space.sh's space, exported to
#      tuning_db/winners.json and copied out;
#   3. h200_quant_op.py --small-only with the ex2 and the linear P (bulk, q_in_kernel);
#   4. on an H200, `tilegen bench --sweep` with that winner.
# At most 8 files under $OUT (the device tool returns no more).
# Before the call, on the CPU machine: bash bench/experiments/gpu_s32_prepare.sh
# Then: carry .kcache .whl;  CALL_LIMIT=540 OUT=$OUT bash bench/experiments/gpu_s32_run.sh
# (run 4 ran every gpu_s32_bits.py variant, as BITS_ONLY=all does; the default is the short list)
set -uo pipefail
OUT=${OUT:-out/s32_run}
mkdir -p "$OUT"
CALL_LIMIT=${CALL_LIMIT:-540}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "GPU: $gpu"
# On an H200 the padded-rows fix (s31_padded_rows.patch, landed in session 38 and deleted then:
# in git history) went in first, so that the winner tuned here could land with it.
if [[ "$gpu" == *H200* && -n "${PADDED_PATCH:-}" ]]; then
    git apply "$PADDED_PATCH" 2>/dev/null || patch -p1 < "$PADDED_PATCH" || exit 3
    echo "applied $PADDED_PATCH"
fi
source bench/experiments/gpu_env.sh
source bench/experiments/gpu_s32_space.sh
export TILEGEN_CACHE_DIR=$PWD/.kcache
mkdir -p /tmp/s32db
export TILEGEN_DB=/tmp/s32db/tuning.sqlite
start=$SECONDS
timeout 200 python3 bench/experiments/gpu_s32_bits.py --only "${BITS_ONLY:-short}" \
    --out /tmp/s32db/bits.json > "$OUT/bits.log" 2>&1
echo "bits: rc $? in $((SECONDS - start)) s"
sed -n '/^bf16 default op:/,$p' "$OUT/bits.log"
grep -E "rel_l1 .* passed" "$OUT/bits.log" | cut -c1-220
left=$((CALL_LIMIT - SECONDS))
if ((left > 100)); then
    start=$SECONDS
    timeout "$((left > 280 ? 190 : left - 90))" python3 -m tilegen.cli tune \
        --spec bench/specs/int8_fp8.toml --backend cuda "${SPACE[@]}" --sampler grid \
        --trials 20 --seeds 2 --export tuning_db/winners.json \
        --summary /tmp/s32db/summary.json > "$OUT/tune_int8_fp8.log" 2>&1
    echo "tune int8_fp8: rc $? in $((SECONDS - start)) s"
    grep -E "^winner|^trials|^speedup|merged" "$OUT/tune_int8_fp8.log" | cut -c1-220
    cp tuning_db/winners.json "$OUT/winners.json"
fi
left=$((CALL_LIMIT - SECONDS))
if ((left > 60)); then
    start=$SECONDS
    timeout "$((left > 240 ? 110 : left - 130 > 40 ? left - 130 : left - 10))" \
        python3 bench/experiments/h200_quant_op.py --backend cuda --small-only \
        --variants "$SMALL_VARIANTS" --out /tmp/s32db/quant_op.json > "$OUT/quant_op.log" 2>&1
    echo "quant_op (small; default, bulk + q_in_kernel, + linear P): rc $? in $((SECONDS - start)) s"
    grep -E "^checks passed|FAIL|Error" "$OUT/quant_op.log" | head -20
    grep -o "'from_quantized_equal': [A-Za-z]*" "$OUT/quant_op.log" | sort | uniq -c
fi
if [[ "$gpu" != *H200* ]]; then exit 0; fi
left=$((CALL_LIMIT - SECONDS))
if ((left <= 40)); then exit 0; fi
start=$SECONDS
timeout -k 10 "$((left > 130 ? 120 : left - 10))" python3 -m tilegen.cli bench --sweep \
    --backends cuda,gluon --no-dense --no-flex --json "$OUT/bench_sweep.json" \
    --plot "$OUT/bench_sweep.png" > "$OUT/bench_sweep.log" 2>&1
echo "bench: rc $? in $((SECONDS - start)) s"
grep -E "│ seed|^bench finished" "$OUT/bench_sweep.log" | cut -c1-200
