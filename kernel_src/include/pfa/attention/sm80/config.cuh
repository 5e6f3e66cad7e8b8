// Compile-time shape of one FA2-class prefill kernel (mma.sync, sm_80 and newer): tile sizes,
// the per-shape choices the variant table makes, and the dynamic shared-memory layout. Every
// sm80 piece (tile loads, mainloop, epilogue) takes this as its `Cfg`.
//
// One CTA owns BLOCK_M packed query rows of one kv head and walks that head's keys in BLOCK_N
// tiles. Per warp: MQ m16 row tiles of S = Q K^T and O += P V (mma.sync m16n8k16, fp32
// accumulators, operands through ldmatrix from XOR-swizzled shared memory).
//
// PAIR (head dims where a warp cannot hold two m16 row tiles of O, i.e. hd256; also the hd256
// fp8 decode tile, where two warps share the widening of each K/V tile): warps 2i and 2i+1
// share MQ row tiles. For S = Q K^T each takes half of the tile's keys over the whole head dim;
// for O += P V each takes half of the head dim over all keys. Every K/V ldmatrix then feeds
// 2*MQ row tiles instead of one, which cuts shared-memory reads per MMA by a third: the
// one-row-tile kernel was bound by ldmatrix throughput, and the pair measured faster on H100.
//
// fp8 K/V (KV = fp8_storage): the ring holds one-byte tiles exactly as they sit in global memory
// (half the bytes per load); after a tile lands, the CTA widens it once into 16-bit tiles in the
// swizzled layout, so the MMA path is the same as for 16-bit K/V. Most decode tiles instead
// widen fp8 / NVFP4 fragments in registers (KV_REG_WIDEN, sm80/reg_frags.cuh).
// NVFP4 K/V (KV = nvfp4_storage, paged decode tiles only): each ring tile holds the rows' e2m1
// code pairs (HEAD_DIM / 2 bytes a row), then their e4m3 block scales (HEAD_DIM / 16 bytes a
// row); the widening multiplies each code by its block's scale (sm80/nvfp4_tiles.cuh).
#pragma once
#include <stdint.h>

#include "pfa/common/dtypes.cuh"

namespace pfa {

// The 16-bit type of P and of the K / V fragments the MMAs read: the query dtype, or fp16 where
// fp8 / NVFP4 K/V widen in registers (sm80/reg_frags.cuh: every e4m3 / e5m2 value, and every
// e2m1 code times its e4m3 block scale, is an fp16).
template <bool FP16, typename T>
struct MmaElemSm80 {
  using type = T;
};
template <typename T>
struct MmaElemSm80<true, T> {
  using type = half;
};

template <typename T, typename KV, int HEAD_DIM_, int NUM_WARPS_, int MQ_, int BLOCK_N_, bool Q_IN_REGS_,
          int KV_STAGES_, bool GENERAL_, bool PAGED_, bool LAZY_RESCALE_, bool PAIR_>
struct PrefillSm80Config {
  using Elem = T;    // Q, O and the 16-bit K/V tiles the MMAs read
  using KvElem = KV;  // K/V as stored in global memory (T, one-byte fp8, or NVFP4 code pairs)
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int NUM_WARPS = NUM_WARPS_;
  static constexpr int MQ = MQ_;  // m16 row tiles per warp
  static constexpr int BLOCK_N = BLOCK_N_;
  static constexpr bool Q_IN_REGS = Q_IN_REGS_;
  static constexpr int KV_STAGES = KV_STAGES_;
  static constexpr bool GENERAL = GENERAL_;  // soft cap, ALiBi, RoPE and custom masks compiled in
  static constexpr bool PAGED = PAGED_;
  static constexpr bool LAZY_RESCALE = LAZY_RESCALE_;
  static constexpr bool PAIR = PAIR_;

  static constexpr int WARP_SIZE = 32;
  static constexpr unsigned FULL_MASK = 0xffffffffu;  // every lane of a warp (shuffles, votes)
  static constexpr int CHUNK_BYTES = 16;              // one cp.async / ldmatrix row / uint4
  // One period of the XOR swizzle: 8 chunks of a row, the span an ldmatrix k16 step pair covers.
  static constexpr int SWIZZLE_CHUNKS = 8;
  static constexpr int SWIZZLE_BYTES = SWIZZLE_CHUNKS * CHUNK_BYTES;
  static constexpr int MMA_M = 16, MMA_N = 8, MMA_K = 16;  // mma.sync m16n8k16

  static constexpr int ROW_WARPS = PAIR ? NUM_WARPS / 2 : NUM_WARPS;  // warps with distinct rows
  static constexpr int BLOCK_M = ROW_WARPS * MQ * MMA_M;
  static constexpr int THREADS = NUM_WARPS * WARP_SIZE;
  static constexpr int CPR = HEAD_DIM / 8;  // 16-byte chunks per row
  static constexpr int KSTEPS = HEAD_DIM / MMA_K;
  static constexpr int NTILES = BLOCK_N / MMA_N;
  static constexpr int DTILES = HEAD_DIM / MMA_N;
  static constexpr int ROW_BYTES = HEAD_DIM * (int)sizeof(T);  // one row of a 16-bit tile
  // Whether the kernel honours PrefillParams::rows_fastest (variants.py puts it in the manifest).
  static constexpr bool ROWS_FASTEST = PAIR && !PAGED;
  static constexpr int S_NT = PAIR ? NTILES / 2 : NTILES;  // n8 tiles of S per warp (its keys)
  static constexpr int O_DT = PAIR ? DTILES / 2 : DTILES;  // n8 tiles of O per warp (its head dims)
  static constexpr int PAIR_THREADS = 2 * WARP_SIZE;       // a named barrier over one warp pair
  static_assert(!PAIR || (NUM_WARPS % 2 == 0 && MQ <= 2 && !Q_IN_REGS && BLOCK_N % 32 == 0),
                "PAIR: warp pairs, at most 4 row maxes per lane, Q from shared memory, whole k16 steps per half");
  // A warp's half of the head dims must start at a multiple of 8 chunks, where the XOR swizzle
  // leaves the offset alone (v_off in the mainloop): hd64 pairs computed wrong outputs.
  static_assert(!PAIR || HEAD_DIM >= 128, "PAIR: each half of the head dims spans whole swizzle periods");
  // Paged KV: the page ids of a CTA's whole KV range are staged in shared memory once, so no
  // tile load waits on a dependent global read of the page table (falls back beyond this).
  // The 16-row decode tiles at head_dim <= 128 stage 1024, so that three CTAs fit an SM, which
  // measured faster for hd128 paged decode on H100; at hd256 only 256 ids would fit three CTAs,
  // and the page-table fallback beyond them cost more than the third CTA gave. variants.py
  // mirrors the rule.
  static constexpr int MAX_PAGE_IDS = BLOCK_M > 16 || HEAD_DIM > 128 ? 2048 : 1024;
  static constexpr bool KV_NVFP4 = KvStorage<KV>::NVFP4;
  static constexpr bool KV_FP8 = sizeof(KV) == 1 && !KV_NVFP4;
  // fp8 / NVFP4 K/V in the decode tiles: read from the ring straight into MMA fragments and
  // widened in registers (sm80/reg_frags.cuh, fp8_frags.cuh, nvfp4_frags.cuh), with no widened
  // copy in shared memory and no barrier pair around one. In the one-warp 16-row tiles nothing is
  // widened twice. The wide fp8 tiles (2 / 4 warps of 16 rows on one K/V tile) widen each element
  // once a warp, which the hardware e4m3 conversion affords (NVFP4's table decode does not: its
  // wide tiles keep the shared widening, as the pairs and the 128-row kernels do). variants.py
  // mirrors the rule.
  // The fp8 warp pair (hd256: each warp S over half the keys, O over half the dims) widens only
  // its own halves, so nothing is widened twice there either.
  static constexpr bool KV_REG_WIDEN = !GENERAL && MQ == 1 &&
                                       (BLOCK_M == 16 ? KV_FP8 || (KV_NVFP4 && !PAIR) : KV_FP8 && BLOCK_M <= 64 && !PAIR);
  // The ring holds a narrower form of K/V that the CTA widens into 16-bit tiles (fp8, NVFP4).
  static constexpr bool KV_WIDEN = (KV_FP8 || KV_NVFP4) && !KV_REG_WIDEN;
  static_assert(!KV_REG_WIDEN || !Q_IN_REGS, "the register-widened tiles read Q in their own fragment order");
  using PElem = typename MmaElemSm80<KV_REG_WIDEN, T>::type;  // P, packed for O += P V
  // Masked tiles of the lean kernels. hd64 / hd256 test each element against its row's key
  // range (MaskRule::row_range, computed once per row; the tile test too), which measured faster
  // there on H100, causal and not. In hd128 that form was slower everywhere, since it moved the
  // allocation of that register-bound loop into more spills; hd128 tests only the row's end when
  // there is no window (MaskRule::row_end, keep() with one). The general kernels (soft cap,
  // ALiBi, custom masks) keep the per-element keep(): their hd128 loops already spill, and the
  // new forms made them slower.
  static constexpr bool ROW_RANGE_MASK = !GENERAL && HEAD_DIM != 128;
  static constexpr bool ROW_END_MASK = !GENERAL && HEAD_DIM == 128;
  static_assert(sizeof(KV) == sizeof(T) || KV_FP8 || KV_NVFP4, "K/V are in the query dtype, one-byte fp8 or NVFP4");
  static_assert(!KV_NVFP4 || PAGED, "NVFP4 K/V come from a paged cache (their scales share its page table)");
  static constexpr int NVFP4_BLOCK = 16;  // head-dim elements per NVFP4 block scale
  // Bytes of one K/V row as stored: its elements, or (NVFP4) its code pairs.
  static constexpr int KV_ROW_BYTES = KV_NVFP4 ? HEAD_DIM / 2 : HEAD_DIM * (int)sizeof(KV);
  static constexpr int SF_ROW_BYTES = KV_NVFP4 ? HEAD_DIM / NVFP4_BLOCK : 0;  // NVFP4: a row's block scales
  static constexpr int KV_CPR = KV_ROW_BYTES / CHUNK_BYTES;                  // 16-byte chunks per K/V row
  // K/V elements per chunk (NVFP4: 32 codes in 16 bytes; its loader addresses bytes, not elements)
  static constexpr int KV_EPC = HEAD_DIM / KV_CPR;
  static constexpr int TILE_BYTES = BLOCK_N * HEAD_DIM * (int)sizeof(T);     // a 16-bit K or V tile
  // A K or V tile as loaded; NVFP4: the codes, then the scales from SF_OFFSET (in the tile).
  static constexpr int SF_OFFSET = BLOCK_N * KV_ROW_BYTES;
  static constexpr int RING_TILE_BYTES = SF_OFFSET + BLOCK_N * SF_ROW_BYTES;
  // The hd256 NVFP4 decode tile (16 rows, a warp pair) widens K, runs S = Q K^T, then widens V
  // into the same 16-bit tile: one widened tile instead of a pair leaves room for more CTAs per
  // SM on a latency-bound widening stream, which measured faster on H100 (for the fp8 pair too,
  // which now widens in registers).
  // At hd64 / hd128 the extra barrier cost more than the CTAs gave, and the 128-row kernels'
  // shared memory holds two CTAs either way. variants.py mirrors the rule.
  static constexpr bool SPLIT_WIDEN = KV_WIDEN && BLOCK_M == 16 && HEAD_DIM >= 256;
  // Honours PrefillParams::scale_dev: the general kernels and the decode tiles (fewer than 128
  // rows). variants.py's device_scale (the manifest) mirrors the rule.
  static constexpr bool DEVICE_SCALE = GENERAL || BLOCK_M < 128;
  // Honours PrefillParams::skip_softmax_factor (SkipSoftmax, softmax_state.cuh), voting per warp (its
  // pair under PAIR): MQ * 16 packed rows. The general kernels and the decode tiles: in the 128-row
  // lean kernels the vote moved the tile loop into spills (hd128 / hd256 on sm_80), so their
  // skip-softmax calls run on the general kernel of the same tile (BatchEngine.apply_skip_softmax).
  // variants.py's skip_softmax_rows (the manifest) mirrors the rule.
  static constexpr bool SKIP_SOFTMAX = GENERAL || BLOCK_M < 128;
  // The lean paged hd128 decode tiles over 16-bit or fp8 K/V honour XQA's speculative-decoding
  // mask (spec_mask_words > 0), the only custom mask they take: 8-token speculative decode then
  // streams K/V as plain decode does instead of running the 128-row general kernel. At hd128 the
  // mask's registers cost nothing (ptxas within +-6); at hd64 it cost 10-14 registers and at
  // hd256 spills, and XQA refuses masks over NVFP4, so those keep the general kernel for masks.
  // variants.py's spec_mask mirrors the rule.
  static constexpr bool SPEC_MASK = !GENERAL && PAGED && BLOCK_M < 128 && HEAD_DIM == 128 && !KV_NVFP4;
  // Whether the epilogue writes the NVFP4 output format (o_format kOutNvfp4): the paged kernels,
  // which the TRT-LLM context API (its only user) runs on, except the hd256 general ones (warp
  // pairs), whose mainloop it pushed into spills (sm_80: 4 -> 56 bytes, reloads in the tile loop).
  // variants.py's nvfp4_out (the manifest) mirrors the rule; the host routes NVFP4 outputs by it.
  static constexpr bool NVFP4_OUT = PAGED && !(GENERAL && PAIR);

  // ---- dynamic shared memory, in this order ----
  // Q, then KV_STAGES (K, V) ring pairs (stage i: K at tile 2i, V at 2i+1), then (fp8, NVFP4) the
  // widened K, V pair (or one tile).
  static constexpr int Q_BYTES = BLOCK_M * HEAD_DIM * (int)sizeof(T);
  static constexpr int RING_OFFSET = Q_BYTES;
  static constexpr int WIDE_OFFSET = RING_OFFSET + 2 * KV_STAGES * RING_TILE_BYTES;
  static constexpr int KV_SMEM_BYTES = WIDE_OFFSET + (KV_WIDEN ? (SPLIT_WIDEN ? 1 : 2) * TILE_BYTES : 0);
  // Paged KV: the staged page ids (int32).
  static constexpr int PAGE_IDS_OFFSET = KV_SMEM_BYTES;
  // Each packed row's (token, q head) as an int2, written by the Q gather, read by the epilogue:
  // the output scatter, LSE and partial stores then need no division by the runtime group size
  // per row, a visible share of a short batch CTA's instructions. Not in the paged kernels: there
  // it moved the tile loop's register allocation into spills inside the loop and made them
  // slower, so they keep the divisions.
  static constexpr bool ROW_MAP = !PAGED;
  static constexpr int ROW_MAP_OFFSET = PAGE_IDS_OFFSET + (PAGED ? MAX_PAGE_IDS * (int)sizeof(int32_t) : 0);
  // PAIR exchange area, one slot per warp written only by that warp, lane-major so every access
  // is conflict-free: a float4 of row maxes (row sums in the epilogue), then its P words.
  static constexpr int XCH_OFFSET = ROW_MAP_OFFSET + (ROW_MAP ? BLOCK_M * (int)sizeof(int2) : 0);
  static constexpr int XCH_P_WORDS = MQ * S_NT * 2;
  static constexpr int XCH_P_OFFSET = XCH_OFFSET + THREADS * (int)sizeof(float4);
  static constexpr int SMEM_BYTES =
      XCH_OFFSET + (PAIR ? THREADS * ((int)sizeof(float4) + XCH_P_WORDS * (int)sizeof(uint32_t)) : 0);
  static_assert(KV_STAGES >= 1 && KV_STAGES <= 4, "KV_STAGES: 1 = FA2 interleave, >= 2 = K/V ring");
  static_assert(!KV_WIDEN || KV_STAGES >= 2, "fp8 / NVFP4 K/V widen whole ring stages (K and V together)");
  static_assert(!KV_REG_WIDEN || KV_STAGES >= 2, "the register-widened tiles run the K/V ring");
  static_assert(HEAD_DIM % 64 == 0, "the XOR swizzle needs at least 8 chunks per row");
  static_assert(!KV_WIDEN || WIDE_OFFSET % SWIZZLE_BYTES == 0, "the widened tiles start on a swizzle period");
  static_assert(BLOCK_N % 16 == 0, "BLOCK_N must be a multiple of 16");
  static_assert(THREADS % CPR == 0 && THREADS % KV_CPR == 0, "each thread keeps one chunk column in the loaders");
  static_assert(BLOCK_M % (THREADS / CPR) == 0 && BLOCK_N % (THREADS / CPR) == 0, "tile rows vs threads");

  // Chunk index of (row, chunk) in a swizzled [rows][HEAD_DIM] tile: XOR with row % 8 puts the
  // eight rows an ldmatrix phase reads into eight different 16-byte bank groups.
  static __device__ __forceinline__ int swz(int row, int chunk) { return row * CPR + (chunk ^ (row & 7)); }

  // The register-widened rings' swizzle (fp8 rows, NVFP4 code rows): chunk ^ fp8_swz(row) puts the 8 rows an ldmatrix
  // phase reads (16 bytes each) into 8 different 16-byte bank groups. A 128-byte line holds
  // FP8_ROWS_PER_LINE rows (hd64: 2), so the XOR takes the row's line. Period: 8 rows.
  static constexpr int FP8_ROWS_PER_LINE = KV_CPR >= 8 ? 1 : 8 / KV_CPR;
  static __device__ __forceinline__ int fp8_swz(int row) {
    return (row / FP8_ROWS_PER_LINE) & (KV_CPR >= 8 ? 7 : KV_CPR - 1);
  }

  // Byte offset of K/V chunk (row, chunk) in a ring tile: 16-bit tiles are swizzled for
  // ldmatrix, and so are the register-widened fp8 tiles (fp8_swz); the fp8 / NVFP4 tiles of the
  // shared widening stay linear (that pass reads them chunk by chunk, conflict-free).
  static __device__ __forceinline__ uint32_t ring_off(int row, int chunk) {
    if constexpr (KV_WIDEN) return (row * KV_CPR + chunk) * CHUNK_BYTES;
    if constexpr (KV_REG_WIDEN) return (row * KV_CPR + (chunk ^ fp8_swz(row))) * CHUNK_BYTES;
    return swz(row, chunk) * CHUNK_BYTES;
  }
};

}  // namespace pfa
