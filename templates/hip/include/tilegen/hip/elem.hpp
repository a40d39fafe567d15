// tilegen HIP library, element types and MFMAs: the fp32 -> 16-bit conversion of bf16 and fp16,
// and the MFMA of one element type and tile size (MfmaTile: 32x32x8 or 16x16x16) with its lane
// maps. A kernel's config names both (Config::Elem, Config::MFMA_MN).
#pragma once

#include "tilegen/hip/prelude.hpp"

namespace tg {

// What both element types share, over E's from_f32.
template <class E>
struct Elem16 {
  // Four fp32 values -> one operand fragment (value t in bits 16*t .. 16*t+15).
  static TG_DEVICE u32x2 pack4(float a, float b, float c, float d) {
    u32x2 r;
    r.x = static_cast<u32>(E::from_f32(a)) | (static_cast<u32>(E::from_f32(b)) << 16);
    r.y = static_cast<u32>(E::from_f32(c)) | (static_cast<u32>(E::from_f32(d)) << 16);
    return r;
  }
};

struct Bf16 : Elem16<Bf16> {
  static constexpr bool IS_BF16 = true;
  typedef i16x4 frag;  // the *_bf16_1k builtins take bf16 bit patterns as short4
  // fp32 -> bf16 bits, round to nearest even like torch and Triton; NaN stays a quiet NaN.
  // gfx942 has no fp32 -> bf16 convert instruction (gfx950 adds one).
  static TG_DEVICE u16 from_f32(float f) {
    const u32 u = __builtin_bit_cast(u32, f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<u16>((u >> 16) | 0x40u);
    return static_cast<u16>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
};

struct F16 : Elem16<F16> {
  static constexpr bool IS_BF16 = false;
  typedef f16x4 frag;
  // fp32 -> fp16 bits: v_cvt_f16_f32, round to nearest even (P <= 1 and o never overflow).
  static TG_DEVICE u16 from_f32(float f) {
    return __builtin_bit_cast(u16, static_cast<_Float16>(f));
  }
};

// One MN x MN fp32 accumulator: MN*MN/64 registers per lane.
template <int MN>
struct MfmaAcc;
template <>
struct MfmaAcc<32> {
  typedef f32x16 type;
};
template <>
struct MfmaAcc<16> {
  typedef f32x4 type;
};

// MFMA MN x MN x K of element type E: K = 4 * G, G = 64 / MN lane groups. Lane maps (wave64,
// the conventions of AMD's matrix instruction calculator), t = 0..3:
//   A (MN x K):  lane l holds A[l % MN][4 * (l / MN) + t]      (4 consecutive k: 8 bytes)
//   B (K x MN):  lane l holds B[4 * (l / MN) + t][l % MN]
//   C (MN x MN): lane l, register r holds C[acc_row(l, r)][l % MN],
//                acc_row(l, r) = 4 * G * (r / 4) + 4 * (l / MN) + r % 4
template <class E, int MN_>
struct MfmaTile {
  static_assert(MN_ == 32 || MN_ == 16, "gfx942's 16-bit MFMAs are 32x32x8 and 16x16x16");
  static constexpr int MN = MN_;
  static constexpr int K = 4 * (kWave / MN);
  static constexpr int G = kWave / MN;
  static constexpr int ACC = MN * MN / kWave;  // accumulator registers per lane
  typedef typename MfmaAcc<MN>::type acc;
  // constexpr (so host + device): also evaluated by the plan checks (plan_checks.hpp).
  static constexpr int acc_row(int lane, int r) {
    return 4 * G * (r / 4) + 4 * (lane / MN) + r % 4;
  }
  // D = A * B + C on one tile; cbsz, abid, blgp = 0: no broadcast of A, no B lane swizzle.
  static TG_DEVICE acc mma(u32x2 a, u32x2 b, acc c) {
    typedef typename E::frag frag;
    if constexpr (MN == 32 && E::IS_BF16) {
      return __builtin_amdgcn_mfma_f32_32x32x8bf16_1k(
          __builtin_bit_cast(frag, a), __builtin_bit_cast(frag, b), c, 0, 0, 0);
    } else if constexpr (MN == 32) {
      return __builtin_amdgcn_mfma_f32_32x32x8f16(
          __builtin_bit_cast(frag, a), __builtin_bit_cast(frag, b), c, 0, 0, 0);
    } else if constexpr (E::IS_BF16) {
      return __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(
          __builtin_bit_cast(frag, a), __builtin_bit_cast(frag, b), c, 0, 0, 0);
    } else {
      return __builtin_amdgcn_mfma_f32_16x16x16f16(
          __builtin_bit_cast(frag, a), __builtin_bit_cast(frag, b), c, 0, 0, 0);
    }
  }
};

}  // namespace tg
