"""Block-sparsity encodings and coarse selectors.

Encodings:
  * LUT ("lut"): ``topk_idx`` ``(B, H, NQ, K)`` int32, the KV-cube ids each query cube attends,
    optionally with ``counts`` ``(B, H, NQ)`` int32 when rows have different lengths (only the first
    ``counts[b, h, i]`` entries of a row are meaningful).
  * mask ("mask"): ``(B, H, NQ, NKV)`` bool.

Coarse selectors (the VSA coarse stage): mean-pool each cube over its real tokens, score cube
pairs with ``q_mean @ k_mean^T`` per head, then keep a fixed top-k per row
(:func:`mean_pool_topk`) or the smallest set holding a softmax-mass fraction (:func:`cdf_select`,
:func:`cdf_mask`). The Jenga / AttenCarve selector (:func:`jenga_mask`, :func:`jenga_lut`) is the
union of that importance top-k, forced 3-D adjacency cubes (:func:`adjacency_mask`) and an
optional extra mask.

Pooling (:func:`pool_cubes`) is one batched GEMM per tensor, ``(1, block) @ (block, H*D)`` per
cube with 0/1 weights that drop padding slots: it reads ``x`` once, accumulates in fp32 and
rounds each cube's sum once to ``x``'s dtype (bf16 input: the sum rounded to bf16, as FastVideo's
``x.float().sum(...).to(x.dtype)`` rounds its pooled cubes), then divides by ``vbs`` in fp32.
On the GPU the selections that need no gradient (:func:`mean_pool_topk`,
:func:`mean_pool_topk_thw`, :func:`topk_of_means`, :func:`jenga_mask` / :func:`jenga_lut`) score
on the tensor cores with the fp32 operands split in three TF32 products
(`tilegen.coarse_gpu.scores_of_means`: products good to about 2^-21 where an fp32 FMA is good to
2^-24, so a row whose k-th and next scores lie that close may select the other);
:func:`coarse_scores` (differentiable) and the selectors built on it (:func:`cdf_mask`,
:func:`cdf_select`, :func:`ranked_topk`) keep the fp32 matmul.

No host sync on the GPU: the selectors are plain torch ops with static shapes (no ``.item()``,
``.tolist()`` or data-dependent shapes). Value checks of ``vbs`` run only for CPU tensors (free
there); on the GPU a cube whose ``vbs`` lies outside ``1..block`` pools to NaN, so its scores are
NaN. Two helpers do sync by nature: :func:`mask_to_lut` (its width is the largest row count, a
data-dependent shape) and hence :func:`cdf_select`; :func:`cdf_mask` and :func:`jenga_lut` are
their sync-free forms.

Adaptive budget (issue #14): :func:`adaptive_topk` maps the kernels' softmax-normalizer signal
``max_prob_cube`` (``op(..., return_max_prob=True)``) to a per-row cube budget ``counts`` for the
next call; :func:`ranked_topk` gives a LUT whose rows are ordered best cube first and
:func:`cut_lut` moves each row's first ``counts`` entries to the front in ascending id order. All
three run on the tensors' device with no host sync.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from tilegen import layout

__all__ = ["lut_to_mask", "mask_to_lut", "pool_cubes", "coarse_scores", "mean_pool_topk",
           "mean_pool_topk_thw", "topk_of_means",
           "cdf_select", "cdf_mask", "adjacency_mask", "jenga_mask", "jenga_lut",
           "ADJACENCY", "ranked_topk", "adaptive_topk", "cut_lut",
           "ADAPTIVE_DEFAULTS"]

#: The documented defaults of `adaptive_topk`: the budget, as a fraction of the LUT width, at the
#: lowest peakedness (max_prob at its floor, 1 / (topk * block): a row spread evenly over every
#: selected key) and at the highest (max_prob = 1: one key holds all the mass). The least-squares
#: fit of the achievable p = 0.9 budget, as a fraction of a LUT of width NKV / 2, against
#: peakedness on the H200 run of `bench/experiments/h200_max_prob.py` (bench/RESULTS.md,
#: 2026-12-01).
ADAPTIVE_DEFAULTS = {"budget_diffuse": 1.0, "budget_peaked": 0.057}

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


def _check_topk(topk: int, nkv: int) -> int:
    topk = _check_pos_int(topk, "topk")
    if topk > nkv:
        raise ValueError(f"topk={topk} exceeds the number of KV cubes NKV={nkv}")
    return topk


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
    if (q.shape[0], q.shape[3]) != (k.shape[0], k.shape[3]) or not k.shape[2] \
            or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"q and k must agree on B and D, and k's heads divide q's (GQA: H_q = g * H_kv): "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}"
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
    # values only where reading them is free: a GPU tensor would need a host sync (bad values
    # there pool to NaN instead, see pool_cubes)
    if (n and vbs.device.type == "cpu" and not torch.compiler.is_compiling()
            and (int(vbs.min()) < 1 or int(vbs.max()) > block)):
        raise ValueError(f"{name} values must lie in 1..{block} (block size)")


def pool_cubes(
    x: torch.Tensor, vbs: torch.Tensor, block: int = 64, chunk: int = 64
) -> torch.Tensor:
    """Mean of each cube over its real tokens: ``(B, NC*block, H, D)`` -> ``(B, H, NC, D)`` fp32.

    Padding slots are masked explicitly (not assumed zero). One batched GEMM reads ``x`` once
    (no upcast copy): each cube's sum is accumulated in fp32 and rounded once to ``x``'s dtype,
    then divided by ``vbs`` in fp32. Differentiable in ``x``. A cube whose ``vbs`` lies outside
    ``1..block`` pools to NaN (values are checked on the host only for CPU tensors).
    ``chunk`` is accepted for compatibility and unused (the GEMM needs no chunking).
    """
    b, s, h, d = x.shape
    nc = s // block
    return _pool(x.reshape(b, nc, block, h * d), vbs.to(x.device), block).view(
        b, nc, h, d).permute(0, 2, 1, 3).contiguous()


def _pool(x4: torch.Tensor, vbs: torch.Tensor, block: int) -> torch.Tensor:
    """``(B, NC, block, N)`` -> ``(B, NC, N)`` fp32 means over the first ``vbs[c]`` slots."""
    b, nc, _, n = x4.shape
    vbs_l = vbs.long()
    slot = torch.arange(block, device=x4.device)
    w = (slot[None, :] < vbs_l[:, None]).to(x4.dtype)  # (NC, block): 0/1, exact in any dtype
    w = w.unsqueeze(0).expand(b, nc, block).reshape(b * nc, 1, block)
    sums = torch.bmm(w, x4.reshape(b * nc, block, n)).view(b, nc, n)
    ok = (vbs_l >= 1) & (vbs_l <= block)
    inv = torch.where(ok, 1.0 / vbs_l.clamp(min=1).to(torch.float32), float("nan"))
    return sums.to(torch.float32) * inv.view(1, nc, 1)


def _scores(q: torch.Tensor, k: torch.Tensor, vbs: torch.Tensor, q_vbs: torch.Tensor,
            block: int, sources: torch.Tensor | None = None) -> torch.Tensor:
    """Unchecked coarse scores ``(B, H, NQ, NKV)`` fp32 for a selection (inputs validated by the
    caller; no gradient): on the GPU through one pooling launch per tensor
    (`tilegen.coarse_gpu.pool_means`, the same means up to fp32 summation order) and the
    scores on the tensor cores (`_scores_of_means`). ``sources``:
    q and k in token order, gathered by the pooling (GPU and a power-of-two head dim only)."""
    d = q.shape[-1]
    if q.is_cuda and d & (d - 1) == 0:  # the kernel's lanes: a power-of-two head dim
        from tilegen.coarse_gpu import pool_means

        qm = pool_means(q, q_vbs.to(q.device), block, sources=sources)
        km = pool_means(k, vbs.to(k.device), block, sources=sources)
    elif sources is not None:
        raise ValueError("sources: the gathering pooling runs on a GPU with a power-of-two "
                         "head dim; reorder with layout.to_cubes elsewhere")
    else:
        qm, km = pool_cubes(q, q_vbs, block), pool_cubes(k, vbs, block)
    return _scores_of_means(qm, km)


def _scores_of_means(qm: torch.Tensor, km: torch.Tensor) -> torch.Tensor:
    """``(B, H, NQ, D)`` and ``(B, H_kv, NKV, D)`` cube means -> ``(B, H, NQ, NKV)`` scores: on a
    GPU with a power-of-two D from 16 to 256 one launch on the tensor cores
    (`coarse_gpu.scores_of_means`, fp32-level products, no gradient), else a torch matmul."""
    d = qm.shape[-1]
    if qm.is_cuda and d & (d - 1) == 0 and 16 <= d <= 256:
        from tilegen.coarse_gpu import scores_of_means

        return scores_of_means(qm, km)
    return qm @ _per_query_head(km, qm.shape[1]).transpose(-1, -2)


def topk_of_means(qm: torch.Tensor, km: torch.Tensor, topk: int) -> torch.Tensor:
    """`mean_pool_topk`'s selection from cube means pooled already: ``qm`` ``(B, H, NQ, D)`` and
    ``km`` ``(B, H_kv, NKV, D)`` fp32 (`pool_cubes`, or the 8-bit pre-pass's
    ``quantize(..., pool=True)``, which pools q and k from its own read of them). Returns
    ``(B, H, NQ, topk)`` int32, ascending by cube id."""
    if qm.dim() != 4 or km.dim() != 4 or qm.shape[0] != km.shape[0] \
            or qm.shape[3] != km.shape[3] or km.shape[1] == 0 or qm.shape[1] % km.shape[1] \
            or qm.dtype != torch.float32 or km.dtype != torch.float32 or qm.device != km.device:
        raise ValueError(f"cube means must be fp32 (B, H, NQ, D) and (B, H_kv, NKV, D) on one "
                         f"device with H_kv dividing H; got {qm.dtype} {tuple(qm.shape)} on "
                         f"{qm.device} and {km.dtype} {tuple(km.shape)} on {km.device}")
    topk = _check_topk(topk, km.shape[2])
    from tilegen.coarse_gpu import row_topk_ids

    return row_topk_ids(_scores_of_means(qm, km), topk)


def _per_query_head(km: torch.Tensor, heads: int) -> torch.Tensor:
    """Pooled K ``(B, H_kv, NKV, D)`` for each query head (GQA: query head h reads KV head
    h // g): the pooled means repeated, not the tokens."""
    g = heads // km.shape[1]
    return km if g == 1 else km.repeat_interleave(g, dim=1)


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
    kc = _per_query_head(pool_cubes(k, vbs, block), q.shape[2])
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
    topk = _check_topk(topk, nkv)
    from tilegen.coarse_gpu import row_topk_ids

    return row_topk_ids(_scores(q, k, vbs, q_vbs, block), topk)


def mean_pool_topk_thw(
    q: torch.Tensor,
    k: torch.Tensor,
    grid: Sequence[int],
    topk: int,
    cube: Sequence[int] = (4, 4, 4),
) -> torch.Tensor:
    """`mean_pool_topk` of THW-ordered tokens, without reordering them: ``q``, ``k`` are
    ``(B, T*H*W, H, D)`` (k's heads may divide q's) over ``grid``; the selection equals
    ``mean_pool_topk(to_cubes(q), to_cubes(k), vbs, topk)`` (up to fp32 summation order in
    the means on the GPU, where the pooling reads each cube's tokens where they lie). Returns
    ``(B, H, NQ, topk)`` int32, ascending by cube id."""
    g, c = layout._triple(grid, "grid"), layout._triple(cube, "cube")
    n_tok, block = g[0] * g[1] * g[2], math.prod(c)
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[1] != n_tok:
            raise ValueError(f"{name} must be (B, T*H*W, H, D) with T*H*W={n_tok} for grid={g}, "
                             f"got {tuple(getattr(t, 'shape', ()))}")
    vbs = layout.vbs_for_grid(g, c, device=q.device)
    d = q.shape[-1]
    if not (q.is_cuda and d & (d - 1) == 0):  # the general form: reorder, then pool
        qc, _ = layout.to_cubes(q, g, c, zero_padding=False)
        kc, _ = layout.to_cubes(k, g, c, zero_padding=False)
        return mean_pool_topk(qc, kc, vbs, topk, block=block)
    from tilegen.coarse_gpu import row_topk_ids

    if q.device != k.device:
        raise ValueError(f"q and k must be on one device, got {q.device} and {k.device}")
    # the cube-major shapes' checks (B, D, GQA heads, dtypes) on shapes alone
    as_cubes = lambda t: torch.empty((t.shape[0], vbs.numel() * block, *t.shape[2:]),  # noqa: E731
                                     dtype=t.dtype, device="meta")
    _check_qkv_cubes(as_cubes(q), as_cubes(k), vbs, block, None)
    topk = _check_topk(topk, vbs.numel())
    return row_topk_ids(_scores(q, k, vbs, vbs, block, layout._sources_on(g, c, q.device)),
                        topk)


def cdf_mask(
    q: torch.Tensor,
    k: torch.Tensor,
    vbs: torch.Tensor,
    p: float,
    block: int = 64,
    q_vbs: torch.Tensor | None = None,
) -> torch.Tensor:
    """The selection of :func:`cdf_select` as a ``(B, H, NQ, NKV)`` bool mask (no host sync).

    Per row, KV cubes are taken in decreasing coarse probability
    ``softmax(mean(q_cube) @ mean(k_cube)^T / sqrt(D))`` until the mass before the next one
    reaches ``p`` (at least one cube per row).
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
    return mask


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
        ``(B, H, NQ)`` int32 counts. The width ``max_count`` is data-dependent: one host sync
        (:func:`cdf_mask` is the sync-free mask).
    """
    return mask_to_lut(cdf_mask(q, k, vbs, p, block, q_vbs))


# ------------------------------------------------------------------ Jenga / AttenCarve selector

#: forced-adjacency neighbourhoods of a query cube in the cube grid (the cube itself included):
#: "self" (1 cube), "face" (itself + its 6 face neighbours, Manhattan distance <= 1),
#: "box" (the 3x3x3 box around it, Chebyshev distance <= 1: up to 27 cubes)
ADJACENCY = ("self", "face", "box")


@functools.lru_cache(maxsize=32)
def _adjacency_cpu(cgrid: tuple[int, int, int], kind: str) -> torch.Tensor:
    """(NC, NC) bool adjacency over the cube grid."""
    nt, nh, nw = cgrid
    ct, ch, cw = torch.meshgrid(torch.arange(nt), torch.arange(nh), torch.arange(nw),
                                indexing="ij")
    pos = torch.stack((ct.reshape(-1), ch.reshape(-1), cw.reshape(-1)), dim=1)  # (NC, 3)
    diff = (pos[:, None, :] - pos[None, :, :]).abs()
    if kind == "self":
        return diff.sum(-1) == 0
    if kind == "face":
        return diff.sum(-1) <= 1
    return diff.amax(-1) <= 1


def _neighbourhood_size(cgrid: Sequence[int], kind: str) -> int:
    """The largest row count of the adjacency (host arithmetic, no tensor)."""
    size = 1
    for n in cgrid:  # plain loops: torch.compile traces this (no generator into math.prod)
        if kind == "face":
            size += min(n - 1, 2)
        elif kind == "box":
            size *= min(n, 3)
    return size


@functools.lru_cache(maxsize=32)
def _adjacency_on(cgrid: tuple[int, int, int], kind: str, device: torch.device) -> torch.Tensor:
    return _adjacency_cpu(cgrid, kind).to(device)


def _check_adjacency(kind: object) -> str | None:
    if kind is not None and kind not in ADJACENCY:
        raise ValueError(f"adjacency={kind!r} is not allowed; allowed values: "
                         f"{list(ADJACENCY)} or None")
    return kind  # type: ignore[return-value]


def adjacency_mask(
    grid: Sequence[int],
    cube: Sequence[int] = (4, 4, 4),
    kind: str = "box",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Forced adjacency: ``(NC, NC)`` bool, ``[i, j]`` True when KV cube ``j`` lies in query cube
    ``i``'s neighbourhood in the cube grid (``kind`` in :data:`ADJACENCY`; the cube itself is
    always included). Cube ids are row-major over (cube_t, cube_h, cube_w) as in
    :mod:`tilegen.layout`; at the grid's faces and corners the neighbourhood is cut, not wrapped.
    Built once per (grid, cube, kind) on the host and cached per device.
    """
    _check_adjacency(kind)
    if kind is None:
        raise ValueError("adjacency_mask needs a kind; allowed values: " + str(list(ADJACENCY)))
    cgrid = layout.cube_grid(grid, cube)
    dev = torch.device(device if device is not None else "cpu")
    return _adjacency_on(cgrid, kind, dev).clone()


def _jenga_args(q, k, topk, grid, cube, adjacency, extra):
    g, c = layout._triple(grid, "grid"), layout._triple(cube, "cube")
    block = math.prod(c)
    cgrid = layout.cube_grid(g, c)
    nc = math.prod(cgrid)
    if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] != nc * block:
        raise ValueError(f"q must hold {nc} cubes of {block} tokens for grid={g}, cube={c} "
                         f"(S={nc * block}, cube-major as layout.to_cubes makes it), "
                         f"got shape {tuple(q.shape)}")
    vbs = layout.vbs_for_grid(g, c, device=q.device if isinstance(q, torch.Tensor) else None)
    _check_qkv_cubes(q, k, vbs, block, None)
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise TypeError(f"topk must be an int, got {type(topk).__name__}")
    if not 0 <= topk <= nc:
        raise ValueError(f"topk={topk} must lie in 0..NKV={nc}")
    _check_adjacency(adjacency)
    if extra is not None:
        if not isinstance(extra, torch.Tensor):
            raise TypeError(f"extra must be a torch.Tensor, got {type(extra).__name__}")
        if extra.dtype not in (torch.bool, torch.uint8):
            raise TypeError(f"extra must be a bool or uint8 mask, got dtype {extra.dtype}")
        want = (q.shape[0], q.shape[2], nc, nc)
        try:
            ok = extra.dim() == 4 and torch.broadcast_shapes(extra.shape, want) == want
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"extra must be (B, H, NQ, NKV) = {want} or broadcastable to it "
                             f"(e.g. (1, 1, NQ, NKV)), got shape {tuple(extra.shape)}")
        if extra.device != q.device:
            raise ValueError(f"extra must be on q's device {q.device}, got {extra.device}")
    return g, c, block, cgrid, vbs


def jenga_mask(
    q: torch.Tensor,
    k: torch.Tensor,
    topk: int,
    grid: Sequence[int],
    cube: Sequence[int] = (4, 4, 4),
    *,
    adjacency: str | None = "box",
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """Jenga / AttenCarve block selection: importance top-k union forced adjacency union extra.

    Args:
        q, k: ``(B, S, H, D)`` cube-major padded (``layout.to_cubes`` of THW tokens on ``grid``).
        topk: importance cubes per query cube, ``0..NKV``: the top-k of the mean-pooled coarse
            scores (:func:`mean_pool_topk`'s: on the GPU on the tensor cores, the module
            docstring), per head.
        grid: latent token grid ``(T, H, W)``; with ``cube`` it fixes the cube grid, ``vbs``
            and the adjacency.
        adjacency: the neighbourhood forced for every query cube (:data:`ADJACENCY`: "self",
            "face" or "box"), or None for none.
        extra: optional ``(B, H, NQ, NKV)`` bool/uint8 mask (or broadcastable, e.g. a
            ``(1, 1, NQ, NKV)`` condition mask) OR-ed in.

    Returns:
        ``(B, H, NQ, NKV)`` bool. No host sync on the GPU. ``mask_to_lut(mask)`` turns it into a
        LUT (one sync for its width); :func:`jenga_lut` gives the LUT without one.
    """
    _, _, block, cgrid, vbs = _jenga_args(q, k, topk, grid, cube, adjacency, extra)
    scores = _scores(q, k, vbs, vbs, block)
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=q.device)
    if topk:
        from tilegen.coarse_gpu import row_topk_ids

        mask.scatter_(-1, row_topk_ids(scores, topk).long(), True)
    if adjacency is not None:
        mask |= _adjacency_on(cgrid, adjacency, q.device)
    if extra is not None:
        mask |= extra.bool()
    return mask


def jenga_lut(
    q: torch.Tensor,
    k: torch.Tensor,
    topk: int,
    grid: Sequence[int],
    cube: Sequence[int] = (4, 4, 4),
    *,
    adjacency: str | None = "box",
    extra: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`jenga_mask` as a padded LUT ``(idx, counts)`` (the layout of :func:`mask_to_lut`)
    with no host sync: the width is a bound known on the host, ``min(NKV, topk + the largest
    neighbourhood)`` without ``extra``, ``NKV`` with it."""
    g, c, _, cgrid, _ = _jenga_args(q, k, topk, grid, cube, adjacency, extra)
    nc = math.prod(cgrid)
    nb = _neighbourhood_size(cgrid, adjacency) if adjacency is not None else 0
    width = nc if extra is not None else max(1, min(nc, topk + nb))
    mask = jenga_mask(q, k, topk, g, c, adjacency=adjacency, extra=extra)
    return _mask_to_lut_width(mask, width)


def _mask_to_lut_width(mask: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mask_to_lut` with a width known to bound every row count (no host sync)."""
    nkv = mask.shape[-1]
    counts = mask.sum(-1, dtype=torch.int32)
    ar = torch.arange(nkv, device=mask.device, dtype=torch.int64)
    key = torch.where(mask, ar, ar + nkv).sort(dim=-1).values[..., :width]
    return torch.where(key >= nkv, key - nkv, key).to(torch.int32), counts


def ranked_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    vbs: torch.Tensor,
    topk: int,
    block: int = 64,
    q_vbs: torch.Tensor | None = None,
) -> torch.Tensor:
    """The coarse stage's top-k (:func:`mean_pool_topk`'s rule; ties may fall differently) with
    each row ordered by **descending** coarse score, so a row's first ``n`` entries are its best
    ``n`` cubes: the LUT that ``counts`` (e.g. from :func:`adaptive_topk`) cut down.
    ``(B, H, NQ, topk)`` int32."""
    nq, nkv, q_vbs = _check_qkv_cubes(q, k, vbs, block, q_vbs)
    topk = _check_topk(topk, nkv)
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
