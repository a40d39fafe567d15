"""The backward's maps on a GPU: the inverse map (plain or packed) and the Gluon dQ plan.

The vectorized torch routines are the models (and the CPU path):
`tilegen.backends.triton.backward.inverse_map` / `packed_inverse_map` (`pack_tiles`) and
`tilegen.backends.gluon.backward.dq_plan`. This module computes the same tensors with fewer,
fused launches (bench/NOTES.md, issue #18: the torch routine's ~20 elementwise passes over the
B*H*NQ*TOPK entries cost more than its sort):

1. `_lut_keys`: per LUT entry its sort key (int32): the list it joins, ``bh * NKV + index``
   (``B*H*NKV``, sorted last, for an entry past the row's count or out of range), when
   packing times log2(block) + 1 plus the size class rank of its query cube (full cubes first,
   as `pack_tiles`); per row the dQ plan's ``meta`` (the entry count, or -1 for a row with a
   bad index, vbs or count);
2. one stable sort of the keys (torch; keeps each list's query cubes ascending);
3. ``offsets`` by one searchsorted of the sorted keys (the first slot of every list);
4. unpacked, `_scatter_order`: per slot p its query cube and, for the plan, each entry's slot;
   packed, `_tile_starts` (which slots open a tile), one cumsum (the tiles before each slot),
   and `_pack_scatter`: the items, each tile's first item and size class, and each entry's
   tile and first row for the plan.

No host sync. The outputs equal the torch models' bit for bit (tests/test_gluon_backward.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

#: LUT rows per `_lut_keys` program, and map slots per scatter program
ROWS = 16
SLOTS = 1024
#: the dQ plan's ``pos`` packs a pair's tile slot and the query cube's first column in it
#: (a multiple of 8: packed tiles place cubes of 8, 16 or 32 rows at multiples of their size)
POS_COLUMN_STEP = 8


@dataclass(frozen=True)
class PackedTiles:
    """Lists of cubes per owner (CSR), each list cut into dense tiles of ``block`` rows.

    ``offsets`` (int32, owners + 1) and ``items`` (int32): owner o's cubes are
    ``items[offsets[o]:offsets[o+1]]``, grouped by size class (full cubes first). Tile t of
    owner o (``t < count[o]``) is at slot ``offsets[o] + t`` of ``tile_start`` (its first
    item's index in ``items``) and ``tile_meta`` (``lg | n << 8``: each of its ``n`` cubes
    takes ``2**lg`` rows: its vbs rounded up to a power of two, at least ``min_rows``; with
    ``exact`` only a cube of exactly that many rows, any other a whole tile; so tile row r
    belongs to item ``r >> lg``, slot ``r & (2**lg - 1)``). ``count`` is -1 for an owner whose
    list holds a bad index or vbs (the kernel poisons it with NaN and sets the error word).
    """

    offsets: torch.Tensor
    items: torch.Tensor
    tile_start: torch.Tensor
    tile_meta: torch.Tensor
    count: torch.Tensor
    #: the smallest size class: a cube of fewer real rows still takes this many
    min_rows: int = 1
    #: only cubes whose real rows are exactly a class size share tiles (others get one of their
    #: own), so a tile's real rows are a prefix: the Gluon kernel masks by one threshold
    exact: bool = False


def check_classes(min_rows: int, block: int) -> None:
    """`pack_tiles`' smallest class must be a power of two in 1..block."""
    if min_rows < 1 or min_rows > block or min_rows & (min_rows - 1):
        raise ValueError(f"min_rows={min_rows}: the smallest packed class must be a power of "
                         f"two in 1..{block}")


def lut_entries(topk_idx: torch.Tensor, counts: torch.Tensor | None, num_kv_blocks: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(idx (BH, NQ, TOPK) int64, in-range mask, real-slot mask) of a LUT: the torch models'
    reading of it (slot < counts[row] is real, a count past TOPK makes every slot real)."""
    B, H, NQ, TOPK = topk_idx.shape
    idx = topk_idx.reshape(B * H, NQ, TOPK).long()
    real = torch.ones_like(idx, dtype=torch.bool)
    if counts is not None:
        slot = torch.arange(TOPK, device=idx.device)
        real = slot[None, None, :] < counts.reshape(B * H, NQ, 1).long()
    return idx, (idx >= 0) & (idx < num_kv_blocks), real


def lut_bad_rows(ok: torch.Tensor, real: torch.Tensor, n_valid: torch.Tensor,
                 counts: torch.Tensor | None, block: int) -> torch.Tensor:
    """(BH*NQ,) bool: the LUT rows with a bad value, as the kernels' guard flags them: a real
    entry out of range or naming a cube whose vbs (``n_valid``) is outside 1..block, or a
    count outside 0..TOPK."""
    bad = (real & (~ok | (n_valid < 1) | (n_valid > block))).any(-1).reshape(-1)
    if counts is not None:
        c = counts.reshape(-1).long()
        bad |= (c < 0) | (c > ok.shape[-1])
    return bad


@triton.jit
def _lut_keys(LUT, COUNTS, VBS, KEY, META, n_rows, NQ, NKV, TOPK, N_LISTS,
              HAS_COUNTS: tl.constexpr, PACK: tl.constexpr, MIN_LG: tl.constexpr,
              EXACT: tl.constexpr, LOG_BLOCK: tl.constexpr, ROWS: tl.constexpr,
              BLOCK_T: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_live = rows < n_rows
    slot = tl.arange(0, BLOCK_T)
    if HAS_COUNTS:
        count = tl.load(COUNTS + rows, mask=row_live, other=0)
    else:
        count = tl.zeros([ROWS], tl.int32) + TOPK
    in_lut = row_live[:, None] & (slot[None, :] < TOPK)
    entry = rows.to(tl.int64)[:, None] * TOPK + slot[None, :]
    idx = tl.load(LUT + entry, mask=in_lut, other=0)
    real = in_lut & (slot[None, :] < count[:, None])
    ok = (idx >= 0) & (idx < NKV)
    key = tl.where(real & ok, (rows // NQ)[:, None] * NKV + idx, N_LISTS)
    if PACK:
        # pack_tiles' class: rows <= 2**lg, lg at least MIN_LG (EXACT: only a cube of exactly
        # 2**lg rows, else a tile of its own); rank 0 (full cubes) first
        q_real = tl.load(VBS + rows % NQ, mask=row_live, other=BLOCK)
        q_real = tl.minimum(tl.maximum(q_real, 1), BLOCK)
        q_rows = tl.maximum(q_real, 1 << MIN_LG)
        lg = tl.zeros([ROWS], tl.int32)
        for i in tl.static_range(LOG_BLOCK):
            lg += (q_rows > (1 << i)).to(tl.int32)
        if EXACT:
            exact = ((q_real & (q_real - 1)) == 0) & (q_real >= (1 << MIN_LG))
            lg = tl.where(exact, lg, LOG_BLOCK)
        key = key * (LOG_BLOCK + 1) + (LOG_BLOCK - lg)[:, None]
    tl.store(KEY + entry, key, mask=in_lut)
    # the dQ plan's row check: the vbs of a chosen cube, read only at an index in range
    n_valid = tl.load(VBS + tl.where(ok, idx, 0), mask=in_lut, other=1)
    bad_entry = real & (~ok | (n_valid < 1) | (n_valid > BLOCK))
    bad = (tl.max(bad_entry.to(tl.int32), 1) != 0) | (count < 0) | (count > TOPK)
    tl.store(META + rows, tl.where(bad, -1, count), mask=row_live)


@triton.jit
def _scatter_order(ORDER, QCUBES, POS, n, NQ, TOPK, HAS_POS: tl.constexpr,
                   COLUMN_STEP: tl.constexpr, SLOTS: tl.constexpr):
    p = tl.program_id(0).to(tl.int64) * SLOTS + tl.arange(0, SLOTS)
    live = p < n
    entry = tl.load(ORDER + p, mask=live, other=0)
    tl.store(QCUBES + p, ((entry // TOPK) % NQ).to(tl.int32), mask=live)
    if HAS_POS:
        tl.store(POS + entry, (p * COLUMN_STEP).to(tl.int32), mask=live)


@triton.jit
def _tile_starts(SKEY, GROUP_FIRST, START, n, N_LISTS, LOG_BLOCK: tl.constexpr,
                 SLOTS: tl.constexpr):
    """START[j] = 1 where slot j opens a tile: a kept entry at a multiple of its class's
    cubes-per-tile inside its (list, class) group."""
    j = tl.program_id(0).to(tl.int64) * SLOTS + tl.arange(0, SLOTS)
    live = j < n
    skey = tl.load(SKEY + j, mask=live, other=0)
    first = tl.load(GROUP_FIRST + j, mask=live, other=0)
    rank = skey % (LOG_BLOCK + 1)
    kept = (skey // (LOG_BLOCK + 1)) < N_LISTS
    opens = kept & (((j - first) & ((1 << rank) - 1)) == 0)
    tl.store(START + j, opens.to(tl.int32), mask=live)


@triton.jit
def _pack_scatter(ORDER, SKEY, GROUP_FIRST, GROUP_END, START, CSUM, OFFSETS, ITEMS, TILE_START,
                  TILE_META, POS, n, NQ, TOPK, N_LISTS, HAS_POS: tl.constexpr,
                  LOG_BLOCK: tl.constexpr, COLUMN_STEP: tl.constexpr, SLOTS: tl.constexpr):
    """`pack_tiles`' outputs from the sorted keys: slot j's item, the tiles' first items and
    classes (``lg | n << 8``) at their slots, and each entry's ``tile * 8 + first row / 8``."""
    j = tl.program_id(0).to(tl.int64) * SLOTS + tl.arange(0, SLOTS)
    live = j < n
    entry = tl.load(ORDER + j, mask=live, other=0)
    tl.store(ITEMS + j, ((entry // TOPK) % NQ).to(tl.int32), mask=live)
    skey = tl.load(SKEY + j, mask=live, other=0)
    owner = skey // (LOG_BLOCK + 1)
    rank = skey % (LOG_BLOCK + 1)
    kept = live & (owner < N_LISTS)
    first = tl.load(GROUP_FIRST + j, mask=kept, other=0)
    end = tl.load(GROUP_END + j, mask=kept, other=0)
    owner_first = tl.load(OFFSETS + owner, mask=kept, other=0)
    # the owner's tiles are numbered from its first slot: tiles of earlier owners excluded
    before = (tl.load(CSUM + owner_first, mask=kept, other=0)
              - tl.load(START + owner_first, mask=kept, other=0))
    tile = owner_first + tl.load(CSUM + j, mask=kept, other=1) - 1 - before
    opens = tl.load(START + j, mask=kept, other=0) != 0
    per_tile = 1 << rank
    lg = LOG_BLOCK - rank
    n_items = tl.minimum(per_tile, end - j)
    tl.store(TILE_START + tile, j.to(tl.int32), mask=kept & opens)
    tl.store(TILE_META + tile, (lg | (n_items << 8)).to(tl.int32), mask=kept & opens)
    if HAS_POS:
        row = ((j - first) & (per_tile - 1)) << lg
        code = tl.where(kept, tile * COLUMN_STEP + row // COLUMN_STEP, 0)
        tl.store(POS + entry, code.to(tl.int32), mask=live)


def device_maps(topk_idx: torch.Tensor, counts: torch.Tensor | None, vbs: torch.Tensor,
                num_kv_blocks: int, block: int = 64, with_plan: bool = True,
                pack: bool = False, min_rows: int = 1, exact: bool = False):
    """``(inverse, plan)``: ``inverse`` as `inverse_map` gives it, ``(offsets, qcubes)``, or
    with ``pack`` as `packed_inverse_map` (a `PackedTiles`, classes ``min_rows`` and
    ``exact`` as `pack_tiles` takes them);
    ``plan`` as `dq_plan` gives it for that map, ``(pos, meta)``, or None without
    ``with_plan``. On the LUT's device (CUDA, or the CPU under the Triton interpreter)."""
    B, H, NQ, TOPK = topk_idx.shape
    BH = B * H
    n = BH * NQ * TOPK
    n_lists = BH * num_kv_blocks
    log_block = block.bit_length() - 1
    classes = log_block + 1 if pack else 1
    check_classes(min_rows, block)
    if with_plan and pack and min_rows < POS_COLUMN_STEP:
        raise ValueError(f"the dQ plan names first rows in steps of {POS_COLUMN_STEP}: packed "
                         f"classes of min_rows={min_rows} do not fit it")
    codes = POS_COLUMN_STEP if with_plan else 1
    if n * codes > 2**31 - 1 or (n_lists + 1) * classes > 2**31 - 1:
        raise ValueError(f"the backward's maps number B*H*NQ*TOPK = {n} LUT entries "
                         + (f"({codes} plan codes each) " if with_plan else "")
                         + f"and B*H*NKV = {n_lists} lists in int32")
    dev = topk_idx.device
    lut = topk_idx.contiguous()
    vbs = vbs.contiguous()
    key = torch.empty(n, dtype=torch.int32, device=dev)
    meta = torch.empty(BH * NQ, dtype=torch.int32, device=dev)
    # counts past int32 keep their meaning (a bad count) when clamped first
    cnt = (counts.reshape(-1).clamp(-1, TOPK + 1).to(torch.int32).contiguous()
           if counts is not None else None)
    _lut_keys[(triton.cdiv(BH * NQ, ROWS),)](
        lut, cnt if cnt is not None else meta, vbs, key, meta, BH * NQ, NQ, num_kv_blocks,
        TOPK, n_lists, HAS_COUNTS=cnt is not None, PACK=pack,
        MIN_LG=max(min_rows, 1).bit_length() - 1, EXACT=exact, LOG_BLOCK=log_block, ROWS=ROWS,
        BLOCK_T=max(16, triton.next_power_of_2(TOPK)), BLOCK=block, num_warps=4)
    sorted_key, order = torch.sort(key, stable=True)
    bounds = torch.arange(n_lists + 1, dtype=torch.int32, device=dev) * classes
    offsets = torch.searchsorted(sorted_key, bounds, out_int32=True)
    pos = torch.empty(n, dtype=torch.int32, device=dev) if with_plan else None
    items = torch.empty(n, dtype=torch.int32, device=dev)
    grid = (triton.cdiv(n, SLOTS),)
    if not pack:
        _scatter_order[grid](order, items, pos if pos is not None else items, n, NQ, TOPK,
                             HAS_POS=with_plan, COLUMN_STEP=POS_COLUMN_STEP, SLOTS=SLOTS,
                             num_warps=4)
        inverse: tuple[torch.Tensor, torch.Tensor] | PackedTiles = (offsets, items)
    else:
        group_first = torch.searchsorted(sorted_key, sorted_key, out_int32=True)
        group_end = torch.searchsorted(sorted_key, sorted_key, right=True, out_int32=True)
        start = torch.empty(n, dtype=torch.int32, device=dev)
        _tile_starts[grid](sorted_key, group_first, start, n, n_lists, LOG_BLOCK=log_block,
                           SLOTS=SLOTS, num_warps=4)
        csum = torch.cumsum(start, 0, dtype=torch.int32)
        tile_start = torch.zeros(n, dtype=torch.int32, device=dev)
        tile_meta = torch.zeros(n, dtype=torch.int32, device=dev)
        _pack_scatter[grid](order, sorted_key, group_first, group_end, start, csum, offsets,
                            items, tile_start, tile_meta, pos if pos is not None else items, n,
                            NQ, TOPK, n_lists, HAS_POS=with_plan, LOG_BLOCK=log_block,
                            COLUMN_STEP=POS_COLUMN_STEP, SLOTS=SLOTS, num_warps=4)
        tiles_before = torch.cat([csum.new_zeros(1), csum])  # tiles before slot i
        count = (tiles_before[offsets[1:].long()] - tiles_before[offsets[:-1].long()])
        inverse = PackedTiles(offsets, items, tile_start, tile_meta, count.to(torch.int32),
                              min_rows, exact)
    plan = (pos.view(topk_idx.shape), meta) if with_plan else None
    return inverse, plan
