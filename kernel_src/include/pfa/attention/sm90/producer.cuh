// The producer warpgroup of the sm_90a prefill: Q once, then the K/V tiles of the CTA's key
// range into a STAGES-deep ring, each tile completing on its "full" mbarrier and reused after the
// consumers arrive on its "empty" one.
//
// It copies with cp.async (16 bytes a thread, zero-filled past the request's keys) and signals
// with cp.async.mbarrier.arrive: rows come from the K/V sources (kv_source.cuh), so the same
// producer serves contiguous, ragged and (PAGED) paged K/V at any stride and page size. Each thread owns one 16-byte chunk
// column, so its swizzled shared-memory offsets are fixed but for a compile-time row step.
#pragma once
#include <stdint.h>

#include "pfa/attention/kv_source.cuh"
#include "pfa/attention/params.h"
#include "pfa/attention/sm90/config.cuh"
#include "pfa/attention/work.cuh"
#include "pfa/ptx/mma_sm80.cuh"
#include "pfa/ptx/sm90.cuh"

namespace pfa {

// Q: BLOCK_M packed rows (row r = token r / group, head kv_head * group + r % group) of elements E
// into the 128-byte-swizzled Q tile at s_q, CPR 16-byte chunks a row, ROW_STEP rows between one
// thread's chunks; rows past the request zero-filled. Shared by the 16-bit and the fp8 producers.
template <class Cfg, typename E, int CPR, int ROW_STEP>
__device__ __forceinline__ void load_q_rows(const PrefillParams& p, const PrefillWork& w, uint32_t s_q, int tid) {
  constexpr int CHUNK_ELEMS = Cfg::CHUNK_BYTES / int(sizeof(E));
  const E* q = reinterpret_cast<const E*>(p.q);
  const uint64_t once = ptx::l2_evict_first();  // each Q row is read by one CTA
  const int chunk = tid % CPR;
#pragma unroll 4
  for (int row = tid / CPR; row < Cfg::BLOCK_M; row += ROW_STEP) {
    const int r = w.r0 + row;
    const bool valid = r < w.rows_total;
    const int rr = valid ? r : 0;
    const int qi = rr / w.group, h = w.kv_head * w.group + rr % w.group;
    ptx::cp_async_16_hint(s_q + Cfg::swz(Cfg::BLOCK_M, row, chunk),
                          q + (w.q_row0 + qi) * p.q_stride_n + h * p.q_stride_h + chunk * CHUNK_ELEMS, valid, once);
  }
}

// The pipeline's mbarriers (the Cfg's q_full, then per stage k_full, v_full, k_empty, v_empty):
// the full ones count one arrival per producer thread (its cp.async, or in the fp8 kernels its
// V transpose), or (TMA) the issuing warp's one; the empty ones one per consumer warp; (TMA) the
// tail tile's barrier one, the issuing warp's.
template <class Cfg>
__device__ __forceinline__ void init_ring_barriers(uint32_t base) {
  ptx::mbar_init(Cfg::q_full(base), Cfg::WG_THREADS);
#pragma unroll
  for (int s = 0; s < Cfg::STAGES; ++s) {
    ptx::mbar_init(Cfg::k_full(base, s), Cfg::TMA ? 1 : Cfg::WG_THREADS);
    ptx::mbar_init(Cfg::v_full(base, s), Cfg::TMA ? 1 : Cfg::WG_THREADS);
    ptx::mbar_init(Cfg::k_empty(base, s), Cfg::CONSUMERS * 4);
    ptx::mbar_init(Cfg::v_empty(base, s), Cfg::CONSUMERS * 4);
  }
  if constexpr (Cfg::TMA) ptx::mbar_init(base + Cfg::TAIL_BAR_OFFSET, 1);
  ptx::mbar_fence_init();
}

// Paged K/V by cp.async, shared by the 16-bit and the fp8 producers. The page id of row `tid` of
// the tile at n0 (PagedKvRows' addressing: key t sits in slot t % page_size of page
// pages[t / page_size], ids clamped into the cache when the host could not check them); 0 for a
// thread past the tile's rows or a row past the request.
template <int BLOCK_N>
__device__ __forceinline__ int32_t paged_row_id(const PrefillParams& p, const int32_t* pages, int n0, int kv_len,
                                                int tid) {
  const int t = n0 + tid;
  if (tid >= BLOCK_N || t >= kv_len) return 0;
  const int pg = p.page_shift >= 0 ? t >> p.page_shift : t / p.page_size;
  return checked_page_id(p, __ldg(pages + pg));
}

// One K or V tile (Cfg::BLOCK_N rows of elements E, keys [n0, n0 + BLOCK_N)) from a paged cache
// into the 128-byte-swizzled tile at s_tile: row r's page id staged in s_ids[r], CPR 16-byte
// chunks a row, ROW_STEP rows between one thread's chunks, UNROLL rows a pass; keys at or past
// kv_len zero-filled. `head`: the kv head's base; strides in elements.
template <class Cfg, typename E, int CPR, int ROW_STEP, int UNROLL>
__device__ __forceinline__ void load_paged_tile(uint32_t s_tile, const E* head, const PrefillParams& p,
                                                const int32_t* s_ids, int64_t stride_page, int64_t stride_n, int n0,
                                                int kv_len, int tid, uint64_t policy) {
  constexpr int CHUNK_ELEMS = Cfg::CHUNK_BYTES / int(sizeof(E));
  const int chunk = tid % CPR, r0 = tid / CPR;
  const bool pow2 = p.page_shift >= 0;
#pragma unroll(UNROLL)
  for (int i = 0; i < Cfg::BLOCK_N / ROW_STEP; ++i) {
    const int r = r0 + i * ROW_STEP, t = n0 + r;
    const bool valid = t < kv_len;
    const int slot = pow2 ? t & (p.page_size - 1) : t % p.page_size;
    const E* src = head + (int64_t)s_ids[r] * stride_page + (int64_t)slot * stride_n + chunk * CHUNK_ELEMS;
    ptx::cp_async_16_hint(s_tile + Cfg::swz(Cfg::BLOCK_N, r, chunk), valid ? src : head, valid, policy);
  }
}

template <class Cfg>
struct ProducerSm90 {
  static constexpr bool PAGED = Cfg::PAGED;
  using T = typename Cfg::Elem;
  static constexpr int CPR = Cfg::CPR, BLOCK_N = Cfg::BLOCK_N, STAGES = Cfg::STAGES;
  static constexpr int ROW_STEP = Cfg::WG_THREADS / CPR;  // rows between one thread's chunks
  static_assert(Cfg::WG_THREADS % CPR == 0 && BLOCK_N % ROW_STEP == 0 && Cfg::BLOCK_M % ROW_STEP == 0,
                "whole rows per pass");

  static __device__ __forceinline__ void load_q(const PrefillParams& p, const PrefillWork& w, uint32_t s_q, int tid) {
    load_q_rows<Cfg, T, CPR, ROW_STEP>(p, w, s_q, tid);
  }

  // One K or V tile: keys [n0, n0 + BLOCK_N) of the request's rows from `head` (the kv head's
  // base), keys at or past kv_len zero-filled.
  static __device__ __forceinline__ void load_tile(uint32_t s_tile, const T* head, int64_t stride_n, int64_t row0,
                                                   int n0, int kv_len, int tid, uint64_t policy) {
    const int chunk = tid % CPR, r0 = tid / CPR;
    const char* src = reinterpret_cast<const char*>(head + (row0 + n0 + r0) * stride_n + chunk * 8);
    const int64_t step = (int64_t)ROW_STEP * stride_n * (int64_t)sizeof(T);
    const int valid_rows = kv_len - n0 - r0;
#pragma unroll
    for (int i = 0; i < BLOCK_N / ROW_STEP; ++i) {
      const bool valid = i * ROW_STEP < valid_rows;
      ptx::cp_async_16_hint(s_tile + Cfg::swz(BLOCK_N, r0 + i * ROW_STEP, chunk),
                            valid ? static_cast<const void*>(src) : static_cast<const void*>(head), valid, policy);
      src += step;
    }
  }

  // Paged K/V (paged_row_id, load_paged_tile): each row's page id is loaded one tile ahead into a
  // register, then staged in shared memory for the whole warpgroup (stage_page_ids), so no row's
  // copy waits on a dependent page-table load. Separate V ids (v_page_indices) are loaded when V's
  // tile is copied and staged after K's copies, in the second buffer (K's ids then always use the
  // first): each staging barrier also retires every read of the buffer it is about to overwrite next.
  static __device__ __forceinline__ void stage_page_ids(int32_t* s_ids, int32_t id, int tid) {
    if (tid < BLOCK_N) s_ids[tid] = id;
    ptx::bar_sync(Cfg::PRODUCER_BAR, Cfg::WG_THREADS);
  }

  // One K or V tile by cp.async into stage `s`, through the request's addressing (paged: the
  // staged page ids s_ids), then its full barrier once the stage is free.
  static __device__ __forceinline__ void copy_tile(const PrefillParams& p, const PrefillWork& w, uint32_t s_tile,
                                                   const T* head, int64_t stride_page, int64_t stride_n,
                                                   const int32_t* s_ids, int n0, uint32_t empty, uint32_t full,
                                                   uint32_t free_parity, int tid, uint64_t policy) {
    ptx::mbar_wait(empty, free_parity);
    if constexpr (PAGED)
      load_paged_tile<Cfg, T, CPR, ROW_STEP, 4>(s_tile, head, p, s_ids, stride_page, stride_n, n0, w.kv_len, tid,
                                                policy);
    else
      load_tile(s_tile, head, stride_n, RaggedKvRows{w.kv_row0}.row(0, 0), n0, w.kv_len, tid, policy);
    ptx::cp_async_mbar_arrive(full);
  }

  // base / smem: the aligned shared-memory base as a shared-window address and as a pointer.
  static __device__ __forceinline__ void run(const PrefillParams& p, const PrefillWork& w, uint32_t base, char* smem,
                                             int tid) {
    load_q(p, w, base + Cfg::Q_OFFSET, tid);
    ptx::cp_async_mbar_arrive(Cfg::q_full(base));
    const T* k = reinterpret_cast<const T*>(p.k) + w.kv_head * p.k_stride_h;
    const T* v = reinterpret_cast<const T*>(p.v) + w.kv_head * p.v_stride_h;
    const int32_t* pages = reinterpret_cast<const int32_t*>(p.kv_page_indices) + w.page_base;
    // Every row tile of the head reads these K/V rows again: keep them in L2 over Q and outputs.
    const uint64_t keep = ptx::l2_evict_last();
    int32_t next_id = PAGED ? paged_row_id<BLOCK_N>(p, pages, w.tile_start, w.kv_len, tid) : 0;
    for (int it = 0; it < w.num_tiles; ++it) {
      const int s = it % STAGES;
      const uint32_t free_parity = ((it / STAGES) & 1) ^ 1;
      const int n0 = w.tile_start + it * BLOCK_N;
      int32_t* s_ids = reinterpret_cast<int32_t*>(smem + Cfg::IDS_OFFSET) + (it & 1) * BLOCK_N;
      int32_t* s_v_ids = s_ids;
      if constexpr (PAGED) {
        if (p.v_page_indices != 0) {
          s_ids = reinterpret_cast<int32_t*>(smem + Cfg::IDS_OFFSET);
          s_v_ids = s_ids + BLOCK_N;
        }
        stage_page_ids(s_ids, next_id, tid);
        if (it + 1 < w.num_tiles) next_id = paged_row_id<BLOCK_N>(p, pages, n0 + BLOCK_N, w.kv_len, tid);
      }
      copy_tile(p, w, base + Cfg::K_OFFSET + s * Cfg::KV_TILE_BYTES, k, p.k_stride_page, p.k_stride_n, s_ids, n0,
                Cfg::k_empty(base, s), Cfg::k_full(base, s), free_parity, tid, keep);
      if constexpr (PAGED) {
        if (p.v_page_indices != 0)
          stage_page_ids(s_v_ids, paged_row_id<BLOCK_N>(p, page_table<true>(p) + w.page_base, n0, w.kv_len, tid), tid);
      }
      copy_tile(p, w, base + Cfg::V_OFFSET + s * Cfg::KV_TILE_BYTES, v, p.v_stride_page, p.v_stride_n, s_v_ids, n0,
                Cfg::v_empty(base, s), Cfg::v_full(base, s), free_parity, tid, keep);
    }
    // Every cp.async lands before the warpgroup exits (the barriers they arrive on live in the
    // CTA's shared memory).
    ptx::cp_async_wait<0>();
  }
};

}  // namespace pfa
