"""The GPU selectors of `tilegen.sparsity`: pooling, the Jenga mask selector (top-k union forced
adjacency union extra), its LUT form, and the absence of host syncs (fullgraph torch.compile)."""

import itertools
import math

import pytest
import torch

from tilegen import layout, sparsity

GRID = (6, 7, 9)  # 2x2x3 cubes of 4x4x4, partial along every axis


def _cubes(seed=0, grid=GRID, b=2, h=3, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    n = math.prod(grid)
    q, k = (torch.randn(b, n, h, d, generator=g).to(dtype) for _ in range(2))
    qc, vbs = layout.to_cubes(q, grid)
    kc, _ = layout.to_cubes(k, grid)
    return qc, kc, vbs


def _brute_adjacency(grid, kind):
    nt, nh, nw = layout.cube_grid(grid)
    pos = list(itertools.product(range(nt), range(nh), range(nw)))
    out = torch.zeros(len(pos), len(pos), dtype=torch.bool)
    for i, a in enumerate(pos):
        for j, b in enumerate(pos):
            d = [abs(x - y) for x, y in zip(a, b, strict=True)]
            out[i, j] = {"self": sum(d) == 0, "face": sum(d) <= 1, "box": max(d) <= 1}[kind]
    return out


@pytest.mark.parametrize("grid", [(6, 7, 9), (12, 12, 12), (4, 4, 4), (3, 13, 5)])
@pytest.mark.parametrize("kind", sparsity.ADJACENCY)
def test_adjacency_matches_brute_force(grid, kind):
    adj = sparsity.adjacency_mask(grid, kind=kind)
    assert torch.equal(adj, _brute_adjacency(grid, kind))
    assert torch.equal(adj, adj.T) and bool(adj.diagonal().all())
    assert int(adj.sum(-1).max()) == sparsity._neighbourhood_size(layout.cube_grid(grid), kind)


def test_adjacency_at_faces_and_corners():
    grid = (12, 12, 12)  # 3x3x3 cubes: corner, edge, face and centre cubes
    box = sparsity.adjacency_mask(grid, kind="box").sum(-1).view(3, 3, 3)
    face = sparsity.adjacency_mask(grid, kind="face").sum(-1).view(3, 3, 3)
    for (t, h, w) in itertools.product((0, 2), repeat=3):  # the 8 corners: cut, not wrapped
        assert box[t, h, w] == 8 and face[t, h, w] == 4
    assert box[1, 1, 1] == 27 and face[1, 1, 1] == 7  # the centre
    assert box[0, 1, 1] == 18 and face[0, 1, 1] == 6  # a face centre
    assert box[0, 0, 1] == 12 and face[0, 0, 1] == 5  # an edge middle


def test_pool_cubes_masks_padding_and_rounds_once():
    qc, _, vbs = _cubes(1, d=8)
    garbage = qc.clone()
    slot = torch.arange(qc.shape[1]) % 64
    pad = slot >= vbs.repeat_interleave(64)
    assert bool(pad.any())
    garbage[:, pad] = 1e3  # padding may hold any finite values
    for dtype in (torch.float32, torch.bfloat16):
        x = garbage.to(dtype)
        got = sparsity.pool_cubes(x, vbs)
        real = ~pad.view(1, -1, 1, 1)
        sums = (x.double() * real).view(2, -1, 64, 3, 8).sum(2)
        want = (sums.to(dtype).double() / vbs.double().view(1, -1, 1, 1)).permute(0, 2, 1, 3)
        torch.testing.assert_close(got.double(), want, rtol=1e-6 if dtype == torch.float32
                                   else 2 ** -8, atol=1e-6)


def test_pool_cubes_bad_vbs_gives_nan_without_reading_it():
    qc, _, vbs = _cubes(2, d=8)
    bad = vbs.clone()
    bad[1] = 0
    bad[2] = 65
    got = sparsity.pool_cubes(qc, bad)
    assert bool(got[:, :, 1:3].isnan().all()) and bool(got[:, :, 3:].isfinite().all())


@pytest.mark.parametrize("kind", [None, *sparsity.ADJACENCY])
@pytest.mark.parametrize("topk", [0, 1, 4])
def test_jenga_mask_is_the_union(kind, topk):
    qc, kc, vbs = _cubes(3)
    nc = vbs.numel()
    g = torch.Generator().manual_seed(3)
    extra = torch.rand(1, 1, nc, nc, generator=g) < 0.1
    for ex in (None, extra, extra.to(torch.uint8).expand(2, 3, nc, nc)):
        got = sparsity.jenga_mask(qc, kc, topk, GRID, adjacency=kind, extra=ex)
        want = torch.zeros(2, 3, nc, nc, dtype=torch.bool)
        if topk:
            want |= sparsity.lut_to_mask(sparsity.mean_pool_topk(qc, kc, vbs, topk), nc)
        if kind is not None:
            want |= _brute_adjacency(GRID, kind)
        if ex is not None:
            want |= ex.bool()
        assert got.dtype == torch.bool and torch.equal(got, want)
        idx, counts = sparsity.jenga_lut(qc, kc, topk, GRID, adjacency=kind, extra=ex)
        ref_idx, ref_counts = sparsity.mask_to_lut(got)
        assert torch.equal(counts, ref_counts)
        assert idx.shape[-1] >= ref_idx.shape[-1]  # a static bound on the width
        assert torch.equal(idx[..., :ref_idx.shape[-1]], ref_idx)
        assert torch.equal(sparsity.lut_to_mask(idx, nc, counts=counts), got)


def test_jenga_importance_cubes_are_the_top_scores():
    qc, kc, vbs = _cubes(4)
    got = sparsity.jenga_mask(qc, kc, 3, GRID, adjacency=None)
    scores = sparsity.coarse_scores(qc, kc, vbs)
    # every selected score beats every unselected one, per row
    sel_min = torch.where(got, scores, math.inf).amin(-1)
    rest_max = torch.where(~got, scores, -math.inf).amax(-1)
    assert bool((sel_min > rest_max).all()) and bool((got.sum(-1) == 3).all())


def test_jenga_validation():
    qc, kc, _ = _cubes(5)
    nc = kc.shape[1] // 64
    with pytest.raises(ValueError, match="adjacency"):
        sparsity.jenga_mask(qc, kc, 2, GRID, adjacency="ring")
    with pytest.raises(ValueError, match="topk"):
        sparsity.jenga_mask(qc, kc, nc + 1, GRID)
    with pytest.raises(TypeError, match="topk"):
        sparsity.jenga_mask(qc, kc, 2.0, GRID)
    with pytest.raises(ValueError, match="extra"):
        sparsity.jenga_mask(qc, kc, 2, GRID, extra=torch.zeros(2, 3, nc, nc + 1, dtype=bool))
    with pytest.raises(TypeError, match="extra"):
        sparsity.jenga_mask(qc, kc, 2, GRID, extra=torch.zeros(2, 3, nc, nc))
    with pytest.raises(ValueError, match="q must hold"):
        sparsity.jenga_mask(qc, kc, 2, (6, 7, 13))
    with pytest.raises(ValueError, match="adjacency_mask needs a kind"):
        sparsity.adjacency_mask(GRID, kind=None)


def test_cdf_select_is_cdf_mask():
    qc, kc, vbs = _cubes(6)
    mask = sparsity.cdf_mask(qc * 3, kc, vbs, 0.6)
    idx, counts = sparsity.cdf_select(qc * 3, kc, vbs, 0.6)
    assert torch.equal(sparsity.lut_to_mask(idx, vbs.numel(), counts=counts), mask)


@pytest.mark.parametrize("name", ["mean_pool_topk", "cdf_mask", "jenga_mask", "jenga_lut",
                                  "pool_cubes"])
def test_selectors_have_no_host_sync(name):
    """Run on meta tensors (shapes, no data), as on a GPU (value checks are for CPU tensors
    only): any `.item()`, `.tolist()`, `int(tensor)` or data-dependent shape raises there, so a
    selector that runs reads nothing back on the GPU either. Shapes match the CPU run."""
    qc, kc, vbs = _cubes(7, dtype=torch.bfloat16)
    extra = torch.zeros(1, 1, vbs.numel(), vbs.numel(), dtype=torch.bool)
    calls = {"mean_pool_topk": lambda q, k, v, e: sparsity.mean_pool_topk(q, k, v, 3),
             "cdf_mask": lambda q, k, v, e: sparsity.cdf_mask(q, k, v, 0.5),
             "jenga_mask": lambda q, k, v, e: sparsity.jenga_mask(q, k, 2, GRID, extra=e),
             "jenga_lut": lambda q, k, v, e: sparsity.jenga_lut(q, k, 2, GRID, extra=e),
             "pool_cubes": lambda q, k, v, e: sparsity.pool_cubes(q, v)}
    cpu = calls[name](qc, kc, vbs, extra)
    meta = calls[name](*(t.to("meta") for t in (qc, kc, vbs, extra)))
    for a, b in zip(cpu if isinstance(cpu, tuple) else (cpu,),
                    meta if isinstance(meta, tuple) else (meta,), strict=True):
        assert b.device.type == "meta" and a.shape == b.shape and a.dtype == b.dtype


def test_the_no_sync_check_can_fail():
    """cdf_select syncs (its LUT width is the largest row count): on meta tensors it raises."""
    qc, kc, vbs = _cubes(8)
    with pytest.raises((RuntimeError, NotImplementedError)):
        sparsity.cdf_select(*(t.to("meta") for t in (qc, kc, vbs)), 0.5)


def test_selectors_compile_fullgraph():
    torch._dynamo.reset()
    qc, kc, vbs = _cubes(9, dtype=torch.bfloat16)
    for fn, args in ((sparsity.mean_pool_topk, (qc, kc, vbs, 3)),
                     (sparsity.jenga_mask, (qc, kc, 2, GRID))):
        assert torch.equal(torch.compile(fn, fullgraph=True, backend="eager")(*args), fn(*args))


@pytest.mark.parametrize("rows_per_program", [1, 4])
def test_row_topk_kernel_matches_torch_with_ties_and_inf(interpreter, rows_per_program):
    """The coarse stage's Triton top-k (bisection on order-preserving score bits over two
    power-of-two row pieces, ties to the lowest ids, compaction in id order) picks what a stable
    descending sort picks, ids ascending; at the production rows per program and at 4."""
    import triton

    from tilegen.coarse_gpu import _row_topk_kernel, row_topk_ids

    gen = torch.Generator().manual_seed(0)
    for n, k in ((624, 78), (100, 7), (33, 33), (5, 1), (64, 9)):
        s = torch.randn(3, 5, n, generator=gen)
        s[0, 0, :10] = 1.5  # ties: lower ids win
        # ties at the threshold across the kernel's two row pieces (block_a lanes, then the rest)
        s[0, 1, max(0, (1 << (n.bit_length() - 1)) - 3):] = 9.0
        s[1, 2, :] = float("-inf")
        s[1, 2, 3] = 0.0
        s[2, 0, :] = 0.0  # +0 and -0 are equal scores: the lowest ids win, as in torch.topk
        s[2, 0, ::2] = -0.0
        want = row_topk_ids(s, k)  # CPU path: stable sort
        assert torch.equal(want, want.sort(-1).values)
        flat = s.reshape(-1, n).contiguous()
        got = torch.empty(flat.shape[0], k, dtype=torch.int32)
        rows = flat.shape[0]
        block_a = 1 << (n.bit_length() - 1)
        _row_topk_kernel[(triton.cdiv(rows, rows_per_program),)](
            flat, got, rows, n, k, ROWS=rows_per_program, BLOCK_A=block_a,
            BLOCK_B=triton.next_power_of_2(max(n - block_a, 1)))
        assert torch.equal(got.view(3, 5, k), want)
        assert torch.equal(want[2, 0], torch.arange(k, dtype=torch.int32))
        ref = torch.topk(s, k, dim=-1).indices.sort(-1).values.to(torch.int32)
        assert torch.equal(want[2, 1:], ref[2, 1:])  # no ties there: the same as torch.topk


def test_scores_kernel_is_the_per_head_product_of_the_means(interpreter):
    """`coarse_gpu.scores_of_means` (the GPU scores, tf32x3 on the tensor cores) against the
    fp64 product: GQA heads (query head h reads KV head h // 2), cube counts that are not
    multiples of the 64-wide tiles, NQ != NKV, and a NaN mean (a bad vbs) kept in its row only.
    The interpreter multiplies in fp32, so this checks the indexing and masking; the GPU's
    precision is measured in bench/experiments/gpu_s24_select.py."""
    from tilegen.coarse_gpu import scores_of_means

    gen = torch.Generator().manual_seed(3)
    for dim in (64, 256):  # 256: the channels in 64-wide steps
        qm = torch.randn(2, 4, 70, dim, generator=gen)
        km = torch.randn(2, 2, 130, dim, generator=gen)
        qm[1, 3, 5] = float("nan")
        got = scores_of_means(qm, km)
        want = (qm.double() @ km.double().repeat_interleave(2, dim=1).transpose(-1, -2)).float()
        assert got.shape == (2, 4, 70, 130)
        assert torch.isnan(got[1, 3, 5]).all() and torch.isnan(got).sum() == 130
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-4, equal_nan=True)
    with pytest.raises(ValueError, match="H_kv dividing H"):
        scores_of_means(qm[:, :3], km)
    with pytest.raises(ValueError, match="fp32"):
        scores_of_means(qm.double(), km)
    with pytest.raises(ValueError, match="fp32"):
        scores_of_means(qm, km[..., :64])
    with pytest.raises(ValueError, match="power of two from 16"):
        scores_of_means(qm[..., :48], km[..., :48])


def _scores_kernel_sass(head_dim: int) -> tuple[dict[str, int], str]:
    """`coarse_gpu.scores_of_means`' kernel as launched for ``head_dim``, cross-compiled for
    sm_90a: its wgmma instructions by shape, and its register/stack line (run without the
    interpreter: `pytorch_path_run`)."""
    import collections
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tilegen.coarse_gpu import _scores_kernel

    sig = {"QM": "*fp32", "KM": "*fp32", "OUT": "*fp32", "nq": "i32", "nkv": "i32",
           "heads": "i32", "kv_heads": "i32"}
    consts = dict(HEAD_DIM=head_dim, BM=64, BN=64, BK=head_dim if head_dim <= 128 else 64,
                  PRECISION="tf32x3")
    sig.update({c: "constexpr" for c in consts})
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    k = triton.compile(ASTSource(_scores_kernel, sig, consts, attrs=aligned),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "scores.cubin"
        cubin.write_bytes(k.asm["cubin"])
        sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout.splitlines()[-1]
    return dict(collections.Counter(re.findall(r"\bHGMMA\.[\w.]+", sass))), usage


def check_scores_kernel_is_tf32x3_without_spills() -> None:
    for dim in (64, 128, 256):
        mmas, usage = _scores_kernel_sass(dim)
        # three TF32 products a k-step of 8 channels over the 64 x 64 tile: tf32x3, not tf32
        assert mmas == {"HGMMA.64x64x8.F32.TF32": 3 * dim // 8}, (dim, mmas)
        assert "STACK:0 " in usage and "LOCAL:0 " in usage, (dim, usage)


def test_scores_kernel_builds_tf32x3_without_spills(pytorch_path_run):
    """The scores kernel as `scores_of_means` launches it, cross-compiled for sm_90a: three
    TF32 wgmma a k-step (the interpreter multiplies in fp32 and cannot tell tf32 from tf32x3)
    and no spills at 64, 128 and 256 channels."""
    pytorch_path_run("test_selectors", "check_scores_kernel_is_tf32x3_without_spills()")


def test_pool_kernel_matches_pool_cubes(interpreter):
    """The selection path's one-launch pooling (GPU) against `pool_cubes`: the same cube means
    (sum in fp32, rounded once to the input dtype, divided by vbs), padding slots ignored."""
    from tilegen.coarse_gpu import _pool_kernel

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 4 * 64, 6, 16, generator=gen).to(torch.float16)
    vbs = torch.tensor([64, 32, 8, 1], dtype=torch.int32)
    x[0, 64 + 32:128] = 1e4  # padding slots: must not count
    for heads in (2, 1):  # heads per program (a contiguous slice of each token's row)
        out = torch.empty(1, 6, 4, 16)
        _pool_kernel[(4, 6 // heads)](x, vbs, vbs, out, 256, 6, 4, HEAD_DIM=16, HEADS=heads,
                                      BLOCK=64, ROWS=8, GATHER=False)
        torch.testing.assert_close(out, sparsity.pool_cubes(x, vbs), rtol=1e-3, atol=1e-4)


def test_pool_kernel_gathers_token_order_inputs(interpreter):
    """With ``sources`` the pooling reads token-order rows (no reorder to cubes first): the
    means of ``to_cubes`` then `pool_cubes`, on a grid of partial cubes (vbs 8 to 64)."""
    from tilegen.coarse_gpu import _pool_kernel

    grid = (5, 6, 4)  # cubes 2 x 2 x 1, partial along t and h
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 5 * 6 * 4, 2, 16, generator=gen).to(torch.float16)
    xc, vbs = layout.to_cubes(x, grid)
    src = layout.cube_sources(grid)
    nc = vbs.numel()
    assert vbs.tolist() == [64, 32, 16, 8]
    out = torch.empty(1, 2, nc, 16)
    _pool_kernel[(nc, 1)](x, vbs, src, out, x.shape[1], 2, nc, HEAD_DIM=16, HEADS=2, BLOCK=64,
                          ROWS=8, GATHER=True)
    torch.testing.assert_close(out, sparsity.pool_cubes(xc, vbs), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("grid,heads_kv", [((5, 6, 8), 4), ((8, 7, 4), 2)])
def test_mean_pool_topk_thw_selects_as_the_cube_major_path(grid, heads_kv):
    """The selection of THW-ordered tokens (what the 8-bit THW op runs) is `mean_pool_topk` of
    the reordered tokens: partial cubes, GQA, several seeds; bad shapes refused by name."""
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        n = math.prod(grid)
        q = torch.randn(2, n, 4, 16, generator=gen)
        k = torch.randn(2, n, heads_kv, 16, generator=gen)
        qc, vbs = layout.to_cubes(q, grid)
        kc, _ = layout.to_cubes(k, grid)
        got = sparsity.mean_pool_topk_thw(q, k, grid, 3)
        assert torch.equal(got, sparsity.mean_pool_topk(qc, kc, vbs, 3))
    with pytest.raises(ValueError, match=r"T\*H\*W="):
        sparsity.mean_pool_topk_thw(q[:, :-1], k, grid, 3)
