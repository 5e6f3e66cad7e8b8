// Merge split-KV partial states: o = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse),
// lse = max + log2(sum w). All-(-inf) rows (no key anywhere) give o = 0, lse = -inf, never NaN.
// The merged row is written in the output's format (MergeParams::o_format, as the attention
// kernel's unsplit rows).
#pragma once
#include <math.h>

#include "pfa/attention/params.h"
#include "pfa/attention/softmax_state.cuh"
#include "pfa/common/dtypes.cuh"
#include "pfa/ptx/pdl.cuh"

namespace pfa {

template <typename T>
struct MergeStates {
  static constexpr int WARPS = 4;
  static constexpr unsigned FULL = 0xffffffffu;
  // Partial rows (float4 per lane) in flight per lane: UNROLL_ROWS / STRIPES splits at a time.
  // A merge is a short chain of dependent loads (merge_indptr -> LSE -> weights -> partial
  // rows) more than a stream, so the first splits are requested together with the LSE, before
  // the weights are known. 6 is the most that fits the register budget without spills, and
  // measured faster on H100 for batch plans and long hd256 splits (unchanged elsewhere).
  static constexpr int UNROLL_ROWS = 6;  // float4 partial rows in flight per lane (/ stripes)

  static __device__ __forceinline__ void add(float4& a, float w, const float4& v) {
    a.x += w * v.x;
    a.y += w * v.y;
    a.z += w * v.z;
    a.w += w * v.w;
  }

  // One warp per (row, head); lane l owns columns [4l, 4l + 4) of each of the STRIPES
  // 128-column stripes (head_dim 256: two; 64: lanes 16-31 idle). Lane s also holds the LSE of
  // chunk s (32 at a time), so the weights take one load per lane and two warp reductions,
  // then a shuffle per chunk. Partial state s sits at (first + s * stride) (row, head) units.
  // Loads use the read-only path (__ldg): nothing here writes what it reads.
  template <int STRIPES>
  static __device__ __forceinline__ void merge(const MergeParams& p, int lane, int row, int head, int64_t first,
                                               int64_t stride, int count) {
    constexpr int UNROLL = UNROLL_ROWS / STRIPES;
    const float* lp = reinterpret_cast<const float*>(p.lse_partial);
    const int hd = p.head_dim;
    const int c0 = lane * 4;
    const float* base = reinterpret_cast<const float*>(p.o_partial) + first * hd + c0;
    const int64_t step = stride * hd;  // floats from one chunk's partial row to the next
    auto has = [&](int st) { return c0 + 128 * st < hd; };
    auto load = [&](int s, int st) { return __ldg(reinterpret_cast<const float4*>(base + s * step + 128 * st)); };

    float4 v[UNROLL][STRIPES];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int st = 0; st < STRIPES; ++st)
        if (u < count && has(st)) v[u][st] = load(u, st);

    const float l0 = lane < count ? __ldg(lp + first + lane * stride) : -INFINITY;
    float mx = l0;
    for (int s = lane + 32; s < count; s += 32) mx = fmaxf(mx, __ldg(lp + first + s * stride));
#pragma unroll
    for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, off));
    const float m_use = mx == -INFINITY ? 0.f : mx;
    const float w0 = lane < count ? exp2f(l0 - m_use) : 0.f;
    float denom = w0;
    for (int s = lane + 32; s < count; s += 32) denom += exp2f(__ldg(lp + first + s * stride) - m_use);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) denom += __shfl_xor_sync(FULL, denom, off);
    float inv = denom > 0.f ? 1.f / denom : 0.f;
    float lse = denom > 0.f ? m_use + log2f(denom) : -INFINITY;
    // The row is finished here: its attention sink joins the normaliser (sink_factor).
    if (p.sinks != 0) inv *= sink_factor(__ldg(reinterpret_cast<const float*>(p.sinks) + head), lse);

    float4 acc[STRIPES];
#pragma unroll
    for (int st = 0; st < STRIPES; ++st) acc[st] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const float w = __shfl_sync(FULL, w0, u);
#pragma unroll
      for (int st = 0; st < STRIPES; ++st)
        if (u < count && has(st)) add(acc[st], w, v[u][st]);
    }
    for (int s0 = 0; s0 < count; s0 += 32) {
      const int n = min(32, count - s0);
      const float wl = s0 == 0 ? w0 : lane < n ? exp2f(__ldg(lp + first + (s0 + lane) * stride) - m_use) : 0.f;
      int j = s0 == 0 ? UNROLL : 0;  // the first UNROLL splits are in already
      for (; j + UNROLL <= n; j += UNROLL) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
          for (int st = 0; st < STRIPES; ++st)
            if (has(st)) v[u][st] = load(s0 + j + u, st);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const float w = __shfl_sync(FULL, wl, j + u);
#pragma unroll
          for (int st = 0; st < STRIPES; ++st)
            if (has(st)) add(acc[st], w, v[u][st]);
        }
      }
      for (; j < n; ++j) {
        const float w = __shfl_sync(FULL, wl, j);
#pragma unroll
        for (int st = 0; st < STRIPES; ++st)
          if (has(st)) add(acc[st], w, load(s0 + j, st));
      }
    }

    // The output in its format (p.o_format): four 16-bit values (8 bytes) or four e4m3 bytes a lane.
    const int fmt = p.o_format;
    const int64_t elem = row * p.o_stride_n + head * p.o_stride_h + c0;
    char* out = reinterpret_cast<char*>(p.o);
#pragma unroll
    for (int st = 0; st < STRIPES; ++st) {
      if (!has(st)) continue;
      const uint32_t lo = pack_out2<T>(acc[st].x * inv, acc[st].y * inv, fmt);
      const uint32_t hi = pack_out2<T>(acc[st].z * inv, acc[st].w * inv, fmt);
      if (fmt == kOutE4M3) {
        *reinterpret_cast<uint32_t*>(out + elem + 128 * st) = __byte_perm(lo, hi, 0x5410);
      } else {
        *reinterpret_cast<uint2*>(out + (elem + 128 * st) * 2) = make_uint2(lo, hi);
      }
    }
    if (p.lse != 0 && lane == 0) reinterpret_cast<float*>(p.lse)[(int64_t)row * p.num_heads + head] = lse * p.lse_scale;
  }

  static __device__ __forceinline__ void run(const MergeParams& p) {
    ptx::wait_prior_grids();  // launched programmatically after the attention kernel (sm_90)
    const int lane = threadIdx.x % 32;
    const int64_t pair = (int64_t)blockIdx.x * WARPS + threadIdx.x / 32;
    const int64_t pairs = (int64_t)p.rows * p.num_heads;
    if (pair >= pairs) return;  // whole warps: the shuffles below see every lane
    const int row = pair / p.num_heads, head = pair % p.num_heads;
    int64_t first = pair, stride = pairs;  // single request: [num_kv_chunks, rows, heads]
    int count = p.num_kv_chunks;
    if (p.merge_indptr != 0) {
      const int32_t* mi = reinterpret_cast<const int32_t*>(p.merge_indptr);
      count = mi[row + 1] - mi[row];
      if (count == 0) return;  // this row's request has one chunk: the attention kernel wrote it
      first = (int64_t)mi[row] * p.num_heads + head;
      stride = p.num_heads;
    }
    // head_dim <= 256 (the host's HEAD_DIMS): one or two column stripes
    if (p.head_dim > 128) {
      merge<2>(p, lane, row, head, first, stride, count);
    } else {
      merge<1>(p, lane, row, head, first, stride, count);
    }
  }
};

}  // namespace pfa

#define PFA_DEFINE_MERGE(NAME, T)                                                         \
  extern "C" __global__ void __launch_bounds__(pfa::MergeStates<T>::WARPS * 32)          \
      NAME(const __grid_constant__ pfa::MergeParams p) {                                  \
    pfa::MergeStates<T>::run(p);                                                          \
  }
