"""xqa_batch_decode_with_kv_cache inside ``jax.jit`` (the eager API's arguments and conventions;
pyflashattn.decode, _engine/xqa.py).

XQA has no plan(): the schedule follows from the shapes and max_seq_len, and the kernel reads the
page table (block_tables) and lengths (seq_lens) on the device. So everything host-side happens at
trace time: the eager checks (xqa.check) on views of the traced arguments, with the eager messages,
then one engine planned per local GPU for the call's shape (kernel, schedule, metadata staged and
waited for). The callback only points the planned struct at XLA's buffers and launches on XLA's
stream: it plans nothing, loads no module, allocates nothing and never waits, so a launch depends
on the trace and the buffer addresses alone (XLA may record it into a CUDA graph). New seq_lens,
block tables, device scales or cache contents of the same shapes reuse the trace and the graph.

workspace_buffer is accepted for FlashInfer compatibility and checked like the eager API's (a
1-D array; None is allowed too), but never read or written: the eager call keeps its split-KV
partials there, and inside jit that memory is a scratch output XLA allocates with the call (its
size is the plan's need, so the eager "pass a larger workspace_buffer" error cannot happen). The
partials need no zeroing (unlike FlashInfer's XQA semaphores); the sm_90 tile scheduler's counters,
which must start at zero, sit behind them and are zeroed on the stream before each launch.

Differences from the eager API: the result is returned (out= raises TypeError: JAX arrays are
immutable), so the fp8 / other-16-bit output is chosen with out_dtype (query's dtype by default;
float16, bfloat16 or float8_e4m3fn, dequantised as out * o_scale as in the eager API);
max_seq_len, q_len_per_req, window_left, the float scales and the options are static Python values
(the float scales are baked into the launch; pass one-element float32 arrays to change them
without re-tracing); PYFLASHATTN_CHECK_METADATA=1 raises NotImplementedError (its host check needs
the metadata's values, which a trace does not have). vmap raises NotImplementedError: the batch is
block_tables' rows.
"""
from __future__ import annotations

import os

import numpy as np

from .._engine import operands, xqa
from .._runtime import dtypes as _dtypes, tensor as _tensor
from . import _bridge

NAME = "xqa_batch_decode_with_kv_cache"
_CACHE = _bridge.CallCache()  # call key -> _bridge.Callable (refusing vmap)
_CACHE_NAMES = ("k_cache", "v_cache")
_SF_NAMES = ("k_sf", "v_sf")


def xqa_batch_decode_with_kv_cache(query, kv_cache, workspace_buffer, block_tables, seq_lens, max_seq_len: int,
                                   bmm1_scale=1.0, bmm2_scale=1.0, window_left: int = -1, out=None, sinks=None,
                                   kv_layout: str = "NHD", enable_pdl=None, q_len_per_req: int | None = 1,
                                   o_scale=1.0, mask=None, kv_cache_sf=None, *, out_dtype=None):
    """pyflashattn.decode.xqa_batch_decode_with_kv_cache as a jittable JAX function: jax.Array inputs
    (query, kv_cache or its (k, v) tuple, block_tables, seq_lens, sinks, mask, kv_cache_sf, and
    bmm1_scale / bmm2_scale when they are one-element float32 arrays), Python options (static under
    jit); returns out [B * q_len_per_req, Hq, D] in out_dtype (query's by default). Errors raise at
    trace time with the eager API's messages; see the module docstring for workspace_buffer, out=
    and vmap."""
    _bridge.no_out(NAME, out=out)
    _bridge.require_static(NAME, max_seq_len=max_seq_len, q_len_per_req=q_len_per_req, window_left=window_left,
                           o_scale=o_scale)
    _bridge.refuse_checked_mode(NAME, "block_tables and seq_lens")
    ordinals = _bridge.gpu_ordinals()
    dev0 = ordinals[0]
    names, arrays, views = _operands(dev0, query, kv_cache, block_tables, seq_lens, mask, sinks, kv_cache_sf,
                                     bmm1_scale, bmm2_scale)
    scale1 = views.get("bmm1_scale", bmm1_scale)
    scale2 = views.get("bmm2_scale", bmm2_scale)
    c = xqa.check(views["query"], _cache_form(views, "kv_cache", _CACHE_NAMES), views["block_tables"],
                  views["seq_lens"], max_seq_len, scale1, scale2, None, kv_layout, q_len_per_req, o_scale,
                  views.get("mask"), _cache_form(views, "kv_cache_sf", _SF_NAMES), out_dtype)
    if workspace_buffer is not None:  # never used (module docstring): checked as the eager API checks it
        operands.contiguous_1d(_bridge.aval_view(workspace_buffer, "workspace_buffer", dev0), "workspace_buffer")
    if "sinks" in views:  # (the eager API checks them at launch)
        operands.sinks_operand(views["sinks"], c.hq, c.hkv, c.dev)
    general = os.environ.get(xqa.SPEC_GENERAL_ENV) == "1"  # read at plan time, as by the eager API
    key = (tuple((n, views[n].shape, views[n].dtype.name) for n in names), c.plan_key(), window_left, c.s1, c.s2,
           enable_pdl, general, tuple(ordinals))
    hit = _CACHE.get(key, lambda: _build(ordinals, names, c, window_left, "bmm1_scale" in views, enable_pdl))
    return hit(*arrays)[0]


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _operands(dev: int, query, kv_cache, block_tables, seq_lens, mask, sinks, kv_cache_sf, s1, s2):
    """(names, arrays, views): the callback's inputs in order, and a trace-time view of each by name
    (a tuple cache and its block scales as two inputs each)."""
    names, arrays, views = [], [], {}

    def add(name, x, shown=None):
        names.append(name)
        arrays.append(x)
        views[name] = _bridge.aval_view(x, shown or name, dev)

    add("query", query)
    _add_parts(add, kv_cache, "kv_cache", _CACHE_NAMES)
    add("block_tables", block_tables)
    add("seq_lens", seq_lens)
    for name, x in (("mask", mask), ("sinks", sinks)):
        if x is not None:
            add(name, x)
    if kv_cache_sf is not None:
        _add_parts(add, kv_cache_sf, "kv_cache_sf", _SF_NAMES)
    for name, x in (("bmm1_scale", s1), ("bmm2_scale", s2)):
        if not _is_number(x):  # a device scale (anything else: the check's TypeError names it)
            add(name, x)
    return tuple(names), arrays, views


def _add_parts(add, x, name: str, part_names: tuple) -> None:
    """One array, or each array of a tuple (named k_... / v_..., an odd length under the tuple's
    name: the check refuses it)."""
    if not isinstance(x, (tuple, list)):
        add(name, x)
        return
    for i, part in enumerate(x):
        add(part_names[i] if len(x) == 2 else f"{name}[{i}]", part, part_names[i] if i < 2 else name)


def _cache_form(views: dict, name: str, part_names: tuple):
    """The view (or tuple of views) of a cache / block scales as the caller passed it (None: absent)."""
    if name in views:
        return views[name]
    parts = [v for n, v in views.items() if n in part_names or n.startswith(name + "[")]
    return tuple(parts) if parts else None


def _plan(dev: int, c, window_left, scale_on_device: bool):
    """The engine of one local GPU, planned, its metadata on the device (waited for here: the
    callback never orders itself after the plan's copy)."""
    return _bridge.engine_ready(xqa.plan_engine(_bridge.plan_workspace(dev), c, window_left, scale_on_device))


def _build(ordinals, names, c, window_left, scale_on_device, enable_pdl):
    """The engines of every local GPU, the result specs and the callable (refusing vmap)."""
    import jax

    engines = {dev: _plan(dev, c, window_left, scale_on_device) for dev in ordinals}
    ws, scratch = _bridge.engines_scratch(engines.values())
    specs = [jax.ShapeDtypeStruct((c.batch * c.q_len, c.hq, c.hd), _bridge.jax_dtype(c.odt))]
    if scratch:
        specs.append(jax.ShapeDtypeStruct((scratch,), _bridge.jax_dtype(_dtypes.UINT8)))
    at = {n: i for i, n in enumerate(names)}
    planned_keys, num_pages, words, s1, s2 = c.pages * c.page_size, c.num_pages, c.words, c.s1, c.s2

    def launch(stream, outs, ins):
        dev = _bridge.device_of(stream, ordinals)
        e = engines[dev]
        view = {n: _bridge.buffer_view(ins[i], dev) for n, i in at.items()}
        ptr = {n: v.ptr for n, v in view.items()}
        p = e.attn.params
        xqa.point(p, ptr["block_tables"], ptr["seq_lens"], planned_keys, num_pages, ptr.get("bmm1_scale", 0),
                  ptr.get("bmm2_scale", 0), words, ptr.get("mask", 0))
        if scratch:
            _bridge.point_scratch(e, _bridge.buffer_ptr(outs[-1]), ws, stream)
        e.run_paged(view["query"], _launch_form(view, "kv_cache", _CACHE_NAMES), k_scale=s1, v_scale=s2,
                    out=_bridge.buffer_view(outs[0], dev), stream=stream, enable_pdl=enable_pdl,
                    sinks=view.get("sinks"), kv_cache_sf=_launch_form(view, "kv_cache_sf", _SF_NAMES))

    call = _bridge.Callable(f"{NAME} ({engines[ordinals[0]].attn.name})", launch, specs, no_vmap=(
        f"pyflashattn.jax.{NAME} does not support vmap: its batch is the rows of block_tables / seq_lens (stack the "
        "requests there, with query rows [batch * q_len_per_req]) or call it once per batch"))
    return call


def _launch_form(view: dict, name: str, part_names: tuple):
    """What run_paged takes for a cache (or its block scales) of XLA buffers: the (k, v) pair, the
    [P, 2, ...] array, or a [P, 1, ...] array as the pair of its halves (K and V share it)."""
    if name in view:
        v = view[name]
        if v.shape[1] == 1:
            half = _tensor.index_dim1(v, 0)
            return half, half
        return v
    if part_names[0] in view:
        return view[part_names[0]], view[part_names[1]]
    return None
