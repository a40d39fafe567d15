"""Issues #19 and #20, sessions 19-20: where the CUDA wgmma kernels' time goes. Variants of the
8-bit kernel are checked by the quantized rule (4 heads, the outlier head, check 4 against the
emulation fed the op's own pre-pass) and timed (kernel + plan, the op, the pre-pass) beside the
Gluon 8-bit op and the bf16 default op; variants of the 16-bit kernel are scored against the
reference variant and timed (bare launch and op) beside the Gluon winner. A variant is knobs
over `wgmma.DEFAULTS` and, for experiments on the headers, preprocessor defines put in front of
its source (with their own cache key).

    PYTHONPATH=$PWD TILEGEN_CACHE_DIR=$PWD/.kcache python3 bench/experiments/h200_s19_q8_cvt.py \
        --out $OUT/q8.json [--only default,k4v3] [--bf16 bf16_default]
    ... --prebuild           compile every variant's cubins for sm_90a here, with no GPU
    ... --ncu LABEL          three calls of one 8-bit variant, for `ncu -k regex:int8_fp8_bm64
                             --launch-skip 2 --launch-count 1 ...` (h200_s19_q8_cvt.sh)
    ... --ncu-summary FILE   every metric of an `ncu --page raw --csv` file, one a line

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
from tilegen.backends.cuda import wgmma
from tilegen.spec import Spec

#: label -> (wgmma knobs over `wgmma.DEFAULTS`, preprocessor defines before the kernel's
#: includes).
#: Earlier runs' labels built code that is gone from the headers (bench/NOTES.md, session 19):
#:   run 2: "cvt" (TILEGEN_SCORES_CVT) against "exact_add" (the magic-number conversion);
#:   run 3: the consumer's fills a tile ahead, split max/sum chains, no select on full tiles;
#:   run 4: "at_tile" (TILEGEN_EXP_PRODUCER_AT_TILE) against "ahead" (the producers' plan
#:          loads a tile ahead: kept, as fast with half the loads).
PINGPONG = {"consumers": 2, "pingpong": True, "k_stages": 2, "v_stages": 2}
#: Session 20 (bench/NOTES.md): "default" is now the 8-bit default (`wgmma.QUANT_DEFAULTS`:
#: 128-key tiles, two of the plan's 64-key tiles, P V in two column parts), "kv64" the 64-key
#: kernel; "3c" three consumers a CTA (160 registers each, P V in four parts). Builds measured in
#: runs 1-4 that are gone from the headers: "pred", "pred_mask" (now the code: scale-d from a
#: predicate, the select only on tiles with a partial half), "3c_serial", "k128_plain",
#: "k128_mask", and the parts' orders TILEGEN_EXP_PACK_LAST ("k128", "3c") and
#: TILEGEN_EXP_PARTS_WITH_S ("k128_with_s": now the code, "3c_with_s"). Session 21, run 4:
#: TILEGEN_EXP_S_AHEAD ("kv64_sahead", "_k4v3", "_2c": 64-key tiles with S_{j+1} issued once
#: S_j's scores are out of s; 3.5-4.5% slower than "kv64", removed); run 7:
#: TILEGEN_EXP_POLY_QUARTER / _HALF ("poly4", "poly2", "3c_poly4": a quarter / half of the
#: exponentials as a degree-2 polynomial on the FMA pipe; 1.6-5% slower, removed). Session 22,
#: run 4: TILEGEN_EXP_ROWSUM_MMA ("rowsum", "k128_2c_rowsum", "3c_rowsum": l from an m64n8
#: MMA of P against a block of e4m3 ones) and TILEGEN_EXP_SUM_TREE ("sumtree": l in four
#: chains); -0.5% for the default, -0.8% / -1.8% with two / three consumers, removed.
THREE = {"consumers": 3, "k_stages": 3, "v_stages": 2}
KV64 = {"consumers": 1, "k_stages": 3, "v_stages": 2}  # session 19's 8-bit defaults
VARIANTS: dict[str, tuple[dict, tuple[str, ...]]] = {
    "default": (wgmma.QUANT_DEFAULTS, ()),
    "kv64": (KV64, ()),
    "kv64_k4v3": ({**KV64, "k_stages": 4, "v_stages": 3}, ()),
    "2c_pp": (PINGPONG, ()),
    "3c": (THREE, ()),
    "k128_k2v2": ({**wgmma.QUANT_DEFAULTS, "k_stages": 2, "v_stages": 2}, ()),
    "k128_2c": ({**wgmma.QUANT_DEFAULTS, "consumers": 2, "k_stages": 2, "v_stages": 1}, ()),
}
#: the 16-bit kernel (issue #20), timed beside the Gluon winner: label -> (knobs, defines)
VARIANTS_BF16: dict[str, tuple[dict, tuple[str, ...]]] = {
    "bf16_default": ({}, ()),  # since session 20 three consumers, K ring 2, V ring 1
    "bf16_1c_k3v2": (KV64, ()),  # session 18's defaults ("bf16_default" in session 19's runs)
    "bf16_3c_k2v1": ({"consumers": 3, "k_stages": 2, "v_stages": 1}, ()),
    "bf16_3c_k1v1": ({"consumers": 3, "k_stages": 1, "v_stages": 1}, ()),
    "bf16_3c_k1v1_persist": ({"consumers": 3, "k_stages": 1, "v_stages": 1,
                              "persistent": True}, ()),
}


def patch(run, defines: tuple[str, ...]) -> None:
    """The launch's source with `defines` in front (and its own cache key)."""
    if not defines:
        return
    text = "".join(f"#define {d} 1\n" for d in defines) + run.source.text
    run.source = dataclasses.replace(run.source, text=text)
    run.digest = hashlib.sha256((run.digest + "|" + ",".join(defines)).encode()).hexdigest()


def load_variant(spec: Spec, label: str):
    opts, defines = {**VARIANTS, **VARIANTS_BF16}[label]
    op = tilegen.load(spec, wgmma.config(**opts), backend="cuda")
    for lse in (True, False):
        patch(op._launch_for(lse), defines)
    return op


def prebuild(labels) -> None:
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
    gl8 = tilegen.load(spec8, backend="gluon")  # the Gluon family's 8-bit op
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
                    "its metrics, one a line")
    args = ap.parse_args()
    if args.ncu_summary:
        import csv

        lines = [x for x in Path(args.ncu_summary).read_text().splitlines()
                 if x.startswith('"')]
        head, units, *rows = list(csv.reader(lines))
        for row in rows:
            for name, unit, value in zip(head, units, row, strict=False):
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
