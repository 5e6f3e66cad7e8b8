// FA2-class prefill for sm_80 and newer (also built for sm_90a, where it is the portable path).
//
// One CTA owns BLOCK_M packed query rows of one kv head and walks that head's keys in
// BLOCK_N tiles. GQA is handled by packing: packed row r = q_idx * group_size + head_in_group,
// so a group's query heads share every K/V tile a CTA loads.
//
// Per warp: MQ m16 row tiles. S = Q K^T and O += P V run on mma.sync m16n8k16 with fp32
// accumulators; operands come from swizzled shared memory through ldmatrix; K and V tiles
// arrive by cp.async so that V(j) streams in during Q K(j)^T and K(j+1) during P V(j).
// Softmax is online in the log2 domain (the scale already carries log2 e), P stays in
// registers (the C fragment of S is exactly the A fragment layout of P V).
//
// PAIR (head dims where a warp cannot hold two m16 row tiles of O, i.e. hd256; also the hd256
// fp8 decode tile, where two warps share the widening of each K/V tile): warps 2i and
// 2i+1 share MQ row tiles. For S = Q K^T each takes half of the tile's keys over the whole head
// dim; for O += P V each takes half of the head dim over all keys. The row max and the other
// half's P cross between the two through shared memory (two 64-thread barriers a tile). Every
// K/V ldmatrix then feeds 2*MQ row tiles instead of one: shared-memory reads per MMA drop by a
// third (the one-row-tile kernel ran shared memory at 80 % with its warps stalled on ldmatrix);
// measured +3 % (NOTES.md).
//
// fp8 K/V (KV = fp8_storage): the ring holds one-byte tiles exactly as they sit in global
// memory (half the bytes per load); after a tile lands, the CTA widens it once into a 16-bit
// K/V pair in the swizzled layout, so the MMA path below is the same as for 16-bit K/V.
#pragma once
#include <math.h>

#include "pfa/attention/mask.cuh"
#include "pfa/attention/params.h"
#include "pfa/attention/variant.cuh"
#include "pfa/common/dtypes.cuh"
#include "pfa/ptx/mma_sm80.cuh"
#include "pfa/ptx/pdl.cuh"

namespace pfa {

template <typename T, typename KV, int HEAD_DIM, int NUM_WARPS, int MQ, int BLOCK_N, bool Q_IN_REGS,
          int KV_STAGES, bool GENERAL, bool PAGED, bool LAZY_RESCALE = false, bool PAIR = false>
struct PrefillSm80 {
  static constexpr int ROW_WARPS = PAIR ? NUM_WARPS / 2 : NUM_WARPS;  // warps with distinct rows
  static constexpr int BLOCK_M = ROW_WARPS * MQ * 16;
  static constexpr int THREADS = NUM_WARPS * 32;
  static constexpr int CPR = HEAD_DIM / 8;  // 16-byte chunks per row
  static constexpr int KSTEPS = HEAD_DIM / 16;
  static constexpr int NTILES = BLOCK_N / 8;
  static constexpr int DTILES = HEAD_DIM / 8;
  // Whether the kernel honours PrefillParams::rows_fastest (variants.py puts it in the manifest).
  static constexpr bool ROWS_FASTEST = PAIR && !PAGED;
  static constexpr int S_NT = PAIR ? NTILES / 2 : NTILES;  // n8 tiles of S per warp (its keys)
  static constexpr int O_DT = PAIR ? DTILES / 2 : DTILES;  // n8 tiles of O per warp (its head dims)
  static_assert(!PAIR || (NUM_WARPS % 2 == 0 && MQ <= 2 && !Q_IN_REGS && BLOCK_N % 32 == 0),
                "PAIR: warp pairs, at most 4 row maxes per lane, Q from shared memory, whole k16 steps per half");
  // A warp's half of the head dims must start at a multiple of 8 chunks, where the XOR swizzle
  // leaves the offset alone (v_off below): hd64 pairs computed wrong outputs.
  static_assert(!PAIR || HEAD_DIM >= 128, "PAIR: each half of the head dims spans whole swizzle periods");
  // Paged KV: the page ids of a CTA's whole KV range are staged in shared memory once, so no
  // tile load waits on a dependent global read of the page table (falls back beyond this).
  // The 16-row decode tiles at head_dim <= 128 stage 1024, so that three CTAs fit an SM (H100,
  // hd128 paged decode 2.22 -> 2.70 TB/s on the spec-decode batch); at 256 only 256 would, and
  // the page-table fallback beyond them cost more than the third CTA gave (2.35 -> 2.00).
  // variants.py mirrors the rule.
  static constexpr int MAX_PAGE_IDS = BLOCK_M > 16 || HEAD_DIM > 128 ? 2048 : 1024;
  static constexpr bool KV_FP8 = sizeof(KV) == 1;
  // Masked tiles of the lean kernels. H100, A/B of the cubins in one machine session, 3 rounds
  // each (NOTES.md, session 8): hd64 / hd256 test each element against its row's key range
  // (MaskRule::row_range, computed once per row; the tile test too): hd64 single causal 2K / 8K
  // +10 / +6 %, non-causal 8K +2 %, causal ragged batch +6 %; hd256 +3..6 % causal, +3 %
  // non-causal. In hd128 that form cost 5 % everywhere, non-causal included (where no tile is
  // masked): it moved the allocation of that 253-register loop (16 -> 32 B of spills). hd128
  // tests only the row's end when there is no window (MaskRule::row_end, keep() with one): 8 B of
  // spills, single causal 2K +6 %, the rest within noise or better. The general kernels (soft
  // cap, ALiBi, custom masks) keep the per-element keep(): with the new forms the hd128 ones lost
  // 4-16 % (their loops already spill 70-90 B).
  static constexpr bool ROW_RANGE_MASK = !GENERAL && HEAD_DIM != 128;
  static constexpr bool ROW_END_MASK = !GENERAL && HEAD_DIM == 128;
  // Lazy rescale: how far (log2 units) the running max may lag the true one; P <= 2^8 = 256
  // fits fp16/bf16 and fp32 sums with room to spare.
  static constexpr float RESCALE_SLACK = 8.f;
  static_assert(sizeof(KV) == sizeof(T) || KV_FP8, "K/V are in the query dtype or one-byte fp8");
  static constexpr int KV_CPR = HEAD_DIM * (int)sizeof(KV) / 16;  // 16-byte chunks per K/V row
  static constexpr int KV_EPC = 16 / (int)sizeof(KV);              // K/V elements per chunk
  static constexpr int TILE_BYTES = BLOCK_N * HEAD_DIM * (int)sizeof(T);     // a 16-bit K or V tile
  static constexpr int RING_TILE_BYTES = BLOCK_N * HEAD_DIM * (int)sizeof(KV);  // as loaded
  // The hd256 fp8 decode tile (16 rows) widens K, runs S = Q K^T, then widens V into the same
  // 16-bit tile: one widened tile instead of a pair, more CTAs per SM for a latency-bound
  // widening stream. H100, bench_decode fp8 paged TB/s, B=64 / B=16 / B=128 / spec-decode:
  // first on the one-warp 16-key tile (one-wave split budget, paged 49 -> 41 KB) 1.06 / 1.60 /
  // 1.71 / 1.42 -> 1.27 / 1.54 / 1.82 / 1.62; then on the shipped warp-pair 32-key tile (two-wave
  // budget) 1.49 / 1.53 / 1.74 / 1.37 -> 1.74 / 1.80 / 2.07 / 1.93. At hd64 / hd128 the extra
  // barrier cost more than the CTAs gave (hd64 -2..-4 % everywhere; the hd128 pair: B=16 1.40 ->
  // 1.62 but spec-decode 1.87 -> 1.49), and the 128-row kernels' shared memory holds two CTAs
  // either way. variants.py mirrors the rule.
  static constexpr bool SPLIT_WIDEN = KV_FP8 && BLOCK_M == 16 && HEAD_DIM >= 256;
  // Q, then KV_STAGES (K, V) ring pairs, then (fp8 only) the widened K, V pair (or one tile).
  static constexpr int KV_SMEM_BYTES = BLOCK_M * HEAD_DIM * (int)sizeof(T) + 2 * KV_STAGES * RING_TILE_BYTES +
                                       (KV_FP8 ? (SPLIT_WIDEN ? 1 : 2) * TILE_BYTES : 0);
  // Each packed row's (token, q head), written by the Q gather, read by the epilogue: the output
  // scatter, LSE and partial stores then need no division by the runtime group size per row
  // (~1K instructions per warp per CTA, a visible share of a short batch CTA). Not in the paged
  // kernels: there it moved the tile loop's register allocation (hd128: 8 -> 56 B of spills,
  // local loads inside the loop, paged -7 %), so they keep the divisions.
  static constexpr bool ROW_MAP = !PAGED;
  static constexpr int ROW_MAP_OFFSET = KV_SMEM_BYTES + (PAGED ? MAX_PAGE_IDS * 4 : 0);
  // PAIR exchange area, one slot per warp written only by that warp, lane-major so every access
  // is conflict-free: a float4 of row maxes (row sums in the epilogue), then its P words.
  static constexpr int XCH_OFFSET = ROW_MAP_OFFSET + (ROW_MAP ? BLOCK_M * 8 : 0);
  static constexpr int XCH_P_WORDS = MQ * S_NT * 2;
  static constexpr int XCH_P_OFFSET = XCH_OFFSET + NUM_WARPS * 32 * 16;
  static constexpr int SMEM_BYTES = XCH_OFFSET + (PAIR ? NUM_WARPS * 32 * (16 + XCH_P_WORDS * 4) : 0);
  static_assert(KV_STAGES >= 1 && KV_STAGES <= 4, "KV_STAGES: 1 = FA2 interleave, >= 2 = K/V ring");
  static_assert(!KV_FP8 || KV_STAGES >= 2, "fp8 K/V widens whole ring stages (K and V together)");
  static_assert(HEAD_DIM % 64 == 0, "the XOR swizzle needs at least 8 chunks per row");
  static_assert(BLOCK_N % 16 == 0, "BLOCK_N must be a multiple of 16");
  static_assert(THREADS % CPR == 0 && THREADS % KV_CPR == 0, "each thread keeps one chunk column in the loaders");

  // Chunk index of (row, chunk) in a swizzled [rows][HEAD_DIM] tile: XOR with row % 8 puts the
  // eight rows an ldmatrix phase reads into eight different 16-byte bank groups.
  static __device__ __forceinline__ int swz(int row, int chunk) { return row * CPR + (chunk ^ (row & 7)); }

  // Byte offset of K/V chunk (row, chunk) in a ring tile: 16-bit tiles are swizzled for
  // ldmatrix; fp8 tiles stay linear (the widening pass reads them chunk by chunk, conflict-free).
  static __device__ __forceinline__ uint32_t ring_off(int row, int chunk) {
    return KV_FP8 ? (row * KV_CPR + chunk) * 16 : swz(row, chunk) * 16;
  }

  // Copy BLOCK_N rows of one K/V head into a ring tile (contiguous KV): this thread's chunk
  // column of rows row0, row0 + ROW_STEP, ... where `src` points at (row0, chunk) and
  // `step_bytes` = ROW_STEP rows; rows at or past valid_rows are zero-filled. A full tile (all
  // but a range's last) is one 64-bit add and one cp.async per row; the shared-memory offsets are
  // one or two registers plus compile-time immediates (the XOR swizzle repeats every 8 rows).
  static __device__ __forceinline__ void load_rows(uint32_t s_tile, const char* src, int64_t step_bytes,
                                                   const KV* safe, int valid_rows, int tid) {
    constexpr int ROW_STEP = THREADS / KV_CPR;
    constexpr int PERIOD = ROW_STEP >= 8 || KV_FP8 ? 1 : 8 / ROW_STEP;  // distinct swizzles
    const int chunk = tid % KV_CPR;
    const int row0 = tid / KV_CPR;
    uint32_t so[PERIOD];
#pragma unroll
    for (int j = 0; j < PERIOD; ++j) so[j] = s_tile + ring_off(row0 + j * ROW_STEP, chunk) - j * ROW_STEP * KV_CPR * 16;
    if (valid_rows >= BLOCK_N) {
#pragma unroll
      for (int i = 0; i < BLOCK_N / ROW_STEP; ++i) {
        ptx::cp_async_16(so[i % PERIOD] + i * ROW_STEP * KV_CPR * 16, src, true);
        src += step_bytes;
      }
    } else {
#pragma unroll
      for (int i = 0; i < BLOCK_N / ROW_STEP; ++i) {
        const bool valid = row0 + i * ROW_STEP < valid_rows;
        ptx::cp_async_16(so[i % PERIOD] + i * ROW_STEP * KV_CPR * 16, valid ? src : reinterpret_cast<const char*>(safe),
                         valid);
        src += step_bytes;
      }
    }
  }

  // acc[mt][2j], acc[mt][2j+1] += a[mt] x (the two n8 halves of one ldmatrix.x4), every row tile:
  // the inner step of both S = Q K^T and O += P V.
  template <int N>
  static __device__ __forceinline__ void mma_n16(float (&acc)[MQ][N][4], int j, const uint32_t (&a)[MQ][4],
                                                 const uint32_t (&b)[4]) {
#pragma unroll
    for (int mt = 0; mt < MQ; ++mt) {
      ptx::mma_16816<T>(acc[mt][2 * j], a[mt], b[0], b[1]);
      ptx::mma_16816<T>(acc[mt][2 * j + 1], a[mt], b[2], b[3]);
    }
  }

  // fp8 only: widen TILES ring tiles at `ring` (K then V, one-byte, linear) into 16-bit swizzled
  // tiles at `wide`. Each raw chunk (16 values) becomes the widened chunks 2c and 2c + 1 of its row.
  template <int TILES>
  static __device__ __forceinline__ void widen_kv(const char* ring, char* wide, int fmt, int tid) {
    constexpr int CHUNKS = BLOCK_N * KV_CPR;  // per tile
#pragma unroll 4
    for (int i = tid; i < TILES * CHUNKS; i += THREADS) {
      const int tile = i / CHUNKS, j = i % CHUNKS;
      const int row = j / KV_CPR, c = j % KV_CPR;
      const uint4 raw = *reinterpret_cast<const uint4*>(ring + tile * RING_TILE_BYTES + j * 16);
      const uint2 a = widen_fp8x4<T>(raw.x, fmt), b = widen_fp8x4<T>(raw.y, fmt);
      const uint2 c2 = widen_fp8x4<T>(raw.z, fmt), d = widen_fp8x4<T>(raw.w, fmt);
      char* dst = wide + tile * TILE_BYTES;
      *reinterpret_cast<uint4*>(dst + swz(row, 2 * c) * 16) = make_uint4(a.x, a.y, b.x, b.y);
      *reinterpret_cast<uint4*>(dst + swz(row, 2 * c + 1) * 16) = make_uint4(c2.x, c2.y, d.x, d.y);
    }
  }

  // sin/cos of a large angle: Cody-Waite reduction to [-pi, pi] (two-constant 2*pi, exact
  // enough for |x| up to ~1e6), then the hardware approximations, which are accurate there
  // (~1e-6 absolute). Plain __sincosf degrades with |x|; sincosf's slow path costs ~4x.
  static __device__ __forceinline__ void fast_sincos(float x, float& sn, float& cs) {
    const float k = rintf(x * 0.15915494309189535f);
    float r = fmaf(-k, 6.28318548202514648f, x);
    r = fmaf(-k, -1.7484556e-07f, r);
    __sincosf(r, &sn, &cs);
  }

  // ROPE_LLAMA (rotate-half) of ROWS rows of a swizzled tile, in place: element j < D/2 pairs
  // with j + D/2, angle = pos(row) * 2^(-2j/D * log2 theta) / rope_scale, in fp32.
  template <int ROWS, typename PosFn>
  static __device__ __forceinline__ void rope_rotate(T* tile, const PrefillParams& p, int tid, PosFn pos_of) {
    constexpr int HALF = CPR / 2;
    for (int item = tid; item < ROWS * HALF; item += THREADS) {
      const int row = item / HALF, c = item % HALF;
      uint4* lo_p = reinterpret_cast<uint4*>(tile + swz(row, c) * 8);
      uint4* hi_p = reinterpret_cast<uint4*>(tile + swz(row, c + HALF) * 8);
      uint4 lo = *lo_p, hi = *hi_p;
      T* l = reinterpret_cast<T*>(&lo);
      T* h = reinterpret_cast<T*>(&hi);
      const float pos = static_cast<float>(pos_of(row));
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float inv_freq = exp2f(-(2.f * (c * 8 + i) / HEAD_DIM) * p.rope_log2_theta) * p.rope_rcp_scale;
        float sn, cs;
        fast_sincos(pos * inv_freq, sn, cs);
        const float x0 = to_float(l[i]), x1 = to_float(h[i]);
        l[i] = from_float<T>(x0 * cs - x1 * sn);
        h[i] = from_float<T>(x1 * cs + x0 * sn);
      }
      *lo_p = lo;
      *hi_p = hi;
    }
  }

  static __device__ __forceinline__ void run(const PrefillParams& p, char* smem) {
    // The split-KV merge after this kernel is launched programmatically: it may start (and
    // park in wait_prior_grids) as soon as every CTA here has started, hiding its launch.
    // And when this kernel itself was launched that way, nothing is read before the kernel
    // ahead of it on the stream is done.
    ptx::allow_dependents();
    ptx::wait_prior_grids();
    static_assert(BLOCK_M % (THREADS / CPR) == 0 && BLOCK_N % (THREADS / CPR) == 0, "tile rows vs threads");
    T* sQ = reinterpret_cast<T*>(smem);
    const uint32_t sQ_u = ptx::smem_u32(sQ);
    // KV_STAGES (K, V) ring pairs follow Q: stage i holds K at +2i and V at +2i+1 tiles.
    constexpr uint32_t KV_TILE_BYTES = RING_TILE_BYTES;
    const uint32_t sKV_u = sQ_u + BLOCK_M * HEAD_DIM * sizeof(T);
    // fp8: the widened (16-bit) K, V pair every MMA reads, after the ring.
    const uint32_t sWide_u = sKV_u + 2 * KV_STAGES * RING_TILE_BYTES;

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    // Grid (kv_head, split, row tile): the row tile varies slowest, so the block scheduler hands
    // out every head's heaviest tiles before any light one (longest-first balancing). A single
    // request without causal/window masking (every tile the same cost) runs (row tile, split,
    // kv_head) instead: the CTAs in flight then share one or two heads' K/V, which stays in L2
    // (with heads fastest, every head's K/V is live at once: 128 MB at 16K keys, hd256). Only the
    // pair kernels (hd256, the largest K/V per head) read the flag: in the others, kv_head =
    // blockIdx.x is re-read rather than kept in a register, and losing that cost hd64 ~5 %.
    const bool rows_fastest = ROWS_FASTEST && p.rows_fastest != 0;
    const int kv_head = rows_fastest ? blockIdx.z : blockIdx.x;
    const int group = p.group_size;
    // ---- the problem this CTA works on: the single request (grid z = row tile), or one work
    // item of a batch plan (request, row tile, KV chunk) ----
    int qo_len = p.qo_len, kv_len = p.kv_len, split = blockIdx.y, num_splits = p.num_splits;
    int tile_m = rows_fastest ? blockIdx.x : gridDim.z - 1 - blockIdx.z;  // heaviest first: causal rows grow down
    int64_t q_row0 = 0, kv_row0 = 0, part_base = -1;
    int page_base = 0;
    const uint8_t* mask_bits = GENERAL ? reinterpret_cast<const uint8_t*>(p.custom_mask) : nullptr;
    if (p.work_request != 0) {
      const int w = blockIdx.z;  // the plan already ordered work items longest first
      const int b = reinterpret_cast<const int32_t*>(p.work_request)[w];
      if (b < 0) return;  // padding item of a fixed-size (CUDA-graph) grid
      tile_m = reinterpret_cast<const int32_t*>(p.work_qtile)[w];
      split = reinterpret_cast<const int32_t*>(p.work_chunk)[w];
      num_splits = reinterpret_cast<const int32_t*>(p.num_chunks)[b];
      const int32_t* qo_indptr = reinterpret_cast<const int32_t*>(p.qo_indptr);
      const int32_t* kv_indptr = reinterpret_cast<const int32_t*>(p.kv_indptr);
      q_row0 = qo_indptr[b];
      qo_len = qo_indptr[b + 1] - qo_indptr[b];
      const int k0 = kv_indptr[b], k1 = kv_indptr[b + 1];
      if constexpr (PAGED) {
        page_base = k0;
        kv_len = k1 > k0 ? (k1 - k0 - 1) * p.page_size + reinterpret_cast<const int32_t*>(p.kv_last_page_len)[b] : 0;
      } else {
        kv_row0 = k0;
        kv_len = k1 - k0;
      }
      if (num_splits > 1) part_base = reinterpret_cast<const int32_t*>(p.o_indptr)[b];
      if (GENERAL && mask_bits != nullptr) mask_bits += reinterpret_cast<const int32_t*>(p.mask_indptr)[b];
    }
    const int rows_total = qo_len * group;
    const int r0 = tile_m * BLOCK_M;
    if (r0 >= rows_total) return;  // defensive: a plan never emits such an item
    const int q_lo = r0 / group;
    const int q_hi = (min(r0 + BLOCK_M, rows_total) - 1) / group;

    const MaskRule rule{qo_len, kv_len, p.causal != 0, p.window_left, mask_bits};
    const int chunk_size =
        p.kv_chunk_size_dev != 0 ? *reinterpret_cast<const int32_t*>(p.kv_chunk_size_dev) : p.kv_chunk_size;
    const int split_lo = split * chunk_size;
    const int split_hi = min(split_lo + chunk_size, kv_len);
    const int kv_lo = max(rule.kv_begin(q_lo), split_lo);
    const int kv_hi = min(rule.kv_end(q_hi), split_hi);
    // Tiles start on the BLOCK_N grid (split boundaries are on it too), so a tile never
    // straddles two splits; keys before kv_lo lie outside every row's window, so the mask
    // predicate removes them.
    const int tile_start = kv_lo / BLOCK_N * BLOCK_N;
    const int num_tiles = kv_hi > kv_lo ? (kv_hi - tile_start + BLOCK_N - 1) / BLOCK_N : 0;

    // ---- Q tile: each row gathers its own (q_idx, head) ----
    {
      const T* q = reinterpret_cast<const T*>(p.q);
      const int chunk = tid % CPR;
      constexpr int ROW_STEP = THREADS / CPR;
      int2* row_map = reinterpret_cast<int2*>(smem + ROW_MAP_OFFSET);
#pragma unroll 4
      for (int row = tid / CPR; row < BLOCK_M; row += ROW_STEP) {
        const int r = r0 + row;
        const bool valid = r < rows_total;
        const int rr = valid ? r : 0;
        const int qi = rr / group, h = kv_head * group + rr % group;
        ptx::cp_async_16(sQ_u + swz(row, chunk) * 16, q + (q_row0 + qi) * p.q_stride_n + h * p.q_stride_h + chunk * 8,
                         valid);
        if (ROW_MAP && chunk == 0) row_map[row] = make_int2(qi, h);  // read after the tile loop's last barrier
      }
    }
    // Row addresses are recomputed from the (constant-bank) params at each load rather than
    // kept live across the loop: registers are the scarce resource here. Paged KV looks up the
    // page of every row (page_shift: power-of-two page sizes avoid the division).
    int first_page = 0;
    bool ids_in_smem = false;
    const int32_t* s_pages = reinterpret_cast<const int32_t*>(smem + KV_SMEM_BYTES);
    if constexpr (PAGED) {
      if (num_tiles > 0) {
        const int load_end = min(kv_len, tile_start + num_tiles * BLOCK_N);  // rows any tile loads
        first_page = tile_start / p.page_size;
        const int n_ids = (load_end - 1) / p.page_size - first_page + 1;
        ids_in_smem = n_ids <= MAX_PAGE_IDS;
        if (ids_in_smem) {
          const int32_t* pages = reinterpret_cast<const int32_t*>(p.kv_page_indices) + page_base + first_page;
          for (int i = tid; i < n_ids; i += THREADS) reinterpret_cast<int32_t*>(smem + KV_SMEM_BYTES)[i] = pages[i];
          __syncthreads();
        }
      }
    }
    // Paged KV: byte offset of request row t from the head's base. The fast path (page ids
    // staged in shared memory, power-of-two page size, a page's rows within 4 GiB) is a shift,
    // a mask, one LDS and unsigned 32x64 / 32x32 multiplies; the general path divides and may
    // read the page table from global memory. The choice is uniform per CTA, so each compiles
    // to its own straight-line loop. Rows past kv_len are clamped to the last row (a valid
    // address) and zero-filled by cp.async, so no row needs a branch.
    const bool page_fast =
        PAGED && ids_in_smem && p.page_shift >= 0 &&
        (uint64_t)p.page_size * (uint64_t)max(p.k_stride_n, p.v_stride_n) * sizeof(KV) < (1ull << 32);
    auto page_off = [&](int t, int64_t stride_page, int64_t stride_n, bool fast) -> uint64_t {
      if (fast) {
        const uint32_t id = s_pages[(t >> p.page_shift) - first_page];
        const uint32_t slot = t & (p.page_size - 1);
        return (uint64_t)id * (uint64_t)(stride_page * (int64_t)sizeof(KV)) +
               slot * (uint32_t)(stride_n * (int64_t)sizeof(KV));
      }
      const int pg = t / p.page_size, slot = t - pg * p.page_size;
      const int id =
          ids_in_smem ? s_pages[pg - first_page] : reinterpret_cast<const int32_t*>(p.kv_page_indices)[page_base + pg];
      return ((int64_t)id * stride_page + (int64_t)slot * stride_n) * (int64_t)sizeof(KV);
    };
    auto at = [](const KV* base, uint64_t byte_off) {
      return reinterpret_cast<const KV*>(reinterpret_cast<const char*>(base) + byte_off);
    };
    constexpr int KV_ROW_STEP = THREADS / KV_CPR;
    // Paged KV: a page lookup per row; contiguous KV: load_rows (a byte pointer stepped per row).
    auto load_kv = [&](const KV* src, int64_t stride_page, int64_t stride_n, int n0, uint32_t s_tile) {
      const int chunk = tid % KV_CPR, row0 = tid / KV_CPR;
      const KV* base = src + chunk * KV_EPC;
      if constexpr (PAGED) {
        auto rows = [&](bool fast) {
#pragma unroll
          for (int i = 0; i < BLOCK_N / KV_ROW_STEP; ++i) {
            const int row = row0 + i * KV_ROW_STEP, t = n0 + row;
            const uint64_t off = page_off(min(t, kv_len - 1), stride_page, stride_n, fast);
            ptx::cp_async_16(s_tile + ring_off(row, chunk), at(base, off), t < kv_len);
          }
        };
        if (page_fast) {
          rows(true);
        } else {
          rows(false);
        }
      } else {
        load_rows(s_tile, reinterpret_cast<const char*>(base + (kv_row0 + n0 + tid / KV_CPR) * stride_n),
                  stride_n * (int64_t)(KV_ROW_STEP * sizeof(KV)), src, kv_len - n0, tid);
      }
    };
    auto load_k = [&](int n0, int stage) {
      load_kv(reinterpret_cast<const KV*>(p.k) + kv_head * p.k_stride_h, p.k_stride_page, p.k_stride_n, n0,
              sKV_u + 2 * stage * KV_TILE_BYTES);
    };
    auto load_v = [&](int n0, int stage) {
      load_kv(reinterpret_cast<const KV*>(p.v) + kv_head * p.v_stride_h, p.v_stride_page, p.v_stride_n, n0,
              sKV_u + (2 * stage + 1) * KV_TILE_BYTES);
    };
    // K and V of one tile. Paged caches whose K and V share strides (one 5-D tensor, or twin
    // tensors) resolve each row's page once for both: the per-row page arithmetic, not the
    // bytes, is what separates paged from ragged speed.
    const bool kv_twin = PAGED && p.k_stride_page == p.v_stride_page && p.k_stride_n == p.v_stride_n;
    auto load_both = [&](int n0, int stage) {
      if constexpr (PAGED) {
        if (kv_twin) {
          const int chunk = tid % KV_CPR, row0 = tid / KV_CPR;
          const KV* kb = reinterpret_cast<const KV*>(p.k) + kv_head * p.k_stride_h + chunk * KV_EPC;
          const KV* vb = reinterpret_cast<const KV*>(p.v) + kv_head * p.v_stride_h + chunk * KV_EPC;
          const uint32_t sk = sKV_u + 2 * stage * KV_TILE_BYTES, sv = sk + KV_TILE_BYTES;
          auto rows = [&](bool fast) {
#pragma unroll
            for (int i = 0; i < BLOCK_N / KV_ROW_STEP; ++i) {
              const int row = row0 + i * KV_ROW_STEP, t = n0 + row;
              const uint64_t off = page_off(min(t, kv_len - 1), p.k_stride_page, p.k_stride_n, fast);
              const uint32_t so = ring_off(row, chunk);
              ptx::cp_async_16(sk + so, at(kb, off), t < kv_len);
              ptx::cp_async_16(sv + so, at(vb, off), t < kv_len);
            }
          };
          if (page_fast) {
            rows(true);
          } else {
            rows(false);
          }
          return;
        }
      }
      load_k(n0, stage);
      load_v(n0, stage);
    };
    // Prologue. KV_STAGES == 1: group 0 = Q + K(0); V(j) streams during Q K(j)^T and K(j+1)
    // during P V(j) (FA2's interleave, two barriers a tile). KV_STAGES >= 2: a ring of K/V
    // stages; group j = tile j (Q rides with tile 0), issued KV_STAGES - 1 tiles ahead, so a
    // load has whole tiles of math to land in and each tile costs one barrier.
    if (num_tiles > 0) {
      if constexpr (KV_STAGES > 1) {
        load_both(tile_start, 0);
      } else {
        load_k(tile_start, 0);
      }
    }
    ptx::cp_async_commit();
#pragma unroll
    for (int st = 1; st < KV_STAGES - 1; ++st) {
      if (st < num_tiles) {
        load_both(tile_start + st * BLOCK_N, st);
      }
      ptx::cp_async_commit();
    }

    // PAIR: `half` picks this warp's keys of each tile (S) and its head dims (O); 0 otherwise.
    const int half = PAIR ? warp % 2 : 0;
    const int warp_row0 = (PAIR ? warp / 2 : warp) * MQ * 16;
    const int col0 = half * (BLOCK_N / 2);   // first key column of this warp's S
    const int dcol0 = half * (HEAD_DIM / 2);  // first head dim of this warp's O
    const int partner = warp ^ 1;
    const int pair_bar = 1 + warp / 2;  // named barrier of the pair (0 is __syncthreads)
    float4* xch_max = reinterpret_cast<float4*>(smem + XCH_OFFSET);
    uint4* xch_p = reinterpret_cast<uint4*>(smem + XCH_P_OFFSET);

    float o[MQ][O_DT][4];
    float m[MQ][2], l[MQ][2];
#pragma unroll
    for (int mt = 0; mt < MQ; ++mt) {
#pragma unroll
      for (int d = 0; d < O_DT; ++d) o[mt][d][0] = o[mt][d][1] = o[mt][d][2] = o[mt][d][3] = 0.f;
      m[mt][0] = m[mt][1] = -INFINITY;
      l[mt][0] = l[mt][1] = 0.f;
    }
    uint32_t qf[Q_IN_REGS ? MQ : 1][Q_IN_REGS ? KSTEPS : 1][4];
    const float scale = p.sm_scale_log2;
    // GENERAL: score transforms that leave logits in log2 units, so softmax then uses scale 1.
    const LogitTransform xf = GENERAL ? LogitTransform::make(p) : LogitTransform{};
    const float scale_eff = xf.kind == LogitTransform::kPlain ? scale : 1.f;
    float alibi_slope[GENERAL ? MQ : 1][2];
    int alibi_q[GENERAL ? MQ : 1][2];
    if constexpr (GENERAL) {
#pragma unroll
      for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int r = min(r0 + warp_row0 + mt * 16 + lane / 4 + hf * 8, rows_total - 1);
          alibi_q[mt][hf] = r / group;
          alibi_slope[mt][hf] = xf.kind == LogitTransform::kAlibi
                                    ? reinterpret_cast<const float*>(p.alibi_slopes)[kv_head * group + r % group] * kLog2e
                                    : 0.f;
        }
    }

    // ldmatrix lane addresses. Every fragment row has row % 8 == lane % 8, and the XOR swizzle
    // only touches the low 3 bits of the chunk index, so chunk 8*h + c (c < 8) lands at
    // 8*h + (c ^ lane % 8): four per-lane offsets per operand (c = 2*j + lane bit) plus
    // compile-time immediates cover every fragment. Spelled out, ptxas keeps 12 registers
    // instead of materialising one address per fragment.
    constexpr int ROW_BYTES = HEAD_DIM * (int)sizeof(T);
    uint32_t q_off[4], k_off[4], v_off[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = lane % 8;
      q_off[j] = (warp_row0 + lane % 16) * ROW_BYTES + 16 * ((2 * j + lane / 16) ^ r);
      // PAIR: K rows start at this warp's keys, V columns at its head dims (a multiple of 8
      // chunks, which the swizzle leaves alone).
      k_off[j] = (col0 + (lane / 16) * 8 + r) * ROW_BYTES + 16 * ((2 * j + (lane / 8) % 2) ^ r);
      v_off[j] = (((lane / 8) % 2) * 8 + r) * ROW_BYTES + 16 * ((2 * j + lane / 16) ^ r) + dcol0 * (int)sizeof(T);
    }

    for (int it = 0; it < num_tiles; ++it) {
      const int n0 = tile_start + it * BLOCK_N;
      const int stage = KV_STAGES > 1 ? it % KV_STAGES : 0;
      const uint32_t sK_u = KV_FP8 ? sWide_u : sKV_u + 2 * stage * KV_TILE_BYTES;
      const uint32_t sV_u = SPLIT_WIDEN ? sK_u : sK_u + TILE_BYTES;
      if constexpr (KV_STAGES == 1) {
        ptx::cp_async_wait<0>();
        __syncthreads();  // K(it) landed; every warp is done reading V(it-1)
        load_v(n0, 0);
        ptx::cp_async_commit();
      } else {
        ptx::cp_async_wait<(KV_STAGES > 1 ? KV_STAGES - 2 : 0)>();
        // Tile it landed, and every warp is done with tile it-1, whose stage is refilled now.
        __syncthreads();
        const int ahead = it + KV_STAGES - 1;
        if (ahead < num_tiles) {
          load_both(tile_start + ahead * BLOCK_N, ahead % KV_STAGES);
        }
        ptx::cp_async_commit();
      }
      if constexpr (KV_FP8) {
        // The barrier above also retired every read of the widened pair (tile it-1).
        widen_kv<SPLIT_WIDEN ? 1 : 2>(smem + (sKV_u - sQ_u) + 2 * stage * KV_TILE_BYTES, smem + (sWide_u - sQ_u),
                                      p.kv_fp8, tid);
        __syncthreads();
      }

      if constexpr (GENERAL) {
        if (p.rope) {
          // Rotate in shared memory right after the tiles land (Q once, K every tile), then
          // make the rotated values visible before any ldmatrix reads them.
          if (it == 0)
            rope_rotate<BLOCK_M>(sQ, p, tid, [&](int row) { return (r0 + row) / group + kv_len - qo_len; });
          rope_rotate<BLOCK_N>(reinterpret_cast<T*>(smem + (sK_u - sQ_u)), p, tid, [&](int row) { return n0 + row; });
          __syncthreads();
        }
      }
      if constexpr (Q_IN_REGS) {
        if (it == 0) {
#pragma unroll
          for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks)
              ptx::ldmatrix_x4(qf[mt][ks], sQ_u + q_off[ks % 4] + mt * 16 * ROW_BYTES + (ks / 4) * 128);
        }
      }

      // ---- S = Q K^T ----
      float s[MQ][S_NT][4];
#pragma unroll
      for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
        for (int nt = 0; nt < S_NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
        uint32_t a[MQ][4];
#pragma unroll
        for (int mt = 0; mt < MQ; ++mt) {
          if constexpr (Q_IN_REGS) {
#pragma unroll
            for (int i = 0; i < 4; ++i) a[mt][i] = qf[mt][ks][i];
          } else {
            ptx::ldmatrix_x4(a[mt], sQ_u + q_off[ks % 4] + mt * 16 * ROW_BYTES + (ks / 4) * 128);
          }
        }
#pragma unroll
        for (int np = 0; np < S_NT / 2; ++np) {
          uint32_t b[4];
          ptx::ldmatrix_x4(b, sK_u + k_off[ks % 4] + np * 16 * ROW_BYTES + (ks / 4) * 128);
          mma_n16(s, np, a, b);
        }
      }

      if constexpr (GENERAL) {
        if (xf.kind != LogitTransform::kPlain) {
#pragma unroll
          for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
            for (int nt = 0; nt < S_NT; ++nt)
#pragma unroll
              for (int e = 0; e < 4; ++e)
                s[mt][nt][e] = xf.apply(s[mt][nt][e], alibi_slope[mt][e >> 1],
                                        n0 + col0 + nt * 8 + (lane % 4) * 2 + (e & 1) - alibi_q[mt][e >> 1]);
        }
      }

      // ---- mask: only tiles that are not fully kept pay for the per-element predicate ----
      if (!rule.template keeps_all<ROW_RANGE_MASK>(q_lo, q_hi, n0, n0 + BLOCK_N - 1)) {
#pragma unroll
        for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            // Query index of the C-fragment row this thread holds (only masked tiles need it).
            const int qi = (r0 + warp_row0 + mt * 16 + lane / 4 + hf * 8) / group;
            // ROW_RANGE_MASK: the row's key range relative to this thread's first column.
            int lo = 0, hi = 0;
            if constexpr (ROW_RANGE_MASK) {
              rule.row_range(qi, lo, hi);
              const int cbase = n0 + col0 + (lane % 4) * 2;
              lo -= cbase;
              hi -= cbase;
            }
            if (GENERAL && rule.bits != nullptr) {
              // keep() for the row's 64 keys as one word (custom bits AND structural range), shifted
              // so that this thread's element (nt, e) is bit 8 nt + e: a constant position.
              static_assert(BLOCK_N <= 64, "row_keep_bits covers 64 keys");
              const uint64_t w = rule.row_keep_bits(qi, n0) >> (col0 + (lane % 4) * 2);
              const uint32_t w_lo = (uint32_t)w, w_hi = (uint32_t)(w >> 32);
#pragma unroll
              for (int nt = 0; nt < S_NT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  const uint32_t word = nt < 4 ? w_lo : w_hi;
                  if (!((word >> ((nt % 4) * 8 + e)) & 1u)) s[mt][nt][2 * hf + e] = -INFINITY;
                }
            } else {
#pragma unroll
              for (int nt = 0; nt < S_NT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  if constexpr (ROW_RANGE_MASK) {
                    if (nt * 8 + e < lo || nt * 8 + e >= hi) s[mt][nt][2 * hf + e] = -INFINITY;
                  } else {
                    const int kv = n0 + col0 + nt * 8 + (lane % 4) * 2 + e;
                    if (ROW_END_MASK && rule.window_left < 0) {  // no window: only the row's end (kv >= 0)
                      if (kv >= rule.row_end(qi)) s[mt][nt][2 * hf + e] = -INFINITY;
                    } else if (!rule.keep(qi, kv)) {
                      s[mt][nt][2 * hf + e] = -INFINITY;
                    }
                  }
                }
            }
          }
      }

      // ---- online softmax, base 2 ----
      uint32_t pp[MQ][S_NT][2];
      float corr[MQ][2];
      bool moved = false;  // did any row max of this thread move (corr != 1)?
      auto row_max = [&](int mt, int hf) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < S_NT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        return fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      };
      // PAIR: a warp's row max covers its own keys; both warps of the pair take the larger of
      // the two (fmaxf is symmetric, so they agree bit for bit and their halves of O match).
      float pair_mx[4] = {0.f, 0.f, 0.f, 0.f};
      if constexpr (PAIR) {
#pragma unroll
        for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) pair_mx[2 * mt + hf] = row_max(mt, hf);
        xch_max[warp * 32 + lane] = make_float4(pair_mx[0], pair_mx[1], pair_mx[2], pair_mx[3]);
        ptx::bar_sync(pair_bar, 64);
        const float4 x = xch_max[partner * 32 + lane];
        pair_mx[0] = fmaxf(pair_mx[0], x.x);
        pair_mx[1] = fmaxf(pair_mx[1], x.y);
        pair_mx[2] = fmaxf(pair_mx[2], x.z);
        pair_mx[3] = fmaxf(pair_mx[3], x.w);
      }
#pragma unroll
      for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const float mx = PAIR ? pair_mx[2 * mt + hf] : row_max(mt, hf);
          float m_new = fmaxf(m[mt][hf], mx * scale_eff);
          // LAZY_RESCALE also keeps a stale row max until the true one exceeds it by more than
          // RESCALE_SLACK (log2 units): P = exp2(s - m) then stays <= 2^RESCALE_SLACK, and the
          // result is exact all the same, since l is summed against the same max and O / l
          // cancels it. A row's max rarely jumps that far after its first tile, so most tiles
          // skip the O rescale even on short rows (~10-20 tiles), where a strict max still moves
          // on most tiles. (-inf - -inf is NaN: a row that saw only masked keys keeps -inf.)
          if (LAZY_RESCALE && m_new - m[mt][hf] <= RESCALE_SLACK) m_new = m[mt][hf];
          // A row that has seen only masked keys keeps m = -inf; use 0 so exp2 gives 0, not NaN.
          const float m_use = m_new == -INFINITY ? 0.f : m_new;
          corr[mt][hf] = ptx::exp2_approx(m[mt][hf] - m_use);  // exactly 1 when the max held
          moved |= corr[mt][hf] != 1.f;
          m[mt][hf] = m_new;
          float rs = 0.f;
#pragma unroll
          for (int nt = 0; nt < S_NT; ++nt) {
            s[mt][nt][2 * hf] = ptx::exp2_approx(fmaf(s[mt][nt][2 * hf], scale_eff, -m_use));
            s[mt][nt][2 * hf + 1] = ptx::exp2_approx(fmaf(s[mt][nt][2 * hf + 1], scale_eff, -m_use));
            rs += s[mt][nt][2 * hf] + s[mt][nt][2 * hf + 1];
          }
          l[mt][hf] = l[mt][hf] * corr[mt][hf] + rs;
          // Round P to 16 bits now: the packed copy is all P V needs, so the fp32 S registers
          // die here instead of living through the P V loop.
#pragma unroll
          for (int nt = 0; nt < S_NT; ++nt) pp[mt][nt][hf] = Pack2<T>::from(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]);
          if constexpr (!LAZY_RESCALE) {
#pragma unroll
            for (int d = 0; d < O_DT; ++d) {
              o[mt][d][2 * hf] *= corr[mt][hf];
              o[mt][d][2 * hf + 1] *= corr[mt][hf];
            }
          }
        }
      // LAZY_RESCALE: rescale O only when some row max of the warp moved; past the first few
      // tiles of a long row it rarely does, and the multiplies (one per O register) are ~10 % of
      // a tile's issue. Whether the vote and branch pay off depends on the register allocation
      // they lead to, so the variant table decides per shape.
      if (LAZY_RESCALE && __any_sync(0xffffffff, moved)) {
#pragma unroll
        for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
          for (int d = 0; d < O_DT; ++d) {
            o[mt][d][0] *= corr[mt][0];
            o[mt][d][1] *= corr[mt][0];
            o[mt][d][2] *= corr[mt][1];
            o[mt][d][3] *= corr[mt][1];
          }
      }

      // PAIR: hand this warp's P to its partner (same lane, same rows, the other keys), so both
      // can run P V over the whole tile for their own head dims. The pair meets only when the
      // partner's half of P V starts (the own half hides the wait), and the partner's P never
      // lives next to this warp's own. The slot is rewritten next tile only after the tile's
      // __syncthreads, which the partner reaches after reading it.
      auto ppw = [&](uint32_t(&a)[MQ][S_NT][2], int k) -> uint32_t& { return a[k / (2 * S_NT)][(k / 2) % S_NT][k % 2]; };
      uint32_t pq[MQ][S_NT][2];
      if constexpr (PAIR) {
#pragma unroll
        for (int i = 0; i < XCH_P_WORDS / 4; ++i)
          xch_p[(warp * (XCH_P_WORDS / 4) + i) * 32 + lane] =
              make_uint4(ppw(pp, 4 * i), ppw(pp, 4 * i + 1), ppw(pp, 4 * i + 2), ppw(pp, 4 * i + 3));
      }

      if constexpr (KV_STAGES == 1) {
        ptx::cp_async_wait<0>();
        __syncthreads();  // V(it) landed; every warp is done reading K(it)
        if (it + 1 < num_tiles) load_k(n0 + BLOCK_N, 0);
        ptx::cp_async_commit();
      }
      if constexpr (SPLIT_WIDEN) {
        __syncthreads();  // every warp is done reading the widened K
        widen_kv<1>(smem + (sKV_u - sQ_u) + (2 * stage + 1) * KV_TILE_BYTES, smem + (sWide_u - sQ_u), p.kv_fp8, tid);
        __syncthreads();
      }

      // ---- O += P V (PAIR: this warp's keys with its own P, then the partner's) ----
      constexpr int HALVES = PAIR ? 2 : 1;
#pragma unroll
      for (int hv = 0; hv < HALVES; ++hv) {
        const uint32_t sVh = PAIR ? sV_u + (hv == 0 ? col0 : BLOCK_N / 2 - col0) * ROW_BYTES : sV_u;
        if (PAIR && hv == 1) {
          ptx::bar_sync(pair_bar, 64);
#pragma unroll
          for (int i = 0; i < XCH_P_WORDS / 4; ++i) {
            const uint4 x = xch_p[(partner * (XCH_P_WORDS / 4) + i) * 32 + lane];
            ppw(pq, 4 * i) = x.x;
            ppw(pq, 4 * i + 1) = x.y;
            ppw(pq, 4 * i + 2) = x.z;
            ppw(pq, 4 * i + 3) = x.w;
          }
        }
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / HALVES / 16; ++kk) {
          uint32_t a[MQ][4];
#pragma unroll
          for (int mt = 0; mt < MQ; ++mt) {
            const uint32_t(&src)[S_NT][2] = hv == 0 ? pp[mt] : pq[mt];
            a[mt][0] = src[2 * kk][0];
            a[mt][1] = src[2 * kk][1];
            a[mt][2] = src[2 * kk + 1][0];
            a[mt][3] = src[2 * kk + 1][1];
          }
#pragma unroll
          for (int dp = 0; dp < O_DT / 2; ++dp) {
            uint32_t b[4];
            ptx::ldmatrix_x4_trans(b, sVh + v_off[dp % 4] + kk * 16 * ROW_BYTES + (dp / 4) * 128);
            mma_n16(o, dp, a, b);
          }
        }
      }
    }
    ptx::cp_async_wait<0>();
    __syncthreads();  // with zero tiles, other threads' Q copies may still target this warp's rows

    // ---- epilogue ----
    if constexpr (PAIR) {
      // Each warp summed P over its own keys: add the partner's (same lane, same rows) before
      // the quad reduction, in an order-free way so both warps hold the same row sums.
      xch_max[warp * 32 + lane] = make_float4(l[0][0], l[0][1], l[MQ - 1][0], l[MQ - 1][1]);
      ptx::bar_sync(pair_bar, 64);
      const float4 x = xch_max[partner * 32 + lane];
      l[0][0] += x.x;
      l[0][1] += x.y;
      if (MQ > 1) {
        l[MQ - 1][0] += x.z;
        l[MQ - 1][1] += x.w;
      }
    }
    float lse_v[MQ][2];
#pragma unroll
    for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float sum = l[mt][hf];
        sum += __shfl_xor_sync(0xffffffff, sum, 1);
        sum += __shfl_xor_sync(0xffffffff, sum, 2);
        const float inv = sum > 0.f ? p.v_scale / sum : 0.f;  // fully masked row: o = 0
        lse_v[mt][hf] = sum > 0.f ? m[mt][hf] + __log2f(sum) : -INFINITY;
#pragma unroll
        for (int d = 0; d < O_DT; ++d) {
          o[mt][d][2 * hf] *= inv;
          o[mt][d][2 * hf + 1] *= inv;
        }
      }

    const int Hq = p.num_qo_heads;
    // Packed row of this CTA -> (token, q head): the Q gather's row map, or (paged) divided out.
    const int2* row_map = reinterpret_cast<const int2*>(smem + ROW_MAP_OFFSET);
    auto token_head = [&](int row) {
      const int r = r0 + row;
      return ROW_MAP ? row_map[row] : make_int2(r / group, kv_head * group + r % group);
    };
    if (num_splits == 1) {
      // Stage this warp's rows through its own slice of sQ (no other warp touches it; PAIR: the
      // pair's two warps write disjoint chunks), then write 16-byte chunks so the global stores
      // are coalesced along each row.
      __syncwarp();
#pragma unroll
      for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int row = warp_row0 + mt * 16 + lane / 4 + hf * 8;
#pragma unroll
          for (int d = 0; d < O_DT; ++d) {
            const uint32_t v = Pack2<T>::from(o[mt][d][2 * hf], o[mt][d][2 * hf + 1]);
            *reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(sQ) + swz(row, dcol0 / 8 + d) * 16 + (lane % 4) * 4) =
                v;
          }
        }
      __syncwarp();
      T* out = reinterpret_cast<T*>(p.o);
      for (int i = lane; i < MQ * 16 * O_DT; i += 32) {
        const int row = warp_row0 + i / O_DT, chunk = dcol0 / 8 + i % O_DT;
        if (r0 + row < rows_total) {
          const int2 th = token_head(row);
          *reinterpret_cast<uint4*>(out + (q_row0 + th.x) * p.o_stride_n + th.y * p.o_stride_h + chunk * 8) =
              *reinterpret_cast<const uint4*>(reinterpret_cast<char*>(sQ) + swz(row, chunk) * 16);
        }
      }
      if (p.lse != 0 && lane % 4 == 0 && half == 0) {
        float* lse = reinterpret_cast<float*>(p.lse);
#pragma unroll
        for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int row = warp_row0 + mt * 16 + lane / 4 + hf * 8;
            if (r0 + row < rows_total) {
              const int2 th = token_head(row);
              lse[(q_row0 + th.x) * Hq + th.y] = lse_v[mt][hf] * p.lse_scale;
            }
          }
      }
    } else {
      // Split KV: normalised fp32 partials plus their base-2 LSE; the merge kernel combines.
      float* op = reinterpret_cast<float*>(p.o_partial);
      float* lp = reinterpret_cast<float*>(p.lse_partial);
#pragma unroll
      for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int row = warp_row0 + mt * 16 + lane / 4 + hf * 8;
          if (r0 + row >= rows_total) continue;
          const int2 th = token_head(row);
          // Partial row: single request [split][qo_len]; batch plan token-major, chunk fastest.
          const int64_t prow = part_base >= 0 ? part_base + (int64_t)th.x * num_splits + split
                                              : (int64_t)split * qo_len + th.x;
          const int64_t idx = prow * Hq + th.y;
#pragma unroll
          for (int d = 0; d < O_DT; ++d)
            *reinterpret_cast<float2*>(op + idx * HEAD_DIM + dcol0 + d * 8 + (lane % 4) * 2) =
                make_float2(o[mt][d][2 * hf], o[mt][d][2 * hf + 1]);
          if (lane % 4 == 0 && half == 0) lp[idx] = lse_v[mt][hf];
        }
    }
  }
};

}  // namespace pfa

// One extern "C" entry per variant: a stable name for the manifest and cuLibraryGetKernel.
// SMEM is the dynamic shared memory the host launches with (variants.py's smem_bytes) and ROWSF
// the manifest's rows_fastest: both checked against the kernel at compile time, so the two sides
// can never drift apart.
#define PFA_DEFINE_PREFILL_SM80(NAME, T, KV, HD, NW, MQ, BN, QREGS, STAGES, MINB, GENERAL, PAGED, LAZY, PAIR, SMEM, \
                                ROWSF)                                                                       \
  static_assert(pfa::PrefillSm80<T, KV, HD, NW, MQ, BN, QREGS, STAGES, GENERAL, PAGED, LAZY, PAIR>::SMEM_BYTES == (SMEM), \
                #NAME ": variants.py smem_bytes differs from the kernel's shared-memory layout");             \
  static_assert(pfa::PrefillSm80<T, KV, HD, NW, MQ, BN, QREGS, STAGES, GENERAL, PAGED, LAZY, PAIR>::ROWS_FASTEST == (ROWSF), \
                #NAME ": the manifest's rows_fastest differs from what the kernel honours");                  \
  extern "C" __global__ void __launch_bounds__(NW * 32, MINB)                                                \
      NAME(const __grid_constant__ pfa::PrefillParams p) {                                                    \
    extern __shared__ __align__(128) char smem[];                                                             \
    pfa::PrefillSm80<T, KV, HD, NW, MQ, BN, QREGS, STAGES, GENERAL, PAGED, LAZY, PAIR>::run(p, smem);               \
  }
