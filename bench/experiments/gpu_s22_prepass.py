"""Question (issues #19, #22; session 22): what do the 8-bit pre-pass and the THW layer's
selection cost, and how much does the pre-pass gain from programs with the heads as the fastest
grid axis (each token's heads read and written side by side)? Run once per tree, this one and
the one before (``.base``), same GPU:

    PYTHONPATH=$PWD python3 bench/experiments/gpu_s22_prepass.py --out $OUT/prepass_new.json
    (cd .base && PYTHONPATH=$PWD python3 ../bench/experiments/gpu_s22_prepass.py --out ...)

Rows: the pre-pass on the default workload (cube-major, 39,936 x 40 x 128) and on the Wan
layer's THW tokens (21 x 30 x 52 = 32,760, gathered by the pass), its outputs' sha256 (the
two trees must write the same bytes), the THW selection, the pre-pass's program shapes, the
8-bit THW op as users call it, and the kernel alone. The table is printed last.

Runs 1 and 2 of session 22 also timed a build, since removed, whose pre-pass pooled q and k
for the selection (``quantize(..., pool=True)``): the pooling cost the pre-pass 0.19-0.23 ms and
saved the selection 0.27. Run 9 timed the statistics from a launch of their own as an option
(``quantize_triton(..., stats_first=True)``, rows ``*_stats_first``, the same bytes): 15% faster,
since the only path (bench/NOTES.md, session 22).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math

import torch
from triton.testing import do_bench

WAN_GRID = (21, 30, 52)
HEADS, DIM = 40, 128


def _ms(fn) -> float:
    return float(do_bench(fn, warmup=25, rep=200))


def _sha(t: torch.Tensor | None) -> str:
    if t is None:
        return "-"
    b = t.contiguous().view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.sha256(b).hexdigest()[:16]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from tilegen import layout, quant, sparsity
    from tilegen.ops import _quant_op_for, block_sparse_attention_8bit_thw

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows: dict[str, dict] = {}
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "rows": rows, "sha": {}}

    def say(name: str, ms: float, gbytes: float | None = None, **extra) -> None:
        rows[name] = {"ms": ms, **extra}
        rate = ""
        if gbytes is not None:
            rows[name]["tb_s"] = gbytes / ms
            rate = f" ({gbytes / ms:.2f} TB/s of {gbytes:.2f} GB)"
        print(f"{name}: {ms:.3f} ms{rate}", flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    def hashes(label: str, qi) -> None:
        res["sha"][label] = {n: _sha(getattr(qi, n)) for n in
                             ("q8", "q_scale", "k8", "k_scale", "k_mean", "v8t", "v_scale",
                              "v_mean")}
        print(f"sha {label}: {res['sha'][label]}", flush=True)

    # -- the default workload, cube-major -------------------------------------------------
    S = 624 * 64
    q, k, v = (torch.randn(1, S, HEADS, DIM, generator=g, device=dev).bfloat16()
               for _ in range(3))
    vbs = torch.full((624,), 64, dtype=torch.int32, device=dev)
    op = _quant_op_for(q, "int8_fp8")
    # read 3 x 2 bytes, written 3 x 1 byte a value (the scales and samples are small)
    gb = 3 * 3 * S * HEADS * DIM / 1e9
    hashes("default", op.quantize(q, k, v, vbs))
    say("prepass_default", _ms(lambda: op.quantize(q, k, v, vbs)), gb)
    del q, k, v
    torch.cuda.empty_cache()

    # -- the Wan layer: THW tokens ----------------------------------------------------------
    n_tok = math.prod(WAN_GRID)
    q, k, v = (torch.randn(1, n_tok, HEADS, DIM, generator=g, device=dev).bfloat16()
               for _ in range(3))
    vbs = layout.vbs_for_grid(WAN_GRID, device=dev)
    src = layout.cube_sources(WAN_GRID, device=dev)
    n_cubes = vbs.numel()
    topk = n_cubes // 8  # 87.5%
    gb = (3 * 2 * n_tok + 3 * n_cubes * 64) * HEADS * DIM / 1e9
    qi = op.quantize(q, k, v, vbs, sources=src)
    hashes("wan_thw", qi)
    say("prepass_wan_thw", _ms(lambda: op.quantize(q, k, v, vbs, sources=src)), gb)
    idx = sparsity.mean_pool_topk_thw(q, k, WAN_GRID, topk)
    say("select_thw_pooling", _ms(lambda: sparsity.mean_pool_topk_thw(q, k, WAN_GRID, topk)),
        2 * 2 * n_tok * HEADS * DIM / 1e9)
    # the pre-pass's program shape (tokens a program, warps)
    for tokens, warps in ((32, 2), (32, 4), (64, 2), (64, 4), (64, 8)):
        fn = functools.partial(quant.quantize_triton, q, k, v, vbs, "int8_fp8", vt_slots=True,
                               sources=src, tokens=tokens, num_warps=warps)
        say(f"prepass_wan_thw_t{tokens}_w{warps}", _ms(fn), gb)
    say("kernel_from_quantized",
        _ms(lambda: op.from_quantized(qi, idx, vbs, return_lse=False)))
    oc = op.from_quantized(qi, idx, vbs, return_lse=False)
    say("from_cubes", _ms(lambda: layout.from_cubes(oc, WAN_GRID)))
    o = block_sparse_attention_8bit_thw(q, k, v, WAN_GRID, topk)
    res["thw_op_finite"] = bool(torch.isfinite(o).all())
    res["thw_op_sha"] = _sha(o)
    want = layout.from_cubes(oc, WAN_GRID)
    res["thw_op_rel_l1_vs_pooling_path"] = ((o.float() - want.float()).abs().sum()
                                            / want.float().abs().sum()).item()
    say("thw_op", _ms(lambda: block_sparse_attention_8bit_thw(q, k, v, WAN_GRID, topk)))
    print(f"thw_op: finite {res['thw_op_finite']}, rel-L1 against the pooling path's o "
          f"{res['thw_op_rel_l1_vs_pooling_path']:.2e}", flush=True)

    print("\n| row | ms | TB/s |\n|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['ms']:.3f} | {r.get('tb_s', float('nan')):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
