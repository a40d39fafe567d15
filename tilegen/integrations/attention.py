"""The block-sparse self-attention the integrations share: THW-ordered ``(B, S, H, D)`` tokens
reordered into cubes (`tilegen.layout.to_cubes`), the mean-pool selection per head
(`tilegen.sparsity.mean_pool_topk`), `tilegen.ops.block_sparse_attention`, tokens back.

`tilegen.integrations.diffusers`' processor calls `sparse_attention` on one rank's heads (one
GPU, or a tensor-parallel rank's head shard); `tilegen.integrations.parallel.ulysses_attention`
calls it between its two all-to-alls. The numbers are the same in every case: the selection and
the kernel are per head.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from tilegen import layout
from tilegen import sparsity as selectors
from tilegen.prologue import NormRope

__all__ = ["DEFAULT_SPARSITY", "KERNEL_DTYPES", "check_cube", "check_sparsity",
           "sparse_attention", "topk_for"]

DEFAULT_SPARSITY = 0.875  # seed 003 / the default spec: 78 of 624 cubes kept
#: the dtypes the kernels take; other inputs (fp32) are rounded to bf16 for the kernel
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
Triple = tuple[int, int, int]


def topk_for(sparsity: float, n_cubes: int) -> int:
    """KV cubes kept per query cube at ``sparsity`` (the fraction dropped) of ``n_cubes``:
    ``round(n_cubes * (1 - sparsity))``, at least 1 (87.5% of 624 cubes keeps 78)."""
    return max(1, min(n_cubes, round(n_cubes * (1.0 - sparsity))))


def check_cube(cube: Sequence[int]) -> Triple:
    """The cube as a triple of ints, refused unless it holds 64 tokens (the kernels' block)."""
    c = layout._triple(cube, "cube")
    if math.prod(c) != 64:
        raise ValueError(f"cube={c} holds {math.prod(c)} tokens; the block-sparse kernels take "
                         "64-token cubes")
    return c


def check_sparsity(value: object, name: str = "sparsity") -> float:
    """A fraction of cubes to drop, in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a fraction of cubes to drop in [0, 1), got {value!r}")
    return float(value)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Triple,
                     cube: Triple, cubes_kept: Callable[[int], int] | int,
                     quant: str = "none", norm_rope: NormRope | None = None) -> torch.Tensor:
    """Block-sparse attention of THW-ordered ``(B, S, H, D)`` tokens, ``S = T*H*W`` of
    ``grid``: cubes, the mean-pool selection of ``cubes_kept`` KV cubes per query cube (an int,
    or a function of the cube count), tilegen's op, tokens back; ``(B, S, H, D)`` in q's dtype.

    The kernel runs in q's dtype when that is bf16 or fp16, else in bf16 (fp32 inputs are
    rounded; scores, softmax and P·V accumulate in fp32 in the kernel either way).
    Differentiable in q, k and v (the selection gets no gradient). With ``quant="int8_fp8"``
    the layer is `tilegen.ops.block_sparse_attention_8bit_thw` instead (the same selection;
    the pooling and the 8-bit pre-pass read the tokens in THW order, so q, k and v are never
    reordered): forward only, on Hopper. ``norm_rope`` (`tilegen.prologue.NormRope`, 8-bit
    only): q and k are the projections before Wan's norm and rotation, which the 8-bit pre-pass
    applies as it reads them (`block_sparse_attention_8bit_thw`).
    """
    from tilegen.ops import block_sparse_attention, block_sparse_attention_8bit_thw

    n_tok = grid[0] * grid[1] * grid[2]
    if q.shape[1] != n_tok:
        raise ValueError(f"self-attention got {q.shape[1]} tokens, the latent grid {grid} has "
                         f"{n_tok}")
    work = q.dtype if q.dtype in KERNEL_DTYPES else torch.bfloat16
    if quant != "none":
        n_cubes = math.prod(layout.cube_grid(grid, cube))
        topk = cubes_kept if isinstance(cubes_kept, int) else cubes_kept(n_cubes)
        o = block_sparse_attention_8bit_thw(q.to(work), k.to(work), v.to(work), grid, topk,
                                            cube=cube, quant=quant, norm_rope=norm_rope)
        return o.to(q.dtype)
    if norm_rope is not None:
        raise ValueError("norm_rope is applied by the 8-bit pre-pass: pass quant='int8_fp8', or "
                         "q and k after the prologue (tilegen.prologue.rms_norm_rope)")
    # padded slots hold a copy of their cube's first token (one gather, no zero fill): the
    # kernel masks padded keys, the selector pools real tokens only, padded rows are dropped
    qc, vbs = layout.to_cubes(q.to(work), grid, cube, zero_padding=False)
    kc, _ = layout.to_cubes(k.to(work), grid, cube, zero_padding=False)
    vc, _ = layout.to_cubes(v.to(work), grid, cube, zero_padding=False)
    n_cubes = vbs.shape[0]
    topk = cubes_kept if isinstance(cubes_kept, int) else cubes_kept(n_cubes)
    block = math.prod(cube)
    with torch.no_grad():
        idx = selectors.mean_pool_topk(qc.detach(), kc.detach(), vbs, topk, block=block)
    oc = block_sparse_attention(qc, kc, vc, idx, vbs)
    return layout.from_cubes(oc, grid, cube).to(q.dtype)
