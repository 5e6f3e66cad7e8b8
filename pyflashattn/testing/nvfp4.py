"""NVFP4 (e2m1 codes with e4m3 block scales) in numpy: the reference encoding the NVFP4 KV-cache
tests and benchmarks quantise with and dequantise from.

The layout is FlashInfer's FA2 / XQA one (its flashinfer-semantics notes, section 1.17):

* codes: uint8 ``[..., D/2]``, two e2m1 values a byte, the even (first) element in the low
  nibble; a code's low 3 bits index 0, .5, 1, 1.5, 2, 3, 4, 6 and bit 3 is the sign (so 0x8 is
  -0 and every magnitude has a negative code);
* block scales: one float8_e4m3fn byte per 16 consecutive elements of a row, ``[..., D/16]``
  (linear, per token; not trtllm-gen's interleaved or swizzled layouts);
* value = e2m1(code) * e4m3(scale) * global scale, where the global scale is the caller's (the
  kernels take K's in the logit scale and V's in the output scale).

The second half covers the NVFP4 *output* (the FP4Tensor of trtllm_batch_context_with_kv_cache):
its block scales in the 128x4 swizzle, dequantisation with the encode-side global scale, and the
error bound e2m1's resolution allows.

Everything is exact float64 arithmetic: ``dequantize`` of any codes and scales is what the
kernels compute (e2m1 * e4m3 needs 5 significant bits, which fp16 and bf16 hold).
"""
from __future__ import annotations

import numpy as np

__all__ = ["BLOCK", "E2M1_VALUES", "e4m3_values", "encode_e4m3", "encode_e2m1", "quantize", "dequantize",
           "pack_codes", "unpack_codes", "random_codes", "random_scales", "swizzle_scales", "unswizzle_scales",
           "dequantize_output", "output_error_bound"]

BLOCK = 16  # elements per block scale
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E4M3_MAX = 448.0
_NAN_BITS = (0x7F, 0xFF)  # e4m3fn has no infinities; these two are NaN


def e4m3_values() -> np.ndarray:
    """float64 value of each of the 256 float8_e4m3fn bit patterns (NaN at 0x7F and 0xFF)."""
    b = np.arange(256)
    e, m = (b >> 3) & 0xF, b & 7
    mag = np.where(e == 0, m / 8.0 * 2.0**-6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    vals = np.where(b & 0x80, -mag, mag)
    vals[list(_NAN_BITS)] = np.nan
    return vals


_E4M3 = e4m3_values()
_E4M3_POS = _E4M3[:0x7F]  # the finite non-negative values, increasing with their bits


def _nearest_even(grid: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Index into the increasing grid of the value nearest to each |x| (ties: the even index,
    which is the even mantissa for e4m3's and e2m1's grids), clamped to the grid."""
    x = np.minimum(np.abs(x), grid[-1])
    hi = np.clip(np.searchsorted(grid, x), 1, len(grid) - 1)
    lo = hi - 1
    d_lo, d_hi = x - grid[lo], grid[hi] - x
    return np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)


def encode_e4m3(x) -> np.ndarray:
    """float8_e4m3fn bits (uint8) of x, rounded to nearest even, saturated at +-448."""
    x = np.asarray(x, np.float64)
    return (_nearest_even(_E4M3_POS, x) | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def encode_e2m1(x) -> np.ndarray:
    """e2m1 codes (uint8, 0..15) of x, rounded to nearest even, saturated at +-6."""
    x = np.asarray(x, np.float64)
    return (_nearest_even(E2M1_VALUES, x) | np.where(np.signbit(x), 8, 0)).astype(np.uint8)


def quantize(x, global_scale: float | None = None):
    """(codes uint8 [..., D/2], scales uint8 e4m3 bits [..., D/16], global_scale) of x [..., D]
    (D a multiple of 16): x ~= dequantize(codes, scales) * global_scale. Each block's scale is its
    largest magnitude / 6 in units of global_scale; by default global_scale = amax / (448 * 6),
    so the largest block scale is e4m3's largest value."""
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    if d % BLOCK:
        raise ValueError(f"the last dim ({d}) must be a multiple of {BLOCK}")
    if global_scale is None:
        amax = float(np.abs(x).max()) if x.size else 0.0
        global_scale = amax / (E4M3_MAX * 6) if amax > 0 else 1.0
    blocks = x.reshape(x.shape[:-1] + (d // BLOCK, BLOCK)) / global_scale
    scale_bits = encode_e4m3(np.abs(blocks).max(-1) / 6)
    scale = _E4M3[scale_bits][..., None]
    safe = np.where(scale > 0, scale, 1.0)
    codes = encode_e2m1(np.where(scale > 0, blocks / safe, 0.0)).reshape(x.shape)
    return pack_codes(codes), scale_bits, global_scale


def pack_codes(codes) -> np.ndarray:
    """uint8 [..., D/2] of e2m1 codes [..., D] (0..15): element 2i in the low nibble of byte i."""
    c = np.asarray(codes, np.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def unpack_codes(packed) -> np.ndarray:
    """e2m1 codes [..., D] (0..15) of packed bytes [..., D/2]."""
    p = np.asarray(packed, np.uint8)
    out = np.empty(p.shape[:-1] + (2 * p.shape[-1],), np.uint8)
    out[..., 0::2], out[..., 1::2] = p & 0xF, p >> 4
    return out


def dequantize(packed, scale_bits) -> np.ndarray:
    """float64 [..., D] = e2m1(code) * e4m3(scale) of packed codes [..., D/2] and their scale bits
    [..., D/16] (without the global scale): exactly what the kernels widen the cache to."""
    c = unpack_codes(packed)
    mag = E2M1_VALUES[c & 7]
    vals = np.where(c & 8, -mag, mag)
    scales = _E4M3[np.asarray(scale_bits, np.uint8)]
    return (vals.reshape(vals.shape[:-1] + (vals.shape[-1] // BLOCK, BLOCK)) * scales[..., None]).reshape(vals.shape)


def random_codes(rng: np.random.Generator, shape) -> np.ndarray:
    """Uniformly random packed code bytes (every one of the 16 codes, negative ones and -0 too)."""
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def random_scales(rng: np.random.Generator, shape, lo: float = 2.0**-4, hi: float = 1.0) -> np.ndarray:
    """Random positive e4m3 scale bits with values in [lo, hi] (default: moderate logits)."""
    cand = np.flatnonzero((_E4M3_POS >= lo) & (_E4M3_POS <= hi))
    return cand[rng.integers(0, len(cand), size=shape)].astype(np.uint8)


# ---- the NVFP4 output (FP4Tensor of trtllm_batch_context_with_kv_cache) ----------------------------
# Its block scales are per 16 elements of a (token, q head) row, held in the 128x4 swizzle of a
# [round_up(tokens, 128), round_up(H * D / 16, 4)] tensor (pyflashattn.fp4.scale_offset), and
# value = e2m1(code) * e4m3(scale) / o_sf_scale.

def swizzle_scales(linear, rows: int | None = None) -> np.ndarray:
    """The swizzled scale tensor [rows, round_up(C, 4)] (rows: a multiple of 128, default linear's
    rounded up) of linear scale bits [n, C], by the byte offsets of fp4.scale_offset; rows past n
    and columns past C hold 0."""
    from ..fp4 import scale_offset

    lin = np.asarray(linear, np.uint8)
    n, c_in = lin.shape
    rows = -(-n // 128) * 128 if rows is None else rows
    cols = -(-c_in // 4) * 4
    out = np.zeros(rows * cols, np.uint8)
    r, c = np.meshgrid(np.arange(n), np.arange(c_in), indexing="ij")
    out[scale_offset(r, c, cols)] = lin
    return out.reshape(rows, cols)


def unswizzle_scales(swizzled) -> np.ndarray:
    """Linear scale bits [R, C] of a swizzled scale tensor [R, C], by reshaping its 512-byte atoms
    ([R/128, C/4] atoms of [32 rows, 4 row groups, 4 columns]): an independent reading of the
    layout that swizzle_scales writes."""
    s = np.asarray(swizzled, np.uint8)
    R, C = s.shape
    return s.reshape(R // 128, C // 4, 32, 4, 4).transpose(0, 3, 2, 1, 4).reshape(R, C)


def dequantize_output(data, scale, start: int, o_sf_scale: float) -> np.ndarray:
    """float64 [T, H, D] of an NVFP4 output: data uint8 [T, H, D/2], scale the swizzled scale bits
    [R, C], rows start .. start + T its scales."""
    data = np.asarray(data, np.uint8)
    T, H, half = data.shape
    lin = unswizzle_scales(scale)[start:start + T, :H * half * 2 // BLOCK].reshape(T, H, -1)
    return dequantize(data, lin) / o_sf_scale


def output_error_bound(ref, scale, start: int, o_sf_scale: float) -> np.ndarray:
    """The largest error NVFP4 quantisation may leave on each element of ref [T, H, D], given the
    block scales the kernel chose (swizzled bits, from row start): half the e2m1 grid step at the
    element's magnitude in scale units (.25 below 2, .5 below 4, 1 above), plus what saturation
    at 6 cuts off, times scale / o_sf_scale."""
    ref = np.asarray(ref, np.float64)
    T, H, D = ref.shape
    sf = _E4M3[unswizzle_scales(scale)[start:start + T, :H * D // BLOCK]].reshape(T, H, D // BLOCK)
    unit = np.repeat(sf, BLOCK, axis=-1) / o_sf_scale  # value of one e2m1 unit
    y = np.abs(ref) / np.where(unit > 0, unit, np.inf)
    half_step = np.where(y < 2, 0.25, np.where(y < 4, 0.5, 1.0))
    return np.where(unit > 0, (half_step + np.maximum(y - 6, 0)) * unit, np.abs(ref))  # scale 0: codes 0
