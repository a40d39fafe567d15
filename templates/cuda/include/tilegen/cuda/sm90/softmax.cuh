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

// The online softmax of the 8-bit recipe (issue #19, int8_fp8; tilegen/quant.py): S comes as
// int32 from Q8 K8^T, its logit is q_scale_i k_scale_j S_ij (sm_scale and log2 e folded into the
// row's scale `c`), and P goes to the P V MMA as e4m3(p * 448) in the A fragment (AttentionMma8).
// The running max m is of the row-unscaled scores f = k_scale_j S_ij (c > 0 per row, so the max
// commutes with it); l sums the same p * 448 that P V multiplies, so o / l needs no rescale.
template <int kBlock>
struct QuantSoftmax {
  static constexpr int kSRegs = kBlock / 2;
  static constexpr int kPRegs = kBlock / 8;
  static constexpr float kLog2PScale = 8.807354922057604f;  // log2(448): P's e4m3 scale
  float m[2];
  float l[2];

  __device__ __forceinline__ void init() {
    m[0] = m[1] = neg_inf();
    l[0] = l[1] = 0.f;
  }

  // f = k_scale_j * S_ij from the tile's key scales in shared memory; keys at or past their
  // half's fill (fill[u] for keys 32 u .. 32 u + 31; 0 for an absent half) get -inf.
  static __device__ __forceinline__ void scores(const int (&s)[kSRegs], float (&f)[kSRegs],
                                                uint32_t key_scales,
                                                const int (&fill)[kBlock / 32], int lane) {
#pragma unroll
    for (int g = 0; g < kSRegs / 4; ++g) {
      const int col = 8 * g + 2 * (lane & 3);
      float k0, k1;
      asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                   : "=f"(k0), "=f"(k1)
                   : "r"(key_scales + 4 * col));
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 4 * g + e;
        const float x = static_cast<float>(s[i]) * ((e & 1) ? k1 : k0);
        f[i] = x;
      }
    }
    bool partial = false;
#pragma unroll
    for (int u = 0; u < kBlock / 32; ++u) partial |= fill[u] < 32;
    if (partial) {
#pragma unroll
      for (int i = 0; i < kSRegs; ++i) {
        const int col = Fragment::column(i, lane);
        if (col % 32 >= fill[col / 32]) f[i] = neg_inf();
      }
    }
  }

  // One e4m3x4 register: bytes (low first) a, b, c, d.
  static __device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
    uint16_t lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(d), "f"(c));
    uint32_t r;
    asm("mov.b32 %0, {%1, %2};\n" : "=r"(r) : "h"(lo), "h"(hi));
    return r;
  }

  // f (scores) -> p (the e4m3 A fragment of P V: register 4 t + 2 hi + h of k-step t packs S's
  // groups 4 t + 2 hi and 4 t + 2 hi + 1 of row half h) and alpha (O's rescale per row half;
  // unset on the first tile). `c` is each row half's scale (q_scale sm_scale log2 e, > 0).
  // The three parts run apart where P V is issued in parts (QuantConsumer).
  template <bool kFirst>
  __device__ __forceinline__ void step(float (&f)[kSRegs], uint32_t (&p)[kPRegs],
                                       float (&alpha)[2], const float (&c)[2]) {
    update_max<kFirst>(f, alpha, c);
    exponentiate<kFirst>(f, alpha, c);
    pack(f, p);
  }

  // The running max over this tile's scores, and alpha.
  template <bool kFirst>
  __device__ __forceinline__ void update_max(const float (&f)[kSRegs], float (&alpha)[2],
                                             const float (&c)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = neg_inf();
#pragma unroll
      for (int i = 0; i < kSRegs; ++i)
        if (Fragment::half(i) == h) mx = fmaxf(mx, f[i]);
      // the first half of every tile holds a real key (fill[0] >= 1): mx and m_new are finite
      const float m_new = fmaxf(m[h], Fragment::quad_max(mx));
      if constexpr (!kFirst) alpha[h] = fast_exp2((m[h] - m_new) * c[h]);
      m[h] = m_new;
    }
  }

  // f <- p * 448 = exp2(f c - m c + log2 448), and the row sums.
  template <bool kFirst>
  __device__ __forceinline__ void exponentiate(float (&f)[kSRegs], const float (&alpha)[2],
                                               const float (&c)[2]) {
    const float shift[2] = {fmaf(m[0], c[0], -kLog2PScale), fmaf(m[1], c[1], -kLog2PScale)};
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < kSRegs; ++i) {
      const int h = Fragment::half(i);
      f[i] = fast_exp2(fmaf(f[i], c[h], -shift[h]));
      sum[h] += f[i];
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) l[h] = kFirst ? sum[h] : fmaf(l[h], alpha[h], sum[h]);
  }

  static __device__ __forceinline__ void pack(const float (&f)[kSRegs], uint32_t (&p)[kPRegs]) {
#pragma unroll
    for (int t = 0; t < kPRegs / 4; ++t)
#pragma unroll
      for (int hi = 0; hi < 2; ++hi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int g = 4 * t + 2 * hi;
          p[4 * t + 2 * hi + h] = pack_e4m3x4(f[4 * g + 2 * h], f[4 * g + 2 * h + 1],
                                              f[4 * g + 4 + 2 * h], f[4 * g + 4 + 2 * h + 1]);
        }
  }

  __device__ __forceinline__ float row_sum(int h) const { return Fragment::quad_sum(l[h]); }
};

}  // namespace sm90
}  // namespace tilegen
