"""K/V of their own shape (issue #21, items 1 and 3): cross-attention with ``S_q != S_kv`` in
both directions, with a ``q_vbs`` of partial query cubes, and GQA read in place (query head h
reads KV head h // g). Forward and dq, dk, dv are checked against an fp32 reference written here
(dense attention masked to each row's chosen KV cubes and their real keys, the KV head picked by
index), on the CPU: under the interpreter in this process and on the PyTorch path in a
subprocess. The families that address K/V by q's shape refuse such calls by name."""

from __future__ import annotations

import math

import known_spills
import pytest
import torch

import tilegen
from tilegen.ops import block_sparse_attention
from tilegen.spec import Spec

BLOCK = 64


def _reference(q, k, v, allowed, vbs):
    """fp32 attention, BSHD: query token i of head h over the real keys (vbs) of the KV cubes
    that ``allowed[b, h, i // BLOCK]`` names, in KV head h // g."""
    B, s_q, hq, d = q.shape
    s_kv, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    key_real = (torch.arange(BLOCK)[None, :] < vbs[:, None]).reshape(s_kv)
    out = torch.empty(B, s_q, hq, d)
    for b in range(B):
        for h in range(hq):
            mask = allowed[b, h].repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
            scores = (q[b, :, h] @ k[b, :, h // g].T) / math.sqrt(d)
            scores = scores.masked_fill(~(mask & key_real[None, :]), float("-inf"))
            out[b, :, h] = torch.softmax(scores, -1) @ v[b, :, h // g]
    return out


def _case(seed: int, nq: int, nkv: int, hq: int = 2, hkv: int = 2, topk: int = 2,
          batch: int = 1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, nq * BLOCK, hq, 64, generator=g).bfloat16()
    k, v = (torch.randn(batch, nkv * BLOCK, hkv, 64, generator=g).bfloat16() for _ in range(2))
    idx = torch.stack([torch.randperm(nkv, generator=g)[:topk].sort().values
                       for _ in range(batch * hq * nq)]).view(batch, hq, nq, topk).int()
    vbs = torch.full((nkv,), BLOCK, dtype=torch.int32)
    vbs[-1] = 23  # the last KV cube partial
    q_vbs = torch.full((nq,), BLOCK, dtype=torch.int32)
    q_vbs[-1] = 40  # the last query cube partial
    allowed = torch.zeros(batch, hq, nq, nkv, dtype=torch.bool)
    allowed.scatter_(3, idx.long(), True)
    return q, k, v, idx, vbs, q_vbs, allowed


def _check(call, q, k, v, vbs, q_vbs, allowed, seed):
    """call(q, k, v) -> o against the reference on the real query rows, and the gradients of
    a dO that is zero on padded query rows."""
    rows = (torch.arange(BLOCK)[None, :] < q_vbs[:, None]).reshape(-1)
    g = torch.Generator().manual_seed(seed + 100)
    do = torch.randn(q.shape, generator=g)
    do[:, ~rows] = 0.0
    do = do.bfloat16()
    qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
    o = call(qr, kr, vr)
    o.backward(do)
    q32, k32, v32 = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    ref = _reference(q32, k32, v32, allowed, vbs)
    ref.backward(do.float())
    assert o.shape == q.shape and kr.grad.shape == k.shape and vr.grad.shape == v.shape
    err = (o.float() - ref)[:, rows].abs().max().item()
    assert err <= 0.02 * ref[:, rows].abs().max().item(), err
    for name, got, want in (("dq", qr.grad[:, rows], q32.grad[:, rows]),
                            ("dk", kr.grad, k32.grad), ("dv", vr.grad, v32.grad)):
        got = got.float()
        assert torch.isfinite(got).all(), name
        rel = ((got - want).abs().max() / want.abs().max()).item()
        assert rel <= 0.02, (name, rel)
        cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), 0).item()
        assert cos >= 0.999, (name, cos)
    assert (qr.grad[:, ~rows] == 0).all()  # padded query rows get no gradient


@pytest.mark.parametrize("nq,nkv", [(3, 5), (5, 3)], ids=["kv_longer", "q_longer"])
def test_cross_attention_forward_and_backward(nq, nkv):
    """block_sparse_attention with S_q != S_kv and a partial q_vbs, under the interpreter."""
    q, k, v, idx, vbs, q_vbs, allowed = _case(0, nq, nkv)
    _check(lambda a, b, c: block_sparse_attention(a, b, c, idx, vbs, q_vbs=q_vbs),
           q, k, v, vbs, q_vbs, allowed, 0)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 1)], ids=["g2", "g4"])
def test_cross_attention_with_gqa(hq, hkv):
    """Cross-attention and GQA at once (KV head h // g), batch 2, through the op."""
    q, k, v, idx, vbs, q_vbs, allowed = _case(1, 2, 3, hq=hq, hkv=hkv, batch=2)
    op = tilegen.load(Spec(head_dim=64), backend="triton")
    _check(lambda a, b, c: op(a, b, c, idx, vbs, q_vbs=q_vbs)[0], q, k, v, vbs, q_vbs,
           allowed, 1)


def test_q_vbs_defaults():
    """q_vbs defaults to vbs when the lengths match and to every row real when they differ."""
    q, k, v, idx, vbs, _, allowed = _case(2, 3, 3)
    full = torch.full((3,), BLOCK, dtype=torch.int32)
    want = block_sparse_attention(q, k, v, idx, vbs, q_vbs=vbs)
    torch.testing.assert_close(block_sparse_attention(q, k, v, idx, vbs), want)
    q2, k2, v2, idx2, vbs2, _, allowed2 = _case(3, 2, 3)
    got = block_sparse_attention(q2, k2, v2, idx2, vbs2)
    ref = _reference(q2.float(), k2.float(), v2.float(), allowed2, vbs2)
    assert (got.float() - ref).abs().max() <= 0.02 * ref.abs().max()  # every row real
    torch.testing.assert_close(
        got, block_sparse_attention(q2, k2, v2, idx2, vbs2, q_vbs=full[:2]))


def test_mask_encoding_takes_cross_attention():
    """The mask encoding: a (B, H, NQ, NKV) mask over KV cubes of another length."""
    q, k, v, idx, vbs, q_vbs, allowed = _case(4, 2, 3)
    op = tilegen.load(Spec(encoding="mask", head_dim=64), backend="triton")
    _check(lambda a, b, c: op(a, b, c, allowed, vbs, q_vbs=q_vbs)[0], q, k, v, vbs, q_vbs,
           allowed, 4)


def test_refusals_name_the_argument_and_the_family():
    q, k, v, idx, vbs, q_vbs, _ = _case(5, 2, 3)
    op = tilegen.load(Spec(head_dim=64), backend="triton")
    with pytest.raises(ValueError, match=r"vbs must have shape \(NKV,\) = \(3,\)"):
        op(q, k, v, idx, vbs[:2].contiguous())
    with pytest.raises(ValueError, match=r"q_vbs must be a contiguous \(NQ,\) = \(2,\)"):
        op(q, k, v, idx, vbs, q_vbs=vbs)
    with pytest.raises(ValueError, match=r"q_vbs holds values in \[0, 64\]"):
        op(q, k, v, idx, vbs, q_vbs=torch.tensor([64, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="topk_idx holds values in"):
        op(q, k, v, idx + 3, vbs)
    with pytest.raises(ValueError, match="must have q's batch"):
        op(q, k[:, :, :, :32].contiguous(), v[:, :, :, :32].contiguous(), idx, vbs)
    with pytest.raises(ValueError, match="k and v must have one shape"):
        op(q, k, v[:, :128].contiguous(), idx, vbs)
    st = Spec(encoding="sliding_tile", grid=(4, 8, 8), window=(1, 1, 1), head_dim=64)
    with pytest.raises(ValueError, match="sliding_tile windows follow one cube grid"):
        tilegen.load(st, backend="triton")(q, k, v, vbs)
    cuda = tilegen.load(Spec(head_dim=64), backend="cuda", target="sm_90")
    with pytest.raises(ValueError, match="run on the Triton family"):
        cuda(q, k, v, idx, vbs)


def test_cross_attention_on_the_pytorch_path(pytorch_path_run):
    """The CPU user's default (no interpreter): the same checks in a fresh process."""
    pytorch_path_run("test_cross_attention",
                     "test_cross_attention_forward_and_backward(3, 5); "
                     "t.test_cross_attention_with_gqa(4, 2); "
                     "t.test_mask_encoding_takes_cross_attention()")


def test_separate_kv_sources_build_for_sm90a_with_hgmma_and_no_spills(tmp_path):
    """The Triton forward and backward kernels of separate K/V compiled for sm_90a in a process
    without the interpreter (as `tilegen build` does): HGMMA, no spills; the default source is
    untouched by the option (`KernelConfig.separate_kv` off renders the text without it)."""
    import os
    import subprocess
    import sys

    code = (
        "from pathlib import Path\n"
        "from tilegen import Spec, backends\n"
        "from tilegen.backends.triton.aot import compile_triton, compile_triton_backward\n"
        "from tilegen.backends.triton.backward import BackwardConfig\n"
        "from tilegen.targets import get_target\n"
        "t = get_target('sm_90'); s = Spec()\n"
        "cfg = backends.get('triton').default_config(s, t).replace(separate_kv=True)\n"
        f"d = Path({str(tmp_path)!r})\n"
        "arts = [compile_triton(s, cfg, t, d)]"
        " + compile_triton_backward(s, cfg, t, d, bwd=BackwardConfig())\n"
        "for a in arts: print(a.kernel_name, a.spill_bytes, a.matrix_ops.get('HGMMA', 0))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout.split("\n")
    got = {ln.split()[0]: [int(x) for x in ln.split()[1:]] for ln in out if ln.strip()}
    assert set(got) == {"tilegen_block_sparse_attn", "tilegen_bsa_bwd_preprocess",
                        "tilegen_bsa_bwd_dq", "tilegen_bsa_bwd_dkdv"}, got
    assert all(spills <= known_spills.allowed("sm_90", f"separate_kv {name}")
               for name, (spills, _) in got.items()), got
    assert all(got[k][1] > 0 for k in ("tilegen_block_sparse_attn", "tilegen_bsa_bwd_dq",
                                       "tilegen_bsa_bwd_dkdv")), got
    from tilegen.backends.triton.render import render_triton
    from tilegen.config import KernelConfig

    plain = render_triton(Spec(), KernelConfig(), None).text
    assert "kv_seq_len" not in plain and "Q_VBS" not in plain
    assert "kv_seq_len" in render_triton(Spec(), KernelConfig(separate_kv=True), None).text
