// tilegen CUDA library, the online softmax of the 8-bit recipe on wgmma fragments (sm_90a;
// issue #19, int8_fp8, tilegen/quant.py): S comes as int32 from Q8 K8^T, its logit is
// q_scale_i k_scale_u S_ij with one key scale a 32-key half u (quant.K_SCALE_GROUP) and sm_scale
// and log2 e folded into the row's scale `c`; P goes to the P V MMA as e4m3(p * 448) in the A
// fragment (AttentionMma8). The running max m is of the row-unscaled scores k_scale_u S_ij (c >
// 0 per row, so the max commutes with it). A half's scale multiplies its max and the row's
// exponent coefficient, never a score: per score one convert, one max, one FFMA, one exp2, one
// add, half a pack (p_exp "ex2"; "linear" below: no exp2, no add). l is in P's scale (p * 448),
// so o / l needs no rescale.
#pragma once

#include <cstdint>

#include "tilegen/cuda/ptx.cuh"
#include "tilegen/cuda/sm90/softmax.cuh"

namespace tilegen {
namespace sm90 {

// kMmaRowSum (row_sum "mma"): l is P's row sum from an m64n8 MMA of P against e4m3 ones (the
// very e4m3 values P V multiplies; no FADD a score). kLinearP (p_exp "linear"): P's e4m3 code
// comes straight from the exponent in eighths, 8 (c ks S) - sc + 126 with the row's shift sc =
// ceil(8 c m) an integer: the FFMA puts it at 1024 + code, F2FP packs two such into f16x2, whose
// rounding at 1024..2047 (ulp 1) is the code's (ties to even), HMNMX2 clamps two at 1024 (code
// 0, a masked key's -inf too), and a PRMT takes four codes, the low bytes of four halves. The
// row max is of S's int32, two scores a DPX three-way max. The mantissa is then linear in the
// exponent's fraction (2^f read as 1 + f, at most 6% high, the same for P V and l, so o keeps
// its accuracy: bench/NOTES.md, session 32); a score takes one convert, half a max, one FFMA,
// half an F2FP, half an HMNMX2 and a quarter PRMT, no MUFU.EX2 or FADD, and needs the MMA row
// sum.
template <int kBlock, bool kLinearP = false, bool kMmaRowSum = false>
struct QuantSoftmax {
  static constexpr int kSRegs = kBlock / 2;
  static constexpr int kPRegs = kBlock / 8;
  static constexpr int kHalves = kBlock / 32;
  static constexpr int kHalfRegs = kSRegs / kHalves;  // S registers of one 32-key half
  static constexpr float kLog2PScale = 8.807354922057604f;  // log2(448): P's e4m3 scale
  static constexpr bool kLinear = kLinearP;
  static constexpr bool kRowSumMma = kMmaRowSum || kLinearP;
  // linear P: y = 1024 + code, so y's f16 (ulp 1 in [1024, 2048)) is the integer code in its
  // low byte; 0x6400 is f16 1024 (code 0) twice
  static constexpr float kCodeBase = 1024.f;
  static constexpr uint32_t kCodeZero2 = 0x64006400u;
  static constexpr float kTopCode = 126.f;  // e4m3 0x7e = 448 = 2^(126 / 8 - 7) (1 + 6 / 8)
  // log2 of the linear code's mean overestimate of 2^x (x's fraction uniform; tilegen.quant
  // LINEAR_P_BIAS): taken out of lse, which l's sum of the codes would otherwise carry
  static constexpr float kLinearBias = 0.0570815f;
  float m[2];
  float l[2];   // kRowSumMma: the whole row's sum (the MMA's); else this thread's part of it
  float sc[2];  // kLinear: the row's shift, ceil(8 c m), an integer

  // The floor of a key scale and of a row's scale c: their product, the exponent's coefficient,
  // stays a normal float (>= 2^-120), so a masked key's -inf times it stays -inf. At FLT_MIN
  // (before session 38) a padded query row (q_scale 0) over a half of padded keys (k_scale 0)
  // gave 0, and -inf times 0 a NaN in the row's sum and O (p_exp "ex2"). Real scales lie far
  // above it.
  static constexpr float kMinScale = 0x1p-60f;
  static_assert(kMinScale * kMinScale >= 1.17549435e-38f, "the floors' product is normal");

  __device__ __forceinline__ void init() {
    m[0] = m[1] = neg_inf();
    l[0] = l[1] = 0.f;
    sc[0] = sc[1] = 0.f;
  }

  // Register i of S lies in key half i / kHalfRegs (its column 8 (i / 4) + ..., 32 a half).
  static __host__ __device__ __forceinline__ constexpr int key_half(int i) {
    return i / kHalfRegs;
  }

  // The tile's key scales, one a half (the first 16 bytes of each half's slot in the K stage;
  // floored at kMinScale where a half's keys are all 0 or padded).
  static __device__ __forceinline__ void key_scales(uint32_t slots, float (&ks)[kHalves]) {
#pragma unroll
    for (int u = 0; u < kHalves; ++u) {
      float x;
      asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x) : "r"(slots + 16 * u));
      ks[u] = fmaxf(x, kMinScale);
    }
  }

  // f = S_ij as fp32 (exact: |S| < 2^24); keys at or past their half's fill (fill[u] for keys
  // 32 u .. 32 u + 31; 0 for an absent half) get -inf.
  // kLinear: also mu, each key half's and row half's max of S (masked keys INT_MIN), taken
  // before S becomes f, so that f can take S's registers.
  static __device__ __forceinline__ void scores(int (&s)[kSRegs], float (&f)[kSRegs],
                                                const int (&fill)[kHalves], int lane,
                                                float (&mu)[2][kHalves]) {
    bool partial = false;
#pragma unroll
    for (int u = 0; u < kHalves; ++u) partial |= fill[u] < 32;
    auto masked = [&](int i) { return Fragment::column(i, lane) % 32 >= fill[key_half(i)]; };
    if constexpr (kLinear) {
      if (partial) {
#pragma unroll
        for (int i = 0; i < kSRegs; ++i)
          if (masked(i)) s[i] = INT32_MIN;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int u = 0; u < kHalves; ++u) mu[h][u] = static_cast<float>(half_max(s, u, h));
    }
#pragma unroll
    for (int i = 0; i < kSRegs; ++i) f[i] = static_cast<float>(s[i]);
    if (partial) {
#pragma unroll
      for (int i = 0; i < kSRegs; ++i)
        if (masked(i)) f[i] = neg_inf();
    }
  }

  // The max of S over key half u's registers of row half h (eight), in four DPX maxima.
  static __device__ __forceinline__ int half_max(const int (&s)[kSRegs], int u, int h) {
    static_assert(kHalfRegs == 16, "eight scores a key half and row half");
    int v[8];
    int n = 0;
#pragma unroll
    for (int i = u * kHalfRegs; i < (u + 1) * kHalfRegs; ++i)
      if (Fragment::half(i) == h) v[n++] = s[i];
    const int a = __vimax3_s32(v[0], v[1], v[2]);
    const int b = __vimax3_s32(v[3], v[4], v[5]);
    return max(__vimax3_s32(a, b, v[6]), v[7]);
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
  __device__ __forceinline__ void step(float (&f)[kSRegs], const float (&mu)[2][kHalves],
                                       uint32_t (&p)[kPRegs], float (&alpha)[2],
                                       const float (&c)[2], const float (&ks)[kHalves]) {
    update_max<kFirst>(f, mu, alpha, c, ks);
    exponentiate<kFirst>(f, alpha, c, ks);
    pack(f, p);
  }

  // The running max over this tile's scaled scores: each half's max of S times its scale
  // (kLinear: the halves' maxima `scores` took of S).
  template <bool kFirst>
  __device__ __forceinline__ void update_max(const float (&f)[kSRegs],
                                             const float (&mu)[2][kHalves], float (&alpha)[2],
                                             const float (&c)[2], const float (&ks)[kHalves]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = neg_inf();
#pragma unroll
      for (int u = 0; u < kHalves; ++u) {
        float mh = neg_inf();
        if constexpr (kLinear) {
          mh = mu[h][u];
        } else {
#pragma unroll
          for (int i = u * kHalfRegs; i < (u + 1) * kHalfRegs; ++i)
            if (Fragment::half(i) == h) mh = fmaxf(mh, f[i]);
        }
        mx = fmaxf(mx, mh * ks[u]);
      }
      // the first half of every tile holds a real key (fill[0] >= 1): mx and m_new are finite
      const float m_new = fmaxf(m[h], Fragment::quad_max(mx));
      if constexpr (kLinear) {
        const float sc_new = ceilf(8.f * (m_new * c[h]));
        if constexpr (!kFirst) alpha[h] = fast_exp2((sc[h] - sc_new) * 0.125f);
        sc[h] = sc_new;
      } else {
        if constexpr (!kFirst) alpha[h] = fast_exp2((m[h] - m_new) * c[h]);
      }
      m[h] = m_new;
    }
  }

  // f <- p * 448 = exp2(S c ks_u - m c + log2 448), and the row sums.
  template <bool kFirst>
  __device__ __forceinline__ void exponentiate(float (&f)[kSRegs], const float (&alpha)[2],
                                               const float (&c)[2],
                                               const float (&ks)[kHalves]) {
    if constexpr (kLinear) {
      // y = 1024 + 8 (c ks S - sc / 8) + 126: at most 1024 + 126 (sc >= 8 c m); pack rounds
      // and clamps it
      float coef[2][kHalves];
      float base[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        base[h] = (kCodeBase + kTopCode) - sc[h];
#pragma unroll
        for (int u = 0; u < kHalves; ++u) coef[h][u] = (8.f * c[h]) * ks[u];
      }
#pragma unroll
      for (int i = 0; i < kSRegs; ++i) {
        const int h = Fragment::half(i);
        f[i] = fmaf(f[i], coef[h][key_half(i)], base[h]);
      }
      return;
    }
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
      if constexpr (!kRowSumMma) sum[h] += f[i];
    }
    if constexpr (!kRowSumMma) {
#pragma unroll
      for (int h = 0; h < 2; ++h) l[h] = kFirst ? sum[h] : fmaf(l[h], alpha[h], sum[h]);
    }
  }

  // kRowSumMma: P_{j-1}'s row sums (the m64n8 fragment) added as O adds P_{j-1} V_{j-1}.
  __device__ __forceinline__ void add_row_sums(const float (&rs)[4], const float (&alpha)[2]) {
    l[0] = fmaf(l[0], alpha[0], rs[0]);
    l[1] = fmaf(l[1], alpha[1], rs[2]);
  }

  // Row half h's lse (base 2, of the smoothed keys) from its row sum l > 0.
  __device__ __forceinline__ float lse(int h, float c, float l_row) const {
    if constexpr (kLinear)
      return fmaf(sc[h], 0.125f, log2f(l_row) - (kTopCode / 8.f - 7.f + kLinearBias));
    return fmaf(m[h], c, log2f(l_row) - kLog2PScale);
  }

  // kLinear: four values y = 1024 + code to their codes: two f16x2 conversions (each value
  // rounded to its integer code), clamped two at a time at 1024, the low bytes of the halves.
  static __device__ __forceinline__ uint32_t linear_codes4(float a, float b, float c, float d) {
    uint32_t ab, cd;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(ab) : "f"(b), "f"(a));
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(cd) : "f"(d), "f"(c));
    asm("max.f16x2 %0, %0, %1;\n" : "+r"(ab) : "r"(kCodeZero2));
    asm("max.f16x2 %0, %0, %1;\n" : "+r"(cd) : "r"(kCodeZero2));
    return __byte_perm(ab, cd, 0x6420);
  }

  // One P register (bytes a, b, c, d, low first) from f as exponentiate left it.
  static __device__ __forceinline__ uint32_t p_register(float a, float b, float c, float d) {
    if constexpr (kLinear) return linear_codes4(a, b, c, d);
    return pack_e4m3x4(a, b, c, d);
  }

  static __device__ __forceinline__ void pack(const float (&f)[kSRegs], uint32_t (&p)[kPRegs]) {
#pragma unroll
    for (int t = 0; t < kPRegs / 4; ++t)
#pragma unroll
      for (int hi = 0; hi < 2; ++hi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int g = 4 * t + 2 * hi;
          p[4 * t + 2 * hi + h] = p_register(f[4 * g + 2 * h], f[4 * g + 2 * h + 1],
                                             f[4 * g + 4 + 2 * h], f[4 * g + 4 + 2 * h + 1]);
        }
  }

  __device__ __forceinline__ float row_sum(int h) const {
    if constexpr (kRowSumMma) return l[h];
    return Fragment::quad_sum(l[h]);
  }
};

}  // namespace sm90
}  // namespace tilegen
