// The producer warpgroup of the sm_90a fp8 prefill: Q once, then per key tile its K into the K
// ring (as the 16-bit producer: cp.async, arriving on k_full) and its V transposed into the Vt
// ring, the B operand of O += P V (8-bit wgmma reads B K-major only). K/V rows: contiguous /
// ragged, or (PAGED) a paged cache by the 16-bit producer's owned-row copies (producer.cuh,
// OwnedRows; V's own ids when v_page_indices is set); the TMA configurations load them as boxes
// (run_tma; paged: run_tma_paged, one warp issuing while three transpose).
//
// V's transpose: each V tile is copied as stored ([key][dim], the raw tile, 2 buffers) and, once
// it has landed, the four producer warps turn it into Vt [dim][key] in shared memory with
// ldmatrix / byte permutes / stmatrix.trans (FlashAttention-3 transposes its fp8 V the same way;
// this is our own arrangement). One step of a warp covers 16 keys (k0 .. k0 + 15) x 32 dims
// (d0 .. d0 + 31):
//   ldmatrix.x4 (b16, not transposed): matrix q, row r = raw row of key k0 + 8 * (q & 1) + r,
//     bytes of dims d0 + 16 * (q >> 1) .. + 15. Lane l (kk = l / 4, t = l % 4) gets
//     x[q] = 4 bytes, dims d0 + 16 * (q >> 1) + 4 t .. + 3, of key k0 + 8 * (q & 1) + kk.
//   byte permutes: y[2 h + e] = (x[2 h].b(2e), x[2 h + 1].b(2e), x[2 h].b(2e+1), x[2 h + 1].b(2e+1)):
//     b16 number 0 of y[m] = dim D(m, t, 0), keys (k0 + kk, k0 + kk + 8); number 1 = dim D(m, t, 1),
//     with D(m, t, c) = d0 + 16 * (m >> 1) + 4 t + 2 * (m & 1) + c.
//   stmatrix.x4.trans: element (row kk, column 2 t + c) of matrix m -> b16 number kk of memory
//     row 2 t + c of matrix m, which is Vt row (dim) D(m, t, c).
// So Vt row d, 16-byte chunk k0 / 16 holds bytes [key k0 + kk at 2 kk, key k0 + kk + 8 at 2 kk + 1]:
// within every 16-key group, byte position 2 kk holds key kk and 2 kk + 1 holds key kk + 8. The
// consumers pack P in that same key order (fp8_consumer.cuh, p_frags), so P V sums over the same
// keys and no register of P is moved between threads.
// Bank conflicts: ldmatrix reads 8 consecutive keys (distinct swizzle chunks) per matrix: none;
// stmatrix writes rows d, d+1, d+4, d+5, d+8, ... per matrix, whose row % 8 repeat once: two-way.
// Cfg::PERMUTED_VT: within each block of 32 dims, dim 8 a + 2 b + e goes to Vt row 8 b + 2 a + e
// (a, b < 4: the two swapped), so that O's accumulator column pairs of four consecutive column
// tiles hold 8 consecutive dims of a lane (EpilogueSm90's PERMUTED: 16-byte stores without
// shuffles); a matrix's rows are then 0, 1, 16, 17, 2, 3, 18, 19 (+ 4 ...): two-way as before.
#pragma once
#include <stdint.h>

#include <type_traits>

#include "pfa/attention/kv_source.cuh"
#include "pfa/attention/params.h"
#include "pfa/attention/sm90/pipeline.cuh"
#include "pfa/attention/sm90/producer.cuh"
#include "pfa/attention/sm90/producer_tma.cuh"
#include "pfa/attention/work.cuh"
#include "pfa/ptx/mma_sm80.cuh"
#include "pfa/ptx/sm90.cuh"

namespace pfa {

template <class Cfg>
struct ProducerSm90Fp8 {
  static constexpr int CPR = Cfg::CPR, BLOCK_N = Cfg::BLOCK_N, STAGES = Cfg::STAGES, HEAD_DIM = Cfg::HEAD_DIM;
  static constexpr int ROW_STEP = Cfg::WG_THREADS / CPR;  // rows between one thread's chunks
  static_assert(Cfg::WG_THREADS % CPR == 0 && BLOCK_N % ROW_STEP == 0 && Cfg::BLOCK_M % ROW_STEP == 0,
                "whole rows per pass");
  static constexpr int LOAD_UNROLL = Cfg::PRODUCER_REGS >= 40 ? 2 : 1;
  // Paged tiles are copied in halves of 128 keys (a 256-key tile, the paged long-KV twin's: two),
  // each owned row by row as a 128-key tile (producer.cuh OwnedRows: one lane a row of a warp's
  // 32). A half's rows are whole swizzle rows (HEAD_DIM <= 128: the swizzle does not depend on the
  // tile's rows), so half h is the 128-key tile at the tile's row 128 h.
  struct PagedHalf : Cfg {
    static constexpr int BLOCK_N = 128;
  };
  using Half = std::conditional_t<(BLOCK_N > 128), PagedHalf, Cfg>;
  static constexpr int HALF_N = Half::BLOCK_N, HALVES = Cfg::PAGED ? BLOCK_N / HALF_N : 1;
  // The paged copies fully unrolled where the producer has the registers (the persistent hd128 row
  // at 56): each copy's shuffle lanes and shared-memory offsets become constants of its own, not a
  // loop's (~5 instructions a copy instead of ~9.5). At 32 / 40 registers (hd64, hd256) it spills.
  static constexpr int PAGED_UNROLL = Cfg::PRODUCER_REGS >= 56 ? HALF_N / ROW_STEP : LOAD_UNROLL;
  // Paged copies one row at a time (load_tile_paged's MAX_RUN = 1): with the page-run paths
  // compiled in, ptxas (nvcc 13.0) gives some of this producer's cp.async an [R + UR0 + imm]
  // address with its cache-policy descriptor in UR1, an odd uniform register, and the GPU stops
  // on them with an illegal instruction (found on an H100, NOTES.md session 22). The 16-bit
  // producer's run paths compile without that form.
  static constexpr int PAGE_RUN_MAX = 1;
  static constexpr int NO_PAGE_RUNS = -1;  // load_tile_paged's page_shift: no runs to find
  // The dense twin (Cfg::DENSE_KV) finds page runs (p.page_shift): at ROW_STEP 16 a page of 32
  // slots holds 2 of a thread's rows, 64 slots 4; runs of 1 and 2 rows compiled in (each run path
  // is a copy of the unrolled copies).
  static constexpr int DENSE_RUN_MAX = 2;
  // transpose steps (16 keys x 32 dims) of a tile, spread over the four producer warps: GROUPS
  // 16-key groups a warp per 32-dim block
  static constexpr int GROUPS = BLOCK_N / 64;
  static_assert(BLOCK_N % 64 == 0, "whole 16-key groups per warp");

  // Q (load_q_tile, producer.cuh: by TMA on the TMA rows where it can): one-byte elements, 16 a chunk
  static __device__ __forceinline__ void load_q(const PrefillParams& p, const PrefillWork& w, uint32_t base, int tid) {
    load_q_tile<Cfg, uint8_t, CPR, ROW_STEP>(p, w, base, tid);
  }

  // One K or raw V tile: keys [n0, n0 + BLOCK_N) from `head` (the kv head's base, rows at
  // stride_n bytes from row0), keys at or past kv_len zero-filled (load_tile_rows, producer.cuh).
  // Partly rolled: with the transpose's addresses live too, a full unroll spills on PRODUCER_REGS
  // (two rows per pass fit 40 registers, one row 32).
  static __device__ __forceinline__ void load_tile(uint32_t s_tile, const uint8_t* head, int64_t stride_n,
                                                   int64_t row0, int n0, int kv_len, int tid, uint64_t policy) {
    load_tile_rows<Cfg, uint8_t, CPR, ROW_STEP, LOAD_UNROLL>(s_tile, head, stride_n, row0, n0, kv_len, tid, policy);
  }

  // Raw V tile [key][dim] -> Vt tile [dim][key in the order above] (every producer thread).
  // Warp w covers the 16-key groups g = w + 4 h (h < GROUPS) of each 32-dim block c, so each
  // address is a per-lane base plus what c and h add:
  //   ldmatrix: key 16 g + 8 (q & 1) + r (key & 7 = r), chunk 2 c + (q >> 1), whose swizzled
  //     chunk (chunk & 7) ^ r = 2 ((c & 3) ^ (r >> 1)) + ((q >> 1) ^ (r & 1));
  //   stmatrix: Vt row 32 c + vr (vt_row: the row of this lane's dim) of column block g / 8, chunk g % 8.
  static __device__ __forceinline__ void transpose_v(uint32_t s_raw, uint32_t s_vt, int tid) {
    constexpr int ROW_BYTES = Cfg::ROW_BYTES;
    const int lane = tid % 32, warp = tid / 32;
    const int q = lane / 8, r = lane % 8;  // the matrix and row whose address this lane passes
    const int rh = r >> 1;
    const int vr = vt_row(lane);
    const uint32_t ld_lane = s_raw + (16 * warp + 8 * (q & 1) + r) * ROW_BYTES + (((q >> 1) ^ (r & 1)) << 4);
    const uint32_t st_lane = s_vt + vr * ROW_BYTES;
    // Rolled over the dim blocks: the producer runs on PRODUCER_REGS registers.
#pragma unroll 1
    for (int c = 0; c < HEAD_DIM / 32; ++c) {
      const uint32_t ld_c = ld_lane + (c >> 2) * BLOCK_N * ROW_BYTES + (((c & 3) ^ rh) << 5);
      const uint32_t st_c = st_lane + 32 * c * ROW_BYTES;
#pragma unroll
      for (int h = 0; h < GROUPS; ++h) {
        const int g8 = warp + 4 * (h & 1);  // g % 8 (warp < 4); g / 8 = h / 2
        uint32_t x[4];
        ptx::ldmatrix_x4(x, ld_c + h * 64 * ROW_BYTES);
        const uint32_t y0 = __byte_perm(x[0], x[1], 0x5140), y1 = __byte_perm(x[0], x[1], 0x7362);
        const uint32_t y2 = __byte_perm(x[2], x[3], 0x5140), y3 = __byte_perm(x[2], x[3], 0x7362);
        ptx::stmatrix_x4_trans(st_c + (h >> 1) * Cfg::VT_BLOCK_BYTES + ((g8 ^ (vr & 7)) << 4), y0, y1, y2, y3);
      }
    }
  }

  // transpose_v on NW warps, this one warp W of them (ISSUER_WARP: the three transposing warps):
  // the tile's steps k = W, W + NW, ... (32-dim block c = k / G, 16-key group g = k % G, G =
  // BLOCK_N / 16), each as transpose_v's step of group g in block c. Unrolled: a step's addresses
  // are a lane's two bases plus constants (and one XOR with the lane's swizzle row each).
  template <int NW, int W>
  static __device__ __forceinline__ void transpose_v_of(uint32_t s_raw, uint32_t s_vt, int lane) {
    constexpr int ROW_BYTES = Cfg::ROW_BYTES, G = BLOCK_N / 16, STEPS = HEAD_DIM / 32 * G;
    const int q = lane / 8, r = lane % 8, rh = r >> 1;
    const int vr = vt_row(lane);
    const uint32_t ld_lane = s_raw + (8 * (q & 1) + r) * ROW_BYTES + (((q >> 1) ^ (r & 1)) << 4);
    const uint32_t st_lane = s_vt + vr * ROW_BYTES;
#pragma unroll
    for (int k = W; k < STEPS; k += NW) {
      const int c = k / G, g = k % G;
      uint32_t x[4];
      ptx::ldmatrix_x4(x, ld_lane + ((c >> 2) * BLOCK_N + 16 * g) * ROW_BYTES + (((c & 3) ^ rh) << 5));
      const uint32_t y0 = __byte_perm(x[0], x[1], 0x5140), y1 = __byte_perm(x[0], x[1], 0x7362);
      const uint32_t y2 = __byte_perm(x[2], x[3], 0x5140), y3 = __byte_perm(x[2], x[3], 0x7362);
      const uint32_t st = st_lane + 32 * c * ROW_BYTES + (g >> 3) * Cfg::VT_BLOCK_BYTES;
      ptx::stmatrix_x4_trans(st + (((g & 7) ^ (vr & 7)) << 4), y0, y1, y2, y3);
    }
  }

  // The Vt row of the dim whose address lane passes to stmatrix (memory row r = lane % 8 of matrix
  // q = lane / 8: dim D(q, r / 2, r % 2) of the 32-dim block; PERMUTED_VT: dim 8 a + 2 b + e in
  // row 8 b + 2 a + e).
  static __device__ __forceinline__ int vt_row(int lane) {
    const int q = lane / 8, r = lane % 8;
    const int dl = 16 * (q >> 1) + 4 * (r >> 1) + 2 * (q & 1) + (r & 1);
    return Cfg::PERMUTED_VT ? ((dl >> 1) & 3) * 8 + (dl >> 3) * 2 + (dl & 1) : dl;
  }

  // PAGED: the byte offsets within the kv head of this lane's owned row of each half of a tile
  struct RowOffsets {
    int64_t half[HALVES];
  };

  // One K or raw V tile, keys [n0, n0 + BLOCK_N) from `head` (the kv head's base) through the
  // request's addressing: ragged rows from row0, or (PAGED) this lane's owned rows' byte offsets
  // `off` (load_tile_paged, producer.cuh), a half at a time.
  static __device__ __forceinline__ void copy_tile(const PrefillParams& p, const PrefillWork& w, uint32_t s_tile,
                                                   const uint8_t* head, int64_t stride_n, int64_t row0,
                                                   const RowOffsets& off, int n0, int tid, uint64_t policy) {
    if constexpr (Cfg::PAGED) {
#pragma unroll
      for (int h = 0; h < HALVES; ++h) {
        const uint32_t s_half = s_tile + h * HALF_N * Cfg::ROW_PAD;
        // Unrolled with the L2 policy, ptxas addresses the copies as [R + UR0 + imm] with the policy
        // in UR1, the form that stops the GPU (PAGE_RUN_MAX above; nvcc_guard.sh): plain copies.
        if constexpr (Cfg::DENSE_KV)  // page runs of DENSE_RUN_MAX rows at most
          load_tile_paged<Half, uint8_t, CPR, ROW_STEP, PAGED_UNROLL, DENSE_RUN_MAX, true, false>(
              s_half, head, off.half[h], n0 + h * HALF_N, w.kv_len, p.page_shift, stride_n, tid, policy);
        else
          load_tile_paged<Half, uint8_t, CPR, ROW_STEP, PAGED_UNROLL, PAGE_RUN_MAX, false,
                          PAGED_UNROLL == LOAD_UNROLL>(s_half, head, off.half[h], n0 + h * HALF_N, w.kv_len,
                                                       NO_PAGE_RUNS, stride_n, tid, policy);
      }
    } else {
      load_tile(s_tile, head, stride_n, row0, n0, w.kv_len, tid, policy);
    }
  }

  // Paged: the owned row's page ids (owned_page_id, producer.cuh) of the tile at n0: K's, and V's
  // (its own where the call has them, else K's). The tables' bases are worked out per call, not
  // held as OwnedPageIds holds them: in this producer's registers that changed its paged rows' code
  // (nvdisasm), untested on a GPU. One id a half of the tile (HALVES).
  struct TileIds {
    int32_t k[HALVES], v[HALVES];
  };
  static __device__ __forceinline__ TileIds tile_ids(const PrefillParams& p, const PrefillWork& w, int n0, int row,
                                                     int tid) {
    TileIds ids;
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
      const int t = n0 + h * HALF_N + row;
      ids.k[h] = owned_page_id<Half, CPR, ROW_STEP>(p, page_table<false>(p) + w.page_base, t, w.kv_len, tid);
      ids.v[h] = p.v_page_indices != 0
                     ? owned_page_id<Half, CPR, ROW_STEP>(p, page_table<true>(p) + w.page_base, t, w.kv_len, tid)
                     : ids.k[h];
    }
    return ids;
  }

  // base: the aligned shared-memory base as a shared-window address. Per tile it: raw V(it + 1)
  // and K(it + 1) are issued, then V(it) (landed: cp.async.wait_group + a producer barrier) is
  // transposed into its Vt stage, fenced for the async proxy (the consumers' wgmma) and announced
  // on v_full; a second barrier frees its raw buffer for V(it + 2).
  // PAGED: `ids` holds the owned row's page ids of the next tile to copy; each copy's row offset
  // (page_offset) is worked out just before it, and the ids of the tile after are loaded between
  // the two copies, so their page-table reads hide behind the K stage wait and the transpose.
  // walk: the CTA's place in the ring (sm90/pipeline.cuh): each tile's stage and phase, and (PERSISTENT)
  // Q's, whose buffer the consumers free after the previous work item's last S (q_empty). The raw V
  // buffers restart at 0 every item: the item before ended with both transposed.
  static __device__ __forceinline__ void run(const PrefillParams& p, const PrefillWork& w, uint32_t base, int tid,
                                             const Sm90Walk& walk) {
    if constexpr (Cfg::ISSUER_WARP) {
      run_tma_paged(p, w, base, tid, walk);
      return;
    } else if constexpr (Cfg::TMA) {
      run_tma(p, w, base, tid, walk);
      return;
    }
    if (w.num_tiles == 0) return;  // (the consumers wait for no Q either)
    wait_q_free<Cfg>(base, walk);
    load_q(p, w, base, tid);
    const uint8_t* k = reinterpret_cast<const uint8_t*>(p.k) + w.kv_head * p.k_stride_h;
    const uint8_t* v = reinterpret_cast<const uint8_t*>(p.v) + w.kv_head * p.v_stride_h;
    const int64_t row0 = RaggedKvRows{w.kv_row0}.row(0, 0);
    const int n = w.num_tiles;
    const int row = Cfg::PAGED ? owned_row<Half, CPR, ROW_STEP>(tid) : 0;
    // Every row tile of the head reads these K/V rows again: keep them in L2 over Q and outputs.
    const uint64_t keep = ptx::l2_evict_last();
    TileIds ids{};
    if constexpr (Cfg::PAGED) ids = tile_ids(p, w, w.tile_start, row, tid);
    // The byte offsets of the owned rows of the tile at n0 within the kv head, K's (IS_V false) or
    // V's (PAGED; else unused)
    auto offsets = [&](auto is_v, int n0) {
      RowOffsets o{};
      if constexpr (Cfg::PAGED) {
        constexpr bool IS_V = decltype(is_v)::value;
#pragma unroll
        for (int h = 0; h < HALVES; ++h)
          o.half[h] = page_offset<uint8_t>(p, IS_V ? ids.v[h] : ids.k[h], n0 + h * HALF_N + row, w.kv_len,
                                           IS_V ? p.v_stride_page : p.k_stride_page,
                                           IS_V ? p.v_stride_n : p.k_stride_n);
      }
      return o;
    };
    auto k_off = [&](int n0) { return offsets(std::false_type{}, n0); };
    auto v_off = [&](int n0) { return offsets(std::true_type{}, n0); };
    {
      const int n1 = w.tile_start, s0 = walk.stage<STAGES>(0);
      ptx::mbar_wait(Cfg::k_empty(base, s0), walk.phase<STAGES>(0) ^ 1);  // (a fresh ring: free at once)
      copy_tile(p, w, base + Cfg::K_OFFSET + s0 * Cfg::K_TILE_BYTES, k, p.k_stride_n, row0, k_off(n1), n1, tid,
                keep);
      ptx::cp_async_mbar_arrive(Cfg::k_full(base, s0));
      copy_tile(p, w, base + Cfg::RAW_OFFSET, v, p.v_stride_n, row0, v_off(n1), n1, tid, keep);
      ptx::cp_async_commit();
      if constexpr (Cfg::PAGED) {
        if (n > 1) ids = tile_ids(p, w, n1 + BLOCK_N, row, tid);
      }
    }
    for (int it = 0; it < n; ++it) {
      if (it + 1 < n) {
        // raw V(it + 1) first: its buffer is free (the barrier ending tile it - 1), while K(it + 1)
        // waits for the consumers to release a K stage
        const int s1 = walk.stage<STAGES>(it + 1), n1 = w.tile_start + (it + 1) * BLOCK_N;
        copy_tile(p, w, base + Cfg::RAW_OFFSET + ((it + 1) & 1) * Cfg::K_TILE_BYTES, v, p.v_stride_n, row0,
                  v_off(n1), n1, tid, keep);
        const RowOffsets k_row_off = k_off(n1);
        if constexpr (Cfg::PAGED) {
          if (it + 2 < n) ids = tile_ids(p, w, n1 + BLOCK_N, row, tid);
        }
        ptx::mbar_wait(Cfg::k_empty(base, s1), walk.phase<STAGES>(it + 1) ^ 1);
        copy_tile(p, w, base + Cfg::K_OFFSET + s1 * Cfg::K_TILE_BYTES, k, p.k_stride_n, row0, k_row_off, n1, tid,
                  keep);
        ptx::cp_async_mbar_arrive(Cfg::k_full(base, s1));  // (once V(it + 1) has landed too)
        ptx::cp_async_commit();
        ptx::cp_async_wait<1>();  // this thread's copies of V(it) (and earlier) have landed
      } else {
        ptx::cp_async_wait<0>();
      }
      ptx::bar_sync(Cfg::PRODUCER_BAR, Cfg::WG_THREADS);  // ... and every thread's
      const int s = walk.stage<STAGES>(it);
      ptx::mbar_wait(Cfg::v_empty(base, s), walk.phase<STAGES>(it) ^ 1);
      transpose_v(base + Cfg::RAW_OFFSET + (it & 1) * Cfg::K_TILE_BYTES, base + Cfg::V_OFFSET + s * Cfg::VT_TILE_BYTES,
                  tid);
      ptx::fence_proxy_async();  // the stmatrix writes (generic proxy) before the consumers' wgmma reads
      ptx::mbar_arrive(Cfg::v_full(base, s));
      ptx::bar_sync(Cfg::PRODUCER_BAR, Cfg::WG_THREADS);  // raw buffer it & 1 read by all: free for V(it + 2)
    }
    // Every cp.async lands before the warpgroup exits (the barriers they arrive on live in the
    // CTA's shared memory).
    ptx::cp_async_wait<0>();
  }

  // ---- TMA (Cfg::TMA: head_dim 128 / 256; contiguous / ragged, or PAGED a paged cache) ----
  // One K (IS_V false) or raw V tile into s_tile, completing `bar` (one arrival), contiguous /
  // ragged: a whole tile by TMA once `empty` is free (where given), warp 0's lanes a box each
  // (ProducerSm90Tma::tma_tile, the 16-bit producer's, with boxes of 128 one-byte columns: a box a
  // column block). The request's last, partial tile by every thread's zero-filled cp.async (V's
  // rows past kv_len must be zeros, 0 * NaN being NaN in P V; its boxes could also pass the
  // tensor's rows), fenced for the async proxy (K: the consumers' wgmma). Pointers, strides and the
  // L2 policy are worked out here, not held across the tile loop: the producer runs on
  // PRODUCER_REGS registers.
  template <bool IS_V>
  static __device__ __forceinline__ void tma_or_copy(const PrefillParams& p, const PrefillWork& w, uint32_t s_tile,
                                                     uint32_t bar, uint32_t empty, uint32_t free_parity, int n0,
                                                     int tid) {
    static_assert(!Cfg::PAGED, "paged TMA: run_tma_paged");
    using Tma = ProducerSm90Tma<Cfg>;
    // Every row tile of the head reads these K/V rows again: keep them in L2 over Q and outputs.
    const uint64_t keep = ptx::l2_evict_last();
    if (n0 + BLOCK_N <= w.kv_len) {
      if (tid < 32) {  // lane l: box l / COL_BLOCKS of column block l % COL_BLOCKS
        if (empty != 0) ptx::mbar_wait(empty, free_parity);
        Tma::tma_tile(p, w, s_tile, IS_V ? &p.v_tmap : &p.k_tmap, bar, n0, BLOCK_N, 1, 0, tid / Tma::COL_BLOCKS,
                      tid % Tma::COL_BLOCKS, tid, keep);
      }
      return;
    }
    if (empty != 0) ptx::mbar_wait(empty, free_parity);
    const uint8_t* head =
        reinterpret_cast<const uint8_t*>(IS_V ? p.v : p.k) + w.kv_head * (IS_V ? p.v_stride_h : p.k_stride_h);
    load_tile(s_tile, head, IS_V ? p.v_stride_n : p.k_stride_n, RaggedKvRows{w.kv_row0}.row(0, 0), n0, w.kv_len,
              tid, keep);
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
    ptx::fence_proxy_async();
    ptx::bar_sync(Cfg::PRODUCER_BAR, Cfg::WG_THREADS);  // every thread's copies landed
    if (tid == 0) ptx::mbar_arrive(bar);
  }

  // run() of the TMA configuration: Q by TMA where it can (load_q_tile, producer.cuh); per tile, raw
  // V(it + 1) and K(it + 1) are issued (one thread), then V(it) is awaited on its raw buffer's
  // barrier and transposed as in run(). The raw buffers alternate over the CTA's whole walk (tile
  // g = walk.tile0 + it in buffer g & 1, phase (g >> 1) & 1).
  static __device__ __forceinline__ void run_tma(const PrefillParams& p, const PrefillWork& w, uint32_t base, int tid,
                                                 const Sm90Walk& walk) {
    if (w.num_tiles == 0) return;  // (the consumers wait for no Q either)
    wait_q_free<Cfg>(base, walk);
    load_q(p, w, base, tid);
    const int n = w.num_tiles;
    // one call site of each copy (its cp.async path inlined once), tile it + 1 issued before tile
    // it is transposed: raw V first (its buffer is free: the barrier ending tile it - 1), then K (a
    // stage the consumers released)
#pragma unroll 1
    for (int it = -1; it < n; ++it) {
      if (it + 1 < n) {
        const int g1 = walk.tile0 + it + 1, s1 = walk.stage<STAGES>(it + 1), n1 = w.tile_start + (it + 1) * BLOCK_N;
        tma_or_copy<true>(p, w, base + Cfg::RAW_OFFSET + (g1 & 1) * Cfg::K_TILE_BYTES, Cfg::raw_full(base, g1 & 1), 0,
                          0, n1, tid);
        tma_or_copy<false>(p, w, base + Cfg::K_OFFSET + s1 * Cfg::K_TILE_BYTES, Cfg::k_full(base, s1),
                           Cfg::k_empty(base, s1), walk.phase<STAGES>(it + 1) ^ 1, n1, tid);
      }
      if (it < 0) continue;
      const int g = walk.tile0 + it, s = walk.stage<STAGES>(it);
      ptx::mbar_wait(Cfg::raw_full(base, g & 1), (g >> 1) & 1);  // V(it) has landed
      ptx::mbar_wait(Cfg::v_empty(base, s), walk.phase<STAGES>(it) ^ 1);
      transpose_v(base + Cfg::RAW_OFFSET + (g & 1) * Cfg::K_TILE_BYTES, base + Cfg::V_OFFSET + s * Cfg::VT_TILE_BYTES,
                  tid);
      ptx::fence_proxy_async();  // the stmatrix writes (generic proxy) before the consumers' wgmma reads
      ptx::mbar_arrive(Cfg::v_full(base, s));
      ptx::bar_sync(Cfg::PRODUCER_BAR, Cfg::WG_THREADS);  // raw buffer of V(it) read by all: free for V(it + 2)
    }
    ptx::cp_async_wait<0>();  // (Q's copies, a copied tail's)
  }

  // ---- paged TMA (ISSUER_WARP): warp 0 issues, warps 1..3 transpose ----
  // The page ids of this lane's box (K's and V's: lane l box l / COL_BLOCKS, ProducerSm90Tma::
  // box_page_id) in the tile at n0, where the page size makes boxes (rows > 0; all: a whole tile's
  // boxes, the tail's live ones only): as loaded, checked (checked_page_id) where issue_paged
  // uses them, so their loads' latency runs under the waits between.
  struct BoxIds {
    int32_t k = 0, v = 0;
  };
  static __device__ __forceinline__ BoxIds box_ids(const PrefillParams& p, const PrefillWork& w, int n0, int rows,
                                                   int all, int lane) {
    using Tma = ProducerSm90Tma<Cfg>;
    BoxIds ids;
    if (rows > 0) {
      const int box = lane / Tma::COL_BLOCKS, live = n0 + BLOCK_N <= w.kv_len ? all : Tma::live_boxes(w, rows, n0);
      ids.k = Tma::template box_page_id<false, false>(p, w, n0, rows, box, live);
      ids.v = p.v_page_indices != 0 ? Tma::template box_page_id<true, false>(p, w, n0, rows, box, live) : ids.k;
    }
    return ids;
  }

  // One paged K (IS_V false) or raw V tile by warp 0 onto `bar` (one arrival): where the page size
  // makes boxes, a box a page (id: this lane's as loaded, box_ids). Otherwise (a page size the host does not
  // route here) the warp's own zero-filled copies, each row's page looked up: slower, right.
  template <bool IS_V>
  static __device__ __forceinline__ void issue_paged(const PrefillParams& p, const PrefillWork& w, uint32_t s_tile,
                                                     uint32_t bar, int n0, int rows, int all, int32_t id, int lane,
                                                     uint64_t policy) {
    using Tma = ProducerSm90Tma<Cfg>;
    if (rows > 0) {
      const int live = n0 + BLOCK_N <= w.kv_len ? all : Tma::live_boxes(w, rows, n0);
      Tma::tma_tile(p, w, s_tile, IS_V ? &p.v_tmap : &p.k_tmap, bar, n0, rows, live, checked_page_id(p, id),
                    lane / Tma::COL_BLOCKS, lane % Tma::COL_BLOCKS, lane, policy);
      return;
    }
    const uint8_t* head =
        reinterpret_cast<const uint8_t*>(IS_V ? p.v : p.k) + w.kv_head * (IS_V ? p.v_stride_h : p.k_stride_h);
    const int32_t* pages = page_table<IS_V>(p) + w.page_base;
#pragma unroll 1
    for (int i = lane; i < BLOCK_N * CPR; i += 32) {
      const int r = i / CPR, chunk = i % CPR, t = n0 + r;
      const bool valid = t < w.kv_len;
      const uint8_t* src = head;
      if (valid) {
        const int32_t pid = checked_page_id(p, __ldg(pages + t / p.page_size));
        src += page_offset<uint8_t>(p, pid, t, w.kv_len, IS_V ? p.v_stride_page : p.k_stride_page,
                                    IS_V ? p.v_stride_n : p.k_stride_n) + chunk * Cfg::CHUNK_BYTES;
      }
      ptx::cp_async_16_hint(s_tile + Cfg::swz(BLOCK_N, r, chunk), src, valid, policy);
    }
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
    ptx::fence_proxy_async();  // K: the consumers' wgmma reads it through the async proxy
    __syncwarp();
    if (lane == 0) ptx::mbar_arrive(bar);
  }

  // run() of the paged TMA configuration: Q as run_tma's (TAIL_WARPS: by warp 0 alone where it goes
  // by TMA); then warp 0 issues each tile's raw V (once the transposing warps have freed its
  // buffer: raw_empty) and its K (once the consumers have freed its stage), as far ahead as the
  // buffers allow, while warps 1..3 transpose each V as it lands. Warp 0 loads the first tile's
  // page ids before it waits for Q's buffer, and each next tile's after issuing one. The raw
  // buffers alternate over the CTA's whole walk (tile g = walk.tile0 + it in buffer g & 1, phase
  // (g >> 1) & 1); warp 0 is at most the two buffers ahead, so no wait sees a phase twice.
  // Persistent (TAIL_WARPS: warps 1..3 take each block from the scheduler's ring as the consumers
  // do): warp 0 goes on to the next block's Q and first tiles while warps 1..3 still transpose this
  // one's last. Their Q waits (a copied Q) are never late, as producer_tma.cuh says of its own.
  static __device__ __forceinline__ void run_tma_paged(const PrefillParams& p, const PrefillWork& w, uint32_t base,
                                                       int tid, const Sm90Walk& walk) {
    if (w.num_tiles == 0) return;  // (the consumers wait for no Q either)
    const int n = w.num_tiles, warp = tid / 32, lane = tid % 32;
    const int rows = ProducerSm90Tma<Cfg>::box_rows(p), all = rows > 0 ? BLOCK_N / rows : 0;
    BoxIds ids;
    if (warp == 0) ids = box_ids(p, w, w.tile_start, rows, all, lane);
    if (!Cfg::TAIL_WARPS || warp == 0 || !QByTma<Cfg, uint8_t>::on(p, w)) {
      wait_q_free<Cfg>(base, walk);
      load_q(p, w, base, tid);
    }
    if (warp == 0) {
      // Every row tile of the head reads these K/V rows again: keep them in L2 over Q and outputs.
      const uint64_t keep = ptx::l2_evict_last();
#pragma unroll 1
      for (int it = 0; it < n; ++it) {
        const int g = walk.tile0 + it, s = walk.stage<STAGES>(it), n0 = w.tile_start + it * BLOCK_N;
        ptx::mbar_wait(Cfg::raw_empty(base, g & 1), ((g >> 1) & 1) ^ 1);  // V(g - 2) transposed
        issue_paged<true>(p, w, base + Cfg::RAW_OFFSET + (g & 1) * Cfg::K_TILE_BYTES, Cfg::raw_full(base, g & 1), n0,
                          rows, all, ids.v, lane, keep);
        ptx::mbar_wait(Cfg::k_empty(base, s), walk.phase<STAGES>(it) ^ 1);
        issue_paged<false>(p, w, base + Cfg::K_OFFSET + s * Cfg::K_TILE_BYTES, Cfg::k_full(base, s), n0, rows, all,
                           ids.k, lane, keep);
        if (it + 1 < n) ids = box_ids(p, w, n0 + BLOCK_N, rows, all, lane);
      }
    } else {
#pragma unroll 1
      for (int it = 0; it < n; ++it) {
        const int g = walk.tile0 + it, s = walk.stage<STAGES>(it), n0 = w.tile_start + it * BLOCK_N;
        const uint32_t raw = base + Cfg::RAW_OFFSET + (g & 1) * Cfg::K_TILE_BYTES;
        ptx::mbar_wait(Cfg::raw_full(base, g & 1), (g >> 1) & 1);  // V(it) has landed
        if (n0 + BLOCK_N > w.kv_len) {
          // the tail: raw V's rows past kv_len (a last page's unused slots, rows no box wrote) to
          // zeros, as 0 * NaN is NaN in P V
#pragma unroll 1
          for (int i = (w.kv_len - n0) * CPR + tid - 32; i < BLOCK_N * CPR; i += Cfg::TRANSPOSE_THREADS)
            ptx::st_shared_zero16(raw + Cfg::swz(BLOCK_N, i / CPR, i % CPR));
          ptx::bar_sync(Cfg::TAIL_ZERO_BAR, Cfg::TRANSPOSE_THREADS);
        }
        ptx::mbar_wait(Cfg::v_empty(base, s), walk.phase<STAGES>(it) ^ 1);
        const uint32_t vt = base + Cfg::V_OFFSET + s * Cfg::VT_TILE_BYTES;
        if (warp == 1)
          transpose_v_of<3, 0>(raw, vt, lane);
        else if (warp == 2)
          transpose_v_of<3, 1>(raw, vt, lane);
        else
          transpose_v_of<3, 2>(raw, vt, lane);
        ptx::fence_proxy_async();  // the stmatrix writes (generic proxy) before the consumers' wgmma reads
        ptx::mbar_arrive(Cfg::v_full(base, s));
        ptx::mbar_arrive(Cfg::raw_empty(base, g & 1));  // (its reads are done: their values are stored)
      }
    }
    ptx::cp_async_wait<0>();  // (Q's copies)
  }
};

}  // namespace pfa
