"""8-bit attention's recipe (issue #19): INT8 Q·K with per-token scales, smoothed, and P·V in
bf16 (``"int8"``) or e4m3 (``"int8_fp8"``); the pre-pass that quantizes, and the emulation the
kernels are held to (contract.md, the quantized rule's check 4).

**The recipe**, per (batch, head), on cube-major padded BSHD tensors (``block`` tokens a cube,
``vbs`` real tokens of each cube):

* **K smoothing.** ``k - k̄``, with ``k̄`` the mean of K's first token of ``SAMPLE_CUBES``
  cubes spread over the sequence (always real tokens). Softmax is invariant to any vector
  subtracted from every key, so the choice of ``k̄`` changes only the rounding; a sample keeps
  the statistics one small launch of a program a head, before the pass reads them.
* **No Q smoothing.** Subtracting each query cube's mean and adding ``q̄_c · k_j`` back would
  cost the kernel a GEMV per tile; measured on the default workload it buys 0.001 of relative L1
  on ``"int8_fp8"`` (bench/NOTES.md), so the kernels' recipe leaves it out. `quantize_torch`
  keeps it as an ablation (``q_smooth=True``), and `emulate` adds the term when ``q_mean`` is set.
* **INT8 Q per token, K per half cube.** ``x8 = round(x * (1 / s))`` (round half to even,
  ``|x8| <= 127``; the reciprocal once per scale, IEEE, in both pre-passes) with ``s = amax
  |x| / 127`` over each query token's channels, and over each ``K_SCALE_GROUP``-token half of a
  key cube (its real tokens, every channel; the kernels' 32-key halves): ``S_ij = sq_i sk_j
  (q8_i · k8_j)`` exactly in int32 (128 products of at most 127^2 stay below 2^24, so fp32
  holds the sum exactly too). ``k_scale`` stays one value per token (equal within a half), so
  any kernel may read it per key; the CUDA kernel reads one a half and multiplies it into the
  row's scale, not into every score (session 21: relative L1 0.0123 / 0.0136 against 0.0114 /
  0.0126 per token on the two default-workload captures, bench/NOTES.md).
* **V** (``"int8_fp8"``): smoothed by its sampled channel mean ``v̄`` (added back after the
  normalization: the softmax weights sum to 1), then e4m3 with one scale per channel, the
  sample's amax times ``V_HEADROOM`` (values past 448 saturate), stored transposed ``(B, H, D,
  S)`` so that P·V reads it K-major, as 8-bit wgmma requires of its B operand; or, with
  ``vt_tiles=True``, as 32-key tiles ``(B, H, S / 32, D, 32)`` whose bytes lie in the order of
  the kernel's shared-memory tile (32-byte swizzle: the 16-byte halves of rows ``d`` with
  ``d // 4`` odd swapped), so that one tile is ``D / 4`` rows of 128 bytes to copy
  (`vt_to_tiles`, `vt_natural`); or, with ``vt_slots=True``, natural but with the keys of each
  32-key half in the CUDA wgmma kernel's MMA slot order (`vt_to_slots`), so that its e4m3 P
  fragment is S's accumulator fragment with no data moved; or with both, tiles of the slotted
  V^T (what the CUDA kernel's ``kv_copies="bulk"`` copies, a tile a 4 KB bulk copy).
* **K tiles** (``k_tiles=True``, for the CUDA kernel's bulk copies): K8 as 32-key tiles ``(B,
  H, S / 32, 32, D)`` whose bytes lie in the order of the kernel's shared-memory tile (128-byte
  swizzle: the 16-byte chunk ``c`` of key ``r`` at ``c ^ (r % 8)``), a tile one 4 KB copy
  (`k_to_tiles`, `k_natural`).
* **P** (``"int8_fp8"``): ``p = exp2(s - m)`` of the online softmax is in ``[0, 1]``; P·V takes
  ``e4m3(p * P_SCALE)`` and divides by ``P_SCALE`` afterwards; the row sum ``l`` is of the fp32
  ``p``. Each tile's P·V goes into an fp32 accumulator (Hopper's 8-bit MMA accumulates at
  reduced precision inside one instruction, so tiles are summed outside it).
  With ``p_exp="linear"`` (the CUDA kernel's knob of that name) P's e4m3 code comes straight
  from the exponent in eighths, ``code = round(8 s - sc + 126)`` clamped to ``0..126`` with the
  row's shift ``sc = ceil(8 m)`` (an integer), so the code's mantissa is linear in the
  exponent's fraction (``2^f`` read as ``1 + f``, at most 6% high); ``l`` sums those same e4m3
  values, so o keeps its accuracy (bench/NOTES.md, session 32), and lse takes out their mean
  overestimate, `LINEAR_P_BIAS`. No exponential is computed a score.
* ``"int8"`` keeps V in bf16 and rounds P to bf16, as the bf16 kernels do.

`quantize` runs the pre-pass (two Triton launches on a GPU, no host sync; the same arithmetic in
PyTorch on a CPU, since Triton 3.6's interpreter rounds fp8 casts wrongly; with ``norm_rope`` it
takes Wan's q and k projections and applies their norm and rotation as it reads them),
`emulate` computes block-sparse attention with exactly this arithmetic in fp32, tile by tile in
LUT order with the online softmax the kernels use. The rule itself is
`tilegen.captures.quant_score`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from tilegen.prologue import NormRope, norm_rope, rms_rsqrt_triton
from tilegen.spec import QUANT_MODES  # "none", "int8" (INT8 Q·K, bf16 P·V), "int8_fp8"

__all__ = ["QUANT_MODES", "QuantizedInputs", "quantize", "quantize_torch", "quantize_triton",
           "emulate", "QuantReference", "quant_reference", "vt_to_tiles", "vt_natural",
           "k_to_tiles", "k_natural", "k8_shape",
           "vt_slot_keys", "vt_to_slots", "E4M3_MAX", "INT8_MAX", "P_SCALE", "V_HEADROOM",
           "SAMPLE_CUBES", "K_SCALE_GROUP"]

#: largest finite e4m3fn value (a property of the format, not of any device)
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
INT8_MAX = 127.0
#: P in [0, 1] is stored as P x P_SCALE in e4m3 (the top of its range)
P_SCALE = E4M3_MAX
#: how P's e4m3 code is formed (`emulate`; the CUDA kernel's knob ``p_exp``): "ex2" rounds
#: ``exp2(s - m) * P_SCALE``, "linear" takes the exponent in eighths as the code
P_EXPS = ("ex2", "linear")
#: the code of e4m3 448 (0x7e), the top of a "linear" P: ``2^(126 / 8 - 7) (1 + 6 / 8)``
LINEAR_TOP_CODE = 126


def _linear_p_bias() -> float:
    """log2 of the mean of ``e4m3(code) / 2^(code / 8 - 7)`` over a uniform fraction: how
    much a "linear" P's row sum overestimates its exponentials' on average (lse takes it out)."""
    z = torch.arange(0, 8, 2 ** -16, dtype=torch.float64)
    return math.log2(float(((1 + torch.round(z) / 8) / torch.exp2(z / 8)).mean()))


#: `_linear_p_bias`, as the CUDA kernel's softmax_8bit.cuh holds it (kLinearBias)
LINEAR_P_BIAS = 0.0570815
#: V's per-channel scale = sampled amax x this / 448 (room above the sample's largest value)
V_HEADROOM = 8.0
#: cubes whose first token is the sample for K's and V's means and V's scales
SAMPLE_CUBES = 16
#: key tokens that share one INT8 scale: a 32-key half of a cube (the 8-bit kernels' K box)
K_SCALE_GROUP = 32


@dataclass(frozen=True)
class QuantizedInputs:
    """What the 8-bit kernels read (on q's device). Padded rows hold zeros and scale 0. q8 and
    q_scale are None from ``quantize(..., with_q=False)`` (the op's kernel quantizes Q)."""

    mode: str
    q8: torch.Tensor | None       # (B, S, H, D) int8: q / q_scale (q - q̄_c with q_smooth)
    q_scale: torch.Tensor | None  # (B, H, S) fp32
    k8: torch.Tensor        # (B, S, H, D) int8: (k - k̄) / k_scale; tiled with k_tiles
    k_scale: torch.Tensor   # (B, H, S) fp32, equal within each group of k_scale_group keys
    k_mean: torch.Tensor    # (B, H, D) fp32: k̄ (a sampled mean)
    v8t: torch.Tensor | None    # int8_fp8: (B, H, D, S) e4m3, (v - v̄) / v_scale, transposed
    v_scale: torch.Tensor | None  # int8_fp8: (B, H, D) fp32
    v_mean: torch.Tensor | None   # int8_fp8: (B, H, D) fp32: v̄ (sampled), added back to o
    q_mean: torch.Tensor | None = None  # q_smooth only: (B, H, NQ, D) fp32, q̄_c of real rows
    #: v8t as 32-key tiles (B, H, S / 32, D, 32) in shared-memory order (`vt_to_tiles`)
    vt_tiles: bool = False
    #: v8t (B, H, D, S) with each 32-key half's keys in MMA slot order (`vt_to_slots`); with
    #: vt_tiles too, the tiles of that V^T
    vt_slots: bool = False
    #: keys that share one K scale: the pre-pass's `K_SCALE_GROUP`; 1 (one a key) for inputs
    #: made another way, which the CUDA kernel refuses (it reads one scale a 32-key half)
    k_scale_group: int = 1
    #: ``quantize(..., pool=True)``: (B, H, NC, D) fp32 cube means of q and of k over their real
    #: tokens, from the same read (`sparsity.pool_cubes`' values up to fp32 summation order)
    q_pool: torch.Tensor | None = None
    k_pool: torch.Tensor | None = None
    #: k8 as 32-key tiles (B, H, S / 32, 32, D) in shared-memory order (`k_to_tiles`)
    k_tiles: bool = False


#: keys a V^T tile holds (the kernels' half tile: 8-bit TMA boxes of V^T are 32 keys wide)
VT_TILE = 32


def _swizzle(x: torch.Tensor) -> torch.Tensor:
    """The NVMMA shared-memory swizzle of rows as wide as the swizzle (32 or 128 bytes), over the
    last two dims (rows, width): the 16-byte chunk c of row r goes to chunk c ^ ((r width / 128)
    mod (width / 16)), i.e. the halves of the 32-byte rows r with r // 4 odd swapped, or chunk
    c ^ (r % 8) of 128-byte rows. Its own inverse."""
    rows, width = x.shape[-2:]
    r = torch.arange(rows, device=x.device).view(rows, 1)
    chunk = torch.arange(width // 16, device=x.device).view(1, -1) ^ (r * width // 128
                                                                       % (width // 16))
    chunks = x.unflatten(-1, (width // 16, 16))
    index = chunk.view(rows, -1, 1).expand(rows, -1, 16).expand(chunks.shape)
    return chunks.gather(-2, index).flatten(-2)


def k_to_tiles(k8: torch.Tensor) -> torch.Tensor:
    """(B, S, H, 128) K8 as (B, H, S / 32, 32, 128) tiles in shared-memory byte order."""
    B, S, H, D = k8.shape
    if D != 128:
        raise ValueError(f"K tiles are 128-byte swizzled rows: head_dim 128, not {D}")
    tiles = k8.view(B, S // VT_TILE, VT_TILE, H, D).permute(0, 3, 1, 2, 4)
    return _swizzle(tiles.view(torch.uint8)).contiguous().view(k8.dtype)


def k8_shape(qi: QuantizedInputs) -> tuple[int, ...]:
    """qi's K8 shape as (B, S, H, D), whichever layout the pre-pass wrote."""
    if not qi.k_tiles:
        return tuple(qi.k8.shape)
    B, H, n, w, D = qi.k8.shape
    return (B, n * w, H, D)


def k_natural(qi: QuantizedInputs) -> torch.Tensor:
    """qi's K8 as (B, S, H, D), whichever layout the pre-pass wrote."""
    if not qi.k_tiles:
        return qi.k8
    B, H, n, w, D = qi.k8.shape
    tiles = _swizzle(qi.k8.view(torch.uint8)).view(qi.k8.dtype)
    return tiles.permute(0, 2, 3, 1, 4).reshape(B, n * w, H, D)


def vt_to_tiles(v8t: torch.Tensor) -> torch.Tensor:
    """(B, H, D, S) V^T as (B, H, S / 32, D, 32) tiles in shared-memory byte order."""
    B, H, D, S = v8t.shape
    tiles = v8t.view(torch.uint8).view(B, H, D, S // VT_TILE, VT_TILE).permute(0, 1, 3, 2, 4)
    return _swizzle(tiles).contiguous().view(v8t.dtype)


def vt_slot_keys() -> list[int]:
    """The key of a 32-key half that the CUDA wgmma kernel's P.V reads at MMA slot kk
    (`AttentionMma8::key_of_slot` in templates/cuda/include/tilegen/cuda/sm90/wgmma.cuh): wgmma's
    8-bit A fragment gives a thread slots 4 (lane % 4) + 0..3 and 16 + 4 (lane % 4) + 0..3, S's
    accumulator gives it keys 8 g + 2 (lane % 4) + 0..1."""
    return [8 * (2 * (kk // 16) + (kk % 4) // 2) + 2 * ((kk % 16) // 4) + kk % 2
            for kk in range(VT_TILE)]


def vt_to_slots(v8t: torch.Tensor) -> torch.Tensor:
    """(B, H, D, S) V^T with the keys of each 32-key half in MMA slot order."""
    B, H, D, S = v8t.shape
    keys = torch.tensor(vt_slot_keys(), device=v8t.device)
    halves = v8t.view(torch.uint8).view(B, H, D, S // VT_TILE, VT_TILE)
    return halves.index_select(-1, keys).view(B, H, D, S).view(v8t.dtype)


def vt_natural(qi: QuantizedInputs) -> torch.Tensor | None:
    """qi's V^T as (B, H, D, S), whichever layout the pre-pass wrote."""
    v8t = qi.v8t
    if v8t is None:
        return None
    if qi.vt_tiles:
        B, H, n, D, w = v8t.shape
        tiles = _swizzle(v8t.view(torch.uint8))
        v8t = tiles.permute(0, 1, 3, 2, 4).reshape(B, H, D, n * w).view(v8t.dtype)
    if qi.vt_slots:
        B, H, D, S = v8t.shape
        slots = torch.argsort(torch.tensor(vt_slot_keys(), device=v8t.device))
        halves = v8t.view(torch.uint8).view(B, H, D, S // VT_TILE, VT_TILE)
        v8t = halves.index_select(-1, slots).view(B, H, D, S).view(v8t.dtype)
    return v8t


def _check_mode(mode: str) -> str:
    if mode not in QUANT_MODES[1:]:
        raise ValueError(f"quant mode {mode!r} is not allowed here; allowed values: "
                         f"{list(QUANT_MODES[1:])}")
    return mode


def sample_cubes(nkv: int) -> list[int]:
    """The cubes whose first token samples K's and V's statistics: SAMPLE_CUBES spread evenly
    (all of them when there are fewer)."""
    n = min(SAMPLE_CUBES, nkv)
    return [i * nkv // n for i in range(n)]


# -- the pre-pass: PyTorch (CPU, and the model) --------------------------------------------------
def _check_sources(sources: torch.Tensor | None, in_len: int, block: int,
                   device: torch.device) -> int:
    """The cube-major length the pre-pass writes: ``in_len`` without ``sources``, else the
    length of ``sources`` (a 1-D int tensor on the inputs' device, whole cubes of ``block``
    slots). No value check here (it would sync): `tilegen.layout.cube_sources` makes them."""
    if sources is None:
        return in_len
    if not isinstance(sources, torch.Tensor) or sources.dim() != 1 \
            or sources.dtype not in (torch.int32, torch.int64) or sources.numel() % block:
        raise ValueError(f"sources must be a 1-D int32/int64 tensor of whole {block}-slot "
                         "cubes (tilegen.layout.cube_sources(grid, cube))")
    if sources.device != device:
        raise ValueError(f"sources is on {sources.device}, the inputs on {device}")
    return sources.numel()


def _round_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # x times the IEEE reciprocal of its scale: one division per token, the kernel's arithmetic
    inv = 1.0 / torch.where(scale > 0, scale, 1.0)
    return torch.round(x * inv).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def quantize_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vbs: torch.Tensor,
                   mode: str = "int8_fp8", block: int = 64, *, q_smooth: bool = False,
                   v_smooth: bool = True, vt_tiles: bool = False,
                   sources: torch.Tensor | None = None, pool: bool = False,
                   norm_rope: NormRope | None = None) -> QuantizedInputs:
    """The pre-pass's arithmetic in PyTorch (fp32), for any device. ``q_smooth=True`` and
    ``v_smooth=False`` are the recipe's ablations (`bench/experiments/int8_recipe.py`); the
    defaults are what the kernels read. ``sources``: inputs in token order; ``pool``: the
    cube means of q and k too; ``norm_rope``: q and k are projections, put through the
    prologue first (`quantize`)."""
    _check_mode(mode)
    if norm_rope is not None:
        norm_rope.check(q, k)
        q, k = norm_rope.apply_torch(q, k)
    if sources is not None:
        _check_sources(sources, q.shape[1], block, q.device)
        q, k, v = (t.index_select(1, sources.to(t.device).long()) for t in (q, k, v))
    B, S, H, D = q.shape
    n = S // block
    real = (torch.arange(block, device=q.device)[None, :] < vbs.to(q.device)[:, None].long())
    real = real.reshape(1, n, block, 1, 1)
    samples = torch.tensor(sample_cubes(n), device=q.device) * block

    def first_tokens_mean(x):                         # (B, H, D)
        return x.float()[:, samples].mean(1)

    k_mean = first_tokens_mean(k)
    qf = q.float().view(B, n, block, H, D)
    q_mean = None
    if q_smooth:
        q_mean = (torch.where(real, qf, 0.0).sum(2) / vbs.to(q.device).view(1, n, 1, 1).float())
        qf = qf - q_mean[:, :, None]
    qs = torch.where(real, qf, 0.0)
    ks = torch.where(real, k.float().view(B, n, block, H, D) - k_mean[:, None, None], 0.0)
    q_scale = qs.abs().amax(-1) / INT8_MAX             # (B, n, block, H)
    groups = ks.view(B, n, block // K_SCALE_GROUP, K_SCALE_GROUP, H, D)
    k_scale = (groups.abs().amax(dim=(3, 5), keepdim=True) / INT8_MAX).expand(
        -1, -1, -1, K_SCALE_GROUP, -1, -1).reshape(B, n, block, H)
    k_scale = torch.where(real[..., 0], k_scale, 0.0)  # padded keys: scale 0, as their rows
    q8 = _round_int8(qs, q_scale[..., None]).view(B, S, H, D)
    k8 = _round_int8(ks, k_scale[..., None]).view(B, S, H, D)

    def per_head(scale):                               # (B, n, block, H) -> (B, H, S)
        return scale.reshape(B, S, H).permute(0, 2, 1).contiguous()

    v8t = v_scale = v_mean = None
    if mode == "int8_fp8":
        vf = v.float()
        v_mean = first_tokens_mean(v) if v_smooth else torch.zeros_like(k_mean)
        centred = vf - v_mean[:, None]
        v_scale = (centred[:, samples].abs().amax(1) * (V_HEADROOM / E4M3_MAX)).clamp_min(1e-30)
        vq = torch.where(real.view(1, S, 1, 1), centred * (1.0 / v_scale)[:, None], 0.0)
        v8t = vq.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).permute(0, 2, 3, 1)
        v8t = v8t.contiguous()
        if vt_tiles:
            v8t = vt_to_tiles(v8t)
    pooled = {}
    if pool:
        from tilegen.sparsity import pool_cubes

        pooled = dict(q_pool=pool_cubes(q, vbs, block), k_pool=pool_cubes(k, vbs, block))
    return QuantizedInputs(mode, q8, per_head(q_scale), k8, per_head(k_scale), k_mean, v8t,
                           v_scale, v_mean,
                           None if q_mean is None else q_mean.permute(0, 2, 1, 3).contiguous(),
                           vt_tiles=vt_tiles and v8t is not None,
                           k_scale_group=K_SCALE_GROUP, **pooled)


# -- the pre-pass: Triton (GPU), the statistics, then one pass ------------------------------------
@triton.jit
def _clamp_int8(x):
    # the clamp before the rounding, not after: it rounds the product to fp32 first. Fed the
    # product straight, `x - floor(x)` below contracts into an FMA with the unrounded product,
    # and near-ties round the other way than torch.round(q * inv) (one int8 step in ~3.5e-4 of
    # the values, session 9; bench/NOTES.md)
    return tl.minimum(tl.maximum(x, -127.0), 127.0)


@triton.jit
def _round_half_even(x):
    # round half to even without libdevice (torch.round's rule): floor, then fix the ties
    f = tl.floor(x)
    d = x - f
    up = (d > 0.5) | ((d == 0.5) & ((f - 2.0 * tl.floor(f * 0.5)) != 0.0))
    return tl.where(up, f + 1.0, f)


@triton.jit
def _int8_per_token(x):
    """A tile's rows to int8 with one scale a row (amax / 127): the integer values (fp32) and
    the scales. One IEEE reciprocal per row (div_rn: Triton's `/` is div.full.f32, up to 2 ulp
    off), then a multiply: the PyTorch model's arithmetic, bit for bit."""
    scale = tl.max(tl.abs(x), 1) / 127.0
    inv = tl.div_rn(1.0, tl.where(scale > 0, scale, 1.0))
    return _round_half_even(_clamp_int8(x * inv[:, None])), scale


@triton.jit
def _int8_per_group(x, TOKENS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A tile's rows to int8 with one scale per GROUP rows (amax over the group's rows and
    channels / 127): the integer values (fp32) and each row's scale (its group's)."""
    g = tl.reshape(x, (TOKENS // GROUP, GROUP, HEAD_DIM))
    scale = tl.max(tl.max(tl.abs(g), 2), 1) / 127.0
    inv = tl.div_rn(1.0, tl.where(scale > 0, scale, 1.0))
    x8 = _round_half_even(_clamp_int8(g * inv[:, None, None]))
    rows = tl.reshape(tl.broadcast_to(scale[:, None], (TOKENS // GROUP, GROUP)), (TOKENS,))
    return tl.reshape(x8, (TOKENS, HEAD_DIM)), rows


@triton.jit
def _column_sums(x, TOKENS: tl.constexpr, PARTS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 LANE_ROWS: tl.constexpr):
    """A (TOKENS, HEAD_DIM) tile's column sums in PARTS pieces, (PARTS, HEAD_DIM): piece p sums
    rows with (row // LANE_ROWS) % PARTS == p. With PARTS the program's warps these are the
    rows one warp of the tile's load layout holds (LANE_ROWS rows of HEAD_DIM / 16 lanes x 16
    channels, the warps stacked along the rows: what Triton 3.6 picks for these loads), so no
    sum crosses warps (a whole-tile sum: 14 more barriers a program, session 22,
    bench/NOTES.md). Any PARTS gives the same sums up to fp32 order; only the speed assumes
    the layout."""
    g = tl.reshape(x, (TOKENS // (LANE_ROWS * PARTS), PARTS, LANE_ROWS, HEAD_DIM))
    return tl.sum(tl.sum(g, 2), 0)


@triton.jit
def _store_sums(SUMS, row, chunk, chunks, x, TOKENS: tl.constexpr, PARTS: tl.constexpr,
                HEAD_DIM: tl.constexpr, LANE_ROWS: tl.constexpr):
    """`_column_sums` of a chunk's tile at SUMS[row, chunk * PARTS:(chunk + 1) * PARTS]."""
    part = tl.arange(0, PARTS)
    d = tl.arange(0, HEAD_DIM)
    off = ((row * chunks + chunk) * PARTS + part)[:, None] * HEAD_DIM + d[None, :]
    tl.store(SUMS + off, _column_sums(x, TOKENS, PARTS, HEAD_DIM, LANE_ROWS))


@triton.jit
def _normed_rows(x, RSQRT, W, COS, SIN, norm_row, tok, h, HEAD_DIM: tl.constexpr):
    """Rows ``x`` of a projection (token ``tok`` of each, its norm scale at RSQRT[norm_row]) put
    through Wan's prologue (`prologue.norm_rope`): what `rms_norm_rope` would have written, as
    fp32."""
    d = tl.arange(0, HEAD_DIM)
    r = tl.load(RSQRT + norm_row)[:, None]
    col = tok[:, None] * HEAD_DIM + d[None, :]
    # w as whole rows too (a row's copy a token, from L1): a (D,) load broadcast converted
    # layouts through shared memory, 2 barriers a program (sm_90a)
    w = tl.load(W + h * HEAD_DIM + col % HEAD_DIM).to(tl.float32)
    c = tl.load(COS + col)
    sn = tl.load(SIN + col)
    return norm_rope(x.to(tl.float32), r, w, c, sn, x.shape[0], HEAD_DIM,
                     x.dtype).to(tl.float32)


@triton.jit
def _stats_kernel(K, V, SRC, KMEAN, VSCALE, VMEAN, RSQRT, KW, COS, SIN, batch, in_len,
                  num_heads, n_cubes, n_sample, GATHER: tl.constexpr, NORM_ROPE: tl.constexpr,
                  FP8_V: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK: tl.constexpr, SAMPLE: tl.constexpr, E4M3: tl.constexpr,
                  HEADROOM: tl.constexpr):
    """One program a (batch, head): k̄, and with FP8_V v̄ and V's channel scales, from the first
    token of n_sample cubes spread over the sequence; the pass's K and V programs read them
    (each computing them from the samples made the pass 15% slower: session 22,
    bench/NOTES.md)."""
    bh = tl.program_id(0).to(tl.int64)
    b = bh // num_heads
    h = bh % num_heads
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, SAMPLE)
    s_ok = s < n_sample
    s_tok = tl.where(s_ok, ((s * n_cubes) // n_sample) * BLOCK, 0)
    if GATHER:  # inputs in token order: each cube slot reads its source token (to_cubes' order)
        s_tok = tl.load(SRC + s_tok, mask=s_ok, other=0)
    s_off = ((b * in_len + s_tok) * num_heads + h)[:, None] * HEAD_DIM + d[None, :]
    k_smp = tl.load(K + s_off, mask=s_ok[:, None], other=0.0)
    if NORM_ROPE:  # K's projection: the sample through the prologue first
        k_smp = _normed_rows(k_smp, RSQRT, KW, COS, SIN, (batch + b) * in_len + s_tok, s_tok, h,
                             HEAD_DIM)
    k_smp = tl.where(s_ok[:, None], k_smp.to(tl.float32), 0.0)
    tl.store(KMEAN + bh * HEAD_DIM + d, tl.sum(k_smp, 0) / n_sample)
    if FP8_V:
        v_smp = tl.load(V + s_off, mask=s_ok[:, None], other=0.0).to(tl.float32)
        v_mean = tl.sum(v_smp, 0) / n_sample
        v_amax = tl.max(tl.where(s_ok[:, None], tl.abs(v_smp - v_mean[None, :]), 0.0), 0)
        tl.store(VSCALE + bh * HEAD_DIM + d, tl.maximum(v_amax * (HEADROOM / E4M3), 1e-30))
        tl.store(VMEAN + bh * HEAD_DIM + d, v_mean)


@triton.jit
def _quantize_kernel(Q, K, V, VBS, Q8, QSCALE, K8, KSCALE, KMEAN, V8T, VSCALE, VMEAN, SRC,
                     POOL_SUMS, RSQRT, QW, KW, COS, SIN, seq_len, in_len, num_heads,
                     batch_heads, FIRST_PART, HEADS: tl.constexpr, GATHER: tl.constexpr,
                     NORM_ROPE: tl.constexpr,
                     POOL: tl.constexpr, POOL_PARTS: tl.constexpr,
                     POOL_LANE_ROWS: tl.constexpr,
                     FP8_V: tl.constexpr, VT_TILES: tl.constexpr, VT_SLOTS: tl.constexpr,
                     K_TILES: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                     TOKENS: tl.constexpr, E4M3: tl.constexpr, K_GROUP: tl.constexpr):
    # a program quantizes TOKENS tokens of one cube and one tensor (axis 2: 0 Q, 1 K, 2 V):
    # with a whole cube of all three, 255 registers and spills left one or two programs an SM.
    # Axis 0 is (chunk, batch x head), the heads fastest: programs in flight together read and
    # write each token's heads side by side (whole BSHD rows), not one head's 256 bytes every
    # H x 256 (-3% on the H100, session 22, bench/NOTES.md). POOL: the Q and K programs also
    # write their tokens' fp32 sums over the real rows, POOL_PARTS a program (POOL_SUMS
    # (2, B*H, chunks * POOL_PARTS, D)), which `coarse_gpu.pool_from_sums` turns into the
    # selection's cube means: the pooling's read of q and k, done by this one. NORM_ROPE: q
    # and k are the projections, put through Wan's prologue here (`_normed_rows`), so the
    # normalized q and k are never written (RSQRT (2, B, in_len) the norm's scales). A program
    # takes HEADS neighbouring heads of its tokens in turn, so that what all heads read alike
    # (the rotary tables) can come from L1 after the first; measured, it changes nothing (the
    # fused pass 1.50-1.53 ms at 1-8 heads, H100, session 26, bench/NOTES.md)
    groups = batch_heads // HEADS
    chunk = tl.program_id(0) // groups
    part = tl.program_id(2) + FIRST_PART
    cube = chunk // (BLOCK // TOKENS)
    rows = (chunk % (BLOCK // TOKENS)) * TOKENS + tl.arange(0, TOKENS)
    for i in tl.range(0, HEADS):
        bh = (tl.program_id(0) % groups).to(tl.int64) * HEADS + i
        _quantize_head(Q, K, V, VBS, Q8, QSCALE, K8, KSCALE, KMEAN, V8T, VSCALE, VMEAN, SRC,
                       POOL_SUMS, RSQRT, QW, KW, COS, SIN, seq_len, in_len, num_heads,
                       batch_heads, bh, chunk, part, cube, rows, GATHER, NORM_ROPE, POOL,
                       POOL_PARTS, POOL_LANE_ROWS, FP8_V, VT_TILES, VT_SLOTS, K_TILES, HEAD_DIM,
                       BLOCK, TOKENS, E4M3, K_GROUP)


@triton.jit
def _quantize_head(Q, K, V, VBS, Q8, QSCALE, K8, KSCALE, KMEAN, V8T, VSCALE, VMEAN, SRC,
                   POOL_SUMS, RSQRT, QW, KW, COS, SIN, seq_len, in_len, num_heads, batch_heads,
                   bh, chunk, part, cube, rows, GATHER: tl.constexpr, NORM_ROPE: tl.constexpr,
                   POOL: tl.constexpr, POOL_PARTS: tl.constexpr, POOL_LANE_ROWS: tl.constexpr,
                   FP8_V: tl.constexpr, VT_TILES: tl.constexpr, VT_SLOTS: tl.constexpr,
                   K_TILES: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                   TOKENS: tl.constexpr, E4M3: tl.constexpr, K_GROUP: tl.constexpr):
    # `_quantize_kernel`'s work for one (batch, head) of its tokens
    b = bh // num_heads
    h = bh % num_heads
    d = tl.arange(0, HEAD_DIM)
    n_valid = tl.load(VBS + cube)
    valid = rows < n_valid
    tok = cube * BLOCK + rows
    off = ((b * seq_len + tok) * num_heads + h)[:, None] * HEAD_DIM + d[None, :]
    if GATHER:  # inputs in token order: each cube slot reads its source token (to_cubes' order)
        src = tl.load(SRC + tok)
    else:
        src = tok
    in_off = ((b * in_len + src) * num_heads + h)[:, None] * HEAD_DIM + d[None, :]
    if part == 0:
        # Q: per-token int8 (no smoothing: the module docstring)
        q = tl.load(Q + in_off)
        if NORM_ROPE:
            q = _normed_rows(q, RSQRT, QW, COS, SIN, b * in_len + src, src, h, HEAD_DIM)
        q = tl.where(valid[:, None], q.to(tl.float32), 0.0)
        q8, q_scale = _int8_per_token(q)
        if POOL:
            _store_sums(POOL_SUMS, bh, chunk, seq_len // TOKENS, q, TOKENS, POOL_PARTS, HEAD_DIM,
                        POOL_LANE_ROWS)
        tl.store(Q8 + off, q8.to(tl.int8))
        tl.store(QSCALE + bh * seq_len + tok, q_scale)
    elif part == 1:
        # K: smoothed by the sampled mean `_stats_kernel` wrote, per-token int8
        k_mean = tl.load(KMEAN + bh * HEAD_DIM + d)
        k = tl.load(K + in_off)
        if NORM_ROPE:
            k = _normed_rows(k, RSQRT, KW, COS, SIN, (batch_heads // num_heads + b) * in_len
                             + src, src, h, HEAD_DIM)
        k = k.to(tl.float32)
        if POOL:
            _store_sums(POOL_SUMS, batch_heads + bh, chunk, seq_len // TOKENS,
                        tl.where(valid[:, None], k, 0.0), TOKENS, POOL_PARTS, HEAD_DIM,
                        POOL_LANE_ROWS)
        k8, k_scale = _int8_per_group(tl.where(valid[:, None], k - k_mean[None, :], 0.0),
                                      TOKENS, K_GROUP, HEAD_DIM)
        if K_TILES:  # (B, H, S / 32, 32, D), 16-byte chunks swizzled (k_to_tiles)
            k_chunk = (d // 16)[None, :] ^ (tok % 8)[:, None]
            k_off = (bh * seq_len + tok)[:, None] * HEAD_DIM + k_chunk * 16 + (d % 16)[None, :]
        else:
            k_off = off
        tl.store(K8 + k_off, k8.to(tl.int8))
        tl.store(KSCALE + bh * seq_len + tok, tl.where(valid, k_scale, 0.0))
    elif FP8_V:
        v_mean = tl.load(VMEAN + bh * HEAD_DIM + d)
        v_inv = tl.div_rn(1.0, tl.load(VSCALE + bh * HEAD_DIM + d))
        v = (tl.load(V + in_off).to(tl.float32) - v_mean[None, :]) * v_inv[None, :]
        v = tl.minimum(tl.maximum(tl.where(valid[:, None], v, 0.0), -E4M3), E4M3)
        if VT_SLOTS:
            # each key at its MMA slot (vt_slot_keys): key bits (k3 k2 k1 k0) of each 16 go to
            # slot bits (k2 k1 k3 k0). Permuted in registers so that the store stays runs of
            # contiguous keys (a computed column made it byte stores: 4.06 ms against 0.80,
            # session 19); row i of v is then slot tok[i]'s key
            v = tl.reshape(v, (TOKENS // 16, 2, 2, 2, 2, HEAD_DIM))
            v = tl.reshape(tl.permute(v, (0, 2, 3, 1, 4, 5)), (TOKENS, HEAD_DIM))
        if VT_TILES:  # (B, H, S / 32, D, 32), 16-byte halves swizzled (vt_to_tiles)
            key = tok % 32
            half = (key // 16) ^ ((d // 4) % 2)[:, None]
            vt_off = ((bh * (seq_len // 32) + tok // 32)[None, :] * HEAD_DIM + d[:, None]) * 32 \
                + half * 16 + (key % 16)[None, :]
        else:  # (B, H, D, S): the transposed tile, so that a warp writes runs of keys
            vt_off = (bh * HEAD_DIM + d)[:, None] * seq_len + tok[None, :]
        tl.store(V8T + vt_off, tl.trans(v).to(tl.float8e4nv))


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vbs: torch.Tensor,
             mode: str = "int8_fp8", block: int = 64, *, with_q: bool = True,
             vt_tiles: bool = False, vt_slots: bool = False, k_tiles: bool = False,
             sources: torch.Tensor | None = None, pool: bool = False,
             norm_rope: NormRope | None = None) -> QuantizedInputs:
    """The pre-pass: Q, K (and V for ``"int8_fp8"``) quantized by the recipe (module
    docstring). On a GPU two Triton launches (one more with ``pool``, one with
    ``norm_rope``), no host sync; on a CPU `quantize_torch`.
    ``with_q=False`` leaves Q out on the GPU (q8 and q_scale None: the op's kernel quantizes
    each query cube itself). ``vt_tiles``: V^T as 32-key tiles in shared-memory order;
    ``vt_slots``: V^T's keys in MMA slot order, in the same pass; both: tiles of that V^T;
    ``k_tiles``: K8 as 32-key tiles in shared-memory order (module docstring).
    ``sources``: q, k, v come in token order and cube slot ``i`` of the output reads token
    ``sources[i]`` (`tilegen.layout.cube_sources`): the reorder to cubes done by the same pass,
    the outputs cube-major as without it. ``pool``: also the cube means of q and k over their
    real tokens (``q_pool``, ``k_pool``: what `sparsity.mean_pool_topk` scores), from the
    pass's own read of q and k (a third launch turns its sums into means); needs ``with_q``.
    ``norm_rope`` (`tilegen.prologue.NormRope`): q and k ``(B, S, H, D)`` are the projections
    before Wan's RMSNorm across heads and rotary embedding, which the pass applies as it reads
    them, with `rms_norm_rope`'s arithmetic bit for bit (a launch first computes the norm's
    scales, `prologue.rms_rsqrt`): the outputs are those of ``quantize(*rms_norm_rope(q, k,
    ...), v, ...)`` without the normalized q and k ever written."""
    import dataclasses

    _check_mode(mode)
    if vt_slots and mode != "int8_fp8":
        raise ValueError("vt_slots orders the e4m3 V^T of int8_fp8: not for mode 'int8'")
    if k_tiles and q.shape[-1] != 128:
        raise ValueError(f"k_tiles: K tiles are 128-byte swizzled rows, head_dim 128, not "
                         f"{q.shape[-1]}")
    if q.device.type == "cpu":
        if pool and not with_q:
            raise ValueError("pool=True pools q as the pass reads it: not with with_q=False")
        qi = quantize_torch(q, k, v, vbs, mode, block, vt_tiles=vt_tiles and not vt_slots,
                            sources=sources, pool=pool, norm_rope=norm_rope)
        if vt_slots:
            v8t = vt_to_slots(qi.v8t)
            qi = dataclasses.replace(qi, v8t=vt_to_tiles(v8t) if vt_tiles else v8t,
                                     vt_slots=True, vt_tiles=vt_tiles)
        if k_tiles:
            qi = dataclasses.replace(qi, k8=k_to_tiles(qi.k8), k_tiles=True)
        return qi
    return quantize_triton(q, k, v, vbs, mode, block, with_q=with_q, vt_tiles=vt_tiles,
                           vt_slots=vt_slots, k_tiles=k_tiles, sources=sources, pool=pool,
                           norm_rope=norm_rope)


def quantize_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vbs: torch.Tensor,
                    mode: str = "int8_fp8", block: int = 64, *,
                    num_warps: int = 2, tokens: int = 32, with_q: bool = True,
                    vt_tiles: bool = False, vt_slots: bool = False, k_tiles: bool = False,
                    sources: torch.Tensor | None = None, pool: bool = False,
                    norm_rope: NormRope | None = None,
                    heads_per_program: int | None = None) -> QuantizedInputs:
    """The Triton pre-pass (what `quantize` runs on a GPU; the tests run it under the
    interpreter on CPU tensors); ``tokens`` a program: a power of two from 32 (K's scale
    group) to ``block``.
    The defaults are the H200's fastest (bench/NOTES.md, session 15: K and V in 0.51 ms at the
    default workload against 0.59 for a whole cube on 4 warps). ``vt_slots``: V^T's keys
    written at their MMA slots (`vt_to_slots`), in the same pass (with ``vt_tiles``, as
    tiles); ``k_tiles``: K8 as tiles (`k_to_tiles`), in the same pass. Two launches: the sampled
    statistics (`_stats_kernel`, one program a head), then the pass; with ``pool`` a third,
    `coarse_gpu.pool_from_sums` of the sums the pass's Q and K programs write; with
    ``norm_rope`` one before them, `prologue.rms_rsqrt`. ``heads_per_program``: neighbouring
    heads a program takes in turn (a divisor of H); by default 1, and with ``norm_rope``
    the largest of 8, 4, 2 that divides H, so that the rotary tables (the same rows for every
    head) can come from L1 after a program's first head. Measured on an H100 (session 26,
    bench/NOTES.md), the fused pass with its scales takes 1.50-1.53 ms at 1-8 heads a program
    against 1.29 for `prologue.rms_norm_rope` and the plain pass: the prologue's arithmetic in
    this latency-bound pass costs more than the 670 MB of writes it saves."""
    _check_mode(mode)
    if vt_slots and mode != "int8_fp8":
        raise ValueError("vt_slots orders the e4m3 V^T of int8_fp8: not for mode 'int8'")
    if pool and not with_q:
        raise ValueError("pool=True pools q as the pass reads it: not with with_q=False")
    if vt_tiles and tokens < VT_TILE:
        raise ValueError(f"vt_tiles: tokens={tokens} must cover a {VT_TILE}-key tile")
    if tokens & (tokens - 1) or block % tokens or tokens < K_SCALE_GROUP:
        raise ValueError(f"tokens={tokens}: a power of two from {K_SCALE_GROUP} (K's scale "
                         f"group) that divides the cube ({block})")
    B, S_in, H, D = q.shape
    S = _check_sources(sources, S_in, block, q.device)
    if D & (D - 1):
        raise ValueError(f"head_dim {D}: the pre-pass kernel takes a power-of-two head dim")
    if k_tiles and D != 128:
        raise ValueError(f"k_tiles: K tiles are 128-byte swizzled rows, head_dim 128, not {D}")
    n = S // block
    if heads_per_program is None:
        heads_per_program = next(g for g in (8, 4, 2, 1) if H % g == 0) if norm_rope else 1
    if heads_per_program < 1 or H % heads_per_program:
        raise ValueError(f"heads_per_program={heads_per_program} must divide the {H} heads")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    dev = q.device
    if norm_rope is not None:
        norm_rope.check(q, k)
        rsqrt = rms_rsqrt_triton(q, k, float(norm_rope.q_eps), float(norm_rope.k_eps))
        prologue_args = (rsqrt, norm_rope.q_weight, norm_rope.k_weight, norm_rope.cos,
                         norm_rope.sin)
    else:  # never read: q stands in for the pointers
        prologue_args = (q,) * 5
    f32 = dict(dtype=torch.float32, device=dev)
    k8 = torch.empty((B, H, S // VT_TILE, VT_TILE, D) if k_tiles else (B, S, H, D),
                     dtype=torch.int8, device=dev)
    k_scale = torch.empty((B, H, S), **f32)
    # without Q its part never runs: k8 and k_scale stand in for the pointers
    q8 = torch.empty((B, S, H, D), dtype=torch.int8, device=dev) if with_q else k8
    q_scale = torch.empty_like(k_scale) if with_q else k_scale
    k_mean = torch.empty((B, H, D), **f32)
    fp8 = mode == "int8_fp8"
    vt_shape = (B, H, S // VT_TILE, D, VT_TILE) if vt_tiles else (B, H, D, S)
    v8t = torch.empty(vt_shape, dtype=torch.float8_e4m3fn, device=dev) if fp8 else None
    v_scale = torch.empty((B, H, D), **f32) if fp8 else None
    v_mean = torch.empty((B, H, D), **f32) if fp8 else None
    n_sample = len(sample_cubes(n))
    parts = (3 if fp8 else 2) - (0 if with_q else 1)  # program axis 2: Q, K, V from FIRST_PART
    chunks = n * block // tokens
    src = vbs if sources is None else sources
    # the Q and K programs' sums, one a warp where the tile's rows allow (`_column_sums`):
    # (2, B * H, chunks * parts, D); k_scale stands in without pool
    lane_rows = max(1, 512 // D)  # a warp's rows of the load layout: 16 channels a lane
    pool_parts = num_warps
    while pool_parts > 1 and tokens % (lane_rows * pool_parts):
        pool_parts //= 2
    pool_sums = torch.empty((2, B * H, chunks * pool_parts, D), **f32) if pool else k_scale
    # without fp8 V its statistics are not written: k_mean stands in for the pointers
    _stats_kernel[(B * H,)](
        k, v, src, k_mean, v_scale if fp8 else k_mean, v_mean if fp8 else k_mean,
        *prologue_args[:1], *prologue_args[2:], B, S_in, H, n, n_sample,
        GATHER=sources is not None, NORM_ROPE=norm_rope is not None, FP8_V=fp8, HEAD_DIM=D,
        BLOCK=block,
        SAMPLE=triton.next_power_of_2(SAMPLE_CUBES), E4M3=E4M3_MAX, HEADROOM=V_HEADROOM,
        num_warps=num_warps)
    _quantize_kernel[(chunks * B * H // heads_per_program, 1, parts)](
        q, k, v, vbs, q8, q_scale, k8, k_scale, k_mean,
        v8t if fp8 else q8, v_scale if fp8 else q_scale, v_mean if fp8 else q_scale, src,
        pool_sums, *prologue_args, S, S_in, H, B * H, 0 if with_q else 1,
        HEADS=heads_per_program, GATHER=sources is not None, NORM_ROPE=norm_rope is not None,
        POOL=pool, POOL_PARTS=pool_parts, POOL_LANE_ROWS=min(lane_rows, tokens),
        FP8_V=fp8, VT_TILES=vt_tiles, VT_SLOTS=vt_slots, K_TILES=k_tiles, HEAD_DIM=D,
        BLOCK=block, TOKENS=tokens, E4M3=E4M3_MAX, K_GROUP=K_SCALE_GROUP, num_warps=num_warps)
    tiles, slots = vt_tiles and fp8, vt_slots and fp8
    pooled = {}
    if pool:
        from tilegen.coarse_gpu import pool_from_sums

        means = pool_from_sums(pool_sums.view(2 * B * H, chunks * pool_parts, D), vbs, q.dtype,
                               block)
        pooled = dict(q_pool=means[:B * H].view(B, H, n, D), k_pool=means[B * H:].view(B, H, n, D))
    if not with_q:
        return QuantizedInputs(mode, None, None, k8, k_scale, k_mean, v8t, v_scale, v_mean,
                               vt_tiles=tiles, vt_slots=slots, k_scale_group=K_SCALE_GROUP,
                               k_tiles=k_tiles)
    return QuantizedInputs(mode, q8, q_scale, k8, k_scale, k_mean, v8t, v_scale, v_mean,
                           vt_tiles=tiles, vt_slots=slots, k_scale_group=K_SCALE_GROUP,
                           k_tiles=k_tiles, **pooled)


# -- the emulation --------------------------------------------------------------------------------
def emulate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topk_idx: torch.Tensor,
            vbs: torch.Tensor, counts: torch.Tensor | None = None, *, mode: str = "int8_fp8",
            sm_scale: float | None = None, block: int = 64,
            quantized: QuantizedInputs | None = None, l_from_p8: bool = False,
            p_exp: str = "ex2") -> torch.Tensor:
    """Block-sparse attention with exactly the recipe's quantization, in fp32 (BSHD, cube-major
    padded; padded query rows come out zero, as the reference's do). Tile by tile in LUT order
    with the kernels' online softmax (base 2), so each rounding happens where a kernel's does.
    ``quantized``: the pre-pass's output to use (default: `quantize_torch` of q, k, v).
    ``l_from_p8`` (``"int8_fp8"``, an ablation: `bench/experiments/int8_recipe_variants.py`):
    the row sum adds the e4m3 P that P.V multiplies instead of the fp32 p. ``p_exp``
    (``"int8_fp8"``): how P's e4m3 code is formed (`P_EXPS`; "linear" sums the codes' values,
    as the kernel's MMA row sum does). Returns o in fp32."""
    _check_mode(mode)
    if p_exp not in P_EXPS or (p_exp != "ex2" and mode != "int8_fp8"):
        raise ValueError(f"p_exp={p_exp!r}: one of {list(P_EXPS)}, and 'linear' forms the e4m3 "
                         f"P of mode 'int8_fp8'")
    if quantized is not None and quantized.mode != mode:
        raise ValueError(f"quantized holds a {quantized.mode!r} pre-pass, mode is {mode!r}")
    B, S, H, D = q.shape
    n = S // block
    scale = (sm_scale if sm_scale is not None else D ** -0.5) * math.log2(math.e)
    qi = quantized if quantized is not None else quantize_torch(q.cpu(), k.cpu(), v.cpu(),
                                                                vbs.cpu(), mode, block)
    vbs = vbs.cpu().long()
    v8t = vt_natural(qi)
    k8_all = k_natural(qi)
    idx = topk_idx.cpu().long()
    width = idx.shape[-1]
    cnt = (torch.full((B, H, n), width) if counts is None else counts.cpu().long())
    keys = torch.arange(block)
    row_ok = (keys[None, :] < vbs[:, None])[..., None]                   # (n, block, 1)
    out = torch.zeros(B, S, H, D)
    for b in range(B):
        for h in range(H):
            q8 = qi.q8[b, :, h].cpu().float().view(n, block, D)
            sq = qi.q_scale[b, h].cpu().view(n, block)
            qm = None if qi.q_mean is None else qi.q_mean[b, h].cpu()     # (n, D)
            kd = (k8_all[b, :, h].cpu().float() * qi.k_scale[b, h].cpu()[:, None]).view(n, block, D)
            k8 = k8_all[b, :, h].cpu().float().view(n, block, D)
            sk = qi.k_scale[b, h].cpu().view(n, block)
            if mode == "int8_fp8":
                vt = v8t[b, h].cpu().float().T.reshape(n, block, D)       # e4m3 values
            else:
                vt = v[b, :, h].cpu().float().view(n, block, D)
            m = torch.full((n, block), -math.inf)
            sc = torch.zeros(n, block)                                    # "linear": ceil(8 m)
            l_sum = torch.zeros(n, block)
            acc = torch.zeros(n, block, D)
            for t in range(width):
                live = t < cnt[b, h]                                      # (n,)
                c = idx[b, h, :, t].clamp(0, n - 1)
                s_int = torch.bmm(q8, k8[c].transpose(1, 2))              # exact integer dots
                s = sq[:, :, None] * sk[c][:, None, :] * s_int
                if qm is not None:                                        # q̄_c . k_j, fp32
                    s = s + torch.bmm(qm[:, None, :], kd[c].transpose(1, 2))
                s = s * scale
                key_ok = (keys[None, :] < vbs[c][:, None]) & live[:, None]
                s = torch.where(key_ok[:, None, :], s, -math.inf)
                m_new = torch.maximum(m, s.amax(-1))
                m_safe = torch.where(torch.isfinite(m_new), m_new, 0.0)
                if p_exp == "linear":
                    sc_new = torch.ceil(8 * m_safe)
                    alpha = torch.exp2((sc - sc_new) / 8)
                    code = torch.round(8 * s + (LINEAR_TOP_CODE - sc_new)[..., None])
                    code = torch.where(torch.isfinite(s), code, 0.0).clamp(0, LINEAR_TOP_CODE)
                    p8 = code.to(torch.uint8).view(torch.float8_e4m3fn).float()
                    acc = acc * alpha[..., None] + torch.bmm(p8, vt[c])
                    l_sum = l_sum * alpha + p8.sum(-1)
                    m, sc = m_new, sc_new
                    continue
                alpha = torch.exp2(m - m_safe)
                p = torch.exp2(s - m_safe[..., None])
                p_sum = p.sum(-1)
                if mode == "int8_fp8":
                    p8 = (p * P_SCALE).to(torch.float8_e4m3fn).float()
                    pv = torch.bmm(p8, vt[c]) / P_SCALE
                    if l_from_p8:
                        p_sum = (p8 / P_SCALE).sum(-1)
                else:
                    pv = torch.bmm(p.to(torch.bfloat16).float(), vt[c])
                acc = acc * alpha[..., None] + pv
                l_sum = l_sum * alpha + p_sum
                m = m_new
            o = acc / l_sum.clamp_min(1e-30)[..., None]
            if mode == "int8_fp8":
                # v̄ comes back with the weights (they sum to 1): not on a row without any key
                seen = (l_sum > 0)[..., None]
                o = o * qi.v_scale[b, h].cpu() + torch.where(seen, qi.v_mean[b, h].cpu(), 0.0)
            out[b, :, h] = torch.where(row_ok, o, 0.0).reshape(S, D)
    return out


# -- the gate: the quantized rule on a subset of heads -------------------------------------------
@dataclass(frozen=True)
class QuantReference:
    """What an 8-bit output is scored against on one capture (the bench's quant rows and the
    tuner's gate): on ``heads``, the fp32 oracle and the recipe's emulation fed the pre-pass's
    own output for those heads (the pre-pass works per head, so a subset quantizes as in the
    whole call). CPU tensors, BSHD."""

    mode: str
    heads: list[int]
    o_oracle: torch.Tensor
    o_emul: torch.Tensor
    vbs: torch.Tensor
    #: what another P recipe's emulation needs (`emulate`'s arguments on the heads, CPU), and
    #: those computed so far, by p_exp
    emulate_args: tuple = ()
    emulate_kwargs: dict = field(default_factory=dict)
    other_emul: dict = field(default_factory=dict, compare=False)

    def emulation(self, p_exp: str = "ex2") -> torch.Tensor:
        """The recipe's emulation with P formed as ``p_exp`` (`P_EXPS`), on the heads."""
        if p_exp == "ex2":
            return self.o_emul
        if p_exp not in self.other_emul:
            if not self.emulate_args:
                raise ValueError(f"this reference keeps no inputs to emulate p_exp={p_exp!r}")
            self.other_emul[p_exp] = emulate(*self.emulate_args, **self.emulate_kwargs,
                                             p_exp=p_exp)
        return self.other_emul[p_exp]

    def score(self, o: torch.Tensor, p_exp: str = "ex2"):
        """`tilegen.captures.quant_score` of the op's whole output ``o`` (BSHD) on the heads,
        check 4 against the emulation of the op's own P recipe (``p_exp``)."""
        from tilegen.captures import quant_score

        mine = o[:, :, self.heads].float().cpu()
        return quant_score(mine, self.o_oracle.to(o.dtype), self.emulation(p_exp),
                           self.o_oracle, vbs=self.vbs)


def quant_reference(mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    topk_idx: torch.Tensor, vbs: torch.Tensor, counts: torch.Tensor | None,
                    heads: list[int], *, sm_scale: float | None = None,
                    block: int = 64) -> QuantReference:
    """The `QuantReference` of one capture (BSHD q, k, v; the LUT and counts that compute its
    attention) on `heads`: the oracle on q's device, the pre-pass (`quantize`) there too, the
    emulation on the CPU."""
    from tilegen.reference import attention_fp32

    _check_mode(mode)
    sel = [int(h) for h in heads]
    q, k, v = (t[:, :, sel].contiguous() for t in (q, k, v))
    idx = topk_idx[:, sel].contiguous()
    cnt = None if counts is None else counts[:, sel].contiguous()
    o32, _ = attention_fp32(q, k, v, idx, vbs, cnt, block=block, sm_scale=sm_scale)
    qi = quantize(q, k, v, vbs, mode, block)
    qi_cpu = QuantizedInputs(**{f: (getattr(qi, f).cpu() if isinstance(getattr(qi, f),
                                                                       torch.Tensor)
                                    else getattr(qi, f)) for f in qi.__dataclass_fields__})
    args = (q.cpu(), k.cpu(), v.cpu(), idx.cpu(), vbs.cpu(), None if cnt is None else cnt.cpu())
    kwargs = dict(mode=mode, sm_scale=sm_scale, block=block, quantized=qi_cpu)
    return QuantReference(mode, sel, o32.cpu(), emulate(*args, **kwargs), vbs.cpu(), args,
                          kwargs)


def p_exp_of(op) -> str:
    """The P recipe an 8-bit op's kernel runs (its config's ``p_exp``, "ex2" by default and
    for kernels without the knob), for `QuantReference.score`."""
    cfg = getattr(op, "config", None) or getattr(op, "_config", None)
    return str(dict(getattr(cfg, "options", ()) or ()).get("p_exp", "ex2"))
