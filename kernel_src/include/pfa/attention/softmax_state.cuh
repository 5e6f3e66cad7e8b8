// Online softmax in the log2 domain, one query row at a time. Layout-free: a kernel keeps, for
// each row a thread holds, a running max m (of scaled logits, log2 units) and a running sum l of
// 2^(x - m) over the keys that thread has seen; it reduces the tile's row max across the threads
// sharing a row its own way (quad shuffles for mma.sync fragments, other patterns for wgmma) and
// calls these for the math. The scale (sm_scale * log2 e, or 1 when a logit transform already
// produced log2 units) is folded into the exponent's FMA.
//
// Per tile:  m_use = rescale(m, tile_max, scale, corr);       // then o *= corr, if corr != 1
//            x = prob(s, scale, m_use) for every score of the row; l = l * corr + sum(x)
//            (the kernel writes that last FMA itself, in the operand order of its own loop)
// At the end: inv = finish(row_sum over threads, m, out_scale, lse); o *= inv.
#pragma once
#include <math.h>

#include "pfa/ptx/math.cuh"

namespace pfa {

template <bool LAZY_RESCALE, int SLACK_QUARTERS = 32>
struct OnlineSoftmax {
  // Lazy rescale: how far (log2 units, in quarters) the running max may lag the true one. The
  // default, P <= 2^8 = 256, fits fp16/bf16 and fp32 sums with room to spare; P rounded to e4m3
  // needs less (sm90/fp8_consumer.cuh).
  static constexpr float RESCALE_SLACK = SLACK_QUARTERS / 4.f;
  static constexpr bool LAZY = LAZY_RESCALE;

  // Fold a tile's raw row max (before scaling) into m. Returns the max to subtract in the
  // exponent, m_use, and sets corr = 2^(m_old - m_use), the factor for l and O (exactly 1 when
  // the max held).
  //
  // LAZY_RESCALE keeps a stale row max until the true one exceeds it by more than RESCALE_SLACK:
  // P = exp2(s - m) then stays <= 2^RESCALE_SLACK, and the result is exact all the same, since l
  // is summed against the same max and O / l cancels it. A row's max rarely jumps that far after
  // its first tile, so most tiles skip the O rescale even on short rows (~10-20 tiles), where a
  // strict max still moves on most tiles. (-inf - -inf is NaN: a row that saw only masked keys
  // keeps -inf.)
  // lazy = false (a runtime value): the strict max even under LAZY_RESCALE, which skip-softmax's
  // comparison against the running max needs (SkipSoftmax).
  static __device__ __forceinline__ float rescale(float& m, float tile_max, float scale, float& corr,
                                                  bool lazy = true) {
    float m_new = fmaxf(m, tile_max * scale);
    if (LAZY_RESCALE && lazy && m_new - m <= RESCALE_SLACK) m_new = m;
    // A row that has seen only masked keys keeps m = -inf; use 0 so exp2 gives 0, not NaN.
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    corr = ptx::exp2_approx(m - m_use);
    m = m_new;
    return m_use;
  }

  // Whether a tile whose raw max is tile_max leaves m as it is by rescale's lazy rule (scaled, at
  // most RESCALE_SLACK past m). Also for a max over part of a row's keys: if every part's holds, the
  // row's does (ConsumerSm90::max_held). Never for m = -inf (no key yet).
  static __device__ __forceinline__ bool holds(float tile_max, float scale, float m) {
    return LAZY_RESCALE && tile_max * scale - m <= RESCALE_SLACK;
  }
  // Unnormalised probability of raw score s: 2^(s * scale - m_use).
  static __device__ __forceinline__ float prob(float s, float scale, float m_use) {
    return ptx::exp2_approx(fmaf(s, scale, -m_use));
  }

  // The row's total sum (every thread's share added) -> the multiplier that normalises O (times
  // out_scale, e.g. the fp8 V dequantisation scale), and the base-2 LSE. A fully masked row
  // gives O = 0 and LSE = -inf, never NaN.
  static __device__ __forceinline__ float finish(float sum, float m, float out_scale, float& lse) {
    const float inv = sum > 0.f ? out_scale / sum : 0.f;
    lse = sum > 0.f ? m + __log2f(sum) : -INFINITY;
    return inv;
  }
};

// Skip-softmax sparsity (TRT-LLM's skip_softmax_threshold_scale_factor, arXiv 2512.12087; semantics
// 1.12): with T = factor / kv_len (the request's keys), a KV tile whose every row has
// exp(tile_max - m) < T (natural units of the final logit, m = the row's running max over the
// tiles before it in this CTA's KV chunk) would add at most T * BLOCK_N of each row's normaliser,
// so its softmax and P V are skipped: it adds nothing to the sum or the output. The rows voting
// together are a kernel's vote group (one warp's rows in the sm80 family, its pair's under PAIR;
// one consumer warpgroup's 64 in the sm90 family: the manifest's skip_softmax_rows); rows past
// the request (padding) and rows that see no key of the tile vote "negligible" (neither adds
// anything). In the kernels' log2 units, x = tile_max * scale and m: exp(.) < T  <=>
// x - m < log2(T). Its first tile is never skipped (m = -inf there), so a KV split starts afresh.
struct SkipSoftmax {
  float log2_threshold;  // log2(factor / kv_len); -inf = off

  static __device__ __forceinline__ SkipSoftmax make(float factor, int kv_len) {
    SkipSoftmax k;
    k.log2_threshold = factor > 0.f && kv_len > 0 ? log2f(factor) - log2f(static_cast<float>(kv_len)) : -INFINITY;
    return k;
  }
  __device__ __forceinline__ bool on() const { return log2_threshold != -INFINITY; }
  // One row's vote: its tile max (raw, before `scale`) is negligible against its running max m.
  // -inf - -inf (no key yet, none in the tile) is NaN: caught by the first test.
  __device__ __forceinline__ bool negligible(float tile_max, float scale, float m) const {
    return tile_max == -INFINITY || tile_max * scale - m < log2_threshold;
  }
};

// An attention sink (FlashInfer's, semantics 1.10) on a finished row: a virtual key of logit
// `sink` (natural-log units of the scaled logit) that adds e^sink to the row's normaliser and
// nothing to its value. Given the row's base-2 LSE, returns the factor for its normalised O and
// moves the LSE to include the sink. Applied once per row where the row is finished (unsplit:
// the epilogue; split KV: the merge), so splitting never counts it twice.
__device__ __forceinline__ float sink_factor(float sink, float& lse) {
  const float s2 = sink * 1.4426950408889634f;  // log2(e): the LSE is base 2
  if (lse == -INFINITY) {  // no visible key: the sink takes the whole normaliser, O stays 0
    lse = s2;
    return 0.f;
  }
  const float mx = fmaxf(lse, s2);
  const float own = exp2f(lse - mx), total = own + exp2f(s2 - mx);
  lse = mx + log2f(total);
  return own / total;
}

}  // namespace pfa
