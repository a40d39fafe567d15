"""Question: Where does mean_pool_topk's time go at full size? (issue #9)

Where `sparsity.mean_pool_topk`'s time goes at full size on the H200 (issue #9 item 3), one
stage at a time, beside the library function: pooling (bf16 bmm rounded to bf16 vs fp32 output),
the coarse scores, the top-k and the sort of the selected ids.

    python bench/experiments/h200_mean_pool_probe.py
"""

from __future__ import annotations

import torch
import triton

from tilegen import captures, sparsity
from tilegen.coarse_gpu import pool_means, row_topk_ids


def ms(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def main() -> int:
    cap = captures.synthesize(seed=0, device="cuda")
    q, k, vbs = cap["q"], cap["k"], cap["vbs"]
    b, s, h, d = q.shape
    nc = s // 64
    w = (torch.arange(64, device="cuda")[None, :] < vbs[:, None].long()).to(q.dtype)
    w = w.unsqueeze(0).expand(b, nc, 64).reshape(b * nc, 1, 64)
    x = q.reshape(b * nc, 64, h * d)
    pq = sparsity.pool_cubes(q, vbs)
    pk = sparsity.pool_cubes(k, vbs)
    scores = pq @ pk.transpose(-1, -2)
    rows = {
        "mean_pool_topk (library)": ms(lambda: sparsity.mean_pool_topk(q, k, vbs, 78)),
        "pool_cubes(q) (library, torch)": ms(lambda: sparsity.pool_cubes(q, vbs)),
        "pool_means(q) (one Triton launch)": ms(lambda: pool_means(q, vbs)),
        "row_topk_ids (one Triton launch)": ms(lambda: row_topk_ids(scores, 78)),
        "bmm bf16 out, q": ms(lambda: torch.bmm(w, x)),
        "bmm fp32 out, q": ms(lambda: torch.bmm(w, x, out_dtype=torch.float32)),
        "view-sum fp32, q": ms(lambda: q.view(b, nc, 64, h, d).sum(2, dtype=torch.float32)),
        "scores (fp32 matmul)": ms(lambda: pq @ pk.transpose(-1, -2)),
        "topk(78, sorted=False)": ms(lambda: scores.topk(78, dim=-1, sorted=False)),
        "topk(78, sorted=True)": ms(lambda: scores.topk(78, dim=-1)),
        "sort rows, slice 78": ms(lambda: scores.sort(dim=-1, descending=True)),
        "sort 78 ids": ms(lambda: scores.topk(78, dim=-1, sorted=False).indices.sort(-1)),
    }
    from tilegen.coarse_gpu import _pool_kernel

    out = torch.empty((b, h, nc, d), dtype=torch.float32, device="cuda")
    for heads, rows_, warps in ((4, 16, 4), (4, 32, 8), (2, 32, 4), (8, 8, 4), (8, 16, 8),
                                (4, 8, 2)):
        rows[f"pool kernel heads={heads} rows={rows_} warps={warps}"] = ms(
            lambda heads=heads, rows_=rows_, warps=warps: _pool_kernel[(nc, b * h // heads)](
                q, vbs, vbs, out, s, h, nc, HEAD_DIM=d, HEADS=heads, BLOCK=64, ROWS=rows_,
                GATHER=False, num_warps=warps))
    torch.cuda.set_sync_debug_mode("error")
    idx = sparsity.mean_pool_topk(q, k, vbs, 78)  # no host sync on the selection path
    torch.cuda.set_sync_debug_mode(0)
    ref = scores.topk(78, dim=-1).indices.sort(-1).values.int()
    agree = float((idx == ref).all(-1).float().mean())
    for name, t in rows.items():
        print(f"{name:36s} {t:8.3f} ms")
    print(f"rows whose selection equals torch.topk on the torch-pooled scores: {agree:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
