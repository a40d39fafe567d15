// tilegen HIP library, prelude: attributes, vector types, wave and barrier helpers.
//
// Self-contained on purpose: no HIP headers and no device libraries. The kernel needs only
// clang's AMDGPU builtins, so it compiles with `-nogpuinc -nogpulib` on any clang that has the
// AMDGPU target (Debian's clang-19 included) and needs no ROCm install. These three macros are
// what hip_runtime.h would provide. The CPU executor (tilegen/backends/hip/host) compiles the
// same kernel as host C++ after a header that defines them (and the builtins) first.
#pragma once

#ifndef TG_KERNEL
#define TG_KERNEL extern "C" __attribute__((global))
#endif
#ifndef TG_DEVICE
#define TG_DEVICE __attribute__((device)) __attribute__((always_inline)) inline
#endif
#ifndef TG_SHARED
#define TG_SHARED __attribute__((shared))
#endif

namespace tg {

typedef unsigned short u16;  // a bf16 / fp16 value as raw bits: the kernel never does 16-bit math
typedef unsigned int u32;
typedef long long i64;
typedef u32 u32x2 __attribute__((ext_vector_type(2)));    // 4 x 16-bit: one MFMA operand fragment
typedef u32 u32x4 __attribute__((ext_vector_type(4)));    // 8 x 16-bit: one 16-byte global load
typedef short i16x4 __attribute__((ext_vector_type(4)));  // bf16 operands of *_bf16_1k builtins
typedef _Float16 f16x4 __attribute__((ext_vector_type(4)));
typedef float f32x4 __attribute__((ext_vector_type(4)));
typedef float f32x16 __attribute__((ext_vector_type(16)));

constexpr int kWave = 64;  // gfx942 (CDNA3) runs wave64 only
constexpr float kNegInf = -__builtin_inff();

TG_DEVICE int thread_id() { return static_cast<int>(__builtin_amdgcn_workitem_id_x()); }
TG_DEVICE int lane_id() {
  return static_cast<int>(__builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u)));
}
// The wave index, moved to an SGPR: the row offsets and LDS slices derived from it stay scalar.
TG_DEVICE int wave_id() { return __builtin_amdgcn_readfirstlane(thread_id() / kWave); }

// __syncthreads(): LDS writes issued before the barrier are visible to every wave after it.
TG_DEVICE void block_sync() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}

// Wait until this wave's global loads have landed: s_waitcnt vmcnt(0) (gfx9 encoding: vmcnt in
// bits 3:0 and 15:14, expcnt 6:4 and lgkmcnt 11:8 left at their maxima, i.e. not waited on).
TG_DEVICE void wait_global_loads() { __builtin_amdgcn_s_waitcnt(0x0f70); }

// `x` from lane (lane ^ mask). ds_bpermute uses the LDS crossbar but allocates no LDS.
TG_DEVICE float lane_xor(float x, int mask) {
  return __builtin_bit_cast(
      float, __builtin_amdgcn_ds_bpermute((lane_id() ^ mask) << 2, __builtin_bit_cast(int, x)));
}

// *p += x, one global_atomic_add_f32 (device scope), for the max_prob signal. clang's scoped
// atomics exist in every language mode, so the CPU executor's host build runs the same call.
TG_DEVICE void atomic_add_f32(float* p, float x) {
  __scoped_atomic_fetch_add(p, x, __ATOMIC_RELAXED, __MEMORY_SCOPE_DEVICE);
}

// Vector loads and stores: memcpy keeps type punning well-defined, and the alignment promise
// (every call site's address is a multiple of sizeof(T), see the tile comments) lets clang emit
// a single global_load / ds_read of sizeof(T) bytes.
template <class T>
TG_DEVICE T load_vec(const void* p) {
  T v;
  __builtin_memcpy(&v, __builtin_assume_aligned(p, sizeof(T)), sizeof(T));
  return v;
}
template <class T>
TG_DEVICE void store_vec(void* p, const T& v) {
  __builtin_memcpy(__builtin_assume_aligned(p, sizeof(T)), &v, sizeof(T));
}

}  // namespace tg
