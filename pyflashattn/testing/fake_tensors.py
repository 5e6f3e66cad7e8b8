"""Hand-built DLPack producers for CPU tests: any shape, strides, dtype and device (CUDA too)
without a GPU or a framework. The data pointer is never dereferenced by the code under test
before a launch, so validation paths can be exercised on a machine with no GPU.
"""
import ctypes

from pyflashattn._runtime import dlpack as _dlpack, dtypes as _dtypes

c_int64 = ctypes.c_int64


class _Capsule:
    """Legacy or versioned capsule over ctypes memory (kept alive by this object)."""

    def __init__(self, kind, data, shape, strides, dtype, device, offset=0):
        n = len(shape)
        self.shape_arr = (c_int64 * max(n, 1))(*shape)
        self.strides_arr = (c_int64 * max(n, 1))(*strides)
        if kind == "versioned":
            self.mt = _dlpack.DLManagedTensorVersioned()
            self.mt.version.major = 1
            name = b"dltensor_versioned"
        else:
            self.mt = _dlpack.DLManagedTensor()
            name = b"dltensor"
        t = self.mt.dl_tensor
        t.data, t.byte_offset, t.ndim = data, offset, n
        t.device.device_type, t.device.device_id = device
        t.dtype.code, t.dtype.bits, t.dtype.lanes = dtype.dlpack if isinstance(dtype, _dtypes.DType) else dtype
        t.shape = ctypes.cast(self.shape_arr, ctypes.POINTER(c_int64))
        t.strides = ctypes.cast(self.strides_arr, ctypes.POINTER(c_int64))
        self.name = ctypes.create_string_buffer(name)
        self.capsule = _dlpack._capsule_new(ctypes.addressof(self.mt), ctypes.addressof(self.name), None)


class FakeProducer:
    """A CUDA DLPack producer that records how __dlpack__ was called."""

    kind = "versioned"
    accepts_max_version = True

    def __init__(self, shape=(4, 8), strides=(8, 1), dtype=_dtypes.FLOAT16, data=0x100000, offset=0,
                 device=(2, 0)):
        self.args = (shape, strides, dtype, data, offset, device)
        self.calls = []
        self.caps = []

    def __dlpack_device__(self):
        return self.args[5]

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if max_version is not None and not self.accepts_max_version:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        self.calls.append({"stream": stream, "max_version": max_version})
        shape, strides, dtype, data, offset, device = self.args
        c = _Capsule(self.kind, data, shape, strides, dtype, device, offset)
        self.caps.append(c)  # keep the memory alive as long as the producer
        return c.capsule




def compact_strides(shape) -> tuple:
    """Row-major (C-contiguous) strides of `shape`, in elements."""
    out, acc = [], 1
    for n in reversed(shape):
        out.insert(0, acc)
        acc *= n
    return tuple(out)


def fake_cuda_tensor(shape, dtype, strides=None, device=(2, 0), data=0x100000) -> FakeProducer:
    """A fake CUDA tensor at an arbitrary address (never dereferenced: pointers only);
    contiguous unless strides are given."""
    strides = compact_strides(shape) if strides is None else strides
    return FakeProducer(shape=tuple(shape), strides=tuple(strides), dtype=dtype, data=data, device=device)
