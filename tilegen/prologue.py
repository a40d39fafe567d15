"""The attention prologue of a video DiT in one pass: RMSNorm across heads, then the rotary
embedding, for q and k together (issue #22).

Wan's self-attention normalizes q and k over all heads' channels (``qk_norm =
"rms_norm_across_heads"``: ``torch.nn.RMSNorm(heads * D)``), splits the heads, and rotates
channel pairs ``(2j, 2j + 1)`` of every head by the token's angles. Compiled by
``torch.compile`` it is one reduction kernel over q and k that reads both and writes both
(1.35 ms at the Wan2.2-A14B layer on an H100, 1 TB/s), rotating in the tables' dtype (fp32, or
fp64 as diffusers builds them by default). This is the same arithmetic in one
Triton launch a tensor pair: each program reads one token's row of q (or k), keeps it in
registers for the sum of squares, the scale and the rotation, and writes it once.

**The numbers.** The norm is torch's: ``bf16(x * rsqrt(mean(x^2) + eps) * w)`` in fp32 (its
output rounded to the input dtype, as ``torch.nn.RMSNorm`` returns it). The rotation of that
rounded value runs in fp32 with the tables rounded to fp32, where diffusers runs it in theirs; the
result is rounded to the input dtype, so the two agree except where fp32 rounding moves a value
across a half-ulp of bf16 (one ulp apart then). The sum of squares is in another order than
torch's reduction, which moves the scale by an fp32 ulp at most.

`rms_norm_rope` is the entry point (a ``torch.library`` custom op with a fake, so
``torch.compile(fullgraph=True)`` traces it as one node); `rms_norm_rope_torch` is the same in
PyTorch, which a CPU runs and the tests hold the kernel to.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm_rope", "rms_norm_rope_torch", "rope_tables"]


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(S, D / 2)`` tables from diffusers' Wan rotary embedding ``(1, S, 1, D)``: pair
    ``j`` of every head turns by ``cos[..., 2j]`` and ``sin[..., 2j + 1]`` (the entries its
    formula reads)."""
    if cos.dim() != 4 or cos.shape[0] != 1 or cos.shape[2] != 1 or cos.shape != sin.shape:
        raise ValueError(f"the rotary tables must be (1, S, 1, D), one shape; got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    return (cos[0, :, 0, 0::2].float().contiguous(), sin[0, :, 0, 1::2].float().contiguous())


def rms_norm_rope_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                        sin: torch.Tensor, heads: int) -> torch.Tensor:
    """The model of the kernel: ``x`` ``(B, S, heads * D)``, ``cos``/``sin`` from `rope_tables`;
    returns ``(B, S, heads, D)`` in x's dtype."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    pairs = normed.unflatten(-1, (heads, -1, 2)).float()
    even, odd = pairs.unbind(-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1)
    return out.flatten(-2).to(x.dtype)


@triton.jit
def _rms_norm_rope_kernel(X, W, COS, SIN, OUT, seq_len, eps, x_stride_b, x_stride_s,
                          HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr):
    # one program a token row, (HEADS_PAD, D) in registers (the padded heads masked); loaded
    # and stored as whole rows of a head (16-byte accesses), split into channel pairs between
    row = tl.program_id(0)
    b = row // seq_len
    s = row % seq_len
    h = tl.arange(0, HEADS_PAD)[:, None]
    col = h * (2 * HALF) + tl.arange(0, 2 * HALF)[None, :]
    mask = (h < HEADS) & (col >= 0)
    x = tl.load(X + b * x_stride_b + s * x_stride_s + col, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + col, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(tl.sum(x * x, 1), 0) / (HEADS * HALF * 2)
    # the norm's output is rounded to the input dtype before the rotation, as the model has it
    y = (x * tl.rsqrt(mean_sq + eps) * w).to(OUT.dtype.element_ty).to(tl.float32)
    even, odd = tl.split(tl.reshape(y, (HEADS_PAD, HALF, 2)))
    c = tl.load(COS + s * HALF + tl.arange(0, HALF))[None, :]
    sn = tl.load(SIN + s * HALF + tl.arange(0, HALF))[None, :]
    out = tl.reshape(tl.join(even * c - odd * sn, even * sn + odd * c), (HEADS_PAD, 2 * HALF))
    tl.store(OUT + row * (HEADS * HALF * 2) + col, out.to(OUT.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
            sin: torch.Tensor, heads: int) -> torch.Tensor:
    bsz, seq, width = x.shape
    half = width // heads // 2
    out = torch.empty(bsz, seq, heads, 2 * half, device=x.device, dtype=x.dtype)
    heads_pad = triton.next_power_of_2(heads)
    # 4 warps: 0.463 ms for q and k against 0.517 at 8 and 0.598 at 16 (H100, session 23)
    _rms_norm_rope_kernel[(bsz * seq,)](
        x, weight, cos, sin, out, seq, eps, x.stride(0), x.stride(1),
        HEADS=heads, HEADS_PAD=heads_pad, HALF=half, num_warps=4)
    return out


def _check(name: str, x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor, heads: int) -> None:
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"{name} must be (B, S, heads * D) with unit channel stride; got "
                         f"shape {tuple(x.shape)}, strides {x.stride()}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{name} has dtype {x.dtype}; the prologue takes bf16 or fp16")
    width = x.shape[-1]
    if heads < 1 or width % heads or (width // heads) % 2:
        raise ValueError(f"{name}: {width} channels do not split into {heads} heads of an "
                         "even head dim")
    half = width // heads // 2
    if half & (half - 1):
        raise ValueError(f"{name}: head dim {2 * half}: the prologue's kernel takes a power "
                         "of two")
    if weight.shape != (width,):
        raise ValueError(f"{name}'s norm weight must be ({width},); got {tuple(weight.shape)}")
    if cos.shape != (x.shape[1], half) or sin.shape != cos.shape:
        raise ValueError(f"the rotary tables must be (S, D / 2) = ({x.shape[1]}, {half}) from "
                         f"rope_tables; got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 \
            or not (cos.is_contiguous() and sin.is_contiguous()):
        raise TypeError("the rotary tables must be contiguous fp32 (rope_tables)")


@torch.library.custom_op("tilegen::rms_norm_rope", mutates_args=())
def _rms_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                   k_weight: torch.Tensor, q_eps: float, k_eps: float, cos: torch.Tensor,
                   sin: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    if q.device.type == "cpu":
        return (rms_norm_rope_torch(q, q_weight, q_eps, cos, sin, heads),
                rms_norm_rope_torch(k, k_weight, k_eps, cos, sin, heads))
    return (_launch(q, q_weight, q_eps, cos, sin, heads),
            _launch(k, k_weight, k_eps, cos, sin, heads))


@_rms_norm_rope.register_fake
def _rms_norm_rope_fake(q, k, q_weight, k_weight, q_eps, k_eps, cos, sin, heads):
    shape = (*q.shape[:2], heads, q.shape[-1] // heads)
    return q.new_empty(shape), k.new_empty(shape)


def rms_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                  k_weight: torch.Tensor, q_eps: float, k_eps: float, cos: torch.Tensor,
                  sin: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over all ``heads * D`` channels of each token, then the rotary embedding, of the
    projections ``q`` and ``k`` ``(B, S, heads * D)`` (bf16/fp16, unit channel stride); returns
    ``(B, S, heads, D)`` each, in the input dtype (module docstring for the arithmetic).
    ``cos``/``sin``: fp32 ``(S, D / 2)`` from `rope_tables`. One Triton launch a tensor on a
    GPU; PyTorch on a CPU."""
    for name, x, w in (("q", q, q_weight), ("k", k, k_weight)):
        _check(name, x, w, cos, sin, heads)
    if k.shape != q.shape or k.dtype != q.dtype:
        raise ValueError(f"q and k must be one shape and dtype; got {tuple(q.shape)} "
                         f"{q.dtype} and {tuple(k.shape)} {k.dtype}")
    return torch.ops.tilegen.rms_norm_rope(q, k, q_weight, k_weight, float(q_eps), float(k_eps),
                                           cos, sin, int(heads))
