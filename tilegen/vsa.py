"""The full VSA forward (Video Sparse Attention, FastVideo's ``video_sparse_attn``) on THW tokens.

``out = video_sparse_attention(q, k, v, grid, topk, cube, gate)`` with ``q, k, v`` ``(B, T*H*W,
heads, D)`` tokens row-major over (t, h, w) (the model's order), in five stages:

1. **reorder**: ``layout.to_cubes`` puts the tokens cube-major (cubes of ``cube`` tokens, zero
   padding in partial edge cubes; ``vbs[c]`` real tokens in cube ``c``).
2. **coarse**: every cube is mean-pooled over its real tokens (``sparsity.pool_cubes``: the sum
   accumulated in fp32 and rounded once to the input dtype, as FastVideo rounds its pooled
   cubes, then divided by ``vbs`` in fp32) into ``q̄, k̄, v̄`` ``(B, H, NC, D)``. Per head,
   ``P = softmax(q̄ k̄ᵀ · sm_scale)`` over all ``NC`` KV cubes (fp32), and the **coarse output**
   of query cube ``i`` is ``(P v̄)[i]``, the same vector for every token of the cube. The
   **selection** is the top-``topk`` KV cubes of row ``i`` of ``q̄ k̄ᵀ`` (the rule of
   ``sparsity.mean_pool_topk``, whose GPU pooling sums in another order and whose GPU scores
   run on the tensor cores as tf32x3 products: a near-tie can fall the other way), ids
   ascending; the scores here are one fp32 matmul, since the coarse output needs their
   gradient.
3. **fine**: block-sparse attention of every token over the real tokens of its query cube's
   selected KV cubes: the tuned kernel ``tilegen.load(spec)`` for the workload's spec
   (`fine_spec`: grid, heads, topk; the nearest tuned workload's winner otherwise), output in
   the input dtype. The ops layer supplies it (`tilegen.ops.vsa_fine`), so this module holds no
   kernels.
4. **combine**: ``out = fine + gate * coarse``, in fp32, rounded once to the input dtype. ``gate``
   is a tensor broadcastable to ``(B, T*H*W, heads, D)`` in token order (FastVideo's
   ``compress_attn_weight``, e.g. a per-element ``(B, S, H, D)`` projection or ``(B, S, H, 1)``);
   ``gate=None`` means a gate of 1, ``out = fine + coarse``, as FastVideo does without one.
5. **reorder back**: ``layout.from_cubes`` (padding dropped).

:func:`reference_fp32` is the same definition computed independently in fp32/fp64 (the oracle),
with the two roundings that belong to it (pooled sums to the input dtype, the fine output to the
input dtype); the op's result, rounded once at the end, is scored against it with the contract's
rule. The stage functions (:func:`reorder`, :func:`coarse`, :func:`combine`, and
`tilegen.ops.vsa_fine`) are public so benchmarks can time the split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tilegen import layout, sparsity
from tilegen.coarse_gpu import row_topk_ids
from tilegen.spec import Spec

__all__ = ["default_topk", "check_args", "check_varlen_args", "reorder", "coarse",
           "fine_spec", "combine", "forward", "forward_varlen", "is_grid_list", "reference_fp32"]

Triple = tuple[int, int, int]
_DTYPES = (torch.bfloat16, torch.float16)


def default_topk(grid: Sequence[int], cube: Sequence[int] = (4, 4, 4)) -> int:
    """The default spec's density (topk / cubes, 78/624 = 12.5%) on this grid, at least 1."""
    base = Spec()
    nc = math.prod(layout.cube_grid(grid, cube))
    return max(1, round(nc * base.topk / base.num_cubes))


def check_args(q: Any, k: Any, v: Any, grid: Any, topk: Any, cube: Any, gate: Any,
               sm_scale: Any = None) -> tuple[Triple, Triple, int]:
    """Validate on the host (no device read); returns (grid, cube, topk). Errors name the
    argument: TypeError for types and dtypes, ValueError for shapes, devices and values."""
    g, c = layout._triple(grid, "grid"), layout._triple(cube, "cube")
    n_tok = math.prod(g)
    nc = math.prod(layout.cube_grid(g, c))
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; video_sparse_attention takes "
                            f"{[str(d) for d in _DTYPES]}")
        if t.dim() != 4 or t.shape[1] != n_tok:
            raise ValueError(f"{name} must be (B, T*H*W, heads, D) with T*H*W={n_tok} for "
                             f"grid={g}, got shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must match q's shape, dtype and device "
                             f"({tuple(q.shape)}, {q.dtype}, {q.device}), got "
                             f"({tuple(t.shape)}, {t.dtype}, {t.device})")
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise TypeError(f"topk must be an int, got {type(topk).__name__}")
    if not 1 <= topk <= nc:
        raise ValueError(f"topk={topk} must lie in 1..{nc} (the cubes of grid={g}, cube={c})")
    if gate is not None:
        if not isinstance(gate, torch.Tensor):
            raise TypeError(f"gate must be a torch.Tensor or None, got {type(gate).__name__}")
        if not gate.is_floating_point():
            raise TypeError(f"gate must be a floating tensor, got dtype {gate.dtype}")
        if gate.device != q.device:
            raise ValueError(f"gate must be on q's device {q.device}, got {gate.device}")
        try:
            ok = gate.dim() <= 4 and torch.broadcast_shapes(gate.shape, q.shape) == q.shape
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"gate must broadcast to the output {tuple(q.shape)} "
                             f"(B, T*H*W, heads, D), got shape {tuple(gate.shape)}")
    if sm_scale is not None and (isinstance(sm_scale, bool)
                                 or not isinstance(sm_scale, (int, float))
                                 or not math.isfinite(sm_scale) or sm_scale <= 0):
        raise ValueError(f"sm_scale must be a positive finite float or None, got {sm_scale!r}")
    return g, c, topk


# -- stages ----------------------------------------------------------------------------------
def reorder(x: torch.Tensor, grid: Triple, cube: Triple) -> torch.Tensor:
    """Stage 1: THW tokens -> cube-major padded (``layout.to_cubes``; padding zero)."""
    return layout.to_cubes(x, grid, cube)[0]


def coarse(qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, vbs: torch.Tensor, topk: int,
           block: int, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 2: the coarse output ``(B, H, NC, D)`` fp32 and the selection ``(B, H, NC, topk)``
    int32 (ids ascending) from cube-major ``qc, kc, vc``. No host sync."""
    return coarse_pooled(*(sparsity.pool_cubes(x, vbs, block) for x in (qc, kc, vc)), topk,
                         sm_scale)


def coarse_pooled(qm: torch.Tensor, km: torch.Tensor, vm: torch.Tensor, topk: int,
                  sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`coarse` from the pooled cubes ``(B, H, NC, D)`` fp32 (a list of grids pools all its
    sequences at once and attends per sequence on slices of the small pooled tensors)."""
    raw = qm @ km.transpose(-1, -2)
    # the top-k of the unscaled scores: sparsity.mean_pool_topk's rule (on the GPU its pooling
    # kernel sums in another order and its scores are tf32x3, so a near-tie can fall the other
    # way)
    idx = row_topk_ids(raw.detach(), topk)
    out = torch.softmax(raw * sm_scale, dim=-1) @ vm
    return out, idx


def fine_spec(qc: torch.Tensor, grid: Triple, cube: Triple, topk: int) -> Spec:
    """The workload spec of the fine stage (kernel fields from the tensors and the cube)."""
    vol = math.prod(cube)
    return Spec(block_q=vol, block_kv=vol, cube=cube, head_dim=qc.shape[-1],
                dtype={torch.bfloat16: "bf16", torch.float16: "fp16"}[qc.dtype],
                layout="bshd", grid=grid, num_heads=qc.shape[2], topk=topk, batch=qc.shape[0])


def combine(fine_c: torch.Tensor, coarse_out: torch.Tensor, gate: torch.Tensor | None,
            grid: Triple, cube: Triple, differentiable: bool = False) -> torch.Tensor:
    """Stages 4 and 5: ``fine + gate * coarse`` in fp32, rounded once to the input dtype, then
    back to THW token order. Runs in cube order, where the coarse output is a broadcast view
    (never materialised per token); a gate with a token dimension is reordered to cubes."""
    if gate is not None:
        gate = gate.reshape((1,) * (4 - gate.dim()) + tuple(gate.shape))
        if gate.shape[1] != 1:  # per token: to cube order (padding slots get 0)
            gate = layout.to_cubes(gate, grid, cube)[0]
    out_c = _mix(fine_c, coarse_out, gate, math.prod(cube), differentiable)
    return layout.from_cubes(out_c, grid, cube)


def _mix(fine_c: torch.Tensor, coarse_out: torch.Tensor, gate: torch.Tensor | None, vol: int,
         differentiable: bool) -> torch.Tensor:
    """``fine + gate * coarse`` in cube order: ``fine_c`` ``(B, S, H, D)``, ``coarse_out``
    ``(B, H, S / vol, D)`` fp32, ``gate`` None, ``(Bg, 1, Hg, Dg)`` or cube-ordered
    ``(Bg, S, Hg, Dg)``; fp32 arithmetic, one rounding to ``fine_c``'s dtype."""
    B, S, H, D = fine_c.shape
    nc = S // vol
    fine_v = fine_c.view(B, nc, vol, H, D)
    co = coarse_out.permute(0, 2, 1, 3).unsqueeze(2)  # (B, NC, 1, H, D) fp32
    if gate is not None:
        gate = (gate.view(gate.shape[0], nc, vol, *gate.shape[2:]) if gate.shape[1] != 1
                else gate.unsqueeze(2))  # (Bg, NC, vol | 1, Hg, Dg)
    if differentiable:
        mixed = fine_v.float() + (co if gate is None else gate.float() * co)
        out_c = mixed.to(fine_c.dtype)
    else:  # one fused pass: fp32 arithmetic, bf16/fp16 store
        out_c = torch.empty_like(fine_v)
        if gate is None:
            torch.add(fine_v, co, out=out_c)
        else:
            torch.addcmul(fine_v, gate, co, out=out_c)
    return out_c.view(B, S, H, D)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Triple, topk: int,
            cube: Triple = (4, 4, 4), gate: torch.Tensor | None = None,
            sm_scale: float | None = None, *, fine: Callable[..., torch.Tensor],
            differentiable: bool = False, return_selection: bool = False) -> Any:
    """The pipeline on validated inputs (`check_args`). ``fine`` is the fine stage,
    ``fine(qc, kc, vc, idx, vbs, grid, cube, sm_scale, differentiable) -> o`` cube-major in the
    input dtype (`tilegen.ops.vsa_fine`: the ops layer owns the kernels). ``differentiable``
    builds the pipeline from ops autograd records (the gradient path); otherwise the tuned fine
    op and the fused combine run. ``return_selection`` also returns the ``(B, H, NC, topk)``
    int32 selection."""
    vol = math.prod(cube)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    vbs = layout.vbs_for_grid(grid, cube, device=q.device)
    if q.is_cuda and not differentiable and q.shape == k.shape == v.shape and all(
            t.is_contiguous() for t in (q, k, v)):
        from tilegen.reorder_gpu import to_cubes3

        qc, kc, vc = to_cubes3(q, k, v, grid, cube)  # one launch for the three
    else:
        qc, kc, vc = (reorder(t, grid, cube) for t in (q, k, v))
    co, idx = coarse(qc, kc, vc, vbs, topk, vol, scale)
    fine_c = fine(qc, kc, vc, idx, vbs, grid, cube, sm_scale, differentiable)
    out = combine(fine_c, co, gate, grid, cube, differentiable)
    return (out, idx) if return_selection else out


def is_grid_list(grid: Any) -> bool:
    """A list of grids (one per packed sequence) rather than one grid."""
    return (isinstance(grid, (list, tuple)) and len(grid) > 0
            and all(isinstance(g, (list, tuple)) for g in grid))


def check_varlen_args(q: Any, k: Any, v: Any, grids: Any, topk: Any, cube: Any, gate: Any,
                      sm_scale: Any = None) -> tuple[list[Triple], Triple, list[int]]:
    """`check_args` for packed sequences: q, k, v ``(1, sum_s T_s*H_s*W_s, heads, D)``, the
    sequences' tokens one after another (each THW row-major); ``topk`` an int for every
    sequence, one per sequence, or None (each grid's default density). Returns (grids, cube,
    topks)."""
    gs = [layout._triple(g, f"grid[{i}]") for i, g in enumerate(grids)]
    c = layout._triple(cube, "cube")
    n_tok = sum(math.prod(g) for g in gs)
    ncs = [math.prod(layout.cube_grid(g, c)) for g in gs]
    if topk is None:
        topks = [default_topk(g, c) for g in gs]
    elif isinstance(topk, int) and not isinstance(topk, bool):
        topks = [topk] * len(gs)
    elif isinstance(topk, (list, tuple)) and len(topk) == len(gs):
        topks = list(topk)
    else:
        raise TypeError(f"topk must be None, an int or one int per grid ({len(gs)}), "
                        f"got {topk!r}")
    for i, (t, nc) in enumerate(zip(topks, ncs, strict=True)):
        if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= nc:
            raise ValueError(f"topk for grid[{i}]={gs[i]} must be an int in 1..{nc} (its cubes)"
                             f", got {t!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and (t.dim() != 4 or t.shape[0] != 1
                                            or t.shape[1] != n_tok):
            raise ValueError(f"{name} must be (1, {n_tok}, heads, D) for the {len(gs)} grids "
                             f"packed one after another, got shape {tuple(t.shape)}")
    if math.prod(c) != 64:
        raise ValueError(f"cube={c}: a list of grids runs the fine stage as one packed call of "
                         "tilegen::block_sparse_attention, whose cubes have 64 tokens")
    # dtypes, devices, k and v like q, the gate: the checks of one sequence of n_tok tokens
    check_args(q, k, v, (1, 1, n_tok), 1, (1, 1, 1), gate, sm_scale)
    return gs, c, topks


def _gather_slots(x: torch.Tensor, idx: torch.Tensor, padded: bool) -> torch.Tensor:
    """``x[:, idx]`` along dim 1; with ``padded``, zeros where ``idx < 0``."""
    out = x[:, idx.clamp(min=0) if padded else idx]
    if not padded:
        return out
    real = (idx >= 0).view(1, -1, *(1,) * (x.dim() - 2))
    return torch.where(real, out, 0.0).to(x.dtype)


class _SlotGather(torch.autograd.Function):
    """``out[:, i] = x[:, fwd[i]]`` (zero where ``fwd[i] < 0``) for index maps ``fwd`` and ``bwd``
    that are each other's inverse on their non-negative entries (tokens to cube slots and back:
    every element lands in exactly one place). So the backward is the gather by ``bwd``, not
    the scatter-add autograd records for an index (2x slower than the whole step on the H200:
    bench/NOTES.md)."""

    @staticmethod
    def forward(ctx, x, fwd, bwd, fwd_padded, bwd_padded):
        ctx.bwd, ctx.bwd_padded = bwd, bwd_padded
        return _gather_slots(x, fwd, fwd_padded)

    @staticmethod
    def backward(ctx, grad):
        return _gather_slots(grad, ctx.bwd, ctx.bwd_padded), None, None, None, None


def _to_slots(x: torch.Tensor, src: torch.Tensor, slot_of: torch.Tensor,
              differentiable: bool) -> torch.Tensor:
    """Packed tokens ``(Bx, tokens, ...)`` -> their cube slots (zeros in padding slots)."""
    if differentiable:
        return _SlotGather.apply(x, src, slot_of, True, False)
    return _gather_slots(x, src, True)


def _from_slots(x: torch.Tensor, src: torch.Tensor, slot_of: torch.Tensor,
                differentiable: bool) -> torch.Tensor:
    """Cube slots -> packed tokens (padding slots dropped)."""
    if differentiable:
        return _SlotGather.apply(x, slot_of, src, False, True)
    return _gather_slots(x, slot_of, False)


def forward_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grids: list[Triple],
                   topks: list[int], cube: Triple = (4, 4, 4), gate: torch.Tensor | None = None,
                   sm_scale: float | None = None, *, fine: Callable[..., torch.Tensor],
                   differentiable: bool = False) -> torch.Tensor:
    """The pipeline over packed sequences (`check_varlen_args`). Every stage that is per cube
    runs once over all sequences side by side, cube-major: the reorder (one gather), the
    pooling, the fine call (each row's selected cubes offset to its sequence, counts for the
    narrower rows), the combine and the reorder back (one gather). Only the coarse attention
    runs per sequence, on slices of the small pooled tensors, so autograd never materialises a
    full-size gradient per slice. ``fine(qc, kc, vc, idx, vbs, counts)`` is the packed fine
    stage (`tilegen.ops`). No host sync: the offsets come from the grids."""
    vol = math.prod(cube)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    width = max(topks)
    key = tuple(tuple(g) for g in grids), tuple(cube)
    src = layout.packed_slot_sources(*key, q.device).long()
    slot_of = layout.packed_token_slots(*key, q.device)
    if q.is_cuda and not differentiable and q.shape == k.shape == v.shape and all(
            t.is_contiguous() for t in (q, k, v)):
        from tilegen.reorder_gpu import to_cubes3_packed

        packed = to_cubes3_packed(q, k, v, *key)  # every sequence, one launch
    else:
        packed = tuple(_to_slots(x, src, slot_of, differentiable) for x in (q, k, v))
    vbs_of = [layout.vbs_for_grid(g, cube, device=q.device) for g in grids]
    vbs_all = torch.cat(vbs_of)
    pooled = [sparsity.pool_cubes(x, vbs_all, vol) for x in packed]  # (1, H, NC_total, D)
    coarse_outs, rows, counts_of, at = [], [], [], 0
    for vbs, t in zip(vbs_of, topks, strict=True):
        cubes = slice(at, at + vbs.numel())
        co, idx = coarse_pooled(*(m[:, :, cubes] for m in pooled), t, scale)
        if t < width:  # slots past the count are never read: repeat the first id
            idx = torch.cat((idx, idx[..., :1].expand(-1, -1, -1, width - t)), -1)
        coarse_outs.append(co)
        rows.append(idx + at)
        counts_of.append(torch.full(idx.shape[:3], t, dtype=torch.int32, device=q.device))
        at += vbs.numel()
    counts = torch.cat(counts_of, 2).contiguous() if min(topks) < width else None
    fine_all = fine(*packed, torch.cat(rows, 2).to(torch.int32).contiguous(), vbs_all, counts)
    co_all = torch.cat(coarse_outs, 2)
    if gate is not None:
        gate = gate.reshape((1,) * (4 - gate.dim()) + tuple(gate.shape))
        if gate.shape[1] != 1:  # a token dimension: to the cube slots (padding slots get 0)
            gate = _to_slots(gate, src, slot_of, differentiable)
    out_c = _mix(fine_all, co_all, gate, vol, differentiable)
    return _from_slots(out_c, src, slot_of, differentiable)


# -- the oracle ------------------------------------------------------------------------------
def reference_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Sequence[int],
                   topk: int, cube: Sequence[int] = (4, 4, 4), gate: torch.Tensor | None = None,
                   sm_scale: float | None = None, *, topk_idx: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The VSA forward in fp32 (fp64 for the pooling), independent of the op's stage code.

    Returns ``(out, idx)``: ``out`` fp32 ``(B, T*H*W, heads, D)`` before the op's final rounding
    (compare ``out.to(dtype)`` with the contract's rule), ``idx`` the ``(B, H, NC, topk)``
    selection it used: its own top-k of the pooled scores, or ``topk_idx`` when given (so the
    fine stage can be checked on the op's selection; near-ties may order differently at fp32
    rounding level). Chunked over heads through `tilegen.reference.attention_fp32`.
    """
    from tilegen.reference import attention_fp32

    g, c = layout._triple(grid, "grid"), layout._triple(cube, "cube")
    vol = math.prod(c)
    B, N, H, D = q.shape
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    vbs = layout.vbs_for_grid(g, c, device=q.device)
    qc, kc, vc = (layout.to_cubes(t, g, c)[0] for t in (q, k, v))
    nc = qc.shape[1] // vol
    real = (torch.arange(vol, device=q.device)[None, :] < vbs.long()[:, None])  # (NC, vol)

    def pooled(x: torch.Tensor) -> torch.Tensor:  # (B, H, NC, D) fp32
        xs = x.view(B, nc, vol, H, D).double() * real.view(1, nc, vol, 1, 1)
        sums = xs.sum(2).to(x.dtype).double()  # the definition's one rounding of the sum
        return (sums / vbs.double().view(1, nc, 1, 1)).permute(0, 2, 1, 3).float()

    qm, km, vm = pooled(qc), pooled(kc), pooled(vc)
    raw = qm.double() @ km.double().transpose(-1, -2)
    if topk_idx is None:
        topk_idx = raw.topk(topk, dim=-1).indices.sort(dim=-1).values.to(torch.int32)
    co = (torch.softmax(raw * scale, dim=-1) @ vm.double()).float()  # (B, H, NC, D)
    fine_c, _ = attention_fp32(qc, kc, vc, topk_idx, vbs, block=vol, sm_scale=sm_scale)
    fine_c = fine_c.to(q.dtype).float()  # the fine stage's output is in the input dtype
    cube_of = layout.token_slots(g, c, device=q.device) // vol  # (N,)
    co_tok = co.permute(0, 2, 1, 3)[:, cube_of]  # (B, N, H, D)
    fine_tok = layout.from_cubes(fine_c, g, c)
    gate_f = torch.ones((), device=q.device) if gate is None else gate.float()
    return fine_tok + gate_f * co_tok, topk_idx
