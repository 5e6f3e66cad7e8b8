// Epilogue of the sm80 prefill: finish the online softmax on the fragment rows, then write the
// CTA's rows: the output in its format (p.o_format: the query dtype, the other 16-bit type or
// e4m3, staged through shared memory for coalesced stores; where compiled in, NVFP4: store_nvfp4)
// and LSE, or (split KV) normalised fp32 partials and their base-2 LSE for the merge kernel. The
// layouts written are epilogue.cuh's.
#pragma once
#include <math.h>
#include <stdint.h>

#include "pfa/attention/epilogue.cuh"
#include "pfa/attention/nvfp4_out.cuh"
#include "pfa/attention/params.h"
#include "pfa/attention/sm80/fragments.cuh"
#include "pfa/attention/softmax_state.cuh"
#include "pfa/attention/variant.cuh"
#include "pfa/attention/work.cuh"
#include "pfa/common/dtypes.cuh"
#include "pfa/ptx/mma_sm80.cuh"

namespace pfa {

// lane and warp come as plain arguments rather than through WarpRoleSm80: used directly here,
// they stay computed once at kernel entry; read through the role, the compiler moves them and
// the register allocation of the whole kernel changes.
template <class Cfg>
struct EpilogueSm80 {
  using T = typename Cfg::Elem;
  using Role = WarpRoleSm80<Cfg>;
  using OAcc = typename AccumSm80<Cfg>::O;
  using Rows = typename AccumSm80<Cfg>::Rows;
  static constexpr int MQ = Cfg::MQ, O_DT = Cfg::O_DT, HEAD_DIM = Cfg::HEAD_DIM;
  static constexpr unsigned FULL = Cfg::FULL_MASK;

  // Full row sums (PAIR: both warps' keys; then the quad), O normalised in place, base-2 LSE of
  // every fragment row into lse_v.
  static __device__ __forceinline__ void normalize(const PrefillParams& p, const Role& wr, int lane, int warp, OAcc& o,
                                                   Rows& m, Rows& l, float (&lse_v)[MQ][2]) {
    if constexpr (Cfg::PAIR) {
      // Each warp summed P over its own keys: add the partner's (same lane, same rows) before
      // the quad reduction, in an order-free way so both warps hold the same row sums.
      wr.xch_max[warp * 32 + lane] = make_float4(l[0][0], l[0][1], l[MQ - 1][0], l[MQ - 1][1]);
      ptx::bar_sync(wr.pair_bar, Cfg::PAIR_THREADS);
      const float4 x = wr.xch_max[wr.partner * 32 + lane];
      l[0][0] += x.x;
      l[0][1] += x.y;
      if (MQ > 1) {
        l[MQ - 1][0] += x.z;
        l[MQ - 1][1] += x.w;
      }
    }
#pragma unroll
    for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float sum = l[mt][hf];
        sum += __shfl_xor_sync(FULL, sum, 1);
        sum += __shfl_xor_sync(FULL, sum, 2);
        const float inv = OnlineSoftmax<Cfg::LAZY_RESCALE>::finish(sum, m[mt][hf], output_scale(p), lse_v[mt][hf]);
#pragma unroll
        for (int d = 0; d < O_DT; ++d) {
          o[mt][d][2 * hf] *= inv;
          o[mt][d][2 * hf + 1] *= inv;
        }
      }
  }

  // Packed row `row` of the CTA tile -> (token, q head): the Q gather's row map, or (paged, no
  // row map) divided out.
  static __device__ __forceinline__ int2 token_head(const PrefillWork& w, const int2* row_map, int row) {
    const int r = w.r0 + row;
    return Cfg::ROW_MAP ? row_map[row] : make_int2(r / w.group, w.kv_head * w.group + r % w.group);
  }

  // Attention sinks (an unsplit row is finished here; split rows get theirs in the merge): each
  // fragment row's O scaled by its sink factor and its LSE moved to include the sink.
  static __device__ __forceinline__ void apply_sinks(const PrefillParams& p, const PrefillWork& w, const int2* row_map,
                                                  const Role& wr, int lane, OAcc& o, float (&lse_v)[MQ][2]) {
    const float* sinks = reinterpret_cast<const float*>(p.sinks);
#pragma unroll
    for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = wr.warp_row0 + mt * 16 + lane / 4 + hf * 8;
        if (w.r0 + row >= w.rows_total) continue;
        const float f = sink_factor(sinks[token_head(w, row_map, row).y], lse_v[mt][hf]);
#pragma unroll
        for (int d = 0; d < O_DT; ++d) {
          o[mt][d][2 * hf] *= f;
          o[mt][d][2 * hf + 1] *= f;
        }
      }
  }

  // TRT-LLM FMHAv2's softmax stats of every fragment row (general kernels, unsplit rows only):
  // (row max, row sum) in natural units with max + ln(sum) = the natural LSE, sinks included.
  // m is the true row max here: the general kernels never rescale lazily (variants.py).
  static __device__ __forceinline__ void store_stats(const PrefillParams& p, const PrefillWork& w,
                                                     const int2* row_map, int num_heads, const Role& wr, int lane,
                                                     const Rows& m, const float (&lse_v)[MQ][2]) {
    static_assert(!Cfg::LAZY_RESCALE, "softmax stats need the true row max");
    float2* stats = reinterpret_cast<float2*>(p.softmax_stats);
#pragma unroll
    for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = wr.warp_row0 + mt * 16 + lane / 4 + hf * 8;
        if (w.r0 + row >= w.rows_total) continue;
        const float mx = m[mt][hf], lse = lse_v[mt][hf];
        // No visible key: max -inf, sum 0 (a sink alone: its own max, sum 1).
        const float2 st = mx == -INFINITY ? (lse == -INFINITY ? make_float2(-INFINITY, 0.f)
                                                              : make_float2(lse * 0.6931471805599453f, 1.f))
                                          : make_float2(mx * 0.6931471805599453f, exp2f(lse - mx));
        const int2 th = token_head(w, row_map, row);
        stats[lse_index(w, num_heads, th.x, th.y)] = st;
      }
  }

  // The NVFP4 output (o_format kOutNvfp4, kernels with Cfg::NVFP4_OUT): the warp's rows staged as
  // fp32 through its own slice of sQ, half of its column tiles at a time (fp32 takes twice the
  // 16-bit staging), then each lane quantises whole 16-column blocks of a row from shared memory
  // (amax, e4m3 scale, 16 codes: nvfp4_out.cuh) and stores their 8 bytes and the scale. Quantising
  // there, out of the unrolled staging loop, keeps the fragment registers' pressure that of the
  // 16-bit store (the hd256 general kernels have none to spare).
  static __device__ __forceinline__ void store_nvfp4(const PrefillParams& p, const PrefillWork& w, char* smem,
                                                     const int2* row_map, const Role& wr, int lane, const OAcc& o) {
    static_assert(O_DT % 4 == 0, "whole 16-column blocks in each half of a warp's column tiles");
    constexpr int HALF = O_DT / 2, BLOCKS = HALF / 2;  // column tiles, 16-column blocks per pass
    char* out = reinterpret_cast<char*>(p.o);
    const float g = p.o_sf_scale;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      __syncwarp();
      // fp32 tile dd of this pass: chunk slots 2 dd (its elements 0-3: lanes 4k, 4k+1) and 2 dd + 1 (4-7)
#pragma unroll
      for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int row = wr.warp_row0 + mt * 16 + lane / 4 + hf * 8;
#pragma unroll
          for (int dd = 0; dd < HALF; ++dd) {
            const int d = h * HALF + dd;
            *reinterpret_cast<float2*>(smem + Cfg::swz(row, wr.dcol0 / 8 + 2 * dd + (lane % 4) / 2) * Cfg::CHUNK_BYTES +
                                       (lane % 2) * 8) = make_float2(o[mt][d][2 * hf], o[mt][d][2 * hf + 1]);
          }
        }
      __syncwarp();
      for (int i = lane; i < MQ * 16 * BLOCKS; i += 32) {
        const int row = wr.warp_row0 + i / BLOCKS, b = i % BLOCKS;
        if (w.r0 + row >= w.rows_total) continue;
        // two reads of the block's four chunks (amax, then codes): fewer registers than holding 16 values
        auto chunk = [&](int c) {
          return *reinterpret_cast<const float4*>(smem + Cfg::swz(row, wr.dcol0 / 8 + 4 * b + c) * Cfg::CHUNK_BYTES);
        };
        float amax = 0.f;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float4 v = chunk(c);
          amax = fmaxf(fmaxf(amax, fmaxf(fabsf(v.x), fabsf(v.y))), fmaxf(fabsf(v.z), fabsf(v.w)));
        }
        const Nvfp4Out::Block blk = Nvfp4Out::block(amax, g);
        uint32_t codes[2] = {0u, 0u};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float4 v = chunk(c);
          codes[c / 2] |= (Nvfp4Out::pack2(v.x, v.y, blk.to_code) | Nvfp4Out::pack2(v.z, v.w, blk.to_code) << 8)
                          << (16 * (c % 2));
        }
        const int2 th = token_head(w, row_map, row);
        const int tile = wr.dcol0 / 8 + h * HALF + 2 * b;  // the block's first column tile in the head
        const int64_t elem = output_offset(p, w, th.x, th.y) + tile * 8;  // e2m1 elements: two a byte
        *reinterpret_cast<uint2*>(out + (elem >> 1)) = make_uint2(codes[0], codes[1]);
        Nvfp4Out::store_scale(p, w.q_row0 + th.x, th.y * (HEAD_DIM / 16) + tile / 2, p.num_qo_heads * (HEAD_DIM / 16),
                              blk.sf_bits);
      }
    }
  }

  // One chunk: O in the output format (p.o_format) and (if requested) the LSE.
  static __device__ __forceinline__ void store_output(const PrefillParams& p, const PrefillWork& w, char* smem,
                                                      const int2* row_map, int num_heads, const Role& wr, int lane,
                                                      const OAcc& o, const float (&lse_v)[MQ][2]) {
    // Stage this warp's rows through its own slice of sQ (no other warp touches it; PAIR: the
    // pair's two warps write disjoint chunks), then write whole chunks so the global stores are
    // coalesced along each row. Every format stages 32 bits per value pair (e4m3: two bytes in
    // the low half), so the staging layout is the 16-bit one and an fp8 chunk is compacted to
    // 8 bytes on its way out. (A runtime format, converted right here: the 128-row lean kernels and
    // the decode tiles allocate their registers exactly as with the 16-bit store alone; an fp32
    // staging with the conversion in the copy-out loop measured no better.)
    if (Cfg::NVFP4_OUT && p.o_format == kOutNvfp4) {
      store_nvfp4(p, w, smem, row_map, wr, lane, o);
    } else {
      const int fmt = p.o_format;
      __syncwarp();
#pragma unroll
      for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int row = wr.warp_row0 + mt * 16 + lane / 4 + hf * 8;
#pragma unroll
          for (int d = 0; d < O_DT; ++d) {
            const uint32_t v = pack_out2<T>(o[mt][d][2 * hf], o[mt][d][2 * hf + 1], fmt);
            *reinterpret_cast<uint32_t*>(smem + Cfg::swz(row, wr.dcol0 / 8 + d) * Cfg::CHUNK_BYTES + (lane % 4) * 4) =
                v;
          }
        }
      __syncwarp();
      char* out = reinterpret_cast<char*>(p.o);
      const bool fp8 = fmt == kOutE4M3;
      for (int i = lane; i < MQ * 16 * O_DT; i += 32) {
        const int row = wr.warp_row0 + i / O_DT, chunk = wr.dcol0 / 8 + i % O_DT;
        if (w.r0 + row < w.rows_total) {
          const int2 th = token_head(w, row_map, row);
          const int64_t elem = output_offset(p, w, th.x, th.y) + chunk * 8;
          const uint4 staged = *reinterpret_cast<const uint4*>(smem + Cfg::swz(row, chunk) * Cfg::CHUNK_BYTES);
          if (fp8) {
            *reinterpret_cast<uint2*>(out + elem) = compact_fp8x8(staged);
          } else {
            *reinterpret_cast<uint4*>(out + elem * 2) = staged;
          }
        }
      }
    }
    if (p.lse != 0 && lane % 4 == 0 && wr.half == 0) {
      float* lse = reinterpret_cast<float*>(p.lse);
#pragma unroll
      for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int row = wr.warp_row0 + mt * 16 + lane / 4 + hf * 8;
          if (w.r0 + row < w.rows_total) {
            const int2 th = token_head(w, row_map, row);
            lse[lse_index(w, num_heads, th.x, th.y)] = lse_v[mt][hf] * p.lse_scale;
          }
        }
    }
  }

  // Split KV: normalised fp32 partials plus their base-2 LSE; the merge kernel combines.
  static __device__ __forceinline__ void store_partials(const PrefillParams& p, const PrefillWork& w,
                                                        const int2* row_map, int num_heads, const Role& wr,
                                                        int lane, const OAcc& o, const float (&lse_v)[MQ][2]) {
    float* op = reinterpret_cast<float*>(p.o_partial);
    float* lp = reinterpret_cast<float*>(p.lse_partial);
#pragma unroll
    for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = wr.warp_row0 + mt * 16 + lane / 4 + hf * 8;
        if (w.r0 + row >= w.rows_total) continue;
        const int2 th = token_head(w, row_map, row);
        const int64_t idx = partial_index(w, num_heads, th.x, th.y);
#pragma unroll
        for (int d = 0; d < O_DT; ++d)
          *reinterpret_cast<float2*>(op + idx * HEAD_DIM + wr.dcol0 + d * 8 + (lane % 4) * 2) =
              make_float2(o[mt][d][2 * hf], o[mt][d][2 * hf + 1]);
        if (lane % 4 == 0 && wr.half == 0) lp[idx] = lse_v[mt][hf];
      }
  }

  // The CTA's rows, normalised (o) with their LSE (lse_v), to global memory.
  // m: the rows' maxima (log2 units), read only for the general kernels' softmax stats.
  static __device__ __forceinline__ void store(const PrefillParams& p, const PrefillWork& w, char* smem,
                                               const Role& wr, int lane, OAcc& o, const Rows& m,
                                               float (&lse_v)[MQ][2]) {
    const int num_heads = p.num_qo_heads;
    const int2* row_map = reinterpret_cast<const int2*>(smem + Cfg::ROW_MAP_OFFSET);
    if (w.num_chunks == 1) {
      if (p.sinks != 0) apply_sinks(p, w, row_map, wr, lane, o, lse_v);
      if constexpr (Cfg::GENERAL) {
        if (p.softmax_stats != 0 && lane % 4 == 0 && wr.half == 0)
          store_stats(p, w, row_map, num_heads, wr, lane, m, lse_v);
      }
      store_output(p, w, smem, row_map, num_heads, wr, lane, o, lse_v);
    } else {
      store_partials(p, w, row_map, num_heads, wr, lane, o, lse_v);
    }
  }
};

}  // namespace pfa
