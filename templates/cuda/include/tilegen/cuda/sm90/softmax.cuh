// tilegen CUDA library, the online softmax on wgmma fragments (sm_90a): base-2 units with a
// running row max, as the reference kernel (m = max(m, rowmax s), p = exp2(s * c - m * c),
// alpha = exp2((m_old - m) * c), l = l * alpha + rowsum p, o = o * alpha + P V, c = sm_scale *
// log2 e). Subtracting the running max keeps every exp2 argument <= 0: no logit overflows, the
// outlier head's included.
#pragma once

#include <cstdint>

#include "tilegen/cuda/ptx.cuh"

namespace tilegen {
namespace sm90 {

// An m64nN fp32 fragment of one consumer warpgroup: warp w holds rows 16w..16w+15; thread
// (lane) holds N / 2 values, element i in row 16w + lane / 4 + 8 * half(i) and column
// column(i, lane). The 4 lanes of a quad share a row, so row reductions are two xor-shuffles.
struct Fragment {
  static __host__ __device__ __forceinline__ constexpr int half(int i) { return (i >> 1) & 1; }
  static __host__ __device__ __forceinline__ int column(int i, int lane) {
    return 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
  }
  static __host__ __device__ __forceinline__ int row(int half_index, int warp, int lane) {
    return 16 * warp + (lane >> 2) + 8 * half_index;
  }
  static __device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  }
  static __device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
  }
};

template <class Elem, int kBlock>
struct OnlineSoftmax {
  static constexpr int kSRegs = kBlock / 2;
  static constexpr int kPRegs = kBlock / 4;
  float m[2];  // running row max of the raw scores (unscaled), per row half
  float l[2];  // this thread's share of the running row sum

  __device__ __forceinline__ void init() {
    m[0] = m[1] = neg_inf();
    l[0] = l[1] = 0.f;
  }

  // Keys at or past `fill` (a partial tile's padding or stale rows) get -inf: a select, so
  // whatever those shared-memory rows hold cannot reach P.
  static __device__ __forceinline__ void mask(float (&s)[kSRegs], int fill, int lane) {
#pragma unroll
    for (int i = 0; i < kSRegs; ++i)
      if (Fragment::column(i, lane) >= fill) s[i] = neg_inf();
  }

  // s (scores) -> p (the P fragment, 16-bit, as the A operand of P V: register 4c + j holds
  // keys 16c..16c+15 in the m16n8k16 A order, so S's accumulator layout maps onto it with no
  // shuffle) and alpha (the rescale of O per row half; unset on the first tile).
  template <bool kFirst>
  __device__ __forceinline__ void step(float (&s)[kSRegs], uint32_t (&p)[kPRegs],
                                       float (&alpha)[2], float scale) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = neg_inf();
#pragma unroll
      for (int i = 0; i < kSRegs; ++i)
        if (Fragment::half(i) == h) mx = fmaxf(mx, s[i]);
      // every row has a real key in every tile (fill >= 1): mx and m_new are finite
      const float m_new = fmaxf(m[h], Fragment::quad_max(mx));
      if constexpr (!kFirst) alpha[h] = fast_exp2((m[h] - m_new) * scale);
      m[h] = m_new;
    }
    const float shift[2] = {m[0] * scale, m[1] * scale};
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < kSRegs; ++i) {
      s[i] = fast_exp2(fmaf(s[i], scale, -shift[Fragment::half(i)]));
      sum[Fragment::half(i)] += s[i];
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) l[h] = kFirst ? sum[h] : fmaf(l[h], alpha[h], sum[h]);
#pragma unroll
    for (int c = 0; c < kPRegs; ++c) p[c] = Elem::pack2(s[2 * c], s[2 * c + 1]);
  }

  template <int N>
  static __device__ __forceinline__ void rescale(float (&o)[N], const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < N; ++i) o[i] *= alpha[Fragment::half(i)];
  }

  // The full row sum of row half h (every lane of the quad gets it).
  __device__ __forceinline__ float row_sum(int h) const { return Fragment::quad_sum(l[h]); }
};

}  // namespace sm90
}  // namespace tilegen
