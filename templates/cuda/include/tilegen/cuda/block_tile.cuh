// tilegen CUDA library, block tile: where a (batch, head) token row lives in global memory (the
// layouts a kernel's traits choose from), the swizzled shared-memory tile, and the cooperative
// global -> shared copy of a [rows x head_dim] tile by the whole CTA.
#pragma once

#include "tilegen/cuda/ptx.cuh"

namespace tilegen {

// Token rows of one (batch, head) in a contiguous tensor; q, k, v, o share the layout.
// BSHD (batch, seq, heads, head_dim): consecutive tokens are num_heads * head_dim apart.
struct Bshd {
  // Element offset of token 0 of (b, h).
  static __device__ __forceinline__ long long base(long long b, long long h, int seq_len,
                                                   int num_heads, int head_dim) {
    return (b * seq_len * num_heads + h) * head_dim;
  }
  // Elements between consecutive token rows.
  static __device__ __forceinline__ long long row_stride(int num_heads, int head_dim) {
    return static_cast<long long>(num_heads) * head_dim;
  }
};

// BHSD (batch, heads, seq, head_dim): each (b, h) is one dense [seq x head_dim] block.
struct Bhsd {
  static __device__ __forceinline__ long long base(long long b, long long h, int seq_len,
                                                   int num_heads, int head_dim) {
    return (b * num_heads + h) * seq_len * head_dim;
  }
  static __device__ __forceinline__ long long row_stride(int num_heads, int head_dim) {
    return head_dim;
  }
};

// A [rows x kHeadDim] 16-bit tile in shared memory, row-major, 16-byte chunks XOR-swizzled by
// (row % 8): the 8 rows one ldmatrix phase reads (same logical chunk) land on 8 different
// 16-byte bank groups, so ldmatrix and the epilogue's row accesses are conflict-free.
template <int kHeadDim>
struct SwizzledTile {
  static constexpr int kChunksPerRow = kHeadDim / 8;
  static_assert(kChunksPerRow % 8 == 0, "the swizzle permutes 8 chunks per row (head_dim >= 64)");
  static constexpr int kRowBytes = kHeadDim * 2;
  // Byte offset of 16-byte chunk `chunk` (columns 8*chunk .. 8*chunk+7) of row `row`.
  static __device__ __forceinline__ unsigned offset(int row, int chunk) {
    return row * kRowBytes + ((chunk ^ (row & 7)) << 4);
  }
};

// The whole CTA copies a [kRows x kHeadDim] tile with cp.async, 16 bytes per thread per step.
// Chunk c goes to thread c % kThreads: consecutive threads read consecutive 16-byte pieces of
// a row, so every warp issues fully coalesced 512-byte (D=128) row reads.
template <int kRows, int kHeadDim, int kThreads>
struct TileCopy {
  using Tile = SwizzledTile<kHeadDim>;
  static constexpr int kChunks = kRows * Tile::kChunksPerRow;
  static constexpr int kSteps = (kChunks + kThreads - 1) / kThreads;
  static __device__ __forceinline__ void load(unsigned smem, const elem_t* gmem_row0,
                                              long long row_stride, int tid) {
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      const int c = tid + step * kThreads;
      if (kChunks % kThreads == 0 || c < kChunks) {
        const int row = c / Tile::kChunksPerRow;
        const int chunk = c % Tile::kChunksPerRow;
        cp_async_16(smem + Tile::offset(row, chunk), gmem_row0 + row * row_stride + chunk * 8);
      }
    }
  }
};

}  // namespace tilegen
