// tilegen HIP library, block tile: where a (batch, head) token row lives in global memory (the
// layouts a config chooses from), the LUT walk over the KV sub-tiles of one query cube, and the
// cooperative global -> register -> LDS copy of one K/V sub-tile by the whole workgroup.
#pragma once

#include "tilegen/hip/prelude.hpp"

namespace tg {

// Token rows of one (batch, head) in a contiguous tensor; q, k, v and o share the layout.
// BSHD (batch, seq, heads, head_dim): consecutive tokens are num_heads * head_dim apart.
struct Bshd {
  // Element offset of token 0 of (b, h).
  static TG_DEVICE i64 base(i64 b, i64 h, int seq_len, int num_heads, int head_dim) {
    return (b * seq_len * num_heads + h) * head_dim;
  }
  // Elements between consecutive token rows.
  static TG_DEVICE i64 row_stride(int num_heads, int head_dim) {
    return static_cast<i64>(num_heads) * head_dim;
  }
};

// BHSD (batch, heads, seq, head_dim): each (b, h) is one dense [seq x head_dim] block.
struct Bhsd {
  static TG_DEVICE i64 base(i64 b, i64 h, int seq_len, int num_heads, int head_dim) {
    return (b * num_heads + h) * seq_len * head_dim;
  }
  static TG_DEVICE i64 row_stride(int num_heads, int head_dim) {
    static_cast<void>(num_heads);
    return head_dim;
  }
};

// Walks the KV sub-tiles of one query cube in the order the Triton kernel does: LUT slots
// 0 .. n_blocks-1, and inside each named cube the BLOCK_N-key sub-tiles that start before
// vbs[cube] (sub-tile 0 always does: vbs >= 1). Every value is workgroup-uniform, so the loads
// are scalar and every wave sees the same sequence (the barriers in the loop stay matched).
template <class C>
struct KvCursor {
  const int* lut;  // this query cube's LUT row
  const int* vbs;
  int n_blocks;    // counts[...] or TOPK
  int slot = 0;    // LUT slot
  int sub = 0;     // sub-tile within the cube
  int cube = 0;    // lut[slot]
  int n_valid = 0; // real keys in the cube: vbs[cube] (BLOCK_KV when every cube is full)

  TG_DEVICE KvCursor(const int* lut_row, const int* vbs_, int n)
      : lut(lut_row), vbs(vbs_), n_blocks(n) { fetch(); }
  TG_DEVICE void fetch() {
    if (slot < n_blocks) {
      cube = lut[slot];
      if constexpr (C::VBS) {
        n_valid = vbs[cube];
      } else {
        n_valid = C::BLOCK_KV;  // variable block sizes off: vbs is never read
      }
    }
  }
  TG_DEVICE bool valid() const { return slot < n_blocks; }
  // First token (row of k / v) of the current sub-tile.
  TG_DEVICE int first_token() const { return cube * C::BLOCK_KV + sub * C::BLOCK_N; }
  TG_DEVICE void advance() {
    if (++sub == C::SUBTILES || sub * C::BLOCK_N >= n_valid) {
      sub = 0;
      ++slot;
      fetch();
    }
  }
};

// LDS rows hold 8-byte units (4 elements: one MFMA operand fragment). A row of 128 bytes or more
// starts on bank 0 whatever its index, a shorter one on bank 0 every 16 / UNITS rows; XOR-ing the
// unit index with the row's place in that cycle sends the 16 rows one operand read touches (same
// logical unit) to 16 different bank pairs. No padding: the default config's two stages take
// exactly 32 KiB, so two workgroups share a CU's 64 KiB.
template <int UNITS>
struct Swizzle {
  static constexpr int ROWS_PER_WINDOW = UNITS >= 16 ? 1 : 16 / UNITS;
  static constexpr int SPAN = UNITS >= 16 ? 16 : UNITS;
  // Element offset of element e (e % 4 == 0 for 8-byte accesses) of row `row`.
  static constexpr int offset(int row, int e) {
    return row * (4 * UNITS) + 4 * ((e / 4) ^ ((row / ROWS_PER_WINDOW) % SPAN)) + e % 4;
  }
};

// One LDS stage holds one K/V sub-tile [BLOCK_N keys x HEAD_DIM]:
//   K   row-major [key][d]: the QK MFMA's A operand is 4 consecutive d of one key per lane;
//   V^T transposed [d][key], after K: the PV MFMA's A operand is V^T (4 consecutive keys of one
//       d per lane), then one 8-byte read instead of four 2-byte ones.
template <class C>
struct StageLayout {
  typedef Swizzle<C::HEAD_DIM / 4> KSwz;
  typedef Swizzle<C::BLOCK_N / 4> VSwz;
  static constexpr int k(int key, int d) { return KSwz::offset(key, d); }
  static constexpr int vt(int d, int key) {
    return C::BLOCK_N * C::HEAD_DIM + VSwz::offset(d, key);
  }
};

// The whole workgroup copies a sub-tile global -> registers -> LDS in 16-byte chunks (8 elements
// of one row); chunk c goes to thread c % THREADS. K chunks run along the rows, so consecutive
// threads read consecutive pieces of a row (coalesced). V chunks run down the keys, so the
// transposed 2-byte LDS writes of a wave land on consecutive addresses. load() only issues the
// global loads and store() writes LDS, so the next tile's loads fly while the MFMAs run.
template <class C>
struct KvBlockTile {
  typedef StageLayout<C> L;
  static constexpr int ROW_CHUNKS = C::HEAD_DIM / 8;
  static constexpr int CHUNKS = C::BLOCK_N * ROW_CHUNKS;
  static constexpr int STEPS = (CHUNKS + C::THREADS - 1) / C::THREADS;
  // Chunk c -> (key, first d) of its K piece and of its V piece.
  static constexpr int k_key(int c) { return c / ROW_CHUNKS; }
  static constexpr int k_d(int c) { return (c % ROW_CHUNKS) * 8; }
  static constexpr int v_key(int c) { return c % C::BLOCK_N; }
  static constexpr int v_d(int c) { return (c / C::BLOCK_N) * 8; }
  u32x4 k[STEPS];
  u32x4 v[STEPS];

  // row0: element offset of the sub-tile's first key. Global addresses are multiples of 16
  // bytes: 16-byte aligned tensors (the launcher checks) and row strides that are multiples of
  // HEAD_DIM.
  TG_DEVICE void load(const u16* K, const u16* V, i64 row0, i64 row_stride, int tid) {
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      const int c = tid + s * C::THREADS;
      if (CHUNKS % C::THREADS == 0 || c < CHUNKS) {
        k[s] = load_vec<u32x4>(K + row0 + k_key(c) * row_stride + k_d(c));
        v[s] = load_vec<u32x4>(V + row0 + v_key(c) * row_stride + v_d(c));
      }
    }
  }

  TG_DEVICE void store(u16* stage, int tid) const {
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      const int c = tid + s * C::THREADS;
      if (CHUNKS % C::THREADS == 0 || c < CHUNKS) {
        const int key = k_key(c);
        const int d = k_d(c);
        // The two 8-byte units of a chunk are swizzled independently: two 8-byte writes.
        store_vec<u32x2>(stage + L::k(key, d), u32x2{k[s].x, k[s].y});
        store_vec<u32x2>(stage + L::k(key, d + 4), u32x2{k[s].z, k[s].w});
#pragma unroll
        for (int e = 0; e < 8; ++e)
          stage[L::vt(v_d(c) + e, v_key(c))] = static_cast<u16>(v[s][e >> 1] >> (16 * (e & 1)));
      }
    }
  }
};

}  // namespace tg
