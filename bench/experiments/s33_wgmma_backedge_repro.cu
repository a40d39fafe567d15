// Session 33 (issue #19): which orders of 8-bit wgmma commit groups ptxas (nvcc 13.0) keeps
// asynchronous. Build each pattern and read ptxas's notes (C7513 / C7514: every MMA serialized):
//   for v in "-DPATTERN=1" "-DPATTERN=2 -DAHEAD=0" "-DPATTERN=2 -DAHEAD=1" "-DPATTERN=3" \
//            "-DPATTERN=4"; do
//     nvcc -arch=sm_90a -O3 -std=c++17 -Xptxas -v -Itemplates/cuda/include $v -cubin \
//       -o /tmp/r.cubin bench/experiments/s33_wgmma_backedge_repro.cu 2>&1 | grep -E "C75|spill"
//   done
// Seen: 1, 3 and 4 clean; 2 (an MMA committed at the loop's end and waited at its top, with or
// without S ahead) C7514. So no MMA may be in flight across a loop's back edge, while inside
// one turn `wait_group 1` may retire either of two groups (3: [P.V][S], 4: [S][P.V]).
// Not a kernel of the product: it computes nothing meaningful (descriptors are dummies).
#include <cstdint>
#include "tilegen/cuda/sm90/wgmma.cuh"
using namespace tilegen::sm90;
// PATTERN 1: landed order  [ss S][rs part] wait1 -> read S ; wait0 -> read acc
// PATTERN 2: S-ahead order [rs part][ss S] wait1 -> read acc ; loop: [rs part'] wait1 -> read S
extern "C" __global__ void k(float* out, uint64_t da, uint64_t db, int n) {
  int s[64];
  float acc[32];
  float o[32];
  uint32_t p[4] = {0, 0, 0, 0};
  for (int i = 0; i < 32; ++i) o[i] = 0.f;
#if PATTERN == 3
  for (int j = 0; j < n; ++j) {
    fence_operands(acc);
    wgmma_fence();
    Wgmma8::rs(acc, p[0], p[1], p[2], p[3], db, false);
    wgmma_commit();
    wgmma_fence();
    for (int t = 0; t < 4; ++t) Wgmma8::ss(s, da + t, db + t, t > 0);
    wgmma_commit();
    wgmma_wait<1>();     // the part landed, S may run
    fence_operands(acc);
    for (int i = 0; i < 32; ++i) o[i] += acc[i];
    wgmma_wait<0>();
    fence_operands(s);
    float m = 0.f;
    for (int i = 0; i < 64; ++i) m += (float)s[i];
    p[0] = __float_as_uint(m);
  }
#elif PATTERN == 4
  // like 3 with the ss first: [ss][rs] wait1 -> read S
  for (int j = 0; j < n; ++j) {
    wgmma_fence();
    for (int t = 0; t < 4; ++t) Wgmma8::ss(s, da + t, db + t, t > 0);
    wgmma_commit();
    fence_operands(acc);
    wgmma_fence();
    Wgmma8::rs(acc, p[0], p[1], p[2], p[3], db, false);
    wgmma_commit();
    wgmma_wait<1>();
    fence_operands(s);
    float m = 0.f;
    for (int i = 0; i < 64; ++i) m += (float)s[i];
    wgmma_wait<0>();
    fence_operands(acc);
    for (int i = 0; i < 32; ++i) o[i] += acc[i];
    p[0] = __float_as_uint(m);
  }
#elif PATTERN == 1
  for (int j = 0; j < n; ++j) {
    wgmma_fence();
    for (int t = 0; t < 4; ++t) Wgmma8::ss(s, da + t, db + t, t > 0);
    wgmma_commit();
    fence_operands(acc);
    wgmma_fence();
    Wgmma8::rs(acc, p[0], p[1], p[2], p[3], db, false);
    wgmma_commit();
    wgmma_wait<1>();
    fence_operands(s);
    float m = 0.f;
    for (int i = 0; i < 64; ++i) m += (float)s[i];
    wgmma_wait<0>();
    fence_operands(acc);
    for (int i = 0; i < 32; ++i) o[i] += acc[i] * m;
    p[0] = __float_as_uint(m);
  }
#else
  wgmma_fence();
  for (int t = 0; t < 4; ++t) Wgmma8::ss(s, da + t, db + t, t > 0);
  wgmma_commit();
  for (int j = 0; j < n; ++j) {
    fence_operands(acc);
    wgmma_fence();
    Wgmma8::rs(acc, p[0], p[1], p[2], p[3], db, false);
    wgmma_commit();
    wgmma_wait<1>();     // S landed, the part may run
    fence_operands(s);
    float m = 0.f;
    for (int i = 0; i < 64; ++i) m += (float)s[i];
#if AHEAD
    wgmma_fence();
    for (int t = 0; t < 4; ++t) Wgmma8::ss(s, da + t, db + t, t > 0);   // next S, ahead
    wgmma_commit();
    wgmma_wait<1>();     // the part landed, the next S may run
#else
    wgmma_wait<0>();
#endif
    fence_operands(acc);
    for (int i = 0; i < 32; ++i) o[i] += acc[i] * m;
    p[0] = __float_as_uint(m);
#if !AHEAD
    wgmma_fence();
    for (int t = 0; t < 4; ++t) Wgmma8::ss(s, da + t, db + t, t > 0);
    wgmma_commit();
#endif
  }
  wgmma_wait<0>();
  fence_operands(s);
  o[0] += s[0];
#endif
  for (int i = 0; i < 32; ++i) out[threadIdx.x * 32 + i] = o[i];
}
