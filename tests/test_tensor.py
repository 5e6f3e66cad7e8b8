"""CPU tests of pyflashattn._runtime.tensor: views, framework dispatch, streams and output allocation.

torch/CuPy/JAX are not installed here, so they are impersonated by small classes whose
``__module__`` says which framework they belong to, and by fake modules in ``sys.modules``.
"""

import ctypes
import gc
import sys
import threading
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyflashattn
from pyflashattn._runtime import dlpack as _dlpack, dtypes as _dtypes
from pyflashattn._runtime.tensor import (TensorView, check_same_device, current_stream, empty, finalize,
                                 framework_of, require_cuda, stream_handle, view)

c_int64 = ctypes.c_int64


def _in_module(cls, module):
    cls.__module__ = module
    return cls


from pyflashattn.testing.fake_tensors import FakeProducer, _Capsule  # noqa: E402


FakeCupy = _in_module(type("ndarray", (FakeProducer,), {}), "cupy._core.core")
FakeJax = _in_module(type("ArrayImpl", (FakeProducer,), {"kind": "legacy"}), "jaxlib.xla_extension")
FakeOld = type("Old", (FakeProducer,), {"accepts_max_version": False})


# ---------------------------------------------------------------- torch impersonation
class _TorchDevice:
    def __init__(self, type_, index):
        self.type, self.index = type_, index


class _TorchDtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"


_in_module(_TorchDtype, "torch")
BF16 = _TorchDtype("bfloat16")


class FakeTorchTensor:
    """Only the attributes pyflashattn reads from a torch.Tensor."""

    def __init__(self, ptr=0x200000, shape=(2, 3, 4), strides=(12, 1, 3), dtype=BF16, device=("cuda", 1),
                 layout="torch.strided"):
        self._ptr, self.shape, self._strides, self.dtype = ptr, shape, strides, dtype
        self.device = _TorchDevice(*device)
        self.layout = layout
        self.dlpack_calls = 0
        self._caps = []

    def data_ptr(self):
        return self._ptr

    @property
    def is_cuda(self):
        return self.device.type == "cuda"

    @property
    def is_cpu(self):
        return self.device.type == "cpu"

    def get_device(self):
        return self.device.index if self.device.type == "cuda" else -1

    new_empty_calls = []

    def new_empty(self, shape, dtype):
        FakeTorchTensor.new_empty_calls.append((shape, dtype, self.device.index))
        n = len(shape)
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(n))
        return type(self)(ptr=0xE000, shape=tuple(shape), strides=strides, dtype=dtype,
                          device=(self.device.type, self.device.index))

    def stride(self):
        return self._strides

    def __dlpack_device__(self):
        return (2 if self.device.type == "cuda" else 1, self.device.index or 0)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.dlpack_calls += 1
        c = _Capsule("versioned", self._ptr, self.shape, self._strides, _dtypes.normalize(str(self.dtype)),
                     self.__dlpack_device__())
        self._caps.append(c)
        return c.capsule


_in_module(FakeTorchTensor, "torch")


# ---------------------------------------------------------------- framework_of
def test_framework_of():
    assert framework_of(np.zeros(2)) == "numpy"
    assert framework_of(np.ma.zeros(2)) == "numpy"
    assert framework_of([1]) == "other"
    assert framework_of(FakeProducer()) == "other"
    assert framework_of(FakeCupy()) == "cupy"
    assert framework_of(FakeJax()) == "jax"
    assert framework_of(FakeTorchTensor()) == "torch"
    Param = _in_module(type("Parameter", (FakeTorchTensor,), {}), "torch.nn.parameter")
    assert framework_of(Param()) == "torch"
    Sub = _in_module(type("MyTensor", (FakeTorchTensor,), {}), "user_code")  # subclass: base decides
    assert framework_of(Sub()) == "torch"
    assert framework_of(_in_module(type("A", (), {}), "jax._src.array")()) == "jax"
    assert framework_of(_in_module(type("A", (), {}), "torchvision.x")()) == "other"  # prefix must be exact


# ---------------------------------------------------------------- numpy through view()
@pytest.mark.parametrize("code", "?bhilqBHILQefdFD")
def test_view_numpy_every_dtype(code):
    base = np.zeros((5, 6, 7), dtype=code)
    for a in (base, base[1:, ::2, 3:], base.transpose(2, 0, 1), base[::-1, :, ::-2], base[2, 3]):
        v = view(a, "q")
        assert v.ptr == a.ctypes.data
        assert v.shape == a.shape
        assert v.strides == tuple(s // a.itemsize for s in a.strides)
        assert v.dtype.name == a.dtype.name
        assert (v.device_type, v.device_id, v.framework) == (1, 0, "numpy")
        assert v.obj is a and v._keep is not None
        assert v.ndim == a.ndim and not v.is_cuda


def test_view_numpy_strides_examples():
    a = np.zeros((4, 6), np.float32)
    assert view(a.T, "q").strides == (1, 6)
    assert view(a[:, 1::3], "q").strides == (6, 3)
    assert view(a[:, 1::3], "q").ptr == a.ctypes.data + 4
    assert view(a[::-1], "q").ptr == a.ctypes.data + 3 * 6 * 4


def test_view_numpy_zero_dim_and_empty():
    z = np.array(3.0, np.float32)
    v = view(z, "scale")
    assert (v.shape, v.strides, v.ptr, v.ndim) == ((), (), z.ctypes.data, 0)
    e = np.zeros((0, 4), np.float16)
    v = view(e, "q")
    assert v.shape == (0, 4) and v.dtype is _dtypes.FLOAT16


def test_view_numpy_readonly_and_stream_ignored():
    a = np.arange(4.0)
    a.flags.writeable = False
    v = view(a, "q", stream=1234)  # numpy rejects stream != None: it must not be passed
    assert v.readonly is True and v.ptr == a.ctypes.data


def test_view_rejects_non_dlpack_naming_the_argument():
    with pytest.raises(TypeError) as e:
        view([1, 2], "q")
    assert str(e.value) == "q must be a DLPack tensor (torch/CuPy/JAX), got list"
    with pytest.raises(TypeError, match="^paged_kv_cache must be a DLPack tensor .* got dict$"):
        view({}, "paged_kv_cache")


def test_view_unsupported_dtype_names_the_argument():
    with pytest.raises(TypeError, match="^k: unsupported DLPack dtype"):
        view(FakeProducer(dtype=(3, 64, 1)), "k")


# ---------------------------------------------------------------- generic producers and streams
def test_view_byte_offset_and_device():
    p = FakeCupy(shape=(3, 5), strides=(10, 2), dtype=_dtypes.FLOAT8_E4M3, data=0x40000, offset=96,
                 device=(2, 3))
    v = view(p, "q")
    assert (v.ptr, v.shape, v.strides, v.dtype) == (0x40000 + 96, (3, 5), (10, 2), _dtypes.FLOAT8_E4M3)
    assert (v.device_type, v.device_id, v.framework, v.is_cuda) == (2, 3, "cupy", True)
    assert v._keep is not None and _dlpack.capsule_name(v._keep) == b"dltensor_versioned"


@pytest.mark.parametrize("stream,passed", [(None, None), (0, 1), (1, 1), (2, 2), (0xBEEF, 0xBEEF)])
def test_view_passes_launch_stream(stream, passed):
    for p in (FakeCupy(), FakeJax(), FakeProducer()):
        view(p, "q", stream=stream)
        assert p.calls == [{"stream": passed, "max_version": (1, 3)}]


def test_view_cpu_producer_gets_no_stream():
    p = FakeProducer(device=(1, 0))
    view(p, "q", stream=0xBEEF)
    assert p.calls[0]["stream"] is None


def test_view_legacy_capsule_and_old_producer():
    j = FakeJax(shape=(2, 2), strides=(2, 1), dtype=_dtypes.BFLOAT16)
    v = view(j, "q", stream=77)
    assert v.framework == "jax" and v.dtype is _dtypes.BFLOAT16
    assert _dlpack.capsule_name(v._keep) == b"dltensor"
    old = FakeOld()
    v = view(old, "q", stream=5)
    assert old.calls == [{"stream": 5, "max_version": None}] and v.shape == (4, 8)


# ---------------------------------------------------------------- torch paths
def test_view_torch_attribute_path():
    t = FakeTorchTensor(ptr=0x200010, shape=(2, 3, 4), strides=(12, 1, 3), device=("cuda", 1))
    v = view(t, "q", stream=99)
    assert (v.ptr, v.shape, v.strides, v.dtype) == (0x200010, (2, 3, 4), (12, 1, 3), _dtypes.BFLOAT16)
    assert (v.device_type, v.device_id, v.framework, v._keep) == (2, 1, "torch", None)
    assert t.dlpack_calls == 0  # no capsule, no handshake for torch
    cpu = view(FakeTorchTensor(device=("cpu", None), dtype=_TorchDtype("float8_e4m3fn")), "q")
    assert (cpu.device_type, cpu.device_id, cpu.dtype) == (1, 0, _dtypes.FLOAT8_E4M3)


def test_view_torch_falls_back_to_dlpack_for_unusual_tensors():
    t = FakeTorchTensor(layout="torch.sparse_coo")
    v = view(t, "q")
    assert t.dlpack_calls == 1 and v.framework == "torch" and v._keep is not None
    t = FakeTorchTensor(device=("mps", 0))
    view(t, "q")
    assert t.dlpack_calls == 1


def test_view_torch_unknown_dtype_names_the_argument():
    with pytest.raises(TypeError, match="^v: unsupported dtype"):
        view(FakeTorchTensor(dtype=_TorchDtype("qint8")), "v")


class _ExchangeTable:
    """A DLPackExchangeAPI whose reader serves FakeTorchTensor objects (counts its calls)."""

    def __init__(self, stream_value=0x5000):
        self.reads = 0
        self.fail = False

        def from_py(obj, out):
            self.reads += 1
            if self.fail:
                return -1
            t = _dlpack.DLTensor.from_address(out)
            t.data = obj._ptr
            t.device.device_type, t.device.device_id = 2, obj.device.index
            t.ndim = len(obj.shape)
            t.dtype.code, t.dtype.bits, t.dtype.lanes = _dtypes.normalize(str(obj.dtype)).dlpack
            obj._arrs = ((c_int64 * t.ndim)(*obj.shape), (c_int64 * t.ndim)(*obj._strides))
            t.shape = ctypes.cast(obj._arrs[0], ctypes.POINTER(c_int64))
            t.strides = ctypes.cast(obj._arrs[1], ctypes.POINTER(c_int64))
            return 0

        def work_stream(dev_type, dev_id, out):
            out[0] = stream_value + dev_id
            return 0

        self.cbs = (_dlpack._FROM_PY(from_py), _dlpack._WORK_STREAM(work_stream))
        self.api = _dlpack.DLPackExchangeAPI()
        self.api.header.version.major = 1
        self.api.dltensor_from_py_object_no_sync = ctypes.cast(self.cbs[0], ctypes.c_void_p).value
        self.api.current_work_stream = ctypes.cast(self.cbs[1], ctypes.c_void_p).value
        self.name = ctypes.create_string_buffer(b"dlpack_exchange_api")
        self.capsule = _dlpack._capsule_new(ctypes.addressof(self.api), ctypes.addressof(self.name), None)


def test_view_torch_exchange_api_fallback():
    table = _ExchangeTable()
    T = _in_module(type("Tensor", (FakeTorchTensor,), {"__dlpack_c_exchange_api__": table.capsule}), "torch")
    t = T(ptr=0x300000, shape=(5, 2), strides=(1, 5), device=("cuda", 2))
    t.data_ptr = None  # prove the attribute path is not taken
    v = view(t, "q")
    assert table.reads == 1
    assert (v.ptr, v.shape, v.strides, v.dtype, v.device_id, v.framework) == (
        0x300000, (5, 2), (1, 5), _dtypes.BFLOAT16, 2, "torch")
    # ordinary tensors take the attribute reads first and never reach the table
    t2 = T(ptr=0x300100)
    assert view(t2, "q").ptr == 0x300100 and table.reads == 1


# ---------------------------------------------------------------- TensorView helpers
def _tv(device_type=2, device_id=0, shape=(2, 3), strides=(3, 1)):
    return TensorView(None, 0x1000, shape, strides, _dtypes.FLOAT16, device_type, device_id, "other")


def test_tensorview_properties():
    assert _tv().is_cuda and _tv(device_type=13).is_cuda and not _tv(device_type=1).is_cuda
    assert not _tv(device_type=3).is_cuda  # pinned host memory is not device memory
    assert _tv().ndim == 2
    assert "float16[2, 3]" in repr(_tv())


def test_require_cuda_message():
    require_cuda(_tv(), "q")
    with pytest.raises(ValueError) as e:
        require_cuda(_tv(device_type=1), "q")
    assert str(e.value) == "q is on the CPU; pyflashattn needs CUDA tensors"
    with pytest.raises(ValueError) as e:
        require_cuda(_tv(device_type=10), "k")
    assert str(e.value) == "k is on rocm:0; pyflashattn needs CUDA tensors"
    with pytest.raises(ValueError) as e:
        require_cuda(_tv(device_type=3), "v")
    assert str(e.value) == "v is in pinned host memory (cuda_host); pyflashattn needs CUDA tensors"


def test_check_same_device():
    check_same_device({"q": _tv(device_id=1), "k": _tv(device_id=1), "out": None, "lse": _tv(13, 1)})
    with pytest.raises(ValueError, match=r"^k is on cuda:0 but q is on cuda:1"):
        check_same_device({"q": _tv(device_id=1), "k": _tv(device_id=0)})
    with pytest.raises(ValueError, match=r"^v is on cpu:0 but q is on cuda:0"):
        check_same_device({"q": _tv(), "k": _tv(), "v": _tv(device_type=1)})


# ---------------------------------------------------------------- stream_handle
def test_stream_handle_variants():
    class Proto:
        def __cuda_stream__(self):
            return (0, 0xAA00)

    class OldProto:  # cuda.core < 0.2 exposed the protocol as a property
        __cuda_stream__ = (0, 0xAB00)

    class TorchStream:
        cuda_stream = 0xAC00

    class CupyStream:
        ptr = 0xAD00

    assert stream_handle(None) is None
    assert stream_handle(0) == 0 and stream_handle(0xFF) == 0xFF
    assert stream_handle(np.uint64(7)) == 7
    assert stream_handle(Proto()) == 0xAA00
    assert stream_handle(OldProto()) == 0xAB00
    assert stream_handle(TorchStream()) == 0xAC00
    assert stream_handle(CupyStream()) == 0xAD00


def test_stream_handle_cuda_bindings_stream():
    driver = pytest.importorskip("cuda.bindings.driver")
    assert stream_handle(driver.CUstream(0x1234)) == 0x1234


@pytest.mark.parametrize("bad", [True, "0", 1.0, object(), [1]])
def test_stream_handle_rejects_naming_stream(bad):
    with pytest.raises(TypeError, match="^stream must be"):
        stream_handle(bad)


def test_stream_handle_negative():
    with pytest.raises(ValueError, match="stream"):
        stream_handle(-1)


# ---------------------------------------------------------------- fake framework modules
class FakeCuda:
    """Stands in for pyflashattn._runtime.cuda (no GPU here): records every call."""

    def __init__(self):
        self.log = []
        self.freed = []
        self.next_ptr = 0xD0000000

    def ensure_context(self, dev, force=False):
        self.log.append(("ctx", dev, "forced") if force else ("ctx", dev))

    def library_stream(self, dev):
        return 0x7700 + dev

    def mem_alloc_async(self, nbytes, stream):
        self.log.append(("alloc", nbytes, stream))
        p, self.next_ptr = self.next_ptr, self.next_ptr + 0x10000
        return p

    def mem_free(self, ptr):
        self.freed.append(ptr)

    def mem_free_async(self, ptr, stream):  # stream-ordered after the launch that wrote it
        assert stream == 0x1200, "an output is freed on its launch stream"
        self.freed.append(ptr)

    def stream_wait(self, waiting, on):
        self.log.append(("wait", waiting, on))


@pytest.fixture
def fake_cuda(monkeypatch):
    fc = FakeCuda()
    monkeypatch.setattr(pyflashattn._runtime, "cuda", fc, raising=False)
    monkeypatch.setitem(sys.modules, "pyflashattn._runtime.cuda", fc)
    return fc


def _torch_module(tensor_type):
    torch = types.ModuleType("torch")
    torch.Tensor = tensor_type
    torch.bfloat16, torch.float16, torch.float32 = BF16, _TorchDtype("float16"), _TorchDtype("float32")
    torch.float8_e4m3fn = _TorchDtype("float8_e4m3fn")
    torch.empty_calls = []

    def empty_(shape, dtype, device):
        torch.empty_calls.append((shape, dtype, device))
        n = len(shape)
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(n))
        return tensor_type(ptr=0xE000, shape=tuple(shape), strides=strides, dtype=dtype,
                           device=("cuda", int(device.split(":")[1])))

    torch.empty = empty_
    torch._C = types.SimpleNamespace()  # no raw-stream getter: the public paths are exercised
    torch.cuda = types.SimpleNamespace(
        current_stream=lambda dev: types.SimpleNamespace(cuda_stream=0x4400 + dev))
    return torch


def test_current_stream_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", _torch_module(FakeTorchTensor))
    assert current_stream("torch", 3) == 0x4403  # no exchange API: torch.cuda.current_stream
    table = _ExchangeTable(stream_value=0x9900)
    T = _in_module(type("Tensor", (FakeTorchTensor,), {"__dlpack_c_exchange_api__": table.capsule}), "torch")
    monkeypatch.setitem(sys.modules, "torch", _torch_module(T))
    assert current_stream("torch", 2) == 0x9902  # exchange API current_work_stream
    sys.modules["torch"]._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda dev: 0x7700 + dev)
    assert current_stream("torch", 4) == 0x7704  # torch's raw getter wins when present


def test_current_stream_cupy(monkeypatch):
    seen = []

    class Device:
        def __init__(self, dev):
            self.dev = dev

        def __enter__(self):
            seen.append(self.dev)

        def __exit__(self, *a):
            seen.append("exit")

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(Device=Device,
                                      get_current_stream=lambda: types.SimpleNamespace(ptr=0x3300 + len(seen)))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    assert current_stream("cupy", 1) == 0x3301 and seen == [1, "exit"]


def test_current_stream_jax_and_others_use_library_stream(fake_cuda):
    assert current_stream("jax", 2) == 0x7702
    assert current_stream("other", 0) == 0x7700


def test_dim1_views_and_the_launch_export(fake_cuda):
    """slice_dim1: a JAX array's (or any non-torch / CuPy producer's) [:, i] is a view of its
    export; launch_view exports such an array again with the launch stream (the DLPack handshake
    the derived views skip): JAX's and other producers' alike."""
    from pyflashattn._runtime.tensor import index_dim1, launch_view, slice_dim1

    j = FakeJax(shape=(5, 3, 2, 8), strides=(48, 16, 8, 1), dtype=_dtypes.BFLOAT16, data=0x10000, device=(2, 1))
    v = launch_view(j, "qkv")
    assert [c["stream"] for c in j.calls] == [None, 0x7701]
    h = slice_dim1(j, v, 2)
    assert (h.ptr, h.shape, h.strides, h.framework) == (0x10000 + 2 * 16 * 2, (5, 2, 8), (48, 8, 1), "jax")
    assert h.obj is j and h._keep is v._keep
    assert index_dim1(v, 0).ptr == 0x10000
    other = FakeProducer(shape=(5, 1, 8), strides=(8, 8, 1), device=(2, 0))
    launch_view(other, "kv_cache")
    assert [c["stream"] for c in other.calls] == [None, 0x7700]  # the library stream of device 0
    seen = FakeProducer(shape=(5, 1, 8), strides=(8, 8, 1), device=(2, 0))
    launch_view(seen, "kv_cache", view(seen, "kv_cache"))  # a view taken already: one more export, with the stream
    assert [c["stream"] for c in seen.calls] == [None, 0x7700]
    assert launch_view(h, "x") is h  # a view passes through


# ---------------------------------------------------------------- empty(): torch, CuPy, errors
def test_empty_torch(monkeypatch):
    torch = _torch_module(FakeTorchTensor)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(pyflashattn._runtime.tensor, "_TORCH_BY_NAME", {})  # real torch may have filled it
    ref = view(FakeTorchTensor(device=("cuda", 1)), "q")
    out, v = empty(ref, (3, 4, 8), _dtypes.BFLOAT16, 0x55)
    FakeTorchTensor.new_empty_calls.clear()
    out, v = empty(ref, (3, 4, 8), _dtypes.BFLOAT16, 0x55)
    assert FakeTorchTensor.new_empty_calls == [((3, 4, 8), BF16, 1)]
    assert finalize(out) is out
    assert (v.ptr, v.shape, v.strides, v.dtype, v.device_id, v.framework) == (
        0xE000, (3, 4, 8), (32, 8, 1), _dtypes.BFLOAT16, 1, "torch")
    with pytest.raises(TypeError, match="float4_e2m1fn"):
        empty(ref, (2,), _dtypes.FLOAT4_E2M1, 0)


def test_empty_cupy(monkeypatch):
    seen = []

    class Device:
        def __init__(self, dev):
            self.dev = dev

        def __enter__(self):
            seen.append(self.dev)

        def __exit__(self, *a):
            pass

    def cupy_empty(shape, dtype):
        a = types.SimpleNamespace(shape=shape, itemsize=dtype.itemsize, data=types.SimpleNamespace(ptr=0xC000))
        a.strides = tuple(int(np.prod(shape[i + 1:])) * dtype.itemsize for i in range(len(shape)))
        seen.append(dtype)
        return a

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(Device=Device)
    cupy.empty = cupy_empty
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    ref = view(FakeCupy(device=(2, 2)), "q")
    out, v = empty(ref, (5, 6), _dtypes.FLOAT32, 0)
    assert seen == [2, np.dtype("float32")]
    assert (v.ptr, v.shape, v.strides, v.device_id, v.framework) == (0xC000, (5, 6), (6, 1), 2, "cupy")
    with pytest.raises(TypeError, match="CuPy has no float8_e4m3fn"):
        empty(ref, (2,), _dtypes.FLOAT8_E4M3, 0)
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        with pytest.raises(TypeError, match="ml_dtypes"):
            empty(ref, (2,), _dtypes.BFLOAT16, 0)


def test_empty_errors():
    with pytest.raises(ValueError, match="CUDA"):
        empty(view(np.zeros(2), "q"), (2,), _dtypes.FLOAT32, 0)
    with pytest.raises(TypeError, match="pass out="):
        empty(view(FakeProducer(), "q"), (2,), _dtypes.FLOAT32, 0)


# ---------------------------------------------------------------- empty(): JAX export
_USED = ctypes.create_string_buffer(b"used_dltensor")
_set_name = ctypes.pythonapi.PyCapsule_SetName
_set_name.argtypes = [ctypes.py_object, ctypes.c_void_p]
_DELETER_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class FakeJaxModule(types.ModuleType):
    """jax.dlpack.from_dlpack as JAX does it: ask for a capsule with its stream, consume it, and
    call the DLManagedTensor's deleter when the (fake) array is released."""

    def __init__(self, stream=0x6600, consume=True, fail_before=False, fail_after=False):
        super().__init__("jax")
        self.stream, self.consume, self.fail_before, self.fail_after = stream, consume, fail_before, fail_after
        self.dlpack = types.SimpleNamespace(from_dlpack=self.from_dlpack)

    def from_dlpack(self, x):
        assert x.__dlpack_device__()[0] == 2
        if self.fail_before:
            raise RuntimeError("jax refused")
        cap = x.__dlpack__(stream=self.stream)
        parsed = _dlpack.read_capsule(cap)
        if self.fail_after:
            raise RuntimeError("jax failed after export")
        if not self.consume:
            return parsed
        mt_addr = _dlpack._capsule_get_pointer(cap, b"dltensor")
        _set_name(cap, ctypes.addressof(_USED))
        deleter = _dlpack.DLManagedTensor.from_address(mt_addr).deleter
        return types.SimpleNamespace(parsed=parsed, release=lambda: _DELETER_T(deleter)(mt_addr))


@pytest.mark.parametrize("dtype", [_dtypes.BFLOAT16, _dtypes.FLOAT8_E4M3, _dtypes.FLOAT32,
                                   _dtypes.FLOAT4_E2M1_X2])
def test_empty_jax_roundtrip(fake_cuda, monkeypatch, dtype):
    jax = FakeJaxModule(stream=0x6600)
    monkeypatch.setitem(sys.modules, "jax", jax)
    ref = view(FakeJax(device=(2, 1)), "q")
    out, v = empty(ref, (3, 4, 5), dtype, 0x1200)
    ptr = v.ptr
    assert ("alloc", dtype.nbytes(60), 0x1200) in fake_cuda.log
    assert (v.shape, v.strides, v.dtype, v.device_id, v.framework) == ((3, 4, 5), (20, 5, 1), dtype, 1, "jax")
    arr = finalize(out)  # after the launch
    assert ("wait", 0x6600, 0x1200) in fake_cuda.log  # JAX's stream waits for the launch stream
    p = arr.parsed
    assert (p.ptr, p.shape, p.strides, p.dtype, p.device_type, p.device_id) == (
        ptr, (3, 4, 5), (20, 5, 1), dtype, 2, 1)
    assert fake_cuda.freed == []  # JAX owns it now
    del out
    assert fake_cuda.freed == []
    arr.release()
    assert fake_cuda.freed == [ptr]
    # the deleter runs on any of JAX's threads: the context is set whatever this thread last set
    assert ("ctx", 1, "forced") in fake_cuda.log
    arr.release()  # a second deleter call must not free twice
    assert fake_cuda.freed == [ptr]


def test_empty_jax_deleter_from_foreign_thread(fake_cuda, monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", FakeJaxModule())
    out, v = empty(view(FakeJax(), "q"), (8,), _dtypes.FLOAT16, 0x1200)
    arr = finalize(out)
    th = threading.Thread(target=arr.release)
    th.start()
    th.join()
    assert fake_cuda.freed == [v.ptr]


def test_empty_jax_unconsumed_capsule_is_freed_once(fake_cuda, monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", FakeJaxModule(consume=False))
    out, v = empty(view(FakeJax(), "q"), (8,), _dtypes.FLOAT16, 0x1200)
    finalize(out)
    assert fake_cuda.freed == [v.ptr]
    del out
    assert fake_cuda.freed == [v.ptr]


@pytest.mark.parametrize("where", ["fail_before", "fail_after"])
def test_empty_jax_failed_handover_frees_once(fake_cuda, monkeypatch, where):
    monkeypatch.setitem(sys.modules, "jax", FakeJaxModule(**{where: True}))
    out, v = empty(view(FakeJax(), "q"), (8,), _dtypes.FLOAT16, 0x1200)
    with pytest.raises(RuntimeError, match="jax"):
        finalize(out)
    ptr = v.ptr
    del out, v  # the view holds the exporter too
    gc.collect()  # the traceback kept a frame referring to it
    assert fake_cuda.freed == [ptr]


def test_empty_jax_never_handed_over(fake_cuda):
    out, v = empty(view(FakeJax(), "q"), (8,), _dtypes.FLOAT16, 0x1200)
    ptr = v.ptr
    assert fake_cuda.freed == []
    del out, v  # e.g. the launch raised: the exporter still owns the memory
    assert fake_cuda.freed == [ptr]


def test_jax_output_dlpack_protocol(fake_cuda):
    out = empty(view(FakeJax(device=(2, 3)), "q"), (2, 2), _dtypes.FLOAT16, 0x1200)[0]
    assert out.__dlpack_device__() == (2, 3)
    with pytest.raises(BufferError):
        out.__dlpack__(dl_device=(1, 0))
    cap = out.__dlpack__(stream=None, max_version=(1, 3))  # stream None = legacy default stream
    assert ("wait", 1, 0x1200) in fake_cuda.log
    assert _dlpack.capsule_name(cap) == b"dltensor"
    with pytest.raises(BufferError, match="already"):
        out.__dlpack__(stream=-1)
    n_waits = sum(1 for e in fake_cuda.log if e[0] == "wait")
    del cap, out  # capsule never consumed: the exporter's finaliser frees
    assert len(fake_cuda.freed) == 1
    out = empty(view(FakeJax(), "q"), (2,), _dtypes.FLOAT16, 0x1200)[0]
    out.__dlpack__(stream=-1)  # -1: consumer opted out of synchronisation
    assert sum(1 for e in fake_cuda.log if e[0] == "wait") == n_waits


# ---------------------------------------------------------------- property: any numpy slice
@st.composite
def _sliced_arrays(draw):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    base = np.zeros(shape, dtype=draw(st.sampled_from(["e", "f", "d", "b", "q", "?"])))
    index = tuple(slice(draw(st.integers(0, n - 1)), None, draw(st.sampled_from([1, 2, -1, -2])))
                  for n in shape)
    a = base[index]
    if draw(st.booleans()):
        a = a.transpose(draw(st.permutations(range(ndim))))
    return a


@settings(max_examples=150, deadline=None)
@given(_sliced_arrays())
def test_view_matches_numpy_for_any_slice(a):
    v = view(a, "q")
    assert v.ptr == a.ctypes.data
    assert v.shape == a.shape
    assert v.strides == tuple(s // a.itemsize for s in a.strides)
    assert v.dtype.name == a.dtype.name
