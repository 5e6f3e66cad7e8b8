"""trtllm_fmha_v2_prefill and trtllm_batch_context_with_kv_cache inside ``jax.jit`` (the eager APIs'
arguments and conventions; pyflashattn.prefill, _engine/trtllm*.py).

Both run the eager device-metadata path (trtllm_device.py): the plan covers batch_size requests at
(coarsely rounded) max_q_len / max_kv_len, and the kernel reads cum_seq_lens_q, cum_seq_lens_kv or
seq_lens and block_tables on the device. So everything host-side happens at trace time: the eager
check (trtllm_fmha.check / trtllm_context.check, then the device metadata's checks) on views of
the traced arguments, with the eager messages, then one engine planned per local GPU (its metadata
staged and waited for). The callback runs the same checks on XLA's buffers (they read no device
data: they give the addresses), points the planned struct at them and launches on XLA's stream:
it plans nothing, loads no module, allocates nothing and never waits, so a launch depends on the
trace and the buffer addresses alone (XLA may record it into a CUDA graph). New lengths, block
tables, device scales or contents of the same shapes, within max_q_len / max_kv_len, reuse the
trace and the graph. Metadata given as numpy arrays (or lists) becomes a constant of the trace,
read on the device like the rest (the eager host-metadata path, exact plans with split KV, needs
the values at trace time: it is not used under jit).

workspace_buffer is accepted for FlashInfer compatibility and checked like the eager APIs' (a
1-D array; None is allowed too), but never read or written: the device-metadata plans never
split KV, so they need no workspace; memory a plan might still need (the float workspace, the
sm_90 tile scheduler's counters, zeroed on the stream before each launch) is a scratch output
XLA allocates with the call.

Differences from the eager APIs: the result is returned (out= / lse= raise TypeError: JAX arrays
are immutable), its dtype out_dtype's (query's by default); save_softmax_stats returns (out,
stats [tokens, heads, 2] float32), return_lse (out, lse [tokens, heads] float32). Shapes and every
option (max_q_len, max_kv_len, batch_size, the masks, the float scales: baked into the launch; pass
one-element float32 arrays to change them without re-tracing) are static Python values. Not
supported (NotImplementedError at trace time): the NVFP4 output (out_dtype="nvfp4": the eager path
allocates the FP4Tensor's swizzled scales itself), fmha's [batch_size, 2, max_pages] block tables
(V offsets from K's base in one allocation: XLA's arrays are separate allocations),
PYFLASHATTN_CHECK_METADATA=1 (its host check reads the metadata's values), and vmap (the batch is
batch_size's requests).
"""
from __future__ import annotations

import numpy as np

from .._engine import operands, trtllm, trtllm_context, trtllm_device, trtllm_fmha
from .._runtime import dtypes as _dtypes
from . import _bridge

FMHA = "trtllm_fmha_v2_prefill"
CONTEXT = "trtllm_batch_context_with_kv_cache"
_CACHE = _bridge.CallCache()  # call key -> _bridge.Callable (refusing vmap)
_META = ("seq_lens", "cum_seq_lens_q", "cum_seq_lens_kv", "block_tables")


def trtllm_fmha_v2_prefill(qkv, input_layout, workspace_buffer, seq_lens, max_q_len, max_kv_len, bmm1_scale,
                           bmm2_scale, batch_size, cum_seq_lens_q, cum_seq_lens_kv, block_tables=None, out=None,
                           out_dtype=None, sinks=None, pos_encoding_mode=None, logits_soft_cap_scale=None,
                           mask_mode="causal", window_left=-1, chunked_attention_size=0, save_softmax_stats=False,
                           skip_softmax_threshold_scale_factor=0):
    """pyflashattn.prefill.trtllm_fmha_v2_prefill as a jittable JAX function: jax.Array inputs (qkv's
    arrays, the length metadata, block_tables, sinks, and bmm1_scale / bmm2_scale when they are
    one-element float32 arrays), Python options (static under jit); returns out [tokens, Hq, D] in
    out_dtype (query's by default), with save_softmax_stats (out, stats). Errors raise at trace
    time with the eager API's messages; see the module docstring for workspace_buffer, out= and
    vmap."""
    _bridge.no_out(FMHA, out=out)
    _bridge.require_static(FMHA, max_q_len=max_q_len, max_kv_len=max_kv_len, batch_size=batch_size,
                           window_left=window_left, chunked_attention_size=chunked_attention_size)
    ops = _Operands(FMHA)
    args = dict(qkv=ops.add("qkv", qkv), bmm1_scale=ops.scale("bmm1_scale", bmm1_scale),
                bmm2_scale=ops.scale("bmm2_scale", bmm2_scale), sinks=ops.add("sinks", trtllm.sinks_arg(sinks)),
                **ops.metadata(seq_lens, cum_seq_lens_q, cum_seq_lens_kv, block_tables))
    static = (input_layout, max_q_len, max_kv_len, batch_size, out_dtype, pos_encoding_mode, logits_soft_cap_scale,
              mask_mode, window_left, chunked_attention_size, save_softmax_stats, skip_softmax_threshold_scale_factor)

    def check(a):
        return trtllm_fmha.check(a["qkv"], input_layout, a["seq_lens"], max_q_len, max_kv_len, a["bmm1_scale"],
                                 a["bmm2_scale"], batch_size, a["cum_seq_lens_q"], a["cum_seq_lens_kv"],
                                 a["block_tables"], None, out_dtype, a["sinks"], pos_encoding_mode,
                                 logits_soft_cap_scale, mask_mode, window_left, chunked_attention_size,
                                 save_softmax_stats, skip_softmax_threshold_scale_factor)

    return _call(FMHA, ops, args, check, static, workspace_buffer, None, False)


def trtllm_batch_context_with_kv_cache(query, kv_cache, workspace_buffer, block_tables, seq_lens, max_q_len,
                                       max_kv_len, bmm1_scale, bmm2_scale, batch_size, cum_seq_lens_q,
                                       cum_seq_lens_kv, window_left=-1, out=None, out_dtype=None, o_sf_scale=None,
                                       o_sf_vec_size=None, kv_layout="HND", enable_pdl=None, sinks=None,
                                       kv_block_scales=None, skip_softmax_threshold_scale_factor=None,
                                       uses_shared_paged_kv_idx=True, causal=True, lse=None, return_lse=False,
                                       kv_cache_sf=None, multi_ctas_kv_counter_buffer=None):
    """pyflashattn.prefill.trtllm_batch_context_with_kv_cache as a jittable JAX function: jax.Array
    inputs (query, kv_cache or its (k, v) tuple, block_tables, the length metadata, sinks, an
    NVFP4 cache's block scales, and bmm1_scale / bmm2_scale when they are one-element float32
    arrays), Python options (static under jit); returns out [tokens, Hq, D] in out_dtype (query's
    by default), with return_lse (out, lse). multi_ctas_kv_counter_buffer is accepted and unused,
    as by the eager API. Errors raise at trace time with the eager API's messages; see the module
    docstring for workspace_buffer, out= / lse=, NVFP4 output and vmap."""
    _bridge.no_out(CONTEXT, out=out, lse=lse)
    _bridge.require_static(CONTEXT, max_q_len=max_q_len, max_kv_len=max_kv_len, batch_size=batch_size,
                           window_left=window_left)
    ops = _Operands(CONTEXT)
    args = dict(query=ops.add("query", query), kv_cache=ops.add("kv_cache", kv_cache),
                bmm1_scale=ops.scale("bmm1_scale", bmm1_scale), bmm2_scale=ops.scale("bmm2_scale", bmm2_scale),
                sinks=ops.add("sinks", trtllm.sinks_arg(sinks)),
                kv_block_scales=ops.add("kv_block_scales", kv_block_scales),
                kv_cache_sf=ops.add("kv_cache_sf", kv_cache_sf),
                **ops.metadata(seq_lens, cum_seq_lens_q, cum_seq_lens_kv, block_tables))
    static = (max_q_len, max_kv_len, batch_size, window_left, out_dtype, o_sf_scale, o_sf_vec_size, kv_layout,
              skip_softmax_threshold_scale_factor, uses_shared_paged_kv_idx, causal)

    def check(a):
        return trtllm_context.check(a["query"], a["kv_cache"], a["block_tables"], a["seq_lens"], max_q_len,
                                    max_kv_len, a["bmm1_scale"], a["bmm2_scale"], batch_size, a["cum_seq_lens_q"],
                                    a["cum_seq_lens_kv"], window_left, None, out_dtype, o_sf_scale, o_sf_vec_size,
                                    kv_layout, a["sinks"], a["kv_block_scales"], skip_softmax_threshold_scale_factor,
                                    uses_shared_paged_kv_idx, causal, a["kv_cache_sf"])

    return _call(CONTEXT, ops, args, check, static, workspace_buffer, enable_pdl, bool(return_lse))


class _Ref(str):
    """An array argument's place in the check's arguments: the name of its callback input."""


class _Operands:
    """The call's array arguments as the callback's inputs (a tuple of arrays: one input each), with a
    trace-time view of each by name; the check's arguments hold _Refs in their places."""

    def __init__(self, name: str):
        _bridge.refuse_checked_mode(name, "the length metadata and block_tables")
        self.ordinals = _bridge.gpu_ordinals()
        self.names, self.arrays, self.views = [], [], {}

    def add(self, name: str, x):
        if x is None:
            return None
        if isinstance(x, (tuple, list)):
            return tuple(self.add(f"{name}[{i}]", part) for i, part in enumerate(x))
        self.names.append(name)
        self.arrays.append(x)
        self.views[name] = _bridge.aval_view(x, name, self.ordinals[0])
        return _Ref(name)

    def scale(self, name: str, x):
        """A number stays a Python value (baked into the launch); an array is an input."""
        if isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool):
            return x
        return self.add(name, x)

    def metadata(self, *arrays) -> dict:
        """The index arrays; numpy arrays and lists become constants of the trace (read on the device)."""
        import jax.numpy as jnp

        return {name: self.add(name, jnp.asarray(x) if isinstance(x, (np.ndarray, list, tuple)) else x)
                for name, x in zip(_META, arrays)}

    def key(self) -> tuple:
        return tuple((n, v.shape, v.dtype.name) for n, v in self.views.items())


def _resolve(x, views: dict):
    """The check's argument with each _Ref replaced by its view (trace-time, or an XLA buffer's)."""
    if type(x) is _Ref:
        return views[x]
    if type(x) is tuple:
        return tuple(_resolve(part, views) for part in x)
    return x


def _call(name, ops, args, check, static, workspace_buffer, pdl, return_lse):
    """Check at trace time (the eager messages), build or reuse the callable, call it."""
    dev0 = ops.ordinals[0]
    c = check({k: _resolve(v, ops.views) for k, v in args.items()})
    bounds = _check_more(name, c, dev0)
    if workspace_buffer is not None:  # never used (module docstring): checked as the eager APIs check it
        operands.contiguous_1d(_bridge.aval_view(workspace_buffer, "workspace_buffer", dev0), "workspace_buffer")
    key = (name, ops.key(), static, tuple(sorted((k, v) for k, v in args.items() if type(v) is not _Ref and
                                                 not isinstance(v, tuple) and v is not None)),
           pdl, return_lse, tuple(ops.ordinals))
    hit = _CACHE.get(key, lambda: _build(name, ops, args, check, c, bounds, pdl, return_lse))
    res = hit(*ops.arrays)
    extra = c.stats or return_lse
    return (res[0], res[1]) if extra else res[0]


def _check_more(name, c, dev):
    """The checks the eager call makes after its front check (bounds, device metadata, sinks), on
    the trace-time views (K / V against the plan: _build, through the engine's ragged_kv). Returns
    (batch, max_q_len, max_kv_len)."""
    if c.dtypes[2] is operands.NVFP4_OUTPUT:
        raise NotImplementedError(f"pyflashattn.jax.{name}: out_dtype='nvfp4' (the NVFP4 output) is not supported "
                                  "under jax: the eager call allocates the FP4Tensor's swizzled scales itself; "
                                  "use a 16-bit or float8_e4m3fn out_dtype")
    if c.paging is not None and c.paging.separate and name == FMHA:
        raise NotImplementedError(f"pyflashattn.jax.{name}: block_tables [batch_size, 2, max_pages] (K / V offsets "
                                  "from K's base in one allocation) is not supported under jax: XLA's arrays are "
                                  "separate allocations; pass the 5-D paged cache with [batch_size, max_pages] "
                                  "block_tables")
    bounds = operands.trtllm_bounds(*c.lengths[3:])
    trtllm.device_metadata(dev, c.lengths, bounds, c.paging)
    if c.sinks is not None:  # (the eager APIs check them at launch)
        operands.sinks_operand(c.sinks, c.heads[0], c.heads[1], dev)
    return bounds


def _plan(dev, c, bounds, geometry, scale_on_device: bool):
    """The engine of one local GPU, planned as the eager call plans it (a tensor bmm1_scale: on a
    kernel that reads it), its metadata on the device (waited for here: the callback never orders
    itself after the plan's copy), skip-softmax applied (its kernel loaded now, not in the callback)."""
    B, mq, mk = bounds
    causal, wl, chunk = c.mask
    q_plan, kv_plan = trtllm_device.planned_lengths(mq, mk, geometry)

    def plan(general):
        return trtllm_device.new_engine(_bridge.plan_workspace(dev), c.kv_layout, c.paging is not None, c.heads,
                                        c.dtypes, B, q_plan, kv_plan, causal, wl, chunk, c.pos, c.cap,
                                        general or c.stats, geometry)

    e = plan(False)
    if scale_on_device and not e.attn.meta.get("device_scale"):
        e = plan(True)
    _bridge.engine_ready(e)
    e.apply_skip_softmax(c.skip)
    return e


def _build(name, ops, args, check, c, bounds, pdl, return_lse):
    """The engines of every local GPU, the result specs and the callable (refusing vmap)."""
    import jax

    ordinals = ops.ordinals
    meta = trtllm.device_metadata(ordinals[0], c.lengths, bounds, c.paging)
    geometry = None if c.paging is None else (c.paging.page_size, meta.row_stride, meta.width)
    engines = {dev: _plan(dev, c, bounds, geometry, type(args["bmm1_scale"]) is _Ref) for dev in ordinals}
    # K and V against the plan, as the eager run checks them at launch (SEPARATE_Q_K_V's may differ);
    # a cache hit has the same shapes and dtypes, so a miss is where to check
    if c.paging is None:
        engines[ordinals[0]].ragged_kv(*c.kv, None)
    ws, scratch = _bridge.engines_scratch(engines.values())
    tokens, (hq, _, hd) = c.q.shape[0], c.heads
    f32 = _bridge.jax_dtype(_dtypes.FLOAT32)
    specs = [jax.ShapeDtypeStruct((tokens, hq, hd), _bridge.jax_dtype(c.dtypes[2]))]
    if c.stats:
        specs.append(jax.ShapeDtypeStruct((tokens, hq, 2), f32))
    if return_lse:
        specs.append(jax.ShapeDtypeStruct((tokens, hq), f32))
    if scratch:
        specs.append(jax.ShapeDtypeStruct((scratch,), _bridge.jax_dtype(_dtypes.UINT8)))
    at = {n: i for i, n in enumerate(ops.names)}
    _, mq, mk = bounds

    def launch(stream, outs, ins):
        dev = _bridge.device_of(stream, ordinals)
        e = engines[dev]
        views = {n: _bridge.buffer_view(ins[i], dev) for n, i in at.items()}
        call = check({k: _resolve(v, views) for k, v in args.items()})  # addresses only: nothing is read
        trtllm.point_metadata(e, trtllm.device_metadata(dev, call.lengths, bounds, call.paging), mq, mk)
        p = e.attn.params
        p.scale_dev, p.v_scale_dev = call.s1[1], call.s2[1]
        p.softmax_stats = _bridge.buffer_ptr(outs[1]) if c.stats else 0
        if scratch:
            _bridge.point_scratch(e, _bridge.buffer_ptr(outs[-1]), ws, stream)
        o = _bridge.buffer_view(outs[0], dev)
        lse = _bridge.buffer_view(outs[1], dev) if return_lse else None
        if call.paging is None:
            e.run_ragged(call.q, call.kv[0], call.kv[1], k_scale=call.s1[0], v_scale=call.s2[0], out=o, lse=lse,
                         return_lse=return_lse, stream=stream, enable_pdl=pdl, sinks=call.sinks,
                         skip_softmax_threshold_scale_factor=call.skip)
        else:
            e.run_paged(call.q, call.kv, k_scale=call.s1[0], v_scale=call.s2[0], out=o, lse=lse,
                        return_lse=return_lse, stream=stream, enable_pdl=pdl, sinks=call.sinks,
                        skip_softmax_threshold_scale_factor=call.skip, kv_cache_sf=call.kv_cache_sf)

    fn = _bridge.Callable(f"{name} ({engines[ordinals[0]].attn.name})", launch, specs, no_vmap=(
        f"pyflashattn.jax.{name} does not support vmap: its batch is batch_size's requests (stack them along the "
        "token axis, with cum_seq_lens_q / seq_lens describing them) or call it once per batch"))
    return fn
