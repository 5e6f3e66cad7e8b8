// Global -> shared memory for the sm80 prefill: the Q tile gather and the cp.async K/V ring,
// plus the fp8 widening pass (NVFP4's loads and widening: nvfp4_tiles.cuh). Row addresses come
// from the K/V sources (kv_source.cuh); this file owns the shared-memory side (swizzle, ring
// stages) and the cp.async protocol.
//
// KV_STAGES == 1: group 0 = Q + K(0); V(j) streams during Q K(j)^T and K(j+1) during P V(j)
// (FA2's interleave, two barriers a tile). KV_STAGES >= 2: a ring of K/V stages; group j = tile
// j (Q rides with tile 0), issued KV_STAGES - 1 tiles ahead, so a load has whole tiles of math to
// land in and each tile costs one barrier.
#pragma once
#include <stdint.h>

#include "pfa/attention/kv_source.cuh"
#include "pfa/attention/params.h"
#include "pfa/attention/sm80/nvfp4_tiles.cuh"
#include "pfa/attention/work.cuh"
#include "pfa/common/dtypes.cuh"
#include "pfa/ptx/mma_sm80.cuh"

namespace pfa {

// Q tile: each packed row gathers its own (q_idx, head); rows past the request are zero-filled.
// Cfg::ROW_MAP: also record each row's (token, head) for the epilogue (read after the tile
// loop's last barrier).
template <class Cfg>
__device__ __forceinline__ void load_q_tile(const PrefillParams& p, const PrefillWork& w, char* smem, uint32_t sQ_u,
                                            int tid) {
  using T = typename Cfg::Elem;
  const T* q = reinterpret_cast<const T*>(p.q);
  const int chunk = tid % Cfg::CPR;
  constexpr int ROW_STEP = Cfg::THREADS / Cfg::CPR;
  int2* row_map = reinterpret_cast<int2*>(smem + Cfg::ROW_MAP_OFFSET);
#pragma unroll 4
  for (int row = tid / Cfg::CPR; row < Cfg::BLOCK_M; row += ROW_STEP) {
    const int r = w.r0 + row;
    const bool valid = r < w.rows_total;
    const int rr = valid ? r : 0;
    const int qi = rr / w.group, h = w.kv_head * w.group + rr % w.group;
    ptx::cp_async_16(sQ_u + Cfg::swz(row, chunk) * Cfg::CHUNK_BYTES,
                     q + (w.q_row0 + qi) * p.q_stride_n + h * p.q_stride_h + chunk * 8, valid);
    if (Cfg::ROW_MAP && chunk == 0) row_map[row] = make_int2(qi, h);
  }
}

// The K/V ring of one CTA: KV_STAGES (K, V) stages of ring tiles after Q, and (fp8, NVFP4) the
// widened 16-bit tiles every MMA reads.
template <class Cfg>
struct KvRingSm80 {
  using T = typename Cfg::Elem;
  using KV = typename Cfg::KvElem;
  static constexpr int THREADS = Cfg::THREADS, BLOCK_N = Cfg::BLOCK_N, KV_STAGES = Cfg::KV_STAGES;
  static constexpr int KV_CPR = Cfg::KV_CPR, KV_EPC = Cfg::KV_EPC, CHUNK_BYTES = Cfg::CHUNK_BYTES;
  static constexpr int RING_TILE_BYTES = Cfg::RING_TILE_BYTES, TILE_BYTES = Cfg::TILE_BYTES;
  static constexpr int KV_ROW_STEP = THREADS / KV_CPR;  // rows between one thread's chunks

  const PrefillParams& p;
  char* smem;
  uint32_t s_q;     // shared address of smem (the Q tile)
  uint32_t s_ring;  // shared address of ring stage 0's K tile
  uint32_t s_wide;  // fp8, NVFP4: shared address of the widened tile(s)
  int tid;
  int kv_head, kv_len;
  RaggedKvRows ragged;
  PagedKvRows<KV> paged;
  bool page_fast;  // paged: every row lookup of this CTA takes PagedKvRows' fast path
  // Paged caches whose K and V share strides (one 5-D tensor, or twin tensors) and page ids
  // resolve each row's page once for both: the per-row page arithmetic, not the bytes, is what
  // separates paged from ragged speed.
  bool twin;

  // Copy BLOCK_N rows of one K/V head into a ring tile (contiguous KV): this thread's chunk
  // column of rows row0, row0 + ROW_STEP, ... where `src` points at (row0, chunk) and
  // `step_bytes` = ROW_STEP rows; rows at or past valid_rows are zero-filled. A full tile (all
  // but a range's last) is one 64-bit add and one cp.async per row; the shared-memory offsets are
  // one or two registers plus compile-time immediates (the XOR swizzle repeats every 8 rows).
  static __device__ __forceinline__ void load_rows(uint32_t s_tile, const char* src, int64_t step_bytes,
                                                   const KV* safe, int valid_rows, int tid) {
    constexpr int ROW_STEP = THREADS / KV_CPR;
    constexpr int PERIOD = ROW_STEP >= 8 || Cfg::KV_WIDEN ? 1 : 8 / ROW_STEP;  // distinct swizzles
    const int chunk = tid % KV_CPR;
    const int row0 = tid / KV_CPR;
    uint32_t so[PERIOD];
#pragma unroll
    for (int j = 0; j < PERIOD; ++j)
      so[j] = s_tile + Cfg::ring_off(row0 + j * ROW_STEP, chunk) - j * ROW_STEP * KV_CPR * CHUNK_BYTES;
    if (valid_rows >= BLOCK_N) {
#pragma unroll
      for (int i = 0; i < BLOCK_N / ROW_STEP; ++i) {
        ptx::cp_async_16(so[i % PERIOD] + i * ROW_STEP * KV_CPR * CHUNK_BYTES, src, true);
        src += step_bytes;
      }
    } else {
#pragma unroll
      for (int i = 0; i < BLOCK_N / ROW_STEP; ++i) {
        const bool valid = row0 + i * ROW_STEP < valid_rows;
        ptx::cp_async_16(so[i % PERIOD] + i * ROW_STEP * KV_CPR * CHUNK_BYTES,
                         valid ? src : reinterpret_cast<const char*>(safe), valid);
        src += step_bytes;
      }
    }
  }

  // One K or V tile (keys n0 ..) of this head into ring tile s_tile; src = the head's base.
  // Paged KV: a page lookup per row (V: through V's page ids); rows past kv_len are clamped to
  // the last row (a valid address) and zero-filled by cp.async, so no row needs a branch.
  // Contiguous KV: load_rows.
  template <bool V>
  __device__ __forceinline__ void load_tile(const KV* src, int64_t stride_page, int64_t stride_n, int n0,
                                            uint32_t s_tile) const {
    const int chunk = tid % KV_CPR, row0 = tid / KV_CPR;
    const KV* base = src + chunk * KV_EPC;
    if constexpr (Cfg::PAGED) {
      const int ids_off = V ? paged.template v_ids_offset<Cfg::MAX_PAGE_IDS>() : 0;
      auto rows = [&](bool fast) {
#pragma unroll
        for (int i = 0; i < BLOCK_N / KV_ROW_STEP; ++i) {
          const int row = row0 + i * KV_ROW_STEP, t = n0 + row;
          const uint64_t off = paged.template offset<V>(min(t, kv_len - 1), stride_page, stride_n, fast, ids_off);
          ptx::cp_async_16(s_tile + Cfg::ring_off(row, chunk), kv_at(base, off), t < kv_len);
        }
      };
      // The fast/general choice is uniform per CTA: each path compiles to its own straight loop.
      if (page_fast) {
        rows(true);
      } else {
        rows(false);
      }
    } else {
      load_rows(s_tile, reinterpret_cast<const char*>(base + ragged.row(n0, tid / KV_CPR) * stride_n),
                stride_n * (int64_t)(KV_ROW_STEP * sizeof(KV)), src, kv_len - n0, tid);
    }
  }
  __device__ __forceinline__ void load_k(int n0, int stage) const {
    load_tile<false>(reinterpret_cast<const KV*>(p.k) + kv_head * p.k_stride_h, p.k_stride_page, p.k_stride_n, n0,
                     s_ring + 2 * stage * RING_TILE_BYTES);
  }
  __device__ __forceinline__ void load_v(int n0, int stage) const {
    load_tile<true>(reinterpret_cast<const KV*>(p.v) + kv_head * p.v_stride_h, p.v_stride_page, p.v_stride_n, n0,
                    s_ring + (2 * stage + 1) * RING_TILE_BYTES);
  }
  // K and V of one tile.
  __device__ __forceinline__ void load_both(int n0, int stage) const {
    if constexpr (Cfg::KV_NVFP4) {
      const uint32_t sk = s_ring + 2 * stage * RING_TILE_BYTES;
      if (page_fast) {
        load_nvfp4_stage<Cfg>(p, paged, kv_head, kv_len, true, n0, sk, tid);
      } else {
        load_nvfp4_stage<Cfg>(p, paged, kv_head, kv_len, false, n0, sk, tid);
      }
    } else {
      load_both_elements(n0, stage);
    }
  }
  __device__ __forceinline__ void load_both_elements(int n0, int stage) const {
    if constexpr (Cfg::PAGED) {
      if (twin) {
        const int chunk = tid % KV_CPR, row0 = tid / KV_CPR;
        const KV* kb = reinterpret_cast<const KV*>(p.k) + kv_head * p.k_stride_h + chunk * KV_EPC;
        const KV* vb = reinterpret_cast<const KV*>(p.v) + kv_head * p.v_stride_h + chunk * KV_EPC;
        const uint32_t sk = s_ring + 2 * stage * RING_TILE_BYTES, sv = sk + RING_TILE_BYTES;
        auto rows = [&](bool fast) {
#pragma unroll
          for (int i = 0; i < BLOCK_N / KV_ROW_STEP; ++i) {
            const int row = row0 + i * KV_ROW_STEP, t = n0 + row;
            const uint64_t off = paged.offset(min(t, kv_len - 1), p.k_stride_page, p.k_stride_n, fast);
            const uint32_t so = Cfg::ring_off(row, chunk);
            ptx::cp_async_16(sk + so, kv_at(kb, off), t < kv_len);
            ptx::cp_async_16(sv + so, kv_at(vb, off), t < kv_len);
          }
        };
        if (page_fast) {
          rows(true);
        } else {
          rows(false);
        }
        return;
      }
    }
    load_k(n0, stage);
    load_v(n0, stage);
  }

  // Widen TILES ring tiles at `ring` (K then V) into 16-bit swizzled tiles at `wide`.
  template <int TILES>
  __device__ __forceinline__ void widen(const char* ring, char* wide) const {
    if constexpr (Cfg::KV_NVFP4) {
      widen_nvfp4<Cfg, TILES>(ring, wide, tid);
    } else {
      widen_fp8<TILES>(ring, wide);
    }
  }
  // fp8: the ring tiles are one-byte and linear; each raw chunk (16 values) becomes the widened
  // chunks 2c and 2c + 1 of its row. The format (a runtime field) picks one of two loops, each
  // with its conversion's constants in the instructions.
  template <int TILES>
  __device__ __forceinline__ void widen_fp8(const char* ring, char* wide) const {
    if (p.kv_fp8 == kFp8E5M2) {
      widen_fp8_as<TILES, kFp8E5M2>(ring, wide);
    } else {
      widen_fp8_as<TILES, kFp8E4M3>(ring, wide);
    }
  }
  template <int TILES, int FMT>
  __device__ __forceinline__ void widen_fp8_as(const char* ring, char* wide) const {
    constexpr int CHUNKS = BLOCK_N * KV_CPR;  // per tile
#pragma unroll 4
    for (int i = tid; i < TILES * CHUNKS; i += THREADS) {
      const int tile = i / CHUNKS, j = i % CHUNKS;
      const int row = j / KV_CPR, c = j % KV_CPR;
      const uint4 raw = *reinterpret_cast<const uint4*>(ring + tile * RING_TILE_BYTES + j * CHUNK_BYTES);
      const uint2 a = widen_fp8x4<T, FMT>(raw.x), b = widen_fp8x4<T, FMT>(raw.y);
      const uint2 c2 = widen_fp8x4<T, FMT>(raw.z), d = widen_fp8x4<T, FMT>(raw.w);
      char* dst = wide + tile * TILE_BYTES;
      *reinterpret_cast<uint4*>(dst + Cfg::swz(row, 2 * c) * CHUNK_BYTES) = make_uint4(a.x, a.y, b.x, b.y);
      *reinterpret_cast<uint4*>(dst + Cfg::swz(row, 2 * c + 1) * CHUNK_BYTES) = make_uint4(c2.x, c2.y, d.x, d.y);
    }
  }

  // Issue the loads ahead of the tile loop (their cp.async groups: see the top of this file).
  __device__ __forceinline__ void prologue(const PrefillWork& w) const {
    if (w.num_tiles > 0) {
      if constexpr (KV_STAGES > 1) {
        load_both(w.tile_start, 0);
      } else {
        load_k(w.tile_start, 0);
      }
    }
    ptx::cp_async_commit();
#pragma unroll
    for (int st = 1; st < KV_STAGES - 1; ++st) {
      if (st < w.num_tiles) {
        load_both(w.tile_start + st * BLOCK_N, st);
      }
      ptx::cp_async_commit();
    }
  }

  // Start of tile `it` (keys n0 .., ring stage `stage`): wait for its loads, refill the stage
  // the previous tile freed, and (fp8) widen it. Every thread of the CTA calls this.
  __device__ __forceinline__ void begin_tile(const PrefillWork& w, int it, int n0, int stage) const {
    if constexpr (KV_STAGES == 1) {
      ptx::cp_async_wait<0>();
      __syncthreads();  // K(it) landed; every warp is done reading V(it-1)
      load_v(n0, 0);
      ptx::cp_async_commit();
    } else {
      ptx::cp_async_wait<(KV_STAGES > 1 ? KV_STAGES - 2 : 0)>();
      // Tile it landed, and every warp is done with tile it-1, whose stage is refilled now.
      __syncthreads();
      const int ahead = it + KV_STAGES - 1;
      if (ahead < w.num_tiles) {
        load_both(w.tile_start + ahead * BLOCK_N, ahead % KV_STAGES);
      }
      ptx::cp_async_commit();
    }
    if constexpr (Cfg::KV_WIDEN) {
      // The barrier above also retired every read of the widened pair (tile it-1).
      widen<Cfg::SPLIT_WIDEN ? 1 : 2>(smem + (s_ring - s_q) + 2 * stage * RING_TILE_BYTES, smem + (s_wide - s_q));
      __syncthreads();
    }
  }

  // Between S = Q K^T and O += P V of tile `it`: KV_STAGES == 1 fetches the next K into the tile
  // every warp has now finished reading; SPLIT_WIDEN widens V into the tile K occupied.
  __device__ __forceinline__ void mid_tile(const PrefillWork& w, int it, int n0, int stage) const {
    if constexpr (KV_STAGES == 1) {
      ptx::cp_async_wait<0>();
      __syncthreads();  // V(it) landed; every warp is done reading K(it)
      if (it + 1 < w.num_tiles) load_k(n0 + BLOCK_N, 0);
      ptx::cp_async_commit();
    }
    if constexpr (Cfg::SPLIT_WIDEN) {
      __syncthreads();  // every warp is done reading the widened K
      widen<1>(smem + (s_ring - s_q) + (2 * stage + 1) * RING_TILE_BYTES, smem + (s_wide - s_q));
      __syncthreads();
    }
  }
};

// The ring of this CTA, with (paged) its page ids staged. Every thread of the CTA calls this.
template <class Cfg>
__device__ __forceinline__ KvRingSm80<Cfg> make_kv_ring(const PrefillParams& p, const PrefillWork& w, char* smem,
                                                        uint32_t sQ_u, int tid) {
  using KV = typename Cfg::KvElem;
  KvRingSm80<Cfg> ring{p,
                       smem,
                       sQ_u,
                       sQ_u + Cfg::RING_OFFSET,
                       sQ_u + Cfg::WIDE_OFFSET,
                       tid,
                       w.kv_head,
                       w.kv_len,
                       RaggedKvRows{w.kv_row0},
                       PagedKvRows<KV>{p, w.page_base, 0, false, reinterpret_cast<const int32_t*>(smem + Cfg::PAGE_IDS_OFFSET)},
                       false,
                       false};
  if constexpr (Cfg::PAGED) {
    if (w.num_tiles > 0) {
      const int load_end = min(w.kv_len, w.tile_start + w.num_tiles * Cfg::BLOCK_N);  // rows any tile loads
      ring.paged.template stage<Cfg::THREADS, Cfg::MAX_PAGE_IDS>(
          reinterpret_cast<int32_t*>(smem + Cfg::PAGE_IDS_OFFSET), w.tile_start, load_end, tid);
    }
  }
  // PagedKvRows::offset's fast path for every row of this CTA: ids staged, power-of-two pages,
  // 32-bit page offsets. Uniform per CTA, so each path compiles to its own straight-line loop.
  ring.page_fast = Cfg::PAGED && ring.paged.ids_in_smem && p.page_shift >= 0 && PagedKvRows<KV>::page_fits_32bit(p);
  ring.twin = Cfg::PAGED && p.k_stride_page == p.v_stride_page && p.k_stride_n == p.v_stride_n &&
              p.v_page_indices == 0;
  return ring;
}

}  // namespace pfa
