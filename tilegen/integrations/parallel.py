"""Sequence parallelism (DeepSpeed-Ulysses) around tilegen's block-sparse self-attention, on
torch.distributed's collectives::

    from tilegen.integrations.parallel import ulysses_attention

    # on each of the P ranks of `group`: q, k, v are (B, S/P, H, D), this rank's slice of the
    # THW-ordered sequence of the latent grid (T, H, W) (rank r holds tokens r*S/P .. (r+1)*S/P)
    out = ulysses_attention(q, k, v, (T, H, W), group=group, sparsity=0.875)   # (B, S/P, H, D)

What runs where, on every rank of ``group``:

1. an all-to-all (``torch.distributed.all_to_all_single``) of q, k and v: each rank sends head
   group p of its tokens to rank p and receives its own head group of every rank's tokens,
   ``(B, S/P, H, D) -> (B, S, H/P, D)`` (rank r holds heads ``r*H/P .. (r+1)*H/P``, the full
   sequence in token order);
2. the attention of the single-GPU path on those H/P heads
   (`tilegen.integrations.attention.sparse_attention`: the reorder into cubes, the mean-pool
   selection, `tilegen.ops.block_sparse_attention`, tokens back): VSA is head-parallel, so the
   selection and the kernel see exactly what they see on one GPU;
3. the inverse all-to-all, ``(B, S, H/P, D) -> (B, S/P, H, D)``.

The layout of both all-to-alls is diffusers' (``TemplatedUlyssesAttention``), so the ranks,
head groups and sequence slices line up with a diffusers context-parallel model's.

Autograd flows through both all-to-alls (`_AllToAll`: its backward is the same all-to-all of
the gradient, the adjoint of a permutation of chunks) and the op's backward, so q, k and v get
their gradients on their own ranks. (``torch.distributed.nn.functional.all_to_all_single`` does
the same on gloo, but torch 2.13 deprecates it with a FutureWarning, so tilegen has its own.)
The collectives are eager calls: under ``torch.compile`` they are graph breaks.

Checked with two gloo processes on the CPU (`tests/test_parallel.py`): the output and the
gradients of q, k, v equal the one-process result. Not exercised there: NCCL on GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from tilegen import layout
from tilegen.integrations.attention import (
    DEFAULT_SPARSITY,
    check_cube,
    check_sparsity,
    sparse_attention,
    topk_for,
)

__all__ = ["ulysses_attention"]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of a ``(P, ...)`` tensor over ``group``: chunk p goes to rank p,
    chunk p of the result came from rank p. Its own adjoint, so the backward is the same
    all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _gather_sequence(x: torch.Tensor, p: int, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, S/P, H, D) -> (B, S, H/P, D): this rank's head group, every rank's tokens."""
    b, s_local, h, d = x.shape
    x = x.reshape(b, s_local, p, h // p, d).permute(2, 1, 0, 3, 4)  # (P, S/P, B, H/P, D)
    x = _AllToAll.apply(x, group)  # chunk i: rank i's tokens of this rank's heads
    return x.permute(2, 0, 1, 3, 4).reshape(b, p * s_local, h // p, d)


def _scatter_sequence(x: torch.Tensor, p: int, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, S, H/P, D) -> (B, S/P, H, D): the inverse of `_gather_sequence`."""
    b, s, h_local, d = x.shape
    x = x.reshape(b, p, s // p, h_local, d).permute(1, 2, 0, 3, 4)  # (P, S/P, B, H/P, D)
    x = _AllToAll.apply(x, group)  # chunk i: head group i of this rank's tokens
    return x.permute(2, 1, 0, 3, 4).reshape(b, s // p, p * h_local, d)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: Sequence[int],
    *,
    group: dist.ProcessGroup,
    sparsity: float | None = None,
    topk: int | None = None,
    cube: Sequence[int] = (4, 4, 4),
    quant: str = "none",
) -> torch.Tensor:
    """Block-sparse self-attention of a sequence split across the ranks of ``group``
    (module docstring: the all-to-all, the single-GPU attention on H/P heads, the inverse).

    Args:
        q, k, v: ``(B, S/P, H, D)`` (BSHD) on every rank, ``P`` the size of ``group``: this
            rank's contiguous slice of the ``S = T*H*W`` tokens of ``grid`` in THW order (after
            patchify), rank r (its rank in ``group``) holding tokens ``r*S/P`` to
            ``(r+1)*S/P``, as diffusers' context-parallel split gives them. Any dtype the
            single-GPU path takes (bf16 and fp16 attend in their dtype; fp32 is rounded to bf16
            for the kernel and the output cast back); communication is in the inputs' dtype.
        grid: the latent grid ``(T, H, W)`` of the whole sequence.
        group: the process group to split over (``torch.distributed.group.WORLD`` for all
            ranks); every rank of it calls this with the same shapes and arguments.
        sparsity: fraction of KV cubes each query cube drops, in [0, 1) (default 0.875).
        topk: KV cubes kept per query cube instead of ``sparsity`` (clamped to the cube count).
        cube: the cube shape in latent tokens, 64 tokens (default (4, 4, 4)).
        quant: ``"none"``, or ``"int8_fp8"`` for the 8-bit kernel (forward only, Hopper:
            `tilegen.ops.block_sparse_attention_8bit_thw`).

    Returns:
        ``(B, S/P, H, D)``: this rank's tokens, every head, in q's dtype; differentiable in q,
        k and v.

    Raises:
        ValueError (one line, on every rank alike, before any collective): the heads or the
        sequence do not divide by the group size, the local shapes do not add up to ``grid``,
        or an argument is out of range. RuntimeError: torch.distributed is not initialized.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ulysses_attention needs torch.distributed initialized "
                           "(torch.distributed.init_process_group) on every rank of the group")
    if group is None:
        raise TypeError("ulysses_attention: group must be a torch.distributed ProcessGroup "
                        "(torch.distributed.group.WORLD for all ranks), got None")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"ulysses_attention: {name} must be a (B, S/P, H, D) tensor, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError("ulysses_attention: q, k and v must have one shape (self-attention), "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    g, c = layout._triple(grid, "grid"), check_cube(cube)
    if sparsity is not None and topk is not None:
        raise ValueError("ulysses_attention: give sparsity or topk, not both")
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 1):
        raise ValueError(f"ulysses_attention: topk must be a positive int, got {topk!r}")
    fraction = None if topk is not None else check_sparsity(
        DEFAULT_SPARSITY if sparsity is None else sparsity)

    p = dist.get_world_size(group)
    _, s_local, heads, _ = q.shape
    n_tok = math.prod(g)
    if heads % p:
        raise ValueError(f"ulysses_attention: {heads} heads do not divide by the group size "
                         f"{p} (each rank attends over heads/{p} of them)")
    if n_tok % p:
        raise ValueError(f"ulysses_attention: the grid {g} has {n_tok} tokens, which do not "
                         f"divide by the group size {p}")
    if s_local * p != n_tok:
        raise ValueError(f"ulysses_attention: q holds {s_local} tokens per rank, {p} ranks "
                         f"hold {s_local * p}, the grid {g} has {n_tok} (each rank holds "
                         f"{n_tok // p})")
    n_cubes = math.prod(layout.cube_grid(g, c))
    kept = min(topk, n_cubes) if topk is not None else topk_for(fraction, n_cubes)

    if p == 1:
        return sparse_attention(q, k, v, g, c, kept, quant)
    qf, kf, vf = (_gather_sequence(t, p, group) for t in (q, k, v))
    out = sparse_attention(qf, kf, vf, g, c, kept, quant)
    return _scatter_sequence(out, p, group)
