"""Tensor views, streams and output allocation for any DLPack framework, without importing one.

Frameworks are recognised by the module of the array's type and reached through ``sys.modules``:
an array of a framework can only exist if that framework is already imported.

Stream policy (DESIGN.md "Streams"):

* torch: launch on torch's current stream (``current_stream``). Inputs are read with no handshake,
  as torch's own extensions do. A ``stream=`` other than torch's current one is the caller's
  promise that the inputs are ready on it (and that outputs are not freed early: torch's caching
  allocator is stream-ordered on the stream that allocated them).
* CuPy: launch on CuPy's current stream; ``view(..., stream=s)`` passes ``s`` to ``__dlpack__`` so
  CuPy makes ``s`` wait when it differs from its current stream.
* JAX: there is no public current stream, so launch on a library-owned non-blocking stream and
  rely on the DLPack handshake both ways: ``view(..., stream=s)`` makes ``s`` wait for JAX's
  pending writes; outputs are handed to JAX only after the launch (``finalize``) with the event
  handshake on JAX's stream.

Lifetime: a TensorView keeps the source object (and its DLPack capsule) alive until it is dropped,
so drop views only after the launch is enqueued. Freeing an input right after the call is safe
only when the framework's allocator is ordered on the launch stream (torch/CuPy current stream).
"""

from __future__ import annotations

import ctypes
import math
import operator
import sys

from . import dlpack as _dlpack
from .dlpack import kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged, compact_strides
from .dtypes import DType, normalize

__all__ = ["TensorView", "view", "framework_of", "current_stream", "stream_handle", "empty",
           "finalize", "check_same_device", "require_cuda", "not_cuda_message"]

_DEVICE_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal",
                 9: "vpi", 10: "rocm", 11: "rocm_host", 12: "ext_dev", 13: "cuda_managed",
                 14: "oneapi", 15: "webgpu", 16: "hexagon", 17: "maia", 18: "trn"}


def device_name(device_type: int, device_id: int | None = None) -> str:
    n = _DEVICE_NAMES.get(device_type, f"device_type {device_type}")
    return n if device_id is None else f"{n}:{device_id}"


def not_cuda_message(name: str, device_type: int, device_id: int | None = None) -> str:
    """The error for a tensor argument that is not in CUDA device memory, naming the argument:
    "q is on the CPU; pyflashattn needs CUDA tensors" (or the device's DLPack name)."""
    if device_type == kDLCPU:
        where = "on the CPU"
    elif device_type == kDLCUDAHost:  # page-locked host memory, not readable as device memory
        where = "in pinned host memory (cuda_host)"
    else:
        where = f"on {device_name(device_type, device_id)}"
    return f"{name} is {where}; pyflashattn needs CUDA tensors"


class TensorView:
    """What a launch needs from one tensor: pointer (byte offset applied), shape, strides in
    elements, dtype and device. ``obj`` is the caller's array; ``_keep`` the DLPack capsule whose
    lifetime guards ``ptr`` for producers that hand out copies (both must outlive the launch)."""

    __slots__ = ("obj", "ptr", "shape", "strides", "dtype", "device_type", "device_id",
                 "framework", "readonly", "_keep")

    def __init__(self, obj, ptr: int, shape: tuple, strides: tuple, dtype: DType,
                 device_type: int, device_id: int, framework: str, readonly: bool = False, keep=None):
        self.obj = obj
        self.ptr = ptr
        self.shape = shape
        self.strides = strides
        self.dtype = dtype
        self.device_type = device_type
        self.device_id = device_id
        self.framework = framework
        self.readonly = readonly
        self._keep = keep

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_cuda(self) -> bool:
        return self.device_type == kDLCUDA or self.device_type == kDLCUDAManaged

    def __repr__(self) -> str:
        return (f"TensorView({self.framework} {self.dtype.name}{list(self.shape)} strides={self.strides} "
                f"ptr=0x{self.ptr:x} on {device_name(self.device_type, self.device_id)})")


def index_dim1(v: TensorView, i: int) -> TensorView:
    """The view of v[:, i] (dim 1 dropped)."""
    return TensorView(v.obj, v.ptr + v.dtype.nbytes(i * v.strides[1]), (v.shape[0],) + v.shape[2:],
                      (v.strides[0],) + v.strides[2:], v.dtype, v.device_type, v.device_id, v.framework, v.readonly,
                      v._keep)


def slice_dim1(x, v: TensorView, i: int):
    """x[:, i] of x (v: its view, launch_view's for a JAX array): torch's or CuPy's own slice (a
    free view), else the view of that slice (index_dim1). A JAX slice is an XLA computation that
    copies (NOTES.md, session 26: 0.7 ms of host and a copy of K or V a call), and
    pyflashattn.jax's views no framework slices."""
    if type(x) is not TensorView and v.framework in ("torch", "cupy"):
        return x[:, i]
    return index_dim1(v, i)


def launch_view(x, name: str, v: TensorView | None = None) -> TensorView:
    """view(x) that a launch on the stream the library picks for x's framework (no stream= given)
    may read: an array of any producer but torch / CuPy (whose slices slice_dim1 takes, viewed with
    their handshake at launch) is exported again with that stream, whose DLPack handshake orders
    the launch after the producer's pending writes (JAX's). For the views derived from it
    (slice_dim1), which reach the launch as views and get no handshake of their own there. v: x's
    view, if taken already."""
    v = view(x, name) if v is None else v
    if v.framework not in ("torch", "cupy", "numpy") and type(x) is not TensorView:
        v = view(x, name, stream=current_stream("jax", v.device_id))
    return v


# ---- framework detection -------------------------------------------------------------------
_FRAMEWORKS = {"torch": "torch", "cupy": "cupy", "cupy_backends": "cupy", "jax": "jax",
               "jaxlib": "jax", "numpy": "numpy"}
_FW_CACHE: dict[type, str] = {}


def framework_of(x) -> str:
    """'torch', 'cupy', 'jax', 'numpy' or 'other', from the module of type(x) or of a base class
    (so torch.nn.Parameter and user subclasses of torch.Tensor count as torch)."""
    tp = type(x)
    fw = _FW_CACHE.get(tp)
    if fw is None:
        fw = "other"
        for base in tp.__mro__:
            f = _FRAMEWORKS.get((getattr(base, "__module__", None) or "").partition(".")[0])
            if f is not None:
                fw = f
                break
        _FW_CACHE[tp] = fw
    return fw


# ---- views ---------------------------------------------------------------------------------
_TORCH_DTYPES: dict[object, DType] = {}
_TORCH_BY_NAME: dict[str, object] = {}
_TORCH_STRIDED: set = set()


def _torch_view(t):
    """TensorView from torch attributes (about 1 us, the fastest path measured): data_ptr()
    already includes the storage offset; stride() is in elements. None when the tensor is
    something only __dlpack__ should judge (not strided, not on cpu/cuda)."""
    if t.is_cuda:
        dev_type, dev_id = kDLCUDA, t.get_device()
    elif t.is_cpu:
        dev_type, dev_id = kDLCPU, 0
    else:
        return None
    layout = t.layout
    if layout not in _TORCH_STRIDED:  # str() of a layout costs ~0.3 us: remember the good one
        if str(layout) != "torch.strided":
            return None
        _TORCH_STRIDED.add(layout)
    dtype = _TORCH_DTYPES.get(t.dtype)
    if dtype is None:
        try:
            dtype = _TORCH_DTYPES[t.dtype] = normalize(str(t.dtype))
        except TypeError as e:
            raise _UnsupportedDtype(str(e)) from None
    return TensorView(t, t.data_ptr(), tuple(t.shape), t.stride(), dtype, dev_type, dev_id, "torch")


class _UnsupportedDtype(TypeError):
    pass


def torch_empty_like(q):
    """A contiguous uninitialised tensor with q's shape, dtype and device (the outputs of the torch
    fast paths, whose shape is q's). torch.empty_like with contiguous_format measured 3.7 us a
    call on the H100 VM, q.new_empty(shape) 5.1 and torch.empty(shape, device=q.device) 4.0."""
    torch = sys.modules["torch"]
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def torch_empty_as(q, dtype: DType):
    """An uninitialised contiguous tensor with q's shape and device in `dtype` (a fast-path output
    in another dtype than q's, e.g. fp8)."""
    torch = sys.modules["torch"]
    tdt = _TORCH_BY_NAME.get(dtype.name)
    if tdt is None:
        tdt = _TORCH_BY_NAME[dtype.name] = getattr(torch, dtype.name)
    return torch.empty(q.shape, dtype=tdt, device=q.device)


def torch_empty_f32(q, shape):
    """An uninitialised float32 tensor of `shape` on q's device (LSE outputs; see torch_empty_like)."""
    torch = sys.modules["torch"]
    return torch.empty(shape, dtype=torch.float32, device=q.device)


def _dlpack_stream(stream: int | None) -> int | None:
    # The protocol forbids 0; a CUstream of 0 is the legacy default stream, spelled 1 in DLPack.
    return 1 if stream == 0 else stream


def view(x, name: str, *, stream: int | None = None) -> TensorView:
    """View ``x`` (any DLPack producer) for a launch; ``name`` is used in error messages.

    ``stream`` is the stream the launch will use, when known. It is passed to ``__dlpack__`` for
    CUDA arrays of CuPy/JAX/other producers so they order their pending writes before it; torch
    tensors are read without a handshake (see the module docstring).
    """
    tp = type(x)
    if tp is TensorView:  # already a view (pyflashattn.jax's XLA buffers): its address is the launch's
        return x
    fw = _FW_CACHE.get(tp) or framework_of(x)
    if fw == "torch":
        # Attribute reads first (measured fastest on torch 2.11); the DLPack exchange API is the
        # fallback for tensors they cannot describe, then plain __dlpack__ below.
        try:
            v = _torch_view(x)
        except _UnsupportedDtype as e:
            raise TypeError(f"{name}: {e}") from None
        except Exception:
            v = None
        if v is not None:
            return v
        api = _dlpack.exchange_api_for(tp)
        if api is not None and api.can_read:
            try:
                ptr, shape, strides, dtype, dev_type, dev_id, ro = api.read_raw(x)
                return TensorView(x, ptr, shape, strides, dtype, dev_type, dev_id, "torch", ro)
            except Exception:
                pass  # e.g. a tensor DLPack cannot describe: __dlpack__ below reports it properly

    dlpack = getattr(x, "__dlpack__", None)
    if dlpack is None:
        raise TypeError(f"{name} must be a DLPack tensor (torch/CuPy/JAX), got {tp.__name__}")
    dl_stream = None
    if stream is None and fw == "cupy":
        # No stream given: the launch goes to CuPy's current stream (current_stream), so that is
        # the consumer stream. __dlpack__(stream=None) would mean the legacy stream, and CuPy
        # would make it wait on its current stream: illegal while that stream is being captured.
        dev = getattr(getattr(x, "device", None), "id", None)
        if dev is not None:
            stream = current_stream("cupy", dev)
    if stream is not None and fw != "numpy":  # numpy only accepts stream=None
        # A stream only means something to a CUDA producer (others may reject one).
        dlpack_device = getattr(x, "__dlpack_device__", None)
        dev_type = dlpack_device()[0] if dlpack_device is not None else None
        if dev_type == kDLCUDA or dev_type == kDLCUDAManaged:
            dl_stream = _dlpack_stream(stream)
    # Ask for the newest ABI we read (any 1.x has the same DLManagedTensorVersioned layout, and a
    # producer may refuse fp8 to a consumer that says 1.0); producers that predate max_version
    # raise TypeError on the keyword.
    try:
        cap = dlpack(stream=dl_stream, max_version=(1, 3))
    except TypeError:
        cap = dlpack(stream=dl_stream) if dl_stream is not None else dlpack()
    try:
        ptr, shape, strides, dtype, dev_type, dev_id, ro = _dlpack._read_raw(cap)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}: {e}") from None
    return TensorView(x, ptr, shape, strides, dtype, dev_type, dev_id, fw, ro, cap)


def require_cuda(v: TensorView, name: str) -> None:
    if not v.is_cuda:
        raise ValueError(not_cuda_message(name, v.device_type, v.device_id))


def check_same_device(views: dict) -> None:
    """All views (None entries skipped) on one device; ValueError naming the first one that is not.
    CUDA managed memory counts as its device's CUDA memory."""
    ref_name = ref_key = None
    for name, v in views.items():
        if v is None:
            continue
        key = (kDLCUDA if v.device_type == kDLCUDAManaged else v.device_type, v.device_id)
        if ref_key is None:
            ref_name, ref_key = name, key
        elif key != ref_key:
            raise ValueError(f"{name} is on {device_name(*key)} but {ref_name} is on {device_name(*ref_key)}; "
                             "all tensors of a call must be on one device")


# ---- streams -------------------------------------------------------------------------------
def current_stream(framework: str, device_id: int) -> int:
    """The stream to launch on when the caller gave none: torch's or CuPy's current stream on
    ``device_id``, else (JAX, others) the library's own non-blocking stream for that device.

    torch's default stream is the legacy stream, handle 0: launching there *is* the caller's
    stream, so 0 is returned as is. A library stream is never 0.
    """
    if framework == "torch":
        torch = sys.modules["torch"]
        # torch's own raw-stream getter (what torch.compile's generated code calls) costs ~0.2 us;
        # the public torch.cuda.current_stream() ~3.6 us, the DLPack exchange API ~1.5 us.
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return int(raw(device_id))
        api = _dlpack.exchange_api_for(torch.Tensor)
        if api is not None:
            try:
                return api.current_work_stream(kDLCUDA, device_id)
            except Exception:
                pass
        return int(torch.cuda.current_stream(device_id).cuda_stream)
    if framework == "cupy":
        cupy = sys.modules["cupy"]
        # CuPy's current stream is per device; switch device only to ask.
        with cupy.cuda.Device(device_id):
            return int(cupy.cuda.get_current_stream().ptr)
    from . import cuda as _cuda

    return _cuda.library_stream(device_id)


def stream_handle(stream) -> int | None:
    """A CUstream handle as an int from None (returned as None: "not given"), an int, an object
    implementing the CUDA stream protocol ``__cuda_stream__() -> (version, handle)`` (torch, CuPy,
    cuda.core streams), a torch stream (``.cuda_stream``), a CuPy stream (``.ptr``) or a
    cuda.bindings ``CUstream``."""
    if stream is None:
        return None
    if not isinstance(stream, bool):
        try:
            h = operator.index(stream)
        except TypeError:
            h = None
        if h is not None:
            if h < 0:
                raise ValueError(f"stream must be a CUstream handle >= 0, got {h}")
            return h
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        pair = proto() if callable(proto) else proto  # cuda.core < 0.2 made it a property
        if isinstance(pair, tuple) and len(pair) == 2:
            return int(pair[1])
    for attr in ("cuda_stream", "ptr"):
        h = getattr(stream, attr, None)
        if isinstance(h, int) and not isinstance(h, bool):
            return h
    get_ptr = getattr(stream, "getPtr", None)  # cuda.bindings.driver.CUstream
    if get_ptr is not None:
        return int(get_ptr())
    raise TypeError("stream must be None, an int CUstream handle or a stream object with "
                    f"__cuda_stream__ (torch/CuPy/cuda.core), got {type(stream).__name__}")


# ---- outputs -------------------------------------------------------------------------------
def _numpy_dtype(dtype: DType, framework: str):
    import numpy as np

    if dtype.name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(f"{framework} needs the ml_dtypes package for bfloat16 outputs; "
                            "install it or pass out=") from None
        return np.dtype(ml_dtypes.bfloat16)
    if dtype.code in (0, 1, 2, 5, 6) and dtype.lanes == 1:  # int, uint, float, complex, bool
        return np.dtype(dtype.name)
    raise TypeError(f"{framework} has no {dtype.name} dtype; pass out= (e.g. a uint8 buffer)")


def empty(ref: TensorView, shape: tuple, dtype: DType, stream: int):
    """Allocate an uninitialised output on ``ref``'s device in ``ref``'s framework.

    Returns ``(obj, view)``. Call ``finalize(obj)`` after the launch is enqueued and return *its*
    result to the user: for JAX, ``obj`` is a pending export that becomes a JAX array only then
    (handing it over earlier would let JAX read it before the kernel wrote it). For torch and
    CuPy ``finalize`` is the identity.

    torch allocates on its *current* stream (caching allocator); CuPy on its current stream's
    pool. When the launch stream differs, the caller owns the ordering (module docstring).
    """
    require_cuda(ref, "the reference tensor")
    shape = tuple(int(s) for s in shape)
    dev = ref.device_id
    fw = ref.framework
    if fw == "torch":
        tdt = _TORCH_BY_NAME.get(dtype.name)
        if tdt is None:
            tdt = _TORCH_BY_NAME[dtype.name] = getattr(sys.modules["torch"], dtype.name, None)
            if tdt is None:
                raise TypeError(f"torch has no {dtype.name} dtype; pass out=")
        # new_empty inherits the device from the reference tensor: measured ~2 us cheaper than
        # torch.empty(..., device="cuda:N"), which parses the device string on every call.
        t = ref.obj.new_empty(shape, dtype=tdt)
        return t, TensorView(t, t.data_ptr(), shape, compact_strides(shape), dtype, kDLCUDA, dev, "torch")
    if fw == "cupy":
        cupy = sys.modules["cupy"]
        npdt = _numpy_dtype(dtype, "CuPy")
        with cupy.cuda.Device(dev):
            a = cupy.empty(shape, dtype=npdt)
        strides = tuple(s // a.itemsize for s in a.strides)
        return a, TensorView(a, int(a.data.ptr), shape, strides, dtype, kDLCUDA, dev, "cupy")
    if fw == "jax":
        out = _JaxOutput(shape, dtype, dev, stream)
        v = TensorView(out, out.ptr, shape, compact_strides(shape), dtype, kDLCUDA, dev, "jax")
        return out, v
    raise TypeError(f"cannot allocate outputs for {fw} arrays; pass out= (and lse=)")


def finalize(obj):
    """The user-facing array for an ``empty()`` result, once its launch is enqueued."""
    if type(obj) is _JaxOutput:
        return obj.hand_over()
    return obj


# ---- JAX outputs: library memory handed over through a legacy DLPack capsule ----------------
#
# Ownership: after __dlpack__ the memory belongs to the DLManagedTensor, whose deleter (a ctypes
# callback; JAX calls it when it drops the buffer, from any thread: ctypes takes the GIL) frees it
# with _cuda.mem_free. _LIVE maps the struct's address to the ctypes objects backing it (so they
# outlive the capsule) and makes the free exactly-once: whoever pops the entry frees.
#
# The capsule gets *no* destructor: a ctypes-callback destructor would run inside capsule
# deallocation, possibly while an exception is propagating, where calling back into Python is not
# safe. Instead the exporter (whose __del__ is an ordinary, exception-safe finaliser) checks
# whether the capsule was consumed (renamed "used_dltensor"); if not, it calls the deleter itself.
# Residual risk: if JAX runs the deleter synchronously while a Python exception is pending on the
# same thread, ctypes reports the callback's failure as unraisable and that buffer leaks.

_LIVE: dict[int, tuple] = {}
_DLTENSOR_NAME = ctypes.create_string_buffer(b"dltensor")  # PyCapsule keeps the name pointer


def _free_managed(addr: int, _live=_LIVE) -> None:
    entry = _live.pop(addr, None)
    if entry is None:  # already freed: never twice
        return
    ptr, device_id, stream = entry[0], entry[1], entry[2]
    from . import cuda as _cuda

    # JAX may call from a thread with no current context, or from one of XLA's whose context XLA
    # switched since this thread's last set (the cached "current" would then be stale): forced
    _cuda.ensure_context(device_id, force=True)
    # Stream-ordered: the launch that writes the output may still be running when JAX drops the
    # array (a synchronous cuMemFree of stream-ordered memory assumes every access is done, and a
    # pipelined loop of 64 MB outputs faulted on exactly that: NOTES.md, session 26).
    _cuda.mem_free_async(ptr, stream)


# Module-level so the callback object (and its trampoline) is never garbage collected.
_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_free_managed)
_DELETER_ADDR = ctypes.cast(_DELETER, ctypes.c_void_p).value


class _JaxOutput:
    """A one-shot DLPack exporter of library-owned device memory (see the block comment above)."""

    __slots__ = ("ptr", "shape", "dtype", "device_id", "launch_stream", "_state", "_capsule", "_addr",
                 "__weakref__")

    def __init__(self, shape: tuple, dtype: DType, device_id: int, stream: int):
        from . import cuda as _cuda

        self._state = "none"  # none -> new (we own the memory) -> exported (the capsule's deleter does)
        self._capsule = None
        self._addr = 0
        self.shape, self.dtype, self.device_id, self.launch_stream = shape, dtype, device_id, stream
        _cuda.ensure_context(device_id)
        self.ptr = _cuda.mem_alloc_async(max(dtype.nbytes(math.prod(shape)), 1), stream)
        self._state = "new"

    def __dlpack_device__(self):
        return (kDLCUDA, self.device_id)

    def __dlpack__(self, stream=None, *, max_version=None, dl_device=None, copy=None):
        # Always a legacy "dltensor" capsule (allowed whatever max_version says; JAX, the one
        # consumer, produces and reads that kind).
        if self._state != "new":
            raise BufferError("this pyflashattn output was already exported")
        if dl_device is not None and tuple(dl_device) != (kDLCUDA, self.device_id):
            raise BufferError(f"cannot export to device {dl_device}")
        if copy:
            raise BufferError("pyflashattn outputs are exported without a copy")
        from . import cuda as _cuda

        if stream != -1:  # -1: consumer opts out; None: consumer uses the legacy stream (1)
            _cuda.ensure_context(self.device_id)
            _cuda.stream_wait(1 if stream is None else stream, self.launch_stream)
        shape = self.shape
        n = len(shape)
        mt = _dlpack.DLManagedTensor()
        shape_arr = (ctypes.c_int64 * max(n, 1))(*shape)
        strides_arr = (ctypes.c_int64 * max(n, 1))(*compact_strides(shape))
        t = mt.dl_tensor
        t.data = self.ptr
        t.device.device_type, t.device.device_id = kDLCUDA, self.device_id
        t.ndim = n
        t.dtype.code, t.dtype.bits, t.dtype.lanes = self.dtype.dlpack
        t.shape = ctypes.cast(shape_arr, ctypes.POINTER(ctypes.c_int64))
        t.strides = ctypes.cast(strides_arr, ctypes.POINTER(ctypes.c_int64))
        mt.deleter = _DELETER_ADDR
        addr = ctypes.addressof(mt)
        _LIVE[addr] = (self.ptr, self.device_id, self.launch_stream, mt, shape_arr, strides_arr)
        self._state, self._addr = "exported", addr
        self._capsule = _dlpack._capsule_new(addr, ctypes.addressof(_DLTENSOR_NAME), None)
        return self._capsule

    def _reclaim_unconsumed(self) -> None:
        cap, self._capsule = self._capsule, None
        if cap is not None and _dlpack.capsule_name(cap) == b"dltensor":
            _free_managed(self._addr)  # nobody took ownership

    def hand_over(self):
        jax = sys.modules["jax"]
        try:
            from_dlpack = jax.dlpack.from_dlpack
        except AttributeError:
            from_dlpack = jax.numpy.from_dlpack
        try:
            return from_dlpack(self)
        finally:
            self._reclaim_unconsumed()

    def __del__(self):
        try:
            if self._state == "new":
                self._state = "freed"
                from . import cuda as _cuda

                _cuda.ensure_context(self.device_id, force=True)  # any thread (the GC's): as _free_managed
                _cuda.mem_free_async(self.ptr, self.launch_stream)
            elif self._state == "exported":
                self._reclaim_unconsumed()
        except Exception:
            pass  # interpreter shutdown or a dead context: nothing sensible left to do
