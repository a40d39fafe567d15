// tilegen CUDA library, warp tile: one warp owns kWarpM query rows (kWarpM / 16 m16 tiles) and
// computes S = Q K^T and O += P V for them with ldmatrix + mma.sync m16n8k16 (T::Elem's).
#pragma once

#include "tilegen/cuda/block_tile.cuh"

namespace tilegen {

// Lane l, g = l / 4, c = l % 4. Fragment lane maps (see mma_16816 / ldmatrix_x4 in ptx.cuh):
//  Q  (A, 16 rows x 16 dims at dim chunk pair 2kk): ldmatrix_x4, lane l addresses row l % 16,
//     chunk 2kk + l / 16 -> matrices (rows 0-7, lo dims) (rows 8-15, lo) (0-7, hi) (8-15, hi)
//     = a0 a1 a2 a3.
//  K  (B of S = Q K^T; B[k][n] = K[n][k], i.e. "col" B is K row-major as stored): ldmatrix_x4,
//     lane l addresses key 16np + 8 * (l / 16) + l % 8, chunk 2kk + (l / 8) % 2 -> matrices
//     (keys 0-7, lo dims) (0-7, hi) (8-15, lo) (8-15, hi) = b0 b1 of n-tile 2np, b0 b1 of 2np+1.
//  P  (A of O += P V): the S accumulators of n-tiles 2kk, 2kk+1 already sit where A wants them:
//     a0 = S[2kk](d0, d1)  a1 = S[2kk](d2, d3)  a2 = S[2kk+1](d0, d1)  a3 = S[2kk+1](d2, d3).
//  V  (B of P V; B[k][n] = V[key k][dim n]): ldmatrix_x4.trans, lane l addresses key
//     16kk + 8 * ((l / 8) % 2) + l % 8, chunk 2dp + l / 16 -> matrices (keys 0-7, dims lo)
//     (8-15, lo) (0-7, hi) (8-15, hi) = b0 b1 of dim-tile 2dp, b0 b1 of 2dp+1.
template <class T>
struct WarpTile {
  using Elem = typename T::Elem;
  static constexpr int kMTiles = T::kWarpM / 16;   // m16 tiles per warp
  static constexpr int kNTiles = T::kBlockN / 8;   // n8 tiles of S
  static constexpr int kDTiles = T::kHeadDim / 8;  // n8 tiles of O
  using Tile = SwizzledTile<T::kHeadDim>;

  // s = Q[warp rows] . K[tile keys]^T (unscaled, fp32).
  static __device__ __forceinline__ void qk(float (&s)[kMTiles][kNTiles][4], unsigned s_q,
                                            unsigned s_k, int warp_row0, int lane) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < T::kHeadDim / 16; ++kk) {
      unsigned a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
        ldmatrix_x4(a[mt], s_q + Tile::offset(warp_row0 + mt * 16 + (lane & 15),
                                              2 * kk + (lane >> 4)));
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        unsigned b[4];
        ldmatrix_x4(b, s_k + Tile::offset(np * 16 + ((lane >> 4) << 3) + (lane & 7),
                                          2 * kk + ((lane >> 3) & 1)));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          Elem::mma_16816(s[mt][2 * np], a[mt], b[0], b[1]);
          Elem::mma_16816(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }

  // o += P . V with P = the probabilities left in s, cast to the 16-bit element type (like the
  // Triton kernel).
  static __device__ __forceinline__ void pv(float (&o)[kMTiles][kDTiles][4],
                                            const float (&p)[kMTiles][kNTiles][4], unsigned s_v,
                                            int lane) {
#pragma unroll
    for (int kk = 0; kk < T::kBlockN / 16; ++kk) {
      unsigned a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        a[mt][0] = Elem::pack2(p[mt][2 * kk][0], p[mt][2 * kk][1]);
        a[mt][1] = Elem::pack2(p[mt][2 * kk][2], p[mt][2 * kk][3]);
        a[mt][2] = Elem::pack2(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
        a[mt][3] = Elem::pack2(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < kDTiles / 2; ++dp) {
        unsigned b[4];
        ldmatrix_x4_trans(b, s_v + Tile::offset(kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7),
                                                2 * dp + (lane >> 4)));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          Elem::mma_16816(o[mt][2 * dp], a[mt], b[0], b[1]);
          Elem::mma_16816(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }
};

}  // namespace tilegen
