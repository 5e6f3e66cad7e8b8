// The paged KV cache helpers of flashinfer.page, one kernel with PageParams.mode:
//   APPEND           token t's K and V rows go to request b = batch_indices[t] at position
//                    p = positions[t]: page kv_indices[kv_indptr[b] + p / page_size], slot
//                    p % page_size. A CTA resolves its tokens' (page, slot) once into shared
//                    memory, then its threads copy the rows vec_bytes at a time (any dtype).
//   BATCH_POSITIONS  token i of request b (append_indptr[b] <= i < append_indptr[b+1]) gets
//                    batch index b and the right-aligned position
//                    seq_lens[b] - (append_indptr[b+1] - append_indptr[b]) + (i - append_indptr[b]).
//   SEQ_LENS         seq_lens[b] = (pages - 1) * page_size + last_page_len, 0 without pages.
//
// NOTE: the metadata lives on the device and is not checked by the host (that would need a sync),
// so the append never writes outside the cache: a token whose batch index is outside
// [0, batch_size), whose position is negative or beyond the pages its request owns, whose
// kv_indices entry is outside [0, num_indices) or whose page id is outside [0, num_pages) is
// skipped. kv_last_page_len is not read by the append (positions say where each token goes).
#pragma once
#include <stdint.h>

#include "pfa/attention/params.h"

namespace pfa {

template <int BYTES> struct PageChunk;
template <> struct PageChunk<16> { using type = uint4; };
template <> struct PageChunk<8> { using type = uint2; };
template <> struct PageChunk<4> { using type = uint32_t; };
template <> struct PageChunk<2> { using type = uint16_t; };
template <> struct PageChunk<1> { using type = uint8_t; };

struct PageKernel {
  static constexpr int THREADS = 256;
  static constexpr int MAX_TOKENS = 64;  // PageParams.tokens_per_block <= MAX_TOKENS
  enum Mode : int32_t { APPEND = 0, BATCH_POSITIONS = 1, SEQ_LENS = 2 };

  static __device__ __forceinline__ void run(const PageParams& p) {
    if (p.mode == APPEND) {
      append(p);
    } else if (p.mode == BATCH_POSITIONS) {
      batch_positions(p);
    } else if (p.mode == SEQ_LENS) {
      seq_lens(p);
    }
  }

  // (page, slot) of token t, or page -1 when the token is skipped (see the NOTE above).
  static __device__ __forceinline__ int2 locate(const PageParams& p, int64_t t) {
    const int32_t b = reinterpret_cast<const int32_t*>(p.batch_indices)[t];
    const int32_t pos = reinterpret_cast<const int32_t*>(p.positions)[t];
    if (b < 0 || b >= p.batch_size || pos < 0) return make_int2(-1, 0);
    const int32_t* indptr = reinterpret_cast<const int32_t*>(p.kv_indptr);
    const int64_t first = indptr[b], owned = (int64_t)indptr[b + 1] - first;
    const int32_t pidx = pos / p.page_size;
    const int64_t idx = first + pidx;
    if (pidx >= owned || idx < 0 || idx >= p.num_indices) return make_int2(-1, 0);
    const int32_t page = reinterpret_cast<const int32_t*>(p.kv_indices)[idx];
    if (page < 0 || page >= p.num_pages) return make_int2(-1, 0);
    return make_int2(page, pos - pidx * p.page_size);
  }

  // Grid (ceil(nnz / tokens_per_block)): CTA x appends tokens [x * tpb, x * tpb + tpb).
  static __device__ __forceinline__ void append(const PageParams& p) {
    __shared__ int2 loc[MAX_TOKENS];
    const int64_t t0 = (int64_t)blockIdx.x * p.tokens_per_block;
    const int ntok = (int)min((int64_t)p.tokens_per_block, (int64_t)p.nnz - t0);
    for (int i = threadIdx.x; i < ntok; i += THREADS) loc[i] = locate(p, t0 + i);
    __syncthreads();
    switch (p.vec_bytes) {
      case 16: copy_rows<16>(p, loc, t0, ntok); break;
      case 8: copy_rows<8>(p, loc, t0, ntok); break;
      case 4: copy_rows<4>(p, loc, t0, ntok); break;
      case 2: copy_rows<2>(p, loc, t0, ntok); break;
      default: copy_rows<1>(p, loc, t0, ntok); break;
    }
  }

  // The CTA's K then V rows, token by token: consecutive threads take consecutive chunks of a
  // row, then the next head, so both sides of the copy are read and written in runs.
  template <int VEC>
  static __device__ __forceinline__ void copy_rows(const PageParams& p, const int2* loc, int64_t t0, int ntok) {
    using Chunk = typename PageChunk<VEC>::type;
    const int row_chunks = p.head_dim * p.elem_bytes / VEC;
    const int side = p.num_heads * row_chunks;  // chunks of one token's K (or V)
    const int total = ntok * 2 * side;          // the host keeps it within int32
    const int64_t eb = p.elem_bytes;
    for (int w = threadIdx.x; w < total; w += THREADS) {
      const int ti = w / (2 * side);
      int r = w - ti * 2 * side;
      const int2 at = loc[ti];
      if (at.x < 0) continue;
      const bool is_v = r >= side;
      if (is_v) r -= side;
      const int h = r / row_chunks;
      const int c = r - h * row_chunks;
      const int64_t t = t0 + ti;
      const int64_t src_el = is_v ? t * p.append_v_stride_n + h * p.append_v_stride_h
                                  : t * p.append_k_stride_n + h * p.append_k_stride_h;
      const int64_t dst_el = is_v ? at.x * p.v_stride_page + at.y * p.v_stride_n + h * p.v_stride_h
                                  : at.x * p.k_stride_page + at.y * p.k_stride_n + h * p.k_stride_h;
      const char* src = reinterpret_cast<const char*>(is_v ? p.append_v : p.append_k) + src_el * eb + c * VEC;
      char* dst = reinterpret_cast<char*>(is_v ? p.v_cache : p.k_cache) + dst_el * eb + c * VEC;
      *reinterpret_cast<Chunk*>(dst) = *reinterpret_cast<const Chunk*>(src);
    }
  }

  // Grid (ceil(nnz / THREADS)): one thread per token. The request is found by binary search
  // (the first j with append_indptr[j] > i, minus one): graph-safe, no host sync for nnz.
  // Tokens of no request (i < append_indptr[0] or i >= append_indptr[batch_size]) get -1, -1,
  // which the append skips.
  static __device__ __forceinline__ void batch_positions(const PageParams& p) {
    const int64_t i = (int64_t)blockIdx.x * THREADS + threadIdx.x;
    if (i >= p.nnz) return;
    const int32_t* ip = reinterpret_cast<const int32_t*>(p.append_indptr);
    int lo = 0, hi = p.batch_size + 1;
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if (ip[mid] <= i) lo = mid + 1;
      else hi = mid;
    }
    const int b = lo - 1;
    int32_t bi = -1, pos = -1;
    if (b >= 0 && b < p.batch_size) {
      const int32_t begin = ip[b], end = ip[b + 1];
      if (i >= begin && i < end) {
        bi = b;
        pos = reinterpret_cast<const int32_t*>(p.seq_lens)[b] - (end - begin) + (int32_t)(i - begin);
      }
    }
    reinterpret_cast<int32_t*>(p.batch_indices)[i] = bi;
    reinterpret_cast<int32_t*>(p.positions)[i] = pos;
  }

  // Grid (ceil(batch_size / THREADS)): one thread per request.
  static __device__ __forceinline__ void seq_lens(const PageParams& p) {
    const int b = blockIdx.x * THREADS + threadIdx.x;
    if (b >= p.batch_size) return;
    const int32_t* indptr = reinterpret_cast<const int32_t*>(p.kv_indptr);
    const int32_t pages = indptr[b + 1] - indptr[b];
    const int32_t last = reinterpret_cast<const int32_t*>(p.kv_last_page_len)[b];
    reinterpret_cast<int32_t*>(p.seq_lens)[b] = pages > 0 ? (pages - 1) * p.page_size + last : 0;
  }
};

}  // namespace pfa

#define PFA_DEFINE_PAGE(NAME)                                                        \
  extern "C" __global__ void __launch_bounds__(pfa::PageKernel::THREADS)             \
      NAME(const __grid_constant__ pfa::PageParams p) {                              \
    pfa::PageKernel::run(p);                                                         \
  }
