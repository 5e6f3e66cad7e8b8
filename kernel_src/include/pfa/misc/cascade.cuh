// Cascade merge of attention states (FlashInfer's merge_state, merge_state_in_place and
// merge_states). A state (v, lse) is attention over one key set; merging states over disjoint
// key sets gives attention over their union:
//   w_i = 2^(lse_i - max_j lse_j),  v = sum_i w_i v_i / sum_i w_i,  lse = max + log2(sum_i w_i)
// in base 2 (FlashInfer's LSE); natural-log LSEs go through lse_log2_scale and come back in
// natural log. A row whose every state is empty (lse -inf) merges to v = 0, lse = -inf, never NaN;
// an empty state's v is never read (the attention kernels may leave it unwritten).
#pragma once
#include <math.h>
#include <stdint.h>

#include "pfa/attention/params.h"
#include "pfa/common/dtypes.cuh"

namespace pfa {

namespace cascade_detail {

__device__ __forceinline__ float widen(half x) { return __half2float(x); }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float widen(float x) { return x; }

template <typename T>
__device__ __forceinline__ T narrow(float x) { return from_float<T>(x); }
template <>
__device__ __forceinline__ float narrow<float>(float x) { return x; }

// W consecutive elements of one state's row: one 16-byte access when W * sizeof(T) == 16 (the
// host checked alignment: CascadeMergeParams::vec16), else W == 1, one element.
template <typename T, int W>
struct alignas(W * sizeof(T)) Chunk {
  static_assert(W == 1 || W * sizeof(T) == 16, "a chunk is one element or one 16-byte access");
  T x[W];

  __device__ __forceinline__ void load(uint64_t addr) {
    if constexpr (W == 1) {
      x[0] = *reinterpret_cast<const T*>(addr);
    } else {
      *reinterpret_cast<uint4*>(x) = *reinterpret_cast<const uint4*>(addr);
    }
  }
  __device__ __forceinline__ void store(uint64_t addr) const {
    if constexpr (W == 1) {
      *reinterpret_cast<T*>(addr) = x[0];
    } else {
      *reinterpret_cast<uint4*>(addr) = *reinterpret_cast<const uint4*>(x);
    }
  }
};

}  // namespace cascade_detail

template <typename T>
struct CascadeMerge {
  static constexpr int WARPS = 4;  // (row, head) pairs per block, one warp each
  static constexpr unsigned FULL = 0xffffffffu;
  static constexpr int VEC = 16 / sizeof(T);  // elements of one 16-byte access
  // States' chunks in flight per lane: a merge is a few dependent loads per state, so several
  // states are requested before the first is accumulated.
  static constexpr int UNROLL = 4;

  // Where the states of one (row, head) live: state s's values at v_first + s * v_step and its LSE
  // at s_first + s * s_step (bytes). Stacked mode steps by the state stride; pair mode steps from
  // v_a's row to v_b's, integer address arithmetic, since the two are separate tensors with
  // their own strides. Loads are plain (not __ldg): in place, v_a and s_a are also written.
  struct States {
    uint64_t v_first, s_first;
    int64_t v_step, s_step;
    int count;

    __device__ __forceinline__ float lse(int s) const {
      return *reinterpret_cast<const float*>(s_first + s * s_step);
    }
    __device__ __forceinline__ uint64_t values(int s) const { return v_first + s * v_step; }
  };

  static __device__ __forceinline__ States locate(const CascadeMergeParams& p, int64_t row, int64_t head) {
    constexpr int64_t VB = sizeof(T), SB = sizeof(float);
    States st;
    st.v_first = p.v_a + VB * (row * p.v_a_stride_n + head * p.v_a_stride_h);
    st.s_first = p.s_a + SB * (row * p.s_a_stride_n + head * p.s_a_stride_h);
    if (p.v_b != 0) {  // pair mode: state 1 is (v_b, s_b)
      st.v_step = static_cast<int64_t>(p.v_b + VB * (row * p.v_b_stride_n + head * p.v_b_stride_h) - st.v_first);
      st.s_step = static_cast<int64_t>(p.s_b + SB * (row * p.s_b_stride_n + head * p.s_b_stride_h) - st.s_first);
    } else {
      st.v_step = VB * p.v_a_stride_s;
      st.s_step = SB * p.s_a_stride_s;
    }
    st.count = p.num_states;
    return st;
  }

  // The weight of a state of LSE l (input units) against the shift m (the max LSE, or 0 when every
  // state is empty, so that -inf - m never becomes -inf - -inf = NaN).
  static __device__ __forceinline__ float weight(float l, float m, float log2_scale) {
    return exp2f((l - m) * log2_scale);
  }

  // Lane j holds state j's weight (the first 32 states); returns it, with the shift and the sum of
  // all weights (warp reductions: every lane gets them). A NaN LSE stays NaN in the sum.
  static __device__ __forceinline__ float weights(const CascadeMergeParams& p, const States& st, int lane,
                                                  float& m, float& denom) {
    const float l0 = lane < st.count ? st.lse(lane) : -INFINITY;
    float mx = l0;
    for (int s = lane + 32; s < st.count; s += 32) mx = fmaxf(mx, st.lse(s));
#pragma unroll
    for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, off));
    m = mx == -INFINITY ? 0.f : mx;
    const float w0 = lane < st.count ? weight(l0, m, p.lse_log2_scale) : 0.f;
    float sum = w0;
    for (int s = lane + 32; s < st.count; s += 32) sum += weight(st.lse(s), m, p.lse_log2_scale);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(FULL, sum, off);
    denom = sum;
    return w0;
  }

  // v_out = sum_s w_s v_s * inv, W elements per lane access. Lane l owns columns
  // [c + l W, c + l W + W) of each 32 W-column stripe c; the stripe loop's trip count is the same
  // for every lane so the weight shuffles see the whole warp. States of weight 0 are skipped (not
  // loaded): uniform over the warp, since every lane holds the same shuffled weight.
  template <int W>
  static __device__ __forceinline__ void merge_values(const CascadeMergeParams& p, const States& st, int lane,
                                                      float w_lane, float m, float inv, uint64_t out) {
    using Chunk = cascade_detail::Chunk<T, W>;
    const int hd = p.head_dim;
    for (int stripe = 0; stripe < hd; stripe += 32 * W) {
      const int c0 = stripe + lane * W;
      const bool mine = c0 < hd;
      const uint64_t col = static_cast<uint64_t>(c0) * sizeof(T);
      float acc[W];
#pragma unroll
      for (int i = 0; i < W; ++i) acc[i] = 0.f;
      for (int s0 = 0; s0 < st.count; s0 += 32) {
        const int n = min(32, st.count - s0);
        // beyond the first 32 states (rare), each group's weights are recomputed per stripe
        const float wl = s0 == 0 ? w_lane : lane < n ? weight(st.lse(s0 + lane), m, p.lse_log2_scale) : 0.f;
        for (int j = 0; j < n; j += UNROLL) {
          float w[UNROLL];
          Chunk c[UNROLL];
#pragma unroll
          for (int u = 0; u < UNROLL; ++u) {
            w[u] = __shfl_sync(FULL, wl, (j + u) & 31);
            if (j + u >= n) w[u] = 0.f;
            if (mine && w[u] != 0.f) c[u].load(st.values(s0 + j + u) + col);
          }
#pragma unroll
          for (int u = 0; u < UNROLL; ++u)
            if (mine && w[u] != 0.f)
#pragma unroll
              for (int i = 0; i < W; ++i) acc[i] = fmaf(w[u], cascade_detail::widen(c[u].x[i]), acc[i]);
        }
      }
      if (mine) {
        Chunk o;
#pragma unroll
        for (int i = 0; i < W; ++i) o.x[i] = cascade_detail::narrow<T>(acc[i] * inv);
        o.store(out + col);
      }
    }
  }

  // Grid (ceil(seq * num_heads / WARPS)); block WARPS * 32.
  static __device__ __forceinline__ void run(const CascadeMergeParams& p) {
    const int lane = threadIdx.x % 32;
    const int64_t pair = static_cast<int64_t>(blockIdx.x) * WARPS + threadIdx.x / 32;
    if (pair >= static_cast<int64_t>(p.seq) * p.num_heads) return;  // whole warps: shuffles see every lane
    const int64_t row = pair / p.num_heads, head = pair % p.num_heads;
    if (p.mask != 0 && reinterpret_cast<const uint8_t*>(p.mask)[row * p.mask_stride] == 0) return;

    const States st = locate(p, row, head);
    float m, denom;
    const float w_lane = weights(p, st, lane, m, denom);
    const bool empty = denom == 0.f;  // no state has keys (a NaN sum is not empty: NaN propagates)
    const float inv = empty ? 0.f : 1.f / denom;
    const uint64_t out = p.v_out + sizeof(T) * (row * p.v_out_stride_n + head * p.v_out_stride_h);
    if (p.vec16) {
      merge_values<VEC>(p, st, lane, w_lane, m, inv, out);
    } else {
      merge_values<1>(p, st, lane, w_lane, m, inv, out);
    }
    // In place, s_out is s_a: every lane has read its LSEs before lane 0 overwrites them.
    __syncwarp();
    if (lane == 0)
      *reinterpret_cast<float*>(p.s_out + sizeof(float) * (row * p.s_out_stride_n + head * p.s_out_stride_h)) =
          empty ? -INFINITY : m + log2f(denom) * p.lse_rcp_scale;
  }
};

}  // namespace pfa

#define PFA_DEFINE_CASCADE(NAME, T)                                          \
  extern "C" __global__ void __launch_bounds__(pfa::CascadeMerge<T>::WARPS * 32)  \
      NAME(const __grid_constant__ pfa::CascadeMergeParams p) {                   \
    pfa::CascadeMerge<T>::run(p);                                                 \
  }
