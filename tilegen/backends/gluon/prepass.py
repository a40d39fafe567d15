"""GPU pre-pass of the Gluon kernel: validate the LUT rows and order them into 64-key tiles.

The kernel reads only this plan, so other ways of naming a row's cubes plug in here: the
sliding-tile pre-pass (`_gluon_window_prepass`) computes each row's window from the query
cube's coordinates instead of reading a LUT, and the pair pre-pass (`_gluon_pair_prepass`,
share_kv) plans the union of two neighbouring rows. Both end in the same planning as below.

One program per LUT row (b, h, query cube). For its first n = counts[row] (or TOPK) entries it

* checks the values without a host sync (`tilegen.guard.row_entries`, shared with the C++
  families' guard): index in [0, NKV), vbs[index] in 1..64, counts in 0..TOPK (duplicates
  are not checked). A bad value sets a bit in the device flag `err`
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

The 8-bit kernel's plan (`_quant_lut_prepass`, `_quant_window_prepass`: the same checks, another
packing) cuts each 64-key tile into two 32-key halves, since its V^T tile cannot take boxes
narrower than 32 keys: plan[row, 2t + h] = the first key row of half h of tile t (within the
batch) | its fill << 25. A cube of more than 32 tokens fills a tile of its own (halves at keys 0
and 32 of the cube, fills min(vbs, 32) and vbs - 32); with pack, cubes of at most 32 tokens
share tiles two by two, after the big ones (an odd last one's partner half is its cube's second
half, padded slots only, with fill 0). meta = (n_tiles or -1, number of one-cube tiles). Every
half covers the slots of one cube, so a key's mask is its slot's alone: key_bias[cube * 64 + s]
= 0 for s < vbs[cube], -inf past it (`_key_bias`), which the kernel adds to the scores in place
of the fill.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tilegen.guard import row_entries


@triton.jit
def _window_entries(WINDOWS, VBS, row, num_heads, nq, GT, GH, GW, BLOCK_T: tl.constexpr,
                    BLOCK: tl.constexpr):
    """The sliding-tile window of one row (b, h, query cube), from coordinates (no index
    tensor): row-major over the window, its centre clamped so it stays inside the cube grid
    (STA; `tilegen.encodings.window_cubes` is the PyTorch model). Same outputs as
    `row_entries`; the windows fit the grid (`Spec.window`), so only vbs can be bad."""
    bh = row // nq
    qc = row - bh * nq
    h = bh % num_heads
    wt = tl.load(WINDOWS + h * 3)
    wh = tl.load(WINDOWS + h * 3 + 1)
    ww = tl.load(WINDOWS + h * 3 + 2)
    i = tl.arange(0, BLOCK_T)
    live = i < wt * wh * ww
    ct = qc // (GH * GW)
    ch = qc // GW % GH
    cw = qc % GW
    st = tl.minimum(tl.maximum(ct - wt // 2, 0), GT - wt)
    sh = tl.minimum(tl.maximum(ch - wh // 2, 0), GH - wh)
    sw = tl.minimum(tl.maximum(cw - ww // 2, 0), GW - ww)
    cube = ((st + i // (wh * ww)) * GH + sh + i // ww % wh) * GW + sw + i % ww
    cube = tl.where(live, cube, 0)
    v = tl.load(VBS + cube, mask=live, other=BLOCK)
    bad_v = live & ((v < 1) | (v > BLOCK))
    return cube, v, live, tl.max(bad_v.to(tl.int32), 0) * 2


@triton.jit
def _gluon_lut_prepass(LUT, COUNTS, VBS, SIDX, TINFO, META, ERR, NKV, TOPK,
                       HAS_COUNTS: tl.constexpr, PACK: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cube, v, live, err = row_entries(LUT, COUNTS, VBS, row, True, NKV, TOPK, HAS_COUNTS,
                                      BLOCK_T, BLOCK)
    _plan_row(cube, v, live, err, row, SIDX, TINFO, META, ERR, TOPK, PACK, BLOCK)


@triton.jit
def _gluon_window_prepass(WINDOWS, VBS, SIDX, TINFO, META, ERR, TOPK, num_heads, nq, GT, GH,
                          GW, PACK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cube, v, live, err = _window_entries(WINDOWS, VBS, row, num_heads, nq, GT, GH, GW, BLOCK_T,
                                         BLOCK)
    _plan_row(cube, v, live, err, row, SIDX, TINFO, META, ERR, TOPK, PACK, BLOCK)


@triton.jit
def _plan_row(cube, v, live, err, row, SIDX, TINFO, META, ERR, TOPK, PACK: tl.constexpr,
              BLOCK: tl.constexpr):
    """Order one row's cubes into 64-key tiles (see the module docstring) and store the plan."""
    n = tl.sum(live.to(tl.int32), 0)

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


#: bits of a half-tile plan entry below its fill (key rows per batch stay under 2**25)
HALF_FILL_SHIFT = 25
_FILL_SHIFT = tl.constexpr(HALF_FILL_SHIFT)


@triton.jit
def _plan_halves(cube, v, live, err, row, PLAN, META, ERR, TOPK, PACK: tl.constexpr,
                 BLOCK: tl.constexpr):
    """The 8-bit kernel's tiles of one row in 32-key halves (see the module docstring)."""
    HALF: tl.constexpr = BLOCK // 2
    if PACK:
        small = live & (v <= HALF)
    else:
        small = live & (v < 0)
    big = live & ~small
    n_big = tl.sum(big.to(tl.int32), 0)
    n_small = tl.sum(small.to(tl.int32), 0)
    k_big = tl.cumsum(big.to(tl.int32), 0) - 1
    k_small = tl.cumsum(small.to(tl.int32), 0) - 1
    n_tiles = n_big + (n_small + 1) // 2
    slot = tl.where(big, 2 * k_big, 2 * n_big + k_small)
    base = cube * BLOCK
    fill0 = tl.where(big, tl.minimum(v, HALF), v)
    plan_row = PLAN + row * (2 * TOPK)
    tl.store(plan_row + slot, base | (fill0 << _FILL_SHIFT), mask=live)
    fill1 = tl.maximum(v - HALF, 0)
    tl.store(plan_row + slot + 1, (base + HALF) | (fill1 << _FILL_SHIFT), mask=big)
    # an odd last small cube: its partner half is the cube's second half, all padded slots
    # (masked by the fill and by the key bias alike)
    lone = small & (k_small == n_small - 1) & (n_small % 2 == 1)
    tl.store(plan_row + slot + 1, base + HALF, mask=lone)
    bad = err != 0
    tl.store(META + row * 2, tl.where(bad, -1, n_tiles))
    tl.store(META + row * 2 + 1, n_big)
    tl.atomic_or(ERR, err, mask=bad)


@triton.jit
def _key_bias(VBS, KBIAS, row, NKV, BLOCK: tl.constexpr):
    """The 8-bit kernel's key bias, 0 for a real key slot and -inf for a padded one (slot <
    vbs of its cube), written by programs row, row + grid, ... for cubes below NKV: every half
    of a plan covers one cube's slots, so this masks what its fill does."""
    slot = tl.arange(0, BLOCK)
    for c in range(row, NKV, tl.num_programs(0)):
        n_valid = tl.load(VBS + c)
        tl.store(KBIAS + c * BLOCK + slot, tl.where(slot < n_valid, 0.0, float("-inf")))


@triton.jit
def _quant_lut_prepass(LUT, COUNTS, VBS, PLAN, META, ERR, KBIAS, NKV, TOPK,
                       HAS_COUNTS: tl.constexpr, PACK: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cube, v, live, err = row_entries(LUT, COUNTS, VBS, row, True, NKV, TOPK, HAS_COUNTS,
                                      BLOCK_T, BLOCK)
    _plan_halves(cube, v, live, err, row, PLAN, META, ERR, TOPK, PACK, BLOCK)
    _key_bias(VBS, KBIAS, row, NKV, BLOCK)


@triton.jit
def _quant_window_prepass(WINDOWS, VBS, PLAN, META, ERR, KBIAS, TOPK, num_heads, nq, GT, GH,
                          GW, PACK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cube, v, live, err = _window_entries(WINDOWS, VBS, row, num_heads, nq, GT, GH, GW, BLOCK_T,
                                         BLOCK)
    _plan_halves(cube, v, live, err, row, PLAN, META, ERR, TOPK, PACK, BLOCK)
    _key_bias(VBS, KBIAS, row, nq, BLOCK)


@triton.jit
def _rank_pos(is_a, is_b, base):
    """Positions of rank members, the first row's (a) before the second's (b), from `base`."""
    ca = tl.sum(is_a.to(tl.int32), 0)
    cb = tl.sum(is_b.to(tl.int32), 0)
    return (base + tl.cumsum(is_a.to(tl.int32), 0) - 1,
            base + ca + tl.cumsum(is_b.to(tl.int32), 0) - 1, ca + cb)


@triton.jit
def _gluon_pair_prepass(LUT, COUNTS, VBS, SIDX, TINFO, TMASK, META, ERR, NKV, TOPK, NQ,
                        HAS_COUNTS: tl.constexpr, PACK: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK: tl.constexpr):
    """One program per pair of neighbouring query cubes (2p, 2p+1) of one (b, h): the union of
    their LUT rows as one tile stream that a shared K/V ring loads once (share_kv)."""
    pair = tl.program_id(0).to(tl.int64)
    n_pairs = (NQ + 1) // 2
    bh = pair // n_pairs
    qa = (pair - bh * n_pairs) * 2
    row_a = bh * NQ + qa
    b_live = qa + 1 < NQ
    ca, va, la, err_a = row_entries(LUT, COUNTS, VBS, row_a, True, NKV, TOPK, HAS_COUNTS,
                                     BLOCK_T, BLOCK)
    cb, vb, lb, err_b = row_entries(LUT, COUNTS, VBS, row_a + 1, b_live, NKV, TOPK,
                                     HAS_COUNTS, BLOCK_T, BLOCK)
    # a row with a bad value contributes nothing (its consumer writes NaN)
    la = la & (err_a == 0)
    lb = lb & (err_b == 0)
    both = (ca[:, None] == cb[None, :]) & la[:, None] & lb[None, :]
    a_shared = tl.max(both.to(tl.int32), 1) != 0
    b_shared = tl.max(both.to(tl.int32), 0) != 0
    lb = lb & ~b_shared  # the union: all of a's cubes, then b's that a lacks
    full = BLOCK
    if PACK:
        small_a = (va == full // 2) | (va == full // 4) | (va == full // 8)
        small_b = (vb == full // 2) | (vb == full // 4) | (vb == full // 8)
    else:
        small_a = va < 0
        small_b = vb < 0
    # ranks: 0 full cubes of both rows, 1 full cubes of one row (interleaved a/b so the two
    # consumers take turns), 2 other sizes (own tile, masked), 3/4/5 packed halves/quarters/eighths
    no_b = lb & (vb < 0)  # b's full cubes shared with a were dropped from lb
    pa0, pb0, c0 = _rank_pos(la & a_shared & (va == full), no_b, 0)
    ia1 = la & ~a_shared & (va == full)
    ib1 = lb & (vb == full)
    na1 = tl.sum(ia1.to(tl.int32), 0)
    nb1 = tl.sum(ib1.to(tl.int32), 0)
    mn = tl.minimum(na1, nb1)
    ka1 = tl.cumsum(ia1.to(tl.int32), 0) - 1
    kb1 = tl.cumsum(ib1.to(tl.int32), 0) - 1
    pa1 = c0 + tl.where(ka1 < mn, 2 * ka1, mn + ka1)
    pb1 = c0 + tl.where(kb1 < mn, 2 * kb1 + 1, mn + kb1)
    c1 = na1 + nb1
    pa2, pb2, c2 = _rank_pos(la & (va != full) & ~small_a, lb & (vb != full) & ~small_b, c0 + c1)
    n_big = c0 + c1 + c2
    pa3, pb3, c3 = _rank_pos(la & small_a & (va == full // 2), lb & small_b & (vb == full // 2),
                             n_big)
    pa4, pb4, c4 = _rank_pos(la & small_a & (va == full // 4), lb & small_b & (vb == full // 4),
                             n_big + c3)
    pa5, pb5, c5 = _rank_pos(la & small_a & (va == full // 8), lb & small_b & (vb == full // 8),
                             n_big + c3 + c4)
    packed_rows = (full // 2) * c3 + (full // 4) * c4 + (full // 8) * c5
    n_tiles = n_big + (packed_rows + full - 1) // full
    n_ent = n_big + c3 + c4 + c5

    ent = 2 * TOPK
    sidx_row = SIDX + pair * ent
    tinfo_row = TINFO + pair * (ent + 1)
    tmask_row = TMASK + pair * (ent + 1)
    # packed tiles' consumer masks are ORed together below: clear them first
    offs2 = tl.arange(0, 2 * BLOCK_T)
    tl.store(tmask_row + n_big + offs2, 0, mask=offs2 < n_tiles - n_big)
    tl.debug_barrier()
    for second in tl.static_range(2):
        if second == 0:
            cube, v, live, shared, small = ca, va, la, a_shared, small_a
            p0, p1, p2, p3, p4, p5 = pa0, pa1, pa2, pa3, pa4, pa5
        else:
            cube, v, live, shared, small = cb, vb, lb, no_b, small_b
            p0, p1, p2, p3, p4, p5 = pb0, pb1, pb2, pb3, pb4, pb5
        one_cube = live & ~small
        pos = tl.where(v == full, tl.where(shared, p0, p1),
                       tl.where(~small, p2,
                                tl.where(v == full // 2, p3, tl.where(v == full // 4, p4, p5))))
        # consumer masks: 8 bits per consumer, one per 8-key segment of the tile
        if second == 0:
            who = tl.where(shared, 0xFFFF, 0xFF)
        else:
            who = tl.full([BLOCK_T], 0xFF00, tl.int32)
        tl.store(sidx_row + pos, cube, mask=live)
        tl.store(tinfo_row + pos, pos | (v << 16), mask=one_cube)
        tl.store(tmask_row + pos, who, mask=one_cube)
        # packed stream: rows before this cube (halves, then quarters, then eighths)
        k = pos - n_big
        off = tl.where(v == full // 2, (full // 2) * (k),
                       tl.where(v == full // 4, (full // 2) * c3 + (full // 4) * (k - c3),
                                (full // 2) * c3 + (full // 4) * c4 + (full // 8) * (k - c3 - c4)))
        packed = live & small
        fill = tl.minimum(packed_rows - off, full)
        tl.store(tinfo_row + n_big + off // full, pos | (fill << 16),
                 mask=packed & ((off % full) == 0))
        segs = ((1 << (v // 8)) - 1) << ((off % full) // 8)
        tl.atomic_or(tmask_row + n_big + off // full, (segs | (segs << 8)) & who, mask=packed)
    tl.store(tinfo_row + n_tiles, n_ent)
    tl.store(META + pair * 4, n_tiles)
    tl.store(META + pair * 4 + 1, n_big)
    tl.store(META + pair * 4 + 2, (err_a != 0).to(tl.int32))
    tl.store(META + pair * 4 + 3, (err_b != 0).to(tl.int32))
    err = err_a | err_b
    tl.atomic_or(ERR, err, mask=err != 0)


def prepass_buffers(device, rows: int, topk: int) -> dict:
    import torch

    return {
        "sidx": torch.empty((rows, topk), device=device, dtype=torch.int32),
        "tinfo": torch.empty((rows, topk + 1), device=device, dtype=torch.int32),
        "meta": torch.empty((rows, 2), device=device, dtype=torch.int32),
    }


def run_prepass(idx, vbs, counts, bufs: dict, rows: int, nkv: int, topk: int, err,
                pack: bool = True, block: int = 64) -> None:
    block_t = max(16, triton.next_power_of_2(topk))
    _gluon_lut_prepass[(rows,)](
        idx, counts if counts is not None else bufs["meta"], vbs, bufs["sidx"], bufs["tinfo"],
        bufs["meta"], err, nkv, topk,
        HAS_COUNTS=counts is not None, PACK=pack, BLOCK_T=block_t, BLOCK=block,
        num_warps=1 if block_t <= 128 else 4,
    )


def run_window_prepass(windows, vbs, bufs: dict, rows: int, heads: int, nq: int,
                       cube_grid: tuple[int, int, int], topk: int, err, pack: bool = True,
                       block: int = 64) -> None:
    """The sliding-tile plan: `windows` (heads * 3,) int32 (`tilegen.encodings.window_table`),
    `topk` the largest window volume (the width of sidx/tinfo rows)."""
    block_t = max(16, triton.next_power_of_2(topk))
    _gluon_window_prepass[(rows,)](
        windows, vbs, bufs["sidx"], bufs["tinfo"], bufs["meta"], err, topk, heads, nq,
        *cube_grid, PACK=pack, BLOCK_T=block_t, BLOCK=block,
        num_warps=1 if block_t <= 128 else 4,
    )


def pair_prepass_buffers(device, pairs: int, topk: int) -> dict:
    """Tile plans of query-cube pairs: sidx (cubes of the union, tile order), tinfo (first |
    fill << 16 per tile, sentinel = entry count), tmask (consumer 0's 8-key segments in bits
    0-7, consumer 1's in 8-15) and meta (n_tiles, one-cube tiles, row 0 bad, row 1 bad)."""
    import torch

    ent = 2 * topk
    return {
        "sidx": torch.empty((pairs, ent), device=device, dtype=torch.int32),
        "tinfo": torch.empty((pairs, ent + 1), device=device, dtype=torch.int32),
        "tmask": torch.empty((pairs, ent + 1), device=device, dtype=torch.int32),
        "meta": torch.empty((pairs, 4), device=device, dtype=torch.int32),
    }


def run_pair_prepass(idx, vbs, counts, bufs: dict, pairs: int, nq: int, nkv: int, topk: int,
                     err, pack: bool = True, block: int = 64, num_warps: int = 4) -> None:
    block_t = max(16, triton.next_power_of_2(topk))
    _gluon_pair_prepass[(pairs,)](
        idx, counts if counts is not None else bufs["meta"], vbs, bufs["sidx"], bufs["tinfo"],
        bufs["tmask"], bufs["meta"], err, nkv, topk, nq,
        HAS_COUNTS=counts is not None, PACK=pack, BLOCK_T=block_t, BLOCK=block,
        num_warps=num_warps,
    )


def halves_buffers(device, rows: int, topk: int, nkv: int, block: int = 64) -> dict:
    """The 8-bit kernel's plan: plan (two half-tile entries per tile, `_plan_halves`), meta
    (n_tiles or -1, one-cube tiles) and key_bias (0 or -inf a key slot, `_key_bias`)."""
    import torch

    return {
        "plan": torch.empty((rows, 2 * topk), device=device, dtype=torch.int32),
        "meta": torch.empty((rows, 2), device=device, dtype=torch.int32),
        "key_bias": torch.empty((1, nkv * block), device=device, dtype=torch.float32),
    }


def _check_key_rows(seq_len: int) -> None:
    if seq_len >= 1 << HALF_FILL_SHIFT:
        raise ValueError(f"sequence of {seq_len} tokens: the 8-bit kernel's plan addresses "
                         f"fewer than {1 << HALF_FILL_SHIFT} key rows a batch")


def run_halves_prepass(idx, vbs, counts, bufs: dict, rows: int, nkv: int, topk: int, err,
                       pack: bool = True, block: int = 64) -> None:
    _check_key_rows(nkv * block)
    block_t = max(16, triton.next_power_of_2(topk))
    _quant_lut_prepass[(rows,)](
        idx, counts if counts is not None else bufs["meta"], vbs, bufs["plan"], bufs["meta"],
        err, bufs["key_bias"], nkv, topk, HAS_COUNTS=counts is not None, PACK=pack,
        BLOCK_T=block_t, BLOCK=block,
        num_warps=1 if block_t <= 128 else 4,
    )


def run_halves_window_prepass(windows, vbs, bufs: dict, rows: int, heads: int, nq: int,
                              cube_grid: tuple[int, int, int], topk: int, err,
                              pack: bool = True, block: int = 64) -> None:
    """`run_window_prepass`'s windows, planned in halves for the 8-bit kernel."""
    _check_key_rows(nq * block)
    block_t = max(16, triton.next_power_of_2(topk))
    _quant_window_prepass[(rows,)](
        windows, vbs, bufs["plan"], bufs["meta"], err, bufs["key_bias"], topk, heads, nq,
        *cube_grid, PACK=pack,
        BLOCK_T=block_t, BLOCK=block, num_warps=1 if block_t <= 128 else 4,
    )
