"""Issue #19, session 32: cuts of the linear-P kernel's loop as header defines (each variant its
own cache key), with a probe patch applied (never landed), checked and timed as
`gpu_s32_bits.py` does its variants, in one process. Eight sets:

``--set 1`` (with ``s32_probes.patch``, runs 6-7):
    TILEGEN_EXP_MAGIC_S   S to float by an IADD on its bits (1.5 2^23 + S, exact) instead of
                          I2FP, the offset taken out in the FFMA's addend
    TILEGEN_EXP_NO_OADD   a probe: O never updated (wrong numbers; ptxas then drops P V's MMAs
                          too, so it measures P V and the update together)
    TILEGEN_EXP_DIRECT_O  P V accumulated into O's registers by the MMA itself (no two-level
                          accumulation), O rescaled before it only where the row max moved
``--set 3`` (with ``s33_s_ahead.patch``, session 33, not run yet):
    TILEGEN_EXP_S_AHEAD   S_{j+1}'s MMAs issued inside tile j, after S_j's codes are packed into
                          a second P fragment and before P_{j-1} V_{j-1}'s last part is waited
                          (alone: in flight across the loop's back edge, and ptxas serializes
                          every MMA, C7513)
    TILEGEN_EXP_S_AHEAD2  with it: two tiles a turn, S issued ahead only inside the turn (no
                          C751x; 64 bytes of spills)
    TILEGEN_EXP_PV4       P V in four 16-register parts instead of two
``--set 2`` (with ``s32_probes2.patch``, run 8):
    TILEGEN_EXP_F16_CODE  the code at 1024 + code: F2FP packs two into f16x2 (rounding each),
                          HMNMX2 clamps two, one PRMT takes four
    TILEGEN_EXP_IMAX3     the row max on S's int32 with DPX vimax3 (two scores an instruction)
``--set 4`` (with ``s36_load_probes.patch``, session 36; wrong numbers by design):
    TILEGEN_EXP_LOADS_HALF  the producer copies K/V for every other tile only (the others'
                            stages complete on a bare arrive, their old bytes computed again)
    TILEGEN_EXP_LOADS_FEW   K/V copied for a cube's first three tiles only
``--set 5`` (with ``s36_wait_hint.patch``, session 36):
    TILEGEN_EXP_WAIT_HINT   every mbarrier wait with a suspend-time hint (10 ms), so a waiting
                            warp sleeps until its phase completes (CUTLASS's barriers wait so)
``--set 6`` (with ``s37_probes.patch``, session 37):
    TILEGEN_EXP_SAT_CODE    the code's clamp at 0 in the FFMA's saturation (z = sat(code / 128))
                            and z * 128 put at 1024 by one fma.f16x2 a pair: max.f16x2 (ALU)
                            becomes fma.f16x2 (FMA pipe), the same count
    TILEGEN_EXP_CODES_EARLY the linear pack in two halves: the codes' FFMAs, conversions and
                            clamps before P V's last part is waited (into 32 pair registers),
                            only the PRMTs after it
    TILEGEN_EXP_WAIT_BRANCH with it: that wait in a block of its own, so that ptxas keeps the
                            codes above it (without it, it hoists the wait over them)
    TILEGEN_EXP_TOP_PACK    with both: P_{j-1}'s PRMTs and the O update of P_{j-2} V_{j-2}'s last
                            part moved to tile j's top, under S_j's MMAs (in a block of their
                            own, so that S_j's four MMAs issue back to back)
``--set 7`` (with ``s38_split_producer.patch``, session 38):
    TILEGEN_EXP_SPLIT_PRODUCER  with one consumer, the producer warpgroup's four warps each copy
                            one 32-key half of every tile (K8, its scale and fill, V^T), each
                            arriving on the full barriers with its own bytes, where warp 0 alone
                            issued all twelve copies (both CTAs' producer lanes on scheduler 0)
``--set 8`` (with ``s39_stale_shift.patch``, session 39):
    TILEGEN_EXP_STALE_CHECK the linear P's shift with a binade of headroom (the top code 118),
                            moved only where a code of the tile would pass it (one vote a
                            warp); else alpha is 1 and the max's shuffles and exp2 are skipped
    TILEGEN_EXP_STALE_SHIFT a probe: the shift never moves after the first tile (wrong numbers
                            by design: what the max's update costs at most)

    git apply bench/experiments/s32_probes2.patch
    PYTHONPATH=$PWD TILEGEN_CACHE_DIR=$PWD/.kcache python3 bench/experiments/gpu_s32_probes.py \
        --set 2 --out $OUT/probes.json        (--prebuild: the cubins here)
"""

from __future__ import annotations

import sys
from pathlib import Path

import tilegen
from tilegen.backends.cuda import wgmma

sys.path.insert(0, str(Path(__file__).parent))
import gpu_s32_bits as bits  # noqa: E402
from h200_s19_q8_cvt import patch  # noqa: E402  (defines in front, their own cache key)

LINEAR = {**bits.H200_WINNER, **bits.LINEAR}
TWO = {**bits.TWO, **bits.LINEAR, "v_stages": 2}
DYNAMIC = {**LINEAR, "v_stages": 2, "persistent": True, "schedule": "dynamic"}
EARLY = ("TILEGEN_EXP_CODES_EARLY", "TILEGEN_EXP_WAIT_BRANCH")
TOP, SAT = "TILEGEN_EXP_TOP_PACK", "TILEGEN_EXP_SAT_CODE"
SPLIT = "TILEGEN_EXP_SPLIT_PRODUCER"
STALE_CHECK, STALE_SHIFT = "TILEGEN_EXP_STALE_CHECK", "TILEGEN_EXP_STALE_SHIFT"
TOPK31 = {**LINEAR, "k_stages": 3, "v_stages": 2}  # the shipped TOPK-31 winner's rings
#: set -> label -> (wgmma knobs, defines)
SETS: dict[str, dict[str, tuple[dict, tuple[str, ...]]]] = {
    "1": {
        "1c K2 V3 linear": (LINEAR, ()),
        "1c K2 V3 linear magic": (LINEAR, ("TILEGEN_EXP_MAGIC_S",)),
        "1c K2 V3 linear no_oadd (wrong)": (LINEAR, ("TILEGEN_EXP_NO_OADD",)),
        "1c K2 V3 linear direct": (LINEAR, ("TILEGEN_EXP_DIRECT_O",)),
        "1c K2 V3 ex2 direct": (bits.H200_WINNER, ("TILEGEN_EXP_DIRECT_O",)),
        "2c K2 V2 linear": (TWO, ()),
        "2c K2 V2 linear magic": (TWO, ("TILEGEN_EXP_MAGIC_S",)),
        "2c K2 V2 linear direct": (TWO, ("TILEGEN_EXP_DIRECT_O",)),
    },
    "2": {
        "1c K2 V3 linear": (LINEAR, ()),
        "1c K2 V3 linear f16": (LINEAR, ("TILEGEN_EXP_F16_CODE",)),
        "1c K2 V3 linear imax3": (LINEAR, ("TILEGEN_EXP_IMAX3",)),
        "1c K2 V3 linear f16 imax3": (LINEAR, ("TILEGEN_EXP_F16_CODE", "TILEGEN_EXP_IMAX3")),
        "2c K2 V2 linear": (TWO, ()),
        "2c K2 V2 linear f16 imax3": (TWO, ("TILEGEN_EXP_F16_CODE", "TILEGEN_EXP_IMAX3")),
    },
    "3": {  # session 33, with s33_s_ahead.patch (S_AHEAD alone serializes: not run)
        "1c K2 V3 linear": (LINEAR, ()),
        "1c K2 V3 linear s_ahead2": (LINEAR, ("TILEGEN_EXP_S_AHEAD", "TILEGEN_EXP_S_AHEAD2")),
        "1c K2 V3 linear s_ahead2 pv4": (LINEAR, ("TILEGEN_EXP_S_AHEAD", "TILEGEN_EXP_S_AHEAD2",
                                                  "TILEGEN_EXP_PV4")),
        "1c K2 V3 linear pv4": (LINEAR, ("TILEGEN_EXP_PV4",)),
        "2c K2 V2 linear": (TWO, ()),
        "2c K2 V2 linear s_ahead2": (TWO, ("TILEGEN_EXP_S_AHEAD", "TILEGEN_EXP_S_AHEAD2")),
    },
    "4": {  # session 36, with s36_load_probes.patch: how much the K/V bytes set the kernel
        "1c K2 V3 linear": (LINEAR, ()),
        "1c K2 V3 linear loads_half (wrong)": (LINEAR, ("TILEGEN_EXP_LOADS_HALF",)),
        "1c K2 V3 linear loads_few (wrong)": (LINEAR, ("TILEGEN_EXP_LOADS_FEW",)),
        "2c K2 V2 linear": (TWO, ()),
        "2c K2 V2 linear loads_half (wrong)": (TWO, ("TILEGEN_EXP_LOADS_HALF",)),
        "2c K2 V2 linear loads_few (wrong)": (TWO, ("TILEGEN_EXP_LOADS_FEW",)),
    },
    "5": {  # session 36, with s36_wait_hint.patch: waits that sleep until their phase completes
        "1c K2 V3 linear": (LINEAR, ()),
        "1c K2 V3 linear wait_hint": (LINEAR, ("TILEGEN_EXP_WAIT_HINT",)),
        "2c K2 V2 linear": (TWO, ()),
        "2c K2 V2 linear wait_hint": (TWO, ("TILEGEN_EXP_WAIT_HINT",)),
        "1c K2 V2 linear dynamic": (DYNAMIC, ()),
        "1c K2 V2 linear dynamic wait_hint": (DYNAMIC, ("TILEGEN_EXP_WAIT_HINT",)),
    },
    "6": {  # session 37, with s37_probes.patch: the code's clamp on the FMA pipe, the codes
        # under P V's last part
        "1c K2 V3 linear": (LINEAR, ()),
        "1c K2 V3 linear codes_early": (LINEAR, EARLY),
        "1c K2 V3 linear codes_early sat_code": (LINEAR, (*EARLY, SAT)),
        "1c K2 V3 linear codes_early top": (LINEAR, (*EARLY, TOP)),
        "1c K2 V3 linear codes_early top sat_code": (LINEAR, (*EARLY, TOP, SAT)),
        "2c K2 V2 linear": (TWO, ()),
        "2c K2 V2 linear codes_early": (TWO, EARLY),
        "2c K2 V2 linear codes_early top": (TWO, (*EARLY, TOP)),
    },
    "7": {  # session 38, with s38_split_producer.patch: the producer's copies over four warps
        "1c K2 V3 linear": (LINEAR, ()),
        "1c K2 V3 linear split": (LINEAR, (SPLIT,)),
        "1c K2 V3 ex2": (bits.H200_WINNER, ()),
        "1c K2 V3 ex2 split": (bits.H200_WINNER, (SPLIT,)),
        "1c K3 V2 linear": (TOPK31, ()),
        "1c K3 V2 linear split": (TOPK31, (SPLIT,)),
    },
    "8": {  # session 39, with s39_stale_shift.patch: the linear P's shift moved only on need
        "1c K2 V3 linear": (LINEAR, ()),
        "1c K2 V3 linear stale_check": (LINEAR, (STALE_CHECK,)),
        "1c K2 V3 linear stale_shift (wrong)": (LINEAR, (STALE_SHIFT,)),
        "2c K2 V2 linear": (TWO, ()),
        "2c K2 V2 linear stale_check": (TWO, (STALE_CHECK,)),
    },
}
PROBES: dict[str, tuple[dict, tuple[str, ...]]] = {}


def load_probe(spec, label: str):
    knobs, defines = PROBES[label]
    op = tilegen.load(spec, wgmma.config(**knobs), backend="cuda", target="sm_90")
    for lse in (True, False):
        patch(op._launch_for(lse), defines)
    return op


def main() -> int:
    which = sys.argv[sys.argv.index("--set") + 1] if "--set" in sys.argv else "2"
    if "--set" in sys.argv:
        i = sys.argv.index("--set")
        del sys.argv[i:i + 2]
    PROBES.update(SETS[which])
    bits.VARIANTS = {label: knobs for label, (knobs, _) in PROBES.items()}
    bits.load_variant = load_probe
    return bits.main()


if __name__ == "__main__":
    raise SystemExit(main())
