"""Question (issue #22; session 25): what does the 8-bit THW layer gain when its pre-pass applies
Wan's q/k prologue (RMSNorm across heads, rotary embedding) as it reads the projections
(``quantize(..., norm_rope=...)``), so that the normalized q and k (2 x 335 MB) are never
written and read again? And is the result the prologue-then-pre-pass result bit for bit?

    PYTHONPATH=$PWD python3 bench/experiments/gpu_s25_fused.py --out $OUT/fused.json

One process, random bf16 projections of the Wan layer (THW tokens, 21 x 30 x 52, 40 heads x
128; one head of k offset, one token of q 300x), fp32 rotary tables of Wan's shape, 87.5%.
Checks first (two seeds), then the pieces and the layer both ways, the table last.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from triton.testing import do_bench

WAN_GRID = (21, 30, 52)
HEADS, DIM = 40, 128


def _ms(fn) -> float:
    return float(do_bench(fn, warmup=25, rep=200))


def _tables(n_tok: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan-like (1, S, 1, D) fp32 tables: angles repeated for each channel pair."""
    pos = torch.arange(n_tok, device=dev, dtype=torch.float64)[:, None]
    freqs = 10000.0 ** (-torch.arange(DIM // 2, device=dev, dtype=torch.float64) / (DIM // 2))
    ang = (pos * freqs).repeat_interleave(2, dim=-1)
    return ang.cos().float()[None, :, None, :], ang.sin().float()[None, :, None, :]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from tilegen import layout, prologue, quant
    from tilegen.ops import _quant_op_for, block_sparse_attention_8bit_thw

    dev = torch.device("cuda")
    rows: dict[str, float] = {}
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                 "checks": {}}

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    def say(name: str, ms: float) -> None:
        rows[name] = ms
        print(f"{name}: {ms:.3f} ms", flush=True)
        save()

    def check(name: str, value) -> None:
        res["checks"][name] = value
        print(f"check {name}: {value}", flush=True)
        save()

    n_tok = math.prod(WAN_GRID)
    vbs = layout.vbs_for_grid(WAN_GRID, device=dev)
    src = layout.cube_sources(WAN_GRID, device=dev)
    topk = vbs.numel() // 8
    op = _quant_op_for(torch.empty(1, 1, 1, DIM, dtype=torch.bfloat16, device=dev), "int8_fp8")
    cos, sin = prologue.rope_tables(*_tables(n_tok, dev))

    def inputs(seed: int):
        g = torch.Generator(device=dev).manual_seed(seed)
        q, k, v = (torch.randn(1, n_tok, HEADS, DIM, device=dev, generator=g)
                   .to(torch.bfloat16) for _ in range(3))
        k[:, :, 3] += 2.0
        q[0, 7] *= 300.0
        qw, kw = ((torch.rand(HEADS * DIM, device=dev, generator=g) + 0.5).to(torch.bfloat16)
                  for _ in range(2))
        return q, k, v, prologue.NormRope(qw, kw, 1e-6, 1e-6, cos, sin)

    def unfused(q, k, nr):
        return prologue.rms_norm_rope(q.flatten(2), k.flatten(2), nr.q_weight, nr.k_weight,
                                      nr.q_eps, nr.k_eps, nr.cos, nr.sin, HEADS)

    names = ("q8", "q_scale", "k8", "k_scale", "k_mean", "v8t", "v_scale", "v_mean", "q_pool",
             "k_pool")
    for seed in (0, 1):
        q, k, v, nr = inputs(seed)
        qn, kn = unfused(q, k, nr)
        # the prologue against its PyTorch model (no fma there): ulps of bf16
        for name, got, x, w in (("q", qn, q, nr.q_weight), ("k", kn, k, nr.k_weight)):
            ref = prologue.rms_norm_rope_torch(x.flatten(2), w, 1e-6, cos, sin, HEADS)
            diff = (got.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
            check(f"seed{seed}_prologue_{name}_vs_model", {
                "max_ulps": int(diff.max()), "frac_differ": float((diff > 0).float().mean())})
        want = op.quantize(qn, kn, v, vbs, sources=src, pool=True)
        got = op.quantize(q, k, v, vbs, sources=src, pool=True, norm_rope=nr)
        equal = {}
        for name in names:
            a, b = getattr(got, name), getattr(want, name)
            if a.dtype == torch.float8_e4m3fn:
                a, b = a.view(torch.uint8), b.view(torch.uint8)
            equal[name] = bool(torch.equal(a, b))
        check(f"seed{seed}_prepass_fused_equal", equal)
        o_want = block_sparse_attention_8bit_thw(qn, kn, v, WAN_GRID, topk)
        o_got = block_sparse_attention_8bit_thw(q, k, v, WAN_GRID, topk, norm_rope=nr)
        check(f"seed{seed}_layer_fused_equal", bool(torch.equal(o_got, o_want)))
        check(f"seed{seed}_layer_finite", bool(torch.isfinite(o_got).all()))
    del qn, kn, want, got, o_want, o_got

    q, k, v, nr = inputs(0)
    qn, kn = unfused(q, k, nr)
    say("prologue (q and k, rms_norm_rope)", _ms(lambda: unfused(q, k, nr)))
    say("norm scales (rms_rsqrt)", _ms(lambda: prologue.rms_rsqrt(q, k, 1e-6, 1e-6)))
    say("pre-pass, pool", _ms(lambda: op.quantize(qn, kn, v, vbs, sources=src, pool=True)))
    say("pre-pass, pool, norm_rope (scales included)",
        _ms(lambda: op.quantize(q, k, v, vbs, sources=src, pool=True, norm_rope=nr)))
    say("prologue + pre-pass", _ms(lambda: op.quantize(*unfused(q, k, nr), v, vbs, sources=src,
                                                        pool=True)))
    for heads in (1, 2, 4, 8):  # heads a program takes in turn (the tables from L1 after one)
        say(f"pre-pass, pool, norm_rope, {heads} heads a program (scales included)",
            _ms(lambda h=heads: quant.quantize_triton(q, k, v, vbs, "int8_fp8", vt_slots=True,
                                                      sources=src, pool=True, norm_rope=nr,
                                                      heads_per_program=h)))
    for heads in (2, 8):
        say(f"pre-pass, pool, {heads} heads a program",
            _ms(lambda h=heads: quant.quantize_triton(qn, kn, v, vbs, "int8_fp8", vt_slots=True,
                                                      sources=src, pool=True,
                                                      heads_per_program=h)))
    say("layer: prologue, then the THW op",
        _ms(lambda: block_sparse_attention_8bit_thw(*unfused(q, k, nr), v, WAN_GRID, topk)))
    say("layer: the THW op with norm_rope",
        _ms(lambda: block_sparse_attention_8bit_thw(q, k, v, WAN_GRID, topk, norm_rope=nr)))
    say("layer: prologue, then the THW op (again)",
        _ms(lambda: block_sparse_attention_8bit_thw(*unfused(q, k, nr), v, WAN_GRID, topk)))
    fused = rows["pre-pass, pool, norm_rope (scales included)"]
    res["fused_faster"] = fused < rows["prologue + pre-pass"]
    save()
    print("\n| piece | ms |\n|---|---|")
    for name, ms in rows.items():
        print(f"| {name} | {ms:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
