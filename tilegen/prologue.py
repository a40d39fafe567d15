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
rounded value runs in fp32 with the tables rounded to fp32, where diffusers runs it in theirs (the
kernel as one fma a channel, ``x c + (partner s)``); the result is rounded to the input dtype,
so the two agree except where fp32 rounding moves a value across a half-ulp of bf16 (one ulp
apart then). The sum of squares is in another order than torch's reduction, which moves the
scale by an fp32 ulp at most.

`rms_norm_rope` is the entry point (a ``torch.library`` custom op with a fake, so
``torch.compile(fullgraph=True)`` traces it as one node); `rms_norm_rope_torch` is the same in
PyTorch, which a CPU runs and the tests hold the kernel to. `NormRope` is the prologue as data,
for the 8-bit pre-pass that applies it to the projections as it reads them
(``tilegen.quant.quantize(..., norm_rope=...)``): the norm's scales from `rms_rsqrt` (the
prologue kernel's own reduction), the rest from the same `norm_rope`, so its values are the
prologue's bit for bit and the normalized q and k are never written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["NormRope", "norm_rope", "rms_norm_rope", "rms_norm_rope_torch",
           "rms_rsqrt", "rms_rsqrt_triton", "rope_tables"]


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(S, D)`` tables from diffusers' Wan rotary embedding ``(1, S, 1, D)``, one entry a
    channel: pair ``j`` of every head turns by ``cos[..., 2j]`` and ``sin[..., 2j + 1]`` (the
    entries its formula reads), so channel ``2j`` becomes ``x_2j c - x_2j+1 s`` and ``2j + 1``
    becomes ``x_2j+1 c + x_2j s``: the tables hold ``c`` at both and ``-s`` / ``+s``. A kernel
    then rotates a row in its load layout (`norm_rope`)."""
    if cos.dim() != 4 or cos.shape[0] != 1 or cos.shape[2] != 1 or cos.shape != sin.shape:
        raise ValueError(f"the rotary tables must be (1, S, 1, D), one shape; got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    c = cos[0, :, 0, 0::2].float()
    s = sin[0, :, 0, 1::2].float()
    return (c.repeat_interleave(2, dim=-1).contiguous(),
            torch.stack((-s, s), dim=-1).flatten(-2).contiguous())


def rms_norm_rope_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                        sin: torch.Tensor, heads: int) -> torch.Tensor:
    """The model of the kernel: ``x`` ``(B, S, heads * D)``, ``cos``/``sin`` from `rope_tables`;
    returns ``(B, S, heads, D)`` in x's dtype."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    normed = normed.unflatten(-1, (heads, -1)).float()
    swapped = normed.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    out = normed * cos[None, :, None, :] + swapped * sin[None, :, None, :]
    return out.to(x.dtype)


@triton.jit
def _token_row(X, row, seq_len, x_stride_b, x_stride_s, HEADS: tl.constexpr,
               HEADS_PAD: tl.constexpr, DIM: tl.constexpr):
    """A token's row of all heads, (HEADS_PAD, DIM) fp32 (padded heads 0), its columns and
    mask."""
    b = row // seq_len
    s = row % seq_len
    h = tl.arange(0, HEADS_PAD)[:, None]
    col = h * DIM + tl.arange(0, DIM)[None, :]
    mask = (h < HEADS) & (col >= 0)
    x = tl.load(X + b * x_stride_b + s * x_stride_s + col, mask=mask, other=0.0).to(tl.float32)
    return x, col, mask


@triton.jit
def _rms_rsqrt(x, eps, WIDTH: tl.constexpr):
    # one reduction order for the prologue and `rms_rsqrt` (same layout, same tree), so that a
    # pass that applies the norm itself rounds exactly as the prologue does
    return tl.rsqrt(tl.sum(tl.sum(x * x, 1), 0) / WIDTH + eps)


@triton.jit
def norm_rope(x, r, w, c, sn, ROWS: tl.constexpr, DIM: tl.constexpr, DTYPE: tl.constexpr):
    """Rows ``x`` (ROWS, DIM) fp32 of one head each: the norm's scale ``r`` and weight ``w``
    applied and rounded to DTYPE as the model has it, then channel pairs (2j, 2j + 1) turned by
    `rope_tables`' ``c``/``sn`` (fp32, broadcast to x's shape); the result in DTYPE. The pair's
    partner comes from a split and join of the pair axis, which lies in one thread's registers,
    so the whole step keeps the rows' load layout (a split into two half-width tensors
    converted layouts through shared memory: 4x the barriers of the 8-bit pre-pass that
    applies it, sm_90a). Shared by the prologue and that pre-pass (`tilegen.quant`), one fma
    form, so their values are equal bit for bit."""
    y = (x * r * w).to(DTYPE).to(tl.float32)
    even, odd = tl.split(tl.reshape(y, (ROWS, DIM // 2, 2)))
    partner = tl.reshape(tl.join(odd, even), (ROWS, DIM))
    return tl.fma(y, c, partner * sn).to(DTYPE)


@triton.jit
def _rms_norm_rope_kernel(X, W, COS, SIN, OUT, seq_len, eps, x_stride_b, x_stride_s,
                          HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, DIM: tl.constexpr):
    # one program a token row, (HEADS_PAD, D) in registers (the padded heads masked); loaded
    # and stored as whole rows of a head (16-byte accesses)
    row = tl.program_id(0)
    s = row % seq_len
    x, col, mask = _token_row(X, row, seq_len, x_stride_b, x_stride_s, HEADS, HEADS_PAD, DIM)
    w = tl.load(W + col, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(COS + s * DIM + col % DIM)
    sn = tl.load(SIN + s * DIM + col % DIM)
    out = norm_rope(x, _rms_rsqrt(x, eps, HEADS * DIM), w, c, sn, HEADS_PAD, DIM,
                    OUT.dtype.element_ty)
    tl.store(OUT + row * (HEADS * DIM) + col, out, mask=mask)


@triton.jit
def _rms_rsqrt_kernel(Q, K, OUT, rows, seq_len, q_eps, k_eps, x_stride_b, x_stride_s,
                      HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, DIM: tl.constexpr):
    # the prologue's first half: its norm scale of a token row of q (axis 1: 0) or k (1)
    row = tl.program_id(0)
    if tl.program_id(1) == 0:
        x, col, mask = _token_row(Q, row, seq_len, x_stride_b, x_stride_s, HEADS, HEADS_PAD, DIM)
        tl.store(OUT + row, _rms_rsqrt(x, q_eps, HEADS * DIM))
    else:
        x, col, mask = _token_row(K, row, seq_len, x_stride_b, x_stride_s, HEADS, HEADS_PAD, DIM)
        tl.store(OUT + rows + row, _rms_rsqrt(x, k_eps, HEADS * DIM))


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
            sin: torch.Tensor, heads: int) -> torch.Tensor:
    bsz, seq, width = x.shape
    dim = width // heads
    out = torch.empty(bsz, seq, heads, dim, device=x.device, dtype=x.dtype)
    heads_pad = triton.next_power_of_2(heads)
    # 4 warps: 0.463 ms for q and k against 0.517 at 8 and 0.598 at 16 (H100, session 23)
    _rms_norm_rope_kernel[(bsz * seq,)](
        x, weight, cos, sin, out, seq, eps, x.stride(0), x.stride(1),
        HEADS=heads, HEADS_PAD=heads_pad, DIM=dim, num_warps=4)
    return out


def rms_rsqrt_triton(q: torch.Tensor, k: torch.Tensor, q_eps: float, k_eps: float
                     ) -> torch.Tensor:
    """`rms_rsqrt`'s Triton launch (what a GPU runs; the tests run it under the interpreter);
    q and k contiguous."""
    bsz, seq, heads, dim = q.shape
    out = torch.empty(2, bsz, seq, device=q.device, dtype=torch.float32)
    # the prologue's launch shape (4 warps, a program a row), so its sums add in its order
    _rms_rsqrt_kernel[(bsz * seq, 2)](
        q, k, out, bsz * seq, seq, q_eps, k_eps, seq * heads * dim, heads * dim,
        HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads), DIM=dim, num_warps=4)
    return out


@dataclass(frozen=True)
class NormRope:
    """Wan's q/k prologue as data, for a pass that applies it to the projections itself (the
    8-bit pre-pass: ``tilegen.quant.quantize(..., norm_rope=...)``, so the normalized q and k
    are never written): each norm's weight ``(heads * D,)`` and epsilon, and the fp32 tables
    ``(S, D)`` of `rope_tables`. The same arithmetic as `rms_norm_rope`, bit for bit: the
    norm's scale comes from the prologue's own reduction (`rms_rsqrt`), the rest from the
    same `norm_rope`."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    q_eps: float
    k_eps: float
    cos: torch.Tensor
    sin: torch.Tensor

    def check(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """q and k: the projections as ``(B, S, heads, D)``, one shape."""
        if q.dim() != 4 or k.shape != q.shape or k.dtype != q.dtype:
            raise ValueError(f"with norm_rope, q and k are the projections (B, S, heads, D), one "
                             f"shape and dtype; got {tuple(q.shape)} {q.dtype} and "
                             f"{tuple(k.shape)} {k.dtype}")
        for name, x, w in (("q", q, self.q_weight), ("k", k, self.k_weight)):
            _check(name, x.flatten(2), w, self.cos, self.sin, q.shape[2])

    def apply_torch(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prologue's model (`rms_norm_rope_torch`) of ``(B, S, heads, D)`` projections."""
        heads = q.shape[2]
        return (rms_norm_rope_torch(q.flatten(2), self.q_weight, self.q_eps, self.cos, self.sin,
                                    heads),
                rms_norm_rope_torch(k.flatten(2), self.k_weight, self.k_eps, self.cos, self.sin,
                                    heads))


def rms_rsqrt(q: torch.Tensor, k: torch.Tensor, q_eps: float, k_eps: float) -> torch.Tensor:
    """The norm's scale ``rsqrt(mean(x^2) + eps)`` of every token of q and k ``(B, S, heads, D)``
    (contiguous), ``(2, B, S)`` fp32: one Triton launch on a GPU (the prologue kernel's
    reduction, the same order), PyTorch on a CPU."""
    if q.device.type == "cpu":
        return torch.stack([torch.rsqrt(x.float().flatten(2).pow(2).mean(-1) + eps)
                            for x, eps in ((q, q_eps), (k, k_eps))])
    return rms_rsqrt_triton(q.contiguous(), k.contiguous(), float(q_eps), float(k_eps))


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
    if cos.shape != (x.shape[1], 2 * half) or sin.shape != cos.shape:
        raise ValueError(f"the rotary tables must be (S, D) = ({x.shape[1]}, {2 * half}) from "
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
    ``cos``/``sin``: fp32 ``(S, D)`` from `rope_tables`. One Triton launch a tensor on a
    GPU; PyTorch on a CPU."""
    for name, x, w in (("q", q, q_weight), ("k", k, k_weight)):
        _check(name, x, w, cos, sin, heads)
    if k.shape != q.shape or k.dtype != q.dtype:
        raise ValueError(f"q and k must be one shape and dtype; got {tuple(q.shape)} "
                         f"{q.dtype} and {tuple(k.shape)} {k.dtype}")
    return torch.ops.tilegen.rms_norm_rope(q, k, q_weight, k_weight, float(q_eps), float(k_eps),
                                           cos, sin, int(heads))
