#!/usr/bin/env bash
# Session 30 (issue #19), one device call for the 8-bit kernel of this checkout's working tree
# against the shipped one (session 30: session 29's bookkeeping cut and Q quantized in the
# kernel, `q_in_kernel`, run at 19f3d9b with them applied; bench/RESULTS.md, session 30):
#   1. gpu_s30_check.py --role ref: the shipped kernel (the tree of the commit this starts from,
#      unpacked into .s28 by gpu_s30_prepare.sh), o and lse saved, timed;
#   2. gpu_s30_check.py --role new: this checkout's, o bit-equal to the shipped kernel's with and
#      without q_in_kernel, lse within rounding, timed beside it (the table);
#   3. the 8-bit kernel re-tuned on this card (its source changed, so the shipped winner is
#      stale): one consumer, 128-key tiles, K ring 2-3, V ring 1-3, boxes and bulk copies, with
#      q_in_kernel where step 2 found it faster; exported to tuning_db/winners.json, copied out;
#   4. h200_quant_op.py --small-only with q_in_kernel and the bulk copies: the quantized rule
#      with check 4, from_quantized bit-equal to the op's call;
#   5. on an H200, `tilegen bench --sweep` with that winner.
# At most 8 files under $OUT (the device tool returns no more).
# Before the call, on the CPU machine, from this checkout: bash bench/experiments/gpu_s30_prepare.sh
# Then: carry .kcache .whl .s28;  CALL_LIMIT=540 OUT=$OUT bash bench/experiments/gpu_s30_run.sh
# (a short call: CHECK_ONLY="1c K2 V3" checks and times the H200 winner's config alone; session
# 31 ran it so on an H100 with CALL_LIMIT=300 in 141 s, the tune and the small checks included)
set -uo pipefail
OUT=${OUT:-out/s30_run}
mkdir -p "$OUT"
CALL_LIMIT=${CALL_LIMIT:-540}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "GPU: $gpu"
source bench/experiments/gpu_env.sh
export TILEGEN_CACHE_DIR=$PWD/.kcache
mkdir -p /tmp/s30db
export TILEGEN_DB=/tmp/s30db/tuning.sqlite
start=$SECONDS
PYTHONPATH=$PWD/.s28:${PYTHONPATH#"$PWD":} TILEGEN_CACHE_DIR=$PWD/.s28/.kcache timeout 120 \
    python3 bench/experiments/gpu_s30_check.py --role ref --dump /tmp/s30ref \
    --only "${CHECK_ONLY:-}" --out /tmp/s30db/ref.json > "$OUT/ref.log" 2>&1
echo "ref: rc $? in $((SECONDS - start)) s"
sed -n '/^| /p' "$OUT/ref.log"
start=$SECONDS
timeout 170 python3 bench/experiments/gpu_s30_check.py --role new --against /tmp/s30ref \
    --only "${CHECK_ONLY:-}" --out "$OUT/check.json" > "$OUT/check.log" 2>&1
echo "new: rc $? in $((SECONDS - start)) s"
sed -n '/^inputs equal/p;/: {.o_equal/p;/^| /p' "$OUT/check.log" | sort -u
# q_in_kernel in the tune where it made the H200 winner's op faster with both copy modes
qk=$(python3 - "$OUT/check.json" <<'EOF'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
    best = {(r["copies"], r["q_in_kernel"]): r["best_op_ms"] for r in rows
            if r["config"].startswith("1c K2 V3")}
    ok = all(best[(c, True)] < best[(c, False)] for c in ("tma", "bulk"))
    print("true" if ok else "false")
except Exception:
    print("false")
EOF
)
echo "tune with q_in_kernel=$qk"
left=$((CALL_LIMIT - SECONDS))
if ((left > 100)); then
    start=$SECONDS
    timeout "$((left > 240 ? 150 : left - 90))" python3 -m tilegen.cli tune \
        --spec bench/specs/int8_fp8.toml --backend cuda --space kv_copies=tma,bulk \
        --space consumers=1 --space kv_tile=128 --space pingpong=false \
        --space persistent=false --space "q_in_kernel=$qk" --sampler grid --trials 16 \
        --seeds 2 --export tuning_db/winners.json --summary /tmp/s30db/summary.json \
        > "$OUT/tune_int8_fp8.log" 2>&1
    echo "tune int8_fp8: rc $? in $((SECONDS - start)) s"
    grep -E "^winner|^trials|^speedup|merged" "$OUT/tune_int8_fp8.log" | cut -c1-200
    cp tuning_db/winners.json "$OUT/winners.json"
fi
left=$((CALL_LIMIT - SECONDS))
if ((left > 60)); then
    start=$SECONDS
    timeout "$((left > 240 ? 110 : left - 130 > 40 ? left - 130 : left - 10))" \
        python3 bench/experiments/h200_quant_op.py --backend cuda --small-only \
        --variants "q_in_kernel=1;q_in_kernel=1,kv_copies=bulk" \
        --out /tmp/s30db/quant_op.json > "$OUT/quant_op.log" 2>&1
    echo "quant_op (small; default, q_in_kernel, q_in_kernel + bulk): rc $? in $((SECONDS - start)) s"
    grep -E "^checks passed|FAIL|Error" "$OUT/quant_op.log" | head -20
    grep -o "'from_quantized_equal': [A-Za-z]*" "$OUT/quant_op.log" | sort | uniq -c
fi
if [[ "$gpu" != *H200* ]]; then exit 0; fi
left=$((CALL_LIMIT - SECONDS))
if ((left <= 40)); then exit 0; fi
start=$SECONDS
timeout -k 10 "$((left > 130 ? 120 : left - 10))" python3 -m tilegen.cli bench --sweep \
    --backends cuda,gluon --no-dense --no-flex --json "$OUT/bench_sweep.json" \
    --plot /tmp/s30db/bench_sweep.png > "$OUT/bench_sweep.log" 2>&1
echo "bench: rc $? in $((SECONDS - start)) s"
grep -E "│ seed|^bench finished" "$OUT/bench_sweep.log" | cut -c1-200
