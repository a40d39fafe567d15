"""Wan2.2-like synthetic captures: RoPE-structured q and k, a mean-pool top-k LUT, partial edge
cubes and an outlier head whose logits overflow a naive softmax; and captures for a spec."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tilegen import encoding_registry, layout, sparsity

# |v| bound of synthetic captures: bf16 spacing in [1, 2) is 2^-7, far under MAX_ABS
V_BOUND = 2.0



_ROPE_THETA = 10000.0


def _rope_bands(head_dim: int) -> tuple[int, int, int]:
    """Wan's split of head_dim into (t, h, w) RoPE bands: d - 4*(d//6), 2*(d//6), 2*(d//6)."""
    s = head_dim // 6
    return head_dim - 4 * s, 2 * s, 2 * s


def _rope_tables(
    grid: tuple[int, int, int], head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``(N, head_dim // 2)`` for Wan 3D RoPE, tokens row-major over (t, h, w)."""
    T, H, W = grid
    t = torch.arange(T, device=device).repeat_interleave(H * W)
    h = torch.arange(H, device=device).repeat_interleave(W).repeat(T)
    w = torch.arange(W, device=device).repeat(T * H)
    angles = []
    for pos, dim in zip((t, h, w), _rope_bands(head_dim), strict=True):
        exps = torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim
        inv = 1.0 / _ROPE_THETA**exps
        angles.append(pos.to(torch.float64)[:, None] * inv[None, :])
    ang = torch.cat(angles, dim=1)
    return torch.cos(ang).to(torch.float32), torch.sin(ang).to(torch.float32)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) of ``x`` ``(h, N, D)`` by the per-token angles.

    ``(x0 cos - x1 sin, x0 sin + x1 cos)``. On the CPU as one complex multiply, ~10x faster than
    the four real products and a stack, and bit-identical to them: ATen's vectorized complex
    product rounds ``ac - bd`` and ``ad + bc`` the same way (no fused multiply-add). Elsewhere
    (CUDA may contract into FMA) the real form keeps each device's stream as it was.
    """
    xp = x.view(*x.shape[:-1], -1, 2)
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous():
        rot = torch.view_as_complex(xp) * torch.complex(cos, sin)
        return torch.view_as_real(rot).view_as(x)
    x0, x1 = xp[..., 0], xp[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.view_as(x)


def _low_freq_pairs(head_dim: int, per_band: int = 2) -> list[int]:
    """The slowest-rotating RoPE pairs (last pairs of each band): alignment survives position."""
    pairs, start = [], 0
    for dim in _rope_bands(head_dim):
        n = dim // 2
        pairs += list(range(start + n - min(per_band, n), start + n))
        start += n
    return pairs


def _fourier_basis(
    pos: torch.Tensor, freqs: torch.Tensor, phase: torch.Tensor
) -> torch.Tensor:
    """Random Fourier features: ``sqrt(2/M) cos(2 pi pos @ f + phase)``.

    pos ``(N, 3)``, freqs ``(h, M, 3)`` cycles/token, phase ``(h, M)`` -> ``(h, N, M)``.
    """
    m = freqs.shape[1]
    arg = torch.einsum("nc,hmc->hnm", pos, freqs) * (2 * math.pi) + phase[:, None, :]
    return torch.cos(arg) * math.sqrt(2.0 / m)


def _rand(shape: Sequence[int], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.rand(tuple(shape), generator=gen, device=device)


def _randn(shape: Sequence[int], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=gen, device=device)


def _uniform(shape: Sequence[int], lo: float, hi: float, gen: torch.Generator,
             device: torch.device) -> torch.Tensor:
    return lo + (hi - lo) * _rand(shape, gen, device)


def _resolve_outlier(outlier: object, heads: int, gen: torch.Generator) -> list[int]:
    if outlier is None or outlier is False:
        return []
    if outlier is True:
        # drawn on a CPU generator seeded from the main one: the index depends only on the seed
        return [int(torch.randint(heads, (1,), generator=gen).item())]
    if isinstance(outlier, int):
        items = [outlier]
    elif isinstance(outlier, Sequence) and not isinstance(outlier, str):
        items = list(outlier)
    else:
        raise TypeError(f"outlier must be True/False/None, a head index or a list of them, "
                        f"got {outlier!r}")
    out = []
    for h in items:
        if isinstance(h, bool) or not isinstance(h, int):
            raise TypeError(f"outlier head indices must be ints, got {h!r}")
        if not 0 <= h < heads:
            raise ValueError(f"outlier head {h} is outside 0..{heads - 1}")
        out.append(h)
    return sorted(set(out))


def _check_synth_args(grid, heads, head_dim, topk, batch, dtype, cube):
    g = layout._triple(grid, "grid")
    c = layout._triple(cube, "cube")
    for name, v in (("heads", heads), ("head_dim", head_dim), ("topk", topk), ("batch", batch)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {v!r}")
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"head_dim must be even and >= 6 (Wan RoPE splits it into t/h/w bands "
                         f"of {_rope_bands(max(head_dim, 6))}), got {head_dim}")
    nc = math.prod(layout.cube_grid(g, c))
    if topk > nc:
        raise ValueError(f"topk={topk} exceeds the number of cubes NKV={nc} for grid={g}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return g, c


def synthesize(
    seed: int = 0,
    grid: Sequence[int] = (21, 30, 52),
    heads: int = 40,
    head_dim: int = 128,
    topk: int = 78,
    outlier: bool | int | Sequence[int] | None = True,
    batch: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    cube: Sequence[int] = (4, 4, 4),
    *,
    outlier_logit: float = 300.0,
    progress: Callable[[int, int], object] | None = None,
) -> dict:
    """A Wan2.2-like synthetic capture, seeded and deterministic.

    The default is the contract workload: ``q, k, v`` ``(1, 39936, 40, 128)`` bf16, ``topk_idx``
    ``(1, 40, 624, 78)`` int32, ``vbs`` ``(624,)`` int32. Returned keys: ``q, k, v, topk_idx, vbs,
    outlier_heads`` (list of int), ``grid, cube, seed, block`` (tokens per cube).

    It closes the loopholes the real captures close (the Wan2.2 capture benchmark behind
    contract.md):

    * **Per-head, data-dependent selection.** ``topk_idx`` is :func:`sparsity.mean_pool_topk` of the
      synthesized q/k (mean-pooled cube scores, per head), so it is neither a sliding window nor
      shared across heads: every head has its own fields, frequencies and gains.
    * **Real q/k structure and magnitude.** Per head: a smooth content field (random Fourier
      features over (t, h, w) with head-specific low frequencies; k's field correlated with q's, so
      similar content attends across distance) + a per-head mean direction (with RoPE this gives a
      locality bias) + per-token noise; then RMSNorm per token per head with per-head, per-channel
      gains (Wan's norm_q/norm_k); then Wan 3D RoPE (head_dim split into t/h/w bands of
      ``d - 4*(d//6), 2*(d//6), 2*(d//6)``, theta 10000, pairs (2i, 2i+1) rotated). Built in
      row-major token order, then reordered with :func:`layout.to_cubes` (zero padding).
    * **Partial cubes.** 21x30x52 with 4x4x4 cubes gives ``vbs`` in {64, 32, 16, 8}.
    * **Outlier head(s).** ``outlier=True`` picks one head from the seed (``False``/``None``: none;
      an int or list: those heads). In a smooth ~20% region of the grid, that head's q is dominated
      by a few slow-RoPE channels aligned with a constant k direction, with large gains there, so
      the max logit ``q.k * sm_scale`` is about ``outlier_logit`` (~300 natural units) while q/k
      stay finite in bf16 (|x| < ~50). A softmax without row-max subtraction overflows fp32 ``exp``
      (> ~88.7) on those rows: non-finite output in the outlier head only. Other heads keep max
      logits of a few tens.
    * **Smooth v.** v is a per-head smooth field + per-channel bias + noise (RMS ~1), softly
      bounded to ``|v| < V_BOUND`` (2) with tanh, so attention outputs are O(0.1-1) and never
      reach 4, where a single bf16 ulp (2^-5) would already exceed ``MAX_ABS``: the bf16
      tolerances (max|Δ| <= 3e-2, mean|Δ| <= 1e-4) bite on kernel errors, not on rounding.

    Everything is drawn from one ``torch.Generator(device)`` seeded with ``seed``: the same seed and
    device give identical tensors (CPU and CUDA streams differ). Work is done in fp32 in chunks of
    heads, directly on ``device``. ``progress(done, total)``, when given, is called after each
    step (one per batch entry and chunk of 8 heads, then one for the cube layout and selection).
    """
    g3, c3 = _check_synth_args(grid, heads, head_dim, topk, batch, dtype, cube)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    outlier_heads = _resolve_outlier(outlier, heads, cpu_gen)

    T, H, W = g3
    n_tok = T * H * W
    d = head_dim
    f32 = dict(device=dev, dtype=torch.float32)
    t_pos = torch.arange(T, **f32).repeat_interleave(H * W)
    h_pos = torch.arange(H, **f32).repeat_interleave(W).repeat(T)
    w_pos = torch.arange(W, **f32).repeat(T * H)
    pos = torch.stack((t_pos, h_pos, w_pos), dim=1)  # (N, 3)
    cos, sin = _rope_tables(g3, d, dev)

    # ---- per-head "weights" (shared across the batch, like a model's layer) ----
    m_qk, m_v = 32, 16
    # spatial wavelengths of ~12-48 tokens, temporal ones longer: video content is smooth
    sig = torch.stack(
        (_uniform((heads,), 1 / 64, 1 / 16, gen, dev),
         _uniform((heads,), 1 / 48, 1 / 12, gen, dev),
         _uniform((heads,), 1 / 48, 1 / 12, gen, dev)), dim=1)  # (heads, 3) cycles/token
    corr = _uniform((heads, 1, 1), 0.4, 0.9, gen, dev)  # q/k content correlation
    mu_q = _randn((heads, d), gen, dev) * 0.8
    mu_k = mu_q * 0.7 + _randn((heads, d), gen, dev) * 0.5
    noise_qk = _uniform((heads, 1, 1), 0.3, 0.8, gen, dev)
    # per-head scale times per-channel spread: Wan's learned RMSNorm weights
    gain_q = _uniform((heads, 1), 0.8, 1.5, gen, dev) * _randn((heads, d), gen, dev).mul(0.25).exp()
    gain_k = _uniform((heads, 1), 0.8, 1.5, gen, dev) * _randn((heads, d), gen, dev).mul(0.25).exp()
    v_bias = _randn((heads, d), gen, dev) * 0.5
    noise_v = _uniform((heads, 1, 1), 0.3, 0.6, gen, dev)

    pairs = torch.tensor(_low_freq_pairs(d), device=dev)
    out_ch = torch.stack((2 * pairs, 2 * pairs + 1), dim=1).reshape(-1)  # outlier channels
    out_sign = torch.where(_rand((out_ch.numel(),), gen, dev) < 0.5, -1.0, 1.0)

    q_all = torch.empty((batch, n_tok, heads, d), device=dev, dtype=dtype)
    k_all = torch.empty_like(q_all)
    v_all = torch.empty_like(q_all)
    chunk = 8
    steps = batch * -(-heads // chunk) + 1
    done = 0
    for b in range(batch):
        for h0 in range(0, heads, chunk):
            h1 = min(heads, h0 + chunk)
            hs = slice(h0, h1)
            nh = h1 - h0
            # content basis: per-head low-frequency random Fourier features
            freqs = _randn((nh, m_qk, 3), gen, dev) * sig[hs, None, :]
            phase = _uniform((nh, m_qk), 0.0, 2 * math.pi, gen, dev)
            basis = _fourier_basis(pos, freqs, phase)  # (nh, N, M)
            a_q = _randn((nh, m_qk, d), gen, dev)
            a_k = corr[hs] * a_q + torch.sqrt(1 - corr[hs] ** 2) * _randn((nh, m_qk, d), gen, dev)
            qh = torch.bmm(basis, a_q).add_(mu_q[hs, None, :])
            qh.add_(_randn(qh.shape, gen, dev).mul_(noise_qk[hs]))
            kh = torch.bmm(basis, a_k).add_(mu_k[hs, None, :])
            kh.add_(_randn(kh.shape, gen, dev).mul_(noise_qk[hs]))
            del basis
            # smooth hot-region field for outlier heads (drawn for every chunk: keeps the stream
            # independent of which heads are outliers)
            hot_f = _randn((1, 16, 3), gen, dev) * torch.tensor([1 / 32, 1 / 24, 1 / 24], **f32)
            hot_p = _uniform((1, 16), 0.0, 2 * math.pi, gen, dev)
            hot = _fourier_basis(pos, hot_f, hot_p)[0].sum(-1)  # (N,)
            thr = torch.quantile(hot[:: max(1, n_tok // 100_000)], 0.8)
            # 0 outside the top ~20%, rising to 1 at the peak
            hot = ((hot - thr) / (hot.max() - thr).clamp(min=1e-6)).clamp_(0.0, 1.0)

            gq = gain_q[hs].clone()
            gk = gain_k[hs].clone()
            local_out = [h - h0 for h in outlier_heads if h0 <= h < h1]
            for lh in local_out:
                # q: in the hot region a few slow-RoPE channels dominate the pre-norm vector;
                # k: a constant component on the same channels everywhere (an attention sink)
                qh[lh][:, out_ch] += hot[:, None] * (15.0 * out_sign)
                kh[lh][:, out_ch] += 4.0 * out_sign
            # in place, here and below: no fresh (nh, N, d) temporaries to page in
            qh.mul_(torch.rsqrt(qh.pow(2).mean(-1, keepdim=True) + 1e-6))
            kh.mul_(torch.rsqrt(kh.pow(2).mean(-1, keepdim=True) + 1e-6))
            for lh in local_out:
                # gain on the outlier channels so the max logit is ~outlier_logit:
                # logit_out ~= G^2 * P_q(x) * P_k(y) / (n_ch * sqrt(d)), P = projection on sign
                pq = (qh[lh][:, out_ch] * out_sign).sum(-1)
                pk = (kh[lh][:, out_ch] * out_sign).sum(-1)
                denom = (pq.max() * pk.mean()).clamp(min=1e-3)
                g2 = outlier_logit * out_ch.numel() * math.sqrt(d) / denom
                gq[lh, out_ch] = torch.sqrt(g2)
                gk[lh, out_ch] = torch.sqrt(g2)
            qh = _apply_rope(qh.mul_(gq[:, None, :]), cos, sin)
            kh = _apply_rope(kh.mul_(gk[:, None, :]), cos, sin)
            q_all[b, :, hs].copy_(qh.permute(1, 0, 2))  # cast and transpose in one pass
            k_all[b, :, hs].copy_(kh.permute(1, 0, 2))
            del qh, kh

            # v: its own smooth field + bias + noise
            freqs_v = _randn((nh, m_v, 3), gen, dev) * sig[hs, None, :]
            phase_v = _uniform((nh, m_v), 0.0, 2 * math.pi, gen, dev)
            basis_v = _fourier_basis(pos, freqs_v, phase_v)
            vh = torch.bmm(basis_v, _randn((nh, m_v, d), gen, dev)).add_(v_bias[hs, None, :])
            vh.add_(_randn(vh.shape, gen, dev).mul_(noise_v[hs]))
            # soft bound |v| < V_BOUND: outputs stay where one bf16 ulp is well under MAX_ABS
            vh.mul_(1.0 / V_BOUND).tanh_().mul_(V_BOUND)
            v_all[b, :, hs].copy_(vh.permute(1, 0, 2))
            del vh, basis_v
            done += 1
            if progress is not None:
                progress(done, steps)

    q, vbs = layout.to_cubes(q_all, g3, c3)
    del q_all
    k, _ = layout.to_cubes(k_all, g3, c3)
    del k_all
    v, _ = layout.to_cubes(v_all, g3, c3)
    del v_all
    block = math.prod(c3)
    topk_idx = sparsity.mean_pool_topk(q, k, vbs, topk, block=block)
    if progress is not None:
        progress(steps, steps)
    return {
        "q": q,
        "k": k,
        "v": v,
        "topk_idx": topk_idx,
        "vbs": vbs,
        "outlier_heads": outlier_heads,
        "grid": g3,
        "cube": c3,
        "seed": seed,
        "block": block,
    }


# ============================================================================ captures for a spec


def for_spec(cap: dict, spec: Any) -> dict:
    """The capture with q, k, v (and a bundled o_ref) in `spec`'s dtype and layout.

    Capture files are BSHD (contract.md); a BHSD spec gets contiguous transposed copies, and a
    dtype other than the file's is a cast (say so when you tune an fp16 spec on bf16 captures).
    The capture must be BSHD (as loaded or synthesized, not already converted) and match the
    spec's workload (batch, grid and cube, heads, head dim, topk): ValueError naming the field.
    """
    out = dict(cap)
    # The workload fields are part of the spec hash that keys tuned winners: a capture of
    # another shape would record a winner for a workload it was never measured on.
    B, S, H, D = cap["q"].shape  # BSHD, as on disk
    topk = cap["topk_idx"].shape[-1]
    for field_name, have, want in (("head_dim", D, spec.head_dim), ("batch", B, spec.batch),
                                   ("seq_len (grid, cube)", S, spec.seq_len),
                                   ("num_heads", H, spec.num_heads), ("topk", topk, spec.topk)):
        if field_name == "topk" and not encoding_registry.get(
                getattr(spec, "encoding", "lut")).has_lut_rows:
            continue  # the window decides which cubes a sliding_tile spec attends
        if have != want:
            raise ValueError(f"capture q {tuple(cap['q'].shape)} (BSHD) does not fit the spec: "
                             f"{field_name} is {have}, spec wants {want}")
    for key in ("q", "k", "v", "o_ref"):
        if key in out:
            t = out[key].to(spec.torch_dtype)
            out[key] = t.transpose(1, 2).contiguous() if spec.layout == "bhsd" else t
    return out


def synthesize_for(spec: Any, seed: int = 0, device: torch.device | str = "cpu",
                   outlier: bool | int | Sequence[int] | None = True) -> dict:
    """`synthesize` at the spec's workload (grid, heads, head dim, topk, batch, cube, dtype),
    returned in the spec's layout (see `for_spec`)."""
    cap = synthesize(seed=seed, grid=spec.grid, heads=spec.num_heads, head_dim=spec.head_dim,
                     topk=min(spec.topk, spec.num_cubes),  # sliding_tile ignores topk
                     outlier=outlier, batch=spec.batch,
                     dtype=spec.torch_dtype, device=device, cube=spec.cube)
    return for_spec(cap, spec)
