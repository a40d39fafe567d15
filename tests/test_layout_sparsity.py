"""Cube reorder (tilegen.layout) and sparsity encodings/selectors (tilegen.sparsity)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tilegen import layout, sparsity

WAN_GRID = (21, 30, 52)


# ------------------------------------------------------------------------------------ layout


def test_wan_cube_grid_and_vbs():
    assert layout.cube_grid(WAN_GRID) == (6, 8, 13)
    vbs = layout.vbs_for_grid(WAN_GRID)
    assert vbs.dtype == torch.int32 and vbs.shape == (624,)
    assert int(vbs.sum()) == 21 * 30 * 52
    values, counts = vbs.unique(return_counts=True)
    # t extents {4, 1}, h extents {4, 2}, w extents {4}
    assert dict(zip(values.tolist(), counts.tolist(), strict=True)) == {
        8: 13, 16: 7 * 13, 32: 5 * 13, 64: 5 * 7 * 13
    }


def test_wan_round_trip_and_padding():
    x = torch.randn(1, 21 * 30 * 52, 1, 2)
    xc, vbs = layout.to_cubes(x, WAN_GRID)
    assert xc.shape == (1, 624 * 64, 1, 2)
    assert torch.equal(vbs, layout.vbs_for_grid(WAN_GRID))
    real = torch.arange(64)[None, :] < vbs[:, None].long()  # (624, 64)
    cubes = xc.view(1, 624, 64, 1, 2)
    assert torch.count_nonzero(cubes[:, ~real]) == 0  # padding is zero
    assert torch.all(cubes[:, real] != 0)  # real slots all filled (randn is never exactly 0)
    assert torch.equal(layout.from_cubes(xc, WAN_GRID), x)


def _brute_force_to_cubes(x, grid, cube):
    T, H, W = grid
    ct, ch, cw = cube
    nt, nh, nw = (math.ceil(g / c) for g, c in zip(grid, cube, strict=True))
    vol = ct * ch * cw
    out = torch.zeros(x.shape[0], nt * nh * nw * vol, *x.shape[2:], dtype=x.dtype)
    vbs = []
    for cid, (bt, bh, bw) in enumerate(itertools.product(range(nt), range(nh), range(nw))):
        slot = 0
        for t in range(bt * ct, min(T, bt * ct + ct)):
            for h in range(bh * ch, min(H, bh * ch + ch)):
                for w in range(bw * cw, min(W, bw * cw + cw)):
                    out[:, cid * vol + slot] = x[:, (t * H + h) * W + w]
                    slot += 1
        vbs.append(slot)
    return out, torch.tensor(vbs, dtype=torch.int32)


@pytest.mark.parametrize(
    "grid,cube", [((5, 6, 8), (4, 4, 4)), ((5, 6, 7), (2, 3, 4)), ((4, 4, 4), (4, 4, 4))]
)
def test_to_cubes_matches_brute_force(grid, cube):
    n = grid[0] * grid[1] * grid[2]
    x = torch.arange(2 * n * 3, dtype=torch.float32).view(2, n, 3) + 1
    xc, vbs = layout.to_cubes(x, grid, cube)
    ref, ref_vbs = _brute_force_to_cubes(x, grid, cube)
    assert torch.equal(xc, ref)
    assert torch.equal(vbs, ref_vbs)
    assert torch.equal(layout.from_cubes(xc, grid, cube), x)


@pytest.mark.parametrize("grid,cube", [((5, 6, 8), (4, 4, 4)), ((5, 6, 7), (2, 3, 4))])
def test_cube_sources_are_the_gather_of_to_cubes(grid, cube):
    """Slot i of the cube-major sequence reads token ``cube_sources[i]``: the real tokens where
    `to_cubes` puts them, padded slots their cube's first token (``zero_padding=False``)."""
    n = grid[0] * grid[1] * grid[2]
    x = torch.randn(1, n, 2)
    src = layout.cube_sources(grid, cube)
    assert src.dtype == torch.int64 and 0 <= int(src.min()) and int(src.max()) < n
    xc, vbs = layout.to_cubes(x, grid, cube, zero_padding=False)
    assert torch.equal(x[:, src], xc)
    ref, _ = _brute_force_to_cubes(x, grid, cube)
    vol = math.prod(cube)
    real = (torch.arange(vol)[None, :] < vbs[:, None]).reshape(-1)
    assert torch.equal(x[:, src][:, real], ref[:, real])
    src[0] = -1  # a copy: the cached index is untouched
    assert int(layout.cube_sources(grid, cube)[0]) == 0


def test_small_grid_has_all_partial_kinds():
    assert set(layout.vbs_for_grid((5, 6, 8)).tolist()) == {64, 32, 16, 8}


def test_cube_coords():
    c = layout.cube_coords(WAN_GRID)
    assert c.shape == (624, 3)
    assert c[0].tolist() == [1.5, 1.5, 1.5]
    assert c[-1].tolist() == [20.0, 28.5, 49.5]  # partial last cube: t extent 1, h extent 2


def test_layout_validation():
    with pytest.raises(ValueError, match="x"):
        layout.to_cubes(torch.zeros(1, 10, 1, 1), (2, 2, 2))
    with pytest.raises(ValueError, match="grid"):
        layout.to_cubes(torch.zeros(1, 8, 1, 1), (2, 2))
    with pytest.raises(ValueError, match="cube"):
        layout.to_cubes(torch.zeros(1, 8, 1, 1), (2, 2, 2), cube=(0, 4, 4))
    with pytest.raises(ValueError, match="xc"):
        layout.from_cubes(torch.zeros(1, 10, 1, 1), (2, 2, 2))
    with pytest.raises(TypeError, match="x"):
        layout.to_cubes([1, 2, 3], (1, 1, 3))


# ------------------------------------------------------------------------------------ LUT/mask


def test_mask_lut_round_trip():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(2, 3, 7, 11, generator=g) < 0.3
    mask[0, 0, 0] = False  # an empty row
    mask[1, 2, 3] = True  # a full row
    idx, counts = sparsity.mask_to_lut(mask)
    assert idx.dtype == torch.int32 and counts.dtype == torch.int32
    assert idx.shape == (2, 3, 7, 11) and torch.equal(counts, mask.sum(-1).int())
    assert torch.equal(sparsity.lut_to_mask(idx, 11, counts=counts), mask)
    for b, h, i in itertools.product(range(2), range(3), range(7)):
        n = int(counts[b, h, i])
        row = idx[b, h, i].tolist()
        assert row[:n] == sorted(torch.nonzero(mask[b, h, i]).flatten().tolist())
        # padding: the smallest unselected ids, ascending, so no id appears twice in a row
        unselected = torch.nonzero(~mask[b, h, i]).flatten().tolist()
        assert row[n:] == unselected[:len(row) - n]


def test_topk_lut_to_mask_and_back():
    g = torch.Generator().manual_seed(1)
    idx = torch.stack([torch.randperm(20, generator=g)[:5] for _ in range(2 * 4 * 6)])
    idx = idx.view(2, 4, 6, 5).to(torch.int32)
    mask = sparsity.lut_to_mask(idx, 20)
    assert mask.shape == (2, 4, 6, 20) and bool((mask.sum(-1) == 5).all())
    back, counts = sparsity.mask_to_lut(mask)
    assert bool((counts == 5).all())
    assert torch.equal(back, idx.sort(-1).values)


def test_sparsity_validation():
    idx = torch.zeros(1, 1, 2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="topk_idx"):
        sparsity.lut_to_mask(idx + 5, 5)
    with pytest.raises(TypeError, match="topk_idx"):
        sparsity.lut_to_mask(idx.float(), 5)
    with pytest.raises(ValueError, match="topk_idx"):
        sparsity.lut_to_mask(idx[0], 5)
    with pytest.raises(TypeError, match="mask"):
        sparsity.mask_to_lut(torch.zeros(1, 1, 2, 3))
    q = torch.randn(1, 4 * 8, 2, 4)
    vbs = torch.full((4,), 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="topk"):
        sparsity.mean_pool_topk(q, q, vbs, 5, block=8)
    with pytest.raises(ValueError, match="vbs"):
        sparsity.mean_pool_topk(q, q, vbs + 1, 2, block=8)
    with pytest.raises(ValueError, match="vbs"):
        sparsity.mean_pool_topk(q, q, vbs[:3], 2, block=8)
    with pytest.raises(ValueError, match="block"):
        sparsity.mean_pool_topk(q, q, vbs, 2, block=7)
    with pytest.raises(ValueError, match="p"):
        sparsity.cdf_select(q, q, vbs, 0.0, block=8)


# ------------------------------------------------------------------------------------ selectors


def _random_cubes(seed, b=2, nc=6, block=8, h=3, d=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nc * block, h, d, generator=g)
    k = torch.randn(b, nc * block, h, d, generator=g)
    vbs = torch.randint(1, block + 1, (nc,), generator=g, dtype=torch.int32)
    vbs[0] = block
    # garbage in the padding slots: the selector must ignore them, not rely on zeros
    return q, k, vbs


def _brute_pooled_scores(q, k, vbs, block):
    b, s, h, d = q.shape
    nc = s // block
    out = torch.empty(b, h, nc, nc)
    for bi, hi, i, j in itertools.product(range(b), range(h), range(nc), range(nc)):
        qm = q[bi, i * block: i * block + int(vbs[i]), hi].double().mean(0)
        km = k[bi, j * block: j * block + int(vbs[j]), hi].double().mean(0)
        out[bi, hi, i, j] = float(qm @ km)
    return out


def test_mean_pool_topk_matches_brute_force():
    block, topk = 8, 3
    q, k, vbs = _random_cubes(0, block=block)
    got = sparsity.mean_pool_topk(q, k, vbs, topk, block=block)
    assert got.dtype == torch.int32 and got.shape == (2, 3, 6, topk)
    scores = _brute_pooled_scores(q, k, vbs, block)
    for bi, hi, i in itertools.product(range(2), range(3), range(6)):
        row = scores[bi, hi, i].tolist()
        want = sorted(sorted(range(6), key=lambda j: -row[j])[:topk])
        assert got[bi, hi, i].tolist() == want  # ascending by cube id


def test_cdf_select_mass_property():
    block, p = 8, 0.7
    q, k, vbs = _random_cubes(1, nc=10, block=block, d=16)
    q = q * 3  # sharper coarse distribution: rows of very different lengths
    idx, counts = sparsity.cdf_select(q, k, vbs, p, block=block)
    probs = torch.softmax(_brute_pooled_scores(q, k, vbs, block) / math.sqrt(16), dim=-1)
    assert len(set(counts.flatten().tolist())) > 1
    for bi, hi, i in itertools.product(range(2), range(3), range(10)):
        n = int(counts[bi, hi, i])
        sel = idx[bi, hi, i, :n].tolist()
        assert sel == sorted(set(sel))
        pr = probs[bi, hi, i]
        mass = float(pr[sel].sum())
        assert mass >= p - 1e-5  # enough mass
        assert mass - float(pr[sel].min()) < p + 1e-5  # and the smallest such set
        rest = [j for j in range(10) if j not in sel]
        if rest:  # the selected cubes are the most probable ones
            assert float(pr[sel].min()) >= float(pr[rest].max()) - 1e-7
    full_idx, full_counts = sparsity.cdf_select(q, k, vbs, 1.0, block=block)
    assert int(full_counts.min()) >= int(counts.max())


# ------------------------------------------------------------------------ no duplicates in a row


def _assert_rows_distinct(idx, what):
    """Every LUT row, padding included, holds each cube id at most once (contract.md)."""
    s = idx.long().sort(dim=-1).values
    dup = (s[..., 1:] == s[..., :-1]).any(-1)
    assert not bool(dup.any()), f"{what}: row {tuple(dup.nonzero()[0].tolist())} repeats an id"


def _tied_cubes(kind, b=2, nc=9, block=8, h=3, d=4):
    if kind == "zeros":  # every coarse score 0
        q = torch.zeros(b, nc * block, h, d)
        return q, q.clone(), torch.full((nc,), block, dtype=torch.int32)
    if kind == "constant":  # every cube the same mean: every score equal
        q = torch.ones(b, nc * block, h, d)
        return q, q.clone(), torch.full((nc,), block, dtype=torch.int32)
    # pairs of identical KV cubes: ties between two ids in every row
    q, k, vbs = _random_cubes(7, b=b, nc=nc, block=block, h=h, d=d)
    k = k.view(b, nc, block, h, d)
    k[:, 1::2] = k[:, 0:-1:2]
    vbs[1::2] = vbs[0:-1:2]
    return q, k.view(b, nc * block, h, d), vbs


@pytest.mark.parametrize("seed", range(5))
def test_selectors_never_repeat_an_id_in_a_row(seed):
    block = 8
    q, k, vbs = _random_cubes(seed, nc=9, block=block, d=8)
    for topk in (1, 4, 9):
        _assert_rows_distinct(sparsity.mean_pool_topk(q, k, vbs, topk, block=block),
                              f"mean_pool_topk topk={topk}")
    padded = 0
    for p in (0.05, 0.5, 0.9, 1.0):
        idx, counts = sparsity.cdf_select(q * 3, k, vbs, p, block=block)
        _assert_rows_distinct(idx, f"cdf_select p={p}")
        padded += int((counts < idx.shape[-1]).sum())
    assert padded > 0  # rows of varying length: the padding was exercised
    g = torch.Generator().manual_seed(seed)
    for density in (0.0, 0.1, 0.5, 0.9, 1.0):
        mask = torch.rand(2, 3, 7, 11, generator=g) < density
        mask[0, 0, 0] = False  # an empty row beside full ones
        idx, counts = sparsity.mask_to_lut(mask)
        _assert_rows_distinct(idx, f"mask_to_lut density={density}")
        assert torch.equal(sparsity.lut_to_mask(idx, 11, counts=counts), mask)


@pytest.mark.parametrize("kind", ["zeros", "constant", "pairs"])
def test_selectors_never_repeat_an_id_on_ties(kind):
    q, k, vbs = _tied_cubes(kind)
    for topk in (1, 3, 8, 9):
        idx = sparsity.mean_pool_topk(q, k, vbs, topk, block=8)
        _assert_rows_distinct(idx, f"mean_pool_topk topk={topk}")
    for p in (0.3, 0.5, 1.0):
        idx, counts = sparsity.cdf_select(q, k, vbs, p, block=8)
        _assert_rows_distinct(idx, f"cdf_select p={p}")
        assert bool((counts >= 1).all())


def test_to_cubes_compiles_to_the_eager_result():
    """Under torch.compile the slots are built inside the graph (no cached host tensor copied
    per call): same values as eager, partial edge cubes included."""
    grid = (6, 7, 9)
    x = torch.randn(2, 6 * 7 * 9, 3, 8)
    torch._dynamo.reset()
    fn = torch.compile(lambda t: layout.from_cubes(layout.to_cubes(t, grid)[0] * 2, grid),
                       fullgraph=True, backend="eager")
    torch.testing.assert_close(fn(x), x * 2, atol=0, rtol=0)
    vbs = torch.compile(lambda t: layout.to_cubes(t, grid)[1], fullgraph=True, backend="eager")(x)
    assert torch.equal(vbs, layout.vbs_for_grid(grid))
    torch._dynamo.reset()


def test_token_slots_is_a_copy_of_the_cached_index():
    grid = (5, 6, 7)
    layout.token_slots(grid).zero_()
    x = torch.randn(1, 5 * 6 * 7, 2)
    torch.testing.assert_close(layout.from_cubes(layout.to_cubes(x, grid)[0], grid), x)


@pytest.mark.parametrize("grid", [(6, 7, 9), (8, 8, 8)], ids=["partial", "whole"])
def test_to_cubes_without_zero_padding_copies_each_cubes_first_token(grid):
    x = torch.randn(2, math.prod(grid), 3, 8)
    zero, vbs = layout.to_cubes(x, grid)
    fast, vbs2 = layout.to_cubes(x, grid, zero_padding=False)
    assert torch.equal(vbs, vbs2) and fast.shape == zero.shape
    real = (torch.arange(64)[None, :] < vbs[:, None].long()).reshape(-1)
    assert torch.equal(fast[:, real], zero[:, real])
    first = fast.view(2, -1, 64, 3, 8)[:, :, :1].expand(-1, -1, 64, -1, -1).reshape(fast.shape)
    assert torch.equal(fast[:, ~real], first[:, ~real])
    torch.testing.assert_close(layout.from_cubes(fast, grid), x, atol=0, rtol=0)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: layout.to_cubes(t, grid, zero_padding=False)[0],
                             fullgraph=True, backend="eager")(x)
    assert torch.equal(compiled, fast)
    torch._dynamo.reset()
