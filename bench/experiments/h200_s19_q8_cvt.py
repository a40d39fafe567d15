"""Issue #19, session 19: where the CUDA 8-bit kernel's time goes, and whether the scores'
int32 -> fp32 conversion is on its critical pipe.

Session 19's first run (H100) timed the kernel with its plan at 5.86 ms (TOPK 78, 40 heads),
barely ahead of the Gluon 8-bit kernel. Per tile and consumer it issues 4096 exp2 (MUFU), 4096
int32 -> fp32 conversions (I2FP) and 2048 e4m3 pair conversions (F2FP). If the conversions share
the MUFU's quarter-rate pipe, the tiles cost ~640 cycles an SM at that pipe alone, about the
measured time; the scores now convert by an exact magic-number add (sm90/softmax.cuh
`exact_float`), and this script times it against the conversion instruction
(``-DTILEGEN_SCORES_CVT``, the old code) in one process, each variant checked by the quantized
rule (4 heads, outlier head, check 4 against the emulation) before it is timed.

    PYTHONPATH=$PWD TILEGEN_CACHE_DIR=$PWD/.kcache python3 bench/experiments/h200_s19_q8_cvt.py \\
        --out $OUT/q8_cvt.json
    ... --prebuild           compile every variant's cubins for sm_90a here, with no GPU
    ... --ncu LABEL          three calls of one variant's op, for `ncu -k regex:lut_wgmma_quant
                             --launch-skip 2 --launch-count 1 ...` (the pipe metrics)

The table is printed last; the rows are also in the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from pathlib import Path

import torch

import tilegen
from tilegen import captures, encodings, quant
from tilegen.spec import Spec

#: label -> (wgmma knobs over the defaults, preprocessor defines before the kernel's includes)
AT_TILE = "TILEGEN_EXP_PRODUCER_AT_TILE"
PINGPONG = {"consumers": 2, "pingpong": True, "k_stages": 2}
VARIANTS: dict[str, tuple[dict, tuple[str, ...]]] = {
    # runs 2-3 (the consumer's arithmetic: none helped; the code is back to run 1's)
    #   base; the magic-number add; fills a tile ahead; four max / two sum chains; no select
    #   on full tiles (their defines are gone from the headers)
    # run 4: the producer's plan loads a tile ahead (the code now) against loads at the tile
    "at_tile": ({}, (AT_TILE,)),
    "ahead": ({}, ()),
    "at_tile_2c_pp": (PINGPONG, (AT_TILE,)),
    "ahead_2c_pp": (PINGPONG, ()),
}
#: the same question for the 16-bit kernel (issue #20): label -> (knobs, defines)
VARIANTS_BF16: dict[str, tuple[dict, tuple[str, ...]]] = {
    "bf16_at_tile": ({}, (AT_TILE,)),
    "bf16_ahead": ({}, ()),
}


def patch(run, defines: tuple[str, ...]) -> None:
    """The launch's source with `defines` in front (and its own cache key)."""
    if not defines:
        return
    text = "".join(f"#define {d} 1\n" for d in defines) + run.source.text
    run.source = dataclasses.replace(run.source, text=text)
    run.digest = hashlib.sha256((run.digest + "|" + ",".join(defines)).encode()).hexdigest()


def load_variant(spec: Spec, label: str):
    from tilegen.backends.cuda import wgmma

    opts, defines = {**VARIANTS, **VARIANTS_BF16}[label]
    op = tilegen.load(spec, wgmma.config(**opts), backend="cuda")
    for lse in (True, False):
        patch(op._launch_for(lse), defines)
    return op


def prebuild(labels) -> None:
    from tilegen.backends.cuda import wgmma
    from tilegen.backends.cuda.nvcc import compile_cuda
    from tilegen.backends.cuda.wgmma_op import WgmmaLaunch, WgmmaQuantLaunch
    from tilegen.targets import get_target

    target = get_target("sm_90")
    for label in labels:
        bf16 = label in VARIANTS_BF16
        opts, defines = (VARIANTS_BF16 if bf16 else VARIANTS)[label]
        spec = Spec() if bf16 else Spec(quant="int8_fp8")
        for lse in (True, False):
            cls = WgmmaLaunch if bf16 else WgmmaQuantLaunch
            run = cls(spec.kernel_spec, wgmma.config(**opts).replace(store_lse=lse), target)
            patch(run, defines)
            compile_cuda(run.source, target, None, run.digest)
        print(f"prebuilt {label}", flush=True)


def check(label: str, seed: int) -> dict:
    """The default workload at 4 heads (an outlier head among them) against the fp32 oracle
    and the emulation fed the op's own pre-pass (check 4)."""
    from tilegen.reference import attention_fp32

    spec = Spec(quant="int8_fp8", num_heads=4)
    cap = captures.synthesize_for(spec.replace(quant="none"), seed=seed)
    idx, counts = encodings.reference_lut(spec, cap)
    q, k, v, vbs = cap["q"], cap["k"], cap["v"], cap["vbs"]
    op = load_variant(spec, label)
    o, _ = op(*[t.cuda() for t in encodings.call_args(spec, cap)])
    qi = op.quantize(q.cuda(), k.cuda(), v.cuda(), vbs.cuda())
    cpu = type(qi)(**{f: (getattr(qi, f).cpu() if isinstance(getattr(qi, f), torch.Tensor)
                          else getattr(qi, f)) for f in qi.__dataclass_fields__})
    oe = quant.emulate(q, k, v, idx, vbs, counts, mode=spec.quant, quantized=cpu)
    o32, _ = attention_fp32(q, k, v, idx, vbs, counts)
    s = captures.quant_score(o.cpu(), o32.to(q.dtype), oe, o32, vbs=vbs)
    return {"label": label, "seed": seed, "score": str(s), "passed": bool(s.passed)}


def timing(labels, topk: int, heads: int) -> list[dict]:
    from triton.testing import do_bench

    from tilegen.ops import block_sparse_attention

    spec = Spec(num_heads=heads, topk=topk)
    cap = captures.synthesize_for(spec, seed=0, device="cuda")
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    spec8 = spec.replace(quant="int8_fp8")
    rows = []
    bf16 = do_bench(lambda: block_sparse_attention(q, k, v, idx, vbs), rep=400)
    gl8 = tilegen.load(spec8)
    gluon8 = do_bench(lambda: gl8(q, k, v, idx, vbs, return_lse=False), rep=400)
    def one(label: str) -> dict:
        op = load_variant(spec8, label)
        qi = op.quantize(q, k, v, vbs)
        return {"label": label, "topk": topk, "heads": heads,
                "kernel_plan_ms": do_bench(lambda: op.from_quantized(qi, idx, vbs,
                                                                      return_lse=False), rep=400),
                "op_ms": do_bench(lambda: op(q, k, v, idx, vbs, return_lse=False), rep=400),
                "prepass_ms": do_bench(lambda: op.quantize(q, k, v, vbs), rep=400)}

    for label in labels:
        row = one(label)
        rows.append(row)
        print(row, flush=True)
    again = do_bench(lambda: block_sparse_attention(q, k, v, idx, vbs), rep=400)
    for row in rows:
        row.update(bf16_op_ms=bf16, bf16_op_again_ms=again, gluon_int8_fp8_op_ms=gluon8)
    return rows


def bf16_rows(labels) -> list[dict]:
    """The 16-bit variants at the default workload: the contract's rule against the reference
    variant (seed 0), then the bare launch (`time_op`) and the op's call, the Gluon winner
    (`tilegen.load(Spec())`) beside them."""
    from tilegen.bench import time_fn, time_op
    from tilegen.config import REFERENCE_CONFIG

    spec = Spec()
    cap = captures.synthesize(seed=0, topk=spec.topk, device="cuda")
    a = (cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"])
    o_ref = tilegen.load(spec, REFERENCE_CONFIG)(*a, return_lse=False)
    ops = {"gluon winner": tilegen.load(spec)}
    ops.update({label: load_variant(spec, label) for label in labels})
    rows = []
    for label, op in ops.items():
        s = captures.score(op(*a, return_lse=False), o_ref)
        row = {"label": label, "score": str(s), "passed": bool(s.passed),
               "bare_ms": time_op(op, cap),
               "op_ms": time_fn(lambda op=op: op(*a, return_lse=False))}
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="q8_cvt.json")
    ap.add_argument("--only", default=",".join(VARIANTS))
    ap.add_argument("--bf16", default=",".join(VARIANTS_BF16))
    ap.add_argument("--prebuild", action="store_true")
    ap.add_argument("--ncu", default="")
    ap.add_argument("--topks", default="78")
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--ncu-summary", default="", help="an `ncu --page raw --csv` file: print "
                    "its pipe, issue and duration metrics")
    args = ap.parse_args()
    if args.ncu_summary:
        import csv

        lines = [x for x in Path(args.ncu_summary).read_text().splitlines()
                 if x.startswith('"')]
        head, units, *rows = list(csv.reader(lines))
        keys = ("pipe", "issue_active", "duration", "inst_executed.avg.per_cycle", "throughput",
                "warps_active", "cycles_elapsed")
        for row in rows:
            for name, unit, value in zip(head, units, row, strict=False):
                if any(key in name for key in keys):
                    print(f"{name} [{unit}] {value}")
        return 0
    labels = [x for x in args.only.split(",") if x]
    bf16_labels = [x for x in args.bf16.split(",") if x]
    if args.prebuild:
        prebuild(labels + bf16_labels)
        return 0
    if args.ncu:
        spec = Spec(quant="int8_fp8", num_heads=args.heads)
        cap = captures.synthesize_for(spec.replace(quant="none"), seed=0, device="cuda")
        op = load_variant(spec, args.ncu)
        qi = op.quantize(*(cap[n] for n in ("q", "k", "v", "vbs")))
        for _ in range(3):
            op.from_quantized(qi, cap["topk_idx"], cap["vbs"], return_lse=False)
        torch.cuda.synchronize()
        print(repr(op))
        return 0
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "tilegen": tilegen.__version__, "checks": [], "timing": []}
    t0 = time.perf_counter()
    for label in labels:
        res["checks"].append(check(label, 0))
        print(res["checks"][-1], flush=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    passed = [r["label"] for r in res["checks"] if r["passed"]]
    for topk in (int(x) for x in args.topks.split(",")):
        res["timing"] += timing(passed, topk, args.heads)
        Path(args.out).write_text(json.dumps(res, indent=2))
    if bf16_labels:
        res["bf16"] = bf16_rows(bf16_labels)
        Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"\n{res['device']}, {time.perf_counter() - t0:.0f} s")
    for r in res.get("bf16", []):
        print(f"  {r['label']:16s} bare {r['bare_ms']:.3f} ms, op {r['op_ms']:.3f} ms, "
              f"{'PASS' if r['passed'] else 'FAIL'} {r['score']}")
    for r in res["checks"]:
        print(f"  {r['label']:16s} {'PASS' if r['passed'] else 'FAIL'} {r['score']}")
    print("| variant | TOPK | kernel + plan ms | op ms | pre-pass ms | Gluon 8-bit op ms "
          "| bf16 op ms |")
    print("|---|---|---|---|---|---|---|")
    for t in res["timing"]:
        bf16 = min(t["bf16_op_ms"], t["bf16_op_again_ms"])
        print(f"| {t['label']} | {t['topk']} | {t['kernel_plan_ms']:.3f} | {t['op_ms']:.3f} | "
              f"{t['prepass_ms']:.3f} | {t['gluon_int8_fp8_op_ms']:.3f} | {bf16:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
