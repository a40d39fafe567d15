"""`tilegen.ops.video_sparse_attention`: the full VSA forward against its fp32 reference (CPU
PyTorch path and the interpreter), gates, partial cubes, gradients, torch.compile, bad input."""

import math

import pytest
import torch
import triton.language  # noqa: F401  (see below)

from tilegen import captures, layout, sparsity, vsa
from tilegen.ops import video_sparse_attention, vsa_fine

# triton.language is imported above under conftest's TRITON_INTERPRET=1: the PyTorch-path tests
# below turn the variable off, and Triton fixes its interpreter mode at its first import.

GRID = (6, 7, 9)  # 2x2x3 cubes, partial along every axis (vbs from 64 down to 2*3*1 = 6)


def _tokens(seed=0, grid=GRID, b=1, h=2, d=64, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    n = math.prod(grid)
    return tuple(torch.randn(b, n, h, d, generator=g).to(dtype) for _ in range(3))


def _gates(q):
    g = torch.Generator().manual_seed(9)
    B, N, H, D = q.shape
    return {"none": None,
            "per_head": torch.rand(B, N, H, 1, generator=g).to(q.dtype),
            "full_fp32": torch.rand(B, N, H, D, generator=g),
            "broadcast": torch.rand(1, 1, H, 1, generator=g).to(q.dtype),
            "zero": torch.zeros(())}


@pytest.fixture
def pytorch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU PyTorch path of the fine op


def _check(q, k, v, grid, topk, cube, gate):
    out, idx = vsa.forward(q, k, v, grid, topk, cube, gate, fine=vsa_fine, return_selection=True)
    op = video_sparse_attention(q, k, v, grid, topk, cube, gate)
    assert torch.equal(op, out) and op.shape == q.shape and op.dtype == q.dtype
    ref, ref_idx = vsa.reference_fp32(q, k, v, grid, topk, cube, gate)
    assert torch.equal(idx, ref_idx)  # the selection, from fp64 pooled scores
    qc, vbs = layout.to_cubes(q, grid, cube)
    kc, _ = layout.to_cubes(k, grid, cube)
    assert torch.equal(idx, sparsity.mean_pool_topk(qc, kc, vbs, topk, block=math.prod(cube)))
    res = captures.score(op, ref.to(op.dtype))
    assert res.passed, res
    return op, ref


@pytest.mark.parametrize("gate", ["none", "per_head", "full_fp32", "broadcast", "zero"])
def test_matches_fp32_reference(pytorch_path, gate):
    q, k, v = _tokens(0)
    _check(q, k, v, GRID, 3, (4, 4, 4), _gates(q)[gate])


def test_gate_semantics(pytorch_path):
    """gate=None is a gate of 1; a zero gate leaves the fine stage alone."""
    q, k, v = _tokens(1)
    ones = torch.ones(1, 1, 1, 1, dtype=q.dtype)
    assert torch.equal(video_sparse_attention(q, k, v, GRID, 3),
                       video_sparse_attention(q, k, v, GRID, 3, gate=ones))
    _, idx = vsa.forward(q, k, v, GRID, 3, fine=vsa_fine, return_selection=True)
    fine = vsa.reference_fp32(q, k, v, GRID, 3, gate=torch.zeros(()), topk_idx=idx)[0]
    coarse = vsa.reference_fp32(q, k, v, GRID, 3, topk_idx=idx)[0] - fine
    # the coarse output is one vector per query cube: equal across the tokens of a cube
    cube_of = layout.token_slots(GRID) // 64
    first = coarse[:, (cube_of == 0)]
    assert torch.allclose(first, first[:, :1].expand_as(first), atol=1e-6)
    assert coarse.abs().max() > 1e-3


@pytest.mark.parametrize("grid,cube,topk", [((5, 6, 8), (4, 4, 4), 1),
                                            ((4, 8, 8), (2, 4, 4), 5),
                                            ((9, 4, 4), (4, 4, 4), 3),
                                            ((8, 16, 12), (4, 8, 8), 2)])
def test_other_grids_and_cubes(pytorch_path, grid, cube, topk):
    q, k, v = _tokens(2, grid=grid, b=2, h=1, d=128)
    _check(q, k, v, grid, topk, cube, _gates(q)["per_head"])


def test_outlier_head_capture(pytorch_path):
    """A synthesized capture with its outlier head (max logit ~300) stays finite and passes."""
    cap = captures.synthesize(seed=0, grid=GRID, heads=2, head_dim=64, topk=2)
    q, k, v = (layout.from_cubes(cap[n], GRID) for n in ("q", "k", "v"))
    _check(q, k, v, GRID, 2, (4, 4, 4), _gates(q)["per_head"])


def test_interpreter_matches_reference(monkeypatch):
    """One tiny case through the generated Triton kernel under Triton's interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    grid = (5, 4, 8)  # 2x1x2 cubes, partial in t
    q, k, v = _tokens(3, grid=grid, h=1, d=64, dtype=torch.float16)  # bf16: see conftest
    _check(q, k, v, grid, 2, (4, 4, 4), _gates(q)["full_fp32"])


def test_gradients_match_fp32_autograd(pytorch_path):
    q, k, v = _tokens(4)
    gate = _gates(q)["per_head"]
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(q.dtype)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, gate)]
    out = video_sparse_attention(*leaves[:3], GRID, 3, gate=leaves[3])
    assert captures.score(out.detach(), video_sparse_attention(q, k, v, GRID, 3,
                                                               gate=gate)).passed
    out.backward(do)
    _, idx = vsa.forward(q, k, v, GRID, 3, gate=gate, fine=vsa_fine, return_selection=True)
    ref_leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v, gate)]
    ref, _ = vsa.reference_fp32(*ref_leaves[:3], GRID, 3, gate=ref_leaves[3], topk_idx=idx)
    ref.backward(do.float())
    for name, a, b in zip("qkvg", leaves, ref_leaves, strict=True):
        res = captures.grad_score(a.grad.float(), b.grad)
        assert res.passed, (name, res)


def test_torch_compile_fullgraph(pytorch_path):
    torch._dynamo.reset()
    q, k, v = _tokens(6)
    gate = _gates(q)["per_head"]

    def block(q, k, v, gate):
        return video_sparse_attention(q, k, v, GRID, 3, gate=gate) * 2 + q

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k, v, gate), block(q, k, v, gate))
    # with gradients: the composite path, traced whole
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, gate)]
    eager = [t.clone().requires_grad_(True) for t in (q, k, v, gate)]
    compiled(*leaves).float().sum().backward()
    block(*eager).float().sum().backward()
    for a, b in zip(leaves, eager, strict=True):
        assert torch.equal(a.grad, b.grad)


def test_custom_op_schema_and_fake(pytorch_path):
    q, k, v = _tokens(7)
    gate = _gates(q)["per_head"]
    for g in (None, gate):
        torch.library.opcheck(torch.ops.tilegen.video_sparse_attention.default,
                              (q, k, v, g, list(GRID), 3, [4, 4, 4], None),
                              test_utils=("test_schema", "test_faketensor"))


def test_bad_input_raises_before_running():
    q, k, v = _tokens(8)
    n = q.shape[1]
    with pytest.raises(TypeError, match="q has dtype"):
        video_sparse_attention(q.float(), k, v, GRID, 3)
    with pytest.raises(ValueError, match="T\\*H\\*W"):
        video_sparse_attention(q[:, :-1], k, v, GRID, 3)
    with pytest.raises(ValueError, match="k must match"):
        video_sparse_attention(q, k[..., :32], v, GRID, 3)
    with pytest.raises(ValueError, match="topk"):
        video_sparse_attention(q, k, v, GRID, 13)  # 12 cubes
    with pytest.raises(TypeError, match="topk"):
        video_sparse_attention(q, k, v, GRID, 2.5)
    with pytest.raises(ValueError, match="gate must broadcast"):
        video_sparse_attention(q, k, v, GRID, 3, gate=torch.ones(1, n, 3, 1))
    with pytest.raises(TypeError, match="gate must be a floating"):
        video_sparse_attention(q, k, v, GRID, 3, gate=torch.ones(1, n, 2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="grid"):
        video_sparse_attention(q, k, v, (6, 7), 3)
    with pytest.raises(ValueError, match="sm_scale"):
        video_sparse_attention(q, k, v, GRID, 3, sm_scale=-1.0)
    q2, k2, v2 = _tokens(8, grid=(4, 8, 8))
    with pytest.raises(ValueError, match="64-token cubes"):
        video_sparse_attention(q2.requires_grad_(True), k2, v2, (4, 8, 8), 2, cube=(2, 4, 4))


def test_default_topk_is_the_default_density():
    assert vsa.default_topk((21, 30, 52)) == 78
    assert vsa.default_topk(GRID) == max(1, round(12 * 78 / 624))


def test_gpu_script_dry_run(tmp_path):
    """bench/experiments/h200_vsa.py runs every section at tiny sizes on the CPU (it is what the
    H200 runs)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(root), OUT=str(tmp_path))
    script = root / "bench" / "experiments" / "h200_vsa.py"
    res = subprocess.run([sys.executable, str(script), "--dry-run"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads((tmp_path / "h200_vsa_dry.json").read_text())
    assert data["errors"] == {}, data["errors"]
    assert data["sections"]["correctness"]["passed"]
    assert "| VSA total, gate None |" in res.stdout.splitlines()[-30:][0] or \
        "recall study" in res.stdout


def test_contract_spelling_after_a_bare_import():
    """contract.md writes `tilegen.ops.video_sparse_attention` after `import tilegen`."""
    import subprocess
    import sys

    code = ("import tilegen; f = tilegen.ops.video_sparse_attention; "
            "assert callable(f) and callable(tilegen.sparsity.mean_pool_topk); "
            "import sys; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_fused_reorder_matches_to_cubes(interpreter):
    """The forward's one-launch reorder of q, k and v gives `layout.to_cubes` exactly (padding
    slots zero), on a grid with partial cubes along every axis."""
    from tilegen.reorder_gpu import to_cubes3

    grid, cube = (5, 6, 7), (4, 4, 4)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5 * 6 * 7, 3, 16, generator=gen).to(torch.bfloat16)
               for _ in range(3))
    got = to_cubes3(q, k, v, grid, cube)
    for x, xc in zip((q, k, v), got, strict=True):
        assert torch.equal(xc, layout.to_cubes(x, grid, cube)[0])


GRIDS = [(6, 7, 9), (4, 4, 4), (5, 4, 8)]  # 12 cubes, a single cube, 4 cubes
TOPKS = [3, 1, 2]


def _packed(seed=11, h=2, dtype=torch.bfloat16):
    """Per-sequence tokens and their packing along the token axis (batch 1)."""
    seqs = [_tokens(seed + i, grid=g, h=h, dtype=dtype) for i, g in enumerate(GRIDS)]
    packed = tuple(torch.cat([s[j] for s in seqs], 1) for j in range(3))
    return seqs, packed


def test_list_of_grids_matches_each_sequence(pytorch_path):
    """Packed sequences of three grids (one a single cube) in one call: each sequence's part is
    its own video_sparse_attention (bit for bit) and passes the rule against the fp32 oracle;
    a gate with a token dimension is split with the tokens."""
    seqs, (q, k, v) = _packed()
    g = torch.Generator().manual_seed(3)
    gate = torch.rand(1, q.shape[1], q.shape[2], 1, generator=g).to(q.dtype)
    out = video_sparse_attention(q, k, v, GRIDS, TOPKS, gate=gate)
    assert out.shape == q.shape and out.dtype == q.dtype
    at = 0
    for (qs, ks, vs), grid, topk in zip(seqs, GRIDS, TOPKS, strict=True):
        n = math.prod(grid)
        gs = gate[:, at:at + n]
        want = video_sparse_attention(qs, ks, vs, grid, topk, gate=gs)
        assert torch.equal(out[:, at:at + n], want), grid
        ref, _ = vsa.reference_fp32(qs, ks, vs, grid, topk, gate=gs)
        res = captures.score(out[:, at:at + n].contiguous(), ref.to(q.dtype))
        assert res.passed, (grid, res)
        at += n
    # one topk for all must fit every grid (nothing is clamped)
    with pytest.raises(ValueError, match=r"topk for grid\[1\]=\(4, 4, 4\) must be an int in"):
        video_sparse_attention(q, k, v, GRIDS, 2)
    with pytest.raises(ValueError, match=r"must be \(1, 602, heads, D\)"):
        video_sparse_attention(q[:, :-1], k[:, :-1], v[:, :-1], GRIDS, TOPKS)
    with pytest.raises(ValueError, match="whose cubes have 64 tokens"):
        video_sparse_attention(q, k, v, GRIDS, TOPKS, cube=(2, 4, 4))


def test_list_of_grids_gradients_match_fp32_autograd(pytorch_path):
    """Gradients through the packed call against each sequence's fp32 oracle on its
    selection."""
    seqs, (q, k, v) = _packed(21)
    g = torch.Generator().manual_seed(5)
    do = torch.randn(q.shape, generator=g).to(q.dtype)
    gate = torch.rand(1, q.shape[1], q.shape[2], 1, generator=g).to(q.dtype)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, gate)]
    video_sparse_attention(*leaves[:3], GRIDS, TOPKS, gate=leaves[3]).backward(do)
    at = 0
    for (qs, ks, vs), grid, topk in zip(seqs, GRIDS, TOPKS, strict=True):
        n = math.prod(grid)
        _, idx = vsa.forward(qs, ks, vs, grid, topk, fine=vsa_fine, return_selection=True)
        ref_leaves = [t.detach().float().requires_grad_(True)
                      for t in (qs, ks, vs, gate[:, at:at + n])]
        ref, _ = vsa.reference_fp32(*ref_leaves[:3], grid, topk, gate=ref_leaves[3],
                                    topk_idx=idx)
        ref.backward(do[:, at:at + n].float())
        for name, a, b in zip(("q", "k", "v", "gate"), leaves, ref_leaves, strict=True):
            res = captures.grad_score(a.grad[:, at:at + n].float(), b.grad)
            assert res.passed, (grid, name, res)
        at += n


def test_packed_reorder_matches_each_sequence(interpreter):
    """The list-of-grids forward's one-launch reorder: each sequence's slots are its own
    `layout.to_cubes`, side by side (padding slots zero)."""
    from tilegen.reorder_gpu import to_cubes3_packed

    seqs, (q, k, v) = _packed(31, h=1)
    src = layout.packed_slot_sources(tuple(GRIDS), (4, 4, 4), "cpu").long()
    slots = layout.packed_token_slots(tuple(GRIDS), (4, 4, 4), "cpu")
    assert torch.equal(src[slots], torch.arange(q.shape[1]))  # each token's slot holds it
    got = to_cubes3_packed(q, k, v, tuple(GRIDS), (4, 4, 4))
    for j in range(3):
        want = torch.cat([layout.to_cubes(s[j], g, (4, 4, 4))[0]
                          for s, g in zip(seqs, GRIDS, strict=True)], 1)
        assert torch.equal(got[j], want)
