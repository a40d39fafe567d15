"""Issue #19 on the H200: the 8-bit op as users load it, `tilegen.load(Spec(quant="int8_fp8"))`,
checked by the quantized rule with check 4 (the PyTorch emulation fed the same pre-pass output)
on every encoding, partial cubes, the outlier head, counts and a bad index; then timed beside
the bf16 default op in the same process, pre-pass included and without it (`from_quantized`).

    PYTHONPATH=$PWD python3 bench/experiments/h200_quant_op.py --out $OUT/quant_op.json
    ... --small-only       (checks at small shapes only)
    ... --variants 'qk_ahead=1;pack_halves=0'   (more 8-bit configs, checked and timed beside
                                                 the default: ';' between them, ',' between knobs)

    ... --backend cuda --prebuild   compile the CUDA 8-bit cubins (default and --variants, with
                           and without lse) for sm_90a here, with no GPU, into $TILEGEN_CACHE_DIR
    ... --backend cuda     the CUDA family's 8-bit wgmma kernel (session 18) instead of the Gluon
                           one, the Gluon 8-bit op timed beside it; --variants then take its
                           knobs (consumers, pingpong, k_stages, v_stages, pack_partials,
                           persistent, kv_copies=bulk); the cases it refuses (head_dim 64,
                           sliding_tile) skipped

The table is printed last; every row is also in the JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import tilegen
from tilegen import captures, encodings, quant
from tilegen.reference import attention_fp32
from tilegen.spec import Spec

DEV = "cuda"


def _cpu(qi):
    return type(qi)(**{f: (getattr(qi, f).cpu() if isinstance(getattr(qi, f), torch.Tensor)
                           else getattr(qi, f)) for f in qi.__dataclass_fields__})


VARIANT: dict = {}  # the 8-bit config options under check (--variants), over the default's
BACKEND = {"name": "gluon"}  # the family whose 8-bit kernel is checked (--backend)


def load8(spec: Spec):
    """The 8-bit op with the options of `VARIANT` over the default config (the default op
    when empty)."""
    if BACKEND["name"] == "cuda" and spec.quant != "none":
        from tilegen.backends.cuda import wgmma

        return tilegen.load(spec, wgmma.config(**{**wgmma.defaults_for(spec), **VARIANT}),
                            backend="cuda")
    if not VARIANT or spec.quant == "none":
        return tilegen.load(spec)
    from tilegen import backends
    from tilegen.targets import get_target

    b = backends.get("gluon")
    target = get_target("sm_90")
    cfg = b.default_config(spec.kernel_spec, target)
    cfg = cfg.replace(options={**dict(cfg.options), **VARIANT})
    return tilegen.load(spec, cfg, backend="gluon")


def parse_variants(text: str) -> list[dict]:
    out = []
    for part in filter(None, text.split(";")):
        opts = {}
        for kv in part.split(","):
            key, val = kv.split("=")
            key, val = key.strip(), val.strip()
            if key.endswith(("stages", "consumers", "regs", "_exp", "kv_tile")) and val.isdigit():
                opts[key] = int(val)
            elif val.lstrip("-").isdigit():  # a flag as 0 / 1
                opts[key] = bool(int(val))
            else:  # a choice by name (kv_copies=bulk)
                opts[key] = val
        out.append(opts)
    return out


def check_case(name: str, spec: Spec, seed: int, out: list, counts_fn=None, sorted_idx=False):
    """One capture: the op's o against the fp32 oracle and the emulation (check 4)."""
    cap = captures.synthesize_for(spec.replace(quant="none"), seed=seed)
    if sorted_idx:  # the mask op walks a row's cubes in ascending order: so does the emulation
        cap["topk_idx"] = cap["topk_idx"].sort(-1).values.contiguous()
    idx, counts = encodings.reference_lut(spec, cap)
    if counts_fn is not None:
        counts = counts_fn(cap)
    q, k, v, vbs = cap["q"], cap["k"], cap["v"], cap["vbs"]
    op = load8(spec)
    args = [t.to(DEV) for t in encodings.call_args(spec, cap)]
    kw = {}
    if counts is not None and spec.encoding == "lut":
        kw["counts"] = counts.to(DEV)
    t0 = time.perf_counter()
    o, lse = op(*args, **kw)
    torch.cuda.synchronize()
    qi = op.quantize(q.to(DEV), k.to(DEV), v.to(DEV), vbs.to(DEV))  # the op's V^T layout
    oe = quant.emulate(q, k, v, idx, vbs, counts, mode=spec.quant, quantized=_cpu(qi),
                       p_exp=quant.p_exp_of(op))
    o32, lse32 = attention_fp32(q, k, v, idx, vbs, counts)
    s = captures.quant_score(o.cpu(), o32.to(q.dtype), oe, o32, vbs=vbs)
    real = (torch.arange(64)[None, :] < vbs[:, None]).reshape(-1)
    lse_err = (lse.cpu()[..., real] - lse32[..., real]).abs()  # both base 2
    lse_err = lse_err[torch.isfinite(lse_err)].max().item() if lse_err.numel() else 0.0
    row = {"case": name, "variant": dict(VARIANT), "spec": spec.short_hash,
           "encoding": spec.encoding, "seed": seed,
           "grid": list(spec.grid), "heads": spec.num_heads, "topk": spec.topk,
           # every row finite, padded ones too (README; NaN there before session 38's floor)
           "o_finite": bool(torch.isfinite(o).all()),
           "score": str(s), "passed": bool(s.passed) and bool(torch.isfinite(o).all()),
           "lse_max_abs_base2": lse_err,
           "op": repr(op), "first_call_s": time.perf_counter() - t0}
    if spec.encoding == "lut":
        # the pre-quantized entry point (int8 Q from the pre-pass; the op's call quantizes Q in
        # the kernel with q_in_kernel): the same arithmetic, so o bit for bit
        o2, lse2 = op.from_quantized(qi, args[3], args[4], kw.get("counts"))
        row["from_quantized_equal"] = bool(torch.equal(o2, o))
        diff = (o2.float() - o.float()).abs()
        rows_d = diff.amax((2, 3))[0] > 0  # (S,): the tokens whose rows differ
        row["from_quantized_diff"] = {
            "elements": int((diff > 0).sum()), "max_abs": float(diff.max()),
            "rows": int(rows_d.sum()),
            "padded_rows": int((rows_d & ~real.to(rows_d.device)).sum())}
        o3, _ = op(*args, **kw)  # the same call again: deterministic?
        row["op_repeat_equal"] = bool(torch.equal(o3, o))
        fin = torch.isfinite(lse) & torch.isfinite(lse2)
        row["from_quantized_lse_max_abs"] = float((lse2 - lse)[fin].abs().max()) \
            if fin.any() else 0.0
    out.append(row)
    print(row, flush=True)


def check_bad_index(out: list):
    spec = Spec(quant="int8_fp8", grid=(8, 12, 16), num_heads=2, topk=6)
    cap = captures.synthesize_for(spec.replace(quant="none"), seed=3)
    cap["topk_idx"][0, 1, 2, 4] = 10_000  # one bad index: row (h=1, q_cube=2)
    op = load8(spec)
    o, _ = op(*[t.to(DEV) for t in encodings.call_args(spec, cap)])
    try:
        op.check()
        raised = ""
    except ValueError as exc:
        raised = str(exc)
    nan_rows = torch.isnan(o.cpu()[0, :, 1]).any(-1).view(-1, 64).any(-1).nonzero().view(-1)
    others_finite = bool(torch.isfinite(o.cpu()[0, :, 0]).all())
    row = {"case": "bad_index", "variant": dict(VARIANT), "raised": raised[:200],
           "nan_cubes_of_head_1": nan_rows.tolist(),
           "head_0_finite": others_finite,
           "passed": bool(raised) and nan_rows.tolist() == [2] and others_finite}
    out.append(row)
    print(row, flush=True)


def checks(small_only: bool, seeds=(0, 1)) -> list:
    rows: list = []
    small = dict(quant="int8_fp8", num_heads=2)
    check_case("lut", Spec(grid=(8, 12, 16), topk=6, **small), 0, rows)
    check_case("lut_partial", Spec(grid=(6, 7, 9), topk=3, **small), 1, rows)
    check_case("lut_counts", Spec(grid=(8, 12, 16), topk=6, **small), 2, rows,
               counts_fn=lambda cap: torch.randint(0, 7, cap["topk_idx"].shape[:3],
                                                   generator=torch.Generator().manual_seed(5),
                                                   dtype=torch.int32))
    # 10 query cubes, batch 2: a CTA of 3 consumers has dead ones past the grid
    check_case("lut_ragged_b2", Spec(grid=(4, 8, 20), topk=4, batch=2, **small), 3, rows)
    cuda = BACKEND["name"] == "cuda"  # head_dim 128 and the LUT (and mask) encodings only
    if not cuda:
        check_case("lut_hd64", Spec(grid=(8, 12, 16), topk=6, head_dim=64, **small), 0, rows)
    check_case("lut_fp16", Spec(grid=(8, 12, 16), topk=6, dtype="fp16", **small), 0, rows)
    check_case("mask", Spec(encoding="mask", grid=(8, 12, 16), topk=6, **small), 0, rows,
               sorted_idx=True)
    if not cuda:
        check_case("sliding_tile", Spec(encoding="sliding_tile", grid=(8, 12, 16),
                                        window=(1, 3, 3), **small), 0, rows)
    check_bad_index(rows)
    if not small_only:
        for seed in seeds:
            check_case("default_4heads", Spec(quant="int8_fp8", num_heads=4), seed, rows)
    return rows


def _time_one(spec: Spec, do_bench, block_sparse_attention) -> dict:
    cap = captures.synthesize_for(spec, seed=0, device=DEV)
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    op8 = load8(spec.replace(quant="int8_fp8"))
    qi = op8.quantize(q, k, v, vbs)
    t = {"topk": spec.topk, "heads": spec.num_heads, "op8": repr(op8), "variant": dict(VARIANT)}
    t["bf16_op_ms"] = do_bench(lambda: block_sparse_attention(q, k, v, idx, vbs), rep=400)
    t["int8_fp8_op_ms"] = do_bench(lambda: op8(q, k, v, idx, vbs, return_lse=False), rep=400)
    t["int8_fp8_from_quantized_ms"] = do_bench(
        lambda: op8.from_quantized(qi, idx, vbs, return_lse=False), rep=400)
    t["prepass_ms"] = do_bench(lambda: quant.quantize(q, k, v, vbs, "int8_fp8"), rep=400)
    t["prepass_kv_ms"] = do_bench(lambda: quant.quantize(q, k, v, vbs, "int8_fp8",
                                                         with_q=False), rep=400)
    # the reorder to cubes inside the pre-pass (token-order inputs, as a Wan layer has them)
    from tilegen import layout

    src = layout.cube_sources(spec.grid, device=DEV)
    qt, kt, vt = (layout.from_cubes(x, spec.grid) for x in (q, k, v))
    gathered = op8.quantize(qt, kt, vt, vbs, sources=src)
    t["prepass_gather_equal"] = all(
        torch.equal(getattr(gathered, n).view(torch.uint8), getattr(qi, n).view(torch.uint8))
        if getattr(qi, n).dtype == torch.float8_e4m3fn else
        torch.equal(getattr(gathered, n), getattr(qi, n))
        for n in ("q8", "q_scale", "k8", "k_scale", "v8t", "v_scale", "v_mean"))
    t["prepass_op_layout_ms"] = do_bench(lambda: op8.quantize(q, k, v, vbs), rep=400)
    t["prepass_gather_ms"] = do_bench(lambda: op8.quantize(qt, kt, vt, vbs, sources=src),
                                      rep=400)
    t["to_cubes_qkv_ms"] = do_bench(
        lambda: [layout.to_cubes(x, spec.grid, zero_padding=False) for x in (qt, kt, vt)],
        rep=400)
    gathered = qt = kt = vt = None  # free before the next rows
    if BACKEND["name"] == "cuda":  # the Gluon family's 8-bit op in the same process
        gl8 = tilegen.load(spec.replace(quant="int8_fp8"), backend="gluon")
        t["gluon_int8_fp8_op_ms"] = do_bench(lambda: gl8(q, k, v, idx, vbs, return_lse=False),
                                             rep=400)
    t["bf16_op_again_ms"] = do_bench(lambda: block_sparse_attention(q, k, v, idx, vbs), rep=400)
    t["speedup"] = min(t["bf16_op_ms"], t["bf16_op_again_ms"]) / t["int8_fp8_op_ms"]
    print(t, flush=True)
    return t


def timing(topks, heads: int) -> list:
    from triton.testing import do_bench

    from tilegen.ops import block_sparse_attention

    rows = []
    for topk in topks:
        rows.append(_time_one(Spec(num_heads=heads, topk=topk), do_bench,
                              block_sparse_attention))
        torch.cuda.empty_cache()
    return rows


def prebuild(variants: list[dict]) -> None:
    """The CUDA 8-bit cubins of the default config and each variant, compiled with no GPU."""
    from tilegen.backends.cuda import wgmma
    from tilegen.backends.cuda.nvcc import compile_cuda
    from tilegen.backends.cuda.wgmma_op import WgmmaQuantLaunch
    from tilegen.targets import get_target

    target = get_target("sm_90")
    spec = Spec(quant="int8_fp8")
    for opts in [{}, *variants]:
        t0 = time.perf_counter()
        for lse in (True, False):
            cfg = wgmma.config(**{**wgmma.defaults_for(spec), **opts})
            run = WgmmaQuantLaunch(spec.kernel_spec, cfg.replace(store_lse=lse), target)
            compile_cuda(run.source, target, None, run.digest)
        print(f"prebuilt {opts or 'default'} in {time.perf_counter() - t0:.1f}s", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="quant_op.json")
    ap.add_argument("--small-only", action="store_true")
    ap.add_argument("--topks", default="78,31,187")
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--variants", default="")
    ap.add_argument("--variant-topks", default="78")
    ap.add_argument("--backend", choices=("gluon", "cuda"), default="gluon")
    ap.add_argument("--prebuild", action="store_true")
    args = ap.parse_args()
    if args.prebuild:
        prebuild(parse_variants(args.variants))
        return 0
    BACKEND["name"] = args.backend
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "tilegen": tilegen.__version__, "backend": args.backend}
    res["checks"] = checks(args.small_only)
    Path(args.out).write_text(json.dumps(res, indent=2))
    if not args.small_only:
        res["timing"] = timing([int(x) for x in args.topks.split(",")], args.heads)
    Path(args.out).write_text(json.dumps(res, indent=2))
    for opts in parse_variants(args.variants):
        VARIANT.clear()
        VARIANT.update(opts)
        # a variant's own full-size check (the outlier head): its accumulation may differ
        res["checks"] += checks(args.small_only, seeds=(0,))
        if not args.small_only:
            res["timing"] += timing([int(x) for x in args.variant_topks.split(",")], args.heads)
        Path(args.out).write_text(json.dumps(res, indent=2))
    VARIANT.clear()
    print(f"\nchecks passed: {sum(r['passed'] for r in res['checks'])}/{len(res['checks'])}")
    for r in res["checks"]:
        print(f"  {r['case']:16s} {r.get('variant') or 'default'} "
              f"{'PASS' if r['passed'] else 'FAIL'} {r.get('score', '')}")
    for t in res.get("timing", []):
        bf16 = min(t["bf16_op_ms"], t["bf16_op_again_ms"])
        print(f"{t.get('variant') or 'default'} TOPK {t['topk']:4d}: bf16 {bf16:.3f} ms, "
              f"int8_fp8 {t['int8_fp8_op_ms']:.3f} ms (from_quantized "
              f"{t['int8_fp8_from_quantized_ms']:.3f}, pre-pass {t['prepass_ms']:.3f}, "
              f"K/V only {t.get('prepass_kv_ms', float('nan')):.3f}; op's layout "
              f"{t.get('prepass_op_layout_ms', float('nan')):.3f}, token order in "
              f"{t.get('prepass_gather_ms', float('nan')):.3f} "
              f"(equal {t.get('prepass_gather_equal')}), to_cubes x3 "
              f"{t.get('to_cubes_qkv_ms', float('nan')):.3f}): {t['speedup']:.2f}x"
              + (f"; gluon int8_fp8 {t['gluon_int8_fp8_op_ms']:.3f} ms"
                 if "gluon_int8_fp8_op_ms" in t else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
