"""FastVideo's calling convention (`tilegen.integrations.fastvideo`) against fp32 references
written here, forward and backward, on the CPU (the op's PyTorch path)."""

import math

import pytest
import torch

from tilegen.integrations import fastvideo as fv

B, H, NB, D = 1, 2, 6, 64
S = NB * 64
VBS = torch.tensor([64, 64, 32, 64, 16, 64], dtype=torch.int32)


def inputs(seed: int, zero_pad: bool = True):
    """q, k, v (B, H, S, D) bf16 requiring grad, and dO; padded tokens zero (FastVideo's own
    inputs are zero-padded) or garbage."""
    g = torch.Generator().manual_seed(seed)
    real = (torch.arange(64)[None, :] < VBS[:, None]).reshape(1, 1, S, 1)
    out = []
    for _ in range(4):
        x = torch.randn(B, H, S, D, generator=g)
        out.append(torch.where(real, x, 0.0 if zero_pad else 7.0 * torch.randn(x.shape,
                                                                               generator=g)))
    q, k, v, do = (x.to(torch.bfloat16) for x in out)
    return [t.requires_grad_(True) for t in (q, k, v)] + [torch.where(real, do, 0)], real


def reference(q, k, v, allowed):
    """fp32 attention of every query row over the real keys of its allowed blocks
    (`allowed`: (B, H, NB, NB) bool); (o, M) with M = log2 of the row's sum of
    exp(scaled scores)."""
    q, k, v = (t.float() for t in (q, k, v))
    key_real = (torch.arange(64)[None, :] < VBS[:, None]).reshape(S)
    mask = allowed.repeat_interleave(64, dim=2).repeat_interleave(64, dim=3) & key_real
    s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(D)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v), torch.logsumexp(s, dim=-1) / math.log(2)


def lists(seed: int):
    """(q2k_idx, q2k_num, allowed): random distinct blocks per row, ragged counts, garbage
    past each row's count."""
    g = torch.Generator().manual_seed(seed)
    K = 4
    idx = torch.stack([torch.randperm(NB, generator=g)[:K] for _ in range(B * H * NB)])
    num = torch.randint(1, K + 1, (B * H * NB,), generator=g)
    allowed = torch.zeros(B * H * NB, NB, dtype=torch.bool)
    for r in range(B * H * NB):
        allowed[r, idx[r, :num[r]]] = True
    idx = torch.where(torch.arange(K)[None, :] < num[:, None], idx, -5)  # garbage past num
    shape = (B, H, NB)
    return (idx.view(*shape, K).to(torch.int32), num.view(shape).to(torch.int32),
            allowed.view(*shape, NB))


def close(a, b, tol):
    a, b = a.float(), b.float()
    return (a - b).abs().max().item() <= tol * b.abs().max().item()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("entry", ["from_indices", "block_map"])
def test_block_sparse_forward_and_backward_match_fp32(seed, entry):
    (q, k, v, do), real = inputs(seed, zero_pad=False)
    idx, num, allowed = lists(seed)
    if entry == "from_indices":
        o, m = fv.block_sparse_attn_from_indices(q, k, v, idx, num, VBS)
    else:
        o, m = fv.block_sparse_attn(q, k, v, allowed, VBS)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert m.shape == (B, H, S) and m.dtype == torch.float32
    grads = torch.autograd.grad(o, (q, k, v), do)
    qr, kr, vr = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    o_ref, m_ref = reference(qr, kr, vr, allowed)
    ref_grads = torch.autograd.grad(o_ref, (qr, kr, vr), do.float())
    rows = real.expand_as(o)
    assert close(o[rows], o_ref[rows], 2e-2)
    assert torch.allclose(m[real[..., 0].expand_as(m)], m_ref[real[..., 0].expand_as(m_ref)],
                          atol=2e-2)
    for g, r in zip(grads, ref_grads, strict=True):
        assert close(g[rows], r[rows], 2e-2)


def test_video_sparse_attn_matches_fastvideos_formula():
    """The coarse stage (block means, softmax, broadcast back), the fine stage over the
    top-k blocks of the coarse scores, the gate; forward and backward against fp32."""
    (q, k, v, do), real = inputs(3)
    gate = torch.rand(B, H, S, D, generator=torch.Generator().manual_seed(9))
    topk = 3
    o = fv.video_sparse_attn(q, k, v, VBS, VBS.clone(), topk, (4, 4, 4), gate.to(q.dtype))
    grads = torch.autograd.grad(o, (q, k, v), do)

    qr, kr, vr = (t.detach().float().requires_grad_(True) for t in (q, k, v))

    def means(x):
        return x.view(B, H, NB, 64, D).sum(3) / VBS.float().view(1, 1, NB, 1)

    scores = means(qr) @ means(kr).transpose(-2, -1) / math.sqrt(D)
    coarse = (torch.softmax(scores, -1) @ means(vr)).repeat_interleave(64, dim=2)
    allowed = torch.zeros(B, H, NB, NB, dtype=torch.bool).scatter_(
        -1, scores.topk(topk, -1).indices, True)
    fine, _ = reference(qr, kr, vr, allowed)
    o_ref = coarse * gate + fine
    ref_grads = torch.autograd.grad(o_ref, (qr, kr, vr), do.float())
    rows = real.expand_as(o)
    assert close(o[rows], o_ref[rows], 2e-2)
    for g, r in zip(grads, ref_grads, strict=True):
        assert close(g[rows], r[rows], 3e-2)


def test_gate_defaults_to_plain_sum_and_block_size_forms_agree():
    (q, k, v, _), _ = inputs(4)
    with torch.no_grad():
        a = fv.video_sparse_attn(q, k, v, VBS, VBS, 2)
        b = fv.video_sparse_attn(q, k, v, VBS, VBS, 2, block_size=4,
                                 compress_attn_weight=torch.ones_like(q))
        c = fv.video_sparse_attn(q, k, v, VBS, VBS, 2, block_size=(2, 4, 8))
    assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("call,needle", [
    (lambda q, k, v: fv.video_sparse_attn(q, k, v, VBS, VBS, 2, block_size=(4, 8, 8)),
     "64-token blocks only"),
    (lambda q, k, v: fv.block_sparse_attn_from_indices(
        q, k[:, :, :100], v[:, :, :100], *lists(0)[:2], VBS), "whole number of 64-token"),
    (lambda q, k, v: fv.video_sparse_attn(q, k, v, VBS[:4], VBS[:4], 2),
     "variable_block_sizes must have length 6"),
    (lambda q, k, v: fv.block_sparse_attn(q, k, v, torch.ones(NB, NB, dtype=torch.bool), VBS),
     "block_map must be"),
    (lambda q, k, v: fv.block_sparse_attn_from_indices(q, k, v, lists(0)[0][:, :, :2],
                                                       lists(0)[1], VBS), "q2k_idx must be"),
])
def test_what_tilegen_does_not_take_is_refused_in_one_line(call, needle):
    (q, k, v, _), _ = inputs(5)
    with pytest.raises(ValueError, match=needle) as err:
        call(q, k, v)
    assert "\n" not in str(err.value)


def test_strided_views_are_taken_as_fastvideo_takes_them():
    """FastVideo's callers pass BHSD views of BSHD tensors; the result equals the contiguous
    call's."""
    (q, k, v, _), _ = inputs(6)
    idx, num, _ = lists(6)
    views = [t.detach().transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert not views[0].is_contiguous()
    with torch.no_grad():
        o_view, m_view = fv.block_sparse_attn_from_indices(*views, idx, num, VBS)
        o, m = fv.block_sparse_attn_from_indices(q, k, v, idx, num, VBS)
    assert torch.equal(o_view, o) and torch.equal(m_view, m)


def test_cross_attention_and_query_block_sizes():
    """S_q != S_kv as FastVideo's Triton path takes it (KV blocks' sizes, every query row
    real), and a q_variable_block_sizes of its own in video_sparse_attn: against fp32."""
    (q, k, v, do), _ = inputs(7)
    nq = 4
    qs = q.detach()[:, :, :nq * 64].contiguous().requires_grad_(True)
    g = torch.Generator().manual_seed(8)
    idx = torch.stack([torch.randperm(NB, generator=g)[:3] for _ in range(B * H * nq)])
    idx = idx.view(B, H, nq, 3).to(torch.int32)
    num = torch.full((B, H, nq), 3, dtype=torch.int32)
    allowed = torch.zeros(B, H, nq, NB, dtype=torch.bool).scatter_(-1, idx.long(), True)
    o, m = fv.block_sparse_attn_from_indices(qs, k, v, idx, num, VBS)
    assert o.shape == qs.shape and m.shape == (B, H, nq * 64)
    dos = torch.randn(qs.shape, generator=g).to(qs.dtype)
    grads = torch.autograd.grad(o, (qs, k, v), dos)
    qr, kr, vr = (t.detach().float().requires_grad_(True) for t in (qs, k, v))
    key_real = (torch.arange(64)[None, :] < VBS[:, None]).reshape(S)
    mask = allowed.repeat_interleave(64, dim=2).repeat_interleave(64, dim=3) & key_real
    sc = (qr @ kr.transpose(-2, -1) / math.sqrt(D)).masked_fill(~mask, float("-inf"))
    o_ref = torch.softmax(sc, -1) @ vr
    ref_grads = torch.autograd.grad(o_ref, (qr, kr, vr), dos.float())
    assert close(o, o_ref, 2e-2)
    assert close(m, torch.logsumexp(sc, -1) / math.log(2), 1e-3)
    for got, want in zip(grads, ref_grads, strict=True):  # every query row real: all of dq
        assert close(got, want, 3e-2)
    # query blocks of their own sizes: the same call as tilegen's q_vbs
    q_sizes = torch.tensor([64, 40, 64, 64, 64, 8], dtype=torch.int32)
    with torch.no_grad():
        a = fv.video_sparse_attn(q, k, v, VBS, q_sizes, 2)
        b = fv.video_sparse_attn(q, k, v, VBS, VBS, 2)
    rows = (torch.arange(64)[None, :] < q_sizes[:, None]).reshape(S)
    assert a.shape == q.shape and torch.isfinite(a[:, :, rows]).all()
    assert not torch.equal(a, b)  # the query blocks' means differ
