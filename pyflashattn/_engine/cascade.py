"""The cascade merge's engine: operand checks and launches of the ``pfa_cascade_<dtype>`` kernels
(kernel_src/include/pfa/misc/cascade.cuh) for pyflashattn.cascade.

Three shapes of one kernel (CascadeMergeParams): a pair of states from two tensors (merge_state),
the same written over the first state (merge_state_in_place, optionally per row by a mask), and
N states stacked in one tensor (merge_states). Every check runs before the driver is touched;
errors name the argument. Values may be strided (last dim contiguous); the kernel moves 16 bytes
at a time when every value pointer, stride and head_dim allows, else one element at a time.
"""
from __future__ import annotations

import ctypes
import math

from .._runtime import cuda as _cuda, dtypes as _dtypes, registry as _registry, tensor as _tensor
from . import operands, options

WARPS = 4  # CascadeMerge::WARPS: (row, head) pairs per block
VALUE_DTYPES = {_dtypes.FLOAT16: "f16", _dtypes.BFLOAT16: "bf16", _dtypes.FLOAT32: "f32"}  # variants.CASCADE_DTYPES
FRAMEWORKS = ("torch", "cupy", "jax", "xla")  # xla: pyflashattn.jax's views of XLA buffers
_INT32_MAX = 2**31 - 1
_CHUNK_BYTES = 16  # the kernel's vector access


# ---------------------------------------------------------------- entry points
# Each is its checks (check_*: the views and the LSE scales, every error before the driver is
# touched) and its launch (launch_*: into given output views on a given stream). pyflashattn.jax
# runs the checks at trace time on views without addresses and the launches inside XLA's callback
# on its buffers; the eager functions here run both.

def merge_pair(v_a, s_a, v_b, s_b, lse_base):
    """(v, s) = the merge of states a and b; outputs in v_a's framework, on its current stream."""
    va, sa, vb, sb, scales = check_pair(v_a, s_a, v_b, s_b, lse_base)
    dev = va.device_id
    _cuda.ensure_context(dev)
    stream = _tensor.current_stream(va.framework, dev)
    va, sa, vb, sb = _handshake({"v_a": va, "s_a": sa, "v_b": vb, "s_b": sb}, stream)
    v, vo = _tensor.empty(va, va.shape, va.dtype, stream)
    s, so = _tensor.empty(va, va.shape[:2], _dtypes.FLOAT32, stream)
    launch_pair(va, sa, vb, sb, vo, so, scales, stream)
    return _tensor.finalize(v), _tensor.finalize(s)


def merge_pair_in_place(v, s, v_other, s_other, mask, lse_base) -> None:
    """(v, s) <- the merge of (v, s) and (v_other, s_other), on rows whose mask is nonzero."""
    views, scales = check_pair_in_place(v, s, v_other, s_other, mask, lse_base)
    vv = views["v"]
    dev = vv.device_id
    _cuda.ensure_context(dev)
    stream = _tensor.current_stream(vv.framework, dev)
    vv, sv, ov, so, mv = _handshake(views, stream)
    launch_pair_in_place(vv, sv, ov, so, mv, scales, stream)


def merge_stacked(v, s, lse_base):
    """(v, s) = the merge of the N states stacked in v [seq, N, H, D], s [seq, N, H]."""
    vv, sv, scales = check_stacked(v, s, lse_base)
    seq, _, heads, head_dim = vv.shape
    dev = vv.device_id
    _cuda.ensure_context(dev)
    stream = _tensor.current_stream(vv.framework, dev)
    vv, sv = _handshake({"v": vv, "s": sv}, stream)
    out, vo = _tensor.empty(vv, (seq, heads, head_dim), vv.dtype, stream)
    lse, so = _tensor.empty(vv, (seq, heads), _dtypes.FLOAT32, stream)
    launch_stacked(vv, sv, vo, so, scales, stream)
    return _tensor.finalize(out), _tensor.finalize(lse)


# ---------------------------------------------------------------- the entry points' checks

def check_pair(v_a, s_a, v_b, s_b, lse_base):
    """merge_state's checks: (v_a, s_a, v_b, s_b) as views, and the LSE scales."""
    scales = lse_scales(lse_base)
    va, sa = _values(v_a, "v_a", 3, "[seq, num_heads, head_dim]"), _cuda_view(s_a, "s_a")
    vb, sb = _values(v_b, "v_b", 3, "[seq, num_heads, head_dim]"), _cuda_view(s_b, "s_b")
    _tensor.check_same_device({"v_a": va, "s_a": sa, "v_b": vb, "s_b": sb})
    _same_values(vb, "v_b", va, "v_a")
    seq, heads, _ = va.shape
    for name, t in (("s_a", sa), ("s_b", sb)):
        _lse(t, name, (seq, heads), "(seq, num_heads) of v_a")
    check_sizes(va.shape, 2)
    _check_frameworks({"v_a": va, "s_a": sa, "v_b": vb, "s_b": sb})
    return va, sa, vb, sb, scales


def check_pair_in_place(v, s, v_other, s_other, mask, lse_base):
    """merge_state_in_place's checks: the views by name (v, s, v_other, s_other, mask: None
    without one) and the LSE scales."""
    scales = lse_scales(lse_base)
    vv = _values(v, "v", 3, "[seq, num_heads, head_dim]")
    sv = _cuda_view(s, "s")
    for name, t in (("v", vv), ("s", sv)):
        if t.framework == "jax":
            raise TypeError(f"{name} is a JAX array, and JAX arrays are immutable: merge_state_in_place cannot "
                            "update it; use merge_state(v_a, s_a, v_b, s_b), which returns the merged (v, s)")
    if sv.dtype is not _dtypes.FLOAT32:
        raise TypeError(f"s must be float32, got {sv.dtype.name}: merge_state_in_place writes the merged LSE into "
                        "s itself (FlashInfer merges into a float32 copy of a non-float32 s and loses the update)")
    for name, t in (("v", vv), ("s", sv)):
        if any(st == 0 and n > 1 for n, st in zip(t.shape, t.strides)):
            raise ValueError(f"{name} is written in place, so its elements must not overlap; got shape {t.shape} "
                             f"with strides {t.strides} (a broadcast view?)")
    ov, so = _values(v_other, "v_other", 3, "[seq, num_heads, head_dim]"), _cuda_view(s_other, "s_other")
    mv = _cuda_view(mask, "mask") if mask is not None else None
    views = {"v": vv, "s": sv, "v_other": ov, "s_other": so, "mask": mv}
    _tensor.check_same_device(views)
    _same_values(ov, "v_other", vv, "v")
    seq, heads, _ = vv.shape
    for name, t in (("s", sv), ("s_other", so)):
        _lse(t, name, (seq, heads), "(seq, num_heads) of v")
    if mv is not None:
        _mask(mv, seq)
    check_sizes(vv.shape, 2)
    _check_frameworks(views)
    return views, scales


def check_stacked(v, s, lse_base):
    """merge_states' checks: (v, s) as views, and the LSE scales."""
    scales = lse_scales(lse_base)
    vv, sv = _values(v, "v", 4, "[seq, num_states, num_heads, head_dim]"), _cuda_view(s, "s")
    _tensor.check_same_device({"v": vv, "s": sv})
    seq, n, heads, head_dim = vv.shape
    _lse(sv, "s", (seq, n, heads), "(seq, num_states, num_heads) of v")
    check_sizes((seq, heads, head_dim), n)
    _check_frameworks({"v": vv, "s": sv})
    return vv, sv, scales


# ---------------------------------------------------------------- the entry points' launches
# la: the launcher to fill (pyflashattn.jax: one of its own, made by new_launcher at trace time);
# None: this thread's cached one. Nothing is launched for an empty output.

def launch_pair(va, sa, vb, sb, vo, so, scales: tuple, stream: int, la=None) -> None:
    """merge_state into vo [seq, H, D] / so [seq, H] on stream."""
    seq, heads = vo.shape[:2]
    if seq * heads:
        la = _launcher(va.dtype, va.device_id, la)
        _fill_inputs(la.params, va, sa, vb, sb)
        _fill_outputs(la.params, vo, so, scales, (va, vb, vo))
        _launch(la, seq, heads, stream)


def launch_pair_in_place(vv, sv, ov, so, mv, scales: tuple, stream: int, la=None) -> None:
    """merge_state_in_place into (vv, sv), on the rows mv (None: all) marks, on stream."""
    seq, heads = vv.shape[:2]
    if seq * heads:
        la = _launcher(vv.dtype, vv.device_id, la)
        p = la.params
        _fill_inputs(p, vv, sv, ov, so)
        _fill_outputs(p, vv, sv, scales, (vv, ov))
        if mv is not None:
            p.mask, p.mask_stride = mv.ptr, mv.strides[0]
        _launch(la, seq, heads, stream)


def launch_stacked(vv, sv, vo, so, scales: tuple, stream: int, la=None) -> None:
    """merge_states of vv [seq, N, H, D] / sv [seq, N, H] into vo [seq, H, D] / so [seq, H] on stream."""
    seq, n, heads, _ = vv.shape
    if seq * heads:
        la = _launcher(vv.dtype, vv.device_id, la)
        p = la.params
        p.v_a, p.s_a, p.num_states = vv.ptr, sv.ptr, n  # stacked mode: v_b = 0
        p.v_a_stride_n, p.v_a_stride_s, p.v_a_stride_h = vv.strides[:3]
        p.s_a_stride_n, p.s_a_stride_s, p.s_a_stride_h = sv.strides
        _fill_outputs(p, vo, so, scales, (vv, vo))
        _launch(la, seq, heads, stream)


def new_launcher(dtype, dev: int):
    """A launcher of the kernel for this value dtype with its own params struct (not the thread's
    cached one), for a caller that launches from other threads (XLA's) under its own lock."""
    return _registry.new_launcher("cascade", dev, dtype=VALUE_DTYPES[dtype])


# ---------------------------------------------------------------- check helpers

def lse_scales(lse_base) -> tuple[float, float]:
    """(LSE units -> base 2, base 2 -> LSE units) for lse_base "log2" (FlashInfer's) or "ln"."""
    if not isinstance(lse_base, str) or lse_base not in options.LSE_BASES:
        raise ValueError(f"lse_base must be 'log2' or 'ln', got {lse_base!r}")
    return (1.0, 1.0) if lse_base == "log2" else (1.0 / math.log(2.0), math.log(2.0))


def _cuda_view(x, name: str):
    v = _tensor.view(x, name)
    operands.require_cuda(v, name)  # "v_a is on the CPU; pyflashattn needs CUDA tensors"
    return v


def _values(x, name: str, ndim: int, layout: str):
    v = _cuda_view(x, name)
    operands.require_ndim(v, name, ndim, layout)
    operands.require_dtype(v, name, tuple(VALUE_DTYPES))  # float16, bfloat16 or float32
    operands.require_last_dim_contiguous(v, name, "head_dim")
    return v


def _same_values(v, name: str, ref, ref_name: str) -> None:
    if v.dtype is not ref.dtype:
        raise TypeError(f"{name} has dtype {v.dtype.name} but {ref_name} has {ref.dtype.name}; "
                        "the states must have one dtype")
    if v.shape != ref.shape:
        raise ValueError(f"{name} must have {ref_name}'s shape {ref.shape}, got {v.shape}")


def _lse(v, name: str, shape: tuple, what: str) -> None:
    operands.require_dtype(v, name, (_dtypes.FLOAT32,), " (an LSE)")
    operands.require_shape(v, name, shape, f", the {what}")


def _mask(v, seq: int) -> None:
    operands.require_dtype(v, "mask", (_dtypes.BOOL, _dtypes.UINT8))
    operands.require_shape(v, "mask", (seq,), ", one entry per row of v")


def check_sizes(out_shape: tuple, num_states: int) -> None:
    """The kernel's int32 fields and its 1-D grid (one warp per (row, head)); head_dim >= 1 (an
    empty value row has no address, and a pair merge tells its second state by v_b's)."""
    if out_shape[2] < 1:
        raise ValueError(f"head_dim (the values' last dim) must be >= 1, got {out_shape[2]}")
    for what, n in zip(("seq", "num_heads", "head_dim"), out_shape):
        if n > _INT32_MAX:
            raise ValueError(f"{what} = {n} exceeds {_INT32_MAX}")
    if num_states > _INT32_MAX:
        raise ValueError(f"num_states = {num_states} exceeds {_INT32_MAX}")
    if -(-out_shape[0] * out_shape[1] // WARPS) > _INT32_MAX:
        raise ValueError(f"seq * num_heads = {out_shape[0] * out_shape[1]} exceeds what one launch covers "
                         f"({_INT32_MAX * WARPS})")


def _check_frameworks(views: dict) -> None:
    """Last check before the driver is touched (CPU tests' fake producers stop here)."""
    for name, v in views.items():
        if v is not None and v.framework not in FRAMEWORKS:
            raise TypeError(f"{name}: CUDA arrays of framework {v.framework!r} are not supported "
                            "(torch, CuPy or JAX)")


def _handshake(views: dict, stream: int) -> tuple:
    """The views again (in order), JAX's exported anew with the launch stream: the DLPack
    handshake makes that stream wait for JAX's pending writes. torch and CuPy inputs are read
    as they are: the launch stream is their framework's current stream."""
    return tuple(v if v is None or v.framework in ("torch", "cupy") else _tensor.view(v.obj, name, stream=stream)
                 for name, v in views.items())


# ---------------------------------------------------------------- params and launch

def _launcher(dtype, dev: int, la=None):
    """The kernel for this value dtype (la, or this thread's cached launcher), its params zeroed (a
    launcher keeps the last call's)."""
    if la is None:
        la = _registry.launcher("cascade", dev, dtype=VALUE_DTYPES[dtype])
    ctypes.memset(ctypes.addressof(la.params), 0, ctypes.sizeof(la.params))
    return la


def _fill_inputs(p, va, sa, vb, sb) -> None:
    """Pair mode: state 0 is (va, sa), state 1 (vb, sb), each at its own strides."""
    p.v_a, p.s_a, p.v_b, p.s_b, p.num_states = va.ptr, sa.ptr, vb.ptr, sb.ptr, 2
    p.v_a_stride_n, p.v_a_stride_h = va.strides[:2]
    p.v_b_stride_n, p.v_b_stride_h = vb.strides[:2]
    p.s_a_stride_n, p.s_a_stride_h = sa.strides
    p.s_b_stride_n, p.s_b_stride_h = sb.strides


def _fill_outputs(p, vo, so, scales: tuple, value_views: tuple) -> None:
    p.v_out, p.s_out = vo.ptr, so.ptr
    p.v_out_stride_n, p.v_out_stride_h = vo.strides[:2]
    p.s_out_stride_n, p.s_out_stride_h = so.strides
    p.head_dim = vo.shape[-1]
    p.vec16 = int(vec16_ok(value_views, vo.shape[-1]))
    p.lse_log2_scale, p.lse_rcp_scale = scales


def vec16_ok(value_views, head_dim: int) -> bool:
    """Whether every value row access can be 16 bytes: pointers 16-byte aligned, head_dim and the
    strides (but the last, 1) multiples of 16 / itemsize elements."""
    epc = _CHUNK_BYTES // (value_views[0].dtype.bits // 8)
    if head_dim % epc:
        return False
    return all(v.ptr % _CHUNK_BYTES == 0 and all(s % epc == 0 for s in v.strides[:-1]) for v in value_views)


def _launch(la, seq: int, heads: int, stream: int) -> None:
    la.params.seq, la.params.num_heads = seq, heads
    la.launch((-(-seq * heads // WARPS), 1, 1), stream)
