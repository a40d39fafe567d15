// tilegen CUDA library, softmax stage: the online softmax in base-2 units with a running row
// max, as in the Triton kernel (qk * qk_scale, m_ij = max(m_i, rowmax), p = exp2(qk - m_ij),
// alpha = exp2(m_i - m_ij), l = l * alpha + rowsum(p), acc = acc * alpha + P V).
#pragma once

#include "tilegen/cuda/warp_tile.cuh"

namespace tilegen {

// Each lane holds rows g and g + 8 (r = 0, 1) of each of its m16 tiles, 2 columns per n8 tile;
// the 4 lanes of a quad (same g) share a row, so row reductions are two xor-shuffles.
// Subtracting the running max keeps every exp2 argument <= 0: no overflow for any logit size
// (the outlier head's logits reach several hundred).
template <class T>
struct OnlineSoftmax {
  using Warp = WarpTile<T>;
  static constexpr int kM = Warp::kMTiles;
  float m[kM][2];  // running row max of the scaled logits (base 2)
  float l[kM][2];  // this lane's share of the running row sum; the quad's shares add up in row_sum

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int mt = 0; mt < kM; ++mt) {
      m[mt][0] = m[mt][1] = neg_inf();
      l[mt][0] = l[mt][1] = 0.f;
    }
  }

  // Turns s (raw logits) into probabilities and rescales o. kMasked: keys at or past `valid`
  // (a partial cube's padding) get -inf; only partial sub-tiles take this path.
  template <bool kMasked>
  __device__ __forceinline__ void step(float (&s)[kM][Warp::kNTiles][4],
                                       float (&o)[kM][Warp::kDTiles][4], float qk_scale,
                                       int valid, int lane) {
#pragma unroll
    for (int mt = 0; mt < kM; ++mt)
#pragma unroll
      for (int nt = 0; nt < Warp::kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float x = s[mt][nt][e] * qk_scale;
          if (kMasked) {
            const int key = nt * 8 + (lane & 3) * 2 + (e & 1);
            s[mt][nt][e] = key < valid ? x : neg_inf();
          } else {
            s[mt][nt][e] = x;
          }
        }
#pragma unroll
    for (int mt = 0; mt < kM; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = neg_inf();
#pragma unroll
        for (int nt = 0; nt < Warp::kNTiles; ++nt)
          mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[mt][r], mx);
        // A row that has only seen masked keys still has max -inf: subtract 0, not -inf (NaN).
        const float m_use = m_new == neg_inf() ? 0.f : m_new;
        const float alpha = fast_exp2(m[mt][r] - m_use);  // 0 on the first tile (m = -inf)
        m[mt][r] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < Warp::kNTiles; ++nt) {
          const float p0 = fast_exp2(s[mt][nt][2 * r] - m_use);
          const float p1 = fast_exp2(s[mt][nt][2 * r + 1] - m_use);
          s[mt][nt][2 * r] = p0;
          s[mt][nt][2 * r + 1] = p1;
          sum += p0 + p1;
        }
        l[mt][r] = l[mt][r] * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < Warp::kDTiles; ++dt) {
          o[mt][dt][2 * r] *= alpha;
          o[mt][dt][2 * r + 1] *= alpha;
        }
      }
  }

  // Full row sum (all 4 lanes of the quad get it).
  __device__ __forceinline__ float row_sum(int mt, int r) const {
    float x = l[mt][r];
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    return x;
  }
};

}  // namespace tilegen
