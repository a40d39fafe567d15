#!/usr/bin/env bash
# Session 34 (issue #19), one device call.
#   1. gpu_s34_overlap.py: overlap_prepass checked (ten calls bit-equal to the shipped op, the
#      quantized rule) and timed beside the op, with the bound (pass and kernel on two streams).
#   On an H200, then:
#   2. the 8-bit tune over gpu_s32_space.sh's space, with overlap_prepass=false,true when step 1
#      passed every check and gained, exported to tuning_db/winners.json and copied out;
#   3. `tilegen bench --sweep --backends cuda` with that winner (the issue's figure).
#   On another card, then: the S-ahead probes (gpu_s32_probes.py --set 3, s33_s_ahead.patch
#   applied here only).
# At most 8 files under $OUT. Before the call, on the CPU machine:
#   bash bench/experiments/gpu_s33_prepare.sh
# Then: carry .kcache .whl;  CALL_LIMIT=560 OUT=$OUT bash bench/experiments/gpu_s34_run.sh
set -uo pipefail
OUT=${OUT:-out/s34_run}
mkdir -p "$OUT"
CALL_LIMIT=${CALL_LIMIT:-560}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "GPU: $gpu"
source bench/experiments/gpu_env.sh
export TILEGEN_CACHE_DIR=$PWD/.kcache
h200=0
[[ "$gpu" == *H200* ]] && h200=1
# on an H200 with less than 500 s the tune and the sweep (the issue's figure) come first
if ((!h200 || CALL_LIMIT >= 500)); then
    timeout $((h200 ? 170 : 240)) python3 bench/experiments/gpu_s34_overlap.py --reps 2 \
        --out /tmp/overlap.json > "$OUT/overlap.log" 2>&1
    echo "overlap: rc $? at $SECONDS s"
fi
sed -n '/^| what/,$p' "$OUT/overlap.log"
grep -E "^bound|^overlap_prepass|Error|error" "$OUT/overlap.log" | cut -c1-300 | tail -8
# the knob joins the tune only if it passed everything and gained
overlap_space=$(python3 - <<'EOF' 2>/dev/null
import json
r = json.load(open("/tmp/overlap.json"))
ok = all(c["passed"] and c["bit_equal_calls"] == 10 for c in r["checks"].values())
best = r["best_ms"]
beside = min(t for n, t in best.items() if n.startswith("op 1c overlap_prepass, "))
print("false,true" if ok and beside < best["op 1c K2 V3 linear"] * 0.995 else "false")
EOF
)
echo "overlap_prepass in the tune: ${overlap_space:-false}"
if ((h200)); then
    source bench/experiments/gpu_s32_space.sh
    mkdir -p /tmp/s34db
    export TILEGEN_DB=/tmp/s34db/tuning.sqlite
    left=$((CALL_LIMIT - SECONDS))
    start=$SECONDS
    timeout "$((left > 350 ? 220 : left - 120))" python3 -m tilegen.cli tune \
        --spec bench/specs/int8_fp8.toml --backend cuda "${SPACE[@]}" \
        --space overlap_prepass="${overlap_space:-false}" --sampler grid --trials 24 \
        --seeds 2 --export tuning_db/winners.json > "$OUT/tune_int8_fp8.log" 2>&1
    echo "tune int8_fp8: rc $? in $((SECONDS - start)) s"
    grep -E "^winner|^trials|^speedup|merged" "$OUT/tune_int8_fp8.log" | cut -c1-220
    sed -n '/^rank/,/^$/p' "$OUT/tune_int8_fp8.log" | cut -c1-40,170-240 | head -24
    cp tuning_db/winners.json "$OUT/winners.json"
    left=$((CALL_LIMIT - SECONDS))
    if ((left > 40)); then
        start=$SECONDS
        timeout -k 10 "$((left > 130 ? 120 : left - 10))" python3 -m tilegen.cli bench \
            --sweep --backends cuda --no-dense --no-flex --json "$OUT/bench_sweep.json" \
            --plot "$OUT/bench_sweep.png" > "$OUT/bench_sweep.log" 2>&1
        echo "bench: rc $? in $((SECONDS - start)) s"
        grep -E "│ seed|^bench finished" "$OUT/bench_sweep.log" | cut -c1-200
    fi
else
    left=$((CALL_LIMIT - SECONDS))
    if ((left > 90)); then
        git apply bench/experiments/s33_s_ahead.patch 2>/dev/null \
            || patch -p1 < bench/experiments/s33_s_ahead.patch
        timeout $((left - 10)) python3 bench/experiments/gpu_s32_probes.py --set 3 \
            --out /tmp/probes3.json > "$OUT/probes3.log" 2>&1
        echo "probes (set 3): rc $? at $SECONDS s"
        sed -n '/^bf16 default op:/,$p' "$OUT/probes3.log"
        grep -E "rel_l1 .* passed" "$OUT/probes3.log" | cut -c1-200
    fi
fi
