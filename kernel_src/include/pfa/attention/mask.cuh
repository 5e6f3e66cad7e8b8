// THE mask predicate. Every masking decision (per element, and which KV tiles a CTA visits
// or may skip masking on) goes through MaskRule, so skipped tiles and masked elements can
// never disagree. Conventions (FlashInfer's): a query row q sits at absolute position
// p = q + kv_len - qo_len (bottom-right alignment); causal keeps kv <= p; window_left >= 0
// keeps kv >= p - window_left (inclusive); kv must lie inside [0, kv_len); a custom mask
// (packed bits, little-endian, bit q * kv_len + kv) replaces causal (the host clears it) and is
// ANDed with the window. A speculative-decoding mask (XQA's; spec_words > 0) is the custom mask
// of the drafts only: the request's last qo_len keys are its drafts, row q keeps draft j when bit
// j of its spec_words 32-bit words is set, and every key before the drafts is kept.
// Chunked attention (TRT-LLM FMHAv2's, chunk_shift > 0, with causal): row q also needs
// kv >= floor(p / 2^chunk_shift) * 2^chunk_shift, a per-row left bound like the window's, so
// every test below takes it where it takes the window (left()).
#pragma once
#include <stdint.h>

namespace pfa {

struct MaskRule {
  int qo_len, kv_len;
  bool causal;
  int window_left;      // -1 = none
  const uint8_t* bits;  // custom mask, nullptr = none (always nullptr in the lean kernels)
  int spec_words;       // > 0: bits is a speculative-decoding mask with this many words per row
  int chunk_shift;      // log2 of the attention chunk, 0 = none (PrefillParams::chunk_shift)

  // A per-row left bound (window or chunk) exists: without one, kv >= 0 is the only left test.
  __device__ __forceinline__ bool has_left() const { return window_left >= 0 || chunk_shift > 0; }
  // Row q's first visible key by the window and the chunk (0 without either; may be < 0).
  __device__ __forceinline__ int left(int q) const {
    const int p = pos(q);
    int lo = window_left >= 0 ? p - window_left : 0;
    if (chunk_shift > 0) lo = max(lo, (p >> chunk_shift) << chunk_shift);  // >>: floor for p < 0 too
    return lo;
  }

  // First draft key of a speculative-decoding mask: keys before it are always visible.
  __device__ __forceinline__ int first_draft() const { return kv_len - qo_len; }

  // Speculative-decoding mask: keep-bits of row q for keys [kv0, kv0 + 64) (bit j = key kv0 + j),
  // the prefix part all ones, the drafts' part from the row's words (at most three loads).
  __device__ __forceinline__ uint64_t spec_row_bits(int q, int kv0) const {
    const int npre = min(max(first_draft() - kv0, 0), 64);
    uint64_t w = npre >= 64 ? ~0ull : (1ull << npre) - 1;
    if (npre < 64) {
      const uint32_t* row = reinterpret_cast<const uint32_t*>(bits) + (int64_t)q * spec_words;
      const int j0 = kv0 + npre - first_draft();  // first draft in the window, >= 0
      const int wi = j0 >> 5, sh = j0 & 31;
      auto word = [&](int i) -> uint64_t { return i < spec_words ? row[i] : 0u; };
      uint64_t d = (word(wi) | word(wi + 1) << 32) >> sh;
      if (sh) d |= word(wi + 2) << (64 - sh);
      w |= d << npre;
    }
    return w;
  }

  __device__ __forceinline__ int pos(int q) const { return q + kv_len - qo_len; }

  // Causal / window / bounds part of the predicate (everything but the custom-mask bits).
  __device__ __forceinline__ bool keep_structural(int q, int kv) const {
    bool ok = kv < kv_len && kv >= 0;
    if (causal) ok = ok && kv <= pos(q);
    if (has_left()) ok = ok && kv >= left(q);
    return ok;
  }

  // The same structural test as the key range of row q: keep_structural(q, kv) == (lo <= kv < hi)
  // (empty when hi <= lo). A masked tile then costs two compares per element, the range once per
  // row (the kernels choose the form per head dim, see PrefillSm80::ROW_RANGE_MASK).
  __device__ __forceinline__ void row_range(int q, int& lo, int& hi) const {
    const int p = pos(q);
    hi = causal ? min(kv_len, p + 1) : kv_len;  // row_end(q), spelled out: the form measured
    lo = has_left() ? max(0, left(q)) : 0;
  }
  // End of row q's range: without a left bound, keep_structural(q, kv) == (kv < row_end(q)) for
  // every kv >= 0.
  __device__ __forceinline__ int row_end(int q) const { return causal ? min(kv_len, pos(q) + 1) : kv_len; }

  // Custom-mask bits of row q for keys [kv0, kv0 + 64) as one word (bit j = key kv0 + j),
  // gathered with at most 9 byte loads that never leave the row's own bits. Tiles test a
  // whole row with shifts instead of one global load per element.
  __device__ __forceinline__ uint64_t row_bits(int q, int kv0) const {
    if (bits == nullptr || q >= qo_len) return 0;
    if (spec_words > 0) return spec_row_bits(q, kv0);
    const int64_t row0 = (int64_t)q * kv_len, first = row0 + kv0;
    const int64_t last = row0 + min(kv0 + 64, kv_len) - 1;  // last bit this row may own
    if (last < first) return 0;
    const int64_t b0 = first >> 3;
    const int n = (int)((last >> 3) - b0) + 1;  // 1..9 bytes
    uint64_t lo = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < n) lo |= (uint64_t)bits[b0 + j] << (8 * j);
    const int sh = (int)(first & 7);
    uint64_t w = lo >> sh;
    if (n == 9) w |= (uint64_t)bits[b0 + 8] << (64 - sh);
    return w;
  }

  // keep(q, kv) for keys [kv0, kv0 + 64) of row q as one word (bit j = key kv0 + j): the custom
  // bits ANDed with the row's structural range. The masked tiles then test one bit per element
  // at a compile-time position instead of the whole predicate.
  __device__ __forceinline__ uint64_t row_keep_bits(int q, int kv0) const {
    int lo, hi;
    row_range(q, lo, hi);
    const int a = min(max(lo - kv0, 0), 64), b = min(max(hi - kv0, 0), 64);
    const uint64_t below_b = b >= 64 ? ~0ull : (1ull << b) - 1;
    const uint64_t below_a = a >= 64 ? ~0ull : (1ull << a) - 1;
    return row_bits(q, kv0) & below_b & ~below_a;
  }

  __device__ __forceinline__ bool keep(int q, int kv) const {
    bool ok = keep_structural(q, kv);
    if (bits != nullptr) {
      if (!ok || q >= qo_len) return false;  // padded rows past qo_len own no mask bits
      if (spec_words > 0) {
        const int j = kv - first_draft();
        return j < 0 || ((reinterpret_cast<const uint32_t*>(bits)[(int64_t)q * spec_words + (j >> 5)] >> (j & 31)) & 1);
      }
      const int64_t i = (int64_t)q * kv_len + kv;
      ok = (bits[i >> 3] >> (i & 7)) & 1;
    }
    return ok;
  }

  // A custom mask is arbitrary, so no rectangle is known to be fully kept, except (speculative
  // decoding) one wholly before the drafts. RANGE: the same test through row_range (the form the
  // ROW_RANGE_MASK kernels use everywhere).
  template <bool RANGE = false>
  __device__ __forceinline__ bool keeps_all(int q0, int q1, int k0, int k1) const {
    const bool no_bits = bits == nullptr || (spec_words > 0 && k1 < first_draft());
    if constexpr (RANGE) {
      int lo0, hi0, lo1, hi1;
      row_range(q0, lo0, hi0);
      row_range(q1, lo1, hi1);
      return no_bits && k1 >= lo0 && k1 < hi0 && k0 >= lo1 && k0 < hi1;
    } else {
      if (!no_bits) return false;
      // the structural test alone: keep() would consult the bits
      return keep_structural(q0, k1) && keep_structural(q1, k0);
    }
  }

  // The keys every row of [q0, q1] keeps, [lo, hi) (empty when hi <= lo): for k0 <= k1,
  // keeps_all(q0, q1, k0, k1) == (k0 >= lo && k1 < hi). A row's range only moves right as q grows
  // (row_range), so the rectangle's last row bounds it on the left and its first row on the
  // right; a custom mask keeps no rectangle but the one before a speculative mask's drafts. Once
  // per work item, so that a tile's test is two compares instead of the predicate's.
  __device__ __forceinline__ void kept_by_all(int q0, int q1, int& lo, int& hi) const {
    int lo0, hi0, lo1, hi1;
    row_range(q0, lo0, hi0);
    row_range(q1, lo1, hi1);
    lo = lo1;
    hi = bits == nullptr ? hi0 : spec_words > 0 ? min(hi0, first_draft()) : lo;
  }

  // Half-open key range [begin, end) that rows [q0, q1] can see at all (may be empty).
  __device__ __forceinline__ int kv_begin(int q0) const {
    return has_left() ? max(0, left(q0)) : 0;
  }
  __device__ __forceinline__ int kv_end(int q1) const {
    return causal ? min(kv_len, max(0, pos(q1) + 1)) : kv_len;
  }
};

}  // namespace pfa
