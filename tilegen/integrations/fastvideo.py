"""FastVideo's block-sparse attention calls (fastvideo-kernel 0.3.5) on tilegen's op, so a FastVideo
user changes one import::

    from tilegen.integrations.fastvideo import video_sparse_attn, block_sparse_attn

The signatures, shapes, dtypes, return values and autograd behaviour are FastVideo's: BHSD
tensors ``(B, H, S, D)`` whose tokens are already in 64-token blocks (FastVideo tiles the video
before the call), ``variable_block_sizes`` the real tokens of each block, and
``(o, M)`` from the two block-sparse calls, ``M`` the base-2 log-sum-exp of each row's scaled
scores (``max * log2(e) + log2(l)``), fp32 ``(B, H, S)``. The attention runs on
`tilegen.block_sparse_attention` (its tuned kernels on a GPU, the PyTorch fp32 path or the
interpreter on a CPU), in the inputs' dtype (bf16 or fp16) with fp32 accumulation.

Where tilegen's contract differs (README, "The input contract"):

- **Padded query rows.** FastVideo masks only keys with ``variable_block_sizes``; tilegen reads
  it as the query rows' padding too. A padded row's output is computed like a real one's, but
  its incoming gradient is ignored and its dq is zero, so dk and dv hold the real rows'
  contributions only (FastVideo adds the padded rows' too).
- **M carries a gradient** (a gradient of lse folds into the backward); FastVideo ignores one.
- **The coarse stage's block means** average a block's real tokens only, so padded tokens get
  no gradient from it; FastVideo sums the whole block (its inputs are zero-padded, so the
  values agree) and gives padded tokens a gradient.
- **Cross-attention** (``S_q != S_kv``) runs as FastVideo's Triton path does: the block lists
  name KV blocks, ``variable_block_sizes`` is the KV blocks' real tokens and every query row is
  real (tilegen's ``q_vbs`` default for another length). A ``q_variable_block_sizes`` that
  differs from ``variable_block_sizes`` in `video_sparse_attn` becomes tilegen's ``q_vbs``.
- **Not supported yet** (tilegen's shapes issue, #21), refused by a one-line ``ValueError``
  that says so: blocks other than 64 tokens (FastVideo's 256-token CuTe path).
"""

from __future__ import annotations

import math

import torch

BLOCK = 64  # tokens per block: the only size FastVideo's 64-token path and tilegen share


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           variable_block_sizes: torch.Tensor) -> tuple[int, int, int]:
    """(B * H, query blocks, KV blocks) after FastVideo's shape rules and tilegen's limits."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d (B, H, S, D) tensor, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must "
                         "share batch, heads and head dim, and k and v one shape")
    for name, t in (("q", q), ("k", k)):
        if t.shape[2] % BLOCK:
            raise ValueError(f"{name}'s sequence length {t.shape[2]} must be a whole number of "
                             f"{BLOCK}-token blocks")
    n_blocks = k.shape[2] // BLOCK
    if variable_block_sizes.numel() != n_blocks:
        raise ValueError(f"variable_block_sizes must have length {n_blocks} (one per KV "
                         f"block), got {variable_block_sizes.numel()}")
    return q.shape[0] * q.shape[1], q.shape[2] // BLOCK, n_blocks


def block_sparse_attn_from_indices(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   q2k_idx: torch.Tensor, q2k_num: torch.Tensor,
                                   variable_block_sizes: torch.Tensor, *,
                                   q_vbs: torch.Tensor | None = None
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention with autograd from compact per-row KV block lists: row ``i`` of
    ``q2k_idx`` ``(B, H, NQ, K)`` attends its first ``q2k_num[b, h, i]`` entries. Returns
    ``(o, M)``. tilegen's ``topk_idx`` and ``counts`` are these two. k and v may hold another
    number of blocks than q (cross-attention); ``q_vbs`` (tilegen's, not FastVideo's) gives the
    query blocks' real rows."""
    _check(q, k, v, variable_block_sizes)
    from tilegen.ops import block_sparse_attention

    if q2k_idx.dim() != 4 or q2k_idx.shape[:3] != q.shape[:2] + (q.shape[2] // BLOCK,):
        raise ValueError(f"q2k_idx must be (B, H, NQ, K) = ({q.shape[0]}, {q.shape[1]}, "
                         f"{q.shape[2] // BLOCK}, K), got {tuple(q2k_idx.shape)}")
    if tuple(q2k_num.shape) != tuple(q2k_idx.shape[:3]):
        raise ValueError(f"q2k_num must be {tuple(q2k_idx.shape[:3])}, got "
                         f"{tuple(q2k_num.shape)}")
    dev = q.device
    num = q2k_num.to(device=dev, dtype=torch.int32).contiguous()
    # entries past a row's count are never attended; FastVideo leaves anything there, tilegen
    # wants a valid id: 0
    slot = torch.arange(q2k_idx.shape[3], device=dev, dtype=torch.int32)
    idx = torch.where(slot < num.unsqueeze(-1), q2k_idx.to(device=dev, dtype=torch.int32), 0)
    # FastVideo's ops take strided views (they call .contiguous() themselves); tilegen's op
    # takes contiguous tensors
    if q_vbs is not None:
        q_vbs = q_vbs.to(device=dev, dtype=torch.int32).contiguous()
    return block_sparse_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                  idx.contiguous(),
                                  variable_block_sizes.to(device=dev, dtype=torch.int32),
                                  num, q_vbs=q_vbs, return_lse=True, layout="bhsd")


def block_sparse_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      block_map: torch.Tensor, variable_block_sizes: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention from a bool block map ``(B, H, NQ, NKV)`` (or ``(H, NQ, NKV)``).
    Returns ``(o, M)``. The map becomes index lists first (`tilegen.sparsity.mask_to_lut`,
    which reads the longest row's length back to the host: one sync, as FastVideo's own
    conversion)."""
    from tilegen.sparsity import mask_to_lut

    if block_map.dim() == 3:
        block_map = block_map.unsqueeze(0)
    if block_map.dim() != 4:
        raise ValueError(f"block_map must be (B, H, NQ, NKV) or (H, NQ, NKV), got "
                         f"{tuple(block_map.shape)}")
    idx, counts = mask_to_lut(block_map.to(torch.bool))
    return block_sparse_attn_from_indices(q, k, v, idx, counts, variable_block_sizes)


def _block_means(x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Each block's mean over its real tokens, (B, H, NB, D), in x's dtype (FastVideo's
    compression: fp32 sums over the block divided by its size; padded tokens masked here, so
    garbage there changes nothing)."""
    B, H, S, D = x.shape
    sizes = sizes.to(x.device)
    blocks = x.reshape(B, H, S // BLOCK, BLOCK, D).float()
    real = (torch.arange(BLOCK, device=x.device)[None, :]
            < sizes.view(-1, 1)).view(1, 1, -1, BLOCK, 1)
    sums = torch.where(real, blocks, 0.0).sum(dim=3)
    return (sums / sizes.to(torch.float32).view(1, 1, -1, 1)).to(x.dtype)


def video_sparse_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      variable_block_sizes: torch.Tensor, q_variable_block_sizes: torch.Tensor,
                      topk: int, block_size: int | tuple = 64,
                      compress_attn_weight: torch.Tensor | None = None) -> torch.Tensor:
    """VSA on ``(B, H, S, D)`` tensors in block order: the coarse stage (attention between the
    blocks' means, broadcast back to each block's tokens) plus the fine stage (block-sparse
    attention over each query block's ``topk`` highest-scoring key blocks), the coarse output
    weighted by ``compress_attn_weight`` (the gate, ``(B, H, S, D)``) when given. Returns o.
    ``block_size`` is an int (tokens per block, or the edge of a cubic block) or a (t, h, w)
    tuple; its volume must be 64 (an int of 64 is read as 64 tokens, FastVideo reads any int b
    as a b x b x b block). ``topk`` is clamped to the number of KV blocks. Block sizes that
    differ between the two tensors become tilegen's ``q_vbs`` (the query rows' own padding).
    Comparing the two tensors reads them back to the host (one sync) unless they are the same
    tensor: pass ``variable_block_sizes`` twice to avoid it (under CUDA graph capture, for
    one)."""
    if isinstance(block_size, int):
        volume = block_size if block_size == BLOCK else block_size ** 3
    else:
        volume = math.prod(block_size)
    if volume != BLOCK:
        raise ValueError(f"block_size={block_size!r} has {volume} tokens per block: tilegen's "
                         f"VSA takes {BLOCK}-token blocks only (256 is issue #21)")
    _, nq_blocks, n_blocks = _check(q, k, v, variable_block_sizes)
    if q_variable_block_sizes.numel() != nq_blocks:
        raise ValueError(f"q_variable_block_sizes must have length {nq_blocks} (one per "
                         f"query block), got {q_variable_block_sizes.numel()}")
    # equal block sizes on both sides keep one vbs (the kernels without separate query rows)
    q_vbs = None
    if q_variable_block_sizes is not variable_block_sizes and (
            nq_blocks != n_blocks or not torch.equal(
                q_variable_block_sizes.to(variable_block_sizes.device).long(),
                variable_block_sizes.long())):
        q_vbs = q_variable_block_sizes
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    B, H, S, D = q.shape
    q_c = _block_means(q, q_variable_block_sizes)
    k_c = _block_means(k, variable_block_sizes)
    v_c = _block_means(v, variable_block_sizes)
    scores = torch.matmul(q_c, k_c.transpose(-2, -1)) / math.sqrt(D)
    out_c = torch.matmul(torch.softmax(scores, dim=-1), v_c)  # (B, H, NB, D)
    out_c = out_c.repeat_interleave(BLOCK, dim=2)
    idx = scores.detach().topk(min(topk, n_blocks), dim=-1).indices.to(torch.int32)
    out_s, _ = block_sparse_attn_from_indices(
        q, k, v, idx.contiguous(), torch.full((B, H, nq_blocks), idx.shape[-1],
                                              dtype=torch.int32, device=q.device),
        variable_block_sizes, q_vbs=q_vbs)
    if compress_attn_weight is not None:
        return out_c * compress_attn_weight + out_s
    return out_c + out_s
