"""Cube reorder: row-major (t, h, w) token order <-> cube-major padded order.

VSA kernels tile the latent grid into 3D cubes (4x4x4 = 64 tokens, one kernel tile). Cube ids
run row-major over (cube_t, cube_h, cube_w). Inside a cube the real tokens come first, in
row-major (t, h, w) order over the cube's actual extent, then zero padding up to the cube volume.
Edge cubes are partial when a grid side is not a multiple of the cube side; ``vbs[c]`` counts the
real tokens of cube ``c``.

The reorder is one gather/scatter with an index computed once per (grid, cube) and cached
(`to_cubes(..., zero_padding=False)`: one gather, padded slots holding a real token).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch

__all__ = ["cube_grid", "vbs_for_grid", "cube_coords", "token_slots", "cube_sources", "slot_tokens",
           "to_cubes", "from_cubes"]

Triple = tuple[int, int, int]


def _triple(value: Sequence[int], name: str) -> Triple:
    """Validate and normalise a 3-tuple of positive ints (so it can key the caches)."""
    try:
        items = tuple(value)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of 3 ints, got {value!r}") from None
    if len(items) != 3:
        raise ValueError(f"{name} must have 3 entries (t, h, w), got {value!r}")
    out = []
    for v in items:
        if isinstance(v, bool):
            raise TypeError(f"{name} entries must be ints, got {value!r}")
        try:
            iv = int(v)  # accepts numpy ints and 0-dim integer tensors
        except (TypeError, ValueError):
            raise TypeError(f"{name} entries must be ints, got {value!r}") from None
        if iv != v:
            raise TypeError(f"{name} entries must be ints, got {value!r}")
        if iv < 1:
            raise ValueError(f"{name} entries must be >= 1, got {value!r}")
        out.append(iv)
    return out[0], out[1], out[2]


def cube_grid(grid: Sequence[int], cube: Sequence[int] = (4, 4, 4)) -> Triple:
    """Number of cubes along (t, h, w): ``ceil(grid / cube)`` per axis."""
    g, c = _triple(grid, "grid"), _triple(cube, "cube")
    return tuple(-(-gi // ci) for gi, ci in zip(g, c, strict=True))  # type: ignore[return-value]


def _extents(grid: Triple, cube: Triple, device: torch.device | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-axis actual cube extents (the last cube along an axis may be short)."""
    out = []
    for g, c in zip(grid, cube, strict=True):
        n = -(-g // c)
        starts = torch.arange(n, dtype=torch.int64, device=device) * c
        out.append(torch.clamp(g - starts, max=c))
    return out[0], out[1], out[2]


def _build_vbs(grid: Triple, cube: Triple, device: torch.device | None = None) -> torch.Tensor:
    et, eh, ew = _extents(grid, cube, device)
    vbs = et[:, None, None] * eh[None, :, None] * ew[None, None, :]
    return vbs.reshape(-1).to(torch.int32)


@functools.lru_cache(maxsize=32)
def _vbs_cpu(grid: Triple, cube: Triple) -> torch.Tensor:
    return _build_vbs(grid, cube)


def vbs_for_grid(
    grid: Sequence[int], cube: Sequence[int] = (4, 4, 4), device: torch.device | str | None = None
) -> torch.Tensor:
    """Real tokens per cube, ``(NC,)`` int32, cube ids row-major over (cube_t, cube_h, cube_w)."""
    g, c = _triple(grid, "grid"), _triple(cube, "cube")
    if device is None:
        return _vbs_cpu(g, c).clone()
    # a device-side copy of the cached vbs: no host-to-device copy (and so no sync) per call
    return _vbs_on(g, c, torch.device(device)).clone()


def _index_on(build: Callable[..., torch.Tensor], grid: Triple, cube: Triple,
              device: torch.device) -> torch.Tensor:
    """``build(grid, cube, device)``, an index tensor of the grid, on ``device``: built once per
    (grid, cube, device) and cached; traced by torch.compile, built on the device inside the
    graph instead (a cached tensor would be a host copy per call, and CUDA graphs cannot
    capture that). Callers that hand it out clone it."""
    if torch.compiler.is_compiling():
        return build(grid, cube, device)
    return _index_cached(build, grid, cube, device)


@functools.lru_cache(maxsize=128)
def _index_cached(build: Callable[..., torch.Tensor], grid: Triple, cube: Triple,
                  device: torch.device) -> torch.Tensor:
    return build(grid, cube).to(device)


def _vbs_on(grid: Triple, cube: Triple, device: torch.device) -> torch.Tensor:
    return _index_on(_build_vbs, grid, cube, device)


def cube_coords(
    grid: Sequence[int], cube: Sequence[int] = (4, 4, 4), device: torch.device | str | None = None
) -> torch.Tensor:
    """Centre of each cube's real tokens in token units, ``(NC, 3)`` float32 over (t, h, w).

    Useful for locality (e.g. "the k nearest cubes" of a sliding-window selection).
    """
    g, c = _triple(grid, "grid"), _triple(cube, "cube")
    axes = []
    for ext, ci in zip(_extents(g, c), c, strict=True):
        starts = torch.arange(ext.numel(), dtype=torch.float32) * ci
        axes.append(starts + (ext.to(torch.float32) - 1) / 2)
    ct, ch, cw = torch.meshgrid(*axes, indexing="ij")
    coords = torch.stack([ct.reshape(-1), ch.reshape(-1), cw.reshape(-1)], dim=1)
    return coords.to(device) if device is not None else coords


def _build_slots(grid: Triple, cube: Triple, device: torch.device | None = None) -> torch.Tensor:
    """For each token (row-major t, h, w) its slot in the cube-major padded sequence."""
    T, H, W = grid
    ct, ch, cw = cube
    _, eh, ew = _extents(grid, cube, device)
    nt, nh, nw = cube_grid(grid, cube)
    t = torch.arange(T, device=device).view(T, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1)
    w = torch.arange(W, device=device).view(1, 1, W)
    bt, bh, bw = t // ct, h // ch, w // cw
    lt, lh, lw = t % ct, h % ch, w % cw
    cube_id = (bt * nh + bh) * nw + bw
    # rank inside the cube: row-major over the cube's *actual* extent, so real tokens are packed
    # first and padding sits at the end of the cube.
    sh = eh[bh]
    sw = ew[bw]
    rank = lt * (sh * sw) + lh * sw + lw
    slots = cube_id * (ct * ch * cw) + rank
    return slots.reshape(-1).contiguous()


def _slots_on(grid: Triple, cube: Triple, device: torch.device) -> torch.Tensor:
    return _index_on(_build_slots, grid, cube, device)


def token_slots(
    grid: Sequence[int], cube: Sequence[int] = (4, 4, 4), device: torch.device | str | None = None
) -> torch.Tensor:
    """``(T*H*W,)`` int64: slot of each row-major token in the cube-major padded sequence."""
    g, c = _triple(grid, "grid"), _triple(cube, "cube")
    # a copy: the cached index serves every reorder
    return _slots_on(g, c, torch.device(device if device is not None else "cpu")).clone()


def _build_sources(grid: Triple, cube: Triple, device: torch.device | None = None
                   ) -> torch.Tensor:
    """For each slot of the cube-major padded sequence the token it holds: its own token, or
    for a padded slot the first token of its cube (always real)."""
    vol = cube[0] * cube[1] * cube[2]
    src, real = _slot_token_map(grid, cube, device)
    idx = torch.arange(src.numel(), device=device)
    return torch.where(real, src, src[idx - idx % vol])


def _slot_token_map(grid: Triple, cube: Triple, device: torch.device | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each slot's token (0 for a padded slot) and whether the slot is real."""
    vol = cube[0] * cube[1] * cube[2]
    slots = _build_slots(grid, cube, device)
    size = math.prod(cube_grid(grid, cube)) * vol
    tokens = torch.arange(slots.numel(), device=device)
    src = torch.zeros(size, dtype=torch.int64, device=device).scatter(0, slots, tokens)
    idx = torch.arange(size, device=device)
    real = (idx % vol) < _build_vbs(grid, cube, device).long().repeat_interleave(vol)
    return src, real


def _sources_on(grid: Triple, cube: Triple, device: torch.device) -> torch.Tensor:
    return _index_on(_build_sources, grid, cube, device)


def _build_slot_tokens(grid: Triple, cube: Triple, device: torch.device | None = None
                       ) -> torch.Tensor:
    src, real = _slot_token_map(grid, cube, device)
    return torch.where(real, src, -1).to(torch.int32)


def _slot_tokens_on(grid: Triple, cube: Triple, device: torch.device) -> torch.Tensor:
    return _index_on(_build_slot_tokens, grid, cube, device)


def slot_tokens(
    grid: Sequence[int], cube: Sequence[int] = (4, 4, 4), device: torch.device | str | None = None
) -> torch.Tensor:
    """``(NC * ct*ch*cw,)`` int32: the row-major token each slot of the cube-major padded
    sequence holds, -1 for a padded slot: where `from_cubes` takes each slot's row from. What
    the CUDA 8-bit kernel takes to write o in token order (``from_quantized(...,
    out_rows=...)``)."""
    g, c = _triple(grid, "grid"), _triple(cube, "cube")
    dev = torch.device(device if device is not None else "cpu")
    return _slot_tokens_on(g, c, dev) if torch.compiler.is_compiling() \
        else _slot_tokens_on(g, c, dev).clone()


def cube_sources(
    grid: Sequence[int], cube: Sequence[int] = (4, 4, 4), device: torch.device | str | None = None
) -> torch.Tensor:
    """``(NC * ct*ch*cw,)`` int64: the row-major token each slot of the cube-major padded
    sequence reads in ``to_cubes(x, grid, cube, zero_padding=False)`` (a padded slot: its
    cube's first token). What the 8-bit pre-pass takes to reorder while it quantizes
    (`tilegen.quant.quantize(..., sources=...)`)."""
    g, c = _triple(grid, "grid"), _triple(cube, "cube")
    dev = torch.device(device if device is not None else "cpu")
    return _sources_on(g, c, dev) if torch.compiler.is_compiling() \
        else _sources_on(g, c, dev).clone()


def to_cubes(
    x: torch.Tensor, grid: Sequence[int], cube: Sequence[int] = (4, 4, 4), *,
    zero_padding: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorder row-major tokens into cube-major padded order.

    Args:
        x: ``(B, T*H*W, ...)`` (typically ``(B, T*H*W, heads, D)``), tokens row-major over
            (t, h, w).
        grid: latent grid ``(T, H, W)``.
        cube: cube size ``(ct, ch, cw)``.
        zero_padding: padded slots hold zeros (a zero fill, then a scatter of the tokens). With
            False they hold a copy of their cube's first token instead, which the kernels'
            contract allows (padded slots may hold any finite values): one gather, no fill,
            about half the memory traffic.

    Returns:
        ``(xc, vbs)``: ``xc`` is ``(B, NC * ct*ch*cw, ...)``, ``vbs`` is the ``(NC,)`` int32
        count of real tokens per cube (on ``x``'s device).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    g, c = _triple(grid, "grid"), _triple(cube, "cube")
    n_tok = g[0] * g[1] * g[2]
    if x.dim() < 2 or x.shape[1] != n_tok:
        raise ValueError(
            f"x must be (B, T*H*W, ...) with T*H*W={n_tok} for grid={g}, got {tuple(x.shape)}"
        )
    if not zero_padding:
        return x.index_select(1, _sources_on(g, c, x.device)), vbs_for_grid(g, c, device=x.device)
    nt, nh, nw = cube_grid(g, c)
    size = nt * nh * nw * c[0] * c[1] * c[2]
    slots = _slots_on(g, c, x.device)
    xc = x.new_zeros((x.shape[0], size, *x.shape[2:]))
    xc.index_copy_(1, slots, x)
    return xc, vbs_for_grid(g, c, device=x.device)


def from_cubes(
    xc: torch.Tensor, grid: Sequence[int], cube: Sequence[int] = (4, 4, 4)
) -> torch.Tensor:
    """Inverse of :func:`to_cubes`: ``(B, NC*vol, ...)`` -> ``(B, T*H*W, ...)``; padding dropped."""
    if not isinstance(xc, torch.Tensor):
        raise TypeError(f"xc must be a torch.Tensor, got {type(xc).__name__}")
    g, c = _triple(grid, "grid"), _triple(cube, "cube")
    nt, nh, nw = cube_grid(g, c)
    size = nt * nh * nw * c[0] * c[1] * c[2]
    if xc.dim() < 2 or xc.shape[1] != size:
        raise ValueError(
            f"xc must be (B, NC*vol, ...) with NC*vol={size} for grid={g}, cube={c}, "
            f"got {tuple(xc.shape)}"
        )
    return xc.index_select(1, _slots_on(g, c, xc.device))


@functools.lru_cache(maxsize=32)
def packed_slot_sources(grids: tuple[tuple[int, int, int], ...], cube: tuple[int, int, int],
                        device: torch.device | str) -> torch.Tensor:
    """(total slots,) int32: the token of each cube slot of sequences packed one after another
    (each THW row-major, its cubes after the previous sequence's), -1 for a padding slot. The
    gather that reorders packed sequences to cube-major (`tilegen.vsa.forward_varlen`)."""
    parts, at = [], 0
    for g in grids:
        g3, c3 = _triple(g, "grid"), _triple(cube, "cube")
        slots = token_slots(g3, c3)
        n_slot = vbs_for_grid(g3, c3).numel() * math.prod(c3)
        src = torch.full((n_slot,), -1, dtype=torch.int32)
        src[slots] = torch.arange(slots.numel(), dtype=torch.int32) + at
        parts.append(src)
        at += math.prod(g3)
    return torch.cat(parts).to(device)


@functools.lru_cache(maxsize=32)
def packed_token_slots(grids: tuple[tuple[int, int, int], ...], cube: tuple[int, int, int],
                       device: torch.device | str) -> torch.Tensor:
    """(total tokens,) int64: the cube slot of each token of packed sequences (the inverse of
    `packed_slot_sources`)."""
    parts, at = [], 0
    for g in grids:
        g3, c3 = _triple(g, "grid"), _triple(cube, "cube")
        parts.append(token_slots(g3, c3).long() + at)
        at += vbs_for_grid(g3, c3).numel() * math.prod(c3)
    return torch.cat(parts).to(device)
