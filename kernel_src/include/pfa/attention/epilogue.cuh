// Where a finished query row goes: the output row, its LSE, or (split KV) its fp32 partial row
// and partial LSE. Family-neutral: a kernel's epilogue decides which (token, q head, columns) a
// thread holds and how it converts and moves them (sm80: sm80/epilogue.cuh); the layouts here
// are the contract with the host and the merge kernel (merge.cuh).
//
//   o:           [token][q head][dim] at o_stride_n / o_stride_h (elements), in the format
//                o_format names (OutFormat: the query dtype, the other 16-bit type, e4m3)
//   lse:         float [token][q head], natural or base 2 (lse_scale)
//   o_partial:   float [partial row][q head][dim], normalised per chunk
//   lse_partial: float [partial row][q head], base 2
// Partial rows: single request [chunk][qo_len]; batch plan token-major with the chunk fastest,
// from the request's o_indptr base (PrefillWork::part_base).
#pragma once
#include <stdint.h>

#include "pfa/attention/params.h"
#include "pfa/attention/work.cuh"

namespace pfa {

// Offset (elements) of output row (token, head) from p.o; token counts from the request's first
// query row.
__device__ __forceinline__ int64_t output_offset(const PrefillParams& p, const PrefillWork& w, int token, int head) {
  return (w.q_row0 + token) * p.o_stride_n + head * p.o_stride_h;
}

// Index of (token, head) in the lse output (num_heads: query heads).
__device__ __forceinline__ int64_t lse_index(const PrefillWork& w, int num_heads, int token, int head) {
  return (w.q_row0 + token) * num_heads + head;
}

// Index of (token, head) of this CTA's chunk in lse_partial (times HEAD_DIM: in o_partial).
__device__ __forceinline__ int64_t partial_index(const PrefillWork& w, int num_heads, int token, int head) {
  const int64_t prow = w.part_base >= 0 ? w.part_base + (int64_t)token * w.num_chunks + w.chunk
                                        : (int64_t)w.chunk * w.qo_len + token;
  return prow * num_heads + head;
}

}  // namespace pfa
