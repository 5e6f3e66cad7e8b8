// Tile shape and shared-memory layout of the sm_90a fp8 prefill (prefill_sm90_fp8.cuh): e4m3 Q, K
// and V, S = Q K^T and O += P V on m64nNk32 e4m3 wgmma.
//
// As PrefillSm90Config (config.cuh), with one-byte elements: a 128-byte swizzle row holds 128
// elements, so a K-major k-step of 32 elements moves a descriptor 32 bytes, exactly as a 16-bit
// k16 step does, and the 16-bit family's descriptor math (ConsumerSm90::q_desc / k_desc) serves
// unchanged. 8-bit wgmma reads B K-major only, so O += P V needs V as [dim][key]: the producer
// copies each V tile as it is stored ([key][dim], the "raw" tile) and transposes it into a Vt
// stage (fp8_producer.cuh). Layout, each part 1024-byte aligned:
//   Q [BLOCK_M x D] | K stages [STAGES][BLOCK_N x D] | Vt stages [STAGES][D x VT_ROW]
//   | raw V [2][BLOCK_N x D] | mbarriers | (TMA) the raw V buffers' mbarriers
//   | (PERSISTENT) Q's empty mbarrier, the scheduler's ring
// Every tile in the 128-byte swizzle: column blocks of 128 bytes, chunk c of row r at c ^ (r % 8).
// BLOCK_N is 128, 192 or 256 (a multiple of 64: whole 16-key groups for each of the four transposing
// warps). A Vt row (a head-dim column of V) holds BLOCK_N keys in VT_BLOCKS column blocks of 128
// bytes, as a 16-bit K tile holds its head dim: keys 128 b .. 128 b + 127 in block b, each block D
// rows of 128 bytes (at 192 keys the second block's rows are half used). At head_dim 64 the Q, K
// and raw V rows (64 bytes) are stored as the first half of 128-byte swizzle rows (ROW_PAD): the
// wgmma k-steps 0 and 1 read only those 64 bytes, so the 128-byte swizzle serves there too, for
// twice the shared memory of those tiles.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "pfa/attention/sm90/pipeline.cuh"

namespace pfa {

// The shared-memory offset of the mbarriers: behind Q, the K and Vt stages and the two raw V tiles
// (one-byte elements, rows padded to 128 bytes at head_dim 64).
constexpr int sm90_fp8_bar_offset(int head_dim, int consumers, int stages, int block_n) {
  const int row_pad = head_dim < 128 ? 128 : head_dim;
  const int vt_row = (block_n + 127) / 128 * 128;  // a Vt row's column blocks
  return consumers * 64 * row_pad + stages * block_n * row_pad + stages * head_dim * vt_row + 2 * block_n * row_pad;
}

// The paged rows' producer (two consumers: hd128) takes 56 registers, as the 16-bit paged rows'
// (sm90_producer_regs): persistent, its owned-row copy loop spilled at 40.
template <int HEAD_DIM_, int CONSUMERS_, int STAGES_, bool PAGED_, bool PERSISTENT_ = false, bool TMA_ = false,
          int BLOCK_N_ = 128, bool DENSE_KV_ = false>
struct PrefillSm90Fp8Config
    : Sm90Pipeline<CONSUMERS_, STAGES_, sm90_fp8_bar_offset(HEAD_DIM_, CONSUMERS_, STAGES_, BLOCK_N_),
                   sm90_producer_regs(CONSUMERS_, false, PAGED_ && HEAD_DIM_ <= 128)> {
  using Base = Sm90Pipeline<CONSUMERS_, STAGES_, sm90_fp8_bar_offset(HEAD_DIM_, CONSUMERS_, STAGES_, BLOCK_N_),
                            sm90_producer_regs(CONSUMERS_, false, PAGED_ && HEAD_DIM_ <= 128)>;
  using Base::ATOM_BYTES, Base::BAR_OFFSET, Base::BLOCK_M, Base::NUM_BARRIERS, Base::ROW_BYTES, Base::STAGES;
  using Elem = __nv_fp8_e4m3;  // Q, K, V
  using VElem = Elem;          // (P and V of the P V GEMM: as the 16-bit configuration's)
  // The output's "own" 16-bit type for o_format (0 = bf16, 1 = fp16, 2 = e4m3), as the 16-bit
  // kernels' o_format counts from their query dtype.
  using Out16 = __nv_bfloat16;
  static constexpr int HEAD_DIM = HEAD_DIM_, BLOCK_N = BLOCK_N_;
  static_assert(BLOCK_N % 64 == 0 && BLOCK_N <= 256, "whole 16-key groups per transposing warp; one wgmma N");
  // the paged copies: one lane of a producer warp owns each row of a 128-key tile (producer.cuh
  // OwnedRows); a 256-key tile (the paged long-KV twin) is copied as two such halves, each row a
  // whole swizzle row (fp8_producer.cuh PagedHalf)
  static_assert(!PAGED_ || BLOCK_N == 128 || (BLOCK_N == 256 && HEAD_DIM_ <= 128), "paged fp8: 128-key halves");
  static constexpr bool PAGED = PAGED_;
  // The paged rows' dense twin (variants.HOPPER_FP8_DENSE_KV, routing.dense_twin): a kv head's page
  // slots back to back (stride_n = HEAD_DIM), so a thread's rows in one page step by a constant
  // (producer.cuh dense_rows_in_runs: one owned-row shuffle a page run, not a copy).
  static constexpr bool DENSE_KV = DENSE_KV_;
  static_assert(!DENSE_KV || (PAGED && !TMA_), "dense: the paged copies");
  // K and raw V tiles by TMA (PrefillParams::k_tmap / v_tmap, boxes of 128 one-byte columns): one
  // producer thread (PAGED: warp 0, a box a page) issues a whole tile's boxes instead of every
  // thread a cp.async per chunk (the copies were a third of the issue-bound producer's
  // instructions). head_dim 128 / 256 (64-byte rows at head_dim 64 are padded to 128 in shared
  // memory: no box lands that way).
  static constexpr bool TMA = TMA_;
  static_assert(!TMA || HEAD_DIM % 128 == 0, "fp8 TMA: whole 128-byte rows");
  static_assert(!TMA || !PAGED || BLOCK_N == 128 || BLOCK_N == 256, "fp8 paged TMA: 128- or 256-key tiles");
  // Paged TMA: warp 0 only issues (a box a page, each lane's page id loaded a tile ahead), warps
  // 1..3 only transpose (fp8_producer.cuh run_tma_paged). With one warp doing both, every
  // transpose waited behind warp 0's page-table loads and K stage wait (ncu, NOTES.md session 46).
  // The raw V buffers then have an empty barrier each beside their full one.
  static constexpr bool ISSUER_WARP = TMA && PAGED;
  static constexpr int TRANSPOSE_THREADS = ISSUER_WARP ? Base::WG_THREADS - 32 : Base::WG_THREADS;
  // The CTAs walk the logical grid (sm90/cta.cuh), as the 16-bit family's PERSISTENT rows
  static constexpr bool PERSISTENT = PERSISTENT_;
  static constexpr bool STREAM_K = false;  // (sm90/stream_k.cuh: the 16-bit consumers' only)
  // (PrefillSm90Config's widened one-byte K/V under a 16-bit Q: K and V stay fp8 here)
  static constexpr bool KV_FP8 = false;
  static_assert(HEAD_DIM == 64 || HEAD_DIM % 128 == 0, "fp8: head_dim in whole (or, 64, half) swizzle rows");

  static constexpr int CHUNK_ELEMS = 16;                 // e4m3 elements per 16-byte chunk
  static constexpr int CPR = HEAD_DIM / CHUNK_ELEMS;     // 16-byte chunks per Q / K / V row
  // bytes of a stored Q / K / V row (swz: chunk < 4 at head_dim 64, the first half of each row)
  static constexpr int ROW_PAD = HEAD_DIM < ROW_BYTES ? ROW_BYTES : HEAD_DIM;
  static constexpr int Q_BYTES = BLOCK_M * ROW_PAD;
  static constexpr int K_TILE_BYTES = BLOCK_N * ROW_PAD;   // a K or raw V tile
  static constexpr int VT_BLOCKS = (BLOCK_N + ROW_BYTES - 1) / ROW_BYTES;  // 128-key column blocks of a Vt row
  static constexpr int VT_BLOCK_BYTES = HEAD_DIM * ROW_BYTES;                // one: HEAD_DIM rows of 128 keys
  static constexpr int VT_TILE_BYTES = VT_BLOCKS * VT_BLOCK_BYTES;
  static constexpr int Q_OFFSET = 0;
  static constexpr int K_OFFSET = Q_OFFSET + Q_BYTES;
  static constexpr int V_OFFSET = K_OFFSET + STAGES * K_TILE_BYTES;  // the Vt stages
  static constexpr int RAW_OFFSET = V_OFFSET + STAGES * VT_TILE_BYTES;
  static constexpr int RAW_TILES = 2;
  static_assert(BAR_OFFSET == RAW_OFFSET + RAW_TILES * K_TILE_BYTES, "sm90_fp8_bar_offset: the mbarriers follow raw V");
  // PERSISTENT: the Q tile's "empty" mbarrier (one arrival per consumer thread once the work
  // item's S GEMMs are done with Q), then the tile scheduler's index ring (sm90/tile_scheduler.cuh)
  // init_ring_barriers: k_full counts the producer threads' cp.async arrivals (TMA: the issuing
  // thread's one), v_full the transposing threads'; TMA: each raw V buffer's barrier (one arrival:
  // the issuing thread's, with the box bytes) follows the ring's
  static constexpr int K_FULL_ARRIVALS = TMA ? 1 : Base::WG_THREADS, V_FULL_ARRIVALS = TRANSPOSE_THREADS;
  static constexpr int TMA_BAR_OFFSET = BAR_OFFSET + NUM_BARRIERS * 8;
  static constexpr int TMA_BARS = TMA ? (ISSUER_WARP ? 2 : 1) * RAW_TILES : 0;
  // init_ring_barriers: raw_full one arrival (the issuing lane's, with the box bytes), (ISSUER_WARP)
  // raw_empty one a transposing thread
  static constexpr int tma_bar_arrivals(int i) { return i < RAW_TILES ? 1 : TRANSPOSE_THREADS; }
  // (ISSUER_WARP) the transposing warps' own named barrier (a tail's zeroed rows before its transpose)
  static constexpr int TAIL_ZERO_BAR = Base::PRODUCER_BAR + 1;
  // (ISSUER_WARP) producer warps 1..3 read the scheduler's ring as the consumers do and skip a Q
  // that goes by TMA, so warp 0 issues the next block while they transpose this one's last tiles
  // (the 16-bit TMA rows' TAIL_WARPS, config.cuh; fp8_producer.cuh run_tma_paged)
  static constexpr bool TAIL_WARPS = ISSUER_WARP;
  // config.cuh's DECODE_AHEAD: measured, the paged e4m3 rows gained 0.4-1.3%, the contiguous ones
  // lost 0.3-0.7% (NOTES.md, session 34).
  static constexpr bool DECODE_AHEAD = PERSISTENT && PAGED;
  // The Vt stage's head-dim rows permuted (fp8_producer.cuh transpose_v), O's columns with them
  // (EpilogueSm90's PERMUTED: 16-byte stores of a 16-bit output without quad shuffles): the
  // hd64 / hd128 rows (TRT-LLM contiguous e4m3 16 x 1k +1.0-2.2%, 4k +0.2-1.4%, single prefill
  // hd64 / hd128 +0.2-4%, NOTES.md session 43; paged e4m3 +0.4-1.5%, session 44, their NVFP4
  // output taking natural columns first). Not the serial hd256 rows (2k causal 0.95 in an A/B).
  static constexpr bool PERMUTED_VT = HEAD_DIM <= 128;
  // Ping-pong rows of 256-key tiles (`make TUNE=1` rows) take the consumers' turn around S only, as
  // fmha_v2's e4m3 kernel does (each consumer's P V then runs under the other's S); the serial loop
  // otherwise takes it around both GEMMs. (Measured 0.93-1.0x the long-KV twin without turns.)
  static constexpr bool S_TURN_ONLY = BLOCK_N > 128;
  static constexpr bool AHEAD_WHEN_READY = false;
  static __device__ __forceinline__ uint32_t raw_full(uint32_t base, int b) { return base + TMA_BAR_OFFSET + 8 * b; }
  static __device__ __forceinline__ uint32_t raw_empty(uint32_t base, int b) {
    return base + TMA_BAR_OFFSET + 8 * (RAW_TILES + b);
  }
  static constexpr int Q_EMPTY_BAR_OFFSET = TMA_BAR_OFFSET + TMA_BARS * 8;
  static constexpr int Q_EMPTY_BAR_BYTES = PERSISTENT ? 8 : 0;
  static __device__ __forceinline__ uint32_t q_empty(uint32_t base) { return base + Q_EMPTY_BAR_OFFSET; }
  static constexpr int SCHED_OFFSET = Q_EMPTY_BAR_OFFSET + Q_EMPTY_BAR_BYTES;
  static constexpr int SCHED_BYTES = PERSISTENT ? 40 : 0;
  // + 1024: the dynamic shared memory base is rounded up to the swizzle atom at run time (PAGED
  // too: its page ids stay in the producer's registers, producer.cuh OwnedRows)
  static constexpr int SMEM_BYTES = SCHED_OFFSET + SCHED_BYTES + ATOM_BYTES;
  static_assert(K_TILE_BYTES % ATOM_BYTES == 0 && VT_TILE_BYTES % ATOM_BYTES == 0 && Q_BYTES % ATOM_BYTES == 0,
                "1024-byte tiles");
};

}  // namespace pfa
