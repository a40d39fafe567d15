"""FP8 (e4m3) quantization of K and V: the groundwork of issue #13 (no quantized kernel and no
``Spec(quant=...)`` field exist yet: bench/experiments/fp8_error_budget.py shows why,
bench/NOTES.md).

The pre-pass a quantized kernel would read, on the GPU, before the attention kernel:

* **K**: subtract a per-(batch, head) channel mean (SageAttention's smoothing: softmax is
  invariant to a vector added to every key, and it removes the range of a channel shared by
  all keys, the outlier head's), then e4m3 with one scale per (cube, head), the cube's exact
  amax over its real rows. Padded rows (past vbs) become 0. The mean is taken over the first
  token of every cube (always real): any per-head constant keeps the softmax exact, so a sample
  is enough and costs one strided read instead of a pass over K.
* **V**: e4m3 with one scale per (batch, head, channel), stored transposed, (B, H, D, S), so
  P.V reads it K-major as the 8-bit MMAs require. The scale is the channel's amax over the
  cubes' first tokens times `V_HEADROOM`; values above 448 x scale saturate (satfinite), and
  e4m3 is floating point, so the headroom costs no precision, only range at the small end.
* **Q** would be quantized by the kernel itself, per query tile (its amax), as it loads it
  (`quantize_q_tile` is its model).
* **P** (<= 1 after the row max) is e4m3 with the fixed scale `P_SCALE`.

`quantize_kv` returns the tensors the kernels read; `emulate` computes attention with exactly
this quantization in PyTorch (float32 arithmetic on the rounded values), the model the tests hold
the kernels to; `quant_rule` is the quantized scoring rule (contract.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

#: largest finite e4m3fn value (a property of the format, not of any device)
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
#: V's per-channel scale = sampled amax x this (range above the sample's largest value)
V_HEADROOM = 8.0
#: P in [0, 1] is stored as P x P_SCALE in e4m3 (the top of its range)
P_SCALE = E4M3_MAX


@dataclass(frozen=True)
class QuantizedKV:
    """What the quantized kernels read: K and V in e4m3 and their scales (all on q's device)."""

    k8: torch.Tensor        # (B, S, H, D) e4m3: (k - k_mean) / k_scale[cube], padded rows 0
    k_scale: torch.Tensor   # (B, H, NKV) fp32
    v8t: torch.Tensor       # (B, H, D, S) e4m3: v / v_scale, transposed, padded rows 0
    v_scale: torch.Tensor   # (B, H, D) fp32
    k_mean: torch.Tensor    # (B, H, D) fp32


@triton.jit
def _quantize_kv_kernel(K, V, VBS, KMEAN, VSCALE, K8, KSCALE, V8T, seq_len, num_heads, nkv,
                        E4M3: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    cube = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // num_heads
    h = bh % num_heads
    rows = tl.arange(0, BLOCK)
    d = tl.arange(0, HEAD_DIM)
    n_valid = tl.load(VBS + cube)
    valid = (rows < n_valid)[:, None]
    tok = cube * BLOCK + rows
    off = ((b * seq_len + tok) * num_heads + h)[:, None] * HEAD_DIM + d[None, :]
    k = tl.load(K + off).to(tl.float32) - tl.load(KMEAN + bh * HEAD_DIM + d)[None, :]
    k = tl.where(valid, k, 0.0)
    amax = tl.max(tl.max(tl.abs(k), 1), 0)
    scale = tl.where(amax > 0, amax / E4M3, 1.0)
    tl.store(KSCALE + bh * nkv + cube, scale)
    tl.store(K8 + off, (k / scale).to(tl.float8e4nv))
    v = tl.load(V + off).to(tl.float32) / tl.load(VSCALE + bh * HEAD_DIM + d)[None, :]
    v = tl.minimum(tl.maximum(tl.where(valid, v, 0.0), -E4M3), E4M3)
    # transposed: (B, H, D, S), keys contiguous
    vt_off = (bh * HEAD_DIM + d)[None, :] * seq_len + tok[:, None]
    tl.store(V8T + vt_off, v.to(tl.float8e4nv))


def _first_tokens(x: torch.Tensor, block: int) -> torch.Tensor:
    """The first token of every cube, (B, NKV, H, D) as fp32: always real (vbs >= 1)."""
    B, S, H, D = x.shape
    return x.view(B, S // block, block, H, D)[:, :, 0].float()


def quantize_kv(k: torch.Tensor, v: torch.Tensor, vbs: torch.Tensor, block: int = 64
                ) -> QuantizedKV:
    """K and V in e4m3 with their scales (see the module docstring); no host sync.

    Runs the Triton pre-pass on GPU tensors; CPU tensors take `quantize_kv_torch`, the same
    arithmetic in PyTorch (Triton 3.6's interpreter rounds fp8 casts wrongly: a value that
    rounds up into the next binade comes out a binade low)."""
    B, S, H, D = k.shape
    nkv = S // block
    sample_k = _first_tokens(k, block)
    k_mean = sample_k.mean(1)                                        # (B, H, D)
    v_scale = (_first_tokens(v, block).abs().amax(1) * (V_HEADROOM / E4M3_MAX)).clamp_min(1e-30)
    if k.device.type == "cpu":
        return quantize_kv_torch(k, v, vbs, k_mean, v_scale, block)
    if D & (D - 1):
        raise ValueError(f"head_dim {D}: the pre-pass kernel takes a power-of-two head dim")
    k, v = k.contiguous(), v.contiguous()
    k8 = torch.empty((B, S, H, D), dtype=torch.float8_e4m3fn, device=k.device)
    v8t = torch.empty((B, H, D, S), dtype=torch.float8_e4m3fn, device=k.device)
    k_scale = torch.empty((B, H, nkv), dtype=torch.float32, device=k.device)
    _quantize_kv_kernel[(nkv, B * H)](
        k, v, vbs, k_mean, v_scale, k8, k_scale, v8t, S, H, nkv,
        E4M3=E4M3_MAX, HEAD_DIM=D, BLOCK=block, num_warps=4)
    return QuantizedKV(k8, k_scale, v8t, v_scale.contiguous(), k_mean)


def quantize_kv_torch(k: torch.Tensor, v: torch.Tensor, vbs: torch.Tensor,
                      k_mean: torch.Tensor, v_scale: torch.Tensor, block: int = 64
                      ) -> QuantizedKV:
    """`quantize_kv`'s arithmetic in PyTorch, given the mean and V scales."""
    B, S, H, D = k.shape
    nkv = S // block
    valid = (torch.arange(block, device=k.device)[None, :] < vbs[:, None].long())
    valid = valid.reshape(1, S, 1, 1)
    kc = torch.where(valid, k.float() - k_mean[:, None], 0.0)        # (B, S, H, D)
    amax = kc.view(B, nkv, block, H, D).abs().amax(dim=(2, 4))       # (B, NKV, H)
    k_scale = torch.where(amax > 0, amax / E4M3_MAX, 1.0).permute(0, 2, 1).contiguous()
    per_tok = k_scale.permute(0, 2, 1).repeat_interleave(block, 1)[..., None]  # (B, S, H, 1)
    k8 = (kc / per_tok).to(torch.float8_e4m3fn)
    vq = torch.where(valid, v.float() / v_scale[:, None], 0.0).clamp(-E4M3_MAX, E4M3_MAX)
    v8t = vq.to(torch.float8_e4m3fn).permute(0, 2, 3, 1).contiguous()
    return QuantizedKV(k8, k_scale, v8t, v_scale.contiguous(), k_mean)


def quantize_q_tile(q: torch.Tensor, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Q per (b, h, query cube): (q8 as fp32 values, scale (B, H, NQ))."""
    B, S, H, D = q.shape
    nq = S // block
    qv = q.float().view(B, nq, block, H, D)
    amax = qv.abs().amax(dim=(2, 4))                                 # (B, NQ, H)
    scale = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    q8 = (qv / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).float()
    return q8.view(B, S, H, D), scale.permute(0, 2, 1).contiguous()


def emulate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topk_idx: torch.Tensor,
            vbs: torch.Tensor, counts: torch.Tensor | None = None,
            sm_scale: float | None = None, block: int = 64) -> torch.Tensor:
    """Block-sparse attention with exactly the kernels' quantization, in fp32 PyTorch (BSHD):
    Q, K, V and P rounded to e4m3 as described above, products and sums in fp32. Returns o
    (fp32). The reference model of the quantized kernels' arithmetic (up to summation order)."""
    B, S, H, D = q.shape
    nq = S // block
    scale = sm_scale if sm_scale is not None else D ** -0.5
    qkv = quantize_kv(k.cpu(), v.cpu(), vbs.cpu(), block)
    q8, q_scale = quantize_q_tile(q.cpu(), block)
    k8 = qkv.k8.float()
    v8 = qkv.v8t.float().permute(0, 3, 1, 2)                         # (B, S, H, D)
    o = torch.zeros(B, S, H, D)
    for b in range(B):
        for h in range(H):
            for qc in range(nq):
                n = topk_idx.shape[3] if counts is None else int(counts[b, h, qc])
                cubes = [int(c) for c in topk_idx[b, h, qc, :n]]
                if not cubes:
                    continue
                rows = slice(qc * block, (qc + 1) * block)
                ks = torch.cat([k8[b, c * block:c * block + int(vbs[c]), h]
                                * qkv.k_scale[b, h, c] for c in cubes])
                vs = torch.cat([v8[b, c * block:c * block + int(vbs[c]), h] for c in cubes])
                s = (q8[b, rows, h] * q_scale[b, h, qc]) @ ks.T * scale
                p = torch.exp(s - s.amax(1, keepdim=True))
                p8 = (p * P_SCALE).to(torch.float8_e4m3fn).float()
                o[b, rows, h] = (p8 @ vs) * qkv.v_scale[b, h] / (P_SCALE * p.sum(1, keepdim=True))
    return o


@dataclass(frozen=True)
class QuantScore:
    """The quantized rule (contract.md): finite, per-head cosine >= 0.999 against the bf16
    reference variant, mean|d| <= 2e-3 and max|d| <= 0.1."""

    finite: bool
    min_head_cos: float
    max_abs: float
    mean_abs: float

    @property
    def passed(self) -> bool:
        return (self.finite and self.min_head_cos >= 0.999 and self.mean_abs <= 2e-3
                and self.max_abs <= 0.1)

    def __str__(self) -> str:
        return (f"finite={self.finite} min_head_cos={self.min_head_cos:.6f} "
                f"max|Δ|={self.max_abs:.2e} mean|Δ|={self.mean_abs:.2e} -> "
                f"{'PASS' if self.passed else 'FAIL'} (quantized rule)")


def quant_rule(o: torch.Tensor, o_ref: torch.Tensor) -> QuantScore:
    """Score a quantized variant's output against the bf16 reference variant's (BSHD)."""
    a, r = o.float(), o_ref.float()
    finite = bool(torch.isfinite(a).all())
    B, S, H, D = a.shape
    af = a.permute(0, 2, 1, 3).reshape(B * H, S * D).double()
    rf = r.permute(0, 2, 1, 3).reshape(B * H, S * D).double()
    cos = torch.nn.functional.cosine_similarity(af, rf, dim=1)
    d = (a - r).abs()
    return QuantScore(finite, float(cos.min()), float(d.max()), float(d.mean()))
