"""GPU pre-pass of the Gluon kernel: validate the LUT rows and order them into 64-key tiles.

One program per LUT row (b, h, query cube). For its first n = counts[row] (or TOPK) entries it

* checks the values without a host sync: index in [0, NKV), vbs[index] in 1..64, counts in
  0..TOPK (duplicates are not checked). A bad value sets a bit in the device flag `err`
  (1 index, 2 vbs, 4 counts) and marks the row (meta n_tiles = -1): the kernel loads nothing for
  it and writes NaN into its output. No out-of-range address is ever formed.
* sorts the row's cubes by a stable counting sort over five ranks:
    0  vbs == 64              a tile of its own, no mask
    1  other sizes            a tile of its own, keys past vbs masked
    2, 3, 4  vbs == 32, 16, 8 (pack=True only) packed back to back into dense 64-key tiles,
             largest first, so every cube lands at a multiple of its own size inside a tile
             (8-row granules keep the 128-byte swizzle atom aligned) and never straddles tiles
* emits sidx (sorted cube ids), tinfo[t] = first sidx index of tile t | fill(t) << 16 with the
  sentinel tinfo[n_tiles] = n, and meta = (n_tiles or -1, number of one-cube tiles).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gluon_lut_prepass(LUT, COUNTS, VBS, SIDX, TINFO, META, ERR, NKV, TOPK,
                       HAS_COUNTS: tl.constexpr, PACK: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_T)
    if HAS_COUNTS:
        n = tl.load(COUNTS + row)
    else:
        n = TOPK
    bad_n = (n < 0) | (n > TOPK)
    n = tl.where(bad_n, 0, n)
    live = offs < n
    idx = tl.load(LUT + row * TOPK + offs, mask=live, other=0)
    bad_i = live & ((idx < 0) | (idx >= NKV))
    cube = tl.where(live & ~bad_i, idx, 0)
    v = tl.load(VBS + cube, mask=live & ~bad_i, other=BLOCK)
    bad_v = live & ((v < 1) | (v > BLOCK))
    err = tl.max(bad_i.to(tl.int32), 0) | (tl.max(bad_v.to(tl.int32), 0) * 2) | (bad_n.to(tl.int32) * 4)

    if PACK:
        rank = tl.where(v == BLOCK, 0,
                        tl.where(v == BLOCK // 2, 2,
                                 tl.where(v == BLOCK // 4, 3, tl.where(v == BLOCK // 8, 4, 1))))
    else:
        rank = tl.where(v == BLOCK, 0, 1)
    rank = tl.where(live, rank, 5)
    is0 = (rank == 0).to(tl.int32)
    is1 = (rank == 1).to(tl.int32)
    is2 = (rank == 2).to(tl.int32)
    is3 = (rank == 3).to(tl.int32)
    is4 = (rank == 4).to(tl.int32)
    c0 = tl.sum(is0, 0)
    c1 = tl.sum(is1, 0)
    c2 = tl.sum(is2, 0)
    c3 = tl.sum(is3, 0)
    c4 = tl.sum(is4, 0)
    k0 = tl.cumsum(is0, 0) - 1
    k1 = tl.cumsum(is1, 0) - 1
    k2 = tl.cumsum(is2, 0) - 1
    k3 = tl.cumsum(is3, 0) - 1
    k4 = tl.cumsum(is4, 0) - 1
    n_big = c0 + c1
    pos = tl.where(rank == 0, k0,
                   tl.where(rank == 1, c0 + k1,
                            tl.where(rank == 2, n_big + k2,
                                     tl.where(rank == 3, n_big + c2 + k3, n_big + c2 + c3 + k4))))
    # rows of the packed stream before this cube (ranks 2..4)
    off = tl.where(rank == 2, (BLOCK // 2) * k2,
                   tl.where(rank == 3, (BLOCK // 2) * c2 + (BLOCK // 4) * k3,
                            (BLOCK // 2) * c2 + (BLOCK // 4) * c3 + (BLOCK // 8) * k4))
    packed_rows = (BLOCK // 2) * c2 + (BLOCK // 4) * c3 + (BLOCK // 8) * c4
    n_tiles = n_big + (packed_rows + BLOCK - 1) // BLOCK

    tl.store(SIDX + row * TOPK + pos, cube, mask=live)
    tinfo_row = TINFO + row * (TOPK + 1)
    # one-cube tiles: first = pos, fill = vbs
    tl.store(tinfo_row + pos, pos | (v << 16), mask=live & (rank <= 1))
    # packed tiles start where a cube starts at a multiple of BLOCK rows
    starts = live & (rank >= 2) & ((off % BLOCK) == 0)
    fill = tl.minimum(packed_rows - off, BLOCK)
    tl.store(tinfo_row + n_big + off // BLOCK, pos | (fill << 16), mask=starts)
    tl.store(tinfo_row + n_tiles, n)
    bad = err != 0
    tl.store(META + row * 2, tl.where(bad, -1, n_tiles))
    tl.store(META + row * 2 + 1, n_big)
    tl.atomic_or(ERR, err, mask=bad)


def prepass_buffers(device, rows: int, topk: int) -> dict:
    import torch

    return {
        "sidx": torch.empty((rows, topk), device=device, dtype=torch.int32),
        "tinfo": torch.empty((rows, topk + 1), device=device, dtype=torch.int32),
        "meta": torch.empty((rows, 2), device=device, dtype=torch.int32),
        "err": torch.zeros((1,), device=device, dtype=torch.int32),
    }


def run_prepass(idx, vbs, counts, bufs: dict, rows: int, nkv: int, topk: int, pack: bool = True,
                block: int = 64) -> None:
    block_t = max(16, triton.next_power_of_2(topk))
    _gluon_lut_prepass[(rows,)](
        idx, counts if counts is not None else bufs["meta"], vbs, bufs["sidx"], bufs["tinfo"],
        bufs["meta"], bufs["err"], nkv, topk,
        HAS_COUNTS=counts is not None, PACK=pack, BLOCK_T=block_t, BLOCK=block,
        num_warps=1 if block_t <= 128 else 4,
    )
