"""Tensor maps for the sm90 kernels that load K/V by TMA (a manifest row with "tma"): the host
encodes one CUtensorMap per K and V tensor (cuTensorMapEncodeTiled) into the kernel parameters
(PrefillParams.k_tmap / v_tmap), 3-D over (head_dim, kv heads, rows) with boxes of 64 elements x
1 head x block_n rows, which land in shared memory in the kernel's swizzled column blocks.

Encoding is a driver call per tensor, so maps are cached by everything they encode (pointer,
extents, strides): a caller that reuses its K/V buffers pays it once.
"""
from __future__ import annotations

import ctypes

from .._runtime import cuda as _cuda

BOX_COLS = 64  # one 128-byte swizzle row of 16-bit elements
_CACHE: dict = {}
_CACHE_SIZE = 256


def kv_map(dtype_short: str, ptr: int, rows: int, heads: int, head_dim: int, stride_n: int, stride_h: int,
           itemsize: int, box_rows: int) -> bytes:
    """The 128-byte map of one K or V tensor: `rows` rows of `heads` heads of head_dim elements,
    strides in elements."""
    key = (dtype_short, ptr, rows, heads, head_dim, stride_n, stride_h, box_rows)
    hit = _CACHE.get(key)
    if hit is None:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.clear()
        hit = _CACHE[key] = _cuda.encode_tensor_map_3d(
            dtype_short, ptr, (head_dim, heads, rows), (stride_h * itemsize, stride_n * itemsize),
            (BOX_COLS, 1, box_rows))
    return hit


def point_kv_maps(p, meta: dict, geometry: tuple, k_ptr: int, v_ptr: int) -> None:
    """Write the K and V maps into params p (a TMA kernel's). geometry = (dtype_short, rows,
    heads, head_dim, (k stride_n, stride_h), (v stride_n, stride_h), itemsize)."""
    short, rows, heads, hd, ks, vs, item = geometry
    for field, ptr, st in (("k_tmap", k_ptr, ks), ("v_tmap", v_ptr, vs)):
        data = kv_map(short, ptr, rows, heads, hd, st[0], st[1], item, meta["block_n"])
        ctypes.memmove(ctypes.addressof(getattr(p, field)), data, len(data))
