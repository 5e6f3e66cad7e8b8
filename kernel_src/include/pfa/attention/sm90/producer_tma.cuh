// The producer warpgroup of the sm_90a prefill when K/V come by TMA (PrefillSm90Config::TMA):
// Q as in producer.cuh (ProducerSm90::load_q), then one warp issues the K/V ring's boxes from the
// host-encoded tensor maps (PrefillParams::k_tmap / v_tmap, pyflashattn/_engine/tma.py); the other
// warps help copy the tiles that do not go by TMA and zero a TMA tail's V rows (tail_v_zero).
//
//  - contiguous / ragged K/V: a 3-D map (column, kv head, row) over the whole K (V) tensor; a tile
//    is HEAD_DIM / 64 boxes of BLOCK_N rows at row kv_row0 + n0.
//  - paged K/V: a 4-D map (column, page slot, kv head, page) over the cache; a tile is BLOCK_N / R
//    boxes of R = min(page_size, BLOCK_N) rows per column block, each at its page's id (page_size
//    divides BLOCK_N or BLOCK_N divides page_size, page_size >= 16: the host routes other page
//    sizes to the cp.async kernel; should one arrive here anyway, every tile takes the copy path
//    below, slower but right).
// Lane l issues box l / COL_BLOCKS of column block l % COL_BLOCKS, its page id loaded a tile ahead
// into a register (and V's, where the call has separate V page ids: PrefillParams::v_page_indices):
// no per-row address math, no shared-memory staging, no warpgroup barrier.
//
// The tile holding the request's last key (the tail: n0 + BLOCK_N > kv_len) goes by TMA too where
// its boxes stay inside the tensors: paged, the boxes of the request's own pages (none past them:
// the page table ends there); ragged, a box ending within K / V's rows (PrefillParams::kv_tokens;
// the ragged map's row extent is ROW_EXTENT, so the map itself bounds nothing). Its V boxes land on
// a tail barrier instead of the stage's; warps 1..3 then zero V's rows at or past kv_len (a last
// page's unused slots, the next request's rows, or a box not issued may hold NaN / Inf, and
// 0 * NaN is NaN in O += P V) and complete the stage, while warp 0 goes on. K's rows past kv_len need nothing:
// the consumers mask those keys to -inf whatever S holds. A tail whose box would pass the tensor
// (the last request of a ragged K / V, kv_tokens 0) is copied by the producer warpgroup with
// zero-filled cp.async.
#pragma once
#include <stdint.h>

#include "pfa/attention/kv_source.cuh"
#include "pfa/attention/params.h"
#include "pfa/attention/sm90/config.cuh"
#include "pfa/attention/sm90/pipeline.cuh"
#include "pfa/attention/sm90/producer.cuh"
#include "pfa/attention/work.cuh"
#include "pfa/ptx/mma_sm80.cuh"
#include "pfa/ptx/sm90.cuh"

namespace pfa {

template <class Cfg>
struct ProducerSm90Tma {
  static constexpr bool PAGED = Cfg::PAGED;
  using T = typename Cfg::Elem;
  static constexpr int BLOCK_N = Cfg::BLOCK_N, STAGES = Cfg::STAGES, CPR = Cfg::CPR;
  // boxes of one swizzle row of columns: 64 16-bit or (the fp8 rows' paged twins,
  // sm90/fp8_producer.cuh) 128 one-byte elements
  static constexpr int BOX_COLS = Cfg::ROW_BYTES / (int)sizeof(T);
  static constexpr int COL_BLOCKS = Cfg::HEAD_DIM / BOX_COLS;
  static constexpr int MIN_BOX_ROWS = 16;                // the smallest page a box covers
  static_assert(COL_BLOCKS * (BLOCK_N / MIN_BOX_ROWS) <= 32, "one lane per (box, column block)");
  static_assert(32 % CPR == 0 || CPR % 32 == 0, "whole rows per warp pass");

  // Rows per box (paged: min(page_size, BLOCK_N); 0 = no TMA geometry for this page size).
  static __device__ __forceinline__ int box_rows(const PrefillParams& p) {
    if constexpr (!PAGED) return BLOCK_N;
    const int ps = p.page_size;
    // whole boxes per tile, each starting on a 1024-byte swizzle atom (8 rows)
    const bool fits = ps >= MIN_BOX_ROWS && ps % 8 == 0 && (BLOCK_N % ps == 0 || ps % BLOCK_N == 0);
    return fits ? min(ps, BLOCK_N) : 0;
  }

  // Whether the tile at n0 goes by TMA (see the header): whole tiles always, the tail where its
  // boxes stay inside the tensors.
  static __device__ __forceinline__ bool by_tma(const PrefillParams& p, const PrefillWork& w, int rows, int n0) {
    if (rows == 0) return false;
    if (PAGED || n0 + BLOCK_N <= w.kv_len) return true;
    return (int64_t)w.kv_row0 + n0 + BLOCK_N <= (int64_t)p.kv_tokens;
  }
  // Boxes of the tile at n0 that start below kv_len (all of them but in the tail).
  static __device__ __forceinline__ int live_boxes(const PrefillWork& w, int rows, int n0) {
    return min(BLOCK_N / rows, (w.kv_len - n0 + rows - 1) / rows);
  }

  // Paged: the page id of this lane's box in the tile at n0 (0 when the lane has none of the tile's
  // `live` boxes), from K's page table (V = false) or V's (page_table: K's unless the call has
  // separate V ids). CHECKED false: as loaded, for the caller's checked_page_id where it uses it
  // (so that the load's latency runs under what comes between).
  template <bool V, bool CHECKED = true>
  static __device__ __forceinline__ int32_t box_page_id(const PrefillParams& p, const PrefillWork& w, int n0,
                                                        int rows, int box, int live) {
    if (box >= live) return 0;
    const int t = n0 + box * rows;
    const int32_t* pages = page_table<V>(p) + w.page_base;
    const int32_t id = __ldg(pages + (p.page_shift >= 0 ? t >> p.page_shift : t / p.page_size));
    return CHECKED ? checked_page_id(p, id) : id;
  }

  // One K or V tile by TMA, its first `live` boxes (live_boxes) completing on `bar`: lane 0
  // announces their bytes, every lane with a live box issues it.
  static __device__ __forceinline__ void tma_tile(const PrefillParams& p, const PrefillWork& w, uint32_t s_tile,
                                                  const void* tmap, uint32_t bar, int n0, int rows, int live,
                                                  int32_t id, int box, int col, int lane, uint64_t policy) {
    if (lane == 0) ptx::mbar_arrive_expect_tx(bar, live * rows * COL_BLOCKS * Cfg::ROW_BYTES);
    __syncwarp();
    if (box >= live) return;
    const uint32_t dst = s_tile + (col * BLOCK_N + box * rows) * Cfg::ROW_BYTES;
    if constexpr (PAGED) {
      const int t = n0 + box * rows;
      const int slot = p.page_shift >= 0 ? t & (p.page_size - 1) : t % p.page_size;
      ptx::tma_load_4d(dst, tmap, col * BOX_COLS, slot, w.kv_head, id, bar, policy);
    } else {
      ptx::tma_load_3d(dst, tmap, col * BOX_COLS, w.kv_head, (int)RaggedKvRows{w.kv_row0}.row(n0, 0), bar, policy);
    }
  }

  // The tail's V tile, once warp 0 has issued its boxes on tail barrier `tails % STAGES` (phase
  // tails / STAGES): warps 1..3 wait for them, zero rows kv_len - n0 .. BLOCK_N - 1 (with warp 0
  // alone the zeroing held the consumers' last P V and warp 0's next block, NOTES.md session 31)
  // and complete the stage's `full` barrier (one arrival). Warp 0 goes on to the next block
  // meanwhile: its Q and first tiles no longer wait for the tail's landing (1.3k cycles a ragged
  // block, NOTES.md session 33). It can be a tail ahead of them at most STAGES - 1 times: its next
  // issue onto the same barrier needs a stage the consumers free only after this tail's `full`.
  static constexpr int TAIL_THREADS = Cfg::WG_THREADS - 32;
  static __device__ __forceinline__ uint32_t tail_bar(uint32_t base, int tails) {
    return base + Cfg::TAIL_BAR_OFFSET + 8 * (tails % STAGES);
  }
  static __device__ __forceinline__ void tail_v_zero(const PrefillWork& w, uint32_t s_tile, uint32_t tail,
                                                     uint32_t parity, uint32_t full, int n0, int tid) {
    ptx::mbar_wait(tail, parity);
#pragma unroll 1
    for (int i = (w.kv_len - n0) * CPR + tid - 32; i < BLOCK_N * CPR; i += TAIL_THREADS)
      ptx::st_shared_zero16(s_tile + Cfg::swz(BLOCK_N, i / CPR, i % CPR));
    ptx::fence_proxy_async();  // the wgmma reads the zeroed rows through the async proxy
    ptx::bar_sync(Cfg::TAIL_ZERO_BAR, TAIL_THREADS);
    if (tid == 32) ptx::mbar_arrive(full);
  }

  // Paged, the copy path: lane l holds the page ids (K's or V's table, as box_page_id) of rows l,
  // l + 32, ... of the tile at n0 (rows at or past kv_len: 0), loaded together so the copies wait
  // on one page-table latency.
  static constexpr int ID_REGS = (BLOCK_N + 31) / 32;
  template <bool V>
  static __device__ __forceinline__ void row_page_ids(const PrefillParams& p, const PrefillWork& w, int n0,
                                                      int lane, int32_t (&ids)[ID_REGS]) {
    const int32_t* pages = page_table<V>(p) + w.page_base;
#pragma unroll
    for (int j = 0; j < ID_REGS; ++j) {
      const int t = n0 + lane + 32 * j;
      const int pg = p.page_shift >= 0 ? t >> p.page_shift : t / p.page_size;
      ids[j] = t < w.kv_len ? checked_page_id(p, __ldg(pages + pg)) : 0;
    }
  }

  // One K or V tile by the producer warpgroup's cp.async, keys at or past kv_len zero-filled: warp
  // 0 waits for the stage (`empty`), the producer barrier hands it to the other warps (which skip
  // the TMA tiles, so they never wait on a ring barrier whose phase they have not followed), and
  // `full` (one arrival) completes once every copy has landed.
  static __device__ __forceinline__ void copy_tile(const PrefillParams& p, const PrefillWork& w, uint32_t s_tile,
                                                   const T* head, int64_t stride_page, int64_t stride_n,
                                                   const int32_t (&ids)[ID_REGS], uint32_t empty, uint32_t free_parity,
                                                   uint32_t full, int n0, int tid, uint64_t policy) {
    if (tid < 32) ptx::mbar_wait(empty, free_parity);
    ptx::bar_sync(Cfg::PRODUCER_BAR, Cfg::WG_THREADS);
    // one warp pass covers whole rows of one 32-row group: the row's id register is the same for
    // every lane
#pragma unroll 1
    for (int i = tid; i < BLOCK_N * CPR; i += Cfg::WG_THREADS) {
      const int r = i / CPR, chunk = i % CPR, t = n0 + r;
      const bool valid = t < w.kv_len;
      const T* src = head;
      if constexpr (PAGED) {
        int32_t id = ids[0];
#pragma unroll
        for (int j = 1; j < ID_REGS; ++j) id = r / 32 == j ? ids[j] : id;
        id = __shfl_sync(0xffffffffu, id, r % 32);
        if (valid) src = head + (int64_t)id * stride_page + (int64_t)(t % p.page_size) * stride_n + chunk * 8;
      } else {
        if (valid) src = head + RaggedKvRows{w.kv_row0}.row(n0, r) * stride_n + chunk * 8;
      }
      ptx::cp_async_16_hint(s_tile + Cfg::swz(BLOCK_N, r, chunk), src, valid, policy);
    }
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
    ptx::fence_proxy_async();  // the wgmma reads the tile through the async proxy
    ptx::bar_sync(Cfg::PRODUCER_BAR, Cfg::WG_THREADS);
    if (tid == 0) ptx::mbar_arrive(full);
  }

  // base: the aligned shared-memory base (shared window).
  // walk: the CTA's place in the ring (its tails field counts this producer's tail tiles).
  static __device__ __forceinline__ void run(const PrefillParams& p, const PrefillWork& w, uint32_t base, int tid,
                                             Sm90Walk& walk) {
    if (w.num_tiles == 0) return;
    const int warp = tid / 32, lane = tid % 32;
    // TAIL_WARPS, Q by TMA: thread 0 gives all of q_full's arrivals, so warps 1..3 neither load Q
    // nor wait for it to be free. Their wait could come two Q rounds late (they trail warp 0 by
    // their decode and the tail's zeroing, and the consumers need nothing of them in a block
    // without a tail), and a wait on q_empty two phases late sees its parity again and never
    // returns: ragged batches with fixed_split_size (short blocks) hung one run in two (NOTES.md,
    // session 35). Where Q is copied they must wait, and then the consumers cannot release that
    // Q before their arrivals, so the wait is never late.
    if (!Cfg::TAIL_WARPS || warp == 0 || !QByTma<Cfg, T>::on(p, w)) {
      wait_q_free<Cfg>(base, walk);
      ProducerSm90<Cfg>::load_q(p, w, base, tid);
    }
    // Every row tile of the head reads these K/V rows again: keep them in L2 over Q and outputs.
    const uint64_t keep = ptx::l2_evict_last();
    const int rows = box_rows(p);
    const int box = rows > 0 ? lane / COL_BLOCKS : BLOCK_N, col = lane % COL_BLOCKS;  // box: none without rows
    const bool v_ids = PAGED && p.v_page_indices != 0;  // V has page ids of its own
    const T* k = reinterpret_cast<const T*>(p.k) + w.kv_head * p.k_stride_h;
    const T* v = reinterpret_cast<const T*>(p.v) + w.kv_head * p.v_stride_h;
    // A work item's key range holds at most one tail (the request's last tile): walk.tails counts
    // the tails before (one a block of a persistent CTA's walk at most), which picks its barrier
    // and phase (tail_v_zero).
    // Boxes of a whole tile, once: the steady state does no division (live_boxes only in the tail).
    const int all_boxes = rows > 0 ? BLOCK_N / rows : 0;
    auto boxes_of = [&](int n0) { return n0 + BLOCK_N <= w.kv_len ? all_boxes : live_boxes(w, rows, n0); };
    int32_t id = 0, id_v = 0;  // warp 0: this tile's page ids of the lane's box (K's, V's)
    if (PAGED && warp == 0 && by_tma(p, w, rows, w.tile_start)) {
      const int live = boxes_of(w.tile_start);
      id = box_page_id<false>(p, w, w.tile_start, rows, box, live);
      id_v = v_ids ? box_page_id<true>(p, w, w.tile_start, rows, box, live) : id;
    }
    for (int it = 0; it < w.num_tiles; ++it) {
      const int s = walk.stage<STAGES>(it);
      const uint32_t free_parity = walk.phase<STAGES>(it) ^ 1;
      const int n0 = w.tile_start + it * BLOCK_N;
      const bool tma = by_tma(p, w, rows, n0), tail = n0 + BLOCK_N > w.kv_len;
      if (warp != 0 && tma && !tail) continue;  // warps 1..3: the copied tiles and a TMA tail's zeroing
      const uint32_t tail_at = tail_bar(base, walk.tails);
      // the next tile's page ids, loaded while this tile waits for its stage
      int32_t next = 0, next_v = 0;
      if (PAGED && warp == 0 && it + 1 < w.num_tiles && by_tma(p, w, rows, n0 + BLOCK_N)) {
        const int live = boxes_of(n0 + BLOCK_N);
        next = box_page_id<false>(p, w, n0 + BLOCK_N, rows, box, live);
        next_v = v_ids ? box_page_id<true>(p, w, n0 + BLOCK_N, rows, box, live) : next;
      }
      const uint32_t k_tile = base + Cfg::K_OFFSET + s * Cfg::KV_TILE_BYTES;
      const uint32_t v_tile = base + Cfg::V_OFFSET + s * Cfg::KV_TILE_BYTES;
      if (tma) {
        if (warp == 0) {
          ptx::mbar_wait(Cfg::k_empty(base, s), free_parity);
          tma_tile(p, w, k_tile, &p.k_tmap, Cfg::k_full(base, s), n0, rows,
                   tail ? live_boxes(w, rows, n0) : all_boxes, id, box, col, lane, keep);
          ptx::mbar_wait(Cfg::v_empty(base, s), free_parity);
          // the tail's V lands on the tail barrier: the warpgroup zeroes past kv_len, then completes it
          tma_tile(p, w, v_tile, &p.v_tmap, tail ? tail_at : Cfg::v_full(base, s), n0, rows,
                   tail ? live_boxes(w, rows, n0) : all_boxes, id_v, box, col, lane, keep);
        }
        if (tail && warp != 0) tail_v_zero(w, v_tile, tail_at, (walk.tails / STAGES) & 1, Cfg::v_full(base, s), n0, tid);
      } else {
        int32_t ids[ID_REGS];
        if (PAGED) row_page_ids<false>(p, w, n0, lane, ids);
        copy_tile(p, w, k_tile, k, p.k_stride_page, p.k_stride_n, ids, Cfg::k_empty(base, s), free_parity,
                  Cfg::k_full(base, s), n0, tid, keep);
        if (PAGED && v_ids) row_page_ids<true>(p, w, n0, lane, ids);
        copy_tile(p, w, v_tile, v, p.v_stride_page, p.v_stride_n, ids, Cfg::v_empty(base, s), free_parity,
                  Cfg::v_full(base, s), n0, tid, keep);
      }
      id = next;
      id_v = next_v;
      if (tma && tail) ++walk.tails;
    }
    if constexpr (!Cfg::PERSISTENT) {
      ptx::cp_async_commit();
      ptx::cp_async_wait<0>();
    }
  }
};

}  // namespace pfa
