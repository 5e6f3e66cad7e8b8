"""cuda.bindings glue: driver init, per-device primary contexts, cubin libraries, launches.

Everything that talks to the driver lives here so the rest of the package stays testable on a
machine without a GPU (this module imports cuda.bindings lazily, on first use).
"""
from __future__ import annotations

import ctypes
import threading

_driver = None
_lock = threading.Lock()
_contexts: dict[int, object] = {}
_current = threading.local()
_streams: dict[int, int] = {}
_events: dict[int, list] = {}
_props: dict[int, dict] = {}


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call (and the kernel, for launches)."""


class DriverError(CudaError):
    """No usable CUDA driver or GPU: cuda-bindings missing, no NVIDIA driver, or cuInit failed.

    ``reason`` is the short form (e.g. "no NVIDIA driver, libcuda.so.1 not found"); the message
    adds which driver the installed cuda-bindings needs. The original exception (cuda-pathfinder's
    DynamicLibNotFoundError, ...) is kept as ``__cause__``."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


# The NVIDIA driver each cuda-bindings major version needs (a CUDA N driver runs CUDA N bindings).
_MIN_DRIVER = {12: "r525 or newer", 13: "r580 or newer"}


def bindings_version() -> str | None:
    """The installed cuda-bindings' version (from its metadata: importing it is not needed)."""
    from importlib import metadata

    try:
        return metadata.version("cuda-bindings")
    except metadata.PackageNotFoundError:
        try:
            from cuda.bindings import __version__
        except ImportError:
            return None
        return str(__version__)


def driver_requirement() -> str:
    """e.g. "cuda-bindings 13.5.0 needs an NVIDIA driver for CUDA 13 (r580 or newer)"."""
    ver = bindings_version()
    if ver is None:
        return "pyflashattn needs cuda-bindings 13.x and an NVIDIA driver for CUDA 13 (r580 or newer)"
    try:
        major = int(ver.split(".")[0])
    except ValueError:
        return f"cuda-bindings {ver} needs an NVIDIA driver of its CUDA major version"
    need = f" ({_MIN_DRIVER[major]})" if major in _MIN_DRIVER else ""
    return f"cuda-bindings {ver} needs an NVIDIA driver for CUDA {major}{need}"


def _driver_lib() -> str:
    import sys

    return "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _driver_version_text(cu) -> str | None:
    """The CUDA version the installed driver supports, e.g. "12.4" (None if it cannot be asked)."""
    try:
        err, v = cu.cuDriverGetVersion()
    except Exception:  # noqa: BLE001 - only for an error message
        return None
    if err != cu.CUresult.CUDA_SUCCESS or not v:
        return None
    return f"{v // 1000}.{v % 1000 // 10}"


def _init_failure(cu, err) -> DriverError:
    name = _err_name(cu, err)
    if name == "CUDA_ERROR_NO_DEVICE":
        reason = "the NVIDIA driver sees no GPU (cuInit: CUDA_ERROR_NO_DEVICE; check CUDA_VISIBLE_DEVICES)"
    elif name in ("CUDA_ERROR_INSUFFICIENT_DRIVER", "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
                  "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE"):
        have = _driver_version_text(cu)
        reason = f"the NVIDIA driver{f' (CUDA {have})' if have else ''} is too old or mismatched (cuInit: {name})"
    else:
        reason = f"cuInit failed with {name}"
    return DriverError(f"pyflashattn cannot run: {reason}; {driver_requirement()}", reason)


def driver():
    """The cuda.bindings.driver module, with cuInit done once.

    Raises DriverError (a CudaError, so a RuntimeError) with one line in pyflashattn's words when
    cuda-bindings is missing, no NVIDIA driver can be loaded, or cuInit fails; the underlying
    exception stays inspectable as ``__cause__``."""
    global _driver
    if _driver is None:
        with _lock:
            if _driver is None:
                try:
                    from cuda.bindings import driver as cu
                except ImportError as e:
                    raise DriverError("pyflashattn needs cuda-bindings: pip install 'cuda-bindings>=13,<14'",
                                      "cuda-bindings is not installed") from e
                try:
                    (err,) = cu.cuInit(0)
                except Exception as e:  # noqa: BLE001 - cuda-pathfinder raises its own RuntimeError kinds
                    lib = _driver_lib()
                    if type(e).__name__ == "DynamicLibNotFoundError":
                        reason = f"no NVIDIA driver, {lib} not found"
                    else:
                        reason = f"the NVIDIA driver ({lib}) could not be loaded: {_first_line(e)}"
                    raise DriverError(f"pyflashattn cannot run: {reason}; {driver_requirement()}", reason) from e
                if err != cu.CUresult.CUDA_SUCCESS:
                    raise _init_failure(cu, err)
                _driver = cu
    return _driver


def driver_version() -> str:
    """The CUDA version the loaded driver supports, e.g. "13.0" (DriverError if there is none)."""
    cu = driver()
    return _driver_version_text(cu) or "unknown"


def devices() -> list[dict]:
    """Every visible GPU: {"id", "name", "cc"} (DriverError if there is no usable driver)."""
    cu = driver()
    n = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
    out = []
    A = cu.CUdevice_attribute
    for i in range(int(n)):
        dev = check(cu.cuDeviceGet(i), f"cuDeviceGet({i})")
        raw = check(cu.cuDeviceGetName(256, dev), f"cuDeviceGetName({i})")
        name = raw.split(b"\0", 1)[0].decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        cc = (check(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cc major"),
              check(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cc minor"))
        out.append({"id": i, "name": name.strip(), "cc": (int(cc[0]), int(cc[1]))})
    return out


def _err_name(cu, err):
    try:
        e, name = cu.cuGetErrorName(err)
        return name.decode() if e == cu.CUresult.CUDA_SUCCESS else str(err)
    except Exception:  # noqa: BLE001 - only for building an error message
        return str(err)


def check(result, what: str):
    """Unpack a cuda.bindings (err, *values) tuple; raise CudaError naming `what` on failure."""
    cu = driver()
    err = result[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(f"{what} failed: {_err_name(cu, err)}")
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def ensure_context(device_id: int, force: bool = False) -> None:
    """Make device_id's primary context current on this thread (the one torch/CuPy/JAX use).
    force: set it even where this thread's last call set it (a callback on a thread whose current
    context its owner may have switched since: XLA's, pyflashattn.jax)."""
    if not force and getattr(_current, "dev", None) == device_id:
        return
    cu = driver()
    ctx = _contexts.get(device_id)
    if ctx is None:
        with _lock:
            ctx = _contexts.get(device_id)
            if ctx is None:
                dev = check(cu.cuDeviceGet(device_id), f"cuDeviceGet({device_id})")
                ctx = check(cu.cuDevicePrimaryCtxRetain(dev), f"cuDevicePrimaryCtxRetain({device_id})")
                _contexts[device_id] = ctx
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    _current.dev = device_id


def properties(device_id: int) -> dict:
    """Compute capability, SM count, shared-memory limits, registers and the L2 size, cached per
    device."""
    props = _props.get(device_id)
    if props is None:
        cu = driver()
        dev = check(cu.cuDeviceGet(device_id), f"cuDeviceGet({device_id})")
        A = cu.CUdevice_attribute

        def attr(a):
            return check(cu.cuDeviceGetAttribute(a, dev), f"cuDeviceGetAttribute({a})")

        props = {
            "cc": (attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                   attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)),
            "sm_count": attr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            "smem_optin": attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
            "smem_per_sm": attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
            "regs_per_sm": attr(A.CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR),
            "l2_bytes": attr(A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
        }
        _props[device_id] = props
    return props


# ---------------------------------------------------------------- libraries and kernels

def load_library(data: bytes, what: str):
    """A context-independent CUlibrary from cubin bytes."""
    cu = driver()
    return check(cu.cuLibraryLoadData(data, None, None, 0, None, None, 0), f"cuLibraryLoadData({what})")


def get_function(library, name: str, device_id: int, dynamic_smem: int):
    """The CUfunction of `name` in device_id's context, with its dynamic shared-memory limit raised."""
    cu = driver()
    ensure_context(device_id)
    kernel = check(cu.cuLibraryGetKernel(library, name.encode()), f"cuLibraryGetKernel({name})")
    func = check(cu.cuKernelGetFunction(kernel), f"cuKernelGetFunction({name})")
    if dynamic_smem > 48 * 1024:
        check(cu.cuFuncSetAttribute(func, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                    dynamic_smem), f"cuFuncSetAttribute({name}, max dynamic smem {dynamic_smem})")
    return func


class Launcher:
    """One kernel launched with one by-value params struct.

    The struct and the void*[1] that points at it are allocated once; a launch refills the
    struct's fields (the caller does that) and hands the array's address to cuLaunchKernel
    with the grid and block fixed by configure(), so no argument packing happens per call.
    cuLaunchKernel, not cuLaunchKernelEx: on the H100 VM it cost 5.1 us a launch against 5.7 for
    the Ex form with a prebuilt CUlaunchConfig (the driver's own time: a ctypes call of either
    measured the same as cuda.bindings). Launch attributes need the Ex form: ProgrammaticLauncher.
    """

    __slots__ = ("name", "func", "params", "_argv", "_argv_addr", "_head", "grid", "_cu", "threads", "smem", "meta")

    def __init__(self, name: str, func, params_type, threads: int, smem: int):
        self._cu = driver()
        self.name = name
        self.func = func
        self.params = params_type()
        self._argv = (ctypes.c_void_p * 1)(ctypes.addressof(self.params))
        self._argv_addr = ctypes.addressof(self._argv)
        self.threads = threads
        self.smem = smem
        self.meta = None  # the manifest row, set by the registry
        self.configure((0, 0, 0))

    def configure(self, grid: tuple[int, int, int]) -> "Launcher":
        """Fix the grid once (a plan's launcher keeps it for every launch)."""
        gx, gy, gz = self.grid = tuple(grid)
        # cuLaunchKernel's leading arguments: function, grid, block, dynamic shared memory
        self._head = (self.func, gx, gy, gz, self.threads, 1, 1, self.smem)
        return self

    def __call__(self, stream: int) -> None:
        """Launch with the configured grid and the current params struct on `stream`."""
        err, = self._cu.cuLaunchKernel(*self._head, stream, self._argv_addr, 0)
        if err != self._cu.CUresult.CUDA_SUCCESS:
            raise CudaError(f"launch of {self.name} grid={self.grid} block={self.threads} smem={self.smem} "
                            f"failed: {_err_name(self._cu, err)}")

    def launch(self, grid: tuple[int, int, int], stream: int) -> None:
        self.configure(grid)(stream)


def copy_params(dst: Launcher, src: Launcher) -> None:
    """dst takes src's params struct (the same type: one family) and grid, byte for byte."""
    if type(dst.params) is not type(src.params):
        raise TypeError(f"{dst.name} and {src.name} take different params structs")
    ctypes.memmove(ctypes.addressof(dst.params), ctypes.addressof(src.params), ctypes.sizeof(src.params))
    dst.configure(src.grid)


class ProgrammaticLauncher(Launcher):
    """A Launcher whose kernel may start before the kernel ahead of it on the stream has
    finished (programmatic dependent launch, compute capability 9.0+): its CTAs are scheduled
    as soon as every CTA of that kernel has started and park in griddepcontrol.wait
    (pfa/ptx/pdl.cuh) until it completes, so the launch latency overlaps its tail. Only for
    kernels that wait before reading anything (the split-KV merge). cuLaunchKernelEx with a
    prebuilt CUlaunchConfig carrying the attribute (~0.6 us more host time than cuLaunchKernel).
    """

    __slots__ = ("_config",)

    def __init__(self, name: str, func, params_type, threads: int, smem: int):
        cu = driver()
        cfg = cu.CUlaunchConfig()
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = threads, 1, 1
        cfg.sharedMemBytes = smem
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg.attrs = [attr]
        cfg.numAttrs = 1
        self._config = cfg
        super().__init__(name, func, params_type, threads, smem)

    @classmethod
    def sharing(cls, la: Launcher) -> "ProgrammaticLauncher":
        """A programmatic launcher of la's kernel over la's own params struct (whatever la's
        owner writes there is launched) with la's grid."""
        pl = cls(la.name, la.func, type(la.params), la.threads, la.smem)
        pl.params, pl._argv, pl._argv_addr, pl.meta = la.params, la._argv, la._argv_addr, la.meta
        return pl.configure(la.grid)

    def configure(self, grid: tuple[int, int, int]) -> "Launcher":
        super().configure(grid)
        cfg = self._config
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self.grid
        return self

    def __call__(self, stream: int) -> None:
        cfg = self._config
        cfg.hStream = stream
        err, = self._cu.cuLaunchKernelEx(cfg, self.func, self._argv_addr, 0)
        if err != self._cu.CUresult.CUDA_SUCCESS:
            raise CudaError(f"launch of {self.name} grid={self.grid} block={self.threads} smem={self.smem} "
                            f"(programmatic) failed: {_err_name(self._cu, err)}")


# ---------------------------------------------------------------- streams, events, memory

def library_stream(device_id: int) -> int:
    """A non-blocking stream owned by the library (used when the caller's framework has none, e.g. JAX)."""
    s = _streams.get(device_id)
    if s is None:
        cu = driver()
        ensure_context(device_id)
        stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        s = _streams[device_id] = int(stream)
    return s


def stream_wait(waiting_stream: int, on_stream: int) -> None:
    """Make waiting_stream wait for the work queued so far on on_stream (no host sync)."""
    if waiting_stream == on_stream:
        return
    cu = driver()
    ev = check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
    check(cu.cuEventRecord(ev, on_stream), "cuEventRecord")
    check(cu.cuStreamWaitEvent(waiting_stream, ev, 0), "cuStreamWaitEvent")
    check(cu.cuEventDestroy(ev), "cuEventDestroy")  # destruction is deferred until the wait resolves


def stream_capturing(stream: int) -> bool:
    """Whether `stream` is being captured into a CUDA graph (cuStreamIsCapturing, legal during a
    capture). A query that fails (the legacy stream while another stream captures globally)
    reads as not capturing: the launch itself then reports the capture error."""
    cu = driver()
    err, status = cu.cuStreamIsCapturing(stream)
    return err == cu.CUresult.CUDA_SUCCESS and status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


def mem_alloc_async(nbytes: int, stream: int) -> int:
    return int(check(driver().cuMemAllocAsync(max(int(nbytes), 1), stream), f"cuMemAllocAsync({nbytes})"))


def mem_alloc(nbytes: int) -> int:
    return int(check(driver().cuMemAlloc(max(int(nbytes), 1)), f"cuMemAlloc({nbytes})"))


def mem_free(ptr: int) -> None:
    """Free device memory from mem_alloc/mem_alloc_async (cuMemFree waits for pending work on it)."""
    check(driver().cuMemFree(ptr), "cuMemFree")


def mem_free_async(ptr: int, stream: int) -> None:
    """Free mem_alloc_async memory once the work queued on `stream` so far is done.

    Under this thread's relaxed capture mode: the callers free library outputs (JAX's) whenever
    they are dropped, garbage collection included, and so possibly while another stream captures
    a graph in global mode (torch's default), which refuses the free and invalidates its capture
    (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED). A stream-ordered free on a stream that is not
    capturing is safe beside a capture; a free on a capturing stream is captured either way."""
    cu = driver()
    prev = check(cu.cuThreadExchangeStreamCaptureMode(cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
                 "cuThreadExchangeStreamCaptureMode")
    try:
        check(cu.cuMemFreeAsync(ptr, stream), "cuMemFreeAsync")
    finally:
        check(cu.cuThreadExchangeStreamCaptureMode(prev), "cuThreadExchangeStreamCaptureMode")


def zeroed(nbytes: int) -> int:
    """Device memory set to zero, synchronously (state such as the tile scheduler's counters, which
    the kernels zero again after each use). Not while a stream captures: a synchronous memset is
    refused there, and one ordered on the capturing stream would run only in the graph."""
    ptr = mem_alloc(nbytes)
    check(driver().cuMemsetD8(ptr, 0, max(int(nbytes), 1)), "cuMemsetD8")
    return ptr


def memset8_async(ptr: int, value: int, nbytes: int, stream: int) -> None:
    """Set `nbytes` bytes at ptr to `value`, ordered on `stream` (legal while it captures)."""
    check(driver().cuMemsetD8Async(ptr, value, nbytes, stream), "cuMemsetD8Async")


def memset32_async(ptr: int, value: int, count: int, stream: int) -> None:
    """Set `count` 32-bit words at ptr to `value`, ordered on `stream` (legal while it captures)."""
    check(driver().cuMemsetD32Async(ptr, value, count, stream), "cuMemsetD32Async")


_stream_ctx_device: dict = {}  # a stream's context -> its device ordinal


def stream_device(stream: int) -> int:
    """The ordinal of the device a stream belongs to, its context made current on this thread (a
    callback of another library's stream: XLA's, pyflashattn.jax)."""
    cu = driver()
    ctx = check(cu.cuStreamGetCtx(stream), "cuStreamGetCtx")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    dev = _stream_ctx_device.get(int(ctx))
    if dev is None:
        dev = _stream_ctx_device[int(ctx)] = int(check(cu.cuCtxGetDevice(), "cuCtxGetDevice"))
    _current.dev = dev
    return dev


def sched_counters(stream: int) -> int:
    """New tile-scheduler counters (two int32, zeroed here; each launch's last CTA zeroes them
    again: sm90/tile_scheduler.cuh), or 0 while `stream` captures (a zeroing the graph would not
    replay first: the launch then takes a fixed share of blocks). The caller keeps them."""
    return 0 if stream_capturing(stream) else zeroed(16)


def upload(data: bytes) -> int:
    """A device copy of host bytes (synchronous; for small constant tables built at plan time)."""
    cu = driver()
    ptr = mem_alloc(len(data))
    check(cu.cuMemcpyHtoD(ptr, data, len(data)), "cuMemcpyHtoD")
    return ptr


class Workspace:
    """Grow-only device scratch memory, one per (device, stream): split-KV partials live here.

    Keyed by stream so two streams never share scratch; growth frees the old block with
    cuMemFreeAsync on the same stream, which orders the free after earlier launches there.
    """

    _spaces: dict[tuple[int, int], "Workspace"] = {}

    # stream-K's hand-off flags (sm90/stream_k.cuh: int32 [CTAs, consumers], zeroed, each lowered
    # again by its reader): room for 256 CTAs of 4 consumer warpgroups
    FLAG_BYTES = 4096

    def __init__(self, device_id: int, stream: int):
        self.device_id, self.stream, self.ptr, self.size = device_id, stream, 0, 0
        self.sched = self.flag_ptr = 0

    @classmethod
    def _of(cls, device_id: int, stream: int) -> "Workspace":
        ws = cls._spaces.get((device_id, stream))
        if ws is None:
            ws = cls._spaces[(device_id, stream)] = cls(device_id, stream)
        return ws

    @classmethod
    def flags(cls, device_id: int, stream: int) -> int:
        """Stream-K's zeroed flags for launches on this stream (0 while none exist and the stream
        captures: a zeroing the graph would not replay first; the launch then does without)."""
        ws = cls._of(device_id, stream)
        if not ws.flag_ptr and not stream_capturing(stream):
            ws.flag_ptr = zeroed(cls.FLAG_BYTES)
        return ws.flag_ptr

    @classmethod
    def counters(cls, device_id: int, stream: int) -> int:
        """The tile scheduler's counters for launches on this stream (sched_counters: 0 while none
        exist and the stream captures). Their own allocation: the scratch block moves on growth."""
        ws = cls._of(device_id, stream)
        if not ws.sched:
            ws.sched = sched_counters(stream)
        return ws.sched

    @classmethod
    def get(cls, device_id: int, stream: int, nbytes: int) -> int:
        ws = cls._of(device_id, stream)
        if ws.size < nbytes:
            cu = driver()
            if ws.ptr:
                check(cu.cuMemFreeAsync(ws.ptr, stream), "cuMemFreeAsync")
            size = max(nbytes, 2 * ws.size, 1 << 20)
            ws.ptr, ws.size = mem_alloc_async(size, stream), size
        return ws.ptr


def encode_tensor_map(dtype_short: str, ptr: int, dims: tuple, strides_bytes: tuple, box: tuple) -> bytes:
    """A tiled CUtensorMap (cuTensorMapEncodeTiled) of a 16-bit or e4m3 tensor at `ptr` of rank len(dims):
    dims innermost first, the byte strides of dims 1.., boxes of `box` elements landing in shared
    memory in the 128-byte swizzle (the wgmma layout), out-of-range elements read as zeros.
    Returns the driver's CUtensorMap object (tensor_map_bytes: its 128 bytes, for a
    kernel-parameter field)."""
    cu = driver()
    dt = cu.CUtensorMapDataType
    kind = {"bf16": dt.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, "f16": dt.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            "e4m3": dt.CU_TENSOR_MAP_DATA_TYPE_UINT8}[dtype_short]  # (bytes: TMA copies them as they are)
    rank = len(dims)
    err, tmap = cu.cuTensorMapEncodeTiled(
        kind, rank, ptr, [cu.cuuint64_t(d) for d in dims], [cu.cuuint64_t(s) for s in strides_bytes],
        [cu.cuuint32_t(b) for b in box], [cu.cuuint32_t(1)] * rank,
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B, cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(f"cuTensorMapEncodeTiled failed ({_err_name(cu, err)}): dims {dims}, strides {strides_bytes}, "
                        f"box {box}")
    return tmap


def tensor_map_bytes(tmap) -> bytes:
    """The 128 bytes of a CUtensorMap object."""
    return ctypes.string_at(tmap.getPtr(), 128)


def tensor_map_replace_address(tmap, ptr: int) -> None:
    """Point an encoded CUtensorMap object at another tensor of its geometry (cuTensorMapReplaceAddress)."""
    check(driver().cuTensorMapReplaceAddress(tmap, ptr), "cuTensorMapReplaceAddress")
