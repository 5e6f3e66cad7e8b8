// NVFP4 K/V in the sm80 family (the paged decode tiles): the ring loads of a tile's e2m1 codes
// and e4m3 block scales, and the widening pass that turns a landed ring tile into the 16-bit
// swizzled tile every MMA reads (the fp8 path's design, config.cuh).
//
// A ring tile (config.cuh): BLOCK_N rows of HEAD_DIM / 2 code bytes, then BLOCK_N rows of
// HEAD_DIM / 16 scale bytes, both linear. Global memory: the codes of K / V at PrefillParams::k
// / v (strides in bytes, their elements), the scales at k_sf / v_sf (own strides, in bytes),
// both addressed through the same page table.
#pragma once
#include <stdint.h>

#include "pfa/attention/kv_source.cuh"
#include "pfa/attention/params.h"
#include "pfa/common/dtypes.cuh"
#include "pfa/ptx/mma_sm80.cuh"

namespace pfa {

// Byte offset of (page id, slot) in a tensor with these page / row strides (bytes). fast: the
// page's rows lie within 32-bit offsets (PagedKvRows::page_fits_32bit).
__device__ __forceinline__ uint64_t nvfp4_page_offset(uint32_t id, uint32_t slot, int64_t stride_page,
                                                      int64_t stride_n, bool fast) {
  return fast ? (uint64_t)id * (uint64_t)stride_page + slot * (uint32_t)stride_n
              : (uint64_t)((int64_t)id * stride_page + (int64_t)slot * stride_n);
}

// Copy K's and V's codes and block scales of keys n0 .. n0 + BLOCK_N - 1 (one kv head) into the
// ring stage whose K tile is at shared address s_k (V's tile follows it). Work items: the tile's
// 16-byte code chunks, then one scale row per key (4, 8 or 16 bytes), each copied for K and V;
// a row's page is looked up once for its four copies. Rows past kv_len are clamped to the last
// row (a valid address) and zero-filled. Every thread of the CTA calls this.
template <class Cfg, class Rows>
__device__ __forceinline__ void load_nvfp4_stage(const PrefillParams& p, const Rows& paged, int kv_head, int kv_len,
                                                 bool fast, int n0, uint32_t s_k, int tid) {
  constexpr int KV_CPR = Cfg::KV_CPR, CHUNK = Cfg::CHUNK_BYTES, SF = Cfg::SF_ROW_BYTES, THREADS = Cfg::THREADS;
  constexpr int CODE_ITEMS = Cfg::BLOCK_N * KV_CPR, ITEMS = CODE_ITEMS + Cfg::BLOCK_N;
  const char* k_codes = reinterpret_cast<const char*>(p.k) + kv_head * p.k_stride_h;
  const char* v_codes = reinterpret_cast<const char*>(p.v) + kv_head * p.v_stride_h;
  const char* k_scales = reinterpret_cast<const char*>(p.k_sf) + kv_head * p.k_sf_stride_h;
  const char* v_scales = reinterpret_cast<const char*>(p.v_sf) + kv_head * p.v_sf_stride_h;
  const uint32_t s_v = s_k + Cfg::RING_TILE_BYTES;
#pragma unroll
  for (int j = 0; j < (ITEMS + THREADS - 1) / THREADS; ++j) {
    const int i = tid + j * THREADS;
    if (ITEMS % THREADS == 0 || i < ITEMS) {
      // Warp-uniform wherever CODE_ITEMS is a multiple of 32 (every built shape).
      const bool code = i < CODE_ITEMS;
      const int row = code ? i / KV_CPR : i - CODE_ITEMS, t = n0 + row;
      uint32_t id, slot;
      paged.locate(min(t, kv_len - 1), fast, id, slot);
      if (code) {
        const int c = i % KV_CPR;
        // linear, or (KV_REG_WIDEN) swizzled for the fragment reads
        const uint32_t so = Cfg::KV_REG_WIDEN ? Cfg::ring_off(row, c) : row * Cfg::KV_ROW_BYTES + c * CHUNK;
        const uint64_t k_off = nvfp4_page_offset(id, slot, p.k_stride_page, p.k_stride_n, fast) + c * CHUNK;
        const uint64_t v_off = nvfp4_page_offset(id, slot, p.v_stride_page, p.v_stride_n, fast) + c * CHUNK;
        ptx::cp_async_16(s_k + so, k_codes + k_off, t < kv_len);
        ptx::cp_async_16(s_v + so, v_codes + v_off, t < kv_len);
      } else {
        const uint32_t so = Cfg::SF_OFFSET + row * SF;
        const uint64_t k_off = nvfp4_page_offset(id, slot, p.k_sf_stride_page, p.k_sf_stride_n, fast);
        const uint64_t v_off = nvfp4_page_offset(id, slot, p.v_sf_stride_page, p.v_sf_stride_n, fast);
        ptx::cp_async<SF>(s_k + so, k_scales + k_off, t < kv_len);
        ptx::cp_async<SF>(s_v + so, v_scales + v_off, t < kv_len);
      }
    }
  }
}

// Widen TILES landed ring tiles at `ring` into 16-bit swizzled tiles at `wide`: code chunk c of a
// row (32 elements, two scale blocks) becomes the widened chunks 4c .. 4c + 3, each code times
// its block's scale (widen_fp4x8: exact). Zero-filled rows (past kv_len) widen to zeros.
template <class Cfg, int TILES>
__device__ __forceinline__ void widen_nvfp4(const char* ring, char* wide, int tid) {
  using T = typename Cfg::Elem;
  constexpr int KV_CPR = Cfg::KV_CPR, CHUNK = Cfg::CHUNK_BYTES, THREADS = Cfg::THREADS;
  constexpr int CHUNKS = Cfg::BLOCK_N * KV_CPR;  // code chunks per tile
  constexpr int ITEMS = TILES * CHUNKS;
#pragma unroll
  for (int j = 0; j < (ITEMS + THREADS - 1) / THREADS; ++j) {
    const int i = tid + j * THREADS;
    if (ITEMS % THREADS == 0 || i < ITEMS) {
      const int tile = i / CHUNKS, k = i % CHUNKS;
      const int row = k / KV_CPR, c = k % KV_CPR;
      const char* src = ring + tile * Cfg::RING_TILE_BYTES;
      const uint4 codes = *reinterpret_cast<const uint4*>(src + k * CHUNK);
      const uint32_t sf = *reinterpret_cast<const uint16_t*>(src + Cfg::SF_OFFSET + row * Cfg::SF_ROW_BYTES + 2 * c);
      const uint2 s = nvfp4_scale_pairs<T>(sf);
      char* dst = wide + tile * Cfg::TILE_BYTES;
      *reinterpret_cast<uint4*>(dst + Cfg::swz(row, 4 * c) * CHUNK) = widen_fp4x8<T>(codes.x, s.x);
      *reinterpret_cast<uint4*>(dst + Cfg::swz(row, 4 * c + 1) * CHUNK) = widen_fp4x8<T>(codes.y, s.x);
      *reinterpret_cast<uint4*>(dst + Cfg::swz(row, 4 * c + 2) * CHUNK) = widen_fp4x8<T>(codes.z, s.y);
      *reinterpret_cast<uint4*>(dst + Cfg::swz(row, 4 * c + 3) * CHUNK) = widen_fp4x8<T>(codes.w, s.y);
    }
  }
}

}  // namespace pfa
