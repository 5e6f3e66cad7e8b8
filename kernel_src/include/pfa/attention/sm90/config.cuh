// Tile shape and shared-memory layout of the sm_90a prefill (prefill_sm90.cuh).
//
// A CTA is one producer warpgroup (loads) and CONSUMERS warpgroups of 64 query rows each
// (BLOCK_M = 64 * CONSUMERS packed rows). Every tile in shared memory is stored in the wgmma
// 128-byte-swizzle layout (ptx/sm90.cuh): column blocks of 64 elements, 128-byte rows, chunk c of
// row r at c ^ (r % 8). Layout, each part 1024-byte aligned:
//   Q [BLOCK_M x D] | K stages [STAGES][BLOCK_N x D] | V stages [STAGES][BLOCK_N x D] | mbarriers
//   | (PAGED, by cp.async) page ids [2][BLOCK_N]
#pragma once
#include <stdint.h>

namespace pfa {

template <typename T_, int HEAD_DIM_, int BLOCK_N_, int CONSUMERS_, int STAGES_, bool PAGED_, bool TMA_ = false>
struct PrefillSm90Config {
  using Elem = T_;
  static_assert(sizeof(T_) == 2, "16-bit Q/K/V");
  static constexpr int HEAD_DIM = HEAD_DIM_, BLOCK_N = BLOCK_N_, CONSUMERS = CONSUMERS_, STAGES = STAGES_;
  static constexpr bool PAGED = PAGED_;
  // Whether the epilogue writes the NVFP4 output (o_format kOutNvfp4): the paged kernels up to
  // hd128 (the context API runs on paged kernels; at hd256 it added tile-loop reloads of spilled
  // values). variants.py's nvfp4_out mirrors the rule; the host routes NVFP4 outputs by it.
  static constexpr bool NVFP4_OUT = PAGED && HEAD_DIM_ <= 128;
  // K/V tiles by TMA (PrefillParams::k_tmap / v_tmap; producer_tma.cuh): one producer warp issues
  // the boxes of a tile instead of every producer thread a cp.async per chunk.
  static constexpr bool TMA = TMA_;
  static_assert(!PAGED || TMA || BLOCK_N <= 128, "paged: one producer thread stages each row's page id");
  static constexpr int WG_THREADS = 128;
  static constexpr int WG_ROWS = 64;  // rows of one m64 wgmma: one consumer warpgroup
  static constexpr int THREADS = (CONSUMERS + 1) * WG_THREADS;
  static constexpr int BLOCK_M = CONSUMERS * WG_ROWS;
  static_assert(HEAD_DIM % 64 == 0, "head_dim in whole 128-byte swizzle blocks");
  static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 256, "BLOCK_N: k-steps of 16 keys, one wgmma N");

  static constexpr int CHUNK_BYTES = 16;
  static constexpr int CPR = HEAD_DIM * 2 / CHUNK_BYTES;  // 16-byte chunks per row
  static constexpr int ROW_BYTES = 128;                   // one row of one column block
  static constexpr int ATOM_BYTES = 8 * ROW_BYTES;        // the swizzle's 8-row repeat
  static constexpr int Q_BYTES = BLOCK_M * HEAD_DIM * 2;
  static constexpr int KV_TILE_BYTES = BLOCK_N * HEAD_DIM * 2;
  static constexpr int Q_OFFSET = 0;
  static constexpr int K_OFFSET = Q_OFFSET + Q_BYTES;
  static constexpr int V_OFFSET = K_OFFSET + STAGES * KV_TILE_BYTES;
  static constexpr int BAR_OFFSET = V_OFFSET + STAGES * KV_TILE_BYTES;
  // q_full, then per stage k_full, v_full, k_empty, v_empty
  static constexpr int NUM_BARRIERS = 1 + 4 * STAGES;
  // PAGED by cp.async: the page id of every row of a tile, double-buffered (the producer stages a
  // tile's ids while its threads may still read the previous tile's); TMA keeps them in registers
  static constexpr int IDS_OFFSET = BAR_OFFSET + NUM_BARRIERS * 8;
  static constexpr int IDS_BYTES = PAGED && !TMA ? 2 * BLOCK_N * 4 : 0;
  // + 1024: the dynamic shared memory base is rounded up to the swizzle atom at run time
  static constexpr int SMEM_BYTES = IDS_OFFSET + IDS_BYTES + ATOM_BYTES;
  // named barriers: 0 = __syncthreads, 1 .. CONSUMERS = the consumers' turns (consumer.cuh), then
  // the producer warpgroup's page-id staging, then each consumer's skip-softmax vote
  static constexpr int PRODUCER_BAR = 1 + CONSUMERS;
  static constexpr int SKIP_VOTE_BAR = PRODUCER_BAR + 1;  // + the consumer's index
  static_assert(SKIP_VOTE_BAR + CONSUMERS <= 16, "16 named barriers");
  static_assert(BLOCK_N * ROW_BYTES % ATOM_BYTES == 0 && KV_TILE_BYTES % ATOM_BYTES == 0, "1024-byte tiles");

  // Producer registers after setmaxnreg, and the consumers': together within the register file
  // (65536 per SM, one CTA per SM).
  static constexpr int PRODUCER_REGS = CONSUMERS == 2 ? 40 : 32;
  static constexpr int CONSUMER_REGS = CONSUMERS == 2 ? 232 : 160;
  static_assert(PRODUCER_REGS * WG_THREADS + CONSUMER_REGS * WG_THREADS * CONSUMERS <= 65536, "register file");

  // Byte offset of (row, 16-byte chunk) in a swizzled tile of `rows` rows.
  static __device__ __forceinline__ uint32_t swz(int rows, int row, int chunk) {
    return (uint32_t)((chunk >> 3) * rows * ROW_BYTES + row * ROW_BYTES + (((chunk & 7) ^ (row & 7)) << 4));
  }

  // mbarrier addresses (shared window) from the aligned base.
  static __device__ __forceinline__ uint32_t q_full(uint32_t base) { return base + BAR_OFFSET; }
  static __device__ __forceinline__ uint32_t k_full(uint32_t base, int s) { return base + BAR_OFFSET + 8 * (1 + s); }
  static __device__ __forceinline__ uint32_t v_full(uint32_t base, int s) {
    return base + BAR_OFFSET + 8 * (1 + STAGES + s);
  }
  static __device__ __forceinline__ uint32_t k_empty(uint32_t base, int s) {
    return base + BAR_OFFSET + 8 * (1 + 2 * STAGES + s);
  }
  static __device__ __forceinline__ uint32_t v_empty(uint32_t base, int s) {
    return base + BAR_OFFSET + 8 * (1 + 3 * STAGES + s);
  }
};

}  // namespace pfa
