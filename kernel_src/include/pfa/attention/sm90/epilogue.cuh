// Epilogue of a consumer warpgroup of the sm_90a prefill: finish the online softmax of its rows,
// then write them (epilogue.cuh's layouts): O in the output format (NVFP4: store_nvfp4) and the LSE, attention
// sinks on an unsplit row, or (split KV) normalised fp32 partials and their base-2 LSE for the merge kernel.
#pragma once
#include <math.h>
#include <stdint.h>

#include "pfa/attention/epilogue.cuh"
#include "pfa/attention/nvfp4_out.cuh"
#include "pfa/attention/params.h"
#include "pfa/attention/softmax_state.cuh"
#include "pfa/attention/variant.cuh"
#include "pfa/attention/work.cuh"
#include "pfa/common/dtypes.cuh"

namespace pfa {

// FOLD: a 16-bit output's rows are normalised in the packs' multiplier (store_16bit: 1 / sum times
// the sink factor, one multiply a value instead of two). The 16-bit family's rows gained 0.6-0.9%;
// the e4m3 hd128 rows, whose tile loop ptxas then scheduled differently, lost 0.5-2.5% and keep
// the normalisation first (NOTES.md, session 43).
// PERMUTED: the accumulator's columns are head dims in the order fp8_producer.cuh's permuted Vt
// gives them (tile_offset): a lane's columns of four column tiles 4 m .. 4 m + 3 are 8 consecutive
// dims, so its 16-bit stores need no quad transposes.
template <class Cfg, int O_ACC, bool FOLD = true, bool PERMUTED = false>
struct EpilogueSm90 {
  using T = typename Cfg::Elem;
  static constexpr int HEAD_DIM = Cfg::HEAD_DIM, O_COLS = HEAD_DIM / 8;
  static constexpr unsigned FULL = 0xffffffffu;
  static_assert(!PERMUTED || HEAD_DIM % 32 == 0, "the permutation works on 32-dim blocks");

  // PERMUTED: accumulator column 8 j + 2 t (and + 1 after it), t = lane % 4, is head dim
  // tile_offset(j) + 8 t, column tile j = 4 m + jj's pair at dims 32 m + 8 t + 2 jj.
  static __device__ __forceinline__ int tile_offset(int j) { return 32 * (j >> 2) + 2 * (j & 3); }

  static __device__ __forceinline__ void run(const PrefillParams& p, const PrefillWork& w, const int (&tile_row)[2],
                                             int lane, float (&o)[O_ACC], const float (&m)[2], const float (&l)[2]) {
    float lse[2], inv[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float sum = l[i];
      sum += __shfl_xor_sync(FULL, sum, 1);
      sum += __shfl_xor_sync(FULL, sum, 2);
      inv[i] = OnlineSoftmax<false>::finish(sum, m[i], output_scale(p), lse[i]);
      if constexpr (!FOLD) normalize(o, i, inv[i]);
    }
    // one branch, then the format's packs alone (pack_out2's run-time format packed every pair
    // both ways, the unused one predicated off but issued all the same)
    if constexpr (FOLD) {
      if (w.num_chunks == 1 && p.o_format != kOutE4M3 && (!Cfg::NVFP4_OUT || p.o_format != kOutNvfp4)) {
        store_16bit_as(p, w, tile_row, lane, o, lse, inv);
        return;
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) normalize(o, i, inv[i]);
    }
    if constexpr (Cfg::NVFP4_OUT) {
      if (w.num_chunks == 1 && p.o_format == kOutNvfp4) {
        if constexpr (PERMUTED) natural_columns(o, lane);  // (NVFP4 blocks read natural column tiles)
        store_nvfp4(p, w, tile_row, lane, o, lse);
        return;
      }
    }
    if (!FOLD && w.num_chunks == 1 && p.o_format != kOutE4M3) {
      store_16bit_as(p, w, tile_row, lane, o, lse, {1.f, 1.f});
      return;
    }
    if constexpr (PERMUTED) natural_columns(o, lane);  // (the e4m3 output and split partials below)
    const int col = 2 * (lane % 4);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = w.r0 + tile_row[i];
      if (r >= w.rows_total) continue;
      const auto [token, head] = packed_row(p, w, r);
      if (w.num_chunks == 1) {  // e4m3 (16-bit formats: store_16bit)
        float f = 1.f;
        if (p.sinks != 0) f = sink_factor(reinterpret_cast<const float*>(p.sinks)[head], lse[i]);
        // two bytes from the low half of pack_out2's word; offsets count one-byte elements
        const int64_t elem = output_offset(p, w, token, head) + col;
        char* out = reinterpret_cast<char*>(p.o);
#pragma unroll
        for (int j = 0; j < O_COLS; ++j)
          *reinterpret_cast<uint16_t*>(out + elem + 8 * j) =
              (uint16_t)pack_out2<T>(o[4 * j + 2 * i] * f, o[4 * j + 2 * i + 1] * f, kOutE4M3);
        if (p.lse != 0 && lane % 4 == 0)
          store_lse(p, w, token, head, lse[i]);
      } else {
        const int64_t idx = partial_index(w, p.num_qo_heads, token, head);
        float* op = reinterpret_cast<float*>(p.o_partial) + idx * HEAD_DIM + col;
#pragma unroll
        for (int j = 0; j < O_COLS; ++j)
          *reinterpret_cast<float2*>(op + 8 * j) = make_float2(o[4 * j + 2 * i], o[4 * j + 2 * i + 1]);
        if (lane % 4 == 0) reinterpret_cast<float*>(p.lse_partial)[idx] = lse[i];
      }
    }
  }

  // PERMUTED: O's columns back in their natural order (lane t's pair of column tile 4 m + jj is dims
  // 32 m + 8 jj + 2 t again): per 4 column tiles, row and element, the quad's 4 x 4 values transposed.
  static __device__ __forceinline__ void natural_columns(float (&o)[O_ACC], int lane) {
#pragma unroll
    for (int c = 0; c < O_COLS / 4; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // e: row i = e >> 1, element e & 1 (o[4 j + e])
        uint32_t a[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) a[k] = __float_as_uint(o[4 * (4 * c + k) + e]);
        quad_transpose4(a, lane);
#pragma unroll
        for (int k = 0; k < 4; ++k) o[4 * (4 * c + k) + e] = __uint_as_float(a[k]);
      }
  }

  // Row i of the thread's two (o[4 j + 2 i], o[4 j + 2 i + 1]) times its 1 / sum.
  static __device__ __forceinline__ void normalize(float (&o)[O_ACC], int i, float inv) {
#pragma unroll
    for (int j = 0; j < O_COLS; ++j) {
      o[4 * j + 2 * i] *= inv;
      o[4 * j + 2 * i + 1] *= inv;
    }
  }

  // store_16bit in the output's 16-bit type (p.o_format: the query's type or the other one).
  static __device__ __forceinline__ void store_16bit_as(const PrefillParams& p, const PrefillWork& w,
                                                        const int (&tile_row)[2], int lane, const float (&o)[O_ACC],
                                                        float (&lse)[2], const float (&inv)[2]) {
    if (p.o_format == kOutOther16)
      store_16bit<typename Other16<T>::type>(p, w, tile_row, lane, o, lse, inv);
    else
      store_16bit<T>(p, w, tile_row, lane, o, lse, inv);
  }

  // An unsplit row's LSE in the library's convention (p.lse_scale), by one lane of its quad.
  static __device__ __forceinline__ void store_lse(const PrefillParams& p, const PrefillWork& w, int token, int head,
                                                   float lse) {
    reinterpret_cast<float*>(p.lse)[lse_index(w, p.num_qo_heads, token, head)] = lse * p.lse_scale;
  }

  // Unsplit rows in the 16-bit type O (p.o_format: the query's type or the other one), their sinks
  // applied, and their LSE. A lane holds a 4-byte pair of every 8-column tile of its two rows; per
  // four column tiles the quad's 4 x 4 words are transposed (quad_transpose4) so that each lane
  // stores one tile's 16 bytes: a quarter of the stores, each filling whole 32-byte sectors. Every
  // lane runs the shuffles (rows past the tile's end too; their stores are skipped). Output rows
  // start on 16 bytes: the host's validator requires it of every output (operands.check_out:
  // 16-byte aligned pointer, strides in multiples of 8 elements). inv: each row's multiplier before
  // its sink factor (FOLD: its 1 / sum, O unnormalised; else 1).
  template <typename O>
  static __device__ __forceinline__ void store_16bit(const PrefillParams& p, const PrefillWork& w,
                                                     const int (&tile_row)[2], int lane, const float (&o)[O_ACC],
                                                     float (&lse)[2], const float (&inv)[2]) {
    static_assert(O_COLS % 4 == 0, "whole groups of four column tiles");
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = w.r0 + tile_row[i];
      const bool live = r < w.rows_total;
      const auto [token, head] = packed_row(p, w, r);
      float f = inv[i];
      if (live && p.sinks != 0) f *= sink_factor(reinterpret_cast<const float*>(p.sinks)[head], lse[i]);
      char* row = reinterpret_cast<char*>(p.o) + 2 * output_offset(p, w, token, head);
#pragma unroll
      for (int c = 0; c < O_COLS / 4; ++c) {
        uint32_t a[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int j = 4 * c + k;
          a[k] = Pack2<O>::from(o[4 * j + 2 * i] * f, o[4 * j + 2 * i + 1] * f);
        }
        // natural: column tile 4 c + lane % 4, lane k's pair at 4 k (after the transpose);
        // PERMUTED: the lane's own 8 consecutive dims (tile_offset)
        if constexpr (!PERMUTED) quad_transpose4(a, lane);
        char* dst = row + (PERMUTED ? 2 * (tile_offset(4 * c) + 8 * (lane % 4)) : 16 * (4 * c + lane % 4));
        if (live) *reinterpret_cast<uint4*>(dst) = make_uint4(a[0], a[1], a[2], a[3]);
      }
      if (live && p.lse != 0 && lane % 4 == 0)
        store_lse(p, w, token, head, lse[i]);
    }
  }

  // A quad's 4 x 4 words transposed: on entry lane s's word k is its pair of column tile 4c + k; on
  // exit lane q's word k is lane k's pair of column tile 4c + q (two butterfly stages of two
  // shuffles, each swapping the words whose index bit differs from the lane's).
  static __device__ __forceinline__ void quad_transpose4(uint32_t (&a)[4], int lane) {
#pragma unroll
    for (int m = 1; m <= 2; m <<= 1) {
      const bool hi = lane & m;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (j & m) continue;
        const uint32_t recv = __shfl_xor_sync(FULL, hi ? a[j] : a[j | m], m);
        if (hi)
          a[j] = recv;
        else
          a[j | m] = recv;
      }
    }
  }

  // An unsplit row in NVFP4 (nvfp4_out.cuh), its sink applied (lse moved to include it), and its LSE.
  // A quad holds a row's 16-column blocks (column tiles 2k, 2k + 1: four values a lane), so every
  // lane runs the shuffles, rows past the tile's end included; their stores are skipped. Each lane's
  // code-pair bytes are transposed across the quad so that every lane stores four consecutive bytes.
  static __device__ __forceinline__ void store_nvfp4(const PrefillParams& p, const PrefillWork& w,
                                                     const int (&tile_row)[2], int lane, const float (&o)[O_ACC],
                                                     float (&lse)[2]) {
    const float g = p.o_sf_scale;
    char* out = reinterpret_cast<char*>(p.o);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = w.r0 + tile_row[i];
      const bool live = r < w.rows_total;
      const auto [token, head] = packed_row(p, w, r);
      const float f = p.sinks != 0 ? sink_factor(reinterpret_cast<const float*>(p.sinks)[head], lse[i]) : 1.f;
      // byte offset of the row's first code pair; lane q stores column tiles 4c + q
      const int64_t row_byte = output_offset(p, w, token, head) >> 1;
#pragma unroll
      for (int c = 0; c < O_COLS / 4; ++c) {
        uint32_t bytes = 0;
#pragma unroll
        for (int b = 0; b < 2; ++b) {  // the two blocks of column tiles 4c .. 4c + 3
          const int j = 4 * c + 2 * b;
          const float a0 = o[4 * j + 2 * i] * f, a1 = o[4 * j + 2 * i + 1] * f;
          const float b0 = o[4 * j + 4 + 2 * i] * f, b1 = o[4 * j + 5 + 2 * i] * f;
          const Nvfp4Out::Block blk = Nvfp4Out::block(Nvfp4Out::quad_amax(a0, a1, b0, b1), g);
          bytes |= (Nvfp4Out::pack2(a0, a1, blk.to_code) | Nvfp4Out::pack2(b0, b1, blk.to_code) << 8) << (16 * b);
          if (live && lane % 4 == 0)
            Nvfp4Out::store_scale(p, w.q_row0 + token, head * (HEAD_DIM / 16) + j / 2, p.num_qo_heads * (HEAD_DIM / 16),
                                  blk.sf_bits);
        }
        bytes = Nvfp4Out::quad_transpose(bytes, lane);
        if (live) *reinterpret_cast<uint32_t*>(out + row_byte + 4 * (4 * c + lane % 4)) = bytes;
      }
      if (live && p.lse != 0 && lane % 4 == 0)
        store_lse(p, w, token, head, lse[i]);
    }
  }
};

}  // namespace pfa
