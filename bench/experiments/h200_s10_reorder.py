"""Question: what does `layout.to_cubes(zero_padding=False)` (one gather; padded slots copy
their cube's first token) save per self-attention layer of a Wan2.2-A14B-shaped step, against
the zero fill and scatter it replaced (issue #22; NOTES predicted 1.85 -> ~0.8 ms for the three
reorders of a layer, about -40 ms per 40-layer step)?

One process on the H200, the latent of 832x480x81 (grid 21x30x52, 40 heads, D 128, bf16):
the three reorders alone both ways, `from_cubes`, and the diffusers processor's attention
(`tilegen.integrations.diffusers._sparse_attention`, 87.5% sparsity) as it ships (False) and with
to_cubes forced back to zero padding. Medians of `triton.testing.do_bench`; the table is printed
last and written to $OUT/h200_s10_reorder.json.

    PYTHONPATH=. python bench/experiments/h200_s10_reorder.py
"""

from __future__ import annotations

import json
import math
import os

import torch
from triton.testing import do_bench

from tilegen import layout
from tilegen.integrations import diffusers as tgd

GRID, H, D = (21, 30, 52), 40, 128


def ms(fn):
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=10, rep=100, return_mode="median")


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    S = math.prod(GRID)
    q, k, v = (torch.randn(1, S, H, D, generator=g, device="cuda").bfloat16() for _ in range(3))
    kept = tgd.topk_for(0.875, math.prod(layout.cube_grid(GRID)))
    rows = {}
    with torch.no_grad():
        for zero in (True, False):
            rows[f"to_cubes x3, zero_padding={zero}"] = ms(
                lambda zero=zero: [layout.to_cubes(z, GRID, zero_padding=zero) for z in (q, k, v)])
        oc, _ = layout.to_cubes(q, GRID)
        rows["from_cubes"] = ms(lambda: layout.from_cubes(oc, GRID))
        rows["processor attention (zero_padding=False, as shipped)"] = ms(
            lambda: tgd._sparse_attention(q, k, v, GRID, (4, 4, 4), kept))
        shipped = tgd._sparse_attention(q, k, v, GRID, (4, 4, 4), kept)
        real_to_cubes = layout.to_cubes

        def zero_filled(x, grid, cube=(4, 4, 4), *, zero_padding=True):
            return real_to_cubes(x, grid, cube, zero_padding=True)

        layout.to_cubes = zero_filled
        try:
            rows["processor attention (zero_padding=True)"] = ms(
                lambda: tgd._sparse_attention(q, k, v, GRID, (4, 4, 4), kept))
            zeroed = tgd._sparse_attention(q, k, v, GRID, (4, 4, 4), kept)
        finally:
            layout.to_cubes = real_to_cubes
        rows["outputs equal"] = bool(torch.equal(shipped, zeroed))
    with open(os.path.join(os.environ.get("OUT", "."), "h200_s10_reorder.json"), "w") as f:
        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                   "grid": GRID, "heads": H, "topk": kept, "rows": rows}, f, indent=1)
    print("| what | ms |")
    print("|---|---|")
    for name, value in rows.items():
        print(f"| {name} | {value if isinstance(value, bool) else f'{value:.3f}'} |")


if __name__ == "__main__":
    main()
