"""The NVFP4 output of the TRT-LLM context API (FlashInfer's FP4Tensor, semantics 1.15 / 1.17):
which calls write it, its arguments checked, its arrays (the caller's FP4Tensor, or new ones in
the query's framework) and the params fields that point the kernels at them.

The kernels quantise each finished 16-element block of a row (bmm2_scale applied) with the
encode-side global scale o_sf_scale: scale = e4m3(o_sf_scale * amax / 6), codes = e2m1 of the
values times o_sf_scale / scale, rounded to nearest with ties to the even code
(kernel_src/include/pfa/attention/nvfp4_out.cuh). Split-KV rows are quantised by the merge
kernel, so the format plans like any other.

FlashInfer requires an fp8 query for this output (the paged sm90 fp8 rows write it); here the
query may be 16-bit too (an extension: the quantisation reads only the finished fp32 rows,
whatever the query's dtype).
"""
from __future__ import annotations

from .. import fp4 as _fp4
from .._runtime import dtypes as _dtypes, tensor as _tensor
from . import operands


def is_fp4_tensor(x) -> bool:
    """An FP4Tensor: pyflashattn's, FlashInfer's, or any object with its four fields."""
    return all(hasattr(x, a) for a in ("data", "scale", "scale_start_index"))


def wanted(out_dtype, out, o_sf_scale, o_sf_vec_size) -> bool:
    """Whether the call writes NVFP4 (out_dtype "nvfp4", or an FP4Tensor out with no out_dtype),
    with o_sf_scale / o_sf_vec_size checked: they describe that output only."""
    named = isinstance(out_dtype, str) and out_dtype.lower() == "nvfp4"
    fp4_out = out is not None and is_fp4_tensor(out)
    if fp4_out and out_dtype is not None and not named:
        raise ValueError(f"out is an FP4Tensor, so out_dtype must be 'nvfp4' or None, got {out_dtype!r}")
    if named and out is not None and not fp4_out:
        raise ValueError("out: out_dtype='nvfp4' writes an FP4Tensor; pass one (data uint8 [tokens, heads, "
                         "head_dim / 2] and its swizzled float8_e4m3fn scale) or None")
    if not (named or fp4_out):
        for name, value in (("o_sf_scale", o_sf_scale), ("o_sf_vec_size", o_sf_vec_size)):
            if value is not None:
                raise ValueError(f"{name} describes the NVFP4 output: pass it with out_dtype='nvfp4' only")
        return False
    if o_sf_vec_size not in (None, 16) or isinstance(o_sf_vec_size, bool):
        raise ValueError(f"o_sf_vec_size must be 16 (one scale per 16 elements) or None, got {o_sf_vec_size!r}")
    if o_sf_scale is None:
        raise ValueError("o_sf_scale is required for out_dtype='nvfp4': the global scale of the output's "
                         "block scales (scale = e4m3(o_sf_scale * amax / 6))")
    operands.scale_arg(o_sf_scale, "o_sf_scale")  # a finite number > 0
    return True


def operand(out, qv, head_dim: int, stream):
    """(data, scale, scale_start_index, data view, scale view) for a query view qv [tokens, heads,
    D]: the caller's FP4Tensor checked (written in place, from its scale_start_index), or new
    arrays in the query's framework (the scale as uint8 bits where the framework has no
    float8_e4m3fn), which result() wraps once the launch is enqueued."""
    tokens, heads = qv.shape[0], qv.shape[1]
    shape = (tokens, heads, head_dim // 2)
    sshape = _fp4.scale_shape(tokens, heads * head_dim)
    if out is None:
        data, dv = _tensor.empty(qv, shape, _dtypes.UINT8, stream)
        try:
            scale, sv = _tensor.empty(qv, sshape, _dtypes.FLOAT8_E4M3, stream)
        except TypeError:  # CuPy: no float8 dtype
            scale, sv = _tensor.empty(qv, sshape, _dtypes.UINT8, stream)
        return data, scale, 0, dv, sv
    start = out.scale_start_index
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"out.scale_start_index must be a non-negative int, got {start!r}")
    dv, sv = _tensor.view(out.data, "out.data"), _tensor.view(out.scale, "out.scale")
    dev = qv.device_id
    operands.check_out(dv, shape, _dtypes.UINT8, dev, "query", "an NVFP4 output is ")
    operands.require_device(sv, "out.scale", dev, "query")
    if sv.dtype not in (_dtypes.FLOAT8_E4M3, _dtypes.UINT8):
        raise TypeError(f"out.scale must be float8_e4m3fn (or its uint8 bits), got {sv.dtype.name}")
    cols = sshape[1]
    if sv.ndim != 2 or sv.shape[1] != cols or sv.shape[0] % _fp4.SF_ROWS:
        raise ValueError(f"out.scale must be [a multiple of {_fp4.SF_ROWS}, {cols}] (round_up(num_heads * head_dim "
                         f"/ 16, 4) columns), got shape {sv.shape}")
    if start + tokens > sv.shape[0]:
        raise ValueError(f"out.scale_start_index + tokens ({start} + {tokens}) exceeds out.scale's {sv.shape[0]} rows")
    if sv.strides != (cols, 1):
        raise ValueError(f"out.scale must be contiguous (the swizzle spans whole rows), got strides {sv.strides}")
    return out.data, out.scale, start, dv, sv


def result(data, scale, start: int, shape: tuple):
    """The FP4Tensor a call returns, its arrays handed to the caller's framework (data already was,
    by the engine's run)."""
    return _fp4.FP4Tensor(data, _tensor.finalize(scale), start, shape)


def bind(engine, out, qv, head_dim: int, o_sf_scale, stream):
    """Point a planned engine at this call's NVFP4 output: (the data array to run into, a function
    turning run()'s result, the data or (data, lse), into the FP4Tensor result)."""
    data, scale, start, _, sv = operand(out, qv, head_dim, stream)
    point(engine, sv, start, o_sf_scale)

    def finish(res):
        fp4 = result(res[0] if isinstance(res, tuple) else res, scale, start, qv.shape)
        return (fp4, res[1]) if isinstance(res, tuple) else fp4

    return data, finish


def point(engine, sv, start: int, o_sf_scale) -> None:
    """The attention (and merge) params at the block scales: the tensor, the row of token 0 and the
    global scale (the kernels take the columns as Hq * D / 16, which operand() checked)."""
    g = float(o_sf_scale)
    structs = [engine.attn.params] + ([engine.merge.params] if engine.merge is not None else [])
    for p in structs:
        p.o_sf, p.o_sf_row0, p.o_sf_scale = sv.ptr, start, g
