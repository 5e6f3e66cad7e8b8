// Merge split-KV partial states: o = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse),
// lse = max + log2(sum w). All-(-inf) rows (no key anywhere) give o = 0, lse = -inf, never NaN.
// The merged row is written in the output's format (MergeParams::o_format, as the attention
// kernel's unsplit rows; NVFP4 by store_nvfp4). Two kernels (variants.py MergeVariant.cta_per_row): one warp per
// (row, head), or, for few rows over many chunks, one CTA per (row, head) whose warps share its
// chunks (the host picks by rows x heads against the SMs).
#pragma once
#include <math.h>

#include "pfa/attention/nvfp4_out.cuh"
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
  // merge_cta: float4 partial rows per lane and batch (/ stripes; a divisor of 32, so a batch
  // never straddles two 32-chunk weight words); two batches are in flight (current and next).
  static constexpr int CTA_UNROLL_ROWS = 8;

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

    store<STRIPES>(p, lane, hd, row, head, acc, inv, lse);
  }

  // The merged row (lane l: columns [4l, 4l + 4) of each stripe) in the output's format
  // (p.o_format): four 16-bit values (8 bytes) or four e4m3 bytes a lane; lane 0 writes the LSE.
  template <int STRIPES>
  static __device__ __forceinline__ void store(const MergeParams& p, int lane, int hd, int row, int head,
                                               const float4 (&acc)[STRIPES], float inv, float lse) {
    if (p.o_format == kOutNvfp4) {
      store_nvfp4<STRIPES>(p, lane, hd, row, head, acc, inv, lse);
      return;
    }
    const int c0 = lane * 4;
    auto has = [&](int st) { return c0 + 128 * st < hd; };
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

  // The merged row in NVFP4 (nvfp4_out.cuh): a quad of lanes holds a 16-column block; every lane of
  // the (whole) warp runs the shuffles (hd64's idle lanes hold zeros) and stores its two code-pair
  // bytes, the quad's first lane the block's scale; lane 0 writes the LSE.
  template <int STRIPES>
  static __device__ __forceinline__ void store_nvfp4(const MergeParams& p, int lane, int hd, int row, int head,
                                                     const float4 (&acc)[STRIPES], float inv, float lse) {
    const int c0 = lane * 4;
    const int64_t elem = row * p.o_stride_n + head * p.o_stride_h + c0;  // in e2m1 elements, two a byte
    char* out = reinterpret_cast<char*>(p.o);
#pragma unroll
    for (int st = 0; st < STRIPES; ++st) {
      const float4 v = make_float4(acc[st].x * inv, acc[st].y * inv, acc[st].z * inv, acc[st].w * inv);
      const Nvfp4Out::Block blk = Nvfp4Out::block(Nvfp4Out::quad_amax(v.x, v.y, v.z, v.w), p.o_sf_scale);
      const int col = c0 + 128 * st;
      if (col >= hd) continue;
      *reinterpret_cast<uint16_t*>(out + ((elem + 128 * st) >> 1)) =
          (uint16_t)(Nvfp4Out::pack2(v.x, v.y, blk.to_code) | Nvfp4Out::pack2(v.z, v.w, blk.to_code) << 8);
      if (lane % 4 == 0)
        Nvfp4Out::store_scale(p, row, head * (hd / 16) + col / 16, p.num_heads * (hd / 16), blk.sf_bits);
    }
    if (p.lse != 0 && lane == 0) reinterpret_cast<float*>(p.lse)[(int64_t)row * p.num_heads + head] = lse * p.lse_scale;
  }

  // One CTA per (row, head) (the CTA_PER_ROW kernel): warp w merges chunks w, w + WARPS, ...
  // as merge() merges a row, against its own max; the WARPS states (max, sum, weighted row)
  // combine in shared memory and warp 0 writes the row. A row of many chunks then costs a
  // quarter of merge()'s dependent load rounds, and each warp keeps two batches of
  // CTA_UNROLL_ROWS partial rows in flight (the next is requested before the current is added).
  template <int STRIPES>
  static __device__ __forceinline__ void merge_cta(const MergeParams& p, int lane, int warp, int row, int head,
                                                   int64_t first, int64_t stride, int count) {
    constexpr int U = CTA_UNROLL_ROWS / STRIPES;
    static_assert(32 % U == 0, "a batch of chunks within one 32-chunk weight word");
    __shared__ float4 s_acc[WARPS][STRIPES][32];
    __shared__ float s_max[WARPS], s_sum[WARPS];
    const float* lp = reinterpret_cast<const float*>(p.lse_partial);
    const int hd = p.head_dim;
    const int c0 = lane * 4;
    const int n = count > warp ? (count - warp + WARPS - 1) / WARPS : 0;  // this warp's chunks
    const int64_t f = first + warp * stride, st = stride * WARPS;         // its first, and the step
    const float* base = reinterpret_cast<const float*>(p.o_partial) + f * hd + c0;
    const int64_t step = st * hd;
    auto has = [&](int sp) { return c0 + 128 * sp < hd; };
    auto load = [&](int s, int sp) { return __ldg(reinterpret_cast<const float4*>(base + s * step + 128 * sp)); };

    float4 cur[U][STRIPES];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int sp = 0; sp < STRIPES; ++sp)
        if (u < n && has(sp)) cur[u][sp] = load(u, sp);
    const float l0 = lane < n ? __ldg(lp + f + lane * st) : -INFINITY;
    float mx = l0;
    for (int s = lane + 32; s < n; s += 32) mx = fmaxf(mx, __ldg(lp + f + s * st));
#pragma unroll
    for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, off));
    const float m_use = mx == -INFINITY ? 0.f : mx;
    const float w0 = lane < n ? exp2f(l0 - m_use) : 0.f;
    float denom = w0;
    for (int s = lane + 32; s < n; s += 32) denom += exp2f(__ldg(lp + f + s * st) - m_use);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) denom += __shfl_xor_sync(FULL, denom, off);

    float4 acc[STRIPES];
#pragma unroll
    for (int sp = 0; sp < STRIPES; ++sp) acc[sp] = make_float4(0.f, 0.f, 0.f, 0.f);
    float wl = w0;  // lane l: the weight of chunk (j & ~31) + l
    for (int j = 0; j < n; j += U) {
      float4 nxt[U][STRIPES];
      if (j + U < n) {
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int sp = 0; sp < STRIPES; ++sp)
            if (j + U + u < n && has(sp)) nxt[u][sp] = load(j + U + u, sp);
      }
      if (j > 0 && j % 32 == 0) wl = j + lane < n ? exp2f(__ldg(lp + f + (j + lane) * st) - m_use) : 0.f;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float w = __shfl_sync(FULL, wl, j % 32 + u);
#pragma unroll
        for (int sp = 0; sp < STRIPES; ++sp)
          if (j + u < n && has(sp)) add(acc[sp], w, cur[u][sp]);
      }
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int sp = 0; sp < STRIPES; ++sp) cur[u][sp] = nxt[u][sp];
    }

    // mx = -inf: no chunk (or only empty ones) here, so denom and acc are 0 and weigh nothing.
    if (lane == 0) {
      s_max[warp] = mx;
      s_sum[warp] = denom;
    }
#pragma unroll
    for (int sp = 0; sp < STRIPES; ++sp)
      if (has(sp)) s_acc[warp][sp][lane] = acc[sp];
    __syncthreads();
    if (warp != 0) return;
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m_all = fmaxf(m_all, s_max[w]);
    float total = 0.f;
#pragma unroll
    for (int sp = 0; sp < STRIPES; ++sp) acc[sp] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float sc = s_max[w] == -INFINITY ? 0.f : exp2f(s_max[w] - m_all);
      total += sc * s_sum[w];
#pragma unroll
      for (int sp = 0; sp < STRIPES; ++sp)
        if (has(sp)) add(acc[sp], sc, s_acc[w][sp][lane]);
    }
    float inv = total > 0.f ? 1.f / total : 0.f;
    float lse = total > 0.f ? m_all + log2f(total) : -INFINITY;
    if (p.sinks != 0) inv *= sink_factor(__ldg(reinterpret_cast<const float*>(p.sinks) + head), lse);
    store<STRIPES>(p, lane, hd, row, head, acc, inv, lse);
  }

  // The grid: one CTA per (row, head) (CTA_PER_ROW), else at most a few waves of CTAs whose
  // warps stride over the (row, head) pairs (the host caps the grid: configure_merge). A
  // fixed-capacity merge (a CUDA-graph plan, pyflashattn.jax) covers every token of the capacity
  // even when the plan split nothing; merge_indptr[rows] (the partial rows of the plan) is then 0
  // and the kernel returns at once: one CTA per four pairs cost 124 us for 20k tokens x 32 heads
  // of exits alone (NOTES.md, session 26).
  template <bool CTA_PER_ROW>
  static __device__ __forceinline__ void run(const MergeParams& p) {
    ptx::wait_prior_grids();  // launched programmatically after the attention kernel (sm_90)
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t pairs = (int64_t)p.rows * p.num_heads;
    if (p.merge_indptr != 0 && reinterpret_cast<const int32_t*>(p.merge_indptr)[p.rows] == 0) return;
    if constexpr (CTA_PER_ROW) {
      if (blockIdx.x < pairs) merge_pair<true>(p, lane, warp, blockIdx.x);  // the whole CTA: its shuffles see every lane
    } else {
      for (int64_t pair = (int64_t)blockIdx.x * WARPS + warp; pair < pairs; pair += (int64_t)gridDim.x * WARPS)
        merge_pair<false>(p, lane, warp, pair);  // whole warps
    }
  }

  // One (row, head) pair: its chunks' partial states merged into the output.
  template <bool CTA_PER_ROW>
  static __device__ __forceinline__ void merge_pair(const MergeParams& p, int lane, int warp, int64_t pair) {
    const int64_t pairs = (int64_t)p.rows * p.num_heads;
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
    if constexpr (CTA_PER_ROW) {
      if (p.head_dim > 128) {
        merge_cta<2>(p, lane, warp, row, head, first, stride, count);
      } else {
        merge_cta<1>(p, lane, warp, row, head, first, stride, count);
      }
    } else {
      if (p.head_dim > 128) {
        merge<2>(p, lane, row, head, first, stride, count);
      } else {
        merge<1>(p, lane, row, head, first, stride, count);
      }
    }
  }
};

}  // namespace pfa

#define PFA_DEFINE_MERGE(NAME, T)                                                         \
  extern "C" __global__ void __launch_bounds__(pfa::MergeStates<T>::WARPS * 32)          \
      NAME(const __grid_constant__ pfa::MergeParams p) {                                  \
    pfa::MergeStates<T>::run<false>(p);                                                   \
  }
// Few rows over many chunks: one CTA per (row, head).
#define PFA_DEFINE_MERGE_CTA(NAME, T)                                                     \
  extern "C" __global__ void __launch_bounds__(pfa::MergeStates<T>::WARPS * 32)          \
      NAME(const __grid_constant__ pfa::MergeParams p) {                                  \
    pfa::MergeStates<T>::run<true>(p);                                                    \
  }
