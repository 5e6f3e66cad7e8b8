// What every sm_90a prefill configuration shares (config.cuh: 16-bit Q/K/V, fp8_config.cuh: e4m3):
// the warp roles (one producer warpgroup, CONSUMERS consumer warpgroups of 64 rows) and their
// register split, the 128-byte swizzle, and the mbarrier ring at BAR_OFFSET behind the tiles
// (q_full, then per stage k_full, v_full, k_empty, v_empty). A configuration derives from it with
// its own layout's BAR_OFFSET.
#pragma once
#include <stdint.h>

namespace pfa {

// Where a CTA's roles stand in the ring after the work items it has run (sm90/cta.cuh): a work
// item's K/V tile `it` sits in stage (tile0 + it) % STAGES at phase ((tile0 + it) / STAGES) & 1,
// and its Q is the q_round-th Q the CTA loads (q_full / q_empty phase q_round & 1). Each role
// keeps its own copy and advances it by the same items. A one-CTA-a-block kernel runs one item
// from zero.
struct Sm90Walk {
  int tile0 = 0;    // K/V tiles of the items before
  int q_round = 0;  // items before that loaded a Q (those with a tile to visit)
  int tails = 0;    // (TMA producer) tail tiles before: the tail barrier's phase
  __device__ __forceinline__ void advance(int num_tiles) {
    tile0 += num_tiles;
    q_round += num_tiles > 0;
  }
  template <int STAGES>
  __device__ __forceinline__ int stage(int it) const {
    return (tile0 + it) % STAGES;
  }
  template <int STAGES>
  __device__ __forceinline__ uint32_t phase(int it) const {
    return ((tile0 + it) / STAGES) & 1;
  }
};

// The producer warpgroup's registers after setmaxnreg: 40 with two consumers, 32 with three; 56
// with two (the consumers then get 8 fewer each, 224, where none of them spills) for a producer
// that widens one-byte K/V (PrefillSm90Config::KV_FP8: its widening keeps several chunks' loads in
// flight), and for the paged 16-bit rows up to hd128. Their producer compiles to the same code at
// 56; it is their consumers, scheduled by ptxas for 224 registers, that ran paged batches 6-9%
// faster (NOTES.md, session 31). The contiguous rows' consumers ran single prefill 1-2% slower at
// 224, so they keep 40, as do the hd256 paged rows (their skip twin's consumer spills grow). The
// paged e4m3 hd128 row takes 56 too (fp8_config.cuh): persistent, its producer spilled in the copy
// loop at 40 (NOTES.md, session 32).
constexpr int sm90_producer_regs(int consumers, bool widens = false, bool paged = false) {
  return consumers == 2 ? (widens || paged ? 56 : 40) : 32;
}

// PRODUCER_REGS_: the producer's registers (sm90_producer_regs); the consumers take what is left
// (CONSUMER_REGS).
template <int CONSUMERS_, int STAGES_, int BAR_OFFSET_, int PRODUCER_REGS_ = sm90_producer_regs(CONSUMERS_)>
struct Sm90Pipeline {
  static constexpr int CONSUMERS = CONSUMERS_, STAGES = STAGES_, BAR_OFFSET = BAR_OFFSET_;
  static constexpr int WG_THREADS = 128;
  static constexpr int WG_ROWS = 64;  // rows of one m64 wgmma: one consumer warpgroup
  static constexpr int THREADS = (CONSUMERS + 1) * WG_THREADS;
  static constexpr int BLOCK_M = CONSUMERS * WG_ROWS;
  static constexpr int CHUNK_BYTES = 16;
  static constexpr int ROW_BYTES = 128;             // one row of one column block
  static constexpr int ATOM_BYTES = 8 * ROW_BYTES;  // the swizzle's 8-row repeat
  static constexpr int NUM_BARRIERS = 1 + 4 * STAGES;
  // named barriers: 0 = __syncthreads, 1 .. CONSUMERS = the consumers' turns, then the producer's
  static constexpr int PRODUCER_BAR = 1 + CONSUMERS;

  // Producer registers after setmaxnreg, and the consumers': the rest of the register file (65536
  // per SM, one CTA per SM) in setmaxnreg's steps of 8 (two consumers 232, three 160 by default).
  static constexpr int PRODUCER_REGS = PRODUCER_REGS_;
  static constexpr int CONSUMER_REGS = (65536 / WG_THREADS - PRODUCER_REGS) / CONSUMERS / 8 * 8;
  static_assert(PRODUCER_REGS * WG_THREADS + CONSUMER_REGS * WG_THREADS * CONSUMERS <= 65536, "register file");
  // setmaxnreg moves registers within what the launch gave the CTA (__launch_bounds__(THREADS, 1):
  // 65536 / THREADS a thread, in steps of 8): the consumers' increase must come out of what the
  // producer gives up, or their setmaxnreg.inc waits forever.
  static constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8;
  static_assert((LAUNCH_REGS - PRODUCER_REGS) >= (CONSUMER_REGS - LAUNCH_REGS) * CONSUMERS,
                "the consumers' registers come from the producer's");

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
