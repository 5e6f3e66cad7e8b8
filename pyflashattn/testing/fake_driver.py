"""A simulated CUDA driver and torch module for CPU tests of the engine (no GPU).

FakeDriver stands in for cuda.bindings: "device memory" is host memory (ctypes buffers),
copies are memmoves, the packbits kernel is executed in numpy and every attention / merge
launch is recorded with a copy of its params struct. FakeEnv installs it into the runtime (with
a manifest made of the variant table's rows); FakeTorch is a torch module with just the
attributes pyflashattn reads. tests/conftest.py makes them the ``fake`` / ``fake_torch``
fixtures. Numerics are the GPU tests' job.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import sys
import types

import numpy as np

import pyflashattn
from pyflashattn._engine import routing
from pyflashattn._runtime import cuda as _cuda, dtypes as _dtypes, registry as _registry, tensor as _tensor
from pyflashattn._runtime.params_gen import FAMILIES, MergeParams, PackbitsParams, PrefillParams
from pyflashattn.testing.fake_tensors import FakeProducer, fake_cuda_tensor
from pyflashattn.testing.fake_tensors import compact_strides as _compact

Paged = pyflashattn.BatchPrefillWithPagedKVCacheWrapper
Ragged = pyflashattn.BatchPrefillWithRaggedKVCacheWrapper
F16, BF16, U8, I32 = _dtypes.FLOAT16, _dtypes.BFLOAT16, _dtypes.UINT8, _dtypes.INT32
E4M3, E5M2, BOOL = _dtypes.FLOAT8_E4M3, _dtypes.FLOAT8_E5M2, _dtypes.BOOL
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# the simulated driver
# ---------------------------------------------------------------------------------------------

def check_divisor_fields(p, sm90: bool) -> None:
    """Every attention launch carries the multipliers of the divisors its kernel divides by
    (fastdiv.cuh): group_size's always, the logical grid's on the sm90 kernels (LogicalGrid)."""
    from .._engine.params import fast_divisor

    pairs = [("group", p.group_size)]
    if sm90:
        last = p.grid_x - (p.grid_x - 1) // p.grid_section * p.grid_section
        pairs += [("section", max(1, p.grid_section * p.grid_y * p.grid_section_z)), ("x", p.grid_section),
                  ("last_x", last), ("y", p.grid_y)]
    for name, d in pairs:
        got = (getattr(p, f"div_{name}_mul"), getattr(p, f"div_{name}_shift"))
        assert got == fast_divisor(d), f"PrefillParams.div_{name}_*: {got} for the divisor {d}"

class _Enum:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class FakeDriver:
    """The subset of cuda.bindings.driver the batch wrappers call, on host memory."""

    CUresult = _Enum(CUDA_SUCCESS=0, CUDA_ERROR_NOT_READY=600)
    lagging = False  # cuEventQuery says "not ready": a GPU that has not reached the copies yet
    CUevent_flags = _Enum(CU_EVENT_DISABLE_TIMING=2)
    CUstreamCaptureStatus = _Enum(CU_STREAM_CAPTURE_STATUS_NONE=0, CU_STREAM_CAPTURE_STATUS_ACTIVE=1)
    CUstreamCaptureMode = _Enum(CU_STREAM_CAPTURE_MODE_GLOBAL=0, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL=1,
                                CU_STREAM_CAPTURE_MODE_RELAXED=2)

    def __init__(self):
        self.mem = {}  # address -> ctypes buffer (device and pinned host alike)
        self.log = []  # (op, ...) in call order
        self.launches = []  # (kernel name, grid, stream, params copy)
        self.capturing = set()  # streams under capture
        self.funcs = {}
        self.freed = []
        # kernel models run at launch, by params struct: fn(params copy, grid, kernel name) (a test
        # registers its kernel's numpy model here; packbits is modelled for every test)
        self.simulators = {PackbitsParams: lambda p, grid, name: _simulate_packbits(p, grid)}

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
        self.log.append(("free_async", a, s, self.capture_mode))
        return (0,)

    capture_mode = 0  # this (one) thread's stream capture interaction mode

    def cuThreadExchangeStreamCaptureMode(self, mode):
        prev, self.capture_mode = self.capture_mode, mode
        return 0, prev

    def cuMemsetD8(self, dst, value, n):
        self.log.append(("memset", dst, n))
        ctypes.memset(dst, value, n)
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
        assert (by, bz, extra) == (1, 1, 0) and bx in (32, 64, 128, 256, 384, 512) and smem >= 0
        argv = ctypes.cast(argv_addr, ctypes.POINTER(ctypes.c_void_p))
        p = ptype.from_buffer_copy(ctypes.string_at(argv[0], ctypes.sizeof(ptype)))
        grid = (gx, gy, gz)
        if ptype.__name__ == "PrefillParams":
            check_divisor_fields(p, "sm90" in str(name))
        self.launches.append((name, grid, stream, p))
        self.log.append(("launch", name, stream))
        model = self.simulators.get(ptype)
        if model is not None:
            model(p, grid, name)
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


    # tensor maps (cuTensorMapEncodeTiled): 128 bytes, the address / 16 in the first 6 (as a map
    # may keep it: tma.py learns where) and a digest of everything else after them
    CUtensorMapDataType = _Enum(CU_TENSOR_MAP_DATA_TYPE_UINT8=0, CU_TENSOR_MAP_DATA_TYPE_FLOAT16=6,
                                CU_TENSOR_MAP_DATA_TYPE_BFLOAT16=9)
    CUtensorMapInterleave = _Enum(CU_TENSOR_MAP_INTERLEAVE_NONE=0)
    CUtensorMapSwizzle = _Enum(CU_TENSOR_MAP_SWIZZLE_128B=3)
    CUtensorMapL2promotion = _Enum(CU_TENSOR_MAP_L2_PROMOTION_L2_256B=3)
    CUtensorMapFloatOOBfill = _Enum(CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE=0)
    cuuint64_t = cuuint32_t = staticmethod(int)

    def cuTensorMapEncodeTiled(self, kind, rank, ptr, dims, strides, box, elem_strides, interleave, swizzle, l2,
                               oob):
        assert rank == len(dims) == len(box) == len(elem_strides) == len(strides) + 1 and 3 <= rank <= 5
        assert ptr % 16 == 0 and all(s % 16 == 0 and 0 < s < 1 << 40 for s in strides)
        item = 1 if kind == self.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8 else 2
        assert all(0 < b <= 256 for b in box) and box[0] * item <= 128 and all(0 < d < 1 << 32 for d in dims)
        geometry = (kind, tuple(dims), tuple(strides), tuple(box), swizzle)
        self.log.append(("tmap", ptr, geometry))
        digest = hashlib.sha256(repr(geometry).encode()).digest() * 4
        buf = ctypes.create_string_buffer((ptr >> 4).to_bytes(6, "little") + digest[:122], 128)
        self.mem[ctypes.addressof(buf)] = buf
        return 0, _Enum(getPtr=lambda: ctypes.addressof(buf))

    def cuTensorMapReplaceAddress(self, tmap, ptr):
        assert ptr % 16 == 0
        self.log.append(("tmap_address", ptr))
        ctypes.memmove(tmap.getPtr(), (ptr >> 4).to_bytes(6, "little"), 6)
        return (0,)


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


def _decode_variant(variants, match):
    """The decode-tile row of build_tools/variants.py that the registry would pick for `match`."""
    kv = match.get("kv_dtype") or match["dtype"]
    return next(v for v in variants if getattr(v, "decode", False) and v.dtype == match["dtype"]
                and v.kv == kv and v.head_dim == match["head_dim"] and v.paged == bool(match.get("paged"))
                and v.block_m == match.get("block_m", 16))


# helper kernels the fake launches under their variant-table name and threads (pfa_cascade_f16,
# pfa_page; the attention, merge and packbits kernels keep the fake's descriptive names)
_MISC_BY_ROW = ("cascade", "page")


def _misc_variant(variants, family, match):
    """The MiscVariant row of build_tools/variants.py for a cascade / page launcher (None otherwise)."""
    if family not in _MISC_BY_ROW:
        return None
    return next(v for v in variants if getattr(v, "family", None) == family and v.dtype == match.get("dtype", ""))


_META = {64: dict(block_m=128, block_n=64, threads=128, ctas_per_sm=2),
         128: dict(block_m=128, block_n=64, threads=128, ctas_per_sm=2),
         256: dict(block_m=128, block_n=64, threads=256, ctas_per_sm=1)}


class FakeEnv:
    """Installs FakeDriver into pyflashattn._runtime.cuda / _registry (see the ``fake`` fixture)."""

    def __init__(self, monkeypatch, variants):
        self.cu = cu = FakeDriver()
        monkeypatch.setattr(_cuda, "driver", lambda: cu)
        monkeypatch.setattr(_cuda, "ensure_context", lambda dev: None)
        monkeypatch.setattr(_cuda, "properties", lambda dev: {"sm_count": 132, "cc": (9, 0), "smem_per_sm": 233472})
        monkeypatch.setattr(_cuda, "_streams", {0: 0x5100})
        monkeypatch.setattr(_cuda, "library_stream", lambda dev: 0x5100)

        def new_launcher(family, dev, **match):
            ptype = FAMILIES[family]  # every kernel family of the params schema
            misc = _misc_variant(variants, family, match)
            if misc is not None:  # the helper kernels: their table row's name, threads and manifest
                la = _cuda.Launcher(misc.name, (misc.name, ptype), ptype, misc.threads, 0)
                la.meta = dict(misc.manifest(), name=misc.name)
                return la
            name = family + "".join(f"_{k}={v}" for k, v in sorted(match.items()))
            if family == "merge":  # its table row's grid shape (rows_per_block), the fake's name
                v = next(v for v in variants if getattr(v, "cta_per_row", None) == match.get("cta_per_row", False)
                         and v.dtype == match["dtype"])
                meta = dict(v.manifest(), **match)
            elif match.get("decode"):  # the decode tiles, as variants.py builds them
                v = _decode_variant(variants, match)
                meta = dict(match, block_m=v.block_m, block_n=v.block_n, threads=v.threads, smem_bytes=v.smem_bytes,
                            ctas_per_sm=v.ctas_per_sm, skip_softmax_rows=v.skip_softmax_rows, spec_mask=v.spec_mask,
                            nvfp4_out=v.nvfp4_out, device_scale=v.device_scale, reg_widen=v.reg_widen)
            else:
                meta = dict(_META.get(match.get("head_dim"), dict(block_m=0, block_n=0, threads=256, ctas_per_sm=1)),
                            smem_bytes=0, **match)
                # the sm80 rule (variants.py): the general 128-row kernels vote per warp, the lean ones lack it
                meta.setdefault("skip_softmax_rows", 32 if match.get("general") else 0)
                # NVFP4 output (variants.py's nvfp4_out): asked for by match; paged kernels but hd256 general
                meta.setdefault("nvfp4_out", bool(match.get("paged")) and not (match.get("general") and
                                                                             match.get("head_dim") == 256))
                if match.get("dtype") == "e4m3":  # the sm90 fp8 rows: their manifest's device_scale
                    meta.setdefault("device_scale", next(v.manifest()["device_scale"] for v in variants
                                                         if type(v).__name__ == "HopperFp8PrefillVariant"
                                                         and v.head_dim == match.get("head_dim")))
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
        # the manifest the routing reads (which decode tiles were built): the variant table's rows
        rows = [dict(v.manifest(), name=v.name, arch="sm_90a") for v in variants]
        monkeypatch.setattr(_registry, "manifest", lambda: {"kernels": rows})
        monkeypatch.setattr(routing, "_decode_rows_cache", {})

    def use_sm90_rows(self, monkeypatch, variants):
        """Make the 16-bit and e4m3 lean row-tile launchers the sm90 rows among `variants`
        (variants.py rows, TUNE=1 ones included), by name too: the K/V load routing
        (routing.kv_load_pair, routing.dense_twin) then sees cp.async rows and their TMA and dense
        twins as the manifest lists them."""
        from pyflashattn._runtime.params_gen import PrefillParams as _Params
        hopper = {v.name: v for v in variants
                  if type(v).__name__ in ("HopperPrefillVariant", "HopperFp8PrefillVariant")}
        fake_new = _registry.new_launcher

        def new_launcher(family, dev, **match):
            name = match.get("name")
            v = hopper.get(name)
            if v is None and name is None and family == "prefill" and not match.get("decode") \
                    and not match.get("general") and match.get("kv_dtype") == match.get("dtype"):
                v = next((r for r in hopper.values() if r.dtype == match["dtype"] and r.head_dim == match["head_dim"]
                          and r.paged == match["paged"] and match.get("block_m", r.block_m) == r.block_m
                          and not (r.tune or r.tma or r.manifest().get("twin_of"))), None)
            if v is None:
                return fake_new(family, dev, **match)
            la = _cuda.Launcher(v.name, (v.name, _Params), _Params, v.threads, v.smem_bytes)
            la.meta = dict(v.manifest(), name=v.name)
            return la

        monkeypatch.setattr(_registry, "new_launcher", new_launcher)

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
        return [x for x in self.cu.launches if x[0].startswith(("prefill", "pfa_prefill"))]

    def assert_refused_before_anything_runs(self, call, exc, pattern):
        """call() raises exc (message matching pattern) having launched, copied to the device and
        allocated nothing: the bad-argument contract of every entry point."""
        import pytest  # test support only: the library never imports pytest

        self.cu.log.clear()
        with pytest.raises(exc, match=pattern):
            call()
        assert not self.cu.launches and not [op for op in self.cu.log if op[0] in ("htod", "alloc")]


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


def f32(x):
    """x rounded to float32, as a params struct stores it."""
    return float(np.float32(x))


def last_attn(env):
    launches = env.attn_launches()
    assert launches, "nothing was launched"
    return launches[-1]


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
