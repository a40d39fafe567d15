"""Issue #19, session 39: how often the linear P's shift would have to move, on the default
workload's synthesized captures (CPU, no kernel). The kernel (`s39_stale_shift.patch`,
TILEGEN_EXP_STALE_CHECK) keeps a warp's shift sc = ceil(8 m) + H (m a row's max of the base-2
logits, H codes of headroom) until a code of a 128-key tile would pass the top code, that is
8 max > sc + 1/2 for one of the warp's 16 rows (rows 16 w .. 16 w + 15 of the cube); then every
row of the warp takes sc = ceil(8 m_new) + H. This counts the (warp, tile) pairs after a cube's
first tile where that happens, for each headroom H, with the tiles as the kernel pairs the
LUT's key cubes (entries 2 t and 2 t + 1) and the float logits s . scale . log2 e (K's
smoothing shifts a row's logits alike, so it moves no max's growth).

    python3 bench/experiments/stale_shift_rate.py [--seeds 0,1] [--headrooms 0,8,16,24]
"""

from __future__ import annotations

import argparse
import math

import torch

from tilegen import captures
from tilegen.spec import Spec


def tile_maxima(q, k, idx, vbs, h, b=0, block=64, chunk=64):
    """(cubes, tiles, block) row maxima of the base-2 logits a 128-key tile, -inf where none."""
    S, D = q.shape[1], q.shape[3]
    n = S // block
    scale = D ** -0.5 * math.log2(math.e)
    qh = q[b, :, h].float().view(n, block, D)
    kh = k[b, :, h].float().view(n, block, D)
    keys = torch.arange(block)
    width = idx.shape[-1]
    tiles = (width + 1) // 2
    out = torch.empty(n, tiles, block)
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        sel = idx[b, h, c0:c1].long()                                  # (c, width)
        kk = kh[sel]                                                   # (c, width, block, D)
        s = torch.einsum("crd,cwkd->crwk", qh[c0:c1], kk) * scale     # (c, block, width, block)
        ok = keys[None, None, :] < vbs[sel][..., None]                 # (c, width, block)
        s = torch.where(ok[:, None], s, -math.inf).amax(-1)            # (c, block, width)
        if width % 2:
            s = torch.cat([s, torch.full_like(s[..., :1], -math.inf)], -1)
        out[c0:c1] = s.view(c1 - c0, block, tiles, 2).amax(-1).transpose(1, 2)
    return out


def fire_rate(mx: torch.Tensor, headroom: int, block: int = 64, rows_a_warp: int = 16):
    """The share of (warp, tile) pairs after the first tile whose shift moves; mx from
    `tile_maxima` (real query rows only matter: a padded row's max is that of its keys)."""
    n, tiles, _ = mx.shape
    w = mx.view(n, tiles, block // rows_a_warp, rows_a_warp)
    m = w[:, 0].clone()                                                # (n, warps, rows)
    sc = torch.ceil(8 * m) + headroom
    fired = 0
    for t in range(1, tiles):
        over = (8 * w[:, t] > sc + 0.5).any(-1)                        # (n, warps)
        fired += int(over.sum())
        m_new = torch.where(over[..., None], torch.maximum(m, w[:, t]), m)
        sc = torch.where(over[..., None], torch.ceil(8 * m_new) + headroom, sc)
        m = m_new
    return fired / (n * w.shape[2] * (tiles - 1))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--headrooms", default="0,8,16,24,32")
    ap.add_argument("--topk", type=int, default=78)
    args = ap.parse_args()
    headrooms = [int(x) for x in args.headrooms.split(",")]
    spec = Spec(quant="none", num_heads=4, topk=args.topk)
    print(f"grid {spec.grid}, TOPK {args.topk}, 4 heads (the outlier among them)")
    print("seed head " + " ".join(f"H={x:<5d}" for x in headrooms))
    for seed in (int(x) for x in args.seeds.split(",")):
        cap = captures.synthesize_for(spec, seed=seed)
        q, k, idx, vbs = (cap[n] for n in ("q", "k", "topk_idx", "vbs"))
        for h in range(q.shape[2]):
            mx = tile_maxima(q, k, idx, vbs, h)
            rates = [fire_rate(mx, x) for x in headrooms]
            print(f"{seed:4d} {h:4d} " + " ".join(f"{r:7.3f}" for r in rates), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
