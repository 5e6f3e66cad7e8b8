// K/V sources: where key/value row t (0-based within a request, one kv head) lives in global
// memory. Kernel-family neutral (no shared-memory tile layout, no copy instruction): a kernel's
// loader asks a source for row addresses and moves the bytes its own way (cp.async, TMA...).
//
//  - RaggedKvRows: contiguous rows; a request's keys are rows [kv_indptr[b], kv_indptr[b+1]).
//  - PagedKvRows:  FlashInfer's paged cache; request b owns page slots kv_indptr[b] ..
//                  kv_indptr[b+1] - 1 of kv_page_indices, its last page holding
//                  kv_last_page_len[b] rows. Row t is slot t % page_size of page t / page_size.
//
// Each source has two parts: the request's extent (read by the work decode, work.cuh) and the
// row -> address map (read by the loader for every tile row).
//
//  - block table + seq_lens (XQA, TRT-LLM): the paged rows above with kv_indptr[b] = b * the
//    table's row stride and the extent from PrefillParams::kv_seq_lens (paged_request_len).
//  - separate V page ids (TRT-LLM's [B, 2, M] tables, PrefillParams::v_page_indices): V's page of
//    row t is read from v_page_indices where K's is read from kv_page_indices (same index).
//
// Page ids from the caller's device memory are not checked on the host without a sync, so
// every id read here is clamped into the cache (PrefillParams::num_pages): bad metadata gives
// a wrong answer, never a read outside the cache.
#pragma once
#include <stdint.h>

#include "pfa/attention/params.h"
#include "pfa/common/dtypes.cuh"

namespace pfa {

// Pointer `byte_off` bytes past `base`: sources speak in byte offsets, so one offset serves K and
// V of different element types or strides in bytes.
template <typename KV>
__device__ __forceinline__ const KV* kv_at(const KV* base, uint64_t byte_off) {
  return reinterpret_cast<const KV*>(reinterpret_cast<const char*>(base) + byte_off);
}

struct RaggedKvRows {
  int64_t row0;  // the request's first row in K / V

  // Index in K / V (rows of stride_n elements) of the request's row n0 + r. Tile start and row
  // within the tile stay separate terms so the sum is formed in 64 bits.
  __device__ __forceinline__ int64_t row(int n0, int r) const { return row0 + n0 + r; }
};

// Paged K/V, extent: request b's rows (its page slots [k0, k1) of kv_page_indices), every page
// full but the last, which holds kv_last_page_len[b].
// By block table (kv_seq_lens set): seq_lens[b], clamped to kv_max_len (at most the keys of the
// pages its table row holds: the host sets it so).
// Two steps, so the word's load goes out with the request's other loads (work.cuh load_plan_item):
// paged_len_word loads it, paged_request_len makes the length of it.
__device__ __forceinline__ uint32_t paged_len_word(const PrefillParams& p, int b) {
  // kv_seq_lens: int32 or uint32, the same bits
  return p.kv_seq_lens != 0 ? reinterpret_cast<const uint32_t*>(p.kv_seq_lens)[b]
                            : (uint32_t)reinterpret_cast<const int32_t*>(p.kv_last_page_len)[b];
}
__device__ __forceinline__ int paged_request_len(const PrefillParams& p, uint32_t word, int k0, int k1) {
  if (p.kv_seq_lens != 0) return (int)min(word, (uint32_t)p.kv_max_len);
  return k1 > k0 ? (k1 - k0 - 1) * p.page_size + (int)word : 0;
}

// A page id from the table, clamped into the cache when the host could not check it (num_pages
// set): a negative id becomes huge as unsigned and lands on the last page.
__device__ __forceinline__ int32_t checked_page_id(const PrefillParams& p, int32_t id) {
  return p.num_pages > 0 ? (int32_t)min((uint32_t)id, (uint32_t)(p.num_pages - 1)) : id;
}

// The page-id table of K (V = false), or of V (V = true): V's own ids when the call has separate
// ones, else K's. Read from the params at each use (no register held across a tile loop).
template <bool V>
__device__ __forceinline__ const int32_t* page_table(const PrefillParams& p) {
  return reinterpret_cast<const int32_t*>(V && p.v_page_indices != 0 ? p.v_page_indices : p.kv_page_indices);
}

// Batch plan over the caller's device metadata (TRT-LLM): a request's rows [lo, hi) from its
// indptr, clamped into the tensor's `total` rows and to `max_len`, so bad metadata never reads
// outside the tensor (an empty or reversed range becomes length 0).
__device__ __forceinline__ void clamp_rows(int& lo, int& hi, int total, int max_len) {
  lo = (int)min((uint32_t)lo, (uint32_t)total);  // a negative start lands on `total` (length 0)
  hi = lo + (hi > lo ? min(hi - lo, min(max_len, total - lo)) : 0);
}

// Paged K/V, row addresses. They are recomputed from the (constant-bank) params at each load
// rather than kept live across a tile loop: registers are the scarce resource in the kernels.
template <typename KV>
struct PagedKvRows {
  // Byte offsets of a page's rows fit 32 bits below this: the fast path multiplies in 32 bits.
  static constexpr uint64_t FAST_PAGE_SPAN_LIMIT = 1ull << 32;

  const PrefillParams& p;
  int page_base;           // the request's first entry in kv_page_indices
  int first_page = 0;      // request page of the first staged id
  bool ids_in_smem = false;
  const int32_t* s_pages;  // staged page ids (shared memory)

  // Stage the page ids of rows [tile_start, load_end) in shared memory (at most MAX_IDS), so no
  // tile load waits on a dependent global read of the page table; beyond MAX_IDS the lookups read
  // the table itself. Separate V ids (v_page_indices) share the space: K's in the first half, V's
  // at v_ids_offset. Every thread of the CTA calls this (THREADS of them): it ends in a barrier
  // when it stages.
  template <int THREADS, int MAX_IDS>
  __device__ __forceinline__ void stage(int32_t* s_ids, int tile_start, int load_end, int tid) {
    first_page = tile_start / p.page_size;
    const int n_ids = (load_end - 1) / p.page_size - first_page + 1;
    const bool separate = p.v_page_indices != 0;
    ids_in_smem = n_ids <= (separate ? MAX_IDS / 2 : MAX_IDS);
    if (ids_in_smem) {
      const int32_t* pages = page_table<false>(p) + page_base + first_page;
      for (int i = tid; i < n_ids; i += THREADS) s_ids[i] = checked_page_id(p, pages[i]);
      if (separate) {
        const int32_t* v_pages = page_table<true>(p) + page_base + first_page;
        for (int i = tid; i < n_ids; i += THREADS) s_ids[MAX_IDS / 2 + i] = checked_page_id(p, v_pages[i]);
      }
      __syncthreads();
    }
  }
  // Where V's staged ids start in the staged list (stage's MAX_IDS): 0 when V shares K's.
  template <int MAX_IDS>
  __device__ __forceinline__ int v_ids_offset() const { return p.v_page_indices != 0 ? MAX_IDS / 2 : 0; }

  // Whether every page's rows lie within 32-bit byte offsets of the page (K and V), as
  // offset(..., fast = true) requires, besides staged ids and a power-of-two page size.
  // NVFP4: the block-scale tensors' rows too (their strides are in bytes).
  static __device__ __forceinline__ bool page_fits_32bit(const PrefillParams& p) {
    if constexpr (KvStorage<KV>::NVFP4) {
      const int64_t stride = max(max(p.k_stride_n, p.v_stride_n), max(p.k_sf_stride_n, p.v_sf_stride_n));
      return (uint64_t)p.page_size * (uint64_t)stride < FAST_PAGE_SPAN_LIMIT;
    }
    return (uint64_t)p.page_size * (uint64_t)max(p.k_stride_n, p.v_stride_n) * sizeof(KV) < FAST_PAGE_SPAN_LIMIT;
  }

  // Page id and slot of row t, for a loader that addresses several tensors with one lookup
  // (NVFP4: codes and block scales of K and V, which never have separate V ids: the host
  // refuses an NVFP4 cache with them). fast: as offset()'s.
  __device__ __forceinline__ void locate(int t, bool fast, uint32_t& id, uint32_t& slot) const {
    if (fast) {
      id = s_pages[(t >> p.page_shift) - first_page];
      slot = t & (p.page_size - 1);
      return;
    }
    const int pg = t / p.page_size;
    slot = t - pg * p.page_size;
    id = ids_in_smem ? s_pages[pg - first_page] : checked_page_id(p, page_table<false>(p)[page_base + pg]);
  }

  // Byte offset of row t from the head's base. fast: a shift, a mask, one shared-memory load and
  // unsigned 32x64 / 32x32 multiplies; otherwise a division and possibly a global page-table read.
  // V: V's page ids (ids_off = where they are staged, v_ids_offset; K: 0).
  template <bool V = false>
  __device__ __forceinline__ uint64_t offset(int t, int64_t stride_page, int64_t stride_n, bool fast,
                                             int ids_off = 0) const {
    if (fast) {
      const uint32_t id = s_pages[(t >> p.page_shift) - first_page + ids_off];
      const uint32_t slot = t & (p.page_size - 1);
      return (uint64_t)id * (uint64_t)(stride_page * (int64_t)sizeof(KV)) +
             slot * (uint32_t)(stride_n * (int64_t)sizeof(KV));
    }
    const int pg = t / p.page_size, slot = t - pg * p.page_size;
    const int id = ids_in_smem ? s_pages[pg - first_page + ids_off] : checked_page_id(p, page_table<V>(p)[page_base + pg]);
    return ((int64_t)id * stride_page + (int64_t)slot * stride_n) * (int64_t)sizeof(KV);
  }
};

}  // namespace pfa
