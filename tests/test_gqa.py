"""GQA/MQA through `tilegen.ops.block_sparse_attention` (issue #21, item 3): q with ``g * H_kv``
heads, k and v with ``H_kv``, query head h reading KV head h // g; forward and backward against
an fp32 reference written here (dense masked attention, the KV head picked by index, no repeat),
on the CPU: under the interpreter in this process and on the PyTorch path in a subprocess."""

from __future__ import annotations

import math

import pytest
import torch

from tilegen import sparsity
from tilegen.ops import block_sparse_attention
from tilegen.spec import Spec

VBS = torch.tensor([64, 48, 64, 16], dtype=torch.int32)  # partial cubes 1 and 3


def _inputs(seed: int, hq: int, hkv: int, topk: int = 2, d: int = 64):
    g = torch.Generator().manual_seed(seed)
    s = VBS.numel() * 64
    q = torch.randn(1, s, hq, d, generator=g).bfloat16()
    k = torch.randn(1, s, hkv, d, generator=g).bfloat16()
    v = torch.randn(1, s, hkv, d, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(VBS.numel(), generator=g)[:topk].sort().values
                       for _ in range(hq * VBS.numel())]).view(1, hq, VBS.numel(), topk).int()
    return q, k, v, idx


def _reference(q, k, v, idx, vbs):
    """fp32 dense attention over each row's chosen cubes' real keys; KV head h // g."""
    _, s, hq, d = q.shape
    g = hq // k.shape[2]
    n = vbs.numel()
    key_real = (torch.arange(64)[None, :] < vbs[:, None]).reshape(s)
    out = []
    for h in range(hq):
        allowed = torch.zeros(n, n, dtype=torch.bool)
        allowed.scatter_(1, idx[0, h].long(), True)
        mask = allowed.repeat_interleave(64, 0).repeat_interleave(64, 1) & key_real[None, :]
        qh, kh, vh = q[0, :, h], k[0, :, h // g], v[0, :, h // g]
        scores = (qh @ kh.T) / math.sqrt(d)
        out.append(torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ vh)
    return torch.stack(out, 1)[None]


@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 1)], ids=["g2", "g4_mqa"])
def test_gqa_forward_and_backward_match_the_reference(hq, hkv):
    q, k, v, idx = _inputs(0, hq, hkv)
    real = (torch.arange(64)[None, :] < VBS[:, None]).reshape(1, -1, 1, 1)
    do = torch.where(real, torch.randn(q.shape, generator=torch.Generator().manual_seed(1)),
                     0.0).bfloat16()
    qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
    o = block_sparse_attention(qr, kr, vr, idx, VBS)
    o.backward(do)
    q32, k32, v32 = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    ref = _reference(q32, k32, v32, idx, VBS)
    ref.backward(do.float())
    assert o.shape == q.shape and kr.grad.shape == k.shape and vr.grad.shape == v.shape
    r = real.expand_as(o)
    torch.testing.assert_close(o.float()[r], ref[r], atol=2e-2, rtol=2e-2)
    for got, want in ((qr.grad, q32.grad), (kr.grad, k32.grad), (vr.grad, v32.grad)):
        scale = want.abs().max()
        assert (got.float() - want).abs().max() <= 2e-2 * scale


def test_gqa_errors_name_the_argument():
    q, k, v, idx = _inputs(0, 4, 2)
    with pytest.raises(ValueError, match="does not divide q's 4"):
        block_sparse_attention(q, k[:, :, :1].repeat(1, 1, 3, 1), v[:, :, :1].repeat(1, 1, 3, 1),
                               idx, VBS)
    with pytest.raises(ValueError, match="k and v must have one shape"):
        block_sparse_attention(q, k, v[:, :, :1].contiguous(), idx, VBS)
    with pytest.raises(ValueError, match="num_kv_heads"):
        Spec(num_heads=40, num_kv_heads=3)
    assert Spec(num_kv_heads=40) == Spec()  # MHA has one spelling (and one hash)
    assert Spec(num_kv_heads=8).short_hash != Spec().short_hash


def test_selectors_take_kv_heads_per_group():
    """mean_pool_topk per query head, each against its group's pooled K: the same selection as
    with K's heads repeated."""
    q, k, v, _ = _inputs(2, 4, 2)
    got = sparsity.mean_pool_topk(q, k, VBS, 2)
    want = sparsity.mean_pool_topk(q, k.repeat_interleave(2, dim=2), VBS, 2)
    assert got.shape == (1, 4, VBS.numel(), 2) and torch.equal(got, want)
    scores = sparsity.coarse_scores(q, k, VBS)
    torch.testing.assert_close(scores, sparsity.coarse_scores(q, k.repeat_interleave(2, 2), VBS))


def test_gqa_on_the_pytorch_path(pytorch_path_run):
    """The CPU user's default (no interpreter): the same reference check in a fresh process."""
    pytorch_path_run("test_gqa", "test_gqa_forward_and_backward_match_the_reference(4, 2)")


@pytest.mark.parametrize("g", [2, 5])
def test_head_group_sum_matches_torch(interpreter, g):
    """The Gluon GQA backward's group sum (one Triton launch for dK and dV) against the fp32 sum
    over each group of query heads: rows past a program's end, g not a power of two. Within
    one bf16 step (the interpreter's fp32 -> bf16 cast truncates; the GPU rounds)."""
    from tilegen.backends.triton.group_sum import head_group_sum

    gen = torch.Generator().manual_seed(g)
    dk, dv = (torch.randn(1, 37, 3 * g, 16, generator=gen).bfloat16() for _ in range(2))
    got_k, got_v = head_group_sum(dk, dv, 3)
    for got, x in ((got_k, dk), (got_v, dv)):
        want = x.float().view(1, 37, 3, g, 16).sum(3)
        assert got.shape == (1, 37, 3, 16) and got.dtype == x.dtype
        torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=0)
        assert not torch.equal(got.float(), x.float().view(1, 37, 3, g, 16)[:, :, :, 0])
    with pytest.raises(ValueError, match="power-of-two"):
        head_group_sum(dk[..., :12].contiguous(), dv[..., :12].contiguous(), 3)
