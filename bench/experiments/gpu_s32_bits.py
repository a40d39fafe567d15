"""Issue #19, session 32: the 8-bit kernel's softmax without MUFU.EX2 (``p_exp="linear"``) and
its row sum on the tensor cores (``row_sum="mma"``), at the shipped winners' configs and a few
others, checked and timed in one process.

    row_sum "mma"    l from an m64n8 MMA of P against e4m3 ones (the sum's FADDs gone)
    p_exp "linear"   P's e4m3 code from the exponent's fixed-point value: one FFMA, one FMNMX and
                     3/4 PRMT a score for MUFU.EX2, FADD and 1/2 F2FP (takes row_sum "mma"); P
                     = 2^x with the mantissa linear in x's fraction

(Run 3 of the session measured the same code as header defines, before the knobs existed.)

    PYTHONPATH=$PWD TILEGEN_CACHE_DIR=$PWD/.kcache python3 bench/experiments/gpu_s32_bits.py \
        --out $OUT/bits.json
    ... --ncu LABEL     only that variant's kernel + plan, four launches (for Nsight Compute)
    ... --prebuild      compile every variant for sm_90a here (no GPU): registers, spills, and
                        the MUFU / PRMT / F2FP / QGMMA counts of the SASS

Checks (4 heads of the default workload, seeds 0 and 1, an outlier head among them): the
quantized rule against the fp32 oracle, check 4 against `quant.emulate` of the op's own pre-pass
with the variant's p_exp; lse against the fp32 oracle's (real rows). Timing (40 heads, TOPK 78,
rounds over all variants, best of each): kernel + plan (`from_quantized`), the op's call without
lse and with it, the bf16 default op beside them. The table is printed last; the rows are also
in the JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
from pathlib import Path

import torch

import tilegen
from tilegen import captures, quant
from tilegen.backends.cuda import wgmma
from tilegen.spec import Spec

H200_WINNER = {**wgmma.QUANT_DEFAULTS, "k_stages": 2, "v_stages": 3, "kv_copies": "bulk",
               "q_in_kernel": True}
TWO = {**wgmma.QUANT_DEFAULTS, "consumers": 2, "k_stages": 2, "v_stages": 1,
       "kv_copies": "bulk", "q_in_kernel": True}
THREE = {**wgmma.QUANT_DEFAULTS, "consumers": 3, "k_stages": 2, "v_stages": 1, "kv_tile": 64,
         "kv_copies": "bulk", "q_in_kernel": True}
ONE64 = {**H200_WINNER, "k_stages": 3, "v_stages": 3, "kv_tile": 64}
LINEAR = {"p_exp": "linear", "row_sum": "mma"}
#: label -> wgmma knobs
VARIANTS: dict[str, dict] = {
    "1c K2 V3": H200_WINNER,
    "1c K2 V3 rowsum": {**H200_WINNER, "row_sum": "mma"},
    "1c K2 V3 linear": {**H200_WINNER, **LINEAR},
    "1c K3 V2 linear": {**H200_WINNER, **LINEAR, "k_stages": 3, "v_stages": 2},
    "2c K2 V1 linear": {**TWO, **LINEAR},
    "2c K2 V2 linear": {**TWO, **LINEAR, "v_stages": 2},
    "3c K2 V1 kv64 linear": {**THREE, **LINEAR},
    "1c K3 V3 kv64 linear": {**ONE64, **LINEAR},
}
#: run 9's shorter list (`--only short`; `--only all`, the default, is every variant)
SHORT = ("1c K2 V3", "1c K2 V3 linear", "2c K2 V2 linear")


def load_variant(spec: Spec, label: str):
    return tilegen.load(spec, wgmma.config(**VARIANTS[label]), backend="cuda", target="sm_90")


def sass_counts(cubin: Path) -> dict:
    import triton

    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    text = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", text)
    want = ("MUFU", "PRMT", "F2FP", "FADD", "FMNMX", "FFMA", "QGMMA", "IGMMA", "FRND", "I2FP")
    return {w: sum(1 for o in ops if o.startswith(w)) for w in want} | {"all": len(ops)}


def prebuild(labels) -> None:
    from tilegen.backends.cuda.nvcc import compile_cuda
    from tilegen.targets import get_target

    target = get_target("sm_90")
    spec = Spec(quant="int8_fp8")
    for label in labels:
        op = load_variant(spec, label)
        for lse in (True, False):
            run = op._launch_for(lse)
            art = compile_cuda(run.source, target, None, run.digest)
        cubins = [Path(p) for p in (getattr(art, "path", None), getattr(art, "cubin", None))
                  if p and str(p).endswith(".cubin")]
        counts = sass_counts(cubins[0]) if cubins else {}
        print(f"prebuilt {label}: {art.registers} registers, spills {art.spill_bytes}, "
              f"SASS {counts}", flush=True)


def check(labels, seeds) -> dict:
    from tilegen.reference import attention_fp32

    spec = Spec(quant="int8_fp8", num_heads=4)
    out: dict = {}
    for seed in seeds:
        cap = captures.synthesize_for(spec.replace(quant="none"), seed=seed)
        q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
        o32, lse32 = attention_fp32(q, k, v, idx, vbs)
        base = load_variant(spec, labels[0])
        qi = base.quantize(q.cuda(), k.cuda(), v.cuda(), vbs.cuda())
        cpu = type(qi)(**{f: (getattr(qi, f).cpu() if isinstance(getattr(qi, f), torch.Tensor)
                              else getattr(qi, f)) for f in qi.__dataclass_fields__})
        emul: dict[str, torch.Tensor] = {}
        for p_exp in sorted({VARIANTS[label].get("p_exp", "ex2") for label in labels}):
            t0 = time.perf_counter()
            emul[p_exp] = quant.emulate(q, k, v, idx, vbs, mode=spec.quant, quantized=cpu,
                                        p_exp=p_exp)
            print(f"seed {seed}: emulation ({p_exp}) {time.perf_counter() - t0:.0f} s",
                  flush=True)
        lse_base = None
        real = (torch.arange(q.shape[1]) % 64 < vbs.repeat_interleave(64))
        for label in labels:
            op = load_variant(spec, label)
            o, lse = op(q.cuda(), k.cuda(), v.cuda(), idx.cuda(), vbs.cuda())
            o, lse = o.cpu(), lse.cpu()
            p_exp = VARIANTS[label].get("p_exp", "ex2")
            s = captures.quant_score(o, o32.to(q.dtype), emul[p_exp], o32, vbs=vbs)
            if lse_base is None:
                lse_base = lse
            fin = torch.isfinite(lse_base) & real
            err = (lse[fin] - lse32[fin]).abs()
            row = {"score": str(s), "passed": bool(s.passed), "rel_l1": s.rel_l1,
                   "cos": s.cos, "min_head_cos": s.min_head_cos,
                   "o_finite": bool(torch.isfinite(o).all()),
                   "lse_max_abs_vs_base": float((lse[fin] - lse_base[fin]).abs().max()),
                   "lse_mean_vs_base": float((lse[fin] - lse_base[fin]).mean()),
                   "lse_max_abs_vs_oracle": float(err.max()),
                   "lse_mean_abs_vs_oracle": float(err.mean())}
            out[f"{label} seed {seed}"] = row
            print(f"{label} seed {seed}: {row}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bits.json")
    ap.add_argument("--only", default=",".join(VARIANTS))
    ap.add_argument("--prebuild", action="store_true")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--seeds", default="0,1", help="the checks' seeds ('': no checks)")
    ap.add_argument("--ncu", default="", help="a label: only its kernel + plan, four times (the "
                    "default workload), for `ncu -k regex:int8_fp8_bm64 --launch-skip 2`")
    ap.add_argument("--topk", type=int, default=None,
                    help="the timing's TOPK (default: the spec's, 78); the checks keep 78")
    args = ap.parse_args()
    named = {"short": ",".join(SHORT), "all": ",".join(VARIANTS)}.get(args.only, args.only)
    labels = [x for x in named.split(",") if x]
    if args.prebuild:
        prebuild(labels)
        return 0
    if args.ncu:
        spec = Spec(quant="int8_fp8")
        cap = captures.synthesize_for(spec.replace(quant="none"), seed=0, device="cuda")
        op = load_variant(spec, args.ncu)
        qi = op.quantize(cap["q"], cap["k"], cap["v"], cap["vbs"])
        for _ in range(4):
            op.from_quantized(qi, cap["topk_idx"], cap["vbs"], return_lse=False)
        torch.cuda.synchronize()
        return 0
    from triton.testing import do_bench

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "checks": check(labels, [int(s) for s in args.seeds.split(",") if s]), "rows": []}
    spec = Spec(quant="int8_fp8")
    if args.topk is not None:
        spec = spec.replace(topk=args.topk)
    cap = captures.synthesize_for(spec.replace(quant="none"), seed=0, device="cuda")
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    ops = {label: load_variant(spec, label) for label in labels}
    times = {label: {"op": [], "op_lse": [], "kernel": []} for label in labels}
    t0 = time.perf_counter()
    for rnd in range(args.reps):
        for label, op in ops.items():
            qi = op.quantize(q, k, v, vbs)
            t = times[label]
            t["kernel"].append(do_bench(
                lambda op=op, qi=qi: op.from_quantized(qi, idx, vbs, return_lse=False), rep=200))
            t["op"].append(do_bench(lambda op=op: op(q, k, v, idx, vbs, return_lse=False),
                                    rep=200))
            t["op_lse"].append(do_bench(lambda op=op: op(q, k, v, idx, vbs), rep=200))
            print(f"round {rnd} {label}: kernel + plan {t['kernel'][-1]:.3f} ms, op "
                  f"{t['op'][-1]:.3f}, with lse {t['op_lse'][-1]:.3f}", flush=True)
    from tilegen.ops import block_sparse_attention

    bf16 = do_bench(lambda: block_sparse_attention(q, k, v, idx, vbs), rep=400)
    res["bf16_default_op_ms"] = bf16
    print(f"bf16 default op (block_sparse_attention): {bf16:.3f} ms", flush=True)
    for label, t in times.items():
        res["rows"].append({"variant": label, **{f"{n}_ms": t[n] for n in t},
                            **{f"best_{n}_ms": min(t[n]) for n in t}})
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"\n{res['device']}, {time.perf_counter() - t0:.0f} s timing, TOPK {spec.topk}, "
          f"{spec.num_heads} heads, best of {args.reps}")
    for name, c in res["checks"].items():
        print(f"{name}: rel_l1 {c['rel_l1']:.5f} cos {c['cos']:.6f} worst head "
              f"{c['min_head_cos']:.6f} passed {c['passed']}; lse vs the oracle max "
              f"{c['lse_max_abs_vs_oracle']:.4f} mean {c['lse_mean_abs_vs_oracle']:.4f}, vs "
              f"the base variant mean {c['lse_mean_vs_base']:+.4f}")
    base = {}
    print(f"bf16 default op: {bf16:.3f} ms")
    print("| variant | kernel + plan ms | op ms | op with lse ms | kernel vs its base | "
          "bf16 default / op |")
    print("|---|---|---|---|---|---|")
    for r in res["rows"]:
        key = " ".join(r["variant"].split()[:3])
        base.setdefault(key, r["best_kernel_ms"])
        print(f"| {r['variant']} | {r['best_kernel_ms']:.3f} | {r['best_op_ms']:.3f} | "
              f"{r['best_op_lse_ms']:.3f} | {r['best_kernel_ms'] / base[key]:.3f} | "
              f"{bf16 / r['best_op_ms']:.3f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
