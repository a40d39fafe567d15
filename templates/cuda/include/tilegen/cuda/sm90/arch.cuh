// tilegen CUDA library, Hopper (sm_90a) primitives: mbarriers, TMA tile copies (the bulk tensor
// copy engine), the proxy fence between them and ordinary stores, named barriers and setmaxnreg.
// Each is one PTX instruction (or a try-wait loop) behind a name that says what it does.
#pragma once

#include <cstdint>

namespace tilegen {
namespace sm90 {

// A CUtensorMap: 128 opaque bytes, 64-byte aligned, encoded on the host by the driver
// (cuTensorMapEncodeTiled; tilegen/backends/cuda/tensor_map.py) and passed by value as a
// __grid_constant__ kernel parameter, so the copy engine reads it from the parameter space.
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

__device__ __forceinline__ uint64_t map_address(const TensorMap& map) {
  return reinterpret_cast<uint64_t>(&map);
}

// Pull a tensor map into the copy engine's cache before its first use.
__device__ __forceinline__ void prefetch_map(const TensorMap& map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(map_address(map)) : "memory");
}

// ---- mbarriers (64-bit words in shared memory, addressed by their 32-bit shared address) ---
__device__ __forceinline__ void barrier_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}

// Make the barriers' initialisation visible to the copy engine (and the other threads, after a
// __syncthreads) before any copy completes on them.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also announces `bytes` of copies still to land on this phase.
__device__ __forceinline__ void barrier_expect_bytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void barrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Wait until the phase of parity `parity` has completed (the scoped labels make every inlined
// copy of the loop its own).
__device__ __forceinline__ void barrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_loop:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_loop;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// ---- TMA: tiles of a 2-D tensor map (coordinates: column, then row) ------------------------
// Global -> shared, completing `bytes` on `bar` (announced by barrier_expect_bytes).
__device__ __forceinline__ void tma_load(uint32_t dst, const TensorMap& map, uint32_t bar,
                                         int col, int row) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(dst),
      "l"(map_address(map)), "r"(bar), "r"(col), "r"(row)
      : "memory");
}

// A contiguous global -> shared copy of `bytes` (a multiple of 16; both addresses 16-byte
// aligned), completing on `bar` like a tile.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// Shared -> global; completion is tracked per thread by bulk groups.
__device__ __forceinline__ void tma_store(const TensorMap& map, uint32_t src, int col, int row) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n"
               ::"l"(map_address(map)), "r"(src), "r"(col), "r"(row)
               : "memory");
}

__device__ __forceinline__ void tma_store_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

// The stores have finished reading shared memory (the CTA may then exit or reuse it).
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

// Ordinary stores to shared memory, then a reader in the async proxy (TMA store, wgmma).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- named barriers (id 0 is __syncthreads') ------------------------------------------------
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- register budget per warpgroup (needs a register cap at entry: __launch_bounds__) ------
template <int kRegs>
__device__ __forceinline__ void raise_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

template <int kRegs>
__device__ __forceinline__ void lower_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

}  // namespace sm90
}  // namespace tilegen
