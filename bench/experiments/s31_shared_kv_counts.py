"""How much K/V neighbouring query cubes share (issue #19, bench/NOTES.md "Session 31"), on the
synthesized default captures, CPU only:
  1. the union of a pair's (or a 2 x 2 quad's) selected key cubes over the lists' total, for
     pairs along w, h and t of the 6 x 8 x 13 cube grid;
  2. for pairs along w (the pairing of a multi-consumer CTA's items), the 128-key tiles a shared
     ring would load and the consumers would compute, against one ring a cube: the union
     ordered as the intersection, then each cube's own, two cubes a tile.
    python3 bench/experiments/s31_shared_kv_counts.py [--seed 1]   (about 2 min a TOPK)
"""
import argparse
import math

import torch

from tilegen.captures.synthesis import synthesize

CUBES_W, CUBES_HW = 13, 104  # the default grid (21, 30, 52) in 4 x 4 x 4 cubes: 6 x 8 x 13


def union_fraction(mask: torch.Tensor, groups: list[torch.Tensor], topk: int) -> float:
    """Mean over heads and groups of |union of the group's lists| / (group size x topk)."""
    union = torch.zeros_like(mask[:, groups[0]])
    for g in groups:
        union |= mask[:, g]
    return float((union.sum(-1).float() / (len(groups) * topk)).mean())


def tile_counts(idx: torch.Tensor) -> tuple[float, float]:
    """(tiles loaded, tiles computed) of a shared ring for pairs (2i, 2i + 1), against two rings."""
    heads, n, topk = idx.shape
    loaded = computed = now = 0
    for h in range(heads):
        for a in range(0, n - 1, 2):
            mine, theirs = set(idx[h, a].tolist()), set(idx[h, a + 1].tolist())
            order = (["ab"] * len(mine & theirs) + ["a"] * len(mine - theirs)
                     + ["b"] * len(theirs - mine))
            tiles = [order[i:i + 2] for i in range(0, len(order), 2)]
            loaded += len(tiles)
            computed += sum(any(c in t for t in tile) for tile in tiles for c in "ab")
            now += 2 * math.ceil(topk / 2)
    return loaded / now, computed / now


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    for topk in (31, 78, 187):
        idx = synthesize(seed=args.seed, topk=topk)["topk_idx"][0].long()  # (H, cubes, topk)
        heads, n, _ = idx.shape
        mask = torch.zeros(heads, n, n, dtype=torch.bool)
        mask.scatter_(2, idx, True)
        row = []
        for name, step in (("w", 1), ("h", CUBES_W), ("t", CUBES_HW)):
            a = torch.tensor([i for i in range(n) if (i // step) % 2 == 0 and i + step < n])
            row.append(f"{name} {union_fraction(mask, [a, a + step], topk):.3f}")
        w, hrow = torch.arange(n) % CUBES_W, (torch.arange(n) // CUBES_W) % 8
        a = torch.nonzero((w % 2 == 0) & (w < CUBES_W - 1) & (hrow % 2 == 0)).flatten()
        quad = [a, a + 1, a + CUBES_W, a + CUBES_W + 1]
        row.append(f"quad {union_fraction(mask, quad, topk):.3f}")
        loaded, computed = tile_counts(idx)
        print(f"TOPK {topk}: union {' '.join(row)}; shared ring (pairs along w): tiles loaded "
              f"{loaded:.3f}, computed {computed:.3f}", flush=True)


if __name__ == "__main__":
    main()
