"""GPU kernels of the coarse stage's selection (`sparsity.mean_pool_topk`): cube pooling and
per-row top-k, each one Triton launch (the torch version is a dozen small launches, and on the
H200 the launches, not the bytes, set its time: 1.5 ms against a 0.2 ms byte floor).

* `pool_means`: the mean of each cube over its real tokens, (B, S, H, D) -> (B, H, NC, D)
  fp32, one program per (cube, group of up to 4 heads: a contiguous 1 KB row slice): the sum
  in fp32, rounded once to the input dtype, then divided by vbs in fp32 (`sparsity.pool_cubes`'
  arithmetic, up to fp32 summation order).
* `scores_of_means`: each head's ``qm @ km^T`` of the cube means on the tensor cores, the fp32
  operands as three TF32 products (cuBLAS runs the batched fp32 GEMM on FMA units).
* `pool_from_sums`: cube means from chunk sums the 8-bit pre-pass writes as it reads q and k
  (`tilegen.quant.quantize(..., pool=True)`), so that its selection needs no pooling read.
* `row_topk_ids`: one warp per row (`ROWS_PER_PROGRAM` rows a program) finds the k-th largest
  score by bisection on its order-preserving int32 bits (32 steps of a count over the row as
  two power-of-two pieces), takes the scores above it and the lowest ids among those equal to
  it, and compacts the ids in id order: `torch.topk`'s selection with lowest-id tie-breaking,
  already ascending (a full sort of the row in Triton measured 1.4 ms, twice torch.topk).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _cube_mean(total, n, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    """Cube sums (fp32) -> means: each rounded once to DTYPE, divided by its vbs ``n`` in fp32,
    NaN for an ``n`` outside 1..BLOCK (`sparsity.pool_cubes`' arithmetic)."""
    ok = (n >= 1) & (n <= BLOCK)
    mean = total.to(DTYPE).to(tl.float32) / tl.where(ok, n, 1).to(tl.float32)
    return tl.where(ok, mean, float("nan"))


@triton.jit
def _pool_kernel(X, VBS, SRC, OUT, seq_len, num_heads, nc, HEAD_DIM: tl.constexpr,
                 HEADS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                 GATHER: tl.constexpr):
    """HEADS neighbouring heads of one cube: their H*D slice is contiguous in BSHD. With
    GATHER, X is in token order and cube slot i reads token SRC[i]."""
    cube = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    groups = num_heads // HEADS
    b = g // groups
    h0 = (g % groups) * HEADS
    cols = tl.arange(0, HEADS * HEAD_DIM)
    n = tl.load(VBS + cube)
    acc = tl.zeros([HEADS * HEAD_DIM], tl.float32)
    for r0 in range(0, BLOCK, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        tok = cube * BLOCK + rows
        if GATHER:
            tok = tl.load(SRC + tok, mask=rows < n, other=0)
        ptr = X + ((b * seq_len + tok) * num_heads + h0)[:, None] * HEAD_DIM + cols[None, :]
        acc += tl.sum(tl.load(ptr, mask=(rows < n)[:, None], other=0.0).to(tl.float32), 0)
    mean = _cube_mean(acc, n, X.dtype.element_ty, BLOCK)
    h = h0 + cols // HEAD_DIM
    d = cols % HEAD_DIM
    tl.store(OUT + ((b * num_heads + h) * nc + cube) * HEAD_DIM + d, mean)


def pool_means(x: torch.Tensor, vbs: torch.Tensor, block: int = 64,
               sources: torch.Tensor | None = None) -> torch.Tensor:
    """(B, S, H, D) BSHD -> (B, H, NC, D) fp32 cube means over the first vbs[c] tokens (NaN for
    a vbs outside 1..block); GPU tensors only (`sparsity.pool_cubes` is the general form).
    ``sources`` (`tilegen.layout.cube_sources`): x is in token order, cube slot i being token
    ``sources[i]``; the means are those of ``x.index_select(1, sources)``, with no reorder."""
    b, s, h, d = x.shape
    seq_len = s
    if sources is not None:
        s = sources.numel()
    nc = s // block
    x = x.contiguous()
    heads = next(n for n in (4, 2, 1) if h % n == 0)  # 4 x 128 bf16 = 1 KB contiguous per row
    out = torch.empty((b, h, nc, d), dtype=torch.float32, device=x.device)
    # 8-row steps at 2 warps: 0.098 ms for q on the H200 (4.2 TB/s), against 0.14-0.25 for
    # 16/32-row steps at 4/8 warps (bench/experiments/h200_mean_pool_probe.py)
    _pool_kernel[(nc, b * h // heads)](x, vbs, vbs if sources is None else sources, out,
                                       seq_len, h, nc, HEAD_DIM=d, HEADS=heads, BLOCK=block,
                                       ROWS=8, GATHER=sources is not None, num_warps=2)
    return out


@triton.jit
def _pool_from_sums_kernel(SUMS, VBS, OUT, nc, DTYPE: tl.constexpr, HEAD_DIM: tl.constexpr,
                           CHUNKS: tl.constexpr, CUBES: tl.constexpr, BLOCK: tl.constexpr):
    """CUBES cubes of one (tensor, batch x head) row of SUMS (R, NC * CHUNKS, D): each cube's
    chunk sums added in chunk order, rounded once to DTYPE, divided by vbs (`_pool_kernel`'s
    arithmetic)."""
    row = tl.program_id(1).to(tl.int64)
    cubes = tl.program_id(0) * CUBES + tl.arange(0, CUBES)
    d = tl.arange(0, HEAD_DIM)
    live = cubes < nc
    acc = tl.zeros([CUBES, HEAD_DIM], tl.float32)
    for c in tl.static_range(CHUNKS):
        ptr = SUMS + ((row * nc + cubes) * CHUNKS + c)[:, None] * HEAD_DIM + d[None, :]
        acc += tl.load(ptr, mask=live[:, None], other=0.0)
    n = tl.load(VBS + cubes, mask=live, other=1)
    mean = _cube_mean(acc, n[:, None], DTYPE, BLOCK)
    tl.store(OUT + (row * nc + cubes)[:, None] * HEAD_DIM + d[None, :], mean, mask=live[:, None])


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def pool_from_sums(sums: torch.Tensor, vbs: torch.Tensor, dtype: torch.dtype,
                   block: int = 64) -> torch.Tensor:
    """Cube means from chunk sums: ``sums`` ``(R, NC * chunks, D)`` fp32, each cube's real
    tokens summed in ``chunks`` consecutive pieces (the 8-bit pre-pass's ``pool=True``), ->
    ``(R, NC, D)`` fp32: the sum rounded once to ``dtype``, divided by vbs, NaN for a vbs
    outside 1..block (`pool_means`' arithmetic, up to fp32 summation order). One launch."""
    nc = vbs.numel()
    if sums.dim() != 3 or sums.dtype != torch.float32 or nc == 0 or sums.shape[1] % nc \
            or sums.shape[2] & (sums.shape[2] - 1) or dtype not in _TL_DTYPES \
            or vbs.device != sums.device:
        raise ValueError(f"sums must be fp32 (R, NC * chunks, D) with NC={nc} (vbs, on sums' "
                         f"device) and a power-of-two D, dtype one of {list(_TL_DTYPES)}; got "
                         f"{sums.dtype} {tuple(sums.shape)} on {sums.device}, vbs on "
                         f"{vbs.device}, {dtype}")
    r, rows, d = sums.shape
    sums, vbs = sums.contiguous(), vbs.contiguous()
    out = torch.empty((r, nc, d), dtype=torch.float32, device=sums.device)
    cubes = 8
    _pool_from_sums_kernel[(triton.cdiv(nc, cubes), r)](
        sums, vbs, out, nc, DTYPE=_TL_DTYPES[dtype], HEAD_DIM=d, CHUNKS=rows // nc,
        CUBES=cubes, BLOCK=block, num_warps=2)
    return out


@triton.jit
def _scores_kernel(QM, KM, OUT, nq, nkv, heads, kv_heads, HEAD_DIM: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   PRECISION: tl.constexpr):
    """A (BM, BN) tile of one head's ``qm @ km^T``: fp32 operands on the tensor cores, BK
    channels a step (the whole head up to 128; 64 for 256, whose whole operands spill)."""
    bh = tl.program_id(2).to(tl.int64)
    b = bh // heads
    hk = (bh % heads) // (heads // kv_heads)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    s = tl.zeros([BM, BN], tl.float32)
    for d0 in tl.static_range(0, HEAD_DIM, BK):
        d = d0 + tl.arange(0, BK)
        a = tl.load(QM + (bh * nq + rows)[:, None] * HEAD_DIM + d[None, :],
                    mask=(rows < nq)[:, None], other=0.0)
        kb = tl.load(KM + ((b * kv_heads + hk) * nkv + cols)[:, None] * HEAD_DIM + d[None, :],
                     mask=(cols < nkv)[:, None], other=0.0)
        s = tl.dot(a, tl.trans(kb), s, input_precision=PRECISION)
    tl.store(OUT + (bh * nq + rows)[:, None] * nkv + cols[None, :], s,
             mask=(rows < nq)[:, None] & (cols < nkv)[None, :])


def scores_of_means(qm: torch.Tensor, km: torch.Tensor) -> torch.Tensor:
    """``qm @ km^T`` per head for cube means ``qm`` ``(B, H, NQ, D)`` and ``km``
    ``(B, H_kv, NKV, D)`` fp32 (query head h reads KV head h // (H / H_kv)) -> ``(B, H, NQ,
    NKV)`` fp32, in one launch on the tensor cores with fp32 operands split in three TF32
    products (``tf32x3``: each product good to about 2^-21, against 2^-24 for an fp32 FMA; the
    dropped term is the two low parts' product). cuBLAS runs this batched fp32 GEMM on FMA
    units (143 us a Wan layer on the H100, bench/NOTES.md). An infinite mean scores NaN here
    (its low part is inf - inf), where an fp32 GEMM gives +-inf; finite means only overflow
    if their products do. D a power of two from 16 to 256."""
    if qm.dim() != 4 or km.dim() != 4 or qm.dtype != torch.float32 \
            or km.dtype != torch.float32 or qm.device != km.device \
            or qm.shape[0] != km.shape[0] or qm.shape[3] != km.shape[3] \
            or km.shape[1] == 0 or qm.shape[1] % km.shape[1]:
        raise ValueError(f"cube means must be fp32 (B, H, NQ, D) and (B, H_kv, NKV, D) on one "
                         f"device with H_kv dividing H; got {qm.dtype} {tuple(qm.shape)} on "
                         f"{qm.device} and {km.dtype} {tuple(km.shape)} on {km.device}")
    b, h, nq, d = qm.shape
    if d & (d - 1) or not 16 <= d <= 256:
        raise ValueError(f"head_dim {d}: the scores kernel takes a power of two from 16 to 256")
    h_kv, nkv = km.shape[1], km.shape[2]
    qm, km = qm.contiguous(), km.contiguous()
    out = torch.empty((b, h, nq, nkv), dtype=torch.float32, device=qm.device)
    bm = bn = 64
    _scores_kernel[(triton.cdiv(nq, bm), triton.cdiv(nkv, bn), b * h)](
        qm, km, out, nq, nkv, h, h_kv, HEAD_DIM=d, BM=bm, BN=bn, BK=d if d <= 128 else 64,
        PRECISION="tf32x3", num_warps=4)
    return out


@triton.jit
def _ordered_keys(SCORES, row, n_rows, n_cols, col):
    """The scores of `col` as int32 keys that order like the floats (negative floats flip their
    magnitude); padding lanes INT32_MIN, below every real key (-inf maps above it)."""
    live = (col[None, :] < n_cols) & (row[:, None] < n_rows)
    s = tl.load(SCORES + row[:, None] * n_cols + col[None, :], mask=live, other=float("-inf"))
    s = s + 0.0  # -0.0 -> +0.0: torch.topk treats the two zeros as equal
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(live, key, -2147483647 - 1), live  # INT32_MIN: not a hardware fact


@triton.jit
def _row_topk_kernel(SCORES, OUT, n_rows, n_cols, k, ROWS: tl.constexpr, BLOCK_A: tl.constexpr,
                     BLOCK_B: tl.constexpr):
    """A row of n_cols scores as two power-of-two pieces, BLOCK_A lanes then BLOCK_B (624 ->
    512 + 128 instead of 1024 lanes): fewer idle compares in the bisection."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col_a = tl.arange(0, BLOCK_A)
    col_b = BLOCK_A + tl.arange(0, BLOCK_B)
    key_a, live_a = _ordered_keys(SCORES, row, n_rows, n_cols, col_a)
    key_b, live_b = _ordered_keys(SCORES, row, n_rows, n_cols, col_b)
    # the k-th largest key of each row by bisection: the largest t with count(key >= t) >= k.
    # A t with exactly k keys at or above it selects the same k (the ties below take what is
    # left, none), so a row stops there: fewer steps than the key space's 32 on most rows.
    lo = tl.full([ROWS], -(2 ** 31) + 1, tl.int64)
    hi = tl.full([ROWS], 2 ** 31 - 1, tl.int64)
    settled = tl.zeros([ROWS], tl.int32)
    steps = 0
    while (tl.min(settled, 0) == 0) & (steps < 32):
        mid = lo + (hi - lo + 1) // 2
        m = mid.to(tl.int32)[:, None]
        count = tl.sum((key_a >= m).to(tl.int32), 1) + tl.sum((key_b >= m).to(tl.int32), 1)
        enough = (count >= k) & (settled == 0)
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough | (settled != 0), hi, mid - 1)
        settled = tl.where((count == k) | (lo >= hi), 1, settled)
        steps += 1
    t = lo.to(tl.int32)[:, None]
    # ties at the threshold: the lowest ids fill what the keys above leave
    tie_a = (key_a == t) & live_a
    tie_b = (key_b == t) & live_b
    need = k - tl.sum((key_a > t).to(tl.int32), 1) - tl.sum((key_b > t).to(tl.int32), 1)
    ties_a = tl.sum(tie_a.to(tl.int32), 1)
    take_a = (key_a > t) | (tie_a & (tl.cumsum(tie_a.to(tl.int32), 1) <= need[:, None]))
    take_b = (key_b > t) | (tie_b & (tl.cumsum(tie_b.to(tl.int32), 1)
                                     <= (need - ties_a)[:, None]))
    pos_a = tl.cumsum(take_a.to(tl.int32), 1) - 1
    pos_b = tl.sum(take_a.to(tl.int32), 1)[:, None] + tl.cumsum(take_b.to(tl.int32), 1) - 1
    tl.store(OUT + row[:, None] * k + pos_a, col_a[None, :] + 0 * pos_a, mask=take_a)
    tl.store(OUT + row[:, None] * k + pos_b, col_b[None, :] + 0 * pos_b, mask=take_b)


#: rows per program (one warp each)
ROWS_PER_PROGRAM = 1


def row_topk_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``(..., N)`` fp32 scores -> ``(..., k)`` int32 ids of each row's k largest, ascending by
    id (ties: lower id first). GPU tensors run the Triton kernel; CPU tensors use torch.topk
    with the same tie rule."""
    n = scores.shape[-1]
    if scores.device.type == "meta":  # shapes only (the no-sync checks run on meta tensors)
        return torch.empty((*scores.shape[:-1], k), dtype=torch.int32, device="meta")
    if scores.device.type == "cpu":
        # stable descending sort keeps the lower id first among equal scores
        ids = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
        return ids.sort(dim=-1).values.to(torch.int32)
    flat = scores.reshape(-1, n).float().contiguous()
    out = torch.empty((flat.shape[0], k), dtype=torch.int32, device=scores.device)
    block_a = 1 << (n.bit_length() - 1)  # the largest power of two <= n, then the rest
    block_b = triton.next_power_of_2(max(n - block_a, 1))
    rows = ROWS_PER_PROGRAM
    _row_topk_kernel[(triton.cdiv(flat.shape[0], rows),)](flat, out, flat.shape[0], n, k,
                                                          ROWS=rows, BLOCK_A=block_a,
                                                          BLOCK_B=block_b, num_warps=rows)
    return out.view(*scores.shape[:-1], k)
