"""Question: How well do the coarse selectors find the cubes dense attention actually uses? (issue
#9)

Recall study: how well do the coarse selectors find the cubes dense attention actually uses?

On synthesized Wan2.2-like captures (`tilegen.captures.synthesize`, outlier head included), per
(batch, head, query cube) the exact dense attention mass on each KV cube is
``M[i, j] = mean over the real query tokens of cube i of sum over the real keys of cube j of
softmax(q k^T * sm_scale)`` (fp32, all real keys). Every selector gets the same budget, the
mean number of KV cubes per query cube (``--density`` of the cubes):

* ``oracle``: the exact top-``budget`` cubes of ``M`` (the best any selector can do);
* ``mean_pool_topk``: top-``budget`` of the mean-pooled coarse scores (VSA);
* ``cdf_select``: the coverage ``p`` bisected so the mean row length is <= budget (rows vary);
* ``jenga box`` / ``jenga face``: importance top-k' union forced adjacency (3x3x3 box or face
  neighbours), k' the largest whose mean row length is <= budget.

Columns: ``recall`` = |S ∩ E| / |E| with E the exact top-``budget`` set (mean over rows),
``mass`` = the fraction of the exact attention mass the selection covers (mean over rows), and
the output error of block-sparse attention with the selection against dense attention (fp32
reference attention, no kernel error): per-head cosine (min over heads), mean|Δ| and max|Δ|
over real tokens.

    python3 bench/experiments/recall_study.py --cpu-small          # CPU, seconds
    python3 bench/experiments/recall_study.py --grid 21 30 52 --heads 2     # on a GPU
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tilegen import captures, sparsity  # noqa: E402
from tilegen.reference import attention_fp32, query_valid  # noqa: E402

SELECTORS = ("oracle", "mean_pool_topk", "cdf_select", "jenga box", "jenga face")


def dense_mass_and_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vbs: torch.Tensor,
                          block: int, chunk: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact dense attention over real keys: (mass (B, H, NQ, NKV), o (B, S, H, D)) in fp32."""
    B, S, H, D = q.shape
    nc = S // block
    scale = 1.0 / math.sqrt(D)
    kvalid = query_valid(vbs, S, block, q.device)  # real key slots
    qvalid = kvalid.view(nc, block).float()
    nreal = qvalid.sum(-1)
    mass = torch.empty(B, H, nc, nc, dtype=torch.float32, device=q.device)
    o = torch.empty(B, S, H, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        for h in range(H):
            kh, vh = k[b, :, h].float(), v[b, :, h].float()
            for c0 in range(0, nc, chunk):
                c1 = min(nc, c0 + chunk)
                qh = q[b, c0 * block:c1 * block, h].float()
                s = (qh @ kh.T) * scale
                s.masked_fill_(~kvalid[None, :], float("-inf"))
                p = torch.softmax(s, dim=-1)
                o[b, c0 * block:c1 * block, h] = p @ vh
                per_cube = p.view(c1 - c0, block, nc, block).sum(-1)  # (c, block, NKV)
                w = qvalid[c0:c1, :, None]
                mass[b, h, c0:c1] = (per_cube * w).sum(1) / nreal[c0:c1, None]
    return mass, o


def _largest_under(fn, lo: float, hi: float, budget: float, steps: int, integer: bool):
    """The largest x in [lo, hi] with fn(x) <= budget (fn non-decreasing), by bisection."""
    best = lo
    for _ in range(steps):
        if integer and hi - lo <= 0:
            break
        mid = (lo + hi + (1 if integer else 0)) // 2 if integer else (lo + hi) / 2
        if fn(mid) <= budget:
            best, lo = mid, mid
        else:
            hi = mid - 1 if integer else mid
    return best


def selections(cap: dict, mass: torch.Tensor, budget: int) -> dict[str, tuple[torch.Tensor, str]]:
    """Each selector's (B, H, NQ, NKV) bool mask at the budget, with its parameter."""
    q, k, vbs, block = cap["q"], cap["k"], cap["vbs"], cap["block"]
    nkv = mass.shape[-1]
    out = {}
    oracle = torch.zeros_like(mass, dtype=torch.bool)
    oracle.scatter_(-1, mass.topk(budget, dim=-1).indices, True)
    out["oracle"] = (oracle, f"top-{budget} of exact mass")
    idx = sparsity.mean_pool_topk(q, k, vbs, budget, block=block)
    out["mean_pool_topk"] = (sparsity.lut_to_mask(idx, nkv), f"topk={budget}")

    def cdf_rows(p: float) -> float:
        return float(sparsity.cdf_mask(q, k, vbs, p, block=block).sum(-1).float().mean())

    p = _largest_under(cdf_rows, 1e-6, 1.0, budget, 30, integer=False)
    out["cdf_select"] = (sparsity.cdf_mask(q, k, vbs, p, block=block), f"p={p:.4f}")
    for kind in ("box", "face"):
        def jenga_rows(kk: int, kind=kind) -> float:
            m = sparsity.jenga_mask(q, k, int(kk), cap["grid"], cap["cube"], adjacency=kind)
            return float(m.sum(-1).float().mean())

        kk = int(_largest_under(jenga_rows, 0, budget, budget, 12, integer=True))
        m = sparsity.jenga_mask(q, k, kk, cap["grid"], cap["cube"], adjacency=kind)
        out[f"jenga {kind}"] = (m, f"topk'={kk}+{kind}")
    return out


def study(grid=(12, 20, 24), heads=4, head_dim=64, density=0.125, seeds=(0, 1),
          device="cpu", dtype=torch.bfloat16, chunk=16) -> list[dict]:
    """Rows of the table, one per selector, averaged over the seeds' captures."""
    acc: dict[str, dict] = {}
    for seed in seeds:
        cap = captures.synthesize(seed=seed, grid=grid, heads=heads, head_dim=head_dim, topk=1,
                                  outlier=True, dtype=dtype, device=device)
        q, k, v, vbs, block = cap["q"], cap["k"], cap["v"], cap["vbs"], cap["block"]
        S = q.shape[1]
        nkv = S // block
        budget = max(1, round(density * nkv))
        mass, o_dense = dense_mass_and_output(q, k, v, vbs, block, chunk)
        exact = torch.zeros_like(mass, dtype=torch.bool)
        exact.scatter_(-1, mass.topk(budget, dim=-1).indices, True)
        real = query_valid(vbs, S, block, q.device)
        for name, (mask, param) in selections(cap, mass, budget).items():
            idx, counts = sparsity.mask_to_lut(mask)
            o_sel, _ = attention_fp32(q, k, v, idx, vbs, counts, block=block)
            a, r = o_sel[:, real], o_dense[:, real]  # (B, n_real, H, D)
            cos = torch.nn.functional.cosine_similarity(
                a.permute(0, 2, 1, 3).flatten(2).double(),
                r.permute(0, 2, 1, 3).flatten(2).double(), dim=-1)  # (B, H)
            row = acc.setdefault(name, {"selector": name, "param": [], "budget": [],
                                        "recall": [], "mass": [], "min_head_cos": [],
                                        "mean_abs": [], "max_abs": []})
            row["param"].append(param)
            row["budget"].append(float(mask.sum(-1).float().mean()))
            row["recall"].append(float((mask & exact).sum(-1).float().mean() / budget))
            row["mass"].append(float((mass * mask).sum(-1).mean()))
            row["min_head_cos"].append(float(cos.min()))
            row["mean_abs"].append(float((a - r).abs().mean()))
            row["max_abs"].append(float((a - r).abs().max()))
        meta = {"grid": list(grid), "heads": heads, "head_dim": head_dim, "cubes": nkv,
                "budget": budget, "seeds": list(seeds), "device": str(device)}
    rows = []
    for name in SELECTORS:
        r = acc[name]
        rows.append({"selector": name, "param": ", ".join(dict.fromkeys(r["param"])),
                     "cubes_per_row": sum(r["budget"]) / len(r["budget"]),
                     "recall": sum(r["recall"]) / len(r["recall"]),
                     "mass": sum(r["mass"]) / len(r["mass"]),
                     "min_head_cos": min(r["min_head_cos"]),
                     "mean_abs": sum(r["mean_abs"]) / len(r["mean_abs"]),
                     "max_abs": max(r["max_abs"]), **meta})
    return rows


def table(rows: list[dict]) -> str:
    m = rows[0]
    head = (f"recall study: grid {tuple(m['grid'])}, {m['cubes']} cubes, {m['heads']} heads "
            f"(outlier incl.), D={m['head_dim']}, budget {m['budget']} cubes/row, seeds "
            f"{m['seeds']}, {m['device']}")
    lines = [head, "",
             "| selector | parameter | cubes/row | recall@budget | mass covered | "
             "min head cos | mean abs err | max abs err |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['selector']} | {r['param']} | {r['cubes_per_row']:.2f} | "
                     f"{r['recall']:.3f} | {r['mass']:.3f} | {r['min_head_cos']:.5f} | "
                     f"{r['mean_abs']:.2e} | {r['max_abs']:.2e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-small", action="store_true",
                    help="CPU: grid 12x20x24 (90 cubes), 4 heads, D=64, density 0.25 unless given")
    ap.add_argument("--grid", type=int, nargs=3, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--density", type=float, default=None,
                    help="budget as a fraction of the cubes (default 0.125, the Wan topk 78/624)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    if a.cpu_small:
        kw = dict(grid=(12, 20, 24), heads=4, head_dim=64, device="cpu")
        if a.density is None:
            a.density = 0.25
    else:
        kw = dict(grid=(21, 30, 52), heads=2, head_dim=128,
                  device="cuda" if torch.cuda.is_available() else "cpu")
    for key, val in (("grid", a.grid), ("heads", a.heads), ("head_dim", a.head_dim)):
        if val is not None:
            kw[key] = tuple(val) if key == "grid" else val
    if a.density is None:
        a.density = 0.125
    t0 = time.time()
    rows = study(density=a.density, seeds=tuple(a.seeds), **kw)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print(table(rows))
    print(f"({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
