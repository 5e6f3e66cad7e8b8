"""FlashInfer's ``FP4Tensor`` (``flashinfer.utils.FP4Tensor``): an NVFP4 tensor as two arrays of the
caller's framework, the form ``trtllm_batch_context_with_kv_cache(out_dtype="nvfp4")`` returns and
takes as ``out``.

* ``data``: uint8 ``[..., D/2]``, two e2m1 codes a byte, the even (first) element in the low nibble
  (code table 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign).
* ``scale``: float8_e4m3fn ``[round_up(rows, 128), round_up(H * D / 16, 4)]``, one scale per 16
  consecutive elements of a row, in the 128x4 swizzle: scale ``(r, c)`` at byte
  ``((r // 128) * (C / 4) + c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4``
  (``scale_offset``). Frameworks without a float8 dtype (CuPy) hold the scale bits as uint8.
* ``scale_start_index``: the scale row of ``data``'s first row, so that two calls (prefill and
  decode) can fill one scale tensor.
* ``original_shape``: the unpacked shape (``data``'s with the last dim doubled).

Decoding: ``value = e2m1(code) * e4m3(scale) / o_sf_scale``, where ``o_sf_scale`` is the
encode-side global scale the producing call was given (``pyflashattn.testing.nvfp4`` has numpy
helpers that unpack, unswizzle and dequantise).
"""
from __future__ import annotations

import math

from ._runtime import dtypes as _dtypes, tensor as _tensor

__all__ = ["FP4Tensor", "scale_offset", "scale_shape"]

SF_VEC = 16  # elements per block scale
SF_ROWS, SF_COLS = 128, 4  # the swizzle's atom: 128 rows x 4 scales
_SCALE_DTYPES = (_dtypes.FLOAT8_E4M3, _dtypes.UINT8)


def scale_shape(rows: int, cols: int) -> tuple:
    """Shape of the swizzled scale tensor for ``rows`` rows of ``cols`` elements (cols = H * D)."""
    return (-(-rows // SF_ROWS) * SF_ROWS, -(-(cols // SF_VEC) // SF_COLS) * SF_COLS)


def scale_offset(r, c, cols: int):
    """Byte offset of block scale (row r, column c) in a swizzled scale tensor of ``cols`` columns
    (a multiple of 4); r and c may be numpy arrays."""
    return ((r // 128) * (cols // 4) + c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4


class FP4Tensor:
    """NVFP4 data and its swizzled block scales (see the module docstring). The arrays stay the
    caller's (any DLPack framework); the constructor checks them as FlashInfer's does."""

    def __init__(self, data, scale, scale_start_index: int = 0, original_shape=None):
        dv, sv = _tensor.view(data, "data"), _tensor.view(scale, "scale")
        if dv.dtype is not _dtypes.UINT8:
            raise ValueError(f"data must be a uint8 tensor, got {dv.dtype.name}")
        if sv.dtype not in _SCALE_DTYPES:
            raise ValueError(f"scale must be a float8_e4m3fn tensor (or its uint8 bits), got {sv.dtype.name}")
        if sv.ndim != 2 or sv.shape[0] % SF_ROWS:
            raise ValueError(f"scale must be 2-D with a multiple of {SF_ROWS} rows, got shape {sv.shape}")
        if isinstance(scale_start_index, bool) or not isinstance(scale_start_index, int) or \
                not 0 <= scale_start_index < sv.shape[0]:
            raise ValueError(f"scale_start_index must be an int in [0, scale.shape[0] = {sv.shape[0]}), got "
                             f"{scale_start_index!r}")
        rows = dv.shape[0] if dv.ndim else 1
        if scale_start_index + rows > sv.shape[0]:
            raise ValueError(f"scale_start_index + data.shape[0] ({scale_start_index} + {rows}) exceeds "
                             f"scale.shape[0] ({sv.shape[0]})")
        if original_shape is not None:
            original_shape = tuple(int(s) for s in original_shape)
            if dv.shape[:-1] != original_shape[:-1] or dv.shape[-1] != math.ceil(original_shape[-1] / 2):
                raise ValueError(f"data's shape {dv.shape} does not hold original_shape {original_shape} (the same "
                                 "dims, the last one halved, rounded up)")
        self.data = data
        self.scale = scale
        self.scale_start_index = scale_start_index
        self.original_shape = original_shape
        self.dtype = "nvfp4"

    def __repr__(self) -> str:
        return (f"FP4Tensor(original_shape={self.original_shape}, scale_start_index={self.scale_start_index}, "
                f"data={type(self.data).__name__}, scale={type(self.scale).__name__})")
