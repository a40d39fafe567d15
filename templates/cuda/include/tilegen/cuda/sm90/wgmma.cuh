// tilegen CUDA library, Hopper warpgroup MMA (wgmma, sm_90a): shared-memory matrix descriptors
// for tiles stored as 128-byte-swizzled panels, the two MMAs of attention (S = Q K^T from shared
// memory, O += P V with P from registers), and the fences that order them against ordinary code.
//
// Tile layout (what TMA writes with a (64-column, rows) box and CU_TENSOR_MAP_SWIZZLE_128B): a
// tile of R rows x D 16-bit columns is D / 64 panels of R rows x 128 bytes, panel p at byte
// p * R * 128; the 16-byte chunk c of row r sits at chunk c ^ (r % 8) of its 128-byte line.
// Panels start 1024-byte aligned (the swizzle repeats every 8 rows).
#pragma once

#include <cstdint>

#include "tilegen/cuda/ptx.cuh"

// The output operand lists of the m64n32 (16 registers), m64n64 (32) and m64n128 (64) fragments.
#define TILEGEN_SM90_D16 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"

#define TILEGEN_SM90_D16_OPERANDS(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), \
  "+f"(d[15])

#define TILEGEN_SM90_D32 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

#define TILEGEN_SM90_D32_OPERANDS(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), \
  "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), \
  "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), \
  "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

#define TILEGEN_SM90_D32_RESULTS(d) \
  "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), \
  "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), \
  "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), \
  "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), \
  "=f"(d[29]), "=f"(d[30]), "=f"(d[31])

#define TILEGEN_SM90_S32_OPERANDS(d) \
  "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), \
  "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), \
  "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), \
  "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), \
  "+r"(d[29]), "+r"(d[30]), "+r"(d[31])

#define TILEGEN_SM90_D64 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, " \
  "%39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, " \
  "%58, %59, %60, %61, %62, %63}"

#define TILEGEN_SM90_D64_OPERANDS(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), \
  "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), \
  "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), \
  "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
  "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), \
  "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), \
  "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), \
  "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

#define TILEGEN_SM90_D64_RESULTS(d) \
  "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), \
  "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), \
  "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), \
  "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), \
  "=f"(d[29]), "=f"(d[30]), "=f"(d[31]), "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), \
  "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]), "=f"(d[40]), "=f"(d[41]), "=f"(d[42]), \
  "=f"(d[43]), "=f"(d[44]), "=f"(d[45]), "=f"(d[46]), "=f"(d[47]), "=f"(d[48]), "=f"(d[49]), \
  "=f"(d[50]), "=f"(d[51]), "=f"(d[52]), "=f"(d[53]), "=f"(d[54]), "=f"(d[55]), "=f"(d[56]), \
  "=f"(d[57]), "=f"(d[58]), "=f"(d[59]), "=f"(d[60]), "=f"(d[61]), "=f"(d[62]), "=f"(d[63])

#define TILEGEN_SM90_S64_OPERANDS(d) \
  "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), \
  "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), \
  "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), \
  "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), \
  "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), \
  "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), \
  "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]), \
  "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]), \
  "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])

namespace tilegen {
namespace sm90 {

constexpr int kPanelCols = 64;  // 16-bit columns of one 128-byte swizzle line

// A 64-bit wgmma matrix descriptor: start address, leading and stride byte offsets (all in
// 16-byte units), 128-byte swizzle (layout type 1 in bits 62-63).
__host__ __device__ __forceinline__ constexpr uint64_t sw128_descriptor(uint32_t smem_addr,
                                                              uint32_t leading_bytes,
                                                              uint32_t stride_bytes) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>(leading_bytes >> 4) << 16) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// The same for tiles under the 32-byte swizzle (layout type 3): 8-bit V^T halves of 32 keys.
__host__ __device__ __forceinline__ constexpr uint64_t sw32_descriptor(uint32_t smem_addr,
                                                             uint32_t stride_bytes) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (static_cast<uint64_t>(3) << 62);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Wait until at most kPending committed groups of this warpgroup are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Registers an in-flight wgmma reads or writes must not be touched, nor their uses moved across
// a wait, by the compiler: an empty asm that "modifies" each one pins the order.
template <int N>
__device__ __forceinline__ void fence_operands(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_operands(int (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_operands(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// The instructions, per 16-bit element type. The accumulate flag (scale-d) is an immediate,
// so ptxas sees that the overwriting form reads nothing from d:
//   ss_n64 / ss_n64_first: d (m64n64 fp32) += / = A (smem, K-major) x B (smem, K-major)
//   rs_n64 / rs_n128: d (m64nN fp32) += A (registers) x B (smem, MN-major: transposed)
// A in registers is the m16n8k16 A fragment per warp (warp w: rows 16w..16w+15).
#define TILEGEN_SM90_WGMMA_OPS(ELEM, TYPE)                                                      \
  template <>                                                                                   \
  struct Wgmma<ELEM> {                                                                          \
    static __device__ __forceinline__ void ss_n64_first(float (&d)[32], uint64_t a, uint64_t b) { \
      asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "              \
                   TILEGEN_SM90_D32 ", %32, %33, 0, 1, 1, 0, 0;\n"                              \
                   : TILEGEN_SM90_D32_RESULTS(d)                                                \
                   : "l"(a), "l"(b));                                                           \
    }                                                                                           \
    static __device__ __forceinline__ void ss_n64(float (&d)[32], uint64_t a, uint64_t b) {     \
      asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "              \
                   TILEGEN_SM90_D32 ", %32, %33, 1, 1, 1, 0, 0;\n"                              \
                   : TILEGEN_SM90_D32_OPERANDS(d)                                               \
                   : "l"(a), "l"(b));                                                           \
    }                                                                                           \
    static __device__ __forceinline__ void rs_n64(float (&d)[32], uint32_t a0, uint32_t a1,     \
                                                  uint32_t a2, uint32_t a3, uint64_t b) {       \
      asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "              \
                   TILEGEN_SM90_D32 ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"                \
                   : TILEGEN_SM90_D32_OPERANDS(d)                                               \
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));                               \
    }                                                                                           \
    static __device__ __forceinline__ void rs_n128(float (&d)[64], uint32_t a0, uint32_t a1,    \
                                                   uint32_t a2, uint32_t a3, uint64_t b) {      \
      asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " "             \
                   TILEGEN_SM90_D64 ", {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"                \
                   : TILEGEN_SM90_D64_OPERANDS(d)                                               \
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));                               \
    }                                                                                           \
  };

template <class Elem>
struct Wgmma;
TILEGEN_SM90_WGMMA_OPS(Bf16, "bf16")
TILEGEN_SM90_WGMMA_OPS(Fp16, "f16")
#undef TILEGEN_SM90_WGMMA_OPS

// The two MMAs of one attention tile of kBlock keys, for one consumer warpgroup (64 query rows).
template <class Elem, int kHeadDim, int kBlock>
struct AttentionMma {
  static_assert(kHeadDim == 64 || kHeadDim == 128, "O is one m64n64 or m64n128 fragment");
  static_assert(kBlock == 64, "S is one m64n64 fragment");
  static constexpr int kPanelBytes = kBlock * 128;  // one panel of a kBlock-row tile
  static constexpr int kSRegs = kBlock / 2;         // S fragment: fp32 per thread
  static constexpr int kORegs = kHeadDim / 2;       // O fragment: fp32 per thread
  static constexpr int kPRegs = kBlock / 4;         // P fragment: 16-bit pairs per thread

  // S = Q K^T: head_dim / 16 k-steps, each 32 bytes further along the panel's 128-byte lines
  // (a K-major operand: rows 1024 bytes apart per 8, no leading offset under the swizzle).
  static __host__ __device__ __forceinline__ uint64_t qk_descriptor(uint32_t tile, int t) {
    return sw128_descriptor(tile + (t / 4) * kPanelBytes + (t % 4) * 32, 0, 1024);
  }
  // P V: k-step t is keys 16t..16t+15 (2048 bytes of rows); V is MN-major (its rows are keys,
  // contiguous in head_dim): panels are the leading offset, 8-key row groups the stride.
  static __host__ __device__ __forceinline__ uint64_t pv_descriptor(uint32_t v_tile, int t) {
    return sw128_descriptor(v_tile + t * 16 * 128, kPanelBytes, 1024);
  }

  static __device__ __forceinline__ void qk(float (&s)[kSRegs], uint32_t q_tile,
                                            uint32_t k_tile) {
#pragma unroll
    for (int t = 0; t < kHeadDim / 16; ++t) {
      const uint64_t a = qk_descriptor(q_tile, t);
      const uint64_t b = qk_descriptor(k_tile, t);
      if (t == 0) {
        Wgmma<Elem>::ss_n64_first(s, a, b);
      } else {
        Wgmma<Elem>::ss_n64(s, a, b);
      }
    }
  }

  // O += P V, P from registers: register 4t + j is A register j of k-step t.
  static __device__ __forceinline__ void pv(float (&o)[kORegs], const uint32_t (&p)[kPRegs],
                                            uint32_t v_tile) {
#pragma unroll
    for (int t = 0; t < kBlock / 16; ++t) {
      const uint64_t b = pv_descriptor(v_tile, t);
      if constexpr (kHeadDim == 128) {
        Wgmma<Elem>::rs_n128(o, p[4 * t], p[4 * t + 1], p[4 * t + 2], p[4 * t + 3], b);
      } else {
        Wgmma<Elem>::rs_n64(o, p[4 * t], p[4 * t + 1], p[4 * t + 2], p[4 * t + 3], b);
      }
    }
  }
};

// ---- 8-bit attention (issue #19's int8_fp8 recipe) ---------------------------------------------
// S = Q8 K8^T exactly in int32 (IGMMA), then O += P V with P in e4m3 from registers and V^T in
// e4m3 (QGMMA). Tiles: Q8 and K8 are 64 rows of kHeadDim bytes (one 128-byte swizzle panel for
// kHeadDim 128); V^T is two 32-key halves, each kHeadDim rows of 32 bytes under the 32-byte
// swizzle (one TMA box of (32 keys, kHeadDim rows) a half), so a k-step of P V is one half.
//
// The P fragment needs no data movement: wgmma's 8-bit A fragment gives thread (lane) of row r
// the keys 4 (lane % 4) + 0..3 (registers 0, 1: rows r, r + 8) and 16 + 4 (lane % 4) + 0..3
// (registers 2, 3) of a 32-key step, while S's accumulator gives it keys 8 g + 2 (lane % 4) +
// 0..1. Register 2 hi + h of step t packs S's groups g = 4 t + 2 hi and g + 1 of row half h, and
// the pre-pass stores V^T's keys permuted within each 32-key half to match: MMA key slot kk of a
// half reads key `key_of_slot(kk)` (tilegen/quant.py: vt_key_permutation).
struct Wgmma8 {
  // The accumulate flag (scale-d) comes from a predicate, not an immediate, so d is always an
  // input and output and every overwrite reuses d's registers: with the immediate 0, ptxas
  // gave each overwrite fresh registers and spilled (session 20: 56 bytes in the one-consumer
  // kernel, 100-300 with P V in parts; none this way).
  //
  // d (m64nN int32, N = 2 R: 64 or 128 columns) = / += A (smem, K-major) x B (smem, K-major),
  // s8 x s8
  template <int R>
  static __device__ __forceinline__ void ss(int (&d)[R], uint64_t a, uint64_t b,
                                            bool accumulate) {
    static_assert(R == 32 || R == 64, "m64n64 or m64n128");
    const int scale_d = accumulate ? 1 : 0;
    if constexpr (R == 32) {
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 " TILEGEN_SM90_D32
                   ", %32, %33, p;\n}\n"
                   : TILEGEN_SM90_S32_OPERANDS(d)
                   : "l"(a), "l"(b), "r"(scale_d));
    } else {
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 " TILEGEN_SM90_D64
                   ", %64, %65, p;\n}\n"
                   : TILEGEN_SM90_S64_OPERANDS(d)
                   : "l"(a), "l"(b), "r"(scale_d));
    }
  }
  // d (m64nN fp32, N = 2 R: 32, 64 or 128 columns of O) = / += A (registers, e4m3) x B (smem,
  // K-major V^T, e4m3)
  template <int R>
  static __device__ __forceinline__ void rs(float (&d)[R], uint32_t a0, uint32_t a1, uint32_t a2,
                                            uint32_t a3, uint64_t b, bool accumulate) {
    static_assert(R == 4 || R == 16 || R == 32 || R == 64, "m64n8, m64n32, m64n64 or m64n128");
    const int scale_d = accumulate ? 1 : 0;
    if constexpr (R == 4) {
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}"
                   ", {%4, %5, %6, %7}, %8, p, 1, 1;\n}\n"
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(scale_d));
    } else if constexpr (R == 16) {
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 " TILEGEN_SM90_D16
                   ", {%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
                   : TILEGEN_SM90_D16_OPERANDS(d)
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(scale_d));
    } else if constexpr (R == 32) {
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " TILEGEN_SM90_D32
                   ", {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
                   : TILEGEN_SM90_D32_OPERANDS(d)
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(scale_d));
    } else {
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " TILEGEN_SM90_D64
                   ", {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
                   : TILEGEN_SM90_D64_OPERANDS(d)
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(scale_d));
    }
  }
};

template <int kHeadDim, int kTileKeys>
struct AttentionMma8 {
  static_assert(kHeadDim == 128, "Q8 and K8 rows are one 128-byte swizzle line");
  static_assert(kTileKeys == 64 || kTileKeys == 128,
                "S is one m64n64 or m64n128 fragment: one or two cubes of keys in 32-key halves");
  static constexpr int kSRegs = kTileKeys / 2;    // S fragment: int32 per thread
  static constexpr int kORegs = kHeadDim / 2;     // O fragment: fp32 per thread
  static constexpr int kPRegs = kTileKeys / 8;    // P fragment: four e4m3 a register
  static constexpr int kHalfKeys = 32;
  static constexpr int kKSteps = kTileKeys / kHalfKeys;    // P V k-steps: one V^T half each
  static constexpr int kHalfBytes = kHeadDim * kHalfKeys;  // one V^T half

  // The descriptors below are sw128_descriptor's and sw32_descriptor's, built from a tile's
  // address word (address >> 4) plus each k-step's offset in 16-byte units, so an MMA costs one
  // add, not a mask and a shift (sessions 27-29: ~5 uniform instructions an MMA, 12 MMAs a
  // 128-key tile). Shared addresses lie below 2^18, so the 14-bit field needs no mask.
  static constexpr uint32_t kSw128High = (1024 >> 4) | (1u << 30);  // stride 1024 B, type 1
  static constexpr uint32_t kSw32High = (256 >> 4) | (3u << 30);    // stride 256 B, type 3
  // `smem_addr` is a shared::cta address (below 2^18 on sm_90): a larger one would spill into
  // the leading-offset field, where sw128_descriptor's mask drops it.
  static __host__ __device__ __forceinline__ constexpr uint32_t word(uint32_t smem_addr) {
    return smem_addr >> 4;
  }
  static __host__ __device__ __forceinline__ constexpr uint64_t descriptor(uint32_t word,
                                                                           uint32_t high) {
    return (static_cast<uint64_t>(high) << 32) | word;
  }
  // S: kHeadDim / 32 k-steps, each 32 bytes further along the 128-byte lines (K-major).
  static __host__ __device__ __forceinline__ constexpr uint64_t qk_descriptor(uint32_t tile_word,
                                                                              int t) {
    return descriptor(tile_word + 2 * t, kSw128High);
  }
  // P V: k-step t is V^T half t (K-major, 8-row groups 256 bytes apart).
  static __host__ __device__ __forceinline__ constexpr uint64_t pv_descriptor(
      uint32_t vt_tile_word, int t) {
    return descriptor(vt_tile_word + t * (kHalfBytes >> 4), kSw32High);
  }
  // The key of a V^T half that MMA key slot kk (0..31) reads (the pre-pass's permutation).
  static __host__ __device__ __forceinline__ constexpr int key_of_slot(int kk) {
    return 8 * (2 * (kk / 16) + (kk % 4) / 2) + 2 * ((kk % 16) / 4) + kk % 2;
  }

  static __device__ __forceinline__ void qk(int (&s)[kSRegs], uint32_t q_tile, uint32_t k_tile) {
    const uint32_t q_word = word(q_tile);
    const uint32_t k_word = word(k_tile);
#pragma unroll
    for (int t = 0; t < kHeadDim / 32; ++t)
      Wgmma8::ss(s, qk_descriptor(q_word, t), qk_descriptor(k_word, t), t > 0);
  }

  // acc = P V over O's columns kCols kPart .. kCols (kPart + 1) - 1 (kCols = kHeadDim / kParts:
  // a fresh accumulator of kCols / 2 registers, two-level accumulation); register 4 t + j of P
  // is A register j of k-step t. A part's V^T rows (head_dim channels) start kCols rows of 32
  // bytes into each key half, a whole number of swizzle atoms (256 bytes).
  template <int kParts, int kPart>
  static __device__ __forceinline__ void pv_part(float (&acc)[kORegs / kParts],
                                                 const uint32_t (&p)[kPRegs], uint32_t vt_tile) {
    constexpr uint32_t kOffset = kPart * (kHeadDim / kParts) * kHalfKeys;
    const uint32_t vt_word = word(vt_tile) + (kOffset >> 4);
#pragma unroll
    for (int t = 0; t < kKSteps; ++t)
      Wgmma8::rs(acc, p[4 * t], p[4 * t + 1], p[4 * t + 2], p[4 * t + 3],
                 pv_descriptor(vt_word, t), t > 0);
  }
  // rs = P 1: each row's sum of P in every column of an m64n8 fragment (register 0: row half
  // 0, register 2: row half 1), from a 32-key by 8-column tile of e4m3 ones (any swizzle reads
  // ones), so the row sum is of the very e4m3 values P V multiplies.
  static __device__ __forceinline__ void row_sum(float (&rs)[4], const uint32_t (&p)[kPRegs],
                                                 uint32_t ones_tile) {
    const uint64_t b = descriptor(word(ones_tile), kSw32High);
#pragma unroll
    for (int t = 0; t < kKSteps; ++t)
      Wgmma8::rs(rs, p[4 * t], p[4 * t + 1], p[4 * t + 2], p[4 * t + 3], b, t > 0);
  }
  // The whole of O's columns (64-key tiles).
  static __device__ __forceinline__ void pv(float (&acc)[kORegs], const uint32_t (&p)[kPRegs],
                                            uint32_t vt_tile) {
    pv_part<1, 0>(acc, p, vt_tile);
  }
};

// The address-word descriptors equal the masked ones for any shared address (below 2^18).
static_assert(AttentionMma8<128, 128>::qk_descriptor(AttentionMma8<128, 128>::word(0x37c00), 3) ==
              sw128_descriptor(0x37c00 + 3 * 32, 0, 1024));
static_assert(AttentionMma8<128, 128>::pv_descriptor(
                  AttentionMma8<128, 128>::word(0x2a400) + (64 * 32 >> 4), 3) ==
              sw32_descriptor(0x2a400 + 64 * 32 + 3 * 4096, 256));

}  // namespace sm90
}  // namespace tilegen
