// Tile shape and shared-memory layout of the sm_90a prefill (prefill_sm90.cuh).
//
// A CTA is one producer warpgroup (loads) and CONSUMERS warpgroups of 64 query rows each
// (BLOCK_M = 64 * CONSUMERS packed rows). Every tile in shared memory is stored in the wgmma
// 128-byte-swizzle layout (ptx/sm90.cuh): column blocks of 64 elements, 128-byte rows, chunk c of
// row r at c ^ (r % 8). Layout, each part 1024-byte aligned:
//   Q [BLOCK_M x D] | K stages [STAGES][BLOCK_N x D] | V stages [STAGES][BLOCK_N x D]
//   | (KV_FP8) raw K, V [2][BLOCK_N x 128 bytes] | mbarriers | (TMA) the tail tile's mbarrier
//   | (PERSISTENT) the Q tile's "empty" mbarrier, the tile scheduler's index ring
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "pfa/attention/sm90/pipeline.cuh"

namespace pfa {

// Bytes of one raw (one-byte) K or V tile of the KV_FP8 rows: BLOCK_N rows of 128 bytes (a 64-dim
// row fills the first half of its swizzle row, as the fp8 family's ROW_PAD).
constexpr int sm90_raw_tile_bytes(int head_dim, int block_n) { return block_n * (head_dim < 128 ? 128 : head_dim); }

// The shared-memory offset of the mbarriers: behind Q and the K and V stages (16-bit elements),
// and (kv_fp8) the two raw K / V tile pairs.
constexpr int sm90_bar_offset(int head_dim, int block_n, int consumers, int stages, bool kv_fp8 = false) {
  return consumers * 64 * head_dim * 2 + 2 * stages * block_n * head_dim * 2 +
         (kv_fp8 ? 4 * sm90_raw_tile_bytes(head_dim, block_n) : 0);
}

template <typename T_, int HEAD_DIM_, int BLOCK_N_, int CONSUMERS_, int STAGES_, bool PAGED_, bool TMA_ = false,
          bool PERSISTENT_ = false, bool KV_FP8_ = false, bool DENSE_KV_ = false, bool SPAN_KV_ = false>
struct PrefillSm90Config
    : Sm90Pipeline<CONSUMERS_, STAGES_, sm90_bar_offset(HEAD_DIM_, BLOCK_N_, CONSUMERS_, STAGES_, KV_FP8_),
                   sm90_producer_regs(CONSUMERS_, KV_FP8_, PAGED_ && HEAD_DIM_ <= 128)> {
  using Base = Sm90Pipeline<CONSUMERS_, STAGES_, sm90_bar_offset(HEAD_DIM_, BLOCK_N_, CONSUMERS_, STAGES_, KV_FP8_),
                            sm90_producer_regs(CONSUMERS_, KV_FP8_, PAGED_ && HEAD_DIM_ <= 128)>;
  using Base::ATOM_BYTES, Base::BAR_OFFSET, Base::BLOCK_M, Base::CHUNK_BYTES, Base::CONSUMERS, Base::NUM_BARRIERS,
      Base::PRODUCER_BAR, Base::ROW_BYTES, Base::STAGES;
  using Elem = T_;
  static_assert(sizeof(T_) == 2, "16-bit Q/K/V");
  static constexpr int HEAD_DIM = HEAD_DIM_, BLOCK_N = BLOCK_N_;
  static constexpr bool PAGED = PAGED_;
  // Whether the epilogue writes the NVFP4 output (o_format kOutNvfp4): the paged kernels up to
  // hd128 (the context API runs on paged kernels; at hd256 it added tile-loop reloads of spilled
  // values). variants.py's nvfp4_out mirrors the rule; the host routes NVFP4 outputs by it.
  static constexpr bool NVFP4_OUT = PAGED && HEAD_DIM_ <= 128;
  // K/V tiles by TMA (PrefillParams::k_tmap / v_tmap; producer_tma.cuh): one producer warp issues
  // the boxes of a tile instead of every producer thread a cp.async per chunk.
  static constexpr bool TMA = TMA_;
  // The CTAs walk the logical grid (PrefillParams::grid_x/y/z, sm90/cta.cuh) instead of one CTA a
  // block: the K/V ring runs on across work items, and the producer loads the next item's Q once
  // the consumers have released this one's (q_empty), while they finish its last tiles and epilogue.
  static constexpr bool PERSISTENT = PERSISTENT_;
  // A persistent launch may share its last blocks out as ranges of KV tiles (sm90/stream_k.cuh,
  // PrefillParams::sk_tiles; the consumers' hand-off is in prefill_sm90.cuh's consume): the rows
  // single prefill runs only (contiguous 16-bit K/V), so the paged and fp8-K/V rows compile none of it
  static constexpr bool STREAM_K = PERSISTENT && !PAGED_ && !KV_FP8_;
  // One-byte K/V (e4m3fn or e5m2: PrefillParams::kv_fp8) under a 16-bit Q: the producer copies each
  // K / V tile as stored into a raw tile pair (2 buffers) and widens it into the 16-bit K / V stage
  // the consumers read (sm90/widen_producer.cuh); consumers and epilogue are the 16-bit ones.
  static constexpr bool KV_FP8 = KV_FP8_;
  static_assert(!KV_FP8 || (!TMA && HEAD_DIM <= 128 && BLOCK_N <= 128), "fp8 K/V: cp.async raw tiles of 128-byte rows");
  // The paged copies' dense twin: a kv head's slots of a page are back to back (k_stride_n and
  // v_stride_n == HEAD_DIM: an HND cache, or NHD with one kv head), which the host guarantees
  // before it launches this kernel (routing.dense_twin; otherwise the row without it runs). A page
  // run's copies then step by a constant: one base address plus immediates, and one compare of the
  // rows left a copy (producer.cuh dense_rows_in_runs).
  static constexpr bool DENSE_KV = DENSE_KV_;
  static_assert(!DENSE_KV || (PAGED && !TMA && !KV_FP8 && HEAD_DIM <= 128), "dense: the 16-bit paged copies");
  // The 16-bit strided paged copies in warp spans (producer.cuh load_tile_spans: a warp's 32 rows
  // of a tile, few pages a thread) instead of rows interleaved across the warpgroup. Same-process
  // A/B (NOTES.md, session 40): hd64 +0.7-2.7% at pages 16-64 (its interleaved rows ran 16 apart,
  // runs of a page up to 4 copies), -0.2 to -0.4% at page 8; hd128 +0.8-1.3% at page 16 but -2 to
  // -6% at pages 8, 32 and 64. So hd64 rows always, hd128 in a page-16 twin of its own (SPAN_KV_: name +
  // "_span", routing.span_pays; compiled beside the interleaved copies it cost the other pages
  // 1.4-5.3%, session 39).
  static constexpr bool SPAN_KV = SPAN_KV_;
  static_assert(!SPAN_KV || (PAGED && !TMA && !KV_FP8 && !DENSE_KV && HEAD_DIM == 128), "spans: the hd128 twin");
  static constexpr bool SPANS = PAGED && !TMA && !KV_FP8 && !DENSE_KV && BLOCK_N == 128 && (HEAD_DIM == 64 || SPAN_KV);
  // The V stages' and P's element type, the P V GEMM's: KV_FP8 widens V to fp16 under either
  // query dtype (e4m3 / e5m2 values are exact in fp16, P in [0, 1] is at least as exact as in
  // bf16, and an e4m3 pair becomes fp16 in one hardware conversion, bf16 in four bit operations);
  // otherwise the query's.
  using VElem = typename std::conditional<KV_FP8, half, T_>::type;
  static_assert(!PAGED || TMA || BLOCK_N <= 128, "paged by cp.async: one lane of a producer warp owns each row");
  static_assert(HEAD_DIM % 64 == 0, "head_dim in whole 128-byte swizzle blocks");
  static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 256, "BLOCK_N: k-steps of 16 keys, one wgmma N");

  static constexpr int CPR = HEAD_DIM * 2 / CHUNK_BYTES;  // 16-byte chunks per row
  static constexpr int Q_BYTES = BLOCK_M * HEAD_DIM * 2;
  static constexpr int KV_TILE_BYTES = BLOCK_N * HEAD_DIM * 2;
  static constexpr int Q_OFFSET = 0;
  static constexpr int K_OFFSET = Q_OFFSET + Q_BYTES;
  static constexpr int V_OFFSET = K_OFFSET + STAGES * KV_TILE_BYTES;
  // KV_FP8: raw K of buffer b at RAW_OFFSET + 2 b RAW_TILE_BYTES, its raw V right behind it
  static constexpr int RAW_OFFSET = V_OFFSET + STAGES * KV_TILE_BYTES;
  static constexpr int RAW_TILE_BYTES = KV_FP8 ? sm90_raw_tile_bytes(HEAD_DIM, BLOCK_N) : 0;
  static_assert(BAR_OFFSET == RAW_OFFSET + 4 * RAW_TILE_BYTES, "sm90_bar_offset: the mbarriers follow V (and raw K / V)");
  // TMA: the mbarriers a request's last V tile lands on before producer warps 1..3 zero its rows
  // past kv_len and complete the stage (producer_tma.cuh), one per stage: warp 0 runs ahead of
  // them by fewer tails than that
  static constexpr int TAIL_BAR_OFFSET = BAR_OFFSET + NUM_BARRIERS * 8;
  static constexpr int TAIL_BAR_BYTES = TMA ? 8 * STAGES : 0;
  // TMA: producer warp 0 goes on without warps 1..3 (the tail's zeroing, the block index's handoff
  // through the scheduler's ring, Q's arrivals: tile_scheduler.cuh, producer.cuh)
  static constexpr bool TAIL_WARPS = TMA;
  // Persistent: the consumers take and decode the walk's next block before this block's epilogue
  // (cta.cuh); AHEAD_WHEN_READY: only where its index is in the ring already, else after the
  // epilogue. Measured per row (NOTES.md, session 34): the ragged and contiguous hd128 rows gained
  // 0.5-1.2%; the paged rows lost 0.3-0.7% when they waited for the index there, and gain 0.8-1.4%
  // (TRT-LLM's HND pages) without; hd64 lost up to 2% at 2k causal (its three consumers spilled more).
  static constexpr bool DECODE_AHEAD = PERSISTENT && !KV_FP8 && HEAD_DIM >= 128;
  static constexpr bool AHEAD_WHEN_READY = PAGED;
  // init_ring_barriers: the arrivals k_full / v_full count (TMA: the issuing warp's one, else one a
  // producer thread), and the one-arrival barriers at TMA_BAR_OFFSET (the tail's)
  static constexpr int K_FULL_ARRIVALS = TMA ? 1 : Base::WG_THREADS, V_FULL_ARRIVALS = K_FULL_ARRIVALS;
  static constexpr int TMA_BAR_OFFSET = TAIL_BAR_OFFSET, TMA_BARS = TAIL_BAR_BYTES / 8;
  static constexpr int tma_bar_arrivals(int) { return 1; }
  // PERSISTENT: the Q tile's "empty" barrier, one arrival per consumer thread once the work item's
  // S GEMMs are done with Q (ConsumerSm90::release_q)
  static constexpr int Q_EMPTY_BAR_OFFSET = TAIL_BAR_OFFSET + TAIL_BAR_BYTES;
  static constexpr int Q_EMPTY_BAR_BYTES = PERSISTENT ? 8 : 0;
  static __device__ __forceinline__ uint32_t q_empty(uint32_t base) { return base + Q_EMPTY_BAR_OFFSET; }
  // PERSISTENT: the tile scheduler's index ring (sm90/tile_scheduler.cuh: 4 mbarriers, 2 indices)
  static constexpr int SCHED_OFFSET = Q_EMPTY_BAR_OFFSET + Q_EMPTY_BAR_BYTES;
  static constexpr int SCHED_BYTES = PERSISTENT ? 40 : 0;
  // + 1024: the dynamic shared memory base is rounded up to the swizzle atom at run time
  static constexpr int SMEM_BYTES = SCHED_OFFSET + SCHED_BYTES + ATOM_BYTES;
  // named barriers after the pipeline's (sm90/pipeline.cuh): each consumer's own (+ its index):
  // its skip-softmax vote, its stream-K hand-off (sm90/stream_k.cuh)
  static constexpr int SKIP_VOTE_BAR = PRODUCER_BAR + 1;  // + the consumer's index
  static constexpr int WG_BAR = SKIP_VOTE_BAR;
  static constexpr int TAIL_ZERO_BAR = SKIP_VOTE_BAR + CONSUMERS;  // producer warps 1..3 (TMA)
  static_assert(TAIL_ZERO_BAR < 16, "16 named barriers");
  static_assert(BLOCK_N * ROW_BYTES % ATOM_BYTES == 0 && KV_TILE_BYTES % ATOM_BYTES == 0, "1024-byte tiles");
};

}  // namespace pfa
