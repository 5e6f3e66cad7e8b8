"""DLPack, read from pure Python with ctypes.

Two ways in:

* ``read_capsule(cap)``: the capsule from ``x.__dlpack__()``, either kind (``"dltensor_versioned"``
  from torch/CuPy/numpy, legacy ``"dltensor"`` from JAX).
* ``exchange_api_for(type(x))``: the DLPack 1.3 C exchange table that torch >= 2.10 (and cuda.core's
  StridedMemoryView) publish as ``type(x).__dlpack_c_exchange_api__``; it fills a DLTensor with no
  capsule, no stream sync and no Python-level checks (about 1 us against 5-9 us for ``__dlpack__``).

The struct layouts below are the ones in dlpack.h v1.3 (cuda-core 1.2.2 ships that header as
``cuda/core/_include/dlpack.h``); ``tests/test_dlpack.py`` checks sizes and offsets. Fields are
decoded with ``string_at`` + ``struct.unpack`` because ``Structure.from_address`` chains cost
3-5x more per tensor.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from typing import NamedTuple

from .dtypes import DType, from_dlpack_code

__all__ = ["Parsed", "read_capsule", "exchange_api_for", "ExchangeAPI"]

# DLDeviceType values this library cares about.
kDLCPU = 1
kDLCUDA = 2
kDLCUDAHost = 3
kDLCUDAManaged = 13

DLPACK_FLAG_BITMASK_READ_ONLY = 1 << 0
DLPACK_FLAG_BITMASK_IS_COPIED = 1 << 1
DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED = 1 << 2

c_void_p, c_int32, c_uint8, c_uint16, c_uint32, c_uint64, c_int64 = (
    ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32,
    ctypes.c_uint64, ctypes.c_int64,
)


# ---- ctypes mirrors (used to *build* structs and to check the struct formats) -------------------
class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", DLDevice),
        ("ndim", c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(c_int64)),
        ("strides", ctypes.POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]


# Function-pointer fields are plain c_void_p: we only store addresses of our own callbacks there,
# or read them to call through a prototype of our choosing.
class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", c_void_p)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", c_void_p),
        ("deleter", c_void_p),
        ("flags", c_uint64),
        ("dl_tensor", DLTensor),
    ]


class DLPackExchangeAPIHeader(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("prev_api", c_void_p)]


class DLPackExchangeAPI(ctypes.Structure):
    _fields_ = [
        ("header", DLPackExchangeAPIHeader),
        ("managed_tensor_allocator", c_void_p),
        ("managed_tensor_from_py_object_no_sync", c_void_p),
        ("managed_tensor_to_py_object_no_sync", c_void_p),
        ("dltensor_from_py_object_no_sync", c_void_p),
        ("current_work_stream", c_void_p),
    ]


# ---- fast decoders -------------------------------------------------------------------------
# Native alignment ('@') reproduces the C layout; asserted against the mirrors at import.
_DLTENSOR = struct.Struct("@PiiiBBHPPQ")  # data, dev type, dev id, ndim, code, bits, lanes,
#                                            shape*, strides*, byte_offset
_VERSIONED = struct.Struct("@IIPPQ" + "PiiiBBHPPQ")  # version, ctx, deleter, flags, dl_tensor
_API = struct.Struct("@IIP5P")  # header {version, prev_api}, 5 function pointers
assert _DLTENSOR.size == ctypes.sizeof(DLTensor) == 48
assert _VERSIONED.size == ctypes.sizeof(DLManagedTensorVersioned) == 80
assert DLManagedTensorVersioned.dl_tensor.offset == 32
assert _API.size == ctypes.sizeof(DLPackExchangeAPI) == 56

_I64 = [struct.Struct(f"@{n}q") for n in range(9)]  # shape/stride readers for ndim <= 8


def _make_mem():
    """A read-only byte view of the whole address space, so ``unpack_from(_MEM, addr)`` decodes
    host memory with no ctypes call (0.3 us against 0.8 us for ``string_at``, which drops and
    retakes the GIL). Only the bytes unpacked are ever touched: reading through it is exactly as
    (un)safe as ``string_at`` at the same address. Falls back to a string_at-backed reader."""
    try:
        mem = memoryview((ctypes.c_char * (1 << 62)).from_address(0)).cast("B")
        probe = ctypes.c_int64(0x1122334455667788)
        if struct.unpack_from("@q", mem, ctypes.addressof(probe))[0] == probe.value:
            return mem
    except Exception:
        pass
    return None


_MEM = _make_mem()


def _unpack(st: struct.Struct, addr: int) -> tuple:
    if _MEM is not None:
        return st.unpack_from(_MEM, addr)
    return st.unpack(ctypes.string_at(addr, st.size))


def _i64s(addr: int, n: int) -> tuple[int, ...]:
    return _unpack(_I64[n] if n < 9 else struct.Struct(f"@{n}q"), addr)


def compact_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides in elements (torch's convention: a size-0 dim counts as 1)."""
    out = [1] * len(shape)
    acc = 1
    for i in range(len(shape) - 1, -1, -1):
        out[i] = acc
        acc *= max(shape[i], 1)
    return tuple(out)


class Parsed(NamedTuple):
    ptr: int  # data + byte_offset
    shape: tuple
    strides: tuple  # in elements
    dtype: DType
    device_type: int
    device_id: int
    readonly: bool


_dtype_cache: dict[tuple[int, int, int], DType] = {}


def _raw(data, dev_type, dev_id, ndim, code, bits, lanes, shape_p, strides_p, offset, flags) -> tuple:
    """Decoded DLTensor fields as a plain tuple in Parsed's order (a NamedTuple costs 0.4 us more;
    the hot path in _tensor.py unpacks the tuple straight into a TensorView)."""
    key = (code, bits, lanes)
    dtype = _dtype_cache.get(key)
    if dtype is None:
        dtype = _dtype_cache[key] = from_dlpack_code(code, bits, lanes)
    if flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED and dtype.bits < 8:
        # One sub-byte value per byte: no kernel reads that layout.
        raise TypeError(f"padded sub-byte DLPack tensors ({dtype.name}) are not supported")
    if ndim:
        shape = _i64s(shape_p, ndim)
        # NULL strides (allowed before DLPack 1.2) mean compact row-major.
        strides = _i64s(strides_p, ndim) if strides_p else compact_strides(shape)
    else:
        shape = strides = ()
    return ((data or 0) + offset, shape, strides, dtype, dev_type, dev_id,
            bool(flags & DLPACK_FLAG_BITMASK_READ_ONLY))


# ---- capsules ---------------------------------------------------------------------------------
_capsule_get_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_get_name.restype = ctypes.c_char_p
_capsule_get_name.argtypes = [ctypes.py_object]
_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = c_void_p
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [c_void_p, c_void_p, c_void_p]
_CapsuleType = type(_capsule_new(1, None, None))


def _pointer_offset() -> int | None:
    """Offset of ``void* pointer`` inside CPython's PyCapsule object (right after PyObject_HEAD,
    then name, context, destructor: so basicsize - 32 on any build). Reading it from the object
    saves the 0.5 us PyCapsule_GetPointer call; verified here, else None (use the call)."""
    try:
        off = _CapsuleType.__basicsize__ - 4 * ctypes.sizeof(c_void_p)
        probe = _capsule_new(0x5EED0, None, None)
        if _MEM is not None and struct.unpack_from("@P", _MEM, id(probe) + off)[0] == 0x5EED0:
            return off
    except Exception:
        pass
    return None


_PTR_OFF = _pointer_offset()


def capsule_name(capsule) -> bytes | None:
    """The capsule's name (None for an unnamed capsule); TypeError if it is not a capsule."""
    if type(capsule) is not _CapsuleType:
        raise TypeError(f"expected a DLPack PyCapsule, got {type(capsule).__name__}")
    return _capsule_get_name(capsule)


def _capsule_pointer(capsule, name: bytes) -> int:
    if _PTR_OFF is not None:  # name already checked by the caller
        return struct.unpack_from("@P", _MEM, id(capsule) + _PTR_OFF)[0]
    return _capsule_get_pointer(capsule, name)


def _read_raw(capsule) -> tuple:
    name = capsule_name(capsule)
    if name == b"dltensor_versioned":
        major, minor, _ctx, _deleter, flags, *t = _unpack(_VERSIONED, _capsule_pointer(capsule, name))
        # Only the major version guards the ABI (dlpack.h: fields up to `flags` stay stable).
        if major != 1:
            raise ValueError(f"unsupported DLPack ABI version {major}.{minor} (pyflashattn reads 1.x)")
        return _raw(*t, flags)
    if name == b"dltensor":
        return _raw(*_unpack(_DLTENSOR, _capsule_pointer(capsule, name)), 0)
    if name in (b"used_dltensor", b"used_dltensor_versioned"):
        raise ValueError("this DLPack capsule was already consumed (capsules are single-use)")
    raise ValueError(f"not a DLPack tensor capsule (name {name!r})")


def read_capsule(capsule) -> Parsed:
    """Decode a DLPack capsule of either kind without consuming it.

    The capsule is neither renamed nor its deleter called: the producer's capsule destructor frees
    the tensor when the capsule is garbage collected. So the *caller must keep the capsule alive*
    until every launch that reads ``ptr`` has been enqueued (TensorView keeps it in ``_keep``).
    """
    return Parsed(*_read_raw(capsule))


# ---- DLPack 1.3 C exchange API ---------------------------------------------------------------
# PYFUNCTYPE, not CFUNCTYPE: these producer functions touch Python objects and must run with the
# GIL held (with CFUNCTYPE, which drops the GIL, torch's to_py_object segfaulted). PYFUNCTYPE also
# makes ctypes raise the Python exception the producer set when it returns -1.
_FROM_PY = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, c_void_p)
_WORK_STREAM = ctypes.PYFUNCTYPE(ctypes.c_int, c_int32, c_int32, ctypes.POINTER(c_void_p))


class ExchangeAPI:
    """Callable view of one producer's ``DLPackExchangeAPI`` table."""

    __slots__ = ("version", "can_read", "_from_py", "_work_stream", "_owner", "_tls")

    def __init__(self, api_ptr: int, owner):
        (major, minor, _prev, _alloc, _mt_from, _mt_to, dlt_from, work_stream) = _unpack(_API, api_ptr)
        self.version = (major, minor)
        self._owner = owner  # the capsule; the table itself is static per the spec
        # dltensor_from_py_object_no_sync may be NULL per the spec; current_work_stream may not.
        self.can_read = bool(dlt_from)
        self._from_py = _FROM_PY(dlt_from) if dlt_from else None
        self._work_stream = _WORK_STREAM(work_stream) if work_stream else None
        # One scratch DLTensor per thread: another thread may run between the producer call and
        # our decode of the buffer.
        self._tls = threading.local()

    def read(self, obj) -> Parsed:
        return Parsed(*self.read_raw(obj))

    def read_raw(self, obj) -> tuple:
        """DLTensor view of ``obj`` (no stream sync: launch on ``current_work_stream``).

        The producer only guarantees the shape/strides arrays until control returns, so they are
        copied at once; ``ptr`` stays valid while ``obj`` is alive.
        """
        tls = self._tls
        try:
            buf = tls.buf
        except AttributeError:
            buf = tls.buf = ctypes.create_string_buffer(48)
            tls.addr = ctypes.addressof(buf)
        addr = tls.addr
        if self._from_py(obj, addr) != 0:  # -1 without an exception set: producer bug
            raise BufferError(f"DLPack exchange API could not export {type(obj).__name__}")
        return _raw(*_DLTENSOR.unpack_from(buf), 0)

    def current_work_stream(self, device_type: int, device_id: int) -> int:
        """The producer's current stream on that device as an int handle (0 = NULL/legacy)."""
        out = c_void_p()
        if self._work_stream is None or self._work_stream(device_type, device_id, ctypes.byref(out)) != 0:
            raise BufferError("DLPack exchange API has no current_work_stream")
        return out.value or 0


_API_CACHE: dict[type, ExchangeAPI | None] = {}


def exchange_api_for(tp: type) -> ExchangeAPI | None:
    """The exchange API of ``tp`` (looked up on the type, cached per type), or None.

    Anything unexpected about the attribute (not a capsule of the right name, no major-1 table in
    the ``prev_api`` chain) gives None, so callers fall back to ``__dlpack__``: correctness first.
    """
    try:
        return _API_CACHE[tp]
    except KeyError:
        pass
    api = None
    try:
        attr = getattr(tp, "__dlpack_c_exchange_api__", None)
        ptr = 0
        if type(attr) is int:  # early tvm-ffi/torch builds published the raw address
            ptr = attr
        elif attr is not None and capsule_name(attr) == b"dlpack_exchange_api":
            ptr = _capsule_get_pointer(attr, b"dlpack_exchange_api")
        # Walk to a table whose major version we understand (spec: prev_api chain).
        while ptr:
            major, _minor, prev = struct.unpack("@IIP", ctypes.string_at(ptr, 16))  # once per type
            if major == 1:
                api = ExchangeAPI(ptr, attr)
                break
            ptr = prev
    except Exception:
        api = None
    _API_CACHE[tp] = api
    return api
