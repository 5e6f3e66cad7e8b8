"""merge_state / merge_states inside ``jax.jit`` (pyflashattn.cascade's arguments, conventions and
messages).

The engine's checks (pyflashattn._engine.cascade.check_*) run at trace time on the arguments'
shapes and dtypes; the callback runs the engine's launch (launch_*) on XLA's buffers and stream.

vmap over leading axes: ``vmap_method="broadcast_all"`` hands the callback every buffer with the
same leading (vmapped) dims, dense and row-major, so a batch of states [B, seq, ...] is the states
[B * seq, ...] of one launch.
"""
from __future__ import annotations

import math

from .._engine import cascade as _engine
from .._runtime import cuda as _cuda, dtypes as _dtypes
from .._runtime.dlpack import compact_strides, kDLCUDA
from . import _bridge

_CACHE = _bridge.CallCache()  # (kind, shapes, dtypes, lse_base, GPUs) -> _bridge.Callable


def merge_state(v_a, s_a, v_b, s_b, *, lse_base: str = "log2"):
    """pyflashattn.merge_state as a jittable JAX function: (v, s), the merge of states a and b.

    v_a, v_b: [seq, num_heads, head_dim] float16 / bfloat16 / float32 (one dtype); s_a, s_b:
    [seq, num_heads] float32 LSEs in lse_base ("log2", FlashInfer's, or "ln"). Errors are raised at
    trace time with the eager API's messages. vmap over leading axes is one launch."""
    ordinals = _bridge.gpu_ordinals()
    views = _views(((v_a, "v_a"), (s_a, "s_a"), (v_b, "v_b"), (s_b, "s_b")), ordinals[0])
    va, _, _, _, scales = _engine.check_pair(*views, lse_base)
    call = _callable("pair", views, scales, ordinals, va.shape, va.shape[:2])
    v, s = call(v_a, s_a, v_b, s_b)
    return v, s


def merge_states(v, s, *, lse_base: str = "log2"):
    """pyflashattn.merge_states as a jittable JAX function: (v, s), the merge of the N states
    stacked in v [seq, N, num_heads, head_dim] (float16 / bfloat16 / float32) and s [seq, N,
    num_heads] (float32). N = 0 gives v = 0, s = -inf; errors at trace time, vmap as merge_state."""
    ordinals = _bridge.gpu_ordinals()
    views = _views(((v, "v"), (s, "s")), ordinals[0])
    vv, _, scales = _engine.check_stacked(*views, lse_base)
    seq, _, heads, head_dim = vv.shape
    call = _callable("stacked", views, scales, ordinals, (seq, heads, head_dim), (seq, heads))
    out, lse = call(v, s)
    return out, lse


def merge_state_in_place(v, s, v_other, s_other, mask=None, *, lse_base: str = "log2"):
    """Not available: JAX arrays are immutable (TypeError); merge_state returns the merged (v, s)."""
    raise TypeError("pyflashattn.jax.merge_state_in_place: JAX arrays are immutable, so (v, s) cannot be updated "
                    "in place; use merge_state(v_a, s_a, v_b, s_b), which returns the merged (v, s)")


def _views(named, dev: int) -> list:
    return [_bridge.aval_view(x, name, dev) for x, name in named]


def _callable(kind: str, views, scales: tuple, ordinals, v_shape: tuple, s_shape: tuple) -> _bridge.Callable:
    """The cached callable of this signature: results v (the values' dtype) and s (float32)."""
    key = (kind, tuple((v.shape, v.dtype.name) for v in views), scales, tuple(ordinals))
    return _CACHE.get(key, lambda: _build(kind, views[0].dtype, scales, ordinals, v_shape, s_shape))


def _build(kind: str, dtype, scales: tuple, ordinals, v_shape: tuple, s_shape: tuple) -> _bridge.Callable:
    import jax

    # One launcher per local GPU, made now (the module load is host work, not for XLA's threads),
    # each with its own params struct: the callable's lock guards it, not the engine's thread cache.
    launchers = {}
    for dev in ordinals:
        _cuda.ensure_context(dev)
        launchers[dev] = _engine.new_launcher(dtype, dev)
    specs = (jax.ShapeDtypeStruct(v_shape, _bridge.jax_dtype(dtype)),
             jax.ShapeDtypeStruct(s_shape, _bridge.jax_dtype(_dtypes.FLOAT32)))

    def launch(stream, outs, ins):
        if not math.prod(outs[1].shape):  # no (row, head): nothing to launch, maybe no address to ask
            return
        dev = _bridge.device_of(stream, ordinals)
        if kind == "pair":
            va, sa, vb, sb = (_flat(b, dev, n) for b, n in zip(ins, (3, 2, 3, 2)))
            vo, so = _flat(outs[0], dev, 3), _flat(outs[1], dev, 2)
            _engine.check_sizes(vo.shape, 2)  # the vmapped rows too
            _engine.launch_pair(va, sa, vb, sb, vo, so, scales, stream, launchers[dev])
        else:
            vv, sv = _flat(ins[0], dev, 4), _flat(ins[1], dev, 3)
            vo, so = _flat(outs[0], dev, 3), _flat(outs[1], dev, 2)
            _engine.check_sizes(vo.shape, vv.shape[1])
            _engine.launch_stacked(vv, sv, vo, so, scales, stream, launchers[dev])

    what = "merge_state" if kind == "pair" else "merge_states"
    return _bridge.Callable(f"{what} ({_engine.VALUE_DTYPES[dtype]})", launch, specs, vmap_method="broadcast_all")


def _flat(buf, dev: int, ndim: int):
    """The view of an XLA buffer (_bridge.XBuf) whose unvmapped rank is ndim, its vmapped leading
    dims folded into its first (dense row-major: [B, seq, ...] is [B * seq, ...])."""
    shape = tuple(int(n) for n in buf.shape)
    lead = len(shape) - ndim
    shape = (math.prod(shape[:lead + 1]),) + shape[lead + 1:]
    return _bridge.TensorView(buf, _bridge.buffer_ptr(buf), shape, compact_strides(shape), buf.dtype, kDLCUDA, dev,
                              _bridge.FRAMEWORK)
