"""`tilegen.prologue`: Wan's q/k RMSNorm across heads and rotary embedding in one pass. The
PyTorch model against diffusers' own formula (fp64 rotation), the Triton kernel under the
interpreter against the model, the custom op, and the diffusers processor's use of it."""

from __future__ import annotations

import pytest
import torch

from tilegen import prologue


def _tables(seq: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan-like fp64 tables (1, S, 1, D), each angle repeated for its channel pair."""
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(seq, head_dim // 2, generator=g, dtype=torch.float64) * 40.0
    angles = angles.repeat_interleave(2, dim=-1)
    return angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]


def _inputs(seed: int, seq: int = 24, heads: int = 3, head_dim: int = 16, bsz: int = 2,
            dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(bsz, seq, heads * head_dim, generator=g) * 3).to(dtype)
    k = (torch.randn(bsz, seq, heads * head_dim, generator=g) + 0.5).to(dtype)
    k[0, 3] *= 300  # a token far from the others: its own scale
    w = (torch.rand(heads * head_dim, generator=g) + 0.5).to(dtype)
    return q, k, w


def _diffusers_formula(x, norm, cos, sin, heads):
    """diffusers 0.42's WanAttnProcessor: torch.nn.RMSNorm, then the rotation in the tables'
    fp64, cast back."""
    x = norm(x).unflatten(2, (heads, -1))
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units of the last place of a's dtype (bf16/fp16), elementwise."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    ia, ib = a.view(bits).int(), b.view(bits).int()
    # two's-complement sign-magnitude to a monotone integer line
    ia = torch.where(ia < 0, -32768 - ia, ia)
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return (ia - ib).abs()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_model_matches_diffusers_formula(seed):
    heads, head_dim = 3, 16
    q, _, w = _inputs(seed, heads=heads, head_dim=head_dim)
    cos, sin = _tables(q.shape[1], head_dim, seed)
    norm = torch.nn.RMSNorm(heads * head_dim, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(w)
        ref = _diffusers_formula(q, norm, cos, sin, heads)
    got = prologue.rms_norm_rope_torch(q, w, 1e-6, *prologue.rope_tables(cos, sin), heads)
    assert got.shape == ref.shape == (2, q.shape[1], heads, head_dim)
    ulps = _ulps(got, ref)
    assert int(ulps.max()) <= 1
    assert float((ulps > 0).float().mean()) < 0.02


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 3])
def test_kernel_matches_model(dtype, seed):
    """The Triton kernel (interpreter) against the model: 5 heads (padded to 8 in the kernel),
    one token 300x the others. The interpreter's fp32 -> bf16 cast truncates where the GPU
    rounds, so bf16 is held to an absolute step of the normalized values (a truncated input of
    a difference near zero is many ulps of the result); fp16 rounds alike there: one ulp."""
    heads, head_dim = 5, 16
    q, k, w = _inputs(seed, seq=12, heads=heads, head_dim=head_dim, dtype=dtype)
    cos, sin = prologue.rope_tables(*_tables(q.shape[1], head_dim, seed))
    for x in (q, k):
        got = prologue._launch(x, w, 1e-6, cos, sin, heads)
        ref = prologue.rms_norm_rope_torch(x, w, 1e-6, cos, sin, heads)
        assert torch.isfinite(got.float()).all()
        if dtype == torch.float16:
            assert int(_ulps(got, ref).max()) <= 1
        else:  # the normalized values are O(1): two bf16 steps of 1
            torch.testing.assert_close(got.float(), ref.float(), atol=2 ** -6, rtol=2 ** -6)


def test_kernel_reads_strided_rows():
    """q and k as chunks of a fused projection (row stride 3 x width) read in place."""
    heads, head_dim = 2, 8
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(1, 6, 3 * heads * head_dim, generator=g).half()
    q = qkv[..., : heads * head_dim]
    w = torch.ones(heads * head_dim, dtype=torch.float16)
    cos, sin = prologue.rope_tables(*_tables(6, head_dim, 5))
    got = prologue._launch(q, w, 1e-5, cos, sin, heads)
    ref = prologue.rms_norm_rope_torch(q.contiguous(), w, 1e-5, cos, sin, heads)
    assert int(_ulps(got, ref).max()) <= 1


def test_op_checks_and_fake():
    heads, head_dim = 2, 8
    q, k, w = _inputs(0, seq=6, heads=heads, head_dim=head_dim)
    cos, sin = prologue.rope_tables(*_tables(6, head_dim, 0))
    qo, ko = prologue.rms_norm_rope(q, k, w, w, 1e-6, 1e-6, cos, sin, heads)
    assert torch.equal(qo, prologue.rms_norm_rope_torch(q, w, 1e-6, cos, sin, heads))
    assert torch.equal(ko, prologue.rms_norm_rope_torch(k, w, 1e-6, cos, sin, heads))
    with pytest.raises(ValueError, match="do not split into 3 heads"):
        prologue.rms_norm_rope(q, k, w, w, 1e-6, 1e-6, cos, sin, 3)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        prologue.rms_norm_rope(q.float(), k.float(), w, w, 1e-6, 1e-6, cos, sin, heads)
    with pytest.raises(ValueError, match="rotary tables"):
        prologue.rms_norm_rope(q, k, w, w, 1e-6, 1e-6, cos[:3], sin[:3], heads)
    with pytest.raises(ValueError, match=r"\(1, S, 1, D\)"):
        prologue.rope_tables(torch.zeros(6, 8), torch.zeros(6, 8))
    compiled = torch.compile(prologue.rms_norm_rope, fullgraph=True, backend="eager")
    qc, kc = compiled(q, k, w, w, 1e-6, 1e-6, cos, sin, heads)
    assert torch.equal(qc, qo) and torch.equal(kc, ko)


def test_tables_hold_each_channels_entries():
    """`rope_tables`: one fp32 entry a channel, the pair's cos at both channels and its sin
    negated at the even one (what diffusers' formula reads: cos at 2j, sin at 2j + 1)."""
    cos, sin = _tables(5, 8, 1)
    c, s = prologue.rope_tables(cos, sin)
    assert c.shape == s.shape == (5, 8) and c.dtype == s.dtype == torch.float32
    assert torch.equal(c[:, 0::2], cos[0, :, 0, 0::2].float())
    assert torch.equal(c[:, 1::2], cos[0, :, 0, 0::2].float())
    assert torch.equal(s[:, 0::2], -sin[0, :, 0, 1::2].float())
    assert torch.equal(s[:, 1::2], sin[0, :, 0, 1::2].float())


def test_norm_scales_and_the_deferred_prologue():
    """`rms_rsqrt` (the Triton launch under the interpreter, and PyTorch) is the norm's scale of
    every token of q and k; `NormRope` applies the model's prologue and refuses projections it
    cannot take."""
    import os

    heads, head_dim = 3, 16
    q, k, w = _inputs(4, seq=10, heads=heads, head_dim=head_dim)
    q4, k4 = q.unflatten(2, (heads, -1)), k.unflatten(2, (heads, -1))
    want = torch.stack([torch.rsqrt(x.float().pow(2).mean(-1) + eps)
                        for x, eps in ((q, 1e-6), (k, 1e-5))])
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.testing.assert_close(prologue.rms_rsqrt_triton(q4, k4, 1e-6, 1e-5), want,
                               rtol=2e-6, atol=0)
    assert torch.equal(prologue.rms_rsqrt(q4, k4, 1e-6, 1e-5), want)
    cos, sin = prologue.rope_tables(*_tables(10, head_dim, 4))
    nr = prologue.NormRope(w, w, 1e-6, 1e-5, cos, sin)
    qn, kn = nr.apply_torch(q4, k4)
    assert torch.equal(qn, prologue.rms_norm_rope_torch(q, w, 1e-6, cos, sin, heads))
    assert torch.equal(kn, prologue.rms_norm_rope_torch(k, w, 1e-5, cos, sin, heads))
    with pytest.raises(ValueError, match="one shape"):
        nr.check(q4, k4[:, :5])
    with pytest.raises(ValueError, match="rotary tables"):
        prologue.NormRope(w, w, 1e-6, 1e-5, cos[:5], sin[:5]).check(q4, k4)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        nr.check(q4.float(), k4.float())
