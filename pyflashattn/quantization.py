"""Bit packing with FlashInfer's API (``flashinfer.quantization``).

    y = packbits(x, bitorder="big")                        # ceil(x.size / 8) bytes
    y, new_indptr = segment_packbits(x, indptr, "little")  # each segment from a byte boundary

``x`` is flattened row-major and nonzero counts as 1. ``bitorder="big"`` (the default, numpy's)
puts the first element in the most significant bit; ``"little"`` puts it in bit 0, which is what
attention custom masks need (FlashInfer's plan packs masks with ``bitorder="little"``; a mask
packed with the default is silently wrong).

numpy arrays (and other host data) are packed on the host with ``numpy.packbits`` and come back
as numpy. CUDA arrays of torch, CuPy or JAX (bool or uint8, contiguous) are packed by the
``packbits`` kernel on the framework's current stream (JAX: the library stream, with the DLPack
handshake both ways) and come back in the caller's framework on the same device.

``segment_packbits`` needs the segment offsets on the host to size its output: a device
``indptr`` is copied to the host, which synchronises with the device (as FlashInfer's ``.item()``
does). Pass a numpy ``indptr`` to avoid that sync. Either way the call is not CUDA-graph safe
(the output size depends on ``indptr``'s values, and the offsets are uploaded from pageable host
memory).
"""
from __future__ import annotations

import math
import sys

import numpy as np

from ._engine import packbits as _packbits
from ._runtime import cuda as _cuda, dtypes as _dtypes, tensor as _tensor
from ._runtime.dlpack import kDLCPU

__all__ = ["packbits", "segment_packbits"]

_INT32_MAX = 2**31 - 1
_DEVICE_FRAMEWORKS = ("torch", "cupy", "jax")


# ---------------------------------------------------------------- public API

def packbits(x, bitorder: str = "big"):
    """Pack the truth values of ``x`` (flattened row-major; nonzero = 1) into a 1-D uint8 array
    of ``ceil(x.size / 8)`` bytes, the last one zero-padded.

    ``bitorder``: "big" (first element -> most significant bit, numpy's default) or "little"
    (first element -> bit 0, the order attention masks use).
    """
    little = _check_bitorder(bitorder)
    xv = _device_view(x, "x")
    if xv is None:
        xb, fw, like = _host_bits(x, "x")
        return _host_result(np.packbits(xb.reshape(-1), bitorder=bitorder), fw, like)
    _check_device_input(xv, "x")
    _check_framework(xv, "x")
    n = math.prod(xv.shape)
    dev = xv.device_id
    _cuda.ensure_context(dev)
    s = _tensor.current_stream(xv.framework, dev)
    if xv.framework not in ("torch", "cupy"):
        xv = _tensor.view(x, "x", stream=s)  # JAX: the launch stream waits for JAX's pending writes
    y, yv = _tensor.empty(xv, (-(-n // 8),), _dtypes.UINT8, s)
    _packbits.launch_flat(dev, xv.ptr, yv.ptr, n, little, s)
    return _tensor.finalize(y)


def segment_packbits(x, indptr, bitorder: str = "big"):
    """Pack each segment ``x[indptr[i]:indptr[i+1]]`` separately, each starting on a byte boundary
    (its last byte zero-padded). Returns ``(y, new_indptr)`` with ``new_indptr[0] = 0`` and
    ``new_indptr[i+1] = new_indptr[i] + ceil((indptr[i+1] - indptr[i]) / 8)`` (int32).

    ``x`` is 1-D; ``indptr`` is a 1-D integer array of ``num_segments + 1`` non-decreasing element
    offsets, ``indptr[0] >= 0`` and ``indptr[-1] == x.size`` (elements before ``indptr[0]``
    belong to no segment). For a CUDA ``x``, ``indptr`` may be a numpy array (no sync) or a device
    array on ``x``'s device (copied to the host: this synchronises); ``y`` and ``new_indptr`` come
    back on the device in ``x``'s framework.
    """
    little = _check_bitorder(bitorder)
    xv = _device_view(x, "x")
    iv = _device_view(indptr, "indptr")
    if xv is None:
        if iv is not None:
            raise ValueError(f"indptr is on {_tensor.device_name(iv.device_type, iv.device_id)} but x is a "
                             "host array; pass both on the host or both on one CUDA device")
        xb, fw, like = _host_bits(x, "x")
        if xb.ndim != 1:
            raise ValueError(f"x must be 1-D, got shape {xb.shape}")
        ip = _check_indptr(_host_indptr(indptr), xb.size)
        y, new_ip = _segment_pack_host(xb, ip, bitorder)
        return _host_result(y, fw, like), _host_result(new_ip, fw, like)

    _check_device_input(xv, "x")
    if len(xv.shape) != 1:
        raise ValueError(f"x must be 1-D, got shape {xv.shape}")
    n = xv.shape[0]
    if n > _INT32_MAX:
        raise ValueError(f"x has {n} elements; segment_packbits on a device supports at most {_INT32_MAX} "
                         "(int32 offsets)")
    if iv is not None:  # a CUDA indptr (_device_view returns None for host data)
        _tensor.check_same_device({"x": xv, "indptr": iv})
        _check_framework(xv, "x")
        ip = _check_indptr(_device_indptr_to_host(indptr, iv), n)  # synchronises
    else:
        ip = _check_indptr(_host_indptr(indptr), n)
        _check_framework(xv, "x")

    num_segments = ip.size - 1
    seg_bytes = (np.diff(ip) + 7) // 8
    new_ip = np.zeros(num_segments + 1, dtype=np.int32)
    np.cumsum(seg_bytes, out=new_ip[1:])
    total = int(new_ip[-1])
    in_ip = np.ascontiguousarray(ip, dtype=np.int32)

    dev = xv.device_id
    _cuda.ensure_context(dev)
    s = _tensor.current_stream(xv.framework, dev)
    if xv.framework not in ("torch", "cupy"):
        xv = _tensor.view(x, "x", stream=s)
    y, yv = _tensor.empty(xv, (total,), _dtypes.UINT8, s)
    out_ip, out_ipv = _tensor.empty(xv, (num_segments + 1,), _dtypes.INT32, s)
    _upload(out_ipv.ptr, new_ip, s)
    if total:
        # The input offsets are scratch: the per-stream workspace is stream-ordered, so no
        # allocation and no lifetime to manage.
        d_in = _cuda.Workspace.get(dev, s, in_ip.nbytes)
        _upload(d_in, in_ip, s)
        _packbits.launch_segments(dev, xv.ptr, yv.ptr, d_in, out_ipv.ptr, n, seg_bytes, little, s)
    return _tensor.finalize(y), _tensor.finalize(out_ip)


# ---------------------------------------------------------------- helpers

def _check_bitorder(bitorder) -> int:
    if bitorder == "little":
        return 1
    if bitorder == "big":
        return 0
    raise ValueError(f"bitorder must be 'big' or 'little', got {bitorder!r}")


def _device_view(x, name: str):
    """A TensorView of a non-host DLPack array, or None for host data (numpy, lists, CPU tensors)."""
    if isinstance(x, (np.ndarray, np.generic)) or not hasattr(x, "__dlpack__"):
        return None
    dev_fn = getattr(x, "__dlpack_device__", None)
    if dev_fn is not None:
        try:
            if dev_fn()[0] == kDLCPU:
                return None
        except Exception:  # noqa: BLE001 - let view() below report a broken producer
            pass
    v = _tensor.view(x, name)
    if v.device_type == kDLCPU:
        return None
    if not v.is_cuda:
        raise ValueError(f"{name} must be a host array or a CUDA tensor, got one on "
                         f"{_tensor.device_name(v.device_type, v.device_id)}")
    return v


def _check_device_input(v, name: str) -> None:
    if v.dtype not in (_dtypes.BOOL, _dtypes.UINT8):
        raise TypeError(f"{name} must be bool or uint8 on a CUDA device, got {v.dtype.name}")
    if not _is_contiguous(v.shape, v.strides):
        raise ValueError(f"{name} must be contiguous, got shape {v.shape} with strides {v.strides}")


def _check_framework(v, name: str) -> None:
    """Last check before the driver is touched (CPU tests' fake producers stop here)."""
    if v.framework not in _DEVICE_FRAMEWORKS:
        raise TypeError(f"{name}: CUDA arrays of framework {v.framework!r} are not supported "
                        "(torch, CuPy or JAX)")


def _is_contiguous(shape, strides) -> bool:
    if 0 in shape:
        return True
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _host_bits(x, name: str):
    """(array whose nonzero entries are the 1 bits, framework, original) for host input: numpy
    packs bool and integer arrays as they are; other dtypes go through ``!= 0``."""
    fw = "numpy"
    if isinstance(x, (np.ndarray, np.generic)) or not hasattr(x, "__dlpack__"):
        a = np.asarray(x)
    else:  # a CPU tensor of another framework (e.g. torch): read it through DLPack
        fw = _tensor.framework_of(x)
        a = _read_host(x, name)
    if a.dtype != np.bool_ and a.dtype.kind not in "iu":
        a = a != 0
    return a, fw, x


def _host_result(arr: np.ndarray, fw: str, like):
    """``arr`` in the framework of a host input (numpy unless that was a CPU torch/JAX array)."""
    if fw == "torch":
        return sys.modules["torch"].from_numpy(arr)
    if fw == "jax":
        return sys.modules["jax"].numpy.asarray(arr)
    return arr


def _host_indptr(indptr) -> np.ndarray:
    if not isinstance(indptr, np.ndarray) and hasattr(indptr, "__dlpack__"):
        return _read_host(indptr, "indptr")  # a CPU tensor of another framework
    return np.asarray(indptr)


def _read_host(x, name: str) -> np.ndarray:
    """A numpy array over a CPU DLPack tensor (``__array__`` when DLPack cannot describe it)."""
    try:
        return np.from_dlpack(x)
    except Exception as e:  # noqa: BLE001 - e.g. an older numpy without DLPack bool
        if hasattr(x, "__array__"):
            try:
                return np.asarray(x)
            except Exception:  # noqa: BLE001
                pass
        raise TypeError(f"{name}: cannot read this {type(x).__name__} on the host: {e}") from None


def _device_indptr_to_host(indptr, iv) -> np.ndarray:
    """Copy a CUDA indptr to the host through its framework (this synchronises)."""
    fw = iv.framework
    if fw == "torch":
        return indptr.detach().cpu().numpy()
    if fw == "cupy":
        return sys.modules["cupy"].asnumpy(indptr)
    if fw == "jax":
        return np.asarray(indptr)
    raise TypeError(f"indptr: cannot copy a CUDA array of framework {fw!r} to the host; pass a numpy indptr")


def _check_indptr(ip: np.ndarray, n: int) -> np.ndarray:
    if ip.ndim != 1:
        raise ValueError(f"indptr must be 1-D, got shape {ip.shape}")
    if ip.size == 0:
        raise ValueError("indptr must have num_segments + 1 >= 1 entries, got an empty array")
    if ip.dtype.kind not in "iu":
        raise TypeError(f"indptr must have an integer dtype, got {ip.dtype}")
    ip = ip.astype(np.int64, copy=False)
    if ip[0] < 0:
        raise ValueError(f"indptr[0] must be >= 0, got {int(ip[0])}")
    d = np.diff(ip)
    if d.size and d.min() < 0:
        i = int(np.argmax(d < 0))
        raise ValueError(f"indptr must be non-decreasing, got indptr[{i}] = {int(ip[i])} > "
                         f"indptr[{i + 1}] = {int(ip[i + 1])}")
    if ip[-1] != n:
        raise ValueError(f"indptr[-1] must equal x.size = {n}, got {int(ip[-1])}")
    return ip


def _segment_pack_host(xb: np.ndarray, ip: np.ndarray, bitorder: str):
    """Vectorised segment packing: pad every segment to a multiple of 8 (no per-element or
    per-segment Python loop), then one numpy.packbits over the padded bits."""
    lens = np.diff(ip)
    seg_bytes = (lens + 7) // 8
    total = int(seg_bytes.sum())
    if total > _INT32_MAX:
        raise ValueError(f"segment_packbits output of {total} bytes does not fit int32 offsets")
    new_ip = np.zeros(ip.size, dtype=np.int32)
    np.cumsum(seg_bytes, out=new_ip[1:])
    body = xb[int(ip[0]):int(ip[-1])]
    pads = seg_bytes * 8 - lens
    if not pads.any():  # every segment is whole bytes: the segments are already byte-aligned
        return np.packbits(body, bitorder=bitorder), new_ip
    # keep[j] says whether padded bit j holds a real element: per segment, lens[i] Trues then
    # pads[i] (< 8) Falses. One byte per padded bit; the counts array is 2 * num_segments.
    keep = np.repeat(np.tile(np.array([True, False]), lens.size), np.stack([lens, pads], axis=1).reshape(-1))
    padded = np.zeros(total * 8, dtype=np.bool_)
    padded[keep] = body  # integer -> bool assignment: nonzero is True
    return np.packbits(padded, bitorder=bitorder), new_ip


def _upload(dst: int, arr: np.ndarray, stream: int) -> None:
    """Host -> device copy on ``stream``. From pageable memory the driver stages the data before
    returning, so ``arr`` may be freed right after."""
    if arr.nbytes:
        _cuda.check(_cuda.driver().cuMemcpyHtoDAsync(dst, arr.ctypes.data, arr.nbytes, stream),
                    "cuMemcpyHtoDAsync")

