"""Question (issue #22; session 24): where do the 8-bit pre-pass's 0.81 ms go on the Wan layer
now that it pools q and k too (`quantize(..., pool=True)`), and does another program shape or a
launch of its own for V (the Q and K programs then compiled without V's code, the V programs
without the pooling) do better? And which tile of `coarse_gpu.scores_of_means` is fastest?

    PYTHONPATH=$PWD python3 bench/experiments/gpu_s24_prepass.py --out $OUT/prepass.json

Random bf16 q, k, v of the Wan layer (THW tokens, 21 x 30 x 52, 40 heads x 128). Every variant's
outputs are compared with the production pass's bytes; the table is printed last.
"""

from __future__ import annotations

import argparse
import functools
import json
import math

import torch
import triton
from triton.testing import do_bench

WAN_GRID = (21, 30, 52)
HEADS, DIM = 40, 128


def _ms(fn) -> float:
    return float(do_bench(fn, warmup=25, rep=200))


def split_pass(q, k, v, vbs, src, tokens: int, warps: int):
    """The pass as two launches after the statistics: Q and K (pooling; FP8_V off, so V's code
    is not in that build), then V alone (no pooling)."""
    from tilegen import quant
    from tilegen.coarse_gpu import pool_from_sums

    B, S_in, H, D = q.shape
    S = src.numel()
    n = S // 64
    dev = q.device
    f32 = dict(dtype=torch.float32, device=dev)
    q8 = torch.empty((B, S, H, D), dtype=torch.int8, device=dev)
    k8 = torch.empty_like(q8)
    q_scale, k_scale = torch.empty((B, H, S), **f32), torch.empty((B, H, S), **f32)
    k_mean, v_scale, v_mean = (torch.empty((B, H, D), **f32) for _ in range(3))
    v8t = torch.empty((B, H, D, S), dtype=torch.float8_e4m3fn, device=dev)
    chunks = S // tokens
    sums = torch.empty((2, B * H, chunks * warps, D), **f32)
    quant._stats_kernel[(B * H,)](
        k, v, src, k_mean, v_scale, v_mean, S_in, H, n, len(quant.sample_cubes(n)), GATHER=True,
        FP8_V=True, HEAD_DIM=D, BLOCK=64, SAMPLE=triton.next_power_of_2(quant.SAMPLE_CUBES),
        E4M3=quant.E4M3_MAX, HEADROOM=quant.V_HEADROOM, num_warps=warps)
    common = dict(GATHER=True, POOL_PARTS=warps, POOL_LANE_ROWS=512 // D, VT_TILES=False,
                  VT_SLOTS=True, HEAD_DIM=D, BLOCK=64, TOKENS=tokens, E4M3=quant.E4M3_MAX,
                  K_GROUP=quant.K_SCALE_GROUP, num_warps=warps)
    args = (q, k, v, vbs, q8, q_scale, k8, k_scale, k_mean, v8t, v_scale, v_mean, src, sums,
            S, S_in, H, B * H)
    quant._quantize_kernel[(chunks * B * H, 1, 2)](*args, 0, POOL=True, FP8_V=False, **common)
    quant._quantize_kernel[(chunks * B * H, 1, 1)](*args, 2, POOL=False, FP8_V=True, **common)
    means = pool_from_sums(sums.view(2 * B * H, chunks * warps, D), vbs, q.dtype)
    return q8, q_scale, k8, k_scale, v8t, means


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from tilegen import coarse_gpu, layout, quant

    dev = torch.device("cuda")
    rows: dict[str, float] = {}
    res: dict = {"gpu": torch.cuda.get_device_name(), "rows": rows, "equal": {}}

    def say(name: str, ms: float) -> None:
        rows[name] = ms
        print(f"{name}: {ms:.3f} ms", flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    def same(name: str, got, want) -> None:
        ok = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                 for a, b in zip(got, want, strict=True))
        res["equal"][name] = ok
        print(f"equal {name}: {ok}", flush=True)

    n_tok = math.prod(WAN_GRID)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, n_tok, HEADS, DIM, generator=g, device=dev).bfloat16()
               for _ in range(3))
    vbs = layout.vbs_for_grid(WAN_GRID, device=dev)
    src = layout.cube_sources(WAN_GRID, device=dev)
    run = functools.partial(quant.quantize_triton, q, k, v, vbs, "int8_fp8", vt_slots=True,
                            sources=src)
    base = run(pool=True)
    want = (base.q8, base.q_scale, base.k8, base.k_scale, base.v8t,
            torch.cat([base.q_pool.flatten(0, 1), base.k_pool.flatten(0, 1)]))
    say("pass_no_pool_t32_w2", _ms(lambda: run()))
    say("pass_pool_t32_w2 (production)", _ms(lambda: run(pool=True)))
    for tokens, warps in ((32, 4), (64, 2), (64, 4)):
        qi = run(pool=True, tokens=tokens, num_warps=warps)
        same(f"t{tokens}_w{warps}", (qi.q8, qi.q_scale, qi.k8, qi.k_scale, qi.v8t), want[:5])
        say(f"pass_pool_t{tokens}_w{warps}",
            _ms(lambda t=tokens, w=warps: run(pool=True, tokens=t, num_warps=w)))
    for tokens, warps in ((32, 2), (64, 4)):
        got = split_pass(q, k, v, vbs, src, tokens, warps)
        same(f"split_t{tokens}_w{warps}", got[:5], want[:5])
        say(f"pass_split_t{tokens}_w{warps}",
            _ms(lambda t=tokens, w=warps: split_pass(q, k, v, vbs, src, t, w)))
    sums = torch.randn(80, 1024 * 2, DIM, device=dev)
    say("pool_from_sums", _ms(lambda: coarse_gpu.pool_from_sums(sums, vbs, torch.bfloat16)))
    qm, km = base.q_pool, base.k_pool
    out = torch.empty(1, HEADS, vbs.numel(), vbs.numel(), device=dev)
    ref = coarse_gpu.scores_of_means(qm, km)
    for bm, bn, warps in ((64, 64, 4), (128, 64, 4), (128, 128, 8), (64, 128, 4)):
        def launch(bm=bm, bn=bn, warps=warps):
            coarse_gpu._scores_kernel[(triton.cdiv(qm.shape[2], bm),
                                       triton.cdiv(km.shape[2], bn), HEADS)](
                qm, km, out, qm.shape[2], km.shape[2], HEADS, HEADS, HEAD_DIM=DIM, BM=bm,
                BN=bn, BK=DIM, PRECISION="tf32x3", num_warps=warps)
        launch()
        res["equal"][f"scores_{bm}x{bn}_w{warps}"] = bool(torch.equal(out, ref))
        say(f"scores_{bm}x{bn}_w{warps}", _ms(launch))
    print("\n| row | ms |\n|---|---|")
    for name, ms in rows.items():
        print(f"| {name} | {ms:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
