"""TMA tensor maps for the CUDA family's Hopper kernel, encoded by the CUDA driver.

A tensor map (``CUtensorMap``, 128 opaque bytes) tells the copy engine a tensor's address,
shape and strides and the box one copy moves. The kernel takes them by value
(``__grid_constant__``); the host encodes them per call with ``cuTensorMapEncodeTiled`` from
``libcuda`` (ctypes, no cuda-python needed for this part). `tile_geometry` is the pure part —
which 2-D view of a token tensor, which box — and is unit-tested on a CPU; `encode` needs the
driver.

Every map here is a 2-D view of a contiguous 16-bit token tensor, innermost dimension first:
BSHD ``(B, S, H, D)`` is ``(H * D columns, B * S rows)`` with rows ``H * D`` elements apart;
BHSD ``(B, H, S, D)`` is ``(D, B * H * S)``. A box is 64 columns (one 128-byte swizzle line)
by 64 rows (a whole cube, Q, O) or 8 rows (a slice of a packed partial cube), swizzled 128 B.
The 8-bit kernel's maps are of bytes ("u8": int8 Q8/K8 and e4m3 V^T alike, `byte_geometry`),
with a 128-byte swizzle for Q8 and K8 rows and a 32-byte one for V^T's 32-key halves.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

#: cuda.h's CUtensorMapDataType codes of the element types the kernel reads
DATA_TYPES: dict[str, int] = {"bf16": 9, "fp16": 6, "u8": 0}
ELEM_BYTES = 2
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "u8": 1}
#: cuda.h: CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
#: CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE
INTERLEAVE_NONE = 0
SWIZZLE_128B = 3
#: cuda.h's CUtensorMapSwizzle code by swizzle width in bytes
SWIZZLE_CODES: dict[int, int] = {32: 1, 64: 2, 128: SWIZZLE_128B}
L2_PROMOTION_256B = 3
OOB_FILL_NONE = 0
#: the widest box row a 128-byte swizzle takes, and the box limit per dimension
SWIZZLE_BYTES = 128
MAX_BOX = 256
MAP_BYTES = 128
MAP_ALIGN = 64


@dataclass(frozen=True)
class TileGeometry:
    """One map's view and box: ``dims`` and ``box`` innermost first (columns, rows)."""

    dims: tuple[int, int]
    row_stride_bytes: int
    box: tuple[int, int]
    elem_bytes: int = ELEM_BYTES
    swizzle_bytes: int = SWIZZLE_BYTES

    def problems(self) -> list[str]:
        """What the driver would refuse (cuTensorMapEncodeTiled's documented rules)."""
        out = []
        if self.swizzle_bytes not in SWIZZLE_CODES:
            out.append(f"swizzle of {self.swizzle_bytes} B: one of {sorted(SWIZZLE_CODES)}")
        if min(self.dims) < 1 or max(self.dims) >= 2**32:
            out.append(f"dims {self.dims} outside 1..2^32-1")
        if self.row_stride_bytes % 16 or self.row_stride_bytes >= 2**40:
            out.append(f"row stride {self.row_stride_bytes} B is not a multiple of 16 below 2^40")
        if self.box[0] * self.elem_bytes > self.swizzle_bytes:
            out.append(f"box row of {self.box[0] * self.elem_bytes} B is wider than the "
                       f"{self.swizzle_bytes}-byte swizzle")
        if self.box[0] * self.elem_bytes % 16:
            out.append(f"box row of {self.box[0] * self.elem_bytes} B is not a multiple of 16")
        if not all(1 <= b <= MAX_BOX for b in self.box) or self.box[0] > self.dims[0]:
            out.append(f"box {self.box} outside 1..{MAX_BOX} or wider than the tensor")
        return out


def tile_geometry(shape: tuple[int, ...], layout: str, box_rows: int,
                  box_cols: int = 64) -> TileGeometry:
    """The 2-D view of a contiguous token tensor of `shape` in `layout` ("bshd" or "bhsd")
    with a (box_cols, box_rows) box."""
    if len(shape) != 4:
        raise ValueError(f"a token tensor is 4-D, got shape {tuple(shape)}")
    if layout == "bshd":
        b, s, h, d = shape
        cols, rows = h * d, b * s
    elif layout == "bhsd":
        b, h, s, d = shape
        cols, rows = d, b * h * s
    else:
        raise ValueError(f"layout {layout!r}: 'bshd' or 'bhsd'")
    geometry = TileGeometry((cols, rows), cols * ELEM_BYTES, (box_cols, box_rows))
    problems = geometry.problems()
    if problems:
        raise ValueError(f"tensor of shape {tuple(shape)} ({layout}): " + "; ".join(problems))
    return geometry


def byte_geometry(cols: int, rows: int, box: tuple[int, int],
                  swizzle_bytes: int) -> TileGeometry:
    """A (cols, rows) byte matrix, rows `cols` bytes apart, with a (box cols, box rows) box."""
    geometry = TileGeometry((cols, rows), cols, box, 1, swizzle_bytes)
    problems = geometry.problems()
    if problems:
        raise ValueError(f"byte matrix of {rows} rows x {cols} B: " + "; ".join(problems))
    return geometry


class TensorMap:
    """An encoded map: 128 bytes in a 64-byte aligned host buffer (`address` is what a kernel
    parameter slot points at). Keeps no reference to the tensor it describes."""

    def __init__(self) -> None:
        self._raw = ctypes.create_string_buffer(MAP_BYTES + MAP_ALIGN)
        base = ctypes.addressof(self._raw)
        self.address = base + (-base % MAP_ALIGN)


@functools.cache
def _driver_encode():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise RuntimeError("the CUDA family's Hopper kernel encodes its TMA tensor maps with "
                           "the CUDA driver (libcuda.so.1), which this process cannot load: "
                           f"{exc}") from exc
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                   ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                   ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def encode(address: int, geometry: TileGeometry, dtype: str) -> TensorMap:
    """Encode a swizzled tiled map (the geometry's swizzle) of the tensor at device
    `address`."""
    if dtype not in DATA_TYPES:
        raise ValueError(f"dtype {dtype!r}: the tensor maps take {sorted(DATA_TYPES)}")
    if DTYPE_BYTES[dtype] != geometry.elem_bytes:
        raise ValueError(f"dtype {dtype!r} has {DTYPE_BYTES[dtype]}-byte elements; the "
                         f"geometry {geometry.elem_bytes}")
    if address % 16:
        raise ValueError(f"tensor address {address:#x} is not 16-byte aligned (TMA needs it): "
                         "pass a tensor that starts on its own allocation")
    out = TensorMap()
    dims = (ctypes.c_uint64 * 2)(*geometry.dims)
    strides = (ctypes.c_uint64 * 1)(geometry.row_stride_bytes)
    box = (ctypes.c_uint32 * 2)(*geometry.box)
    element_strides = (ctypes.c_uint32 * 2)(1, 1)
    err = _driver_encode()(out.address, DATA_TYPES[dtype], 2, address, dims, strides, box,
                           element_strides, INTERLEAVE_NONE,
                           SWIZZLE_CODES[geometry.swizzle_bytes], L2_PROMOTION_256B,
                           OOB_FILL_NONE)
    if err != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {err} for {geometry}")
    return out
