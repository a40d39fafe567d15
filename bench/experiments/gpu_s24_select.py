"""Question (issue #22; session 24): what do the THW 8-bit layer's selection and pre-pass cost
when (a) the pre-pass pools q and k from its own read of them (``quantize(..., pool=True)``, its
column sums one a warp so that no sum crosses warps) and (b) the scores GEMM runs on the tensor
cores (`coarse_gpu.scores_of_means`, tf32x3) instead of cuBLAS's fp32 FMA kernel? And do they
select what the pooling path selects?

    PYTHONPATH=$PWD python3 bench/experiments/gpu_s24_select.py --out $OUT/select.json

One process, random bf16 q, k, v of the Wan layer (THW tokens, 21 x 30 x 52, 40 heads x 128),
87.5% sparsity. Rows: the pieces of both paths and the whole layer as the op runs it (new) and
as it ran before (pooling launches, cuBLAS scores, top-k, pre-pass, kernel), the table last.
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from tilegen import layout, sparsity
    from tilegen.coarse_gpu import pool_means, row_topk_ids, scores_of_means
    from tilegen.ops import _quant_op_for, block_sparse_attention_8bit_thw

    dev = torch.device("cuda")
    rows: dict[str, float] = {}
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                 "checks": {}}

    def say(name: str, ms: float) -> None:
        rows[name] = ms
        print(f"{name}: {ms:.3f} ms", flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    def check(name: str, value) -> None:
        res["checks"][name] = value
        print(f"check {name}: {value}", flush=True)

    n_tok = math.prod(WAN_GRID)
    vbs = layout.vbs_for_grid(WAN_GRID, device=dev)
    src = layout.cube_sources(WAN_GRID, device=dev)
    slot_rows = layout.slot_tokens(WAN_GRID, device=dev)
    n_cubes = vbs.numel()
    topk = n_cubes // 8
    op = _quant_op_for(torch.empty(1, 1, 1, DIM, dtype=torch.bfloat16, device=dev), "int8_fp8")
    def seed_checks(seed: int):
        g = torch.Generator(device=dev).manual_seed(seed)
        q, k, v = (torch.randn(1, n_tok, HEADS, DIM, generator=g, device=dev).bfloat16()
                   for _ in range(3))
        q[:, :, 7] *= 8.0  # an outlier head (large logits)
        k[:, :, 7] += 2.0
        qm, km = pool_means(q, vbs, sources=src), pool_means(k, vbs, sources=src)
        cublas = qm @ km.transpose(-1, -2)
        mine = scores_of_means(qm, km)
        exact = (qm.double() @ km.double().transpose(-1, -2))
        scale = exact.abs().amax(-1, keepdim=True)
        check(f"seed{seed}_scores_err_cublas", ((cublas - exact).abs() / scale).max().item())
        check(f"seed{seed}_scores_err_tf32x3", ((mine - exact).abs() / scale).max().item())
        idx_old = row_topk_ids(cublas, topk)
        idx_mine = row_topk_ids(mine, topk)
        pooled = op.quantize(q, k, v, vbs, sources=src, pool=True)
        plain = op.quantize(q, k, v, vbs, sources=src)
        same = all(torch.equal(getattr(pooled, n).view(torch.uint8), getattr(plain, n).view(
            torch.uint8)) for n in ("q8", "q_scale", "k8", "k_scale", "v8t"))
        check(f"seed{seed}_prepass_bytes_equal_with_pool", same)
        check(f"seed{seed}_pool_elements_differing",
              int((pooled.q_pool != qm).sum() + (pooled.k_pool != km).sum()))
        idx_new = sparsity.topk_of_means(pooled.q_pool, pooled.k_pool, topk)
        check(f"seed{seed}_rows_equal_tf32x3_vs_cublas",
              float((idx_mine == idx_old).all(-1).float().mean()))
        check(f"seed{seed}_rows_equal_new_vs_old",
              float((idx_new == idx_old).all(-1).float().mean()))
        o_new = block_sparse_attention_8bit_thw(q, k, v, WAN_GRID, topk)
        o_old = op.from_quantized(plain, idx_old, vbs, return_lse=False, out_rows=slot_rows,
                                  out_len=n_tok)
        check(f"seed{seed}_o_equal_new_vs_old", bool(torch.equal(o_new, o_old)))
        check(f"seed{seed}_o_rel_l1_new_vs_old",
              ((o_new.float() - o_old.float()).abs().sum() / o_old.float().abs().sum()).item())
        check(f"seed{seed}_o_finite", bool(torch.isfinite(o_new).all()))
        return q, k, v, qm, km, mine, pooled, plain, idx_old

    for seed in (1, 2):
        seed_checks(seed)
    q, k, v, qm, km, mine, pooled, plain, idx_old = seed_checks(0)
    say("pool_means_q_and_k", _ms(lambda: (pool_means(q, vbs, sources=src),
                                            pool_means(k, vbs, sources=src))))
    say("scores_cublas_fp32", _ms(lambda: qm @ km.transpose(-1, -2)))
    say("scores_tf32x3", _ms(lambda: scores_of_means(qm, km)))
    say("row_topk", _ms(lambda: row_topk_ids(mine, topk)))
    say("select_thw_now", _ms(lambda: sparsity.mean_pool_topk_thw(q, k, WAN_GRID, topk)))
    say("prepass", _ms(lambda: op.quantize(q, k, v, vbs, sources=src)))
    say("prepass_pool", _ms(lambda: op.quantize(q, k, v, vbs, sources=src, pool=True)))
    say("select_from_means", _ms(lambda: sparsity.topk_of_means(pooled.q_pool, pooled.k_pool,
                                                                 topk)))
    say("kernel_token_order", _ms(lambda: op.from_quantized(
        plain, idx_old, vbs, return_lse=False, out_rows=slot_rows, out_len=n_tok)))

    def old_layer():
        a, b = pool_means(q, vbs, sources=src), pool_means(k, vbs, sources=src)
        idx = row_topk_ids(a @ b.transpose(-1, -2), topk)
        qi = op.quantize(q, k, v, vbs, sources=src)
        return op.from_quantized(qi, idx, vbs, return_lse=False, out_rows=slot_rows,
                                 out_len=n_tok)

    say("layer_old_path", _ms(old_layer))
    say("layer_op_now", _ms(lambda: block_sparse_attention_8bit_thw(q, k, v, WAN_GRID, topk)))
    say("layer_old_path_again", _ms(old_layer))
    print("\n| row | ms |\n|---|---|")
    for name, ms in rows.items():
        print(f"| {name} | {ms:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
