"""Block-sparsity encodings and coarse selectors.

Encodings:
  * LUT ("lut"): ``topk_idx`` ``(B, H, NQ, K)`` int32, the KV-cube ids each query cube attends,
    optionally with ``counts`` ``(B, H, NQ)`` int32 when rows have different lengths (only the first
    ``counts[b, h, i]`` entries of a row are meaningful).
  * mask ("mask"): ``(B, H, NQ, NKV)`` bool.

Coarse selectors (the VSA coarse stage): mean-pool each cube over its real tokens, score cube
pairs with ``q_mean @ k_mean^T`` per head, then keep a fixed top-k per row
(:func:`mean_pool_topk`) or the smallest set holding a softmax-mass fraction (:func:`cdf_select`).

Adaptive budget (issue #14): :func:`adaptive_topk` maps the kernels' softmax-normalizer signal
``max_prob_cube`` (``op(..., return_max_prob=True)``) to a per-row cube budget ``counts`` for the
next call; :func:`ranked_topk` gives a LUT whose rows are ordered best cube first and
:func:`cut_lut` moves each row's first ``counts`` entries to the front in ascending id order. All
three run on the tensors' device with no host sync.
"""

from __future__ import annotations

import math

import torch

__all__ = ["lut_to_mask", "mask_to_lut", "pool_cubes", "coarse_scores", "mean_pool_topk",
           "cdf_select", "ranked_topk", "adaptive_topk", "cut_lut", "ADAPTIVE_DEFAULTS"]

#: The documented defaults of `adaptive_topk`: the budget, as a fraction of the LUT width, at the
#: lowest peakedness (max_prob at its floor, 1 / (topk * block): a row spread evenly over every
#: selected key) and at the highest (max_prob = 1: one key holds all the mass). Picked from
#: `bench/h200_max_prob.py --cpu-small` (the least-squares fit of the achievable p = 0.9 budget,
#: as a fraction of a LUT of width NKV / 2, against peakedness, on tiny CPU captures; see README
#: "The softmax-normalizer signal and the adaptive budget"); the H200 run at larger grids is to
#: confirm or refit them (bench/RESULTS.md).
ADAPTIVE_DEFAULTS = {"budget_diffuse": 1.0, "budget_peaked": 0.53}

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _check_int_tensor(t: object, name: str, dim: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    return t


def _check_pos_int(v: object, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")
    return v


def lut_to_mask(
    topk_idx: torch.Tensor, nkv: int, counts: torch.Tensor | None = None
) -> torch.Tensor:
    """LUT -> mask.

    Args:
        topk_idx: ``(B, H, NQ, K)`` integer KV-cube ids in ``[0, nkv)``.
        nkv: number of KV cubes.
        counts: optional ``(B, H, NQ)`` row lengths; entries at positions ``>= counts`` are
            ignored (they are padding, see :func:`mask_to_lut`).

    Returns:
        ``(B, H, NQ, nkv)`` bool mask. Duplicate ids collapse into one True.
    """
    _check_int_tensor(topk_idx, "topk_idx", dim=4)
    nkv = _check_pos_int(nkv, "nkv")
    idx = topk_idx.long()
    keep = None
    if counts is not None:
        _check_int_tensor(counts, "counts", dim=3)
        if tuple(counts.shape) != tuple(topk_idx.shape[:3]):
            raise ValueError(
                f"counts must have shape {tuple(topk_idx.shape[:3])} (B, H, NQ) of topk_idx, "
                f"got {tuple(counts.shape)}"
            )
        k = topk_idx.shape[-1]
        if counts.numel() and (int(counts.min()) < 0 or int(counts.max()) > k):
            raise ValueError(f"counts must lie in [0, {k}] (the LUT width)")
        pos = torch.arange(k, device=idx.device)
        keep = pos < counts.to(idx.device).long().unsqueeze(-1)
    check = idx if keep is None else idx[keep]
    if check.numel() and (int(check.min()) < 0 or int(check.max()) >= nkv):
        raise ValueError(
            f"topk_idx holds ids outside [0, {nkv}): min {int(check.min())}, max {int(check.max())}"
        )
    mask = torch.zeros((*topk_idx.shape[:3], nkv), dtype=torch.bool, device=idx.device)
    if keep is None:
        mask.scatter_(-1, idx, True)
    else:
        # padded entries are routed to id 0 with value False; scatter_reduce "amax" keeps any True
        src = keep
        mask.scatter_reduce_(-1, torch.where(keep, idx, 0), src, reduce="amax")
    return mask


def mask_to_lut(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask -> padded LUT.

    Args:
        mask: ``(B, H, NQ, NKV)`` bool.

    Returns:
        ``(idx, counts)``: ``idx`` is ``(B, H, NQ, max_count)`` int32 with each row's selected ids
        sorted ascending, ``max_count = max(1, max row count)``; ``counts`` is ``(B, H, NQ)`` int32.
        Padding (positions ``>= counts``) holds the row's smallest *unselected* ids, ascending
        (``0, 1, ...`` for an empty row), so every entry is a valid cube id (safe to load) and no
        row holds an id twice, padding included (contract.md: indices within a row are
        distinct) -- kernels must still honour ``counts``.
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got dtype {mask.dtype}")
    if mask.dim() != 4:
        raise ValueError(f"mask must be 4-D (B, H, NQ, NKV), got shape {tuple(mask.shape)}")
    nkv = mask.shape[-1]
    if nkv == 0:
        raise ValueError("mask must have at least one KV cube (last dim > 0)")
    counts = mask.sum(-1, dtype=torch.int32)
    width = max(1, int(counts.max())) if counts.numel() else 1
    ar = torch.arange(nkv, device=mask.device, dtype=torch.int64)
    # selected ids keep their value, unselected get pushed past nkv: one ascending sort puts
    # the selected ids first, in order, then the unselected ones, in order (the padding:
    # width <= NKV, so there are always enough of them, and all ids of a row are distinct)
    key = torch.where(mask, ar, ar + nkv)
    key = key.sort(dim=-1).values[..., :width]
    idx = torch.where(key >= nkv, key - nkv, key).to(torch.int32)
    return idx, counts


def _check_qkv_cubes(
    q: torch.Tensor, k: torch.Tensor, vbs: torch.Tensor, block: int, q_vbs: torch.Tensor | None
) -> tuple[int, int, torch.Tensor]:
    block = _check_pos_int(block, "block")
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got dtype {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, S, H, D), got shape {tuple(t.shape)}")
        if t.shape[1] % block:
            raise ValueError(f"{name}.shape[1]={t.shape[1]} is not a multiple of block={block}")
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(
            f"q and k must agree on B, H, D: q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if q.device != k.device:
        raise ValueError(f"q and k must be on one device, got {q.device} and {k.device}")
    nq, nkv = q.shape[1] // block, k.shape[1] // block
    _check_vbs(vbs, nkv, block, "vbs")
    if q_vbs is None:
        if nq != nkv:
            raise ValueError("q_vbs is required when q and k have different numbers of cubes")
        q_vbs = vbs
    else:
        _check_vbs(q_vbs, nq, block, "q_vbs")
    return nq, nkv, q_vbs


def _check_vbs(vbs: torch.Tensor, n: int, block: int, name: str) -> None:
    _check_int_tensor(vbs, name, dim=1)
    if vbs.shape[0] != n:
        raise ValueError(f"{name} must have {n} entries (one per cube), got {vbs.shape[0]}")
    if n and (int(vbs.min()) < 1 or int(vbs.max()) > block):
        raise ValueError(f"{name} values must lie in 1..{block} (block size)")


def pool_cubes(
    x: torch.Tensor, vbs: torch.Tensor, block: int = 64, chunk: int = 64
) -> torch.Tensor:
    """Mean of each cube over its real tokens: ``(B, NC*block, H, D)`` -> ``(B, H, NC, D)`` fp32.

    Padding slots are masked explicitly (not assumed zero). Works in chunks of cubes so a bf16
    input is never upcast whole (the full Wan tensor would be 0.8 GB in fp32).
    """
    b, s, h, d = x.shape
    nc = s // block
    xv = x.view(b, nc, block, h, d)
    vbs_d = vbs.to(x.device).long()
    out = torch.empty((b, nc, h, d), dtype=torch.float32, device=x.device)
    slot = torch.arange(block, device=x.device)
    for c0 in range(0, nc, chunk):
        c1 = min(nc, c0 + chunk)
        w = (slot[None, :] < vbs_d[c0:c1, None]).to(torch.float32)  # (c, block)
        part = xv[:, c0:c1].to(torch.float32)
        out[:, c0:c1] = torch.einsum("bcshd,cs->bchd", part, w)
    out /= vbs_d.to(torch.float32).view(1, nc, 1, 1)
    return out.permute(0, 2, 1, 3).contiguous()


def coarse_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    vbs: torch.Tensor,
    block: int = 64,
    q_vbs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unscaled coarse scores ``mean(q_cube) @ mean(k_cube)^T`` per head.

    Returns ``(B, H, NQ, NKV)`` fp32.
    """
    _, _, q_vbs = _check_qkv_cubes(q, k, vbs, block, q_vbs)
    qc = pool_cubes(q, q_vbs, block)
    kc = pool_cubes(k, vbs, block)
    return qc @ kc.transpose(-1, -2)


def mean_pool_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    vbs: torch.Tensor,
    topk: int,
    block: int = 64,
    q_vbs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Coarse stage: per-head top-k of mean-pooled cube scores.

    Args:
        q, k: ``(B, S, H, D)`` cube-major padded (``S = n_cubes * block``).
        vbs: ``(NKV,)`` real tokens per KV cube, in ``1..block``; padding slots are excluded from
            the means.
        topk: KV cubes per query cube, ``1 <= topk <= NKV``.
        block: tokens per cube slot.
        q_vbs: real tokens per query cube; defaults to ``vbs`` (self-attention).

    Returns:
        ``(B, H, NQ, topk)`` int32, each row's ids sorted **ascending by cube id** (not by score).
    """
    nq, nkv, q_vbs = _check_qkv_cubes(q, k, vbs, block, q_vbs)
    topk = _check_pos_int(topk, "topk")
    if topk > nkv:
        raise ValueError(f"topk={topk} exceeds the number of KV cubes NKV={nkv}")
    scores = coarse_scores(q, k, vbs, block, q_vbs)
    idx = scores.topk(topk, dim=-1, sorted=False).indices
    return idx.sort(dim=-1).values.to(torch.int32)


def cdf_select(
    q: torch.Tensor,
    k: torch.Tensor,
    vbs: torch.Tensor,
    p: float,
    block: int = 64,
    q_vbs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest set of KV cubes whose coarse softmax mass is ``>= p``, per (b, h, query cube).

    The coarse distribution is ``softmax(mean(q_cube) @ mean(k_cube)^T / sqrt(D))`` over KV cubes.
    Cubes are taken in decreasing probability until the cumulative mass reaches ``p`` (at least
    one cube per row).

    Returns:
        ``(idx, counts)`` as :func:`mask_to_lut`: ``(B, H, NQ, max_count)`` int32, the selected
        ids ascending, then padding with the smallest unselected ids (no id twice in a row);
        ``(B, H, NQ)`` int32 counts.
    """
    _, _, q_vbs = _check_qkv_cubes(q, k, vbs, block, q_vbs)
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"p must be a float, got {type(p).__name__}")
    if not (0.0 < float(p) <= 1.0):
        raise ValueError(f"p must lie in (0, 1], got {p}")
    scores = coarse_scores(q, k, vbs, block, q_vbs) * (1.0 / math.sqrt(q.shape[-1]))
    probs = torch.softmax(scores, dim=-1)
    sp, order = probs.sort(dim=-1, descending=True)
    before = sp.cumsum(-1) - sp  # mass strictly before each cube in the descending order
    keep_sorted = before < float(p)
    keep_sorted[..., 0] = True
    mask = torch.zeros_like(keep_sorted)
    mask.scatter_(-1, order, keep_sorted)
    return mask_to_lut(mask)


def ranked_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    vbs: torch.Tensor,
    topk: int,
    block: int = 64,
    q_vbs: torch.Tensor | None = None,
) -> torch.Tensor:
    """The coarse stage's top-k (:func:`mean_pool_topk`'s cubes) with each row ordered by
    **descending** coarse score, so a row's first ``n`` entries are its best ``n`` cubes: the LUT
    that ``counts`` (e.g. from :func:`adaptive_topk`) cut down. ``(B, H, NQ, topk)`` int32."""
    nq, nkv, q_vbs = _check_qkv_cubes(q, k, vbs, block, q_vbs)
    topk = _check_pos_int(topk, "topk")
    if topk > nkv:
        raise ValueError(f"topk={topk} exceeds the number of KV cubes NKV={nkv}")
    scores = coarse_scores(q, k, vbs, block, q_vbs)
    return scores.topk(topk, dim=-1, sorted=True).indices.to(torch.int32)


def _check_fraction(v: object, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(v).__name__}")
    if not (0.0 < float(v) <= 1.0):
        raise ValueError(f"{name} must lie in (0, 1], got {v}")
    return float(v)


def adaptive_topk(
    max_prob_cube: torch.Tensor,
    topk: int,
    *,
    budget_diffuse: float = ADAPTIVE_DEFAULTS["budget_diffuse"],
    budget_peaked: float = ADAPTIVE_DEFAULTS["budget_peaked"],
    block: int = 64,
    min_count: int = 1,
) -> torch.Tensor:
    """Per-(batch, head, query cube) cube budget from the softmax-normalizer signal.

    ``max_prob_cube`` is ``(B, H, NQ)`` fp32 from ``op(..., return_max_prob=True)`` on a LUT of
    width ``topk``: the mean over each query cube's real rows of its largest softmax weight
    ``1 / l``. Peakedness is its position on a log scale between the floor ``1 / (topk *
    block)`` (a row spread evenly over every selected key) and 1 (one key holds everything)::

        t = clamp(log(max_prob_cube * topk * block) / log(topk * block), 0, 1)
        counts = clamp(round(topk * (budget_diffuse + (budget_peaked - budget_diffuse) * t)),
                       min_count, topk)

    Args:
        max_prob_cube: ``(B, H, NQ)`` float signal; 0 (an empty row) and NaN count as the
            lowest peakedness (no evidence that fewer cubes suffice).
        topk: the LUT width the budget cuts (counts lie in ``min_count..topk``).
        budget_diffuse: budget at the lowest peakedness, a fraction of ``topk`` in (0, 1].
        budget_peaked: budget at the highest peakedness, a fraction of ``topk`` in (0, 1], at
            most ``budget_diffuse`` (the budget never grows with peakedness).
        block: keys per KV cube (the floor of the signal).
        min_count: the smallest budget, ``1..topk``.

    Returns:
        ``(B, H, NQ)`` int32 ``counts``, non-increasing in ``max_prob_cube``, on its device, with
        no host sync: pass it with a LUT whose rows are ordered best first (:func:`ranked_topk`,
        or :func:`cut_lut` for ascending ids) as the next call's ``counts``.
    """
    if not isinstance(max_prob_cube, torch.Tensor):
        raise TypeError(f"max_prob_cube must be a torch.Tensor, got {type(max_prob_cube).__name__}")
    if not max_prob_cube.is_floating_point():
        raise TypeError(f"max_prob_cube must be a float tensor, got dtype {max_prob_cube.dtype}")
    if max_prob_cube.dim() != 3:
        raise ValueError(f"max_prob_cube must be 3-D (B, H, NQ), got shape "
                         f"{tuple(max_prob_cube.shape)}")
    topk = _check_pos_int(topk, "topk")
    block = _check_pos_int(block, "block")
    min_count = _check_pos_int(min_count, "min_count")
    if min_count > topk:
        raise ValueError(f"min_count={min_count} exceeds topk={topk}")
    hi = _check_fraction(budget_diffuse, "budget_diffuse")
    lo = _check_fraction(budget_peaked, "budget_peaked")
    if lo > hi:
        raise ValueError(f"budget_peaked={budget_peaked} exceeds budget_diffuse={budget_diffuse}: "
                         "the budget must not grow with peakedness")
    keys = float(topk * block)
    x = torch.nan_to_num(max_prob_cube.float(), nan=0.0).clamp(min=1.0 / keys, max=1.0)
    t = (torch.log(x * keys) / math.log(keys)).clamp(0.0, 1.0) if keys > 1 else x * 0.0
    budget = topk * (hi + (lo - hi) * t)
    return torch.round(budget).clamp(min_count, topk).to(torch.int32)


def cut_lut(ranked_idx: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``ranked_idx`` ``(B, H, NQ, K)`` (rows best first, :func:`ranked_topk`) with each row's
    first ``counts`` entries moved to the front in ascending id order (the order the kernels
    walk best: neighbouring cubes), the rest after them; same shape, int32, no host sync.
    ``(cut_lut(idx, counts), counts)`` is the LUT of the next call."""
    _check_int_tensor(ranked_idx, "ranked_idx", dim=4)
    _check_int_tensor(counts, "counts", dim=3)
    if tuple(counts.shape) != tuple(ranked_idx.shape[:3]):
        raise ValueError(f"counts must have shape {tuple(ranked_idx.shape[:3])} (B, H, NQ) of "
                         f"ranked_idx, got {tuple(counts.shape)}")
    idx = ranked_idx.long()
    width = idx.shape[-1]
    pos = torch.arange(width, device=idx.device)
    kept = pos < counts.to(idx.device).long().unsqueeze(-1)
    # kept ids sort first (by id), the others after them (by id): key = id + (not kept) * big
    big = 1 << 40  # above any cube id; a constant, so no host sync
    key = idx + (~kept).long() * big
    return key.sort(dim=-1).values.remainder(big).to(torch.int32)
