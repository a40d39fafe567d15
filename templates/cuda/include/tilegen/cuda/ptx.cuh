// tilegen CUDA library: the PTX primitives the tile pieces are built from (16-byte async
// copies, ldmatrix, exp2 on the SFU) and the two 16-bit element types, each with its mma.sync
// m16n8k16 and its fp32 -> 16-bit pack. A kernel's traits name its element type (`Elem`).
#pragma once

namespace tilegen {

// Every element is 16 bits (bf16 or fp16); the kernel never does arithmetic on them in C++, so
// they travel as raw bits and no cuda_bf16.h / cuda_fp16.h is needed.
typedef unsigned short elem_t;

__device__ __forceinline__ unsigned smem_u32(const void* ptr) {
  return static_cast<unsigned>(__cvta_generic_to_shared(ptr));
}

// 16-byte global -> shared copy that bypasses L1 (.cg): each K/V tile is read once per CTA.
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ldmatrix .x4: lane l gives the address of row (l % 8) of 8x8 matrix (l / 8); register j of
// lane l receives matrix j's elements (row l / 4, cols 2 * (l % 4) + {0, 1}), low half first.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// .trans: register j of lane l receives M_j[2 * (l % 4) + {0, 1}][l / 4] (rows = addressed rows).
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 { %0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// The element types. mma_16816: D += A * B, m16n8k16, 16-bit inputs, fp32 accumulators. With
// g = lane / 4, c = lane % 4:
//   A (16x16, row): a0 = (g, 2c..2c+1)  a1 = (g+8, 2c..)  a2 = (g, 2c+8..)  a3 = (g+8, 2c+8..)
//   B (16x8, col):  b0 = (k 2c..2c+1, n g)  b1 = (k 2c+8..2c+9, n g)
//   C/D (16x8):     d0, d1 = (g, 2c..2c+1)  d2, d3 = (g+8, 2c..2c+1)
// pack2: two fp32 -> one register of two 16-bit values, round to nearest even. cvt puts its
// FIRST source in the HIGH half, so `hi` goes first: the lower column must sit in the low half.
struct Bf16 {
  static __device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4],
                                                   unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{ %0, %1, %2, %3}, { %4, %5, %6, %7}, { %8, %9}, { %0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

struct Fp16 {
  static __device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4],
                                                   unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{ %0, %1, %2, %3}, { %4, %5, %6, %7}, { %8, %9}, { %0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

// 2^x on the SFU (ex2.approx, 2 ulp). Arguments are always <= 0 (logit minus running max), so
// results lie in [0, 1]; ftz only drops terms below 2^-126 that cannot move an fp32 sum.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

}  // namespace tilegen
