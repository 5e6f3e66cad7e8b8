"""The bridge between XLA and the engine: XLA's device buffers as the engine's tensor views, the
call through ``jax.experimental.buffer_callback``, trace-time views, XLA's scratch memory.

How a jitted call runs (../shared/reference/jax-jit.md, route 1): at trace time a function of this
package checks its arguments and builds its plan from the arguments' shapes and dtypes (fake
views: no address yet), so bad input raises there with the eager API's messages. The plan goes
into the closure of a callback; XLA calls the callback with its buffers and its CUDA stream, and
the callback only points the plan's structs at the buffers and launches on that stream: no host
sync, no allocation (memory a launch needs beyond its outputs is a scratch output that XLA
allocates with the call), no call into ``jax``. With ``command_buffer_compatible`` XLA records the
launches into a CUDA graph and replays it; Python runs again only when buffer addresses change,
so a launch's parameters may depend on nothing but the plan and the addresses.

A callback may run on any of XLA's threads, and for every local GPU (``shard_map``): the plans
are built at trace time for each local GPU that JAX sees and picked by the device that holds the
call's first buffer; a lock per callable serialises the struct writes and launches of one plan.
"""
from __future__ import annotations

import math
import os
import threading

import numpy as np

from .._runtime import cuda as _cuda, dtypes as _dtypes
from .._runtime.dlpack import compact_strides, kDLCUDA
from .._runtime.tensor import TensorView

FRAMEWORK = "xla"  # the TensorViews of XLA buffers (pyflashattn._runtime.tensor passes views through)
COUNTER_BYTES = 16  # the tile scheduler's two int32 counters in a scratch output, 16-byte aligned
# The float workspace trace-time engines plan against: never refuses a plan (XLA's scratch then holds
# exactly what the plan needs, ws_need), never read (its address is the scratch's at each launch)
PLAN_WORKSPACE_BYTES = 1 << 40


def _jax():
    import jax

    return jax


def buffer_callback():
    """jax.experimental.buffer_callback.buffer_callback, or ImportError naming the JAX it needs."""
    try:
        from jax.experimental.buffer_callback import buffer_callback as bc
    except ImportError:
        jax = _jax()
        raise ImportError(f"pyflashattn.jax needs jax.experimental.buffer_callback (JAX 0.6.1 or newer); "
                          f"this JAX is {getattr(jax, '__version__', 'unknown')}") from None
    return bc


def gpu_ordinals() -> list[int]:
    """CUDA ordinals of the local GPUs JAX sees (its CUDA platform's devices)."""
    jax = _jax()
    try:
        devs = jax.local_devices(backend="gpu")
    except RuntimeError as e:
        raise RuntimeError(f"pyflashattn.jax needs JAX's CUDA backend (jax[cuda]): {e}") from None
    return [int(getattr(d, "local_hardware_id", d.id)) for d in devs]


def jax_dtype(dt: _dtypes.DType):
    """The numpy/ml_dtypes dtype JAX uses for a DType."""
    import jax.numpy as jnp

    return jnp.dtype(dt.name)


def aval_view(x, name: str, dev: int) -> TensorView:
    """A trace-time view of a JAX value (tracer or array): shape, dtype and dense strides, no address
    (0: aligned for every check). TypeError naming the argument for a non-array or a dtype the
    library has no name for."""
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"{name} must be a JAX array, got {type(x).__name__}")
    try:
        dt = _dtypes.normalize(dtype)
    except TypeError as e:
        raise TypeError(f"{name}: {e}") from None
    shape = tuple(int(s) for s in shape)
    return TensorView(None, 0, shape, compact_strides(shape), dt, kDLCUDA, dev, FRAMEWORK)


class XBuf:
    """An XLA buffer as the callback sees it: address, shape (vmapped dims first) and the DType it
    holds (an fp8 array crosses the callback as uint8 bytes: XLA's buffers describe no fp8 type
    through __cuda_array_interface__, so Callable bitcasts fp8 to uint8 around the call)."""

    __slots__ = ("ptr", "shape", "dtype")

    def __init__(self, buf, dtype: _dtypes.DType):
        self.ptr = int(buf.__cuda_array_interface__["data"][0])
        self.shape = tuple(buf.shape)
        self.dtype = dtype


def buffer_view(buf: XBuf, dev: int, offset: int = 0, lead: int = 0) -> TensorView:
    """The view of an XLA buffer (dense, row-major) inside a callback; lead > 0 drops that many
    leading (vmapped) dims, offset: the element offset of the slice viewed."""
    shape = buf.shape[lead:]
    return TensorView(buf, buf.ptr + buf.dtype.nbytes(offset), shape, compact_strides(shape), buf.dtype, kDLCUDA, dev,
                      FRAMEWORK)


def buffer_ptr(buf: XBuf) -> int:
    return buf.ptr


def device_of(stream: int, ordinals: list[int]) -> int:
    """The ordinal of the GPU a callback's XLA stream belongs to, its context made current: XLA
    calls back on threads whose current context it sets itself, and a kernel loaded for one device
    does not launch on another's stream (CUDA_ERROR_INVALID_HANDLE under shard_map over two GPUs,
    where the buffers' pointer attribute named device 0 for device 1's memory)."""
    if len(ordinals) == 1:
        _cuda.ensure_context(ordinals[0], force=True)
        return ordinals[0]
    return _cuda.stream_device(stream)


def no_out(fn_name: str, **given) -> None:
    """JAX arrays are immutable: out= / lse= (and in-place writes) refuse with TypeError."""
    for name, val in given.items():
        if val is not None:
            raise TypeError(f"pyflashattn.jax.{fn_name}: {name}= is not supported: JAX arrays are immutable, "
                            "the result is returned as a new array")


# A test switch: "1" NaN-fills (0xff bytes) every floating result buffer on the launch stream before
# each callback's launch, as the eager tests poison their out= (XLA's result buffers are otherwise
# whatever memory XLA reuses, so an element a kernel failed to write could pass). Read when a
# Callable is built. Aliased (in-place) results and the byte / integer scratch are left alone.
POISON_ENV = "PFA_JAX_POISON_OUTPUTS"


def poisoned_results(out_dtypes, aliases) -> list[int]:
    """The results POISON_ENV fills: floating ones (0xff is NaN in fp32 / bf16 / fp16 / fp8; not
    e2m1 codes), not aliased to an input (an in-place write keeps the rest of its buffer)."""
    if os.environ.get(POISON_ENV) != "1":
        return []
    aliased = set((aliases or {}).values())
    return [i for i, d in enumerate(out_dtypes)
            if d.name.startswith(("float", "bfloat")) and "e2m1" not in d.name and i not in aliased]


def _is_fp8(dt: _dtypes.DType) -> bool:
    return dt.bits == 8 and dt.name.startswith("float8")


class Callable:
    """One jittable call: buffer_callback over `launch(stream, outs, ins)` (XBufs), with a lock and
    the error naming the kernel. Built once per plan key (call sites cache it), so eager calls
    reuse JAX's compiled wrapper instead of compiling a new one per call. fp8 inputs and results
    cross as uint8 (a bitcast in XLA, free), their XBufs carrying the fp8 DType."""

    def __init__(self, what: str, launch, result_specs, vmap_method=None, aliases=None, no_vmap: str | None = None):
        """no_vmap: where the call has no vmap (its batch is a plan's or its metadata's), the
        NotImplementedError message a vmap of it raises (buffer_callback's own names its primitive)."""
        jax = _jax()
        self.what = what
        self.launch = launch
        self.lock = threading.Lock()
        self.out_dtypes = [_dtypes.normalize(s.dtype) for s in result_specs]
        self.out_fp8 = [_is_fp8(d) for d in self.out_dtypes]
        specs = [jax.ShapeDtypeStruct(s.shape, jax_dtype(_dtypes.UINT8)) if f else s
                 for s, f in zip(result_specs, self.out_fp8)]
        self.in_dtypes = None  # the inputs' DTypes, from the first call (a trace's signature is fixed)
        self.python_launches = 0  # callbacks run (a replayed command buffer runs none: bench jax reports it)
        self.poison = poisoned_results(self.out_dtypes, aliases)
        self.fn = buffer_callback()(self._callback, specs, vmap_method=vmap_method,
                                    input_output_aliases=aliases, command_buffer_compatible=True)
        call = self._call if no_vmap is None else _refusing_vmap(jax, self._call, no_vmap)
        self.call = _refusing_grad(jax, call, f"pyflashattn.jax {what.split(' (')[0]}")

    def _callback(self, ctx, outs, *ins):
        self.python_launches += 1
        try:
            with self.lock:
                stream, xouts = int(ctx.stream), [XBuf(b, d) for b, d in zip(outs, self.out_dtypes)]
                if self.poison:
                    _cuda.stream_device(stream)  # the stream's context current (XLA's thread)
                for i in self.poison:
                    b = xouts[i]
                    _cuda.memset8_async(b.ptr, 0xFF, b.dtype.nbytes(math.prod(b.shape)), stream)
                self.launch(stream, xouts, [XBuf(b, d) for b, d in zip(ins, self.in_dtypes)])
        except Exception as e:  # noqa: BLE001 - surfaces as JaxRuntimeError with this message
            raise RuntimeError(f"pyflashattn.jax {self.what}: {type(e).__name__}: {e}") from e

    def __call__(self, *args):
        return self.call(*args)

    def _call(self, *args):
        jax = _jax()
        dts = [_dtypes.normalize(a.dtype) for a in args]
        if self.in_dtypes is None:
            self.in_dtypes = dts
        u8 = jax_dtype(_dtypes.UINT8)
        args = [jax.lax.bitcast_convert_type(a, u8) if _is_fp8(d) else a for a, d in zip(args, dts)]
        res = self.fn(*args)
        return [jax.lax.bitcast_convert_type(r, jax_dtype(d)) if f else r
                for r, d, f in zip(res, self.out_dtypes, self.out_fp8)]


class CallCache:
    """Each module's built Callables by call key (eager calls reuse JAX's compiled wrapper): at most
    `size`, cleared when full (the keys are shapes and settings: a program uses few)."""

    def __init__(self, size: int = 64):
        self.size, self.calls = size, {}

    def get(self, key, build) -> "Callable":
        """The Callable for key, build() on a miss."""
        call = self.calls.get(key)
        if call is None:
            call = build()
            if len(self.calls) >= self.size:
                self.calls.clear()
            self.calls[key] = call
        return call


def _refusing_grad(jax, call, who: str):
    """call, whose differentiation raises NotImplementedError naming it (jax.custom_jvp: the
    kernels are forward-only; buffer_callback's own error names its primitive)."""
    fn = jax.custom_jvp(lambda *args: call(*args))

    @fn.defjvp
    def _jvp(primals, tangents):
        raise NotImplementedError(f"{who}: gradients are not supported (pyflashattn's kernels are forward-only); "
                                  "wrap its inputs in jax.lax.stop_gradient to differentiate the rest of the model")

    return fn


def _refusing_vmap(jax, call, message: str):
    """call, whose vmap raises NotImplementedError(message) (jax.custom_batching.custom_vmap: also
    under a vmap outside a jitted function)."""
    fn = jax.custom_batching.custom_vmap(lambda *args: call(*args))

    @fn.def_vmap
    def _refuse(axis_size, in_batched, *args):
        raise NotImplementedError(message)

    return fn


def plan_workspace(dev: int, nbytes: int = PLAN_WORKSPACE_BYTES) -> TensorView:
    """An address-less float workspace of nbytes on dev for a trace-time engine to plan against."""
    return TensorView(None, 0, (int(nbytes),), (1,), _dtypes.UINT8, kDLCUDA, dev, FRAMEWORK)


def engine_ready(e):
    """A trace-time engine with its staged metadata on the device (waited for here, at trace time:
    the callback never orders itself after the plan's copy)."""
    _cuda.check(_cuda.driver().cuStreamSynchronize(e.plan_stream), "cuStreamSynchronize")
    e.pending_copy = False
    return e


def engines_scratch(engines) -> tuple[int, int]:
    """(workspace bytes, scratch bytes) for the trace-time engines of the local GPUs: the largest
    plan's workspace, then the tile scheduler's counters where a kernel takes them."""
    ws = max(scratch_bytes(e.ws_need) if e.ws_need else 0 for e in engines)
    sched = any(getattr(e.attn.params, "sched", 0) for e in engines)
    return ws, ws + (COUNTER_BYTES if sched else 0)


def point_scratch(e, base: int, ws: int, stream: int) -> None:
    """Point an engine at a scratch output laid out as engines_scratch() sized it: the plan's float
    workspace at its start, the tile scheduler's counters at ws (they must start at zero: zeroed
    on the stream, before the launch)."""
    if e.ws_need:
        e.point_workspace(base)
    p = e.attn.params
    if getattr(p, "sched", 0):
        p.sched = base + ws
        _cuda.memset32_async(base + ws, 0, COUNTER_BYTES // 4, stream)


def require_static(fn_name: str, **given) -> None:
    """The arguments that fix a plan or a launch must be Python values (static under jit)."""
    for name, val in given.items():
        if hasattr(val, "shape") and not isinstance(val, (np.integer, np.floating)):
            raise TypeError(f"pyflashattn.jax.{fn_name}: {name} must be a Python value (static under jit: it fixes "
                            f"the plan), got {type(val).__name__}")


def refuse_checked_mode(fn_name: str, reads: str) -> None:
    """PYFLASHATTN_CHECK_METADATA=1 reads device metadata on the host, which a trace does not have."""
    from .._engine.metadata_check import metadata_checks_enabled

    if metadata_checks_enabled():
        raise NotImplementedError(f"pyflashattn.jax.{fn_name}: PYFLASHATTN_CHECK_METADATA=1 is not supported under "
                                  f"jax: its host check reads {reads}, which a trace does not have; unset it for "
                                  "jitted calls (the kernel still clamps bad metadata)")


def scratch_bytes(nbytes: int) -> int:
    """A scratch part's room, 16-byte aligned."""
    return (int(nbytes) + 15) // 16 * 16


def lead_count(buf, base_ndim: int) -> tuple[int, int]:
    """(leading vmapped dims, their product) of a buffer whose unbatched rank is base_ndim."""
    lead = len(buf.shape) - base_ndim
    return lead, math.prod(tuple(buf.shape)[:lead]) if lead > 0 else 1
