// tilegen CUDA library, epilogue: normalise, write o (input dtype) and, with T::kStoreLse, lse
// (fp32, base 2); with T::kStoreMaxProb, the softmax-normalizer signal (max_prob rows and the
// query cube's mean, max_prob_store).
#pragma once

#include "tilegen/cuda/softmax.cuh"

namespace tilegen {

// o = acc / l; lse = m + log2(l). A row that saw no key (count 0) has l = 0: o = 0, lse = -inf.
// Each warp stages its own rows through its own rows of the Q tile (nobody else reads them),
// then writes whole 16-byte chunks: coalesced rows instead of 4-byte scattered stores.
template <class T>
struct Epilogue {
  using Warp = WarpTile<T>;
  using Tile = SwizzledTile<T::kHeadDim>;
  static constexpr int kM = Warp::kMTiles;

  // lse_rows is read with kStoreLse only; max_prob_rows, max_prob_cube, real_rows (real query
  // rows of the cube from this tile's first row) and n_real (of the cube) with kStoreMaxProb.
  static __device__ __forceinline__ void store(const float (&o)[kM][Warp::kDTiles][4],
                                               const OnlineSoftmax<T>& softmax,
                                               unsigned char* s_q, elem_t* o_rows,
                                               long long row_stride, float* lse_rows,
                                               float* max_prob_rows, float* max_prob_cube,
                                               int real_rows, int n_real,
                                               int warp_row0, int lane) {
    float share = 0.f;  // kStoreMaxProb: this lane's part of the sum of max_prob over real rows
#pragma unroll
    for (int mt = 0; mt < kM; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float l = softmax.row_sum(mt, r);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int row = warp_row0 + mt * 16 + (lane >> 2) + 8 * r;
#pragma unroll
        for (int dt = 0; dt < Warp::kDTiles; ++dt)
          *reinterpret_cast<unsigned*>(s_q + Tile::offset(row, dt) + (lane & 3) * 4) =
              T::Elem::pack2(o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv);
        if constexpr (T::kStoreLse) {
          if ((lane & 3) == 0)
            lse_rows[row] = l > 0.f ? softmax.m[mt][r] + log2f(l) : neg_inf();
        }
        if constexpr (T::kStoreMaxProb) {
          // 1 / l is the row's largest softmax weight; 0 for a row with no key, NaN stays NaN
          const float peak = l > 0.f ? inv : (l == 0.f ? 0.f : l);
          if ((lane & 3) == 0) {
            max_prob_rows[row] = peak;
            if (row < real_rows) share += peak;
          }
        }
      }
    __syncwarp();
    constexpr int kChunks = T::kWarpM * Tile::kChunksPerRow;
    static_assert(kChunks % 32 == 0, "a warp's rows split evenly over its lanes");
#pragma unroll
    for (int step = 0; step < kChunks / 32; ++step) {
      const int c = lane + step * 32;
      const int row = warp_row0 + c / Tile::kChunksPerRow;
      const int chunk = c % Tile::kChunksPerRow;
      *reinterpret_cast<uint4*>(o_rows + row * row_stride + chunk * 8) =
          *reinterpret_cast<const uint4*>(s_q + Tile::offset(row, chunk));
    }
    if constexpr (T::kStoreMaxProb) max_prob_store(share, max_prob_cube, n_real, lane);
  }

  // The query cube's mean of max_prob over its real rows: lanes, then warps (in warp order,
  // through shared memory), then one store, or one atomic add when BlockM < BlockQ (several
  // CTAs share the cube; the launcher zeroes the buffer).
  static __device__ __forceinline__ void max_prob_store(float share, float* max_prob_cube,
                                                        int n_real, int lane) {
    __shared__ float warp_share[T::kWarps];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) share += __shfl_xor_sync(0xffffffffu, share, off);
    if (lane == 0) warp_share[threadIdx.x >> 5] = share;
    __syncthreads();
    if (threadIdx.x == 0) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < T::kWarps; ++w) sum += warp_share[w];
      if constexpr (T::kBlockM == T::kBlockQ) {
        *max_prob_cube = sum / static_cast<float>(n_real);
      } else {
        atomicAdd(max_prob_cube, sum / static_cast<float>(n_real));
      }
    }
  }
};

}  // namespace tilegen
