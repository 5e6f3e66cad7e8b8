"""The four driver calls on the per-call path, without cuda.bindings' argument conversion.

run() launches one or two kernels and plan() makes one metadata copy plus an event record and
query. Through cuda.bindings each of those calls converts its Python arguments into driver
handle objects first: about 5 us for cuLaunchKernelEx and 2-3.5 us for cuMemcpyHtoDAsync on
the H100 test VM, most of run()'s host time. A ctypes function with fixed argtypes and
pre-converted handles costs ~0.5 us. So these calls go straight into the libcuda that
cuda.bindings already loaded (same process, same library, same contexts: the constructor checks
that both see the same current context); everything else (init, contexts, modules, memory)
stays on cuda.bindings.

Two implementations behind one interface, chosen by ``pyflashattn._cuda.hot()``:

* ``CtypesHot``: ctypes into libcuda (only over the real ``cuda.bindings.driver``);
* ``BindingsHot``: the same calls through ``driver()`` (cuda.bindings when libcuda cannot be
  opened by ctypes, or the simulated driver of the CPU tests).

Every method returns the CUresult as an int (0 = success); ``handle()`` turns a cuda.bindings
handle (CUfunction, CUevent) into what the implementation passes back into the driver.
"""
from __future__ import annotations

import ctypes
import os
import sys


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h), field names as in cuda.bindings' CUlaunchConfig."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p), ("attrs", ctypes.c_void_p),
                ("numAttrs", ctypes.c_uint)]


class BindingsHot:
    """The hot calls through a cuda.bindings-shaped driver module (or the CPU tests' double)."""

    kind = "cuda.bindings"

    def __init__(self, cu):
        self.cu = cu

    @staticmethod
    def handle(h):
        return h

    def launch_config(self):
        """(config object the caller fills, the value launch() takes for it)."""
        cfg = self.cu.CUlaunchConfig()
        return cfg, cfg

    def launch(self, cfg, func, argv_addr: int) -> int:
        return int(self.cu.cuLaunchKernelEx(cfg, func, argv_addr, 0)[0])

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> int:
        return int(self.cu.cuMemcpyHtoDAsync(dst, src, nbytes, stream)[0])

    def event_record(self, event, stream: int) -> int:
        return int(self.cu.cuEventRecord(event, stream)[0])

    def event_query(self, event) -> int:
        return int(self.cu.cuEventQuery(event)[0])


def _libcuda():
    name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    return ctypes.CDLL(name)


class CtypesHot:
    """The hot calls through ctypes into the libcuda cuda.bindings runs on.

    Stream-taking calls use the per-thread default stream variants exactly when cuda.bindings
    does (``CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM``), so stream handle 0 means the same
    stream on both paths.
    """

    kind = "ctypes"

    def __init__(self, cu, lib=None):
        self.cu = cu
        lib = _libcuda() if lib is None else lib
        ptds = os.environ.get("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "0") not in ("", "0")
        sfx = "_ptsz" if ptds else ""
        vp, i32 = ctypes.c_void_p, ctypes.c_int

        def fn(name, *argtypes):
            f = getattr(lib, name)
            f.restype, f.argtypes = i32, list(argtypes)
            return f

        self._launch = fn("cuLaunchKernelEx" + sfx, vp, vp, vp, vp)
        self._copy = fn("cuMemcpyHtoDAsync_v2" + sfx, ctypes.c_uint64, vp, ctypes.c_size_t, vp)
        self._record = fn("cuEventRecord" + sfx, vp, vp)
        self.event_query = fn("cuEventQuery", vp)
        get_ctx = fn("cuCtxGetCurrent", ctypes.POINTER(vp))
        # Same library as cuda.bindings? Then both see the same current context.
        mine = vp()
        err = get_ctx(ctypes.byref(mine))
        err2, theirs = cu.cuCtxGetCurrent()
        if err or int(err2) or (mine.value or 0) != int(theirs):
            raise OSError("libcuda opened by ctypes is not the one cuda.bindings uses")

    @staticmethod
    def handle(h) -> int:
        return int(h)

    @staticmethod
    def launch_config():
        cfg = LaunchConfig()
        return cfg, ctypes.addressof(cfg)

    def launch(self, cfg_addr: int, func: int, argv_addr: int) -> int:
        return self._launch(cfg_addr, func, argv_addr, None)

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> int:
        return self._copy(dst, src, nbytes, stream)

    def event_record(self, event: int, stream: int) -> int:
        return self._record(event, stream)
