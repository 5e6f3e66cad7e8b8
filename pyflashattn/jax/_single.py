"""Single prefill inside ``jax.jit`` (the eager API's arguments and conventions; pyflashattn.prefill).

The plan (SinglePlan: validation, routing, KV split, workspace size) is built at trace time from
the arguments' shapes and dtypes, once per local GPU; the callback points it at XLA's buffers.
The split-KV partials and the tile scheduler's counters live in a scratch output that XLA
allocates with the call (the counters zeroed on the stream before the launch).

vmap over leading axes: ``vmap_method="broadcast_all"``, and the callback launches the plan once
per batch element (the elements' buffers are consecutive slices).
"""
from __future__ import annotations

from .._engine import fp8, operands, options
from .._engine.single import SinglePlan
from .._runtime import cuda as _cuda, dtypes as _dtypes
from . import _bridge

_CACHE = _bridge.CallCache()  # plan key -> _bridge.Callable


def _key_of(*views):
    return tuple(None if v is None else (v.shape, v.dtype.name) for v in views)


def single_prefill_with_kv_cache(q, k, v, custom_mask=None, packed_custom_mask=None, causal: bool = False,
                                 kv_layout: str = "NHD", pos_encoding_mode: str = "NONE",
                                 allow_fp16_qk_reduction: bool = False, sm_scale=None, window_left: int = -1,
                                 logits_soft_cap=None, rope_scale=None, rope_theta=None, *, return_lse: bool = False,
                                 lse_base: str = "log2", k_scale=None, v_scale=None, scale_q=None, scale_k=None,
                                 scale_v=None, o_dtype=None, out=None, lse=None):
    """pyflashattn.single_prefill_with_kv_cache as a jittable JAX function: jax.Array inputs (q, k, v,
    the mask, fp8 per-head scales), Python options (static under jit), returns o (and lse with
    return_lse). Errors are raised at trace time with the eager API's messages; out= / lse= refuse
    (JAX arrays are immutable). vmap over leading axes launches once per element."""
    _bridge.no_out("single_prefill_with_kv_cache", out=out, lse=lse)
    ordinals = _bridge.gpu_ordinals()
    dev0 = ordinals[0]
    opts = options.resolve(pos_encoding_mode, allow_fp16_qk_reduction, logits_soft_cap, rope_scale, rope_theta,
                           lse_base)
    qv, kv, vv = (_bridge.aval_view(x, n, dev0) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    if k_scale is not None:
        sm_scale = options.softmax_scale(sm_scale, qv.shape[-1]) * operands.scale_arg(k_scale, "k_scale")
    vs = operands.scale_arg(v_scale, "v_scale")
    names = ("scale_q", "scale_k", "scale_v")
    scale_arrays = [x if x is not None and hasattr(x, "shape") else None for x in (scale_q, scale_k, scale_v)]
    scale_views = [None if a is None else _bridge.aval_view(a, n, dev0) for a, n in zip(scale_arrays, names)]
    numbers = tuple(sv if sv is not None else x for sv, x in zip(scale_views, (scale_q, scale_k, scale_v)))
    fp8_args = any(x is not None for x in (scale_q, scale_k, scale_v, o_dtype))
    if fp8_args:
        sm_scale, vs = fp8.fold_numbers(numbers, sm_scale, vs, qv.shape[-1])
    mask_kind = "packed" if packed_custom_mask is not None else "bool" if custom_mask is not None else None
    mask = packed_custom_mask if mask_kind == "packed" else custom_mask
    mname = "packed_custom_mask" if mask_kind == "packed" else "custom_mask"
    mv = _bridge.aval_view(mask, mname, dev0) if mask_kind else None
    key = (_key_of(qv, kv, vv, mv, *scale_views), bool(causal), kv_layout, window_left, sm_scale, opts, mask_kind,
           o_dtype, vs, bool(return_lse), tuple(ordinals))
    call = _CACHE.get(key, lambda: _build(ordinals, qv, kv, vv, mv, mask_kind, causal, kv_layout, window_left,
                                          sm_scale, opts, o_dtype, vs, numbers, fp8_args, return_lse))
    args = [q, k, v] + ([mask] if mask_kind else []) + [a for a in scale_arrays if a is not None]
    res = call(*args)
    return (res[0], res[1]) if return_lse else res[0]


def _build(ordinals, qv, kv, vv, mv, mask_kind, causal, kv_layout, window_left, sm_scale, opts, o_dtype, vs,
           numbers, fp8_args, return_lse):
    """Plans for every local GPU (the first one's errors are the call's), the result specs and the
    callable."""
    import jax

    plans = {}
    for dev in ordinals:
        views = [_relocate(x, dev) for x in (qv, kv, vv, mv)]
        plan = plans[dev] = SinglePlan(views[0], views[1], views[2], None, None, bool(causal), kv_layout,
                                       window_left, sm_scale, opts, mask_kind, views[3], o_dtype)
        # validated at trace time: per-head tensors only with an fp8 q, their shapes and dtypes
        if fp8_args or plan.fp8:
            plan.scale_pointers(tuple(_relocate(x, dev) if type(x) is _bridge.TensorView else x for x in numbers))
    plan = plans[ordinals[0]]
    specs = [jax.ShapeDtypeStruct(plan.o_shape, _bridge.jax_dtype(plan.odt))]
    if return_lse:
        specs.append(jax.ShapeDtypeStruct(plan.lse_shape, _bridge.jax_dtype(_dtypes.FLOAT32)))
    # one scratch layout for every local GPU's plan (the KV split, and so the partials' bytes,
    # follows each GPU's SM count): the largest workspace, the counters behind it
    ws = max(_bridge.scratch_bytes(q.ws_bytes) for q in plans.values())
    scratch = ws + _bridge.COUNTER_BYTES if any(q.attn is not None and (q.ws_bytes or q.section)
                                                for q in plans.values()) else 0
    if scratch:
        specs.append(jax.ShapeDtypeStruct((scratch,), _bridge.jax_dtype(_dtypes.UINT8)))
    tensor_scales = [type(x) is _bridge.TensorView for x in numbers]
    kernel = plan.attn.name if plan.attn is not None else "none"

    def launch(stream, outs, ins):
        dev = _bridge.device_of(stream, ordinals)
        p = plans[dev]
        if p.attn is None:
            return
        lead, count = _bridge.lead_count(ins[0], 3)
        o, lse = outs[0], (outs[1] if return_lse else None)
        base = _bridge.buffer_ptr(outs[-1]) if scratch else 0
        ws_ptr, sched = (base, base + ws) if scratch else (0, None)
        if scratch and p.section:
            _cuda.memset32_async(sched, 0, _bridge.COUNTER_BYTES // 4, stream)
        elems = [_elements(b, lead) for b in ins]
        o_elems, lse_elems = _elements(o, lead), (_elements(lse, lead) if lse is not None else 0)
        mask_at = 3 if mask_kind else None
        scale_at = 4 if mask_kind else 3
        for i in range(count):
            q_p, k_p, v_p = (_slice_ptr(b, i * n) for b, n in zip(ins[:3], elems[:3]))
            mview = _bridge.buffer_view(ins[mask_at], dev, i * elems[mask_at], lead) if mask_kind else None
            scale_ptrs = None
            if fp8_args or p.fp8:
                j, scales = scale_at, []
                for is_tensor, x in zip(tensor_scales, numbers):
                    if is_tensor:
                        x = _bridge.buffer_view(ins[j], dev, i * elems[j], lead)
                        j += 1
                    scales.append(x)
                scale_ptrs = p.scale_pointers(tuple(scales))
            p.run(q_p, k_p, v_p, _slice_ptr(o, i * o_elems), _slice_ptr(lse, i * lse_elems) if lse is not None else 0,
                  stream, mview, vs, scale_ptrs, ws=ws_ptr, sched=sched)

    return _bridge.Callable(f"single_prefill_with_kv_cache ({kernel})", launch, specs, vmap_method="broadcast_all")


def _relocate(v, dev):
    """A trace-time view on another device (the plans of the other local GPUs)."""
    if v is None or v.device_id == dev:
        return v
    return _bridge.TensorView(None, 0, v.shape, v.strides, v.dtype, v.device_type, dev, v.framework)


def _elements(buf, lead: int) -> int:
    """Elements of one vmapped slice of an XLA buffer."""
    n = 1
    for s in tuple(buf.shape)[lead:]:
        n *= int(s)
    return n


def _slice_ptr(buf, elem_offset: int) -> int:
    return _bridge.buffer_ptr(buf) + _dtypes.normalize(buf.dtype).nbytes(elem_offset)
