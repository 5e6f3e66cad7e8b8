// mma.sync fragment layout of the sm80 prefill: which rows and columns a thread holds, the
// per-thread accumulators, and the ldmatrix lane addresses. Shared by the mainloop and the
// epilogue; nothing outside sm80/ depends on it.
//
// m16n8k16 C fragment (S and O): lane holds rows lane / 4 and lane / 4 + 8 (hf = 0, 1) of each
// m16 row tile, columns 2 * (lane % 4) + {0, 1} of each n8 tile: element [mt][n][2 * hf + e].
// Four lanes (a quad) share a row. The C fragment of S is exactly the A fragment layout of
// P V, so P stays in registers.
#pragma once
#include <math.h>
#include <stdint.h>

#include "pfa/ptx/mma_sm80.cuh"

namespace pfa {

// This thread's place in the CTA: its warp, and (PAIR) the pair geometry.
template <class Cfg>
struct WarpRoleSm80 {
  int lane, warp;
  // PAIR: `half` picks this warp's keys of each tile (S) and its head dims (O); 0 otherwise.
  int half;
  int warp_row0;    // first packed row (within the CTA tile) of this warp's MQ row tiles
  int col0;         // first key column of this warp's S
  int dcol0;        // first head dim of this warp's O
  int partner;      // PAIR: the other warp of the pair
  int pair_bar;     // PAIR: named barrier of the pair (0 is __syncthreads)
  float4* xch_max;  // PAIR exchange slots: row maxes, then row sums
  uint4* xch_p;     // PAIR exchange slots: P words

  __device__ __forceinline__ WarpRoleSm80(int lane_, int warp_, char* smem) : lane(lane_), warp(warp_) {
    half = Cfg::PAIR ? warp % 2 : 0;
    warp_row0 = (Cfg::PAIR ? warp / 2 : warp) * Cfg::MQ * Cfg::MMA_M;
    col0 = half * (Cfg::BLOCK_N / 2);
    dcol0 = half * (Cfg::HEAD_DIM / 2);
    partner = warp ^ 1;
    pair_bar = 1 + warp / 2;
    xch_max = reinterpret_cast<float4*>(smem + Cfg::XCH_OFFSET);
    xch_p = reinterpret_cast<uint4*>(smem + Cfg::XCH_P_OFFSET);
  }
};

// Per-thread accumulators: the O fragments, and the online-softmax state of the thread's rows
// (m: running max in log2 units; l: this thread's share of the row sum). Plain arrays, each its
// own variable, rather than one struct: the compiler then orders the loop-carried registers
// the same way for every shape.
template <class Cfg>
struct AccumSm80 {
  using O = float[Cfg::MQ][Cfg::O_DT][4];
  using Rows = float[Cfg::MQ][2];

  static __device__ __forceinline__ void init(O& o, Rows& m, Rows& l) {
#pragma unroll
    for (int mt = 0; mt < Cfg::MQ; ++mt) {
#pragma unroll
      for (int d = 0; d < Cfg::O_DT; ++d) o[mt][d][0] = o[mt][d][1] = o[mt][d][2] = o[mt][d][3] = 0.f;
      m[mt][0] = m[mt][1] = -INFINITY;
      l[mt][0] = l[mt][1] = 0.f;
    }
  }
};

// ldmatrix lane addresses. Every fragment row has row % 8 == lane % 8, and the XOR swizzle only
// touches the low 3 bits of the chunk index, so chunk 8*h + c (c < 8) lands at 8*h + (c ^ lane % 8):
// four per-lane offsets per operand (c = 2*j + lane bit) plus compile-time immediates cover every
// fragment. Spelled out, ptxas keeps 12 registers instead of materialising one address per fragment.
template <class Cfg>
struct LdsmOffsetsSm80 {
  uint32_t q[4], k[4], v[4];

  __device__ __forceinline__ LdsmOffsetsSm80(const WarpRoleSm80<Cfg>& wr) {
    constexpr int ROW_BYTES = Cfg::ROW_BYTES, CB = Cfg::CHUNK_BYTES;
    const int lane = wr.lane;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = lane % 8;
      q[j] = (wr.warp_row0 + lane % 16) * ROW_BYTES + CB * ((2 * j + lane / 16) ^ r);
      // PAIR: K rows start at this warp's keys, V columns at its head dims (a multiple of 8
      // chunks, which the swizzle leaves alone).
      k[j] = (wr.col0 + (lane / 16) * 8 + r) * ROW_BYTES + CB * ((2 * j + (lane / 8) % 2) ^ r);
      v[j] = (((lane / 8) % 2) * 8 + r) * ROW_BYTES + CB * ((2 * j + lane / 16) ^ r) + wr.dcol0 * (int)sizeof(typename Cfg::Elem);
    }
  }
};

// acc[mt][2j], acc[mt][2j+1] += a[mt] x (the two n8 halves of one ldmatrix.x4), every row tile:
// the inner step of both S = Q K^T and O += P V.
template <class Cfg, int N>
__device__ __forceinline__ void mma_n16(float (&acc)[Cfg::MQ][N][4], int j, const uint32_t (&a)[Cfg::MQ][4],
                                        const uint32_t (&b)[4]) {
#pragma unroll
  for (int mt = 0; mt < Cfg::MQ; ++mt) {
    ptx::mma_16816<typename Cfg::Elem>(acc[mt][2 * j], a[mt], b[0], b[1]);
    ptx::mma_16816<typename Cfg::Elem>(acc[mt][2 * j + 1], a[mt], b[2], b[3]);
  }
}

}  // namespace pfa
