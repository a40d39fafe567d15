"""256- and 384-token cubes (issue #21, item 4): FastVideo's VSA-256 tiles (4, 8, 8) and STA's
(6, 8, 8) tiles. The Triton family walks such a cube in BLOCK_M / BLOCK_N steps; forward and
backward are checked here against an fp32 reference written in this file (dense attention
masked to each row's chosen cubes and their real keys), with partial cubes, on the CPU: under the
interpreter and on the PyTorch path. The families that do not take them refuse by name."""

from __future__ import annotations

import math

import pytest
import torch

import tilegen
from tilegen.backends.triton.backward import PACK_MAX_CUBE, BackwardConfig
from tilegen.spec import Spec


def _reference(q, k, v, allowed, vbs, block):
    """fp32 attention of every token over the real keys of the cubes `allowed` (H, NQ, NKV)
    names for its cube; BSHD, batch 1."""
    _, s, heads, d = q.shape
    key_real = (torch.arange(block)[None, :] < vbs[:, None]).reshape(s)
    out = []
    for h in range(heads):
        mask = allowed[h].repeat_interleave(block, 0).repeat_interleave(block, 1)
        scores = (q[0, :, h] @ k[0, :, h].T) / math.sqrt(d)
        scores = scores.masked_fill(~(mask & key_real[None, :]), float("-inf"))
        out.append(torch.softmax(scores, -1) @ v[0, :, h])
    return torch.stack(out, 1)[None]


def _check_forward_backward(op, args, allowed, vbs, block, seed):
    """op's o and dq, dk, dv against the reference, on the real rows; dO is zero on padded
    query rows (the contract: they never reach a gradient)."""
    q, k, v = args[:3]
    g = torch.Generator().manual_seed(seed + 100)
    real = (torch.arange(block)[None, :] < vbs[:, None]).reshape(1, -1, 1, 1)
    do = torch.where(real, torch.randn(q.shape, generator=g), 0.0).bfloat16()
    qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
    o, _ = op(qr, kr, vr, *args[3:])
    o.backward(do)
    q32, k32, v32 = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    ref = _reference(q32, k32, v32, allowed, vbs, block)
    ref.backward(do.float())
    rows = real.reshape(-1)
    err = (o.float() - ref)[:, rows].abs().max().item()
    assert err <= 0.02 * ref[:, rows].abs().max().item(), err
    for name, got, want in (("dq", qr.grad, q32.grad), ("dk", kr.grad, k32.grad),
                            ("dv", vr.grad, v32.grad)):
        got, want = got.float()[:, rows], want[:, rows]
        assert torch.isfinite(got).all(), name
        rel = ((got - want).abs().max() / want.abs().max()).item()
        assert rel <= 0.02, (name, rel)
        cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), 0).item()
        assert cos >= 0.999, (name, cos)


def _lut_case(cube, seed, nq=3, heads=2, topk=2, d=64):
    block = math.prod(cube)
    g = torch.Generator().manual_seed(seed)
    s = nq * block
    q, k, v = (torch.randn(1, s, heads, d, generator=g).bfloat16() for _ in range(3))
    idx = torch.stack([torch.randperm(nq, generator=g)[:topk].sort().values
                       for _ in range(heads * nq)]).view(1, heads, nq, topk).int()
    # cube 1 partial past its first BLOCK_N step, cube 2 inside its first one
    vbs = torch.tensor([block, block - 70, 40], dtype=torch.int32)[:nq]
    allowed = torch.zeros(heads, nq, nq, dtype=torch.bool)
    allowed.scatter_(2, idx[0].long(), True)
    spec = Spec(block_q=block, block_kv=block, cube=cube, head_dim=d, num_heads=heads,
                topk=topk, grid=(cube[0], cube[1] * nq, cube[2]))
    return spec, (q, k, v, idx, vbs), allowed, vbs, block


@pytest.mark.parametrize("cube", [(4, 8, 8), (6, 8, 8)], ids=["256", "384"])
@pytest.mark.parametrize("seed", [0, 1])
def test_lut_op_forward_and_backward(cube, seed):
    """Under the interpreter: the generated forward and the three backward kernels."""
    spec, args, allowed, vbs, block = _lut_case(cube, seed)
    op = tilegen.load(spec)
    assert op.backend == "triton"
    _check_forward_backward(op, args, allowed, vbs, block, seed)


def test_sliding_tile_384_token_tiles_with_partial_edge_cubes():
    """STA on (6, 8, 8) tiles: grid (17, 8, 16) is a 3x1x2 cube grid whose last frame of cubes
    holds 5 of 6 frames (320 of 384 tokens); window (3, 1, 1): each query cube attends the
    cubes of its w column."""
    cube, grid = (6, 8, 8), (17, 8, 16)
    spec = Spec(encoding="sliding_tile", block_q=384, block_kv=384, cube=cube, head_dim=64,
                num_heads=2, grid=grid, window=(3, 1, 1))
    nc = 6
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, nc * 384, 2, 64, generator=g).bfloat16() for _ in range(3))
    t_of = torch.arange(nc) // 2  # cube id = (t * 1 + h) * 2 + w
    vbs = torch.where(t_of == 2, 5 * 64, 384).to(torch.int32)
    w_of = torch.arange(nc) % 2
    allowed = (w_of[:, None] == w_of[None, :]).expand(2, nc, nc)
    op = tilegen.load(spec)
    _check_forward_backward(op, (q, k, v, vbs), allowed, vbs, 384, 3)


def test_lut_op_on_the_pytorch_path(pytorch_path_run):
    """The CPU user's default (no interpreter): the same check in a fresh process."""
    pytorch_path_run("test_large_cubes", "test_lut_op_forward_and_backward((4, 8, 8), 2)")


def test_mask_encoding_with_256_token_cubes():
    """A mask spec runs the LUT kernel behind its on-device conversion, at 256 tokens too."""
    spec, (q, k, v, _, vbs), allowed, vbs, block = _lut_case((4, 8, 8), 4)
    allowed[:, :, 0] = True  # a mask may name more cubes than the LUT's width
    op = tilegen.load(spec.replace(encoding="mask"))
    _check_forward_backward(op, (q, k, v, allowed[None].contiguous(), vbs), allowed, vbs,
                            block, 4)


@pytest.mark.parametrize("backend,target", [("cuda", "sm_90"), ("gluon", "sm_90"),
                                            ("hip", "gfx942")])
def test_other_families_refuse_by_name(backend, target):
    spec = Spec(block_q=256, block_kv=256, cube=(4, 8, 8), grid=(8, 16, 16), topk=4)
    with pytest.raises(ValueError, match=r"256.*families that take it: \['triton'\]"):
        tilegen.load(spec, target=target, backend=backend)


def test_backward_packing_is_left_out_for_large_cubes():
    spec = Spec(block_q=384, block_kv=384, cube=(6, 8, 8), grid=(12, 16, 16), topk=4)
    packed = BackwardConfig(dkdv_pack=True, dq_pack=True, dq_block_n=64)
    assert any(f"up to {PACK_MAX_CUBE} tokens" in p for p in packed.violations(spec))
    fitted = packed.fit(spec)
    assert not (fitted.dq_pack or fitted.dkdv_pack or fitted.gluon)
    assert fitted.violations(spec) == []
    small = Spec()
    assert BackwardConfig(dkdv_pack=True).fit(small).dkdv_pack  # unchanged at 64 tokens


def test_spec_accepts_the_sizes_and_checks_the_cube():
    assert Spec(block_q=256, block_kv=256, cube=(4, 8, 8), grid=(8, 16, 16), topk=4).block_kv == 256
    with pytest.raises(ValueError, match="holds 256 tokens"):
        Spec(block_q=384, block_kv=384, cube=(4, 8, 8), grid=(8, 16, 16), topk=4)
    with pytest.raises(ValueError, match="block_q=512"):
        Spec(block_q=512, block_kv=512, cube=(8, 8, 8), grid=(8, 16, 16), topk=4)
