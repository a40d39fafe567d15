"""THE scoring rule (contract.md "Scoring rule") and the gradient rule: `score`, `grad_score`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# --- the scoring rule's thresholds (contract.md "Scoring rule"); used only by score() ---------
COS_MIN = 0.9999  # per-head cosine, min over (b, h), must be >= this
MAX_ABS = 3e-2  # max |o - o_ref| must be <= this
MEAN_ABS = 1e-4  # mean |o - o_ref| must be <= this




@dataclass(frozen=True)
class Score:
    """Result of :func:`score`. ``head_cos`` is ``(B, H)`` fp64 on the CPU."""

    finite: bool
    min_head_cos: float
    max_abs: float
    mean_abs: float
    passed: bool
    head_cos: torch.Tensor = field(repr=False, compare=False)

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"finite={self.finite} min_head_cos={self.min_head_cos:.6f} "
            f"max|Δ|={self.max_abs:.2e} mean|Δ|={self.mean_abs:.2e} -> {verdict}"
        )


def score(o: torch.Tensor, o_ref: torch.Tensor, *, layout: str = "bshd") -> Score:
    """Score a candidate output against the reference: the one place the rule lives.

    A candidate passes iff (contract.md):
      1. every element of ``o`` is finite;
      2. ``min over (b, h)`` of ``cosine(o[b, :, h, :], o_ref[b, :, h, :])`` (flattened) is
         ``>= COS_MIN``;
      3. ``max|o - o_ref| <= MAX_ABS`` and ``mean|o - o_ref| <= MEAN_ABS``.

    Args:
        o, o_ref: same shape, ``(B, S, H, D)`` for ``layout="bshd"`` or ``(B, H, S, D)`` for
            ``layout="bhsd"``; any floating dtype.
        layout: layout of both tensors.

    Everything is computed in fp64, one (b, h) head at a time on the tensors' device (two fp64
    copies of one head at a time, never of the whole tensor): for bf16, fp16 and fp32 inputs the
    products and differences are exact and the sums' rounding error is far below 1e-9, so the
    rule's margins (1e-4 on the cosine) are not eaten by rounding and identical outputs score a
    cosine of 1. The cosine is ``o.o_ref / sqrt(max(|o|^2 |o_ref|^2, 1e-16))``, as
    ``torch.nn.functional.cosine_similarity``. Non-finite values never raise: they make the
    cosine and the differences NaN/inf, which fail.
    """
    for name, t in (("o", o), ("o_ref", o_ref)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got dtype {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
    if o.shape != o_ref.shape:
        raise ValueError(f"o and o_ref shapes differ: {tuple(o.shape)} vs {tuple(o_ref.shape)}")
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout must be 'bshd' or 'bhsd', got {layout!r}")
    if o_ref.device != o.device:
        o_ref = o_ref.to(o.device)

    o, o_ref = o.detach(), o_ref.detach()
    if layout == "bshd":  # per-head views: (B, H, S, D)
        o, o_ref = o.permute(0, 2, 1, 3), o_ref.permute(0, 2, 1, 3)
    bsz, heads = o.shape[0], o.shape[1]
    f64 = dict(dtype=torch.float64, device=o.device)
    dots, norms_a, norms_b, max_d, sum_d = (torch.zeros((bsz, heads), **f64) for _ in range(5))
    finite = torch.ones((bsz, heads), dtype=torch.bool, device=o.device)
    buf_a = torch.empty(o.shape[2:], **f64)  # one head of each, reused: no per-head allocation
    buf_b = torch.empty(o.shape[2:], **f64)
    a, b = buf_a.view(-1), buf_b.view(-1)
    for bi in range(bsz):
        for h in range(heads):
            buf_a.copy_(o[bi, h])
            buf_b.copy_(o_ref[bi, h])
            dots[bi, h] = torch.dot(a, b)
            norms_a[bi, h] = na = torch.dot(a, a)
            norms_b[bi, h] = torch.dot(b, b)
            # a finite sum of squares means every element is finite; only then is it skipped
            if not bool(torch.isfinite(na)):
                finite[bi, h] = torch.isfinite(a).all()
            if a.numel():
                diff = a.sub_(b).abs_()  # in place: buf_a now holds |o - o_ref|
                max_d[bi, h] = diff.max()
                sum_d[bi, h] = diff.sum()
    head_cos = dots / (norms_a * norms_b).clamp(min=1e-16).sqrt()
    numel = o.numel()
    finite_ok = bool(finite.all())
    cos_min = float(head_cos.min()) if head_cos.numel() else float("nan")
    max_abs = float(max_d.max()) if max_d.numel() else 0.0
    mean_abs = float(sum_d.sum()) / numel if numel else 0.0
    passed = finite_ok and cos_min >= COS_MIN and max_abs <= MAX_ABS and mean_abs <= MEAN_ABS
    return Score(
        finite=finite_ok,
        min_head_cos=cos_min,
        max_abs=max_abs,
        mean_abs=mean_abs,
        passed=passed,
        head_cos=head_cos.cpu(),
    )


GRAD_COS_MIN = 0.9999  # per-head cosine of a gradient, min over (b, h)
GRAD_MAX_REL = 1e-2  # max |g - g_ref| <= GRAD_MAX_REL * max |g_ref| (of that tensor)


@dataclass(frozen=True)
class GradScore:
    """Result of :func:`grad_score` for one gradient tensor (dq, dk or dv)."""

    finite: bool
    min_head_cos: float
    max_abs: float
    ref_max: float
    passed: bool

    @property
    def max_rel(self) -> float:
        return self.max_abs / self.ref_max if self.ref_max > 0 else float(self.max_abs > 0)

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (f"finite={self.finite} min_head_cos={self.min_head_cos:.6f} "
                f"max|Δ|={self.max_abs:.2e} ({self.max_rel:.1e} of max|ref|={self.ref_max:.2e}) "
                f"-> {verdict}")


def grad_score(g: torch.Tensor, g_ref: torch.Tensor, *, layout: str = "bshd") -> GradScore:
    """Score a gradient (dq, dk or dv) against the fp32 autograd reference: the backward's rule.

    A gradient passes iff
      1. every element is finite;
      2. ``min over (b, h)`` of the per-head cosine (as :func:`score`: fp64, one head at a time,
         flattened over tokens and head dim) is ``>= GRAD_COS_MIN`` (0.9999); a head whose
         reference and candidate are both all zero counts as cosine 1;
      3. ``max|g - g_ref| <= GRAD_MAX_REL * max|g_ref|`` (1e-2 of the tensor's own scale:
         gradients have no fixed scale, unlike outputs).
    The reference is :func:`tilegen.reference.attention_grads_fp32` (autograd through the fp32
    reference, padded query rows of dO masked).
    """
    s = score(g, g_ref, layout=layout)
    ref = g_ref.detach().to(g.device)
    heads = (ref.permute(0, 2, 1, 3) if layout == "bshd" else ref)
    cand = (g.detach().permute(0, 2, 1, 3) if layout == "bshd" else g.detach())
    zero = (heads.flatten(2).abs().amax(-1) == 0) & (cand.flatten(2).abs().amax(-1) == 0)
    head_cos = torch.where(zero.cpu(), 1.0, s.head_cos)
    cos_min = float(head_cos.min()) if head_cos.numel() else float("nan")
    ref_max = float(ref.abs().max()) if ref.numel() else 0.0
    passed = (s.finite and cos_min >= GRAD_COS_MIN
              and s.max_abs <= GRAD_MAX_REL * ref_max)
    return GradScore(finite=s.finite, min_head_cos=cos_min, max_abs=s.max_abs, ref_max=ref_max,
                     passed=passed)




# --- the quantized rule (contract.md, "Quantized variants"); used only by quant_score() --------
QUANT_COS_MIN = 0.999       # whole output, flattened: cosine >= this
QUANT_REL_L1_MAX = 0.035    # whole output: sum|o - o_ref| / sum|o_ref| <= this
QUANT_HEAD_COS_MIN = 0.995  # per (b, h): cosine >= this
QUANT_EMUL_RATIO = 2.0      # kernel's max and mean error to the oracle <= this x the emulation's


@dataclass(frozen=True)
class QuantScore:
    """Result of :func:`quant_score`, with its margins. ``emul_max_ratio`` and
    ``emul_mean_ratio`` are the kernel's max and mean error to the oracle over the emulation's
    (None when no emulation was given: check 4 not run)."""

    finite: bool
    cos: float
    rel_l1: float
    min_head_cos: float
    emul_max_ratio: float | None
    emul_mean_ratio: float | None
    passed: bool
    head_cos: torch.Tensor = field(repr=False, compare=False)

    def __str__(self) -> str:
        emul = ("" if self.emul_max_ratio is None else
                f" vs emulation max x{self.emul_max_ratio:.2f} mean x{self.emul_mean_ratio:.2f}")
        return (f"finite={self.finite} cos={self.cos:.5f} relL1={self.rel_l1:.4f} "
                f"min_head_cos={self.min_head_cos:.5f}{emul} -> "
                f"{'PASS' if self.passed else 'FAIL'} (quantized rule)")


def _errors(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a.double() - b.double()).abs()
    return float(d.max()), float(d.mean())


def quant_score(o: torch.Tensor, o_ref: torch.Tensor, o_emul: torch.Tensor | None = None,
                o_oracle: torch.Tensor | None = None, *, vbs: torch.Tensor | None = None,
                layout: str = "bshd") -> QuantScore:
    """Score a quantized variant's output: the contract's quantized rule, scale-free.

    A candidate passes iff
      1. every element of ``o`` is finite;
      2. flattened over the whole output, ``cosine(o, o_ref) >= 0.999`` and the relative L1
         ``sum|o - o_ref| / sum|o_ref| <= 0.035``;
      3. per (b, h), the cosine is ``>= 0.995``;
      4. (when ``o_emul`` is given) against its own recipe: the max and the mean of
         ``|o - o_oracle|`` are each at most 2x those of ``|o_emul - o_oracle|``, so a kernel bug
         cannot hide inside the recipe's error.

    ``o_ref`` is the bf16 reference variant's output on the same index lists; ``o_emul`` the
    PyTorch emulation of the same quantization (`tilegen.quant.emulate`); ``o_oracle`` the fp32
    oracle (default: ``o_ref``, whose own error, one bf16 rounding, is far below an 8-bit
    recipe's). ``vbs`` (real rows of each cube, cube-major padded tensors): padded rows are left
    out of every check (what a kernel writes there is unspecified); without it every row counts.
    """
    if o_oracle is not None and o_emul is None:
        raise ValueError("o_oracle is the reference of check 4, which needs o_emul too")
    if vbs is not None:
        seq = o.shape[1] if layout == "bshd" else o.shape[2]
        block = seq // vbs.numel()
        real = torch.arange(block, device=o.device)[None, :] < vbs.to(o.device)[:, None].long()
        shape = (1, seq, 1, 1) if layout == "bshd" else (1, 1, seq, 1)
        real = real.reshape(shape)

        def keep(t):
            return None if t is None else torch.where(real, t.detach().to(o.device), 0.0)
        o, o_ref, o_emul, o_oracle = keep(o), keep(o_ref), keep(o_emul), keep(o_oracle)
    base = score(o, o_ref, layout=layout)  # shape and type checks, finiteness, head cosines
    a, r = o.detach().double(), o_ref.detach().to(o.device).double()
    finite = base.finite
    cos = float(torch.nn.functional.cosine_similarity(a.flatten(), r.flatten(), dim=0))
    rel = float((a - r).abs().sum() / r.abs().sum().clamp_min(1e-300))
    ratios: tuple[float | None, float | None] = (None, None)
    if o_emul is not None:
        oracle = (o_oracle if o_oracle is not None else o_ref).detach().to(o.device)
        k_max, k_mean = _errors(a, oracle)
        e_max, e_mean = _errors(o_emul.detach().to(o.device), oracle)
        ratios = (k_max / max(e_max, 1e-30), k_mean / max(e_mean, 1e-30))
    passed = (finite and cos >= QUANT_COS_MIN and rel <= QUANT_REL_L1_MAX
              and base.min_head_cos >= QUANT_HEAD_COS_MIN
              and all(x is None or x <= QUANT_EMUL_RATIO for x in ratios))
    return QuantScore(finite=finite, cos=cos, rel_l1=rel, min_head_cos=base.min_head_cos,
                      emul_max_ratio=ratios[0], emul_mean_ratio=ratios[1], passed=passed,
                      head_cos=base.head_cos)
