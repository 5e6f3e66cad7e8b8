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

#include <type_traits>

#include "pfa/attention/kv_source.cuh"
#include "pfa/attention/params.h"
#include "pfa/attention/sm90/config.cuh"
#include "pfa/attention/sm90/pipeline.cuh"
#include "pfa/attention/work.cuh"
#include "pfa/ptx/mma_sm80.cuh"
#include "pfa/ptx/sm90.cuh"

namespace pfa {

// The Q tile of a work item with tiles to visit (none is loaded for an empty one: its consumers
// write empty rows without waiting): PERSISTENT, once the consumers have released the last one.
template <class Cfg>
__device__ __forceinline__ void wait_q_free(uint32_t base, const Sm90Walk& walk) {
  if constexpr (Cfg::PERSISTENT) ptx::mbar_wait(Cfg::q_empty(base), (walk.q_round & 1) ^ 1);
}

// Q: BLOCK_M packed rows (row r = token r / group, head kv_head * group + r % group) of elements E
// into the 128-byte-swizzled Q tile at s_q, CPR 16-byte chunks a row, ROW_STEP rows between one
// thread's chunks; rows past the request zero-filled. Shared by the 16-bit and the fp8 producers.
// A thread's rows step by ROW_STEP, its token and head by ROW_STEP / group and ROW_STEP % group:
// one division a thread (by the host's multiplier), not one a row (a division a row, with the
// producer's 40 registers spilling round it, took ~4k cycles a block to issue Q's copies, which
// the next block's consumers waited for: NOTES.md, session 25).
template <class Cfg, typename E, int CPR, int ROW_STEP>
__device__ __forceinline__ void load_q_rows(const PrefillParams& p, const PrefillWork& w, uint32_t s_q, int tid) {
  constexpr int CHUNK_ELEMS = Cfg::CHUNK_BYTES / int(sizeof(E));
  const E* q = reinterpret_cast<const E*>(p.q);
  const uint64_t once = ptx::l2_evict_first();  // each Q row is read by one CTA
  const int chunk = tid % CPR, g = w.group;
  const int step_q = group_div(p, ROW_STEP), step_h = ROW_STEP - step_q * g;
  const int64_t step = step_q * p.q_stride_n + step_h * p.q_stride_h;  // elements: the row step
  const int64_t wrap = p.q_stride_n - g * p.q_stride_h;                // the head passing the group
  int r = w.r0 + tid / CPR;
  const int qi = group_div(p, r);
  int h = r - qi * g;
  const E* src = q + (w.q_row0 + qi) * p.q_stride_n + (w.kv_head * g + h) * p.q_stride_h + chunk * CHUNK_ELEMS;
#pragma unroll 4
  for (int row = tid / CPR; row < Cfg::BLOCK_M; row += ROW_STEP) {
    const bool valid = r < w.rows_total;
    ptx::cp_async_16_hint(s_q + Cfg::swz(Cfg::BLOCK_M, row, chunk), valid ? src : q, valid, once);
    r += ROW_STEP;
    src += step;
    h += step_h;
    if (h >= g) {
      h -= g;
      src += wrap;
    }
  }
}

// One contiguous / ragged K or V tile of elements E (keys [n0, n0 + BLOCK_N) of the rows from row0,
// `stride_n` elements apart, of the kv head at `head`) into the 128-byte-swizzled tile at s_tile,
// CPR 16-byte chunks a row, ROW_STEP rows between one thread's chunks, UNROLL copies a pass; keys
// at or past kv_len zero-filled. Shared by the one-byte tiles of the fp8 and the fp8-K/V producers.
template <class Cfg, typename E, int CPR, int ROW_STEP, int UNROLL>
__device__ __forceinline__ void load_tile_rows(uint32_t s_tile, const E* head, int64_t stride_n, int64_t row0, int n0,
                                               int kv_len, int tid, uint64_t policy) {
  constexpr int CHUNK_ELEMS = Cfg::CHUNK_BYTES / int(sizeof(E));
  const int chunk = tid % CPR, r0 = tid / CPR;
  const E* src = head + (row0 + n0 + r0) * stride_n + chunk * CHUNK_ELEMS;
  const int64_t step = (int64_t)ROW_STEP * stride_n;
  const int valid_rows = kv_len - n0 - r0;
  // A thread's rows are ROW_STEP apart, a multiple of the swizzle's 8-row repeat: one swizzled
  // offset, then whole rows (not the swizzle worked out again for every copy).
  static_assert(ROW_STEP % 8 == 0, "the thread's rows share their swizzle phase");
  const uint32_t dst = s_tile + Cfg::swz(Cfg::BLOCK_N, r0, chunk);
#pragma unroll(UNROLL)
  for (int i = 0; i < Cfg::BLOCK_N / ROW_STEP; ++i) {
    const bool valid = i * ROW_STEP < valid_rows;
    ptx::cp_async_16_hint(dst + i * ROW_STEP * Cfg::ROW_BYTES,
                          valid ? static_cast<const void*>(src) : static_cast<const void*>(head), valid, policy);
    src += step;
  }
}

// The pipeline's mbarriers (the Cfg's q_full, then per stage k_full, v_full, k_empty, v_empty):
// the full ones count Cfg::K_FULL_ARRIVALS / V_FULL_ARRIVALS (one per producer thread: its
// cp.async, or in the fp8 kernels its V transpose; TMA: the issuing thread's one); the empty ones
// one per consumer warp; the Cfg's TMA_BARS barriers at TMA_BAR_OFFSET (16-bit: the tail tiles';
// fp8: the raw V buffers') Cfg::tma_bar_arrivals(i); (PERSISTENT) Q's empty one one per consumer thread
// (ConsumerSm90::release_q).
template <class Cfg>
__device__ __forceinline__ void init_ring_barriers(uint32_t base) {
  ptx::mbar_init(Cfg::q_full(base), Cfg::WG_THREADS);
  if constexpr (Cfg::PERSISTENT) ptx::mbar_init(Cfg::q_empty(base), Cfg::CONSUMERS * Cfg::WG_THREADS);
#pragma unroll
  for (int s = 0; s < Cfg::STAGES; ++s) {
    ptx::mbar_init(Cfg::k_full(base, s), Cfg::K_FULL_ARRIVALS);
    ptx::mbar_init(Cfg::v_full(base, s), Cfg::V_FULL_ARRIVALS);
    ptx::mbar_init(Cfg::k_empty(base, s), Cfg::CONSUMERS * 4);
    ptx::mbar_init(Cfg::v_empty(base, s), Cfg::CONSUMERS * 4);
  }
#pragma unroll
  for (int i = 0; i < Cfg::TMA_BARS; ++i) ptx::mbar_init(base + Cfg::TMA_BAR_OFFSET + 8 * i, Cfg::tma_bar_arrivals(i));
  ptx::mbar_fence_init();
}

// Paged K/V by cp.async, shared by the 16-bit and the fp8 producers (elements E, CPR 16-byte
// chunks a row, ROW_STEP rows between one thread's chunks; PagedKvRows' addressing: key t sits in
// slot t % page_size of page pages[t / page_size]). Every row's address is worked out once, by one
// lane, not by each of the CPR threads that copy its chunks. Lane l of warp w owns row
// owned_row(w, l), one of the WARP_ROWS rows its warp copies; it loads that row's page id one tile
// ahead (owned_page_id) and turns it into the row's byte offset within the kv head (page_offset);
// each copy then takes its row's offset from the owning lane by shuffle (load_tile_paged). No
// per-copy page arithmetic (it was ~26 instructions a 16-byte copy, which made the producer warps,
// not the memory, the paged kernels' limit), no shared-memory staging, no producer barrier.
template <class Cfg, int CPR, int ROW_STEP>
struct OwnedRows {
  static constexpr int WARP_R0 = 32 / CPR;                                // rows one warp pass covers
  static constexpr int WARP_ROWS = WARP_R0 * (Cfg::BLOCK_N / ROW_STEP);  // rows one warp copies
  // (checked where a paged row instantiates owned_page_id / load_tile_paged)
  static constexpr bool FITS = 32 % CPR == 0 && ROW_STEP % WARP_R0 == 0 && WARP_ROWS <= 32;
};
template <class Cfg, int CPR, int ROW_STEP>
__device__ __forceinline__ int owned_row(int tid) {
  constexpr int WARP_R0 = OwnedRows<Cfg, CPR, ROW_STEP>::WARP_R0;
  const int lane = tid % 32;
  return tid / 32 * WARP_R0 + lane % WARP_R0 + ROW_STEP * (lane / WARP_R0);
}
// The page id of key t (the owned row of a tile), ids clamped into the cache when the host could
// not check them (checked_page_id); 0 for a lane without a row or a key past kv_len.
template <class Cfg, int CPR, int ROW_STEP>
__device__ __forceinline__ int32_t owned_page_id(const PrefillParams& p, const int32_t* pages, int t, int kv_len,
                                                 int tid) {
  using Rows = OwnedRows<Cfg, CPR, ROW_STEP>;
  static_assert(Rows::FITS, "paged: one owning lane per row of a warp");
  if (tid % 32 >= Rows::WARP_ROWS || t >= kv_len) return 0;
  return checked_page_id(p, __ldg(pages + (p.page_shift >= 0 ? t >> p.page_shift : t / p.page_size)));
}
// Paged: the owned row's page ids of a request's tiles (owned_page_id), K's and V's (its own
// where the call has them, else K's), the tables' bases worked out once. The producers load a
// tile's ids a tile ahead of its copies.
template <class Cfg, int CPR, int ROW_STEP>
struct OwnedPageIds {
  const int32_t* k_pages;
  const int32_t* v_pages;
  bool v_ids;
  int32_t k = 0, v = 0;  // the ids of the tile last loaded
  __device__ __forceinline__ OwnedPageIds(const PrefillParams& p, const PrefillWork& w)
      : k_pages(page_table<false>(p) + w.page_base),
        v_pages(page_table<true>(p) + w.page_base),
        v_ids(Cfg::PAGED && p.v_page_indices != 0) {}
  // the ids of key t (the owned row of a tile)
  __device__ __forceinline__ void load(const PrefillParams& p, int t, int kv_len, int tid) {
    k = owned_page_id<Cfg, CPR, ROW_STEP>(p, k_pages, t, kv_len, tid);
    v = v_ids ? owned_page_id<Cfg, CPR, ROW_STEP>(p, v_pages, t, kv_len, tid) : k;
  }
};
// Byte offset of key t within a kv head: id * stride_page + slot * stride_n (elements E), 0 past kv_len.
template <typename E>
__device__ __forceinline__ int64_t page_offset(const PrefillParams& p, int32_t id, int t, int kv_len,
                                               int64_t stride_page, int64_t stride_n) {
  const int slot = p.page_shift >= 0 ? t & (p.page_size - 1) : t % p.page_size;
  return t < kv_len ? ((int64_t)id * stride_page + (int64_t)slot * stride_n) * (int64_t)sizeof(E) : 0;
}
// Rows a thread copies from one page in a row, where its rows (ROW_STEP apart from r0 < ROW_STEP,
// tiles on the BLOCK_N grid) come in runs of a page each, starting at the same copy index for
// every lane: a page size that is a power of two of at least ROW_STEP (page_shift) and that
// divides BLOCK_N or that BLOCK_N divides. 1 otherwise (every row its own).
template <class Cfg, int ROW_STEP>
__device__ __forceinline__ int page_run_rows(int page_shift) {
  constexpr int ROWS = Cfg::BLOCK_N / ROW_STEP;
  if (page_shift < 0) return 1;
  const int ps = 1 << page_shift;
  if (ps < ROW_STEP || (Cfg::BLOCK_N % ps != 0 && ps % Cfg::BLOCK_N != 0)) return 1;
  return min(ps / ROW_STEP, ROWS);
}
// A thread's ROWS copies in runs of RUN rows of one page: each run's first row takes its byte
// offset from the owning lane by shuffle, the rest step `step` bytes (ROW_STEP slots) on. Whole
// runs unrolled (the copies' issue is the paged producer's cost), UNROLL copies a pass as before.
template <class Cfg, int CPR, int ROW_STEP, int RUN, int UNROLL, class Copy>
__device__ __forceinline__ void paged_rows_in_runs(int64_t row_off, int b, int64_t step, Copy copy) {
  constexpr int ROWS = Cfg::BLOCK_N / ROW_STEP, WARP_R0 = OwnedRows<Cfg, CPR, ROW_STEP>::WARP_R0;
  static_assert(ROWS % RUN == 0, "whole runs");
#pragma unroll(UNROLL > RUN ? UNROLL / RUN : 1)
  for (int i0 = 0; i0 < ROWS; i0 += RUN) {
    int64_t off = __shfl_sync(0xffffffffu, row_off, i0 * WARP_R0 + b);
#pragma unroll
    for (int j = 0; j < RUN; ++j) {
      copy(i0 + j, off);
      off += step;  // past kv_len too: such a copy reads nothing (zero-filled)
    }
  }
}
// As paged_rows_in_runs where a page's slots are back to back (Cfg::DENSE_KV: the step is
// STEP_BYTES, a constant): a run's copies address one base plus immediates, and each copy's
// validity is one compare of the rows left (rows_left: keys from this thread's first row to
// kv_len) against an immediate. Fully unrolled: 4.4 instructions a copy at hd128 page 32 against
// 7.0 with the step in a register (NOTES.md, session 32: in the kernel beside the strided path, that
// code cost the strided path 3-5%; as a twin of its own it costs that path nothing).
template <class Cfg, int CPR, int ROW_STEP, int RUN, int STEP_BYTES, class Copy>
__device__ __forceinline__ void dense_rows_in_runs(int64_t row_off, int b, int rows_left, Copy copy) {
  constexpr int ROWS = Cfg::BLOCK_N / ROW_STEP, WARP_R0 = OwnedRows<Cfg, CPR, ROW_STEP>::WARP_R0;
  static_assert(ROWS % RUN == 0, "whole runs");
#pragma unroll
  for (int i0 = 0; i0 < ROWS; i0 += RUN) {
    const int64_t off = __shfl_sync(0xffffffffu, row_off, i0 * WARP_R0 + b);
#pragma unroll
    for (int j = 0; j < RUN; ++j) copy(i0 + j, off + j * STEP_BYTES, (i0 + j) * ROW_STEP < rows_left);
  }
}
// f(std::integral_constant<int, RUN>) for the longest run length compiled in (8, 4, 2, 1 rows:
// those dividing ROWS, up to MAX_RUN) that `run` (page_run_rows) allows: one copy path per length.
template <int ROWS, int MAX_RUN, class F>
__device__ __forceinline__ void by_page_run(int run, F&& f) {
  if constexpr (ROWS % 8 == 0 && MAX_RUN >= 8) {
    if (run >= 8) return f(std::integral_constant<int, 8>{});
  }
  if constexpr (ROWS % 4 == 0 && MAX_RUN >= 4) {
    if (run >= 4) return f(std::integral_constant<int, 4>{});
  }
  if constexpr (ROWS % 2 == 0 && MAX_RUN >= 2) {
    if (run >= 2) return f(std::integral_constant<int, 2>{});
  }
  f(std::integral_constant<int, 1>{});
}
// A zero-filled 16-byte cp.async, with the L2 policy (HINT) or without (load_tile_paged's copies).
template <bool HINT>
__device__ __forceinline__ void copy16(uint32_t dst, const void* src, bool valid, uint64_t policy) {
  if constexpr (HINT)
    ptx::cp_async_16_hint(dst, src, valid, policy);
  else
    ptx::cp_async_16(dst, src, valid);
}
// One paged K or V tile (Cfg::BLOCK_N rows of elements E, keys [n0, n0 + BLOCK_N)) into the
// 128-byte-swizzled tile at s_tile: row r's byte offset from its owning lane (row_off: this lane's
// row's), once a page run (page_run_rows; the owned-row shuffles were the paged producer's
// short-scoreboard stalls); keys at or past kv_len zero-filled. `head`: the kv head's base,
// stride_n: the cache's elements from one slot of a page to the next. MAX_RUN caps the run
// lengths compiled in (1: every row its own shuffle, as before the runs). DENSE: stride_n is
// Cfg::HEAD_DIM (Cfg::DENSE_KV), the runs' copies dense_rows_in_runs'.
template <class Cfg, typename E, int CPR, int ROW_STEP, int UNROLL, int MAX_RUN = 8, bool DENSE = false,
          bool HINT = true>
__device__ __forceinline__ void load_tile_paged(uint32_t s_tile, const E* head, int64_t row_off, int n0, int kv_len,
                                                int page_shift, int64_t stride_n, int tid, uint64_t policy) {
  using Rows = OwnedRows<Cfg, CPR, ROW_STEP>;
  static_assert(Rows::FITS, "paged: one owning lane per row of a warp");
  constexpr int ROWS = Cfg::BLOCK_N / ROW_STEP;
  const int chunk = tid % CPR, r0 = tid / CPR, b = r0 % Rows::WARP_R0;
  const char* src = reinterpret_cast<const char*>(head) + chunk * Cfg::CHUNK_BYTES;
  // Rows ROW_STEP apart share their swizzle phase when ROW_STEP is a multiple of its 8-row repeat:
  // one swizzled offset plus whole rows then (not the swizzle worked out for every copy).
  const uint32_t dst0 = s_tile + Cfg::swz(Cfg::BLOCK_N, r0, chunk);
  if constexpr (DENSE) {
    const int run = page_run_rows<Cfg, ROW_STEP>(page_shift);
    auto copy_valid = [&](int i, int64_t off, bool valid) {
      const uint32_t dst = ROW_STEP % 8 == 0 ? dst0 + i * ROW_STEP * Cfg::ROW_BYTES
                                             : s_tile + Cfg::swz(Cfg::BLOCK_N, r0 + i * ROW_STEP, chunk);
      copy16<HINT>(dst, src + off, valid, policy);
    };
    constexpr int STEP = ROW_STEP * Cfg::HEAD_DIM * (int)sizeof(E);
    const int left = kv_len - n0 - r0;
    return by_page_run<ROWS, MAX_RUN>(run, [&](auto run_c) {
      dense_rows_in_runs<Cfg, CPR, ROW_STEP, decltype(run_c)::value, STEP>(row_off, b, left, copy_valid);
    });
  }
  auto copy = [&](int i, int64_t off) {
    const int r = r0 + i * ROW_STEP;
    const uint32_t dst =
        ROW_STEP % 8 == 0 ? dst0 + i * ROW_STEP * Cfg::ROW_BYTES : s_tile + Cfg::swz(Cfg::BLOCK_N, r, chunk);
    copy16<HINT>(dst, src + off, n0 + r < kv_len, policy);
  };
  const int64_t step = (int64_t)ROW_STEP * stride_n * (int64_t)sizeof(E);
  const int run = page_run_rows<Cfg, ROW_STEP>(page_shift);
  by_page_run<ROWS, MAX_RUN>(run, [&](auto run_c) {
    paged_rows_in_runs<Cfg, CPR, ROW_STEP, decltype(run_c)::value, UNROLL>(row_off, b, step, copy);
  });
}

// One paged K or V tile as load_tile_paged, in warp spans (Cfg::SPANS): warp w copies the tile's
// rows [32 w, 32 w + 32), lane l rows l / CPR + WR0 i (WR0 = 32 / CPR rows a warp pass), so that
// a thread's copies cross few pages: at hd128 page 16 two runs of 8 copies a tile, two offset
// shuffles, against eight runs of 2 with the rows interleaved. The owning lane of a span's row r is
// lane r (owned_row: tid), so a run from copy i of lane b takes lane i WR0 + b's offset. A thread's
// rows step by WR0, not by whole swizzle repeats: its chunk's swizzle phase (c ^ r % 8) takes
// 8 / WR0 values, the lane's own XOR a constant where copies go in groups of whole periods.
template <class Cfg, typename E, int CPR, int UNROLL, int MAX_RUN = 8>
__device__ __forceinline__ void load_tile_spans(uint32_t s_tile, const E* head, int64_t row_off, int n0, int kv_len,
                                                int page_shift, int64_t stride_n, int tid, uint64_t policy) {
  constexpr int WR0 = 32 / CPR, ROWS = 32 / WR0;
  static_assert(32 % CPR == 0 && Cfg::BLOCK_N == 32 * (Cfg::WG_THREADS / 32) && WR0 <= 8, "a warp's span: 32 rows");
  const int lane = tid % 32, chunk = lane % CPR, r0 = tid / 32 * 32 + lane / CPR;
  const char* src = reinterpret_cast<const char*>(head) + chunk * Cfg::CHUNK_BYTES;
  const uint32_t dst0 = s_tile + (uint32_t)((chunk >> 3) * Cfg::BLOCK_N * Cfg::ROW_BYTES + r0 * Cfg::ROW_BYTES);
  const uint32_t phase = (uint32_t)((chunk & 7) ^ (r0 & 7));  // r0 % 8 < WR0: no carry into i WR0
  // copy g + i (g a multiple of the phase's period 8 / WR0, i a constant): the phase a constant
  auto copy = [&](int g, int i, int64_t off) {
    const uint32_t dst = dst0 + (g + i) * WR0 * Cfg::ROW_BYTES + ((phase ^ (uint32_t)((i * WR0) & 7)) << 4);
    ptx::cp_async_16_hint(dst, src + off, n0 + r0 + (g + i) * WR0 < kv_len, policy);
  };
  const int64_t step = (int64_t)WR0 * stride_n * (int64_t)sizeof(E);
  // runs: a page holds page_size / WR0 of a thread's rows (page sizes that are powers of two: the
  // spans and the tiles start on page boundaries or inside one page)
  const int run = page_shift < 0 || (1 << page_shift) < WR0 ? 1 : min((1 << page_shift) / WR0, ROWS);
  by_page_run<ROWS, MAX_RUN>(run, [&](auto run_c) {
    constexpr int RUN = decltype(run_c)::value, PERIOD = 8 / WR0;
    constexpr int GROUP = RUN > UNROLL ? (RUN > PERIOD ? RUN : PERIOD) : (UNROLL > PERIOD ? UNROLL : PERIOD);
    static_assert(ROWS % GROUP == 0 && GROUP % RUN == 0, "whole groups of whole runs");
#pragma unroll 1
    for (int g = 0; g < ROWS; g += GROUP) {
#pragma unroll
      for (int i1 = 0; i1 < GROUP; i1 += RUN) {
        int64_t off = __shfl_sync(0xffffffffu, row_off, (g + i1) * WR0 + lane / CPR);
#pragma unroll
        for (int j = 0; j < RUN; ++j) {
          copy(g, i1 + j, off);
          off += step;  // past kv_len too: such a copy reads nothing (zero-filled)
        }
      }
    }
  });
}

// Q by TMA (the TMA rows of both families, through load_q_tile), where the
// host gave Q's map (q_tma, tma.QMap) and the tile's tokens stay within q_tokens: thread 0
// announces the tile's bytes on q_full and issues COL_BLOCKS boxes of group heads x BLOCK_M / group
// tokens (rows past the request then hold the next request's Q: never stored, never voting); the
// other threads arrive (TAIL_WARPS: thread 0 for them). A few instructions of one thread instead
// of the copies, which took 2-3k cycles to issue at each block's start beside the consumers'
// epilogue (16-bit rows: NOTES.md, session 28; e4m3 rows ~1.8k, session 42).
template <class Cfg, typename T>
struct QByTma {
  static constexpr int BOX_COLS = Cfg::ROW_BYTES / (int)sizeof(T), COL_BLOCKS = Cfg::HEAD_DIM / BOX_COLS;
  static_assert(Cfg::HEAD_DIM % BOX_COLS == 0, "Q in whole 128-byte column blocks");
  static __device__ __forceinline__ bool on(const PrefillParams& p, const PrefillWork& w) {
    const int tokens = group_div(p, Cfg::BLOCK_M), t0 = (int)w.q_row0 + group_div(p, w.r0);
    return p.q_tma != 0 && (int64_t)t0 + tokens <= (int64_t)p.q_tokens;
  }
  static __device__ __forceinline__ void load(const PrefillParams& p, const PrefillWork& w, uint32_t base, int tid) {
    const int t0 = (int)w.q_row0 + group_div(p, w.r0);
    if (tid == 0) {
      ptx::mbar_arrive_expect_tx(Cfg::q_full(base), Cfg::Q_BYTES);
      // TAIL_WARPS: the other threads' arrivals too, so that warp 0 need not wait for warps 1..3
      // (still zeroing the last block's tail, producer_tma.cuh)
      if constexpr (Cfg::TAIL_WARPS) ptx::mbar_arrive_count(Cfg::q_full(base), Cfg::WG_THREADS - 1);
      const uint64_t once = ptx::l2_evict_first();  // each Q row is read by one CTA
#pragma unroll
      for (int col = 0; col < COL_BLOCKS; ++col)
        ptx::tma_load_3d(base + Cfg::Q_OFFSET + col * Cfg::BLOCK_M * Cfg::ROW_BYTES, &p.q_tmap, col * BOX_COLS,
                         w.kv_head * w.group, t0, Cfg::q_full(base), once);
    } else if constexpr (!Cfg::TAIL_WARPS) {
      ptx::mbar_arrive(Cfg::q_full(base));
    }
  }
};

// A row tile's Q of elements E into the Q tile, completing q_full (WG_THREADS arrivals): on the TMA
// rows by TMA where QByTma can, else every producer thread's copies (load_q_rows: rows past the
// request zero-filled). Both families' producers (ProducerSm90::load_q, fp8_producer.cuh). Not
// by TMA on the cp.async rows: the paged ones lost 1-3% with it (NOTES.md, session 28), the ragged
// ones gained 0.3-0.5%.
template <class Cfg, typename E, int CPR, int ROW_STEP>
__device__ __forceinline__ void load_q_tile(const PrefillParams& p, const PrefillWork& w, uint32_t base, int tid) {
  if constexpr (Cfg::TMA) {
    if (QByTma<Cfg, E>::on(p, w)) {
      QByTma<Cfg, E>::load(p, w, base, tid);
      return;
    }
  }
  load_q_rows<Cfg, E, CPR, ROW_STEP>(p, w, base + Cfg::Q_OFFSET, tid);
  ptx::cp_async_mbar_arrive(Cfg::q_full(base));
}

template <class Cfg>
struct ProducerSm90 {
  static constexpr bool PAGED = Cfg::PAGED;
  using T = typename Cfg::Elem;
  static constexpr int CPR = Cfg::CPR, BLOCK_N = Cfg::BLOCK_N, STAGES = Cfg::STAGES;
  static constexpr int ROW_STEP = Cfg::WG_THREADS / CPR;  // rows between one thread's chunks
  static constexpr bool SPANS = Cfg::SPANS;  // the copies' mapping: load_tile_spans
  static_assert(Cfg::WG_THREADS % CPR == 0 && BLOCK_N % ROW_STEP == 0 && Cfg::BLOCK_M % ROW_STEP == 0,
                "whole rows per pass");

  // The row tile's Q (load_q_tile).
  static __device__ __forceinline__ void load_q(const PrefillParams& p, const PrefillWork& w, uint32_t base, int tid) {
    load_q_tile<Cfg, T, CPR, ROW_STEP>(p, w, base, tid);
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

  // One K or V tile by cp.async into stage `s`, through the request's addressing (paged: row_off,
  // OwnedRows above), then its full barrier once the stage is free.
  static __device__ __forceinline__ void copy_tile(const PrefillWork& w, uint32_t s_tile, const T* head,
                                                   int64_t stride_n, int64_t row_off, int page_shift, int n0,
                                                   uint32_t empty, uint32_t full, uint32_t free_parity, int tid,
                                                   uint64_t policy) {
    ptx::mbar_wait(empty, free_parity);
    if constexpr (SPANS)
      load_tile_spans<Cfg, T, CPR, 4>(s_tile, head, row_off, n0, w.kv_len, page_shift, stride_n, tid, policy);
    else if constexpr (PAGED)
      load_tile_paged<Cfg, T, CPR, ROW_STEP, 4, 8, Cfg::DENSE_KV>(s_tile, head, row_off, n0, w.kv_len, page_shift,
                                                                  stride_n, tid, policy);
    else
      load_tile(s_tile, head, stride_n, RaggedKvRows{w.kv_row0}.row(0, 0), n0, w.kv_len, tid, policy);
    ptx::cp_async_mbar_arrive(full);
  }

  // base: the aligned shared-memory base as a shared-window address.
  static __device__ __forceinline__ void run(const PrefillParams& p, const PrefillWork& w, uint32_t base, int tid,
                                             const Sm90Walk& walk) {
    if (w.num_tiles == 0) return;
    wait_q_free<Cfg>(base, walk);
    load_q(p, w, base, tid);
    const T* k = reinterpret_cast<const T*>(p.k) + w.kv_head * p.k_stride_h;
    const T* v = reinterpret_cast<const T*>(p.v) + w.kv_head * p.v_stride_h;
    // Paged: the owned row's page ids of the next tile (K's, and V's own where the call has them)
    OwnedPageIds<Cfg, CPR, ROW_STEP> next(p, w);
    const int row = SPANS ? tid : owned_row<Cfg, CPR, ROW_STEP>(tid);
    // Every row tile of the head reads these K/V rows again: keep them in L2 over Q and outputs.
    const uint64_t keep = ptx::l2_evict_last();
    if constexpr (PAGED) next.load(p, w.tile_start + row, w.kv_len, tid);
    for (int it = 0; it < w.num_tiles; ++it) {
      const int s = walk.stage<STAGES>(it);
      const uint32_t free_parity = walk.phase<STAGES>(it) ^ 1;
      const int n0 = w.tile_start + it * BLOCK_N;
      int64_t k_off = 0, v_off = 0;
      if constexpr (PAGED) {
        const int t = n0 + row;
        // (DENSE_KV: the slot stride is HEAD_DIM, a shift)
        k_off = page_offset<T>(p, next.k, t, w.kv_len, p.k_stride_page, Cfg::DENSE_KV ? Cfg::HEAD_DIM : p.k_stride_n);
        v_off = page_offset<T>(p, next.v, t, w.kv_len, p.v_stride_page, Cfg::DENSE_KV ? Cfg::HEAD_DIM : p.v_stride_n);
        if (it + 1 < w.num_tiles) next.load(p, t + BLOCK_N, w.kv_len, tid);
      }
      copy_tile(w, base + Cfg::K_OFFSET + s * Cfg::KV_TILE_BYTES, k, p.k_stride_n, k_off, p.page_shift, n0,
                Cfg::k_empty(base, s), Cfg::k_full(base, s), free_parity, tid, keep);
      copy_tile(w, base + Cfg::V_OFFSET + s * Cfg::KV_TILE_BYTES, v, p.v_stride_n, v_off, p.page_shift, n0,
                Cfg::v_empty(base, s), Cfg::v_full(base, s), free_parity, tid, keep);
    }
    // Every cp.async lands before the warpgroup exits (the barriers they arrive on live in the
    // CTA's shared memory; PERSISTENT: after its last block, run_warp_specialized_cta).
    if constexpr (!Cfg::PERSISTENT) ptx::cp_async_wait<0>();
  }
};

}  // namespace pfa
