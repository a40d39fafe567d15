"""Packed variable-length batches (issue #21, item 2): `block_sparse_attention_varlen` over three
sequences of different lengths, one of them a single cube, with LUT ids local to each sequence,
in one call. Forward and dq, dk, dv against an fp32 reference written here (each sequence's own
dense attention masked to its rows' chosen cubes and their real keys), on the CPU: under the
interpreter and on the PyTorch path; self-attention, cross lengths and GQA."""

from __future__ import annotations

import math

import pytest
import torch

from tilegen.ops import block_sparse_attention_varlen

BLOCK = 64


def _reference(q, k, v, idx, vbs, cu_q, cu_kv):
    """fp32, packed (total, H, D): sequence s's query cubes over its own KV cubes only."""
    total_q, hq, d = q.shape
    g = hq // k.shape[1]
    out = torch.zeros(total_q, hq, d)
    for s in range(cu_q.numel() - 1):
        q0, q1 = int(cu_q[s]), int(cu_q[s + 1])
        k0, k1 = int(cu_kv[s]), int(cu_kv[s + 1])
        real = (torch.arange(BLOCK)[None, :] < vbs[k0:k1, None]).reshape(-1)
        for h in range(hq):
            allowed = torch.zeros(q1 - q0, k1 - k0, dtype=torch.bool)
            allowed.scatter_(1, idx[h, q0:q1].long(), True)
            mask = allowed.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
            qs = q[q0 * BLOCK:q1 * BLOCK, h]
            ks = k[k0 * BLOCK:k1 * BLOCK, h // g]
            vs = v[k0 * BLOCK:k1 * BLOCK, h // g]
            scores = (qs @ ks.T / math.sqrt(d)).masked_fill(~(mask & real[None, :]),
                                                             float("-inf"))
            out[q0 * BLOCK:q1 * BLOCK, h] = torch.softmax(scores, -1) @ vs
    return out


def _case(seed, cubes_q, cubes_kv, hq=2, hkv=2, topk=2):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(cubes_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_kv = torch.tensor([0, *torch.tensor(cubes_kv).cumsum(0).tolist()], dtype=torch.int32)
    nq, nkv = int(cu_q[-1]), int(cu_kv[-1])
    q = torch.randn(nq * BLOCK, hq, 64, generator=g).bfloat16()
    k, v = (torch.randn(nkv * BLOCK, hkv, 64, generator=g).bfloat16() for _ in range(2))
    width = min(topk, min(cubes_kv))
    rows = []
    for s, n in enumerate(cubes_q):
        for _ in range(hq * n):
            rows.append(torch.randperm(cubes_kv[s], generator=g)[:width].sort().values)
    # (H, NQ_total, TOPK): rows were drawn per sequence, head-major inside it
    per_seq, at = [], 0
    for n in cubes_q:
        per_seq.append(torch.stack(rows[at:at + hq * n]).view(hq, n, width))
        at += hq * n
    idx = torch.cat(per_seq, 1).int().contiguous()
    # each sequence's last KV cube partial; the last query cube of each partial too
    vbs = torch.full((nkv,), BLOCK, dtype=torch.int32)
    vbs[cu_kv[1:].long() - 1] = torch.tensor([40, 17, 64][:len(cubes_kv)], dtype=torch.int32)
    q_vbs = torch.full((nq,), BLOCK, dtype=torch.int32)
    q_vbs[cu_q[1:].long() - 1] = torch.tensor([33, 64, 9][:len(cubes_q)], dtype=torch.int32)
    return q, k, v, idx, vbs, q_vbs, cu_q, cu_kv


@pytest.mark.parametrize("cubes_q,cubes_kv,hkv", [
    ((3, 1, 2), (3, 1, 2), 2),
    ((2, 1, 3), (3, 2, 1), 1),
], ids=["self", "cross_gqa"])
def test_varlen_forward_and_backward(cubes_q, cubes_kv, hkv):
    q, k, v, idx, vbs, q_vbs, cu_q, cu_kv = _case(0, cubes_q, cubes_kv, hkv=hkv)
    rows = (torch.arange(BLOCK)[None, :] < q_vbs[:, None]).reshape(-1)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(7))
    do[~rows] = 0.0
    do = do.bfloat16()
    qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
    o = block_sparse_attention_varlen(qr, kr, vr, idx, vbs, cu_q, cu_kv, q_vbs=q_vbs)
    o.backward(do)
    q32, k32, v32 = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    ref = _reference(q32, k32, v32, idx, vbs, cu_q, cu_kv)
    ref.backward(do.float())
    assert o.shape == q.shape and kr.grad.shape == k.shape
    err = (o.float() - ref)[rows].abs().max().item()
    assert err <= 0.02 * ref[rows].abs().max().item(), err
    for name, got, want in (("dq", qr.grad[rows], q32.grad[rows]), ("dk", kr.grad, k32.grad),
                            ("dv", vr.grad, v32.grad)):
        got = got.float()
        rel = ((got - want).abs().max() / want.abs().max()).item()
        cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), 0).item()
        assert rel <= 0.02 and cos >= 0.999, (name, rel, cos)


def test_varlen_equals_a_loop_over_the_sequences():
    """One packed call gives each sequence's own block_sparse_attention result, bit for bit."""
    from tilegen.ops import block_sparse_attention

    q, k, v, idx, vbs, q_vbs, cu_q, cu_kv = _case(1, (2, 1, 3), (2, 1, 3))
    o, lse = block_sparse_attention_varlen(q, k, v, idx, vbs, cu_q, cu_kv, q_vbs=q_vbs,
                                           return_lse=True)
    for s in range(3):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[s], cu_q[s + 1], cu_kv[s], cu_kv[s + 1]))
        want, want_lse = block_sparse_attention(
            q[None, q0 * BLOCK:q1 * BLOCK], k[None, k0 * BLOCK:k1 * BLOCK],
            v[None, k0 * BLOCK:k1 * BLOCK], idx[None, :, q0:q1].contiguous(), vbs[k0:k1],
            q_vbs=q_vbs[q0:q1], return_lse=True)
        torch.testing.assert_close(o[q0 * BLOCK:q1 * BLOCK], want[0], rtol=0, atol=0)
        torch.testing.assert_close(lse[:, q0 * BLOCK:q1 * BLOCK], want_lse[0], rtol=0, atol=0)


def test_varlen_errors_name_the_argument():
    q, k, v, idx, vbs, q_vbs, cu_q, cu_kv = _case(2, (3, 1, 2), (3, 1, 2))
    bad = idx.clone()
    bad[0, 3, 0] = 1  # sequence 1 has one KV cube: a local id of 1 is outside it
    with pytest.raises(ValueError, match=r"topk_idx\[0, 3, 0\] = 1 is outside \[0, 1\)"):
        block_sparse_attention_varlen(q, k, v, bad, vbs, cu_q, cu_kv)
    with pytest.raises(ValueError, match="cu_cubes_kv=.* must rise from 0"):
        block_sparse_attention_varlen(q, k, v, idx, vbs, cu_q, cu_kv - 1)
    with pytest.raises(TypeError, match="cu_cubes_q has dtype torch.int64"):
        block_sparse_attention_varlen(q, k, v, idx, vbs, cu_q.long(), cu_kv)
    with pytest.raises(ValueError, match="must list the same sequences"):
        block_sparse_attention_varlen(q, k, v, idx, vbs, cu_q[:3].contiguous(), cu_kv)
    with pytest.raises(ValueError, match=r"q must be 3-D \(total, heads, D\)"):
        block_sparse_attention_varlen(q[None], k, v, idx, vbs, cu_q, cu_kv)


def test_varlen_on_the_pytorch_path(pytorch_path_run):
    pytorch_path_run("test_varlen", "test_varlen_forward_and_backward((2, 1, 3), (3, 2, 1), 1); "
                     "t.test_varlen_equals_a_loop_over_the_sequences()")
