// The producer warpgroup of the sm_90a prefill over one-byte K/V (PrefillSm90Config::KV_FP8: a
// 16-bit Q over an e4m3fn / e5m2 cache, the batch wrappers' kv_data_type). Q as the 16-bit
// producer loads it; then each K / V tile is copied as stored (cp.async, one-byte rows in the
// 128-byte swizzle, zero-filled past kv_len) into one of two raw tile pairs, and once it has
// landed, widened into the 16-bit K / V stage the consumers read (K in the query's type, V in
// fp16: Cfg::VElem). The consumers and the epilogue are the 16-bit family's: k_scale sits in the
// logit scale, v_scale in the output's.
//
// Each thread widens exactly the raw chunks it copied (load_tile_rows / load_tile_paged give
// thread t chunk t % CPR of rows t / CPR + i ROW_STEP), so its own cp.async.wait_group makes them
// visible and a raw buffer is reused only by the thread that read it: no producer barrier. Tile
// it + 1's copies are in flight while tile it is widened. A raw chunk (16 dims) becomes the
// 16-bit chunks 2c and 2c + 1 of its row (widen_fp8x4: bf16 by bit moves and a packed multiply,
// fp16 by the hardware conversion (e4m3) or a byte move (e5m2); fp8 Inf / NaN codes are not
// preserved, as in the sm80 family's widening).
#pragma once
#include <stdint.h>

#include <type_traits>

#include "pfa/attention/kv_source.cuh"
#include "pfa/attention/params.h"
#include "pfa/attention/sm90/pipeline.cuh"
#include "pfa/attention/sm90/producer.cuh"
#include "pfa/attention/work.cuh"
#include "pfa/common/dtypes.cuh"
#include "pfa/ptx/mma_sm80.cuh"
#include "pfa/ptx/sm90.cuh"

namespace pfa {

template <class Cfg>
struct ProducerSm90Widen {
  using T = typename Cfg::Elem;
  static constexpr int BLOCK_N = Cfg::BLOCK_N, STAGES = Cfg::STAGES, ROW_BYTES = Cfg::ROW_BYTES;
  static constexpr int CPR = Cfg::HEAD_DIM / 16;          // one-byte elements: 16 a chunk
  static constexpr int ROW_STEP = Cfg::WG_THREADS / CPR;  // rows between one thread's chunks
  static constexpr int ROWS = BLOCK_N / ROW_STEP;         // raw chunks a thread copies (and widens) a tile
  static_assert(Cfg::KV_FP8 && Cfg::WG_THREADS % CPR == 0 && BLOCK_N % ROW_STEP == 0 && ROW_STEP % 8 == 0,
                "whole rows per pass, a thread's rows in one swizzle phase");
  // copies a pass: two rows fit the 32 / 56 producer registers with the widening's addresses live
  static constexpr int UNROLL = 2;
  // raw chunks loaded together before they are widened (widen_as): as many as the registers hold
  static constexpr int WIDEN_BATCH = Cfg::PRODUCER_REGS >= 56 ? 4 : 2;
  static_assert(ROWS % WIDEN_BATCH == 0, "whole batches");
  // Paged copies one row at a time (load_tile_paged's MAX_RUN = 1), as the fp8 producer: with the
  // page-run paths compiled in, ptxas 13.0 gave these copies the `[R + UR0 + imm], desc[UR1]` form
  // that stops the GPU (build_tools/nvcc_guard.sh refuses it).
  static constexpr int PAGE_RUN_MAX = 1;
  static constexpr int NO_PAGE_RUNS = -1;  // load_tile_paged's page_shift: no runs to find

  // The raw K (IS_V false) or V tile of buffer b.
  template <bool IS_V>
  static __device__ __forceinline__ uint32_t raw(uint32_t base, int b) {
    return base + Cfg::RAW_OFFSET + (2 * b + IS_V) * Cfg::RAW_TILE_BYTES;
  }

  // This thread's raw chunks of a tile at s_raw -> its 16-bit chunks (E) of the stage at s_tile.
  template <typename E, int FMT>
  static __device__ __forceinline__ void widen_as(uint32_t s_raw, uint32_t s_tile, int tid) {
    const int chunk = tid % CPR, r0 = tid / CPR;
    const uint32_t src = s_raw + Cfg::swz(BLOCK_N, r0, chunk);
    const uint32_t dst0 = s_tile + Cfg::swz(BLOCK_N, r0, 2 * chunk), dst1 = s_tile + Cfg::swz(BLOCK_N, r0, 2 * chunk + 1);
    // WIDEN_BATCH chunks' loads issued back to back, then their conversions and stores: the
    // shared-memory accesses are volatile, so one chunk at a time would wait out each load.
#pragma unroll 1
    for (int i0 = 0; i0 < ROWS; i0 += WIDEN_BATCH) {
      uint4 r[WIDEN_BATCH];
#pragma unroll
      for (int j = 0; j < WIDEN_BATCH; ++j) r[j] = ptx::ld_shared_v4(src + (i0 + j) * ROW_STEP * ROW_BYTES);
#pragma unroll
      for (int j = 0; j < WIDEN_BATCH; ++j) {
        const uint32_t step = (i0 + j) * ROW_STEP * ROW_BYTES;  // whole rows: the same swizzle phase
        const uint2 a = widen_fp8x4<E, FMT>(r[j].x), b = widen_fp8x4<E, FMT>(r[j].y);
        const uint2 c = widen_fp8x4<E, FMT>(r[j].z), d = widen_fp8x4<E, FMT>(r[j].w);
        ptx::st_shared_v4(dst0 + step, a.x, a.y, b.x, b.y);
        ptx::st_shared_v4(dst1 + step, c.x, c.y, d.x, d.y);
      }
    }
  }
  // K into the query's type, V into the P V GEMM's (Cfg::VElem: fp16). The format is a runtime
  // field (PrefillParams::kv_fp8): one branch a tile, each loop with its conversion's constants in
  // the instructions.
  template <bool IS_V>
  static __device__ __forceinline__ void widen(const PrefillParams& p, uint32_t s_raw, uint32_t s_tile, int tid) {
    using E = typename std::conditional<IS_V, typename Cfg::VElem, T>::type;
    if (p.kv_fp8 == kFp8E5M2)
      widen_as<E, kFp8E5M2>(s_raw, s_tile, tid);
    else
      widen_as<E, kFp8E4M3>(s_raw, s_tile, tid);
  }

  // A widened tile into stage s: wait for the consumers to free it, widen, fence the generic
  // stores for the async proxy (the consumers' wgmma), announce it (one arrival a thread).
  template <bool IS_V>
  static __device__ __forceinline__ void fill_stage(const PrefillParams& p, uint32_t s_raw, uint32_t s_tile,
                                                    uint32_t empty, uint32_t full, uint32_t free_parity, int tid) {
    ptx::mbar_wait(empty, free_parity);
    widen<IS_V>(p, s_raw, s_tile, tid);
    ptx::fence_proxy_async();
    ptx::mbar_arrive(full);
  }

  // base: the aligned shared-memory base as a shared-window address. walk: the CTA's place in the
  // ring (sm90/pipeline.cuh). The raw buffers restart at 0 every work item: the item before ended
  // with all of its raw tiles widened.
  static __device__ __forceinline__ void run(const PrefillParams& p, const PrefillWork& w, uint32_t base, int tid,
                                             const Sm90Walk& walk) {
    if (w.num_tiles == 0) return;  // (the consumers wait for no Q either)
    wait_q_free<Cfg>(base, walk);
    ProducerSm90<Cfg>::load_q(p, w, base, tid);
    const uint8_t* k = reinterpret_cast<const uint8_t*>(p.k) + w.kv_head * p.k_stride_h;
    const uint8_t* v = reinterpret_cast<const uint8_t*>(p.v) + w.kv_head * p.v_stride_h;
    const int64_t row0 = RaggedKvRows{w.kv_row0}.row(0, 0);
    const int n = w.num_tiles;
    // Paged: the owned row's page ids of the next tile to copy (OwnedPageIds, producer.cuh), loaded
    // a tile ahead of their copies.
    OwnedPageIds<Cfg, CPR, ROW_STEP> next(p, w);
    const int row = Cfg::PAGED ? owned_row<Cfg, CPR, ROW_STEP>(tid) : 0;
    // Every row tile of the head reads these K/V rows again: keep them in L2 over Q and outputs.
    const uint64_t keep = ptx::l2_evict_last();
    if constexpr (Cfg::PAGED) next.load(p, w.tile_start + row, w.kv_len, tid);
    // Tile it's raw K and V into buffer it & 1, one cp.async group.
    auto copy = [&](int it) {
      const int n0 = w.tile_start + it * BLOCK_N, b = it & 1;
      if constexpr (Cfg::PAGED) {
        const int t = n0 + row;
        const int64_t k_off = page_offset<uint8_t>(p, next.k, t, w.kv_len, p.k_stride_page, p.k_stride_n);
        const int64_t v_off = page_offset<uint8_t>(p, next.v, t, w.kv_len, p.v_stride_page, p.v_stride_n);
        if (it + 1 < n) next.load(p, t + BLOCK_N, w.kv_len, tid);
        load_tile_paged<Cfg, uint8_t, CPR, ROW_STEP, UNROLL, PAGE_RUN_MAX>(raw<false>(base, b), k, k_off, n0, w.kv_len,
                                                                           NO_PAGE_RUNS, p.k_stride_n, tid, keep);
        load_tile_paged<Cfg, uint8_t, CPR, ROW_STEP, UNROLL, PAGE_RUN_MAX>(raw<true>(base, b), v, v_off, n0, w.kv_len,
                                                                           NO_PAGE_RUNS, p.v_stride_n, tid, keep);
      } else {
        load_tile_rows<Cfg, uint8_t, CPR, ROW_STEP, UNROLL>(raw<false>(base, b), k, p.k_stride_n, row0, n0, w.kv_len,
                                                            tid, keep);
        load_tile_rows<Cfg, uint8_t, CPR, ROW_STEP, UNROLL>(raw<true>(base, b), v, p.v_stride_n, row0, n0, w.kv_len,
                                                            tid, keep);
      }
      ptx::cp_async_commit();
    };
    copy(0);
#pragma unroll 1
    for (int it = 0; it < n; ++it) {
      if (it + 1 < n) {
        copy(it + 1);
        ptx::cp_async_wait<1>();  // this thread's copies of tile it have landed
      } else {
        ptx::cp_async_wait<0>();
      }
      const int s = walk.stage<STAGES>(it), b = it & 1;
      const uint32_t free_parity = walk.phase<STAGES>(it) ^ 1;
      fill_stage<false>(p, raw<false>(base, b), base + Cfg::K_OFFSET + s * Cfg::KV_TILE_BYTES, Cfg::k_empty(base, s),
                        Cfg::k_full(base, s), free_parity, tid);
      fill_stage<true>(p, raw<true>(base, b), base + Cfg::V_OFFSET + s * Cfg::KV_TILE_BYTES, Cfg::v_empty(base, s),
                       Cfg::v_full(base, s), free_parity, tid);
    }
  }
};

}  // namespace pfa
