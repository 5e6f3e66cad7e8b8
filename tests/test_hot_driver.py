"""The per-call driver path (pyflashattn._hot_driver) on CPU: the CUlaunchConfig layout, what
CtypesHot hands to libcuda (against a ctypes double of the four entry points), the same-library
check, and that a simulated driver gets the cuda.bindings-shaped path."""
from __future__ import annotations

import ctypes
import types

import pytest

from pyflashattn import _cuda, _hot_driver

VP, I32 = ctypes.c_void_p, ctypes.c_int


def test_launch_config_layout_matches_cuda_h():
    # cuda.h: seven unsigned ints, then CUstream, CUlaunchAttribute*, unsigned int (64-bit ABI)
    L = _hot_driver.LaunchConfig
    assert [getattr(L, f).offset for f in ("gridDimX", "gridDimY", "gridDimZ", "blockDimX", "blockDimY",
                                           "blockDimZ", "sharedMemBytes")] == [0, 4, 8, 12, 16, 20, 24]
    assert (L.hStream.offset, L.attrs.offset, L.numAttrs.offset, ctypes.sizeof(L)) == (32, 40, 48, 56)


class _FakeLib:
    """ctypes callbacks standing in for libcuda's entry points; records every call."""

    def __init__(self, ctx=0x1234):
        self.calls = []
        self.ctx = ctx

        def cb(restype, *argtypes):
            return lambda f: ctypes.CFUNCTYPE(restype, *argtypes)(f)

        def launch(cfg, func, argv, extra):
            c = _hot_driver.LaunchConfig.from_address(cfg)
            self.calls.append(("launch", (c.gridDimX, c.gridDimY, c.gridDimZ), c.blockDimX, c.sharedMemBytes,
                               c.hStream or 0, func, argv, extra))
            return 0

        def copy(dst, src, n, s):
            self.calls.append(("copy", dst, src, n, s or 0))
            return 0

        def record(ev, s):
            self.calls.append(("record", ev, s or 0))
            return 0

        def query(ev):
            return 600 if ev == 0xBAD else 0

        def get_ctx(p):
            p[0] = self.ctx
            return 0

        self._keep = [cb(I32, VP, VP, VP, VP)(launch), cb(I32, ctypes.c_uint64, VP, ctypes.c_size_t, VP)(copy),
                      cb(I32, VP, VP)(record), cb(I32, VP)(query), cb(I32, ctypes.POINTER(VP))(get_ctx)]
        names = ("cuLaunchKernelEx", "cuMemcpyHtoDAsync_v2", "cuEventRecord", "cuEventQuery", "cuCtxGetCurrent")
        for name, f in zip(names, self._keep):
            setattr(self, name, f)
            setattr(self, name + "_ptsz", f)


def _bindings(ctx=0x1234):
    return types.SimpleNamespace(cuCtxGetCurrent=lambda: (0, ctx))


def test_ctypes_hot_passes_the_arguments_through():
    lib = _FakeLib()
    h = _hot_driver.CtypesHot(_bindings(), lib)
    cfg, arg = h.launch_config()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = 8, 1, 33
    cfg.blockDimX, cfg.sharedMemBytes, cfg.hStream = 256, 99 * 1024, 0x5100
    argv = (ctypes.c_void_p * 1)(0xABC)
    assert h.launch(arg, 0xF00D, ctypes.addressof(argv)) == 0
    assert h.memcpy_htod_async(0x7000_0000, 0x6000, 4096, 0x5100) == 0
    assert h.event_record(0xE7, 0) == 0
    assert h.event_query(0xE7) == 0 and h.event_query(0xBAD) == 600
    assert lib.calls == [("launch", (8, 1, 33), 256, 99 * 1024, 0x5100, 0xF00D, ctypes.addressof(argv), None),
                         ("copy", 0x7000_0000, 0x6000, 4096, 0x5100), ("record", 0xE7, 0)]


def test_ctypes_hot_refuses_a_different_libcuda():
    with pytest.raises(OSError, match="not the one cuda.bindings uses"):
        _hot_driver.CtypesHot(_bindings(ctx=0x9999), _FakeLib(ctx=0x1234))


def test_simulated_driver_gets_the_bindings_path(monkeypatch):
    fake = types.SimpleNamespace(__name__="tests.fake_driver")
    monkeypatch.setattr(_cuda, "driver", lambda: fake)
    monkeypatch.setattr(_cuda, "_hot", None)
    h = _cuda.hot()
    assert isinstance(h, _hot_driver.BindingsHot) and h.cu is fake and _cuda.hot() is h
