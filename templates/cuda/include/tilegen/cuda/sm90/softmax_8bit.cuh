// tilegen CUDA library, the online softmax of the 8-bit recipe on wgmma fragments (sm_90a;
// issue #19, int8_fp8, tilegen/quant.py): S comes as int32 from Q8 K8^T, its logit is
// q_scale_i k_scale_u S_ij with one key scale a 32-key half u (quant.K_SCALE_GROUP) and sm_scale
// and log2 e folded into the row's scale `c`; P goes to the P V MMA as e4m3(p * 448) in the A
// fragment (AttentionMma8). The running max m is of the row-unscaled scores k_scale_u S_ij (c >
// 0 per row, so the max commutes with it). A half's scale multiplies its max and the row's
// exponent coefficient, never a score: per score one convert, one max, one FFMA, one exp2, one
// add, half a pack. l sums the same p * 448 that P V multiplies, so o / l needs no rescale.
#pragma once

#include <cstdint>

#include "tilegen/cuda/ptx.cuh"
#include "tilegen/cuda/sm90/softmax.cuh"

namespace tilegen {
namespace sm90 {

template <int kBlock>
struct QuantSoftmax {
  static constexpr int kSRegs = kBlock / 2;
  static constexpr int kPRegs = kBlock / 8;
  static constexpr int kHalves = kBlock / 32;
  static constexpr int kHalfRegs = kSRegs / kHalves;  // S registers of one 32-key half
  static constexpr float kLog2PScale = 8.807354922057604f;  // log2(448): P's e4m3 scale
  float m[2];
  float l[2];

  __device__ __forceinline__ void init() {
    m[0] = m[1] = neg_inf();
    l[0] = l[1] = 0.f;
  }

  // Register i of S lies in key half i / kHalfRegs (its column 8 (i / 4) + ..., 32 a half).
  static __host__ __device__ __forceinline__ constexpr int key_half(int i) {
    return i / kHalfRegs;
  }

  // The tile's key scales, one a half (the first 16 bytes of each half's slot in the K stage;
  // the floor keeps a masked -inf score times the scale -inf where a half's keys are all 0).
  static __device__ __forceinline__ void key_scales(uint32_t slots, float (&ks)[kHalves]) {
#pragma unroll
    for (int u = 0; u < kHalves; ++u) {
      float x;
      asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x) : "r"(slots + 16 * u));
      ks[u] = fmaxf(x, 1.17549435e-38f);
    }
  }

  // f = S_ij as fp32 (exact: |S| < 2^24); keys at or past their half's fill (fill[u] for keys
  // 32 u .. 32 u + 31; 0 for an absent half) get -inf.
  static __device__ __forceinline__ void scores(const int (&s)[kSRegs], float (&f)[kSRegs],
                                                const int (&fill)[kHalves], int lane) {
#pragma unroll
    for (int i = 0; i < kSRegs; ++i) f[i] = static_cast<float>(s[i]);
    bool partial = false;
#pragma unroll
    for (int u = 0; u < kHalves; ++u) partial |= fill[u] < 32;
    if (partial) {
#pragma unroll
      for (int i = 0; i < kSRegs; ++i) {
        const int col = Fragment::column(i, lane);
        if (col % 32 >= fill[key_half(i)]) f[i] = neg_inf();
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

  // f (raw scores) -> p (the e4m3 A fragment of P V: register 4 t + 2 hi + h of k-step t packs
  // S's groups 4 t + 2 hi and 4 t + 2 hi + 1 of row half h) and alpha (O's rescale per row
  // half; unset on the first tile). `c` is each row half's scale (q_scale sm_scale log2 e,
  // > 0), `ks` the tile's key scales. The three parts run apart where P V is issued in parts
  // (QuantConsumer).
  template <bool kFirst>
  __device__ __forceinline__ void step(float (&f)[kSRegs], uint32_t (&p)[kPRegs],
                                       float (&alpha)[2], const float (&c)[2],
                                       const float (&ks)[kHalves]) {
    update_max<kFirst>(f, alpha, c, ks);
    exponentiate<kFirst>(f, alpha, c, ks);
    pack(f, p);
  }

  // The running max over this tile's scaled scores: each half's max of S times its scale.
  template <bool kFirst>
  __device__ __forceinline__ void update_max(const float (&f)[kSRegs], float (&alpha)[2],
                                             const float (&c)[2], const float (&ks)[kHalves]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = neg_inf();
#pragma unroll
      for (int u = 0; u < kHalves; ++u) {
        float mu = neg_inf();
#pragma unroll
        for (int i = u * kHalfRegs; i < (u + 1) * kHalfRegs; ++i)
          if (Fragment::half(i) == h) mu = fmaxf(mu, f[i]);
        mx = fmaxf(mx, mu * ks[u]);
      }
      // the first half of every tile holds a real key (fill[0] >= 1): mx and m_new are finite
      const float m_new = fmaxf(m[h], Fragment::quad_max(mx));
      if constexpr (!kFirst) alpha[h] = fast_exp2((m[h] - m_new) * c[h]);
      m[h] = m_new;
    }
  }

  // f <- p * 448 = exp2(S c ks_u - m c + log2 448), and the row sums.
  template <bool kFirst>
  __device__ __forceinline__ void exponentiate(float (&f)[kSRegs], const float (&alpha)[2],
                                               const float (&c)[2],
                                               const float (&ks)[kHalves]) {
    const float shift[2] = {fmaf(m[0], c[0], -kLog2PScale), fmaf(m[1], c[1], -kLog2PScale)};
    float coef[2][kHalves];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int u = 0; u < kHalves; ++u) coef[h][u] = c[h] * ks[u];
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < kSRegs; ++i) {
      const int h = Fragment::half(i);
      f[i] = fast_exp2(fmaf(f[i], coef[h][key_half(i)], -shift[h]));
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
