"""CPU tests of the dtype table and the ctypes DLPack reader (capsules and the C exchange API)."""

import ctypes
import struct
import threading

import numpy as np
import pytest

from pyflashattn._runtime import dlpack as _dlpack, dtypes as _dtypes
from pyflashattn._runtime.dlpack import (DLManagedTensor, DLManagedTensorVersioned, DLPackExchangeAPI,
                                 DLTensor, exchange_api_for, read_capsule)
from pyflashattn._runtime.dtypes import ALL, DType, from_dlpack_code, normalize

c_int64 = ctypes.c_int64


# ---------------------------------------------------------------- synthetic capsules
class Synthetic:
    """A DLPack capsule built by hand; holds the ctypes memory the capsule points into."""

    def __init__(self, kind, *, data=0x10000, shape=(2, 3), strides=None, dtype=(2, 32, 1),
                 offset=0, flags=0, device=(2, 0), major=1, name=None):
        n = len(shape)
        self.shape_arr = (c_int64 * max(n, 1))(*shape)
        self.strides_arr = (c_int64 * max(n, 1))(*strides) if strides is not None else None
        if kind == "versioned":
            self.mt = DLManagedTensorVersioned()
            self.mt.version.major, self.mt.version.minor = major, 3
            self.mt.flags = flags
            default_name = b"dltensor_versioned"
        else:
            self.mt = DLManagedTensor()
            default_name = b"dltensor"
        t = self.mt.dl_tensor
        t.data = data
        t.device.device_type, t.device.device_id = device
        t.ndim = n
        t.dtype.code, t.dtype.bits, t.dtype.lanes = dtype
        t.shape = ctypes.cast(self.shape_arr, ctypes.POINTER(c_int64))
        if self.strides_arr is not None:
            t.strides = ctypes.cast(self.strides_arr, ctypes.POINTER(c_int64))
        t.byte_offset = offset
        self.name = ctypes.create_string_buffer(name if name is not None else default_name)
        self.capsule = _dlpack._capsule_new(ctypes.addressof(self.mt), ctypes.addressof(self.name), None)


KINDS = ["versioned", "legacy"]


# ---------------------------------------------------------------- struct layouts
def test_struct_layouts_match_dlpack_h():
    assert ctypes.sizeof(DLTensor) == 48
    assert [getattr(DLTensor, f).offset for f in ("data", "device", "ndim", "dtype", "shape", "strides",
                                                   "byte_offset")] == [0, 8, 16, 20, 24, 32, 40]
    assert ctypes.sizeof(DLManagedTensor) == 64
    assert (DLManagedTensor.manager_ctx.offset, DLManagedTensor.deleter.offset) == (48, 56)
    assert ctypes.sizeof(DLManagedTensorVersioned) == 80
    assert [getattr(DLManagedTensorVersioned, f).offset
            for f in ("version", "manager_ctx", "deleter", "flags", "dl_tensor")] == [0, 8, 16, 24, 32]
    assert ctypes.sizeof(DLPackExchangeAPI) == 56
    assert DLPackExchangeAPI.dltensor_from_py_object_no_sync.offset == 40
    assert DLPackExchangeAPI.current_work_stream.offset == 48
    assert _dlpack._DLTENSOR.size == 48 and _dlpack._VERSIONED.size == 80


def test_fast_memory_reader_reads_real_memory():
    buf = (c_int64 * 3)(7, -8, 1 << 40)
    assert _dlpack._unpack(struct.Struct("@3q"), ctypes.addressof(buf)) == (7, -8, 1 << 40)


# ---------------------------------------------------------------- every dtype, both kinds
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dt", ALL, ids=lambda d: d.name)
def test_every_dtype_code(kind, dt):
    s = Synthetic(kind, data=0xABC000, shape=(4, 5, 6), strides=(60, 1, 5), dtype=dt.dlpack,
                  offset=32, device=(2, 3))
    p = read_capsule(s.capsule)
    assert p.dtype is dt
    assert p.ptr == 0xABC000 + 32
    assert p.shape == (4, 5, 6) and p.strides == (60, 1, 5)
    assert (p.device_type, p.device_id) == (2, 3)
    assert p.readonly is False


@pytest.mark.parametrize("kind", KINDS)
def test_null_strides_mean_row_major(kind):
    s = Synthetic(kind, shape=(2, 3, 4), strides=None)
    assert read_capsule(s.capsule).strides == (12, 4, 1)
    s = Synthetic(kind, shape=(2, 0, 4), strides=None)
    assert read_capsule(s.capsule).strides == (4, 4, 1)  # torch's convention for size-0 dims


@pytest.mark.parametrize("kind", KINDS)
def test_zero_dim_and_null_data(kind):
    s = Synthetic(kind, data=0, shape=(), offset=0)
    p = read_capsule(s.capsule)
    assert (p.ptr, p.shape, p.strides) == (0, (), ())


@pytest.mark.parametrize("kind", KINDS)
def test_negative_strides_and_large_rank(kind):
    shape = tuple(range(1, 11))
    strides = tuple(-x for x in range(10))
    s = Synthetic(kind, shape=shape, strides=strides)
    p = read_capsule(s.capsule)
    assert p.shape == shape and p.strides == strides


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("code,bits,lanes,msg", [
    (2, 32, 4, "lanes=4"),       # vector type
    (2, 16, 2, "lanes=2"),
    (3, 64, 1, "code=3"),        # opaque handle
    (99, 8, 1, "code=99"),
    (2, 24, 1, "bits=24"),
    (10, 16, 1, "code=10"),      # fp8 code with the wrong width
])
def test_unsupported_dtypes_rejected(kind, code, bits, lanes, msg):
    s = Synthetic(kind, dtype=(code, bits, lanes))
    with pytest.raises(TypeError, match=msg):
        read_capsule(s.capsule)


def test_torch_fp4_x2_is_the_packed_pair_dtype():
    s = Synthetic("versioned", dtype=(17, 4, 2))
    assert read_capsule(s.capsule).dtype is _dtypes.FLOAT4_E2M1_X2


# (Each Synthetic is bound to a name: the capsule points into its memory, which must outlive it.)
def test_flags_readonly_and_padded_subbyte():
    s = Synthetic("versioned", flags=1)
    assert read_capsule(s.capsule).readonly is True
    s = Synthetic("versioned", flags=2)
    assert read_capsule(s.capsule).readonly is False
    s = Synthetic("versioned", dtype=(17, 4, 1), flags=4)
    with pytest.raises(TypeError, match="padded"):
        read_capsule(s.capsule)
    # The padded flag only matters below one byte.
    s = Synthetic("versioned", dtype=(10, 8, 1), flags=4)
    assert read_capsule(s.capsule).dtype is _dtypes.FLOAT8_E4M3


def test_capsule_names():
    for used in (b"used_dltensor", b"used_dltensor_versioned"):
        s = Synthetic("legacy", name=used)
        with pytest.raises(ValueError, match="already consumed"):
            read_capsule(s.capsule)
    s = Synthetic("legacy", name=b"something_else")
    with pytest.raises(ValueError, match="not a DLPack"):
        read_capsule(s.capsule)
    with pytest.raises(TypeError, match="PyCapsule"):
        read_capsule(np.zeros(3))


def test_unknown_major_version_rejected():
    s = Synthetic("versioned", major=2)
    with pytest.raises(ValueError, match="version 2"):
        read_capsule(s.capsule)


def test_read_does_not_consume():
    s = Synthetic("versioned")
    read_capsule(s.capsule)
    assert _dlpack.capsule_name(s.capsule) == b"dltensor_versioned"
    assert read_capsule(s.capsule).shape == (2, 3)


# ---------------------------------------------------------------- numpy capsules
NUMPY_DTYPES = "?bhilqBHILQefdFD"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("code", NUMPY_DTYPES)
def test_numpy_capsules(kind, code):
    a = np.zeros((6, 8), dtype=code)[1::2, ::-3]
    cap = a.__dlpack__(max_version=(1, 0)) if kind == "versioned" else a.__dlpack__()
    assert _dlpack.capsule_name(cap) == (b"dltensor_versioned" if kind == "versioned" else b"dltensor")
    p = read_capsule(cap)
    assert p.dtype.name == a.dtype.name
    assert p.ptr == a.ctypes.data
    assert p.shape == a.shape
    assert p.strides == tuple(s // a.itemsize for s in a.strides) == (16, -3)
    assert (p.device_type, p.device_id) == (1, 0)


def test_numpy_readonly_flag():
    a = np.arange(4.0)
    a.flags.writeable = False
    assert read_capsule(a.__dlpack__(max_version=(1, 0))).readonly is True


# ---------------------------------------------------------------- exchange API (synthetic table)
class _Table:
    """A DLPackExchangeAPI implemented with Python callbacks, to test offsets and the chain walk."""

    def __init__(self, major=1, prev=None, with_reader=True):
        self.calls = 0

        def from_py(obj, out):
            self.calls += 1
            if not isinstance(obj, _Producer):
                return -1  # no exception set: reader must raise BufferError itself
            t = DLTensor.from_address(out)
            t.data, t.byte_offset = obj.data, obj.offset
            t.device.device_type, t.device.device_id = 2, obj.dev
            t.ndim = len(obj.shape)
            t.dtype.code, t.dtype.bits, t.dtype.lanes = obj.dtype.dlpack
            t.shape = ctypes.cast(obj.shape_arr, ctypes.POINTER(c_int64))
            t.strides = ctypes.cast(obj.strides_arr, ctypes.POINTER(c_int64))
            return 0

        def work_stream(dev_type, dev_id, out):
            out[0] = 0 if dev_type == 1 else 0xABC00 + dev_id
            return 0

        self.cb_from = _dlpack._FROM_PY(from_py)
        self.cb_stream = _dlpack._WORK_STREAM(work_stream)
        self.api = DLPackExchangeAPI()
        self.api.header.version.major, self.api.header.version.minor = major, 3
        self.api.header.prev_api = ctypes.addressof(prev.api) if prev else None
        if with_reader:
            self.api.dltensor_from_py_object_no_sync = ctypes.cast(self.cb_from, ctypes.c_void_p).value
        self.api.current_work_stream = ctypes.cast(self.cb_stream, ctypes.c_void_p).value
        self.name = ctypes.create_string_buffer(b"dlpack_exchange_api")
        self.capsule = _dlpack._capsule_new(ctypes.addressof(self.api), ctypes.addressof(self.name), None)


class _Producer:
    def __init__(self, shape=(3, 4), strides=(1, 3), dtype=_dtypes.BFLOAT16, data=0x7000, offset=8, dev=1):
        self.shape, self.dtype, self.data, self.offset, self.dev = shape, dtype, data, offset, dev
        self.shape_arr = (c_int64 * len(shape))(*shape)
        self.strides_arr = (c_int64 * len(shape))(*strides)


def _producer_type(attr):
    return type("P", (_Producer,), {"__dlpack_c_exchange_api__": attr})


def test_exchange_api_synthetic_table():
    table = _Table()
    P = _producer_type(table.capsule)
    api = exchange_api_for(P)
    assert api is not None and api.version == (1, 3) and api.can_read
    assert exchange_api_for(P) is api  # cached per type
    p = api.read(P())
    assert (p.ptr, p.shape, p.strides, p.dtype, p.device_type, p.device_id) == (
        0x7008, (3, 4), (1, 3), _dtypes.BFLOAT16, 2, 1)
    assert api.current_work_stream(2, 5) == 0xABC05
    assert api.current_work_stream(1, 0) == 0
    with pytest.raises(BufferError):
        api.read(object())


def test_exchange_api_reader_is_per_thread():
    table = _Table()
    api = exchange_api_for(_producer_type(table.capsule))
    results = []

    def worker(dev):
        for _ in range(200):
            results.append(api.read(_Producer(dev=dev)).device_id == dev)

    threads = [threading.Thread(target=worker, args=(d,)) for d in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 800 and all(results)


def test_exchange_api_prev_chain_and_int_attribute():
    old = _Table(major=1)
    new = _Table(major=2, prev=old)
    api = exchange_api_for(_producer_type(new.capsule))
    assert api is not None and api.version == (1, 3)
    api.read(_Producer())
    assert (old.calls, new.calls) == (1, 0)  # the major-1 table is the one used
    api = exchange_api_for(_producer_type(ctypes.addressof(old.api)))  # raw address form
    assert api is not None and api.read(_Producer()).shape == (3, 4)


def test_exchange_api_rejections():
    assert exchange_api_for(list) is None
    only2 = _Table(major=2)
    assert exchange_api_for(_producer_type(only2.capsule)) is None  # no 1.x in chain
    bad = _Table()
    bad.name.value = b"not_the_api"
    assert exchange_api_for(_producer_type(bad.capsule)) is None
    assert exchange_api_for(_producer_type("nonsense")) is None
    no_reader = _Table(with_reader=False)
    api = exchange_api_for(_producer_type(no_reader.capsule))
    assert api.can_read is False and api.current_work_stream(2, 1) == 0xABC01


def test_exchange_api_of_cuda_core_strided_memory_view():
    utils = pytest.importorskip("cuda.core.utils")
    SMV = utils.StridedMemoryView
    if not hasattr(SMV, "__dlpack_c_exchange_api__"):
        pytest.skip("this cuda.core has no exchange API")
    a = np.arange(24, dtype=np.float32).reshape(4, 6)[:, 1::2]
    v = SMV.from_dlpack(a, stream_ptr=-1)
    api = exchange_api_for(SMV)
    p = api.read(v)
    assert (p.ptr, p.shape, p.strides, p.dtype) == (a.ctypes.data, (4, 3), (6, 2), _dtypes.FLOAT32)
    assert api.current_work_stream(1, 0) == 0
    with pytest.raises(TypeError):  # the producer's own exception, raised through PYFUNCTYPE
        api.read(a)


# ---------------------------------------------------------------- dtype table
def test_contract_constants():
    expect = {
        "FLOAT16": ("float16", 2, 16, "f16"), "BFLOAT16": ("bfloat16", 4, 16, "bf16"),
        "FLOAT32": ("float32", 2, 32, "f32"), "FLOAT64": ("float64", 2, 64, "f64"),
        "FLOAT8_E4M3": ("float8_e4m3fn", 10, 8, "e4m3"), "FLOAT8_E5M2": ("float8_e5m2", 12, 8, "e5m2"),
        "FLOAT8_E8M0": ("float8_e8m0fnu", 14, 8, "e8m0"), "FLOAT4_E2M1": ("float4_e2m1fn", 17, 4, "e2m1"),
        "INT8": ("int8", 0, 8, "i8"), "INT32": ("int32", 0, 32, "i32"), "INT64": ("int64", 0, 64, "i64"),
        "UINT8": ("uint8", 1, 8, "u8"), "BOOL": ("bool", 6, 8, "b8"),
    }
    for const, (name, code, bits, short) in expect.items():
        d = getattr(_dtypes, const)
        assert (d.name, d.code, d.bits, d.short) == (name, code, bits, short), const
    assert len({d.name for d in ALL}) == len({d.short for d in ALL}) == len(ALL)


@pytest.mark.parametrize("code,name", [
    (7, "float8_e3m4"), (8, "float8_e4m3"), (9, "float8_e4m3b11fnuz"), (10, "float8_e4m3fn"),
    (11, "float8_e4m3fnuz"), (12, "float8_e5m2"), (13, "float8_e5m2fnuz"), (14, "float8_e8m0fnu"),
])
def test_dlpack_fp8_codes(code, name):
    assert from_dlpack_code(code, 8, 1).name == name


def test_dlpack_other_codes():
    assert from_dlpack_code(15, 6, 1).name == "float6_e2m3fn"
    assert from_dlpack_code(16, 6, 1).name == "float6_e3m2fn"
    assert from_dlpack_code(17, 4, 1) is _dtypes.FLOAT4_E2M1
    assert from_dlpack_code(4, 16, 1) is _dtypes.BFLOAT16
    assert from_dlpack_code(6, 8, 1) is _dtypes.BOOL
    assert from_dlpack_code(5, 64, 1) is _dtypes.COMPLEX64
    assert from_dlpack_code(1, 8, 1) is _dtypes.UINT8


def test_nbytes():
    assert _dtypes.BFLOAT16.nbytes(10) == 20
    assert _dtypes.FLOAT8_E4M3.nbytes(10) == 10
    assert _dtypes.FLOAT4_E2M1.nbytes(10) == 5
    assert _dtypes.FLOAT4_E2M1.nbytes(11) == 6  # rounds up to whole bytes
    assert _dtypes.FLOAT4_E2M1_X2.nbytes(10) == 10
    assert _dtypes.FLOAT6_E2M3.nbytes(4) == 3


class _FakeTorchDtype:
    __module__ = "torch"

    def __init__(self, s):
        self.s = s

    def __str__(self):
        return self.s

    def __hash__(self):
        return hash(self.s)

    def __eq__(self, other):
        return isinstance(other, _FakeTorchDtype) and other.s == self.s


@pytest.mark.parametrize("value,expect", [
    ("float16", "float16"), ("half", "float16"), ("fp16", "float16"), ("f16", "float16"),
    ("FP16", "float16"), ("bfloat16", "bfloat16"), ("bf16", "bfloat16"), ("torch.bfloat16", "bfloat16"),
    ("float32", "float32"), ("float", "float32"), ("fp32", "float32"), ("double", "float64"),
    ("float8_e4m3fn", "float8_e4m3fn"), ("e4m3", "float8_e4m3fn"), ("fp8_e4m3", "float8_e4m3fn"),
    ("torch.float8_e4m3fn", "float8_e4m3fn"), ("float8_e5m2", "float8_e5m2"), ("e5m2", "float8_e5m2"),
    ("float8_e8m0fnu", "float8_e8m0fnu"), ("e8m0", "float8_e8m0fnu"),
    ("float4_e2m1fn", "float4_e2m1fn"), ("e2m1", "float4_e2m1fn"),
    ("torch.float4_e2m1fn_x2", "float4_e2m1fn_x2"), ("ml_dtypes.bfloat16", "bfloat16"),
    ("int8", "int8"), ("int", "int32"), ("long", "int64"), ("uint8", "uint8"), ("u8", "uint8"),
    ("bool", "bool"), ("torch.bool", "bool"), ("<f2", "float16"), ("float8_e4m3", "float8_e4m3"),
    (np.float16, "float16"), (np.dtype("float32"), "float32"), (np.dtype(">f4"), "float32"),
    (np.int64, "int64"), (np.bool_, "bool"), (np.dtype("uint8"), "uint8"), (np.complex64, "complex64"),
    (_FakeTorchDtype("torch.bfloat16"), "bfloat16"), (_FakeTorchDtype("torch.float8_e5m2"), "float8_e5m2"),
    (_FakeTorchDtype("torch.float16"), "float16"), (_dtypes.FLOAT8_E4M3, "float8_e4m3fn"),
])
def test_normalize(value, expect):
    assert normalize(value).name == expect
    assert normalize(value) is normalize(value)  # cached, and DTypes are singletons


def test_normalize_ml_dtypes_if_installed():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert normalize(ml_dtypes.bfloat16) is _dtypes.BFLOAT16
    assert normalize(np.dtype(ml_dtypes.float8_e4m3fn)) is _dtypes.FLOAT8_E4M3


@pytest.mark.parametrize("bad", ["float7", "", "torch.quint8", None, object(), np.dtype("U3"),
                                 _FakeTorchDtype("torch.qint8"), [1]])
def test_normalize_rejects_naming_the_value(bad):
    with pytest.raises(TypeError, match="unsupported dtype") as e:
        normalize(bad)
    assert repr(bad)[:20] in str(e.value)


def test_dtype_is_frozen_and_hashable():
    d = DType("float16", 2, 16, "f16")
    assert d == _dtypes.FLOAT16 and hash(d) == hash(_dtypes.FLOAT16)
    with pytest.raises(Exception):
        d.bits = 8
