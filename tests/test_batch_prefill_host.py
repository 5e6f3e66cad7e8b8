"""Batch prefill wrappers end to end on CPU, against a simulated CUDA driver.

The fake driver (FakeDriver below) stands in for cuda.bindings: "device memory" is host memory
(ctypes buffers), copies are memmoves, the packbits kernel is executed in numpy and every
attention / merge launch is recorded with a copy of its params struct. That lets these tests
check what plan() / run() hand to the kernels, byte for byte, without a GPU: fp8 KV (kv_fp8,
kernel choice, strides, k_scale / v_scale folded into sm_scale_log2 / v_scale), custom masks
packed into fixed buffers under CUDA graphs (the bits the kernel would read), the capture
freeze, and stream ordering. Numerics are the GPU tests' job.

``PYTHONPATH=. python tests/test_batch_prefill_host.py`` prints the host time of plan() and run() per call
on this fake (the Python-side work; the real driver calls cost extra).
"""
from __future__ import annotations

import ctypes
import math
import pathlib
import sys
import time
import types

import numpy as np
import pytest

import pyflashattn
from pyflashattn._runtime import cuda as _cuda, dtypes as _dtypes, registry as _registry, tensor as _tensor
from pyflashattn._runtime.params_gen import MergeParams, PackbitsParams, PrefillParams
from pyflashattn.testing.fake_tensors import FakeProducer, fake_cuda_tensor
from pyflashattn.testing.fake_tensors import compact_strides as _compact

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "build_tools"))
import variants  # noqa: E402

Paged = pyflashattn.BatchPrefillWithPagedKVCacheWrapper
Ragged = pyflashattn.BatchPrefillWithRaggedKVCacheWrapper
F16, BF16, U8, I32 = _dtypes.FLOAT16, _dtypes.BFLOAT16, _dtypes.UINT8, _dtypes.INT32
E4M3, E5M2, BOOL = _dtypes.FLOAT8_E4M3, _dtypes.FLOAT8_E5M2, _dtypes.BOOL
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# the simulated driver
# ---------------------------------------------------------------------------------------------
class _Enum:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class FakeDriver:
    """The subset of cuda.bindings.driver the batch wrappers call, on host memory."""

    CUresult = _Enum(CUDA_SUCCESS=0, CUDA_ERROR_NOT_READY=600)
    lagging = False  # cuEventQuery says "not ready": a GPU that has not reached the copies yet
    CUevent_flags = _Enum(CU_EVENT_DISABLE_TIMING=2)
    CUstreamCaptureStatus = _Enum(CU_STREAM_CAPTURE_STATUS_NONE=0, CU_STREAM_CAPTURE_STATUS_ACTIVE=1)

    def __init__(self):
        self.mem = {}  # address -> ctypes buffer (device and pinned host alike)
        self.log = []  # (op, ...) in call order
        self.launches = []  # (kernel name, grid, stream, params copy)
        self.capturing = set()  # streams under capture
        self.funcs = {}
        self.freed = []

    # memory
    def _alloc(self, n):
        buf = ctypes.create_string_buffer(max(int(n), 1) + 256)
        addr = (ctypes.addressof(buf) + 255) // 256 * 256  # cudaMalloc-like alignment
        self.mem[addr] = buf
        return addr

    def cuMemHostAlloc(self, n, flags):
        return 0, self._alloc(n)

    def cuMemAlloc(self, n):
        a = self._alloc(n)
        self.log.append(("alloc", a, n))
        return 0, a

    def cuMemAllocAsync(self, n, s):
        a = self._alloc(n)
        self.log.append(("alloc", a, n, s))
        return 0, a

    def cuMemFree(self, a):
        self.freed.append(a)
        return (0,)

    cuMemFreeHost = cuMemFree

    def cuMemFreeAsync(self, a, s):
        self.freed.append(a)
        self.log.append(("free_async", a, s))
        return (0,)

    def cuMemcpyHtoDAsync(self, dst, src, n, s):
        self.log.append(("htod", dst, n, s))
        ctypes.memmove(dst, src, n)
        return (0,)

    def cuMemcpyDtoDAsync(self, dst, src, n, s):
        self.log.append(("dtod", dst, src, n, s))
        ctypes.memmove(dst, src, n)
        return (0,)

    def cuMemcpyDtoHAsync(self, dst, src, n, s):
        self.log.append(("dtoh", src, n, s))
        ctypes.memmove(dst, src, n)
        return (0,)

    def cuMemcpyDtoH(self, dst, src, n):
        return self.cuMemcpyDtoHAsync(dst, src, n, 0)

    # streams and events
    def cuEventCreate(self, flags):
        return 0, object()

    def cuEventRecord(self, ev, s):
        self.log.append(("record", s))
        return (0,)

    def cuEventSynchronize(self, ev):
        self.log.append(("event_sync",))
        return (0,)

    def cuEventQuery(self, ev):
        self.log.append(("query",))
        return (self.CUresult.CUDA_ERROR_NOT_READY if self.lagging else self.CUresult.CUDA_SUCCESS,)

    def cuEventDestroy(self, ev):
        return (0,)

    def cuStreamWaitEvent(self, s, ev, flags):
        self.log.append(("wait", s))
        return (0,)

    def cuStreamSynchronize(self, s):
        self.log.append(("sync", s))
        return (0,)

    def cuStreamIsCapturing(self, s):
        return 0, int(s in self.capturing)

    # kernels
    def cuLaunchKernel(self, func, gx, gy, gz, bx, by, bz, smem, stream, argv_addr, extra):
        name, ptype = func
        assert (by, bz, extra) == (1, 1, 0) and bx in (32, 64, 128, 256) and smem >= 0
        argv = ctypes.cast(argv_addr, ctypes.POINTER(ctypes.c_void_p))
        p = ptype.from_buffer_copy(ctypes.string_at(argv[0], ctypes.sizeof(ptype)))
        grid = (gx, gy, gz)
        self.launches.append((name, grid, stream, p))
        self.log.append(("launch", name, stream))
        if ptype is PackbitsParams:
            _simulate_packbits(p, grid)
        return (0,)

    # programmatic (PDL) launches: cuLaunchKernelEx with one attribute, logged as "launch_pdl"
    CUlaunchAttributeID = _Enum(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION=6)

    class CUlaunchAttribute:
        def __init__(self):
            self.id, self.value = None, _Enum(programmaticStreamSerializationAllowed=0)

    @staticmethod
    def CUlaunchConfig():
        return _Enum(gridDimX=0, gridDimY=0, gridDimZ=0, blockDimX=0, blockDimY=0, blockDimZ=0,
                     sharedMemBytes=0, hStream=None, attrs=[], numAttrs=0)

    def cuLaunchKernelEx(self, cfg, func, argv_addr, extra):
        assert cfg.numAttrs == 1 and cfg.attrs[0].id == 6
        assert cfg.attrs[0].value.programmaticStreamSerializationAllowed == 1
        r = self.cuLaunchKernel(func, cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.blockDimY,
                                cfg.blockDimZ, cfg.sharedMemBytes, cfg.hStream, argv_addr, extra)
        self.log[-1] = ("launch_pdl",) + self.log[-1][1:]
        return r


def _simulate_packbits(p, grid):
    """The packbits kernel (kernel_src/include/pfa/misc/packbits.cuh), segment mode, little."""
    assert p.little == 1 and p.in_indptr and p.out_indptr
    ii = np.frombuffer(ctypes.string_at(p.in_indptr, 4 * (p.num_segments + 1)), np.int32)
    oi = np.frombuffer(ctypes.string_at(p.out_indptr, 4 * (p.num_segments + 1)), np.int32)
    assert grid[1] == p.num_segments
    for seg in range(p.num_segments):
        n = int(ii[seg + 1] - ii[seg])
        nbytes = -(-n // 8)
        assert nbytes <= grid[0] * 256, "grid too small for a segment"
        if not n:
            continue
        x = np.frombuffer(ctypes.string_at(p.x + int(ii[seg]), n), np.uint8) != 0
        packed = np.packbits(x, bitorder="little")
        ctypes.memmove(p.y + int(oi[seg]), packed.tobytes(), nbytes)


def _decode_variant(match):
    """The decode-tile row of build_tools/variants.py that the registry would pick for `match`."""
    kv = match.get("kv_dtype") or match["dtype"]
    return next(v for v in variants.variants() if getattr(v, "decode", False) and v.dtype == match["dtype"]
                and v.kv == kv and v.head_dim == match["head_dim"] and v.paged == bool(match.get("paged"))
                and v.block_m == match.get("block_m", 16))


_META = {64: dict(block_m=128, block_n=64, threads=128), 128: dict(block_m=128, block_n=64, threads=128),
         256: dict(block_m=128, block_n=64, threads=256)}


class FakeEnv:
    """Installs FakeDriver into pyflashattn._runtime.cuda / _registry (see the ``fake`` fixture)."""

    def __init__(self, monkeypatch):
        self.cu = cu = FakeDriver()
        monkeypatch.setattr(_cuda, "driver", lambda: cu)
        monkeypatch.setattr(_cuda, "ensure_context", lambda dev: None)
        monkeypatch.setattr(_cuda, "properties", lambda dev: {"sm_count": 132, "cc": (9, 0), "smem_per_sm": 233472})
        monkeypatch.setattr(_cuda, "_streams", {0: 0x5100})
        monkeypatch.setattr(_cuda, "library_stream", lambda dev: 0x5100)

        def new_launcher(family, dev, **match):
            ptype = {"prefill": PrefillParams, "merge": MergeParams, "packbits": PackbitsParams}[family]
            name = family + "".join(f"_{k}={v}" for k, v in sorted(match.items()))
            if match.get("decode"):  # the decode tiles, as variants.py builds them
                v = _decode_variant(match)
                meta = dict(match, block_m=v.block_m, block_n=v.block_n, threads=v.threads, smem_bytes=v.smem_bytes)
            else:
                meta = dict(_META.get(match.get("head_dim"), dict(block_m=0, block_n=0, threads=256)), smem_bytes=0,
                            **match)
            la = _cuda.Launcher(name, (name, ptype), ptype, meta["threads"], meta["smem_bytes"])
            la.meta = meta
            return la

        cache = {}

        def launcher(family, dev, **match):
            key = (family, dev, tuple(sorted(match.items())))
            if key not in cache:
                cache[key] = new_launcher(family, dev, **match)
            return cache[key]

        monkeypatch.setattr(_registry, "new_launcher", new_launcher)
        monkeypatch.setattr(_registry, "launcher", launcher)

    def dev(self, data: np.ndarray | bytes | int, dtype=U8, shape=None, strides=None):
        """A fake CUDA tensor over simulated device memory holding ``data`` (or n zero bytes)."""
        raw = data if isinstance(data, (bytes, int)) else np.ascontiguousarray(data).tobytes()
        n = raw if isinstance(raw, int) else len(raw)
        addr = self.cu._alloc(n)
        if not isinstance(raw, int):
            ctypes.memmove(addr, raw, n)
        if shape is None:
            shape = (n * 8 // dtype.bits,)
        if strides is None:
            strides = _compact(shape)
        return FakeProducer(shape=tuple(shape), strides=tuple(strides), dtype=dtype, data=addr, device=(2, 0))

    def read(self, addr, n, dtype=np.uint8):
        return np.frombuffer(ctypes.string_at(addr, n * np.dtype(dtype).itemsize), dtype)

    def attn_launches(self):
        return [x for x in self.cu.launches if x[0].startswith("prefill")]


@pytest.fixture
def fake(monkeypatch):
    return FakeEnv(monkeypatch)


def T(shape, dtype=F16, strides=None, data=0x100000):
    return fake_cuda_tensor(shape, dtype, strides, data=data)


def i32(*xs):
    return np.asarray(xs, dtype=np.int32)


def WS(env, nbytes=64 << 20):
    return env.dev(nbytes)


# ---------------------------------------------------------------------------------------------
# a small valid batch (as in test_batch_prefill_validation.py)
# ---------------------------------------------------------------------------------------------
QO = i32(0, 5, 5, 17)            # qo lens 5, 0, 12
KV_INDPTR = i32(0, 2, 3, 3)      # pages 2, 1, 0
KV_INDICES = i32(4, 1, 0)
LAST = i32(3, 16, 0)             # kv lens 19, 16, 0 (page_size 16)
RAGGED_KV = i32(0, 19, 35, 35)
HQ, HKV, D, PS, NPAGES = 8, 2, 128, 16, 5
TQ, TKV = 17, 35
MASK_BITS = (5 * 19, 0, 0)       # qo_len * kv_len per request


def paged(env, **kw):
    return Paged(WS(env), kw.pop("layout", "NHD"), **kw)


def ragged(env, **kw):
    return Ragged(WS(env), kw.pop("layout", "NHD"), **kw)


def plan_paged(w, **kw):
    return w.plan(QO, KV_INDPTR, KV_INDICES, LAST, HQ, HKV, D, PS, **kw)


def plan_ragged(w, **kw):
    return w.plan(QO, RAGGED_KV, HQ, HKV, D, **kw)


def q_t(dtype=F16, data=0x100000):
    return T((TQ, HQ, D), dtype, data=data)


def cache_t(dtype=F16, layout="NHD", data=0x200000):
    shape = (NPAGES, 2, PS, HKV, D) if layout == "NHD" else (NPAGES, 2, HKV, PS, D)
    return T(shape, dtype, data=data)


def kv_t(dtype=F16, data=0x300000, strides=None):
    return T((TKV, HKV, D), dtype, strides=strides, data=data)


def out_t(dtype=F16):
    return T((TQ, HQ, D), dtype, data=0x400000)


def lse_t():
    return T((TQ, HQ), _dtypes.FLOAT32, data=0x500000)


def last_attn(env):
    launches = env.attn_launches()
    assert launches, "nothing was launched"
    return launches[-1]


# ---------------------------------------------------------------------------------------------
# fp8 KV
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qdt", [F16, BF16])
@pytest.mark.parametrize("kvdt, code", [(E4M3, 1), (E5M2, 2), (None, 0)])
@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_plan_picks_the_kv_dtype_kernel(fake, kind, qdt, kvdt, code):
    w = paged(fake) if kind == "paged" else ragged(fake)
    (plan_paged if kind == "paged" else plan_ragged)(w, q_data_type=qdt.name,
                                                     kv_data_type=None if kvdt is None else kvdt.name)
    la = w._attn
    assert la.meta["kv_dtype"] == ("fp8" if kvdt else qdt.short) and la.meta["dtype"] == qdt.short
    assert la.meta["paged"] is (kind == "paged")
    assert la.params.kv_fp8 == code
    kv_dtype = kvdt or qdt
    if kind == "paged":
        w.run(q_t(qdt), cache_t(kv_dtype), out=out_t(qdt))
    else:
        w.run(q_t(qdt), kv_t(kv_dtype), kv_t(kv_dtype, data=0x380000), out=out_t(qdt))
    name, grid, stream, p = last_attn(fake)
    assert p.kv_fp8 == code and name == la.name


def test_fp8_paged_pointers_and_strides_are_in_elements(fake):
    w = paged(fake, layout="HND")
    plan_paged(w, q_data_type="bfloat16", kv_data_type="float8_e5m2")
    c = cache_t(E5M2, "HND")  # [P, 2, Hkv, PS, D], one byte per element
    w.run(q_t(BF16), c, out=out_t(BF16))
    p = last_attn(fake)[3]
    assert p.k == 0x200000 and p.v == 0x200000 + HKV * PS * D  # strides[1] elements = bytes
    assert (p.k_stride_page, p.k_stride_h, p.k_stride_n) == (2 * HKV * PS * D, PS * D, D)
    assert (p.v_stride_page, p.v_stride_h, p.v_stride_n) == (2 * HKV * PS * D, PS * D, D)
    # a (k, v) tuple of separate fp8 caches
    kc = T((NPAGES, HKV, PS, D), E5M2, data=0x600000)
    vc = T((NPAGES, HKV, PS, D), E5M2, data=0x700000)
    w.run(q_t(BF16), (kc, vc), out=out_t(BF16))
    p = last_attn(fake)[3]
    assert (p.k, p.v, p.k_stride_page, p.v_stride_n) == (0x600000, 0x700000, HKV * PS * D, D)


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_run_rejects_kv_of_another_dtype_than_planned(fake, kind):
    w = paged(fake) if kind == "paged" else ragged(fake)
    (plan_paged if kind == "paged" else plan_ragged)(w, kv_data_type="float8_e4m3fn")
    bad = [
        (F16, r"(paged_kv_cache|\bk\b).*float16.*float8_e4m3fn"),  # the 16-bit cache on an fp8 plan
        (E5M2, r"float8_e5m2.*float8_e4m3fn"),  # the other fp8 format
    ]
    for dt, pattern in bad:
        with pytest.raises(TypeError, match=pattern):
            if kind == "paged":
                w.run(q_t(), cache_t(dt), out=out_t())
            else:
                w.run(q_t(), kv_t(dt), kv_t(dt), out=out_t())
    with pytest.raises(TypeError, match=r"\bq\b.*bfloat16.*float16"):
        w.run(q_t(BF16), *((cache_t(E4M3),) if kind == "paged" else (kv_t(E4M3), kv_t(E4M3))), out=out_t())
    assert not fake.attn_launches(), "a kernel ran before the error"
    # 16-bit plan, fp8 cache: also refused
    (plan_paged if kind == "paged" else plan_ragged)(w)
    with pytest.raises(TypeError, match=r"float8_e4m3fn.*float16"):
        w.run(q_t(), *((cache_t(E4M3),) if kind == "paged" else (kv_t(E4M3), kv_t(E4M3))), out=out_t())
    assert not fake.attn_launches()


def test_fp8_alignment_is_16_bytes_not_8_elements(fake):
    # Row strides of 136 elements: 16-byte rows for 16-bit K/V (272 bytes), not for fp8 (136 bytes).
    st = (HKV * 136, 136, 1)
    for kvdt, ok in ((F16, True), (E4M3, False)):
        w = ragged(fake)
        plan_ragged(w, kv_data_type=kvdt.name)
        args = (q_t(), kv_t(kvdt, strides=st), kv_t(kvdt, strides=st, data=0x380000))
        if ok:
            w.run(*args, out=out_t())
        else:
            with pytest.raises(ValueError, match=r"\bk\b.*16-byte.*16 elements"):
                w.run(*args, out=out_t())
    # fp8 data pointer 8 bytes off a 16-byte boundary
    w = ragged(fake)
    plan_ragged(w, kv_data_type="e4m3")
    n = len(fake.attn_launches())
    with pytest.raises(ValueError, match=r"\bv\b.*address %16 = 8"):
        w.run(q_t(), kv_t(E4M3), kv_t(E4M3, data=0x380008), out=out_t())
    # a paged fp8 cache whose K -> V offset (strides[1]) is not a multiple of 16 bytes
    w = paged(fake)
    plan_paged(w, kv_data_type="e4m3")
    odd = T((NPAGES, 2, PS, HKV, D), E4M3, strides=(2 * PS * HKV * D + 16, PS * HKV * D + 8, HKV * D, D, 1))
    with pytest.raises(ValueError, match=r"paged_kv_cache.*16-byte"):
        w.run(q_t(), odd, out=out_t())
    assert len(fake.attn_launches()) == n


def test_fp8_with_rope_and_general_options_uses_the_general_fp8_kernel(fake):
    # FlashInfer rejects fp8 KV + ROPE_LLAMA; our kernel widens K/V to 16 bits before RoPE.
    w = paged(fake)
    plan_paged(w, kv_data_type="float8_e4m3fn", pos_encoding_mode="ROPE_LLAMA", rope_theta=5e5)
    assert w._attn.meta["general"] is True and w._attn.meta["kv_dtype"] == "fp8"
    assert w._attn.params.rope == 1 and w._attn.params.kv_fp8 == 1


# ---------------------------------------------------------------------------------------------
# k_scale / v_scale
# ---------------------------------------------------------------------------------------------
def _run(w, kind, kvdt=F16, **kw):
    if kind == "paged":
        return w.run(q_t(), cache_t(kvdt), out=out_t(), **kw)
    return w.run(q_t(), kv_t(kvdt), kv_t(kvdt, data=0x380000), out=out_t(), **kw)


def _f32(x):
    return float(np.float32(x))


@pytest.mark.parametrize("kvdt", [F16, E4M3])
@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_scales_fold_into_the_kernel_params(fake, kind, kvdt):
    # every KV dtype, both wrappers (FlashInfer's ragged wrapper ignores them: not here)
    w = paged(fake) if kind == "paged" else ragged(fake)
    (plan_paged if kind == "paged" else plan_ragged)(w, kv_data_type=kvdt.name, sm_scale=0.125)
    base = 0.125 * LOG2E
    for ks, vs in [(None, None), (0.5, 2.0), (0.5, 2.0), (3, None), (np.float32(0.75), np.int64(4)),
                   (None, np.float64(1.5)), (None, None)]:
        _run(w, kind, kvdt, k_scale=ks, v_scale=vs)
        p = last_attn(fake)[3]
        assert p.sm_scale_log2 == pytest.approx(_f32(base * (1.0 if ks is None else float(ks))), rel=1e-7)
        assert p.v_scale == pytest.approx(1.0 if vs is None else float(vs))


@pytest.mark.parametrize("kind", ["paged", "ragged"])
@pytest.mark.parametrize("kw, exc, pattern", [
    (dict(k_scale="0.5"), TypeError, r"k_scale"),
    (dict(v_scale=True), TypeError, r"v_scale"),
    (dict(k_scale=[0.5]), TypeError, r"k_scale"),
    (dict(k_scale=np.array(0.5)), TypeError, r"k_scale"),
    (dict(v_scale=object()), TypeError, r"v_scale"),
    (dict(v_scale=1 + 0j), TypeError, r"v_scale"),
    (dict(k_scale=0.0), ValueError, r"k_scale"),
    (dict(k_scale=-1), ValueError, r"k_scale"),
    (dict(v_scale=float("nan")), ValueError, r"v_scale"),
    (dict(v_scale=float("inf")), ValueError, r"v_scale"),
    (dict(k_scale=np.float32("nan")), ValueError, r"k_scale"),
    (dict(k_scale=0.5, v_scale=-2.0), ValueError, r"v_scale"),
])
def test_bad_scales_raise_before_launch_and_change_nothing(fake, kind, kw, exc, pattern):
    w = paged(fake) if kind == "paged" else ragged(fake)
    (plan_paged if kind == "paged" else plan_ragged)(w, kv_data_type="e5m2")
    _run(w, kind, E5M2, k_scale=2.0, v_scale=0.25)
    good = last_attn(fake)[3]
    n = len(fake.attn_launches())
    with pytest.raises(exc, match=pattern):
        _run(w, kind, E5M2, **kw)
    assert len(fake.attn_launches()) == n, "a kernel ran before the error"
    _run(w, kind, E5M2, k_scale=2.0, v_scale=0.25)  # still usable, the same struct as before
    assert bytes(last_attn(fake)[3]) == bytes(good)


# ---------------------------------------------------------------------------------------------
# plan()'s settings cache: the same checks and results as resolving every time
# ---------------------------------------------------------------------------------------------
class _Knob:
    """A mutable number (like a 0-d tensor): float() reads its current value."""

    def __init__(self, v):
        self.v = v

    def __float__(self):
        return self.v


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_cached_settings_still_check_types_and_follow_mutable_values(fake, kind):
    w = paged(fake) if kind == "paged" else ragged(fake)
    plan = plan_paged if kind == "paged" else plan_ragged
    plan(w, sm_scale=0.5)
    plan(w, sm_scale=0.5)  # cached
    assert w._attn.params.sm_scale_log2 == pytest.approx(0.5 * LOG2E)
    # equal values of other types are checked as such, not served from the cache
    args = (QO, KV_INDPTR, KV_INDICES, LAST) if kind == "paged" else (QO, RAGGED_KV)
    tail = (PS,) if kind == "paged" else ()
    with pytest.raises(ValueError, match="head_dim"):
        w.plan(*args, HQ, HKV, float(D), *tail, sm_scale=0.5)
    with pytest.raises(TypeError, match="window_left"):
        plan(w, sm_scale=0.5, window_left=-1.0)
    with pytest.raises(ValueError, match="sm_scale"):
        plan(w, sm_scale=True)
    # a mutable scale is read again at every plan
    knob = _Knob(0.25)
    plan(w, sm_scale=knob)
    assert w._attn.params.sm_scale_log2 == pytest.approx(0.25 * LOG2E)
    knob.v = 0.125
    plan(w, sm_scale=knob)
    assert w._attn.params.sm_scale_log2 == pytest.approx(0.125 * LOG2E)
    plan(w, sm_scale=np.float64(0.75))  # numpy scalars work (resolved each time)
    assert w._attn.params.sm_scale_log2 == pytest.approx(0.75 * LOG2E)


def test_scales_stay_per_run_and_reset_at_plan(fake):
    w = ragged(fake)
    plan_ragged(w, sm_scale=0.5)
    _run(w, "ragged", k_scale=0.25, v_scale=3.0)
    plan_ragged(w, sm_scale=0.5)  # a new plan: run() without scales means 1.0 again
    _run(w, "ragged")
    p = last_attn(fake)[3]
    assert p.sm_scale_log2 == pytest.approx(_f32(0.5 * LOG2E)) and p.v_scale == 1.0


def test_v_scale_reaches_split_kv_partials(fake):
    # The merge kernel has no v_scale: the attention kernel applies it to every partial.
    w = ragged(fake)
    w.plan(i32(0, 1, 2), i32(0, 20000, 40000), HQ, HKV, D, fixed_split_size=1024)
    assert w._merge is not None and w.workspace_size() > 0
    w.run(T((2, HQ, D)), T((40000, HKV, D)), T((40000, HKV, D), data=0x900000), out=T((2, HQ, D)), v_scale=0.5)
    names = [x[0] for x in fake.cu.launches[-2:]]
    assert names[0].startswith("prefill") and names[1].startswith("merge")
    assert fake.cu.launches[-2][3].v_scale == 0.5


# ---------------------------------------------------------------------------------------------
# custom masks: where the packed bits go (non-graph and graph), bit for bit
# ---------------------------------------------------------------------------------------------
def _masks(seed, bits=MASK_BITS):
    rng = np.random.default_rng(seed)
    return [rng.random(n) < 0.5 for n in bits]


def _packed_segments(masks):
    return b"".join(np.packbits(m, bitorder="little").tobytes() for m in masks)


def _read_mask(env, p, nbytes):
    return env.read(p.custom_mask, nbytes).tobytes()


def _mask_indptr(env, p, n):
    return env.read(p.mask_indptr, n, np.int32)


def _check_mask_params(env, w, masks):
    want = _packed_segments(masks)
    p = w._attn.params
    assert p.custom_mask != 0 and w._attn.meta["general"] is True and p.causal == 0
    assert _read_mask(env, p, len(want)) == want
    nbytes = [-(-m.size // 8) for m in masks]
    assert list(_mask_indptr(env, p, len(masks) + 1)) == list(np.concatenate([[0], np.cumsum(nbytes)]))


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_bool_mask_is_packed_on_the_plan_stream(fake, kind):
    w = paged(fake) if kind == "paged" else ragged(fake)
    masks = _masks(1)
    flat = fake.dev(np.concatenate(masks), BOOL)
    (plan_paged if kind == "paged" else plan_ragged)(w, custom_mask=flat, causal=True, stream=0x77)
    _check_mask_params(fake, w, masks)
    packs = [x for x in fake.cu.launches if x[0].startswith("packbits")]
    assert packs and all(x[2] == 0x77 for x in packs), "packing must run on the plan stream"
    assert not any(op[0] == "sync" for op in fake.cu.log), "plan() must not synchronise"


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_packed_mask_is_used_in_place_without_buffers(fake, kind):
    w = paged(fake) if kind == "paged" else ragged(fake)
    masks = _masks(2)
    packed = fake.dev(np.frombuffer(_packed_segments(masks) + b"\0" * 5, np.uint8))
    (plan_paged if kind == "paged" else plan_ragged)(w, packed_custom_mask=packed)
    assert w._attn.params.custom_mask == packed.args[3]
    _check_mask_params(fake, w, masks)
    assert not any(op[0] == "dtod" for op in fake.cu.log)


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_user_mask_buffers_receive_the_mask(fake, graph, packed):
    mbuf = fake.dev(64)
    qk = fake.dev(8 * 4, I32)
    bufs = dict(custom_mask_buf=mbuf, qk_indptr_buf=qk)
    if graph:
        bufs.update(qo_indptr_buf=T((5,), I32), kv_indptr_buf=T((5,), I32))
    w = ragged(fake, use_cuda_graph=graph, **bufs)
    masks = _masks(3)
    if packed:
        kw = dict(packed_custom_mask=fake.dev(np.frombuffer(_packed_segments(masks), np.uint8)))
    else:
        kw = dict(custom_mask=fake.dev(np.concatenate(masks), BOOL))
    plan_ragged(w, **kw, stream=0x99)
    p = w._attn.params
    assert p.custom_mask == mbuf.args[3] and p.mask_indptr == qk.args[3]
    _check_mask_params(fake, w, masks)
    assert all(op[-1] == 0x99 for op in fake.cu.log if op[0] in ("dtod", "htod"))


def _graph_ragged(env, max_batch=4, **kw):
    return ragged(env, use_cuda_graph=True, qo_indptr_buf=T((max_batch + 1,), I32),
                  kv_indptr_buf=T((max_batch + 1,), I32), **kw)


def _mask_batch(seed, B=None):
    """(qo_indptr, kv_indptr, masks) of a random batch within the graph capacity (<= 17 tokens)."""
    rng = np.random.default_rng(seed)
    B = B or int(rng.integers(1, 5))
    qo = rng.multinomial(17, np.ones(B) / B) if seed % 2 else rng.integers(0, 17 // B + 1, B)
    kv = rng.integers(0, 300, B)
    masks = [rng.random(int(a) * int(b)) < 0.3 for a, b in zip(qo, kv)]
    ind = lambda x: np.concatenate([[0], np.cumsum(x)]).astype(np.int32)  # noqa: E731
    return ind(qo), ind(kv), masks


def test_graph_mode_mask_buffer_is_fixed_and_rewritten_per_plan(fake):
    w = _graph_ragged(fake)
    qi, ki, masks = _mask_batch(1, B=4)
    flat = fake.dev(np.concatenate(masks), BOOL)
    w.plan(qi, ki, HQ, HKV, D, custom_mask=flat)
    p = w._attn.params
    addr, indptr_addr = p.custom_mask, p.mask_indptr
    need = sum(-(-m.size // 8) for m in masks)
    assert w._mask_cap == max(2 * need, 64 << 10)
    fixed = {f: getattr(p, f) for f in ("work_request", "qo_indptr", "kv_indptr", "kv_chunk_size_dev")}
    for seed in range(2, 12):
        qi, ki, masks = _mask_batch(seed)
        packed = seed % 3 == 0
        kw = (dict(packed_custom_mask=fake.dev(np.frombuffer(_packed_segments(masks) + b"\0", np.uint8)))
              if packed else dict(custom_mask=fake.dev(np.concatenate(masks) if masks else np.zeros(0, bool), BOOL)))
        w.plan(qi, ki, HQ, HKV, D, **kw)
        p = w._attn.params
        assert (p.custom_mask, p.mask_indptr) == (addr, indptr_addr), "graph-mode mask addresses moved"
        assert {f: getattr(p, f) for f in fixed} == fixed, "graph-mode metadata addresses moved"
        _check_mask_params(fake, w, masks)
    assert not any(op[0] == "sync" for op in fake.cu.log)


def test_graph_mode_mask_over_capacity_names_the_buffer_and_keeps_the_plan(fake):
    w = _graph_ragged(fake, max_batch=2)
    qi, ki = i32(0, 1, 2), i32(0, 8, 16)  # 2 x 8 bits: the owned buffer gets 64 KiB
    w.plan(qi, ki, HQ, HKV, D, custom_mask=fake.dev(np.ones(16, bool), BOOL))
    cap = w._mask_cap
    big_qo = i32(0, 1, 2)
    big_kv = i32(0, cap * 8, cap * 8 + 8)  # 1 x (cap * 8) bits + 1 byte: one byte too many
    with pytest.raises(ValueError, match=rf"{cap + 1} bytes.*{cap}.*custom_mask_buf"):
        w.plan(big_qo, big_kv, HQ, HKV, D, packed_custom_mask=fake.dev(cap + 1))
    # the previous plan is intact and runs
    w.run(T((2, HQ, D)), T((16, HKV, D)), T((16, HKV, D), data=0x900000), out=T((2, HQ, D)))
    assert last_attn(fake)[3].custom_mask == w._mask_dev


def _capture_run(fake, w, q, *kv, out):
    fake.cu.capturing.add(0x5100)
    try:
        w.run(q, *kv, out=out, stream=0x5100)
    finally:
        fake.cu.capturing.discard(0x5100)


def test_capture_freezes_mask_presence_and_options(fake):
    w = _graph_ragged(fake)
    qi, ki, masks = _mask_batch(5, B=3)
    kv_total = int(ki[-1])
    args = (T((int(qi[-1]), HQ, D)), T((kv_total, HKV, D)), T((kv_total, HKV, D), data=0x900000))
    # before any capture, plans may change anything (here: a mask, then none, then causal)
    w.plan(qi, ki, HQ, HKV, D, custom_mask=fake.dev(np.concatenate(masks), BOOL))
    w.plan(qi, ki, HQ, HKV, D, causal=True)
    w.plan(qi, ki, HQ, HKV, D)
    w.run(*args, out=T((int(qi[-1]), HQ, D)))  # an eager run does not freeze anything
    assert w._captured is None
    _capture_run(fake, w, *args, out=T((int(qi[-1]), HQ, D)))
    assert w._captured is not None
    sig = dict(w._captured)
    # same options, other lengths: fine
    qi2, ki2, masks2 = _mask_batch(6, B=2)
    w.plan(qi2, ki2, HQ, HKV, D)
    for kw, pattern in [
        (dict(custom_mask=fake.dev(np.concatenate(masks2), BOOL)), r"custom_mask.*without a custom mask"),
        (dict(causal=True), r"causal"),
        (dict(window_left=3), r"window_left"),
        (dict(sm_scale=0.3), r"sm_scale"),
        (dict(logits_soft_cap=5.0), r"logits_soft_cap"),
        (dict(kv_data_type="float8_e4m3fn"), r"kv_data_type"),
        (dict(q_data_type="bfloat16"), r"q_data_type"),
        (dict(pos_encoding_mode="ALIBI"), r"pos_encoding_mode"),
        (dict(disable_split_kv=True), r"workspace|kernel"),
    ]:
        before = bytes(w._attn.params)
        with pytest.raises(ValueError, match=pattern):
            w.plan(qi2, ki2, HQ, HKV, D, **kw)
        assert bytes(w._attn.params) == before, "a refused plan changed the kernel params"
    assert w._captured == sig
    with pytest.raises(ValueError, match="float_workspace_buffer"):
        w.reset_workspace_buffer(WS(fake))
    w.reset_workspace_buffer(w._ws_buf)  # the same buffer is fine


def test_capture_with_mask_refuses_a_plan_without_one(fake):
    w = _graph_ragged(fake)
    qi, ki, masks = _mask_batch(7, B=3)
    kv_total = int(ki[-1])
    w.plan(qi, ki, HQ, HKV, D, custom_mask=fake.dev(np.concatenate(masks), BOOL))
    _capture_run(fake, w, T((int(qi[-1]), HQ, D)), T((kv_total, HKV, D)), T((kv_total, HKV, D), data=0x900000),
                 out=T((int(qi[-1]), HQ, D)))
    with pytest.raises(ValueError, match=r"custom_mask.*with a custom mask.*all-True"):
        w.plan(qi, ki, HQ, HKV, D)
    qi2, ki2, masks2 = _mask_batch(8, B=4)
    w.plan(qi2, ki2, HQ, HKV, D, custom_mask=fake.dev(np.concatenate(masks2), BOOL))  # with a mask: fine
    _check_mask_params(fake, w, masks2)


def test_fast_path_capture_is_noticed(fake, fake_torch):
    w = _graph_ragged(fake)
    qi, ki, _ = _mask_batch(9, B=2)
    q, k, v, o = (fake_torch.tensor(s, "float16") for s in ((int(qi[-1]), HQ, D), (int(ki[-1]), HKV, D),
                                                            (int(ki[-1]), HKV, D), (int(qi[-1]), HQ, D)))
    w.plan(qi, ki, HQ, HKV, D)
    w.run(q, k, v, out=o)
    w.run(q, k, v, out=o)  # the fast path from here on
    assert w._fast_key is not None and w._captured is None
    fake_torch.stream = 0x5100
    fake.cu.capturing.add(0x5100)
    w.run(q, k, v, out=o)
    fake.cu.capturing.clear()
    assert w._captured is not None
    with pytest.raises(ValueError, match="causal"):
        w.plan(qi, ki, HQ, HKV, D, causal=True)


# ---------------------------------------------------------------------------------------------
# the torch fast path (a fake torch module: pyflashattn reads attributes, never imports torch)
# ---------------------------------------------------------------------------------------------
class _TorchDtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"


_TorchDtype.__module__ = "torch"


class FakeTorch:
    def __init__(self, env):
        self.env = env
        self.stream = 0
        self.module = types.ModuleType("torch")
        self.module._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda dev: self.stream)
        self.dtypes = {n: _TorchDtype(n) for n in ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float32")}
        for n, dt in self.dtypes.items():
            setattr(self.module, n, dt)
        # the fast paths' output allocators (see _tensor.torch_empty_like / torch_empty_f32)
        self.module.contiguous_format = "torch.contiguous_format"
        self.allocs = []

        def empty_like(t, memory_format=None):
            assert memory_format == "torch.contiguous_format"
            self.allocs.append(("empty_like", tuple(t.shape), t.dtype))
            return FakeTorchTensor(self, tuple(t.shape), t.dtype, 0xE00000)

        def empty(shape, dtype=None, device=None):
            assert device == "cuda:0"
            self.allocs.append(("empty", tuple(shape), dtype))
            return FakeTorchTensor(self, tuple(shape), dtype, 0xE10000)

        self.module.empty_like, self.module.empty = empty_like, empty

    def tensor(self, shape, dtype, ptr=None):
        dt = self.dtypes[dtype] if isinstance(dtype, str) else dtype
        n = math.prod(shape) * _dtypes.normalize(str(dt)).bits // 8
        return FakeTorchTensor(self, tuple(shape), dt, ptr or self.env.cu._alloc(max(n, 16)))


class FakeTorchTensor:
    def __init__(self, torch, shape, dtype, ptr):
        self._torch, self.shape, self.dtype, self._ptr = torch, shape, dtype, ptr
        self._strides = _compact(shape)
        self.is_cuda, self.is_cpu, self.layout, self.device = True, False, "torch.strided", "cuda:0"

    def stride(self):
        return self._strides

    def get_device(self):
        return 0

    def data_ptr(self):
        return self._ptr

    def new_empty(self, shape, dtype=None):
        # outputs are never dereferenced by the fake driver: no memory behind them
        return FakeTorchTensor(self._torch, tuple(shape), dtype or self.dtype, 0xE00000)


FakeTorchTensor.__module__ = "torch"


@pytest.fixture
def fake_torch(fake, monkeypatch):
    ft = FakeTorch(fake)
    monkeypatch.setitem(sys.modules, "torch", ft.module)
    monkeypatch.setattr(_tensor, "_TORCH_STRIDED", {"torch.strided"})
    monkeypatch.setattr(_tensor, "_TORCH_BY_NAME", {})  # dtypes cached from a real torch imported earlier
    return ft


def test_torch_fast_path_allocates_contiguous_outputs(fake, fake_torch):
    """run() without out= on the fast path: o like q (contiguous), lse float32 [total_q, Hq], and
    the kernel writes where they are."""
    w = ragged(fake)
    plan_ragged(w)
    ft = fake_torch
    q, k, v = ft.tensor((TQ, HQ, D), "float16"), ft.tensor((TKV, HKV, D), "float16"), ft.tensor((TKV, HKV, D), "float16")
    w.run(q, k, v, return_lse=True)  # the full path validates and remembers the signature
    assert w._fast_key is not None
    ft.allocs.clear()
    o, lse = w.run(q, k, v, return_lse=True)
    assert ft.allocs == [("empty_like", (TQ, HQ, D), ft.dtypes["float16"]),
                         ("empty", (TQ, HQ), ft.dtypes["float32"])]
    assert o.stride() == _compact((TQ, HQ, D)) and lse.shape == (TQ, HQ)
    p = last_attn(fake)[3]
    assert (p.o, p.lse) == (o._ptr, lse._ptr)
    assert (p.o_stride_n, p.o_stride_h) == (HQ * D, D)


@pytest.mark.parametrize("kvdt", ["float16", "float8_e4m3fn"])
def test_torch_fast_path_applies_scales_and_rereads_pointers(fake, fake_torch, kvdt):
    w = ragged(fake)
    plan_ragged(w, kv_data_type=kvdt, sm_scale=0.25)
    ft = fake_torch
    q, o = ft.tensor((TQ, HQ, D), "float16"), ft.tensor((TQ, HQ, D), "float16")
    k, v = ft.tensor((TKV, HKV, D), kvdt), ft.tensor((TKV, HKV, D), kvdt)
    w.run(q, k, v, out=o)
    key = w._fast_key
    assert key is not None
    for ks, vs in [(0.5, 2.0), (None, None), (2, 0.125)]:
        q2, k2, v2, o2 = (ft.tensor(t.shape, t.dtype) for t in (q, k, v, o))
        r = w.run(q2, k2, v2, out=o2, k_scale=ks, v_scale=vs)
        assert r is o2 and w._fast_key == key
        p = last_attn(fake)[3]
        assert (p.q, p.k, p.v, p.o) == (q2._ptr, k2._ptr, v2._ptr, o2._ptr)
        assert p.sm_scale_log2 == pytest.approx(_f32(0.25 * LOG2E * (ks or 1.0)))
        assert p.v_scale == (vs or 1.0)
    # another dtype: the fast path misses and the full checks name the argument
    with pytest.raises(TypeError, match=r"\bk\b"):
        w.run(q, ft.tensor((TKV, HKV, D), "bfloat16"), v, out=o)


def test_paged_fast_path_keeps_the_cache_form_checks(fake, fake_torch):
    w = paged(fake)
    plan_paged(w, kv_data_type="float8_e5m2")
    ft = fake_torch
    q, o = ft.tensor((TQ, HQ, D), "float16"), ft.tensor((TQ, HQ, D), "float16")
    c = ft.tensor((NPAGES, 2, PS, HKV, D), "float8_e5m2")
    w.run(q, c, out=o)
    w.run(q, c, out=o)  # fast path
    p = last_attn(fake)[3]
    assert p.v - p.k == PS * HKV * D  # the V half of the 5-D cache, one byte per element
    n = len(fake.attn_launches())
    with pytest.raises(ValueError, match="tuple"):
        w.run(q, (c,), out=o)  # a 1-tuple is refused even though it holds the remembered cache
    kc, vc = ft.tensor((NPAGES, PS, HKV, D), "float8_e5m2"), ft.tensor((NPAGES, PS, HKV, D), "float8_e5m2")
    w.run(q, (kc, vc), out=o)
    w.run(q, (kc, vc), out=o)
    assert len(fake.attn_launches()) == n + 2
    p = last_attn(fake)[3]
    assert (p.k, p.v) == (kc._ptr, vc._ptr)


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_enable_pdl_launches_the_attention_programmatically(fake, fake_torch, kind):
    """enable_pdl=True: the attention kernel goes through cuLaunchKernelEx with programmatic
    stream serialization, over the plan's own params struct and grid (full and fast paths,
    across a re-plan that changes the grid); None / False: the plain launch."""
    w = paged(fake) if kind == "paged" else ragged(fake)
    plan = plan_paged if kind == "paged" else plan_ragged
    plan(w)
    ft = fake_torch
    q, o = ft.tensor((TQ, HQ, D), "float16"), ft.tensor((TQ, HQ, D), "float16")
    kv = ((ft.tensor((NPAGES, 2, PS, HKV, D), "float16"),) if kind == "paged"
          else (ft.tensor((TKV, HKV, D), "float16"), ft.tensor((TKV, HKV, D), "float16")))

    def attn_log():
        return [e[0] for e in fake.cu.log if e[0].startswith("launch") and "prefill" in e[1]]

    for pdl in (True, True, None, False, True):  # full path, then the fast path
        fake.cu.log.clear()
        w.run(q, *kv, out=o, enable_pdl=pdl)
        assert attn_log() == ["launch_pdl" if pdl else "launch"]
        name, grid, stream, p = last_attn(fake)
        assert grid == w._attn.grid and (p.q, p.o) == (q._ptr, o._ptr)
    before = w._attn.grid
    if kind == "paged":  # the same tokens as one request: one work item, another grid
        w.plan(i32(0, TQ), i32(0, 3), KV_INDICES, i32(3), HQ, HKV, D, PS)
    else:
        w.plan(i32(0, TQ), i32(0, TKV), HQ, HKV, D)
    assert w._attn.grid != before
    fake.cu.log.clear()
    w.run(q, *kv, out=o, enable_pdl=True)
    assert attn_log() == ["launch_pdl"] and last_attn(fake)[1] == w._attn.grid


def test_decode_tile_only_when_every_request_fits_decode_max_rows(fake):
    """The decode tiles (prefill.decode_tiles) for batches whose longest request fits one: 16 rows,
    and over fp8 or paged K/V also the 32- and 64-row tiles; over ragged 16-bit K/V up to
    DECODE_MAX_ROWS[head_dim] packed rows as two 16-row tiles. Each with a plan on its tile and its
    CTAs per SM; the 128-row kernel otherwise and with options only the general kernels carry. In
    CUDA-graph mode the first plan picks for good."""
    assert pyflashattn.prefill.DECODE_MAX_ROWS == {64: 32, 128: 32, 256: 16}
    w = ragged(fake)  # 8 / 2 heads: group 4
    w.plan(i32(0, 4, 5, 5, 7), i32(0, 900, 1700, 1800, 3000), HQ, HKV, D, causal=True)
    la = w._attn
    assert la.meta["decode"] and la.meta["block_m"] == 16 and la.threads == 32
    assert w._plan.block_m == 16
    assert last_cfg_ctas(w) == 233472 // (36992 + 1024)  # 6 on an H100's 228 KB (hd128, 32-key tiles)
    # 8 x 4 = 32 rows: two row tiles of the 16-row tile (contiguous 16-bit K/V: decode_tiles)
    w.plan(i32(0, 8, 9), i32(0, 900, 1700), HQ, HKV, D, causal=True)
    assert w._attn is la and w._plan.block_m == 16
    p = w._plan
    assert set(zip(p.work_request[:p.num_work].tolist(), p.work_qtile[:p.num_work].tolist())) == {
        (0, 0), (0, 1), (1, 0)}  # (request, row tile) of every work item, KV chunks aside
    # ... and the 32-row tile (two warps sharing each K/V tile) over fp8 K/V or a page table
    w.plan(i32(0, 8, 9), i32(0, 900, 1700), HQ, HKV, D, causal=True, kv_data_type="float8_e4m3fn")
    la32 = w._attn
    assert la32.meta["decode"] and la32.meta["block_m"] == 32 and la32.threads == 64 and w._plan.block_m == 32
    p = w._plan
    assert set(zip(p.work_request[:p.num_work].tolist(), p.work_qtile[:p.num_work].tolist())) == {(0, 0), (1, 0)}
    w.plan(i32(0, 5, 6), i32(0, 900, 1700), HQ, HKV, D, causal=True, kv_data_type="float8_e4m3fn")  # 20 rows
    assert w._attn is la32
    w.plan(i32(0, 4, 5), i32(0, 900, 1700), HQ, HKV, D, causal=True, kv_data_type="float8_e4m3fn")  # 16 rows
    assert w._attn.meta["block_m"] == 16
    w.plan(i32(0, 16, 17), i32(0, 900, 1700), HQ, HKV, D, causal=True, kv_data_type="float8_e4m3fn")  # 64 rows
    assert w._attn.meta["block_m"] == 64 and w._attn.threads == 128 and w._attn.meta["decode"]
    w.plan(i32(0, 17, 18), i32(0, 900, 1700), HQ, HKV, D, causal=True, kv_data_type="float8_e4m3fn")  # 68 rows
    assert not w._attn.meta["decode"] and w._plan.block_m == 128
    w.plan(i32(0, 16, 17), i32(0, 900, 1700), HQ, HKV, D, causal=True)  # 64 rows of 16-bit ragged K/V
    assert not w._attn.meta["decode"], "contiguous 16-bit K/V: several 16-row tiles up to DECODE_MAX_ROWS only"
    wp = paged(fake)
    wp.plan(i32(0, 8, 9), i32(0, 3, 5), i32(0, 1, 2, 3, 4), i32(5, 7), HQ, HKV, D, PS, causal=True)
    assert wp._attn.meta["block_m"] == 32 and wp._attn.meta["paged"] and last_cfg_ctas(wp, 32) >= 2
    wp.plan(i32(0, 12, 13), i32(0, 3, 5), i32(0, 1, 2, 3, 4), i32(5, 7), HQ, HKV, D, PS, causal=True)  # 48 rows
    assert wp._attn.meta["block_m"] == 64 and last_cfg_ctas(wp, 64) >= 2
    w.plan(i32(0, 9, 10), i32(0, 900, 1700), HQ, HKV, D, causal=True)  # 9 x 4 = 36 rows
    assert not w._attn.meta["decode"] and w._plan.block_m == 128
    w.plan(i32(0, 4, 5), i32(0, 900, 1700), HQ, HKV, D, causal=True, logits_soft_cap=3.0)
    assert not w._attn.meta["decode"], "soft cap lives in the general kernels"
    def graph_wrapper():
        return Ragged(WS(fake), "NHD", use_cuda_graph=True, qo_indptr_buf=T((9,), _dtypes.INT32, data=0x700000),
                      kv_indptr_buf=T((9,), _dtypes.INT32, data=0x710000))

    g = graph_wrapper()  # a decode graph: the decode tile, kept for a later plan that does not fit
    g.plan(i32(0, 4, 5, 9), i32(0, 900, 1700, 1800), HQ, HKV, D, causal=True)
    assert g._attn.meta["decode"]
    grid = g._attn.grid
    g.plan(i32(0, 9), i32(0, 900), HQ, HKV, D, causal=True)  # 9 x 4 = 36 rows: three 16-row tiles
    assert g._attn.meta["decode"] and g._attn.grid == grid and g._plan.block_m == 16
    assert set(g._plan.work_qtile[:g._plan.num_work].tolist()) == {0, 1, 2}
    g = graph_wrapper()  # a 32-row decode graph (fp8 K/V) keeps its tile for 8-row and 36-row plans
    fp8 = dict(causal=True, kv_data_type="float8_e4m3fn")
    g.plan(i32(0, 8, 9), i32(0, 900, 1700), HQ, HKV, D, **fp8)
    assert g._attn.meta["block_m"] == 32
    g.plan(i32(0, 1, 2), i32(0, 900, 1700), HQ, HKV, D, **fp8)
    assert g._attn.meta["block_m"] == 32 and g._plan.block_m == 32
    g.plan(i32(0, 9), i32(0, 900), HQ, HKV, D, **fp8)  # 36 rows: two 32-row tiles
    assert g._attn.meta["block_m"] == 32 and set(g._plan.work_qtile[:g._plan.num_work].tolist()) == {0, 1}
    g = graph_wrapper()  # a prefill graph: the 128-row tile, also for a later decode plan
    g.plan(i32(0, 12), i32(0, 900), HQ, HKV, D, causal=True)
    assert not g._attn.meta["decode"]
    g.plan(i32(0, 4, 5), i32(0, 900, 1700), HQ, HKV, D, causal=True)
    assert not g._attn.meta["decode"]


def last_cfg_ctas(w, rows=16):
    """CTAs per SM the cached config plans the `rows`-row decode tile with."""
    return next(iter(w._configs.values()))[-1][rows][2]


def test_enable_pdl_before_sm90_is_the_plain_launch(fake, monkeypatch):
    monkeypatch.setattr(_cuda, "properties", lambda dev: {"sm_count": 108, "cc": (8, 0), "smem_per_sm": 167936})
    w = ragged(fake)
    plan_ragged(w)
    w.run(q_t(), kv_t(), kv_t(data=0x380000), out=out_t(), enable_pdl=True)
    assert [e[0] for e in fake.cu.log if e[0].startswith("launch")] == ["launch"]


# ---------------------------------------------------------------------------------------------
# streams, state and JAX-style producers
# ---------------------------------------------------------------------------------------------
def test_first_run_on_another_stream_waits_for_the_plan_copy_once(fake):
    w = ragged(fake)
    plan_ragged(w, stream=0x11)
    assert [op for op in fake.cu.log if op[0] == "htod"][-1][-1] == 0x11, "metadata copy not on the plan stream"
    assert not any(op[0] == "sync" for op in fake.cu.log), "plan() must not synchronise"
    fake.cu.log.clear()
    w.run(q_t(), kv_t(), kv_t(data=0x380000), out=out_t(), stream=0x22)
    ops = [op for op in fake.cu.log if op[0] in ("record", "wait", "launch")]
    assert ops[:3] == [("record", 0x11), ("wait", 0x22), ("launch", ops[2][1], 0x22)]
    fake.cu.log.clear()
    w.run(q_t(), kv_t(), kv_t(data=0x380000), out=out_t(), stream=0x22)
    assert [op[0] for op in fake.cu.log] == ["launch"], "later runs need no wait"


def test_device_index_arrays_are_copied_on_a_stream_then_synced(fake):
    w = ragged(fake)
    qo = fake.dev(QO, I32)
    plan_ragged(w) if False else w.plan(qo, RAGGED_KV, HQ, HKV, D)
    dtoh = [op for op in fake.cu.log if op[0] == "dtoh"]
    assert dtoh and dtoh[0][1] == qo.args[3]
    syncs = [op for op in fake.cu.log if op[0] == "sync"]
    assert syncs and syncs[0][1] == dtoh[0][3]
    assert qo.calls[-1]["stream"] == dtoh[0][3], "the producer was not asked to order its writes first"


class _JaxLike(FakeProducer):
    pass


_JaxLike.__module__ = "jax._src.array"


def test_jax_inputs_get_the_launch_stream_handshake(fake):
    w = paged(fake)
    plan_paged(w)
    q = _JaxLike(shape=(TQ, HQ, D), strides=_compact((TQ, HQ, D)), dtype=F16, data=0x100000)
    c = _JaxLike(shape=(NPAGES, 2, PS, HKV, D), strides=_compact((NPAGES, 2, PS, HKV, D)), dtype=F16, data=0x200000)
    w.run(q, c, out=out_t())
    s = last_attn(fake)[2]
    assert s == 0x5100  # JAX has no current stream: the library stream
    assert q.calls[-1]["stream"] == s and c.calls[-1]["stream"] == s


def test_refused_plan_keeps_the_previous_paged_state(fake):
    w = Paged(fake.dev(1 << 20), "NHD")  # a small workspace
    plan_paged(w)
    # a plan with another page size and a long, split request that needs more workspace
    with pytest.raises(ValueError, match="float_workspace_buffer"):
        w.plan(i32(0, 16), i32(0, 60000), np.arange(60000, dtype=np.int32), i32(1), HQ, HKV, D, 1,
               fixed_split_size=256)
    assert (w._page_size, w._max_page) == (PS, 4)
    w.run(q_t(), cache_t(), out=out_t())  # the old plan still runs against its own cache shape
    assert last_attn(fake)[3].page_size == PS


# ---------------------------------------------------------------------------------------------
# metadata staging: what the kernels read through the params pointers is plan_prefill()'s plan
# ---------------------------------------------------------------------------------------------
def _staging_batches(rng, max_batch, max_q):
    """Random batches within a capacity: split and unsplit, requests without queries or pages."""
    for step in range(10):
        B = int(rng.integers(1, max_batch + 1))
        qo = rng.multinomial(max_q, np.ones(B) / B) if step == 0 else rng.integers(0, max_q // B + 1, B)
        # few tiles and long KV: split; KV shorter than a minimum chunk: not split
        kv = qo + rng.integers(0, 20000, B) if step % 3 else rng.integers(0, 250, B)
        if step % 4 == 3:
            kv[rng.integers(0, B)] = 0
        yield qo.astype(np.int64), kv.astype(np.int64)


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_staged_metadata_is_the_plan(fake, kind, graph):
    from pyflashattn._plan import plan_prefill

    max_batch, max_q, max_pages = 12, 600, 30000
    bufs = {}
    if graph and kind == "paged":
        bufs = dict(qo_indptr_buf=T((max_batch + 1,), I32), paged_kv_indptr_buf=T((max_batch + 1,), I32),
                    paged_kv_indices_buf=T((max_pages,), I32), paged_kv_last_page_len_buf=T((max_batch,), I32))
    elif graph:
        bufs = dict(qo_indptr_buf=T((max_batch + 1,), I32), kv_indptr_buf=T((max_batch + 1,), I32))
    w = (paged if kind == "paged" else ragged)(fake, use_cuda_graph=graph, **bufs)
    ind = lambda x: np.concatenate([[0], np.cumsum(x)]).astype(np.int32)  # noqa: E731
    rng = np.random.default_rng(11)
    for qo, kv in _staging_batches(rng, max_batch, max_q):
        qi = ind(qo)
        if kind == "paged":
            pages = -(-kv // PS)
            last = np.where(pages > 0, kv - (pages - 1) * PS, rng.integers(0, PS + 5, kv.size)).astype(np.int32)
            idx = rng.permutation(int(pages.sum()) + 3).astype(np.int32)  # longer than used
            plan = w.plan(qi, ind(pages), idx, last, HQ, HKV, D, PS, causal=True)
        else:
            plan = w.plan(qi, ind(kv), HQ, HKV, D, causal=True)
        meta = w._attn.meta
        want = plan_prefill(qi, kv, group_size=HQ // HKV, num_kv_heads=HKV, block_m=meta["block_m"],
                            block_n=meta["block_n"], num_sms=132, ctas_per_sm=2 if meta["threads"] <= 128 else 1,
                            causal=True, graph_capacity=w._capacity)
        for name, a in want.int_arrays().items():
            np.testing.assert_array_equal(getattr(plan, name), a, err_msg=name)
        assert (plan.grid, plan.kv_chunk_size, plan.split) == (want.grid, want.kv_chunk_size, want.split)

        p, B, G = w._attn.params, qo.size, plan.grid
        dev = {"work_request": (p.work_request, G), "work_qtile": (p.work_qtile, G),
               "work_chunk": (p.work_chunk, G), "num_chunks": (p.num_chunks, B), "qo_indptr": (p.qo_indptr, B + 1),
               "kv_indptr": (p.kv_indptr, B + 1)}
        host = dict(plan.int_arrays(), qo_indptr=qi, kv_indptr=ind(pages) if kind == "paged" else ind(kv))
        assert p.kv_chunk_size == plan.kv_chunk_size
        if graph:  # a replay reads the chunk size of the latest plan from the device
            dev["kv_chunk_size_dev"] = (p.kv_chunk_size_dev, 1)
            host["kv_chunk_size_dev"] = [plan.kv_chunk_size]
        else:  # the kernel takes the by-value field
            assert p.kv_chunk_size_dev == 0
        if kind == "paged":
            dev.update(kv_page_indices=(p.kv_page_indices, idx.size - 3), kv_last_page_len=(p.kv_last_page_len, B))
            host.update(kv_page_indices=idx[:-3], kv_last_page_len=last)
        merged = w._merge is not None
        assert merged == (plan.split or graph)
        if merged:
            rows = w._capacity["max_total_q"] if graph else plan.total_q
            mi = plan.merge_indptr
            dev.update(o_indptr=(p.o_indptr, B + 1), merge_indptr=(w._merge.params.merge_indptr, rows + 1))
            host["merge_indptr"] = np.concatenate([mi, np.full(rows + 1 - mi.size, mi[-1], np.int32)])
        else:
            assert p.o_indptr == 0
        for name, (addr, n) in dev.items():
            np.testing.assert_array_equal(fake.read(addr, n, np.int32), host[name], err_msg=name)


# ---------------------------------------------------------------------------------------------
# host time (not a test): PYTHONPATH=. python tests/test_batch_prefill_host.py
# ---------------------------------------------------------------------------------------------
def _bench():  # pragma: no cover - prints timings, asserts nothing
    mp = pytest.MonkeyPatch()
    env = FakeEnv(mp)
    ft = FakeTorch(env)
    mp.setitem(sys.modules, "torch", ft.module)
    mp.setattr(_tensor, "_TORCH_STRIDED", {"torch.strided"})

    def per_call(fn, n):
        for _ in range(3):
            fn()
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best.append((time.perf_counter() - t0) / n * 1e6)
        return min(best)

    ws = env.dev(512 << 20)
    for B in (64, 1024):
        rng = np.random.default_rng(B)
        qo = rng.integers(1, 257, B)
        kv = qo + rng.integers(0, 4097 - 256, B)
        ind = lambda x: np.concatenate([[0], np.cumsum(x)]).astype(np.int32)  # noqa: E731
        pages = -(-kv // 16)
        idx = rng.permutation(int(pages.sum())).astype(np.int32)
        last = (kv - (pages - 1) * 16).astype(np.int32)
        wp, wr = Paged(ws), Ragged(ws)
        n = 200 if B == 64 else 50
        qi, pi, ki = ind(qo), ind(pages), ind(kv)
        tp = per_call(lambda: wp.plan(qi, pi, idx, last, 32, 8, 128, 16, causal=True, q_data_type="bfloat16"), n)
        tr = per_call(lambda: wr.plan(qi, ki, 32, 8, 128, causal=True, q_data_type="bfloat16"), n)
        env.cu.launches.clear()
        env.cu.log.clear()
        print(f"plan() B={B}: paged {tp:.1f} us, ragged {tr:.1f} us (scheduler included, fake driver)")
    w = Ragged(ws)
    w.plan(ind([16] * 4), ind([16] * 4), 32, 8, 128, causal=True)
    q, o = ft.tensor((64, 32, 128), "float16"), ft.tensor((64, 32, 128), "float16")
    k = ft.tensor((64, 8, 128), "float16")
    la = w._attn
    t_launch = per_call(lambda: la(0), 5000)
    t_run = per_call(lambda: w.run(q, k, k, out=o), 5000)
    env.cu.launches.clear()
    print(f"run() torch fast path, out=: {t_run:.2f} us, of which the fake launch {t_launch:.2f} us "
          f"-> Python side {t_run - t_launch:.2f} us")




# ---------------------------------------------------------------------------------------------
# metadata staging: plan() never waits for the GPU to drain its stream
# ---------------------------------------------------------------------------------------------
def test_plan_does_not_wait_while_the_gpu_lags_and_reuses_finished_buffers(fake):
    w = ragged(fake)
    plan_ragged(w)
    st = w._staging
    assert len(st.pinned) == 1
    fake.cu.lagging = True  # no copy has run yet: every plan takes a fresh pinned buffer ...
    for n in range(2, st.MAX_PINNED + 1):
        fake.cu.log.clear()
        plan_ragged(w)
        assert len(st.pinned) == n
        assert not [e for e in fake.cu.log if e[0] in ("sync", "event_sync")], "plan() blocked on the GPU"
    hosts = {e[0] for e in st.pinned}
    assert len(hosts) == st.MAX_PINNED  # distinct buffers: no copy's bytes were overwritten
    fake.cu.log.clear()
    plan_ragged(w)  # ... up to MAX_PINNED, then it waits for the oldest copy instead of growing
    assert len(st.pinned) == st.MAX_PINNED and ("event_sync",) in fake.cu.log
    fake.cu.lagging = False  # copies done: buffers are reused, none added
    for _ in range(3):
        plan_ragged(w)
    assert len(st.pinned) == st.MAX_PINNED and {e[0] for e in st.pinned} == hosts


if __name__ == "__main__":  # pragma: no cover
    _bench()


# ---------------------------------------------------------------------------------------------
# single prefill: launch order (heads fastest, or a head's row tiles together for L2 reuse)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("supports, causal, window, rows_fastest", [
    (True, False, -1, True),     # equal-cost tiles in a kernel that reads the flag
    (True, True, -1, False),     # causal: longest-first order across heads
    (True, False, 300, False),   # window: tile costs differ too
    (False, False, -1, False),   # a kernel that ignores the flag never gets the other grid
])
def test_single_prefill_grid_order(fake, monkeypatch, supports, causal, window, rows_fastest):
    meta = dict(_META[256], rows_fastest=True) if supports else dict(_META[256])
    monkeypatch.setitem(_META, 256, meta)
    monkeypatch.setattr(pyflashattn.prefill._tls, "plans", {}, raising=False)  # no plan from another fake
    n, h = 4096, 8  # 32 row tiles x 8 heads: a full wave, no KV split
    q, k, v, out = (T((n, h, 256), data=a) for a in (0x100000, 0x200000, 0x300000, 0x400000))
    pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=causal, window_left=window, out=out)
    (name, grid, _, p), = fake.attn_launches()
    assert p.num_splits == 1
    if rows_fastest:
        assert grid == (32, 1, h) and p.rows_fastest == 1
    else:
        assert grid == (h, 1, 32) and p.rows_fastest == 0


# ---------------------------------------------------------------------------------------------
# single prefill: requests within DECODE_MAX_ROWS packed rows run on the 16-row decode tile
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qo, hq, hkv, D, kw, decode", [
    (1, 32, 8, 128, {}, True),                          # decode, GQA 4: 4 packed rows
    (4, 32, 8, 128, {"causal": True}, True),            # speculative decode: exactly 16 rows
    (8, 32, 8, 128, {"causal": True}, True),            # 32 rows: two row tiles of the decode tile
    (9, 32, 8, 128, {"causal": True}, False),           # 36 rows: the 128-row kernel
    (7, 8, 8, 64, {"window_left": 300}, True),          # MHA append with a window
    (32, 8, 8, 64, {"causal": True}, True),             # MHA, 32 rows at hd64
    (2, 64, 8, 256, {"causal": True}, True),            # GQA 8, hd256: 16 rows
    (5, 32, 8, 256, {"causal": True}, False),           # hd256 stays at 16 rows: 20 rows take the 128-row kernel
    (1, 32, 8, 128, {"logits_soft_cap": 30.0}, False),  # general options: the 128-row general kernel
])
def test_single_prefill_decode_tile(fake, monkeypatch, qo, hq, hkv, D, kw, decode):
    monkeypatch.setattr(pyflashattn.prefill._tls, "plans", {}, raising=False)
    kv_len = 20000
    q, k, v = T((qo, hq, D), data=0x100000), T((kv_len, hkv, D), data=0x200000), T((kv_len, hkv, D), data=0x300000)
    pyflashattn.single_prefill_with_kv_cache(q, k, v, out=T((qo, hq, D), data=0x400000), **kw)
    (name, grid, _, p), = fake.attn_launches()
    assert ("decode=True" in name) == decode and (("general=True" in name) == ("logits_soft_cap" in kw))
    merges = [x for x in fake.cu.launches if x[0].startswith("merge")]
    assert len(merges) == (p.num_splits > 1)
    if not decode:
        return
    # grid (kv heads, splits, 16-row tiles: single prefill has contiguous 16-bit K/V, so 17-32 rows
    # take two of them, decode_tiles), split exactly like a one-request ragged batch plan
    assert grid == (hkv, p.num_splits, -(-qo * (hq // hkv) // 16)) and p.rows_fastest == 0
    assert "block_m=16" in name
    assert p.num_splits > 1 and p.kv_chunk_size * p.num_splits >= kv_len > p.kv_chunk_size * (p.num_splits - 1)
    w = ragged(fake)
    w.plan(i32(0, qo), i32(0, kv_len), hq, hkv, D, causal=kw.get("causal", False),
           window_left=kw.get("window_left", -1))
    bp = w._attn.params
    assert w._attn.name == name and bp.kv_chunk_size == p.kv_chunk_size
    assert fake.read(bp.num_chunks, 1, np.int32)[0] == p.num_splits
