// The NVFP4 output format (o_format kOutNvfp4; FlashInfer's FP4Tensor, semantics 1.17): every 16
// consecutive head-dim elements of a (token, q head) row form a block with one float8_e4m3fn
// scale, and each element becomes a 4-bit e2m1 code (two a byte, the even element in the low
// nibble). With g = o_sf_scale, the caller's encode-side global scale, and amax the block's largest
// magnitude (of the finished output, bmm2_scale applied):
//   scale = e4m3(g * (amax / 6))                     rounded to nearest even, saturated at 448
//   code  = e2m1(x * (1 / (scale * (1 / g))))        round to nearest, ties to the even code
// so x ~= e2m1(code) * scale / g. This is the order of FlashInfer's reference quantiser
// (tests/test_helpers/utils_fp4.py ref_fp4_quant) and of TRT-LLM's quantising epilogues (both
// reciprocals approximate, rcp.approx.ftz, as theirs), whose cvt.rn.satfinite.e2m1x2 sm_80 /
// sm_90 lack: e2m1_code is its software form. A zero scale writes zero codes.
// Scales sit in the 128x4 swizzle of a [rows, cols] tensor (cols = Hq * D / 16, a multiple of 4
// for every head dim built, so round_up(Hq * D / 16, 4) as FlashInfer's),
// row = o_sf_row0 + token, column = q head * D / 16 + element / 16 (sf_offset).
//
// The sm90 epilogue and the merge kernel hold a 16-element block in a quad of lanes (4k .. 4k+3),
// four elements each (quad_amax); the sm80 epilogue quantises whole blocks from shared memory.
#pragma once
#include <stdint.h>

#include "pfa/common/dtypes.cuh"
#include "pfa/ptx/math.cuh"

namespace pfa {

struct Nvfp4Out {
  static constexpr unsigned FULL = 0xffffffffu;

  // Byte offset of block scale (r, c) in the 128x4-swizzled scale tensor of `cols` columns (a
  // multiple of 4): 128-row x 4-column atoms of 512 bytes, row-major over the atoms; inside one,
  // row r sits at (r % 32) * 16 + (r % 128 / 32) * 4 and column c at c % 4.
  static __device__ __forceinline__ int64_t sf_offset(int64_t r, int c, int cols) {
    return ((r >> 7) * (cols >> 2) + (c >> 2)) * 512 + (r & 31) * 16 + ((r >> 5) & 3) * 4 + (c & 3);
  }

  // The block's largest magnitude, from this lane's four values and its quad's (every lane of
  // the warp must call: two shuffles).
  static __device__ __forceinline__ float quad_amax(float a, float b, float c, float d) {
    float m = fmaxf(fmaxf(fabsf(a), fabsf(b)), fmaxf(fabsf(c), fabsf(d)));
    m = fmaxf(m, __shfl_xor_sync(FULL, m, 1));
    return fmaxf(m, __shfl_xor_sync(FULL, m, 2));
  }

  // e4m3 of x >= 0 (round to nearest even, saturated at 448, as cvt.rn.satfinite.e4m3x2.f32): its
  // bits, and its value in *value. Integer rounding of the fp32 bits to 3 mantissa bits (normals,
  // from 2^-6) or to a multiple of 2^-9 (subnormals; 8 * 2^-9 = 2^-6 is code 8, the smallest
  // normal): a few instructions where sm_80's e4m3 conversions are long software sequences whose
  // registers the hd256 general kernel could not spare.
  static __device__ __forceinline__ uint32_t e4m3_bits(float x, float* value) {
    if (x >= 0x1.0p-6f) {
      uint32_t b = __float_as_uint(fminf(x, 448.f));
      b = (b + 0x7FFFFu + ((b >> 20) & 1u)) & 0xFFF00000u;
      *value = __uint_as_float(b);
      return ((b >> 23) - 120u) << 3 | ((b >> 20) & 7u);
    }
    const float m = rintf(x * 512.f);
    *value = m * 0x1.0p-9f;
    return (uint32_t)m;
  }

  // A block's scale: its e4m3 bits, and the multiplier taking its values to e2m1 units (0 for a
  // zero scale: the block's codes are then 0).
  struct Block {
    uint32_t sf_bits;
    float to_code;
  };
  static __device__ __forceinline__ Block block(float amax, float g) {
    float sf;
    const uint32_t bits = e4m3_bits(g * (amax * (1.f / 6.f)), &sf);
    return Block{bits, sf > 0.f ? ptx::rcp_approx(sf * ptx::rcp_approx(g)) : 0.f};
  }

  // e2m1 code of y: magnitude to the nearest of 0, .5, 1, 1.5, 2, 3, 4, 6 (ties to the even code:
  // .25 -> 0, .75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4; above 6 saturates), sign
  // in bit 3 for y < 0 (a negative value that rounds to 0 keeps its sign, -0; NaN gives 0).
  static __device__ __forceinline__ uint32_t e2m1_code(float y) {
    const float a = fabsf(y);
    const uint32_t mag = (uint32_t)(a > 0.25f) + (uint32_t)(a >= 0.75f) + (uint32_t)(a > 1.25f) +
                         (uint32_t)(a >= 1.75f) + (uint32_t)(a > 2.5f) + (uint32_t)(a >= 3.5f) + (uint32_t)(a > 5.f);
    return mag | (y < 0.f ? 8u : 0u);
  }

  // Two values of a block -> one byte of code pairs (the first in the low nibble).
  static __device__ __forceinline__ uint32_t pack2(float a, float b, float to_code) {
    return e2m1_code(a * to_code) | (e2m1_code(b * to_code) << 4);
  }

  // The scale of block (row, col) to the output's scale tensor of `cols` (Hq * D / 16) columns.
  template <class P>
  static __device__ __forceinline__ void store_scale(const P& p, int64_t row, int col, int cols, uint32_t sf_bits) {
    reinterpret_cast<uint8_t*>(p.o_sf)[sf_offset(p.o_sf_row0 + row, col, cols)] = (uint8_t)sf_bits;
  }

  // Four bytes (byte t of lane s of a quad: lane s's code pair of column tile t) -> lane q holds
  // column tile q's four code pairs, lane 0's first: the quad's bytes transposed 4 x 4 (two
  // shuffles), so each lane stores four consecutive bytes of the row.
  static __device__ __forceinline__ uint32_t quad_transpose(uint32_t x, int lane) {
    const uint32_t y = __shfl_xor_sync(FULL, x, 2);
    x = (lane & 2) ? __byte_perm(y, x, 0x7632) : __byte_perm(x, y, 0x5410);
    const uint32_t z = __shfl_xor_sync(FULL, x, 1);
    return (lane & 1) ? __byte_perm(x, z, 0x3715) : __byte_perm(x, z, 0x6240);
  }
};

}  // namespace pfa
