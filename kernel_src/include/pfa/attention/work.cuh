// Work decode: which request, packed-row tile and KV chunk a CTA handles, and the key range it
// visits. Kernel-family neutral: it knows the launch grid, the batch plan's work list, the
// indptrs and the mask rule, never fragment layouts or shared memory, so any prefill kernel with
// (BLOCK_M packed rows) x (BLOCK_N-key tiles) reuses it.
//
// Two launch modes:
//  - single request: grid (kv_head, chunk, row tile), or (row tile, chunk, kv_head) when
//    PrefillParams::rows_fastest is set (see decode_work);
//  - batch plan: grid z indexes the plan's work list (work_request / work_qtile / work_chunk), a
//    (request, row tile, KV chunk) per item; num_chunks, o_indptr and the indptrs locate it.
#pragma once
#include <stdint.h>

#include "pfa/attention/kv_source.cuh"
#include "pfa/attention/mask.cuh"
#include "pfa/attention/params.h"
#include "pfa/common/fastdiv.cuh"

namespace pfa {

// n / group_size for 0 <= n < 2^31 (a packed row's query row), by the host's multiplier.
__device__ __forceinline__ int group_div(const PrefillParams& p, int n) {
  return fast_div(n, p.div_group_mul, p.div_group_shift);
}

// The problem one CTA works on. Packed row r = q_idx * group + head_in_group (GQA packing), so
// a tile's query heads share every K/V tile it loads.
//
// Field order is not cosmetic: the compiler numbers the registers of the values merged after the
// batch-plan branch (chunk, lengths, row bases, custom-mask bits) in this order, and the order
// below reproduces the register allocation of the kernels as they were before this struct existed.
struct PrefillWork {
  MaskRule rule;          // THE mask predicate for this request (custom bits already offset)
  int kv_head;
  int group;              // query heads per kv head
  int chunk;              // this CTA's KV chunk
  int num_chunks;         // the request's KV chunks
  int kv_len;
  int qo_len;
  int64_t kv_row0;        // ragged K/V: first key row of the request (RaggedKvRows)
  int64_t q_row0;         // first query row of the request in q / o
  int page_base;          // paged K/V: the request's first entry in kv_page_indices (PagedKvRows)
  int64_t part_base;      // batch plan, a request of several chunks: its first partial row; -1 = single-request layout
  int rows_total;         // packed rows of the request (qo_len * group)
  int r0;                 // first packed row of this CTA's tile
  int q_lo, q_hi;         // query rows the tile touches (inclusive)
  int kv_lo, kv_hi;       // keys the tile can see: the rows' mask range clipped to the chunk
  int tile_start;         // first key of the first BLOCK_N tile (on the BLOCK_N grid)
  int num_tiles;          // BLOCK_N tiles to visit (0: nothing visible, the CTA writes empty rows)
};

// Packed row r's query row within the request (token) and its query head.
struct PackedRow {
  int token, head;
};
__device__ __forceinline__ PackedRow packed_row(const PrefillParams& p, const PrefillWork& w, int r) {
  const int token = group_div(p, r);
  return {token, w.kv_head * w.group + r - token * w.group};
}

// Batch plan: overwrite the single-request defaults with work item `item`'s request, row tile and
// chunk. False for a padding item (fixed-size CUDA-graph grids pad the list with request -1).
// MASKED: the kernel honours a custom mask (GENERAL, or SPEC: speculative-decoding masks only).
template <bool PAGED, bool MASKED>
__device__ __forceinline__ bool load_plan_item(const PrefillParams& p, int item, int& tile_m, PrefillWork& w) {
  const int b = reinterpret_cast<const int32_t*>(p.work_request)[item];
  if (b < 0) return false;
  tile_m = reinterpret_cast<const int32_t*>(p.work_qtile)[item];
  w.chunk = reinterpret_cast<const int32_t*>(p.work_chunk)[item];
  w.num_chunks = reinterpret_cast<const int32_t*>(p.num_chunks)[b];
  const int32_t* qo_indptr = reinterpret_cast<const int32_t*>(p.qo_indptr);
  const int32_t* kv_indptr = reinterpret_cast<const int32_t*>(p.kv_indptr);
  int q0 = qo_indptr[b], q1 = qo_indptr[b + 1];
  // Paged: every load that needs only b goes out here, before any arithmetic on what they return
  // (a load written after a clamp or a test of another's value waits for it: a further memory
  // latency on each block's way in; o_indptr: the host sets it wherever a request may be split):
  // paged batches +0.3-0.8% (NOTES.md, session 30). The contiguous kernels keep the order below:
  // with the same early loads their TMA rows compiled differently around the plan branch and ran
  // single prefill 0.5% slower, the ragged batches no faster.
  int k0 = 0, k1 = 0, part_base = -1, mask_off = 0;
  uint32_t len_word = 0;
  if constexpr (PAGED) {
    k0 = kv_indptr[b];
    k1 = kv_indptr[b + 1];
    len_word = paged_len_word(p, b);
    if (p.o_indptr != 0) part_base = reinterpret_cast<const int32_t*>(p.o_indptr)[b];
    if (MASKED && w.rule.bits != nullptr) mask_off = reinterpret_cast<const int32_t*>(p.mask_indptr)[b];
  }
  if (p.qo_max_len != 0) clamp_rows(q0, q1, p.q_tokens, p.qo_max_len);  // the caller's device metadata
  w.q_row0 = q0;
  w.qo_len = q1 - q0;
  if constexpr (PAGED) {
    w.page_base = k0;
    w.kv_len = paged_request_len(p, len_word, k0, k1);
  } else {
    k0 = kv_indptr[b];
    k1 = kv_indptr[b + 1];
    if (p.kv_max_len != 0) clamp_rows(k0, k1, p.kv_tokens, p.kv_max_len);
    w.kv_row0 = k0;
    w.kv_len = k1 - k0;
  }
  if constexpr (PAGED) {
    if (w.num_chunks > 1) w.part_base = part_base;
    if (MASKED) w.rule.bits += mask_off;  // (nullptr + 0 where there is no mask)
  } else {
    if (w.num_chunks > 1) w.part_base = reinterpret_cast<const int32_t*>(p.o_indptr)[b];
    if (MASKED && w.rule.bits != nullptr) w.rule.bits += reinterpret_cast<const int32_t*>(p.mask_indptr)[b];
  }
  return true;
}

// Where a CTA's block coordinates come from: its launch's (BlockGrid: blockIdx, gridDim), or block
// `item` of the logical grid PrefillParams::grid_x/y/z that a persistent CTA walks (LogicalGrid).
// The logical grid's order: the z values below grid_section_z in sections of grid_section x values
// (kv heads), each section's blocks x fastest, then y, then z (a batch plan's LPT list, or the row
// tiles heaviest first), before the next section's; then the z values from grid_section_z on (the
// lightest), every x together, in the same x, y, z order: the tail that evens out the CTAs' finish
// times, which the last section's heaviest blocks would otherwise set (routing.section_head_z).
// One section (grid_section = grid_x) is the order a one-CTA-a-block launch hands blocks out in,
// whatever grid_section_z says.
struct BlockGrid {
  __device__ __forceinline__ int x() const { return blockIdx.x; }
  __device__ __forceinline__ int y() const { return blockIdx.y; }
  __device__ __forceinline__ int z() const { return blockIdx.z; }
  __device__ __forceinline__ int dim_z() const { return gridDim.z; }
};
struct LogicalGrid {
  int bx, by, bz, gz;
  static __device__ __forceinline__ LogicalGrid at(const PrefillParams& p, int item) {
    const int zh = p.grid_section_z, per_z = p.grid_x * p.grid_y;
    if (item >= zh * per_z) {  // the tail: every x together
      const int r = item - zh * per_z, z = r / per_z, xy = r - z * per_z, y = xy / p.grid_x;
      return {xy - y * p.grid_x, y, zh + z, p.grid_z};
    }
    // The sectioned part divides by the host's multipliers (fastdiv.cuh): this runs on every
    // role's way into each block; the tail above is the lightest blocks, a few a CTA at most.
    const int per_x = p.grid_y * zh;  // blocks of one x value in the sectioned part
    const int x0 = fast_div(item, p.div_section_mul, p.div_section_shift) * p.grid_section;  // the section's first x
    const bool last = x0 + p.grid_section > p.grid_x;  // the last section, narrower than the rest
    const int xs = last ? p.grid_x - x0 : p.grid_section;  // its x values
    const int within = item - x0 * per_x;
    const int yz = fast_div(within, last ? p.div_last_x_mul : p.div_x_mul, last ? p.div_last_x_shift : p.div_x_shift);
    const int z = fast_div(yz, p.div_y_mul, p.div_y_shift);
    return {x0 + within - yz * xs, yz - z * p.grid_y, z, p.grid_z};
  }
  __device__ __forceinline__ int x() const { return bx; }
  __device__ __forceinline__ int y() const { return by; }
  __device__ __forceinline__ int z() const { return bz; }
  __device__ __forceinline__ int dim_z() const { return gz; }
};

// Decode this CTA's work. False: nothing to do (padding item, or a row tile past the request,
// which a plan never emits). GENERAL: the kernel honours custom masks.
//
// Single request, grid (kv_head, chunk, row tile): the row tile varies slowest, so the block
// scheduler hands out every head's heaviest tiles before any light one (longest-first
// balancing). A single request without causal/window masking (every tile the same cost) may run
// (row tile, chunk, kv_head) instead (PrefillParams::rows_fastest): the CTAs in flight then share
// one or two heads' K/V, which stays in L2, where with heads fastest every head's K/V is live at
// once (far beyond L2 for long hd256 sequences). HONOURS_ROWS_FASTEST compiles the flag in:
// reading it costs the kernel a register for kv_head, which otherwise is re-read from blockIdx,
// and that made hd64 measurably slower; only the kernels with the largest K/V per head (hd256)
// gain enough to pay for it. SPEC: a lean kernel that honours XQA's speculative-decoding mask
// (spec_mask_words > 0), no other custom mask.
template <int BLOCK_M, int BLOCK_N, bool PAGED, bool GENERAL, bool HONOURS_ROWS_FASTEST, bool SPEC = false,
          class Grid = BlockGrid>
__device__ __forceinline__ bool decode_work(const PrefillParams& p, PrefillWork& w, const Grid& g = Grid{}) {
  const bool rows_fastest = HONOURS_ROWS_FASTEST && p.rows_fastest != 0;
  w.kv_head = rows_fastest ? g.z() : g.x();
  w.group = p.group_size;
  w.qo_len = p.qo_len;
  w.kv_len = p.kv_len;
  w.chunk = g.y();
  w.num_chunks = p.num_kv_chunks;
  int tile_m = rows_fastest ? g.x() : g.dim_z() - 1 - g.z();  // heaviest first: causal rows grow down
  w.q_row0 = 0;
  w.kv_row0 = 0;
  w.part_base = -1;
  w.page_base = 0;
  w.rule.bits = GENERAL || (SPEC && p.spec_mask_words > 0) ? reinterpret_cast<const uint8_t*>(p.custom_mask) : nullptr;
  // Batch plans keep the chunk size on the device, so a replayed CUDA graph sees each new plan's.
  // Paged: loaded here, beside the work list's first load (where it is used, it waits for the plan
  // item's loads and the row-tile test); the contiguous kernels load it there (load_plan_item says
  // why).
  int chunk_early = 0;
  if constexpr (PAGED)
    chunk_early =
        p.kv_chunk_size_dev != 0 ? *reinterpret_cast<const int32_t*>(p.kv_chunk_size_dev) : p.kv_chunk_size;
  // Batch plan: grid z indexes the work list, which the plan already ordered longest first.
  if (p.work_request != 0 && !load_plan_item<PAGED, GENERAL || SPEC>(p, g.z(), tile_m, w)) return false;
  w.rows_total = w.qo_len * w.group;
  w.r0 = tile_m * BLOCK_M;
  if (w.r0 >= w.rows_total) return false;
  w.q_lo = group_div(p, w.r0);
  w.q_hi = group_div(p, min(w.r0 + BLOCK_M, w.rows_total) - 1);

  const MaskRule rule{w.qo_len, w.kv_len, p.causal != 0, p.window_left, w.rule.bits,
                      GENERAL || SPEC ? p.spec_mask_words : 0, p.chunk_shift};
  w.rule = rule;
  const int chunk_size =
      PAGED ? chunk_early
            : (p.kv_chunk_size_dev != 0 ? *reinterpret_cast<const int32_t*>(p.kv_chunk_size_dev) : p.kv_chunk_size);
  const int chunk_lo = w.chunk * chunk_size;
  const int chunk_hi = min(chunk_lo + chunk_size, w.kv_len);
  w.kv_lo = max(rule.kv_begin(w.q_lo), chunk_lo);
  w.kv_hi = min(rule.kv_end(w.q_hi), chunk_hi);
  // Tiles start on the BLOCK_N grid (chunk boundaries are on it too), so a tile never straddles
  // two splits; keys before kv_lo lie outside every row's window, so the mask predicate removes
  // them.
  w.tile_start = w.kv_lo / BLOCK_N * BLOCK_N;
  w.num_tiles = w.kv_hi > w.kv_lo ? (w.kv_hi - w.tile_start + BLOCK_N - 1) / BLOCK_N : 0;
  return true;
}

}  // namespace pfa
