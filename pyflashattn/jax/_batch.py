"""The batch wrappers inside ``jax.jit``: plan() outside (host work), run() inside.

Each wrapper holds the eager wrapper in CUDA-graph mode (fixed capacity: batch size, pages, query
tokens), whose launches depend on a plan only through device metadata at fixed offsets. plan()
runs the eager plan on the host and returns a ``Plan``: a pytree whose one leaf is the plan's
metadata bytes as a device array (int32), so the jitted run() takes it as an input and a re-plan
within capacity re-uses the trace (same shape). Inside the callback the kernels' metadata pointers
are pointed at that input (the staging buffer the eager plan wrote is never read by them), the
float workspace at a scratch output, and the eager run() launches on XLA's stream.

The first plan fixes the settings (heads, head_dim, dtypes, causal, window, scale, page size, the
kernel): later plans must keep them, as a captured CUDA graph requires (a re-plan with other
settings raises ValueError). q and out hold the wrapper's token capacity (max_num_tokens; decode:
max_batch_size * q_len_per_req) rows; rows past the plan's qo_indptr[-1] are not written (their
values in the result are unspecified, as in FlashInfer's graph mode). Custom masks are not
supported under jit (NotImplementedError): their bytes live outside the plan's metadata.
"""
from __future__ import annotations

import threading

import numpy as np

from .. import decode as _decode, prefill as _prefill
from .._engine import graph as _graph, indices as _indices, operands
from .._runtime import dtypes as _dtypes
from .._runtime.dlpack import compact_strides, kDLCUDA
from . import _bridge


def _jax():
    import jax

    return jax


class Plan:
    """A plan's metadata as a device array (``state``, int32), for the wrapper that made it. A pytree:
    pass it into the jitted function that calls the wrapper's run()."""

    __slots__ = ("state", "owner")

    def __init__(self, state, owner):
        self.state, self.owner = state, owner


def _flatten(plan):
    return (plan.state,), plan.owner


def _unflatten(owner, children):
    return Plan(children[0], owner)


_REGISTERED = []


def _register():
    if not _REGISTERED:
        _jax().tree_util.register_pytree_node(Plan, _flatten, _unflatten)
        _REGISTERED.append(True)


def _jax_device(dev: int):
    for d in _jax().local_devices(backend="gpu"):
        if int(getattr(d, "local_hardware_id", d.id)) == dev:
            return d
    raise ValueError(f"device {dev}: JAX sees no such local GPU")


def _fake_out(qv, eng):
    """A trace-time out view for q's rows in the plan's output dtype (NVFP4: code pairs)."""
    cfg, (_, Hq, _, D) = eng.cfg, eng.shape
    shape = (qv.shape[0], Hq, D // 2 if cfg.o_format == operands.OUT_NVFP4 else D)
    return _bridge.TensorView(None, 0, shape, compact_strides(shape), cfg.o_dtype, kDLCUDA, qv.device_id,
                              _bridge.FRAMEWORK)


class _JitBatch:
    """What the three wrappers share: the eager wrapper, the lock, the plan's bytes, run()'s callables."""

    NAME = "batch"

    def __init__(self, make_eager, device, float_workspace_bytes: int):
        _register()
        ordinals = _bridge.gpu_ordinals()
        self.dev = ordinals[0] if device is None else int(device)
        if self.dev not in ordinals:
            raise ValueError(f"device must be one of the local GPUs JAX sees {ordinals}, got {device}")
        nbytes = operands.positive_int(float_workspace_bytes, "float_workspace_bytes")
        # The eager engine plans against a workspace of this size; its address is the scratch output
        # of each jitted call (point_workspace), never this placeholder's 0.
        ws = _bridge.plan_workspace(self.dev, nbytes)
        self.eager = make_eager(ws)
        self.engine = self.eager._engine
        # q / out / lse (and ragged k / v) hold the capacity's rows: the engine takes their row
        # counts as given (the kernel bounds its TMA boxes by them) instead of the latest plan's
        self.engine.device_lengths = True
        self.ordinals = ordinals
        self.lock = threading.Lock()
        self.fields = None  # (struct, field, offset) of the metadata pointers (engine.detach_metadata)
        # The fewest K/V rows (ragged) / cache pages (paged) a traced run() reads: a later plan must
        # stay within them (the kernels read the plan's indices from the device, unchecked there)
        self.kv_bound = None
        self.calls = {}

    def _plan(self, plan_fn, extent, *args, **kwargs) -> Plan:
        """plan_fn(*args, **kwargs), the eager plan, once the plan's K/V extent (max page, K/V rows:
        extent()) is within what traced run()s read (checked first: a refused plan leaves no trace)."""
        if kwargs.get("custom_mask") is not None or kwargs.get("packed_custom_mask") is not None:
            raise NotImplementedError(f"pyflashattn.jax {self.NAME}: custom masks are not supported under jit (their "
                                      "bytes live outside the plan's metadata); use the eager wrapper")
        jax = _jax()
        with self.lock:
            self._check_bound(*extent())
            # the placeholder workspace address the first plan saw (its graph signature includes it;
            # each jitted call points the workspace at its own scratch)
            self.engine.point_workspace(0)
            try:
                plan_fn(*args, **kwargs)
            except _graph.FrozenSettingsError as e:
                raise ValueError(f"pyflashattn.jax {self.NAME}: the first plan() fixes the settings every jitted run() "
                                 f"launches with (they are baked into the launch XLA may record): {e}") from None
            eng = self.engine
            fields = eng.detach_metadata()
            if self.fields is None:
                self.fields = fields
            eng.graph.freeze()  # later plans keep these settings (check_sig)
            host, nbytes = eng.staging.last
            state = np.array(host[:max(nbytes // 4, 1)], dtype=np.int32)
        return Plan(jax.device_put(state, _jax_device(self.dev)), self)

    def _check_plan(self, plan):
        if not isinstance(plan, Plan) or plan.owner is not self:
            raise TypeError(f"plan must be the Plan this wrapper's plan() returned, got {type(plan).__name__}")
        if not self.engine.planned:
            raise RuntimeError("call plan() first")

    def _kv_extent(self, kind, kv_views) -> int:
        """The cache's pages (paged) or K's rows (ragged) of a run()'s K/V views."""
        if kind == "paged":
            return kv_views[0].shape[0]
        return kv_views[0].shape[0 if self.engine.kv_layout == "NHD" else 1]

    def _check_bound(self, max_page: int, total_kv: int, bound=None):
        bound = self.kv_bound if bound is None else bound
        if bound is None:
            return
        if self.engine.paged:
            if max_page >= bound:
                raise ValueError(f"paged_kv_indices refers to page {max_page} but the paged_kv_cache a jitted "
                                 f"run() was traced with has {bound} pages")
        elif total_kv > bound:
            raise ValueError(f"kv_indptr[-1] = {total_kv} but the k / v a jitted run() was traced with hold "
                             f"{bound} rows")

    def _out_specs(self, rows: int, return_lse: bool):
        jax = _jax()
        cfg, (_, Hq, _, D) = self.engine.cfg, self.engine.shape
        od = D // 2 if cfg.o_format == operands.OUT_NVFP4 else D
        specs = [jax.ShapeDtypeStruct((rows, Hq, od), _bridge.jax_dtype(cfg.o_dtype))]
        if return_lse:
            specs.append(jax.ShapeDtypeStruct((rows, Hq), _bridge.jax_dtype(_dtypes.FLOAT32)))
        specs.append(jax.ShapeDtypeStruct((max(self.engine.ws_bytes, 16),), _bridge.jax_dtype(_dtypes.UINT8)))
        return specs

    def _call(self, kind: str, q, kv: tuple, plan, sinks, return_lse: bool, scales: dict, enable_pdl, rows: int):
        """Check at trace time, then the cached callable for this signature, called."""
        self._check_plan(plan)
        eng = self.engine
        qv = _bridge.aval_view(q, "q", self.dev)
        _, Hq, _, D = eng.shape
        if qv.shape != (rows, Hq, D):
            raise ValueError(f"q must have shape {(rows, Hq, D)} (the wrapper's token capacity, num_qo_heads, "
                             f"head_dim), got {qv.shape}")
        kv_views = tuple(_bridge.aval_view(x, n, self.dev) for x, n in kv)
        sv = _bridge.aval_view(sinks, "sinks", self.dev) if sinks is not None else None
        with self.lock:  # the eager checks at trace time, on views without addresses
            self._launch(kind, qv, kv_views, None, None, None, sv, return_lse, scales, enable_pdl, dry=True)
            bound = self._kv_extent(kind, kv_views)
            self._check_bound(eng.src.max_page, eng.src.total_kv, bound)
            self.kv_bound = bound if self.kv_bound is None else min(self.kv_bound, bound)
        key = (kind, qv.shape, qv.dtype.name, tuple((v.shape, v.dtype.name) for v in kv_views),
               None if sv is None else (sv.shape, sv.dtype.name), bool(return_lse),
               tuple(sorted(scales.items())), enable_pdl)
        call = self.calls.get(key)
        if call is None:
            call = self.calls[key] = self._callable(kind, len(kv), sinks is not None, return_lse, scales, enable_pdl,
                                                    rows)
        args = [q, *(x for x, _ in kv), plan.state] + ([sinks] if sinks is not None else [])
        res = call(*args)
        return (res[0], res[1]) if return_lse else res[0]

    def _callable(self, kind, n_kv, has_sinks, return_lse, scales, enable_pdl, rows):
        dev = self.dev

        def launch(stream, outs, ins):
            if _bridge.device_of(stream, self.ordinals) != dev:
                raise ValueError(f"this wrapper plans for cuda:{dev}; its run() got buffers of another device")
            q, kv, state = ins[0], ins[1:1 + n_kv], ins[1 + n_kv]
            sv = _bridge.buffer_view(ins[2 + n_kv], dev) if has_sinks else None
            qv, ov = _bridge.buffer_view(q, dev), _bridge.buffer_view(outs[0], dev)
            lv = _bridge.buffer_view(outs[1], dev) if return_lse else None
            kv_views = tuple(_bridge.buffer_view(b, dev) for b in kv)
            eng = self.engine
            with self.lock:  # the engine's structs: plan() on the host thread writes them too
                base = _bridge.buffer_ptr(state)
                for p, name, off in self.fields:
                    setattr(p, name, base + off)
                eng.point_workspace(_bridge.buffer_ptr(outs[-1]))
                self._launch(kind, qv, kv_views, ov, lv, stream, sv, return_lse, scales, enable_pdl)

        kernel = getattr(self.engine.attn, "name", "attention")
        return _bridge.Callable(f"{self.NAME}.run ({kernel})", launch, self._out_specs(rows, return_lse), no_vmap=(
            f"pyflashattn.jax {self.NAME}.run does not support vmap: its batch is the plan's (plan every request "
            "of the batch together)"))

    def _launch(self, kind, qv, kv_views, ov, lv, stream, sv, return_lse, scales, enable_pdl, dry=False):
        eng = self.engine
        if dry:  # trace time: the eager operand checks (views without addresses), nothing launched
            eng.check_q(qv, _fake_out(qv, eng), None, False, 0)
            if kind == "paged":
                parts = kv_views if len(kv_views) == 2 else None
                eng._paged_operands(parts if parts else kv_views[0], parts or kv_views, None)
            else:
                eng.ragged_kv(kv_views[0], kv_views[1], None)
            if sv is not None:
                operands.sinks_operand(sv, eng.cfg.num_qo_heads, eng.cfg.num_kv_heads, self.dev)
            return
        cache = kv_views if len(kv_views) == 2 and kind == "paged" else kv_views[0]
        if kind == "paged":
            eng.run_paged(qv, cache, out=ov, lse=lv, return_lse=return_lse, stream=stream, enable_pdl=enable_pdl,
                          sinks=sv, **scales)
        else:
            eng.run_ragged(qv, kv_views[0], kv_views[1], out=ov, lse=lv, return_lse=return_lse, stream=stream,
                           enable_pdl=enable_pdl, sinks=sv, **scales)


def _last(a: np.ndarray) -> int:
    return int(a[-1]) if a.size else 0


def _paged_extent(kv_indptr, kv_indices) -> tuple:
    """(the largest page id the batch uses, -1 without pages; 0): host copies, as plan() reads them."""
    n = max(_last(_indices.host_int(kv_indptr, "kv_indptr")), 0)
    used = _indices.host_int(kv_indices, "paged_kv_indices")[:n]
    return (int(used.max()) if used.size else -1), 0


def _capacity(name: str, value) -> np.ndarray:
    """A capacity stand-in for the eager wrapper's graph buffers: a host array of that many entries."""
    return np.zeros(operands.positive_int(value, name), np.int32)


class BatchPrefillWithPagedKVCacheWrapper(_JitBatch):
    """BatchPrefillWithPagedKVCacheWrapper under jit: plan() outside, ``run(q, paged_kv_cache, plan)``
    inside (see the module docstring). max_batch_size, max_num_pages and max_num_tokens fix the
    capacity; q / out have max_num_tokens rows."""

    NAME = "BatchPrefillWithPagedKVCacheWrapper"

    def __init__(self, kv_layout: str = "NHD", *, max_batch_size: int, max_num_pages: int, max_num_tokens: int,
                 float_workspace_bytes: int = 64 << 20, device=None):
        B = operands.positive_int(max_batch_size, "max_batch_size")
        self.max_tokens = operands.positive_int(max_num_tokens, "max_num_tokens")

        def make(ws):
            w = _prefill.BatchPrefillWithPagedKVCacheWrapper(
                ws, kv_layout, True, _capacity("max_batch_size", B + 1), _capacity("max_batch_size", B + 1),
                _capacity("max_num_pages", max_num_pages), _capacity("max_batch_size", B))
            w._engine.graph.fix_token_capacity(self.max_tokens)
            return w

        super().__init__(make, device, float_workspace_bytes)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, *args, **kwargs) -> Plan:
        """The eager plan() (host index arrays; numpy avoids a sync), returning the Plan to pass to run()."""
        return self._plan(self.eager.plan, lambda: _paged_extent(paged_kv_indptr, paged_kv_indices), qo_indptr,
                          paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, *args, **kwargs)

    def run(self, q, paged_kv_cache, plan, *, k_scale=None, v_scale=None, return_lse: bool = False, sinks=None,
            enable_pdl=None):
        """o [max_num_tokens, Hq, D] (and lse [max_num_tokens, Hq] with return_lse) of q over the cache
        (one array [P, 2, ...] or a (k_cache, v_cache) tuple), for `plan`."""
        kv = tuple(zip(paged_kv_cache, ("k_cache", "v_cache"))) if isinstance(paged_kv_cache, (tuple, list)) \
            else ((paged_kv_cache, "paged_kv_cache"),)
        return self._call("paged", q, kv, plan, sinks, return_lse, _scales(k_scale=k_scale, v_scale=v_scale),
                          enable_pdl, self.max_tokens)

    def run_return_lse(self, q, paged_kv_cache, plan, **kwargs):
        kwargs["return_lse"] = True
        return self.run(q, paged_kv_cache, plan, **kwargs)


class BatchPrefillWithRaggedKVCacheWrapper(_JitBatch):
    """BatchPrefillWithRaggedKVCacheWrapper under jit: ``run(q, k, v, plan)``; k / v may hold more
    rows than a plan's kv_indptr[-1] (their row count is fixed by the trace; plans beyond it raise)."""

    NAME = "BatchPrefillWithRaggedKVCacheWrapper"

    def __init__(self, kv_layout: str = "NHD", *, max_batch_size: int, max_num_tokens: int,
                 float_workspace_bytes: int = 64 << 20, device=None):
        B = operands.positive_int(max_batch_size, "max_batch_size")
        self.max_tokens = operands.positive_int(max_num_tokens, "max_num_tokens")

        def make(ws):
            w = _prefill.BatchPrefillWithRaggedKVCacheWrapper(ws, kv_layout, True, _capacity("max_batch_size", B + 1),
                                                             _capacity("max_batch_size", B + 1))
            w._engine.graph.fix_token_capacity(self.max_tokens)
            return w

        super().__init__(make, device, float_workspace_bytes)

    def plan(self, qo_indptr, kv_indptr, *args, **kwargs) -> Plan:
        return self._plan(self.eager.plan, lambda: (-1, _last(_indices.host_int(kv_indptr, "kv_indptr"))), qo_indptr,
                          kv_indptr, *args, **kwargs)

    def run(self, q, k, v, plan, *, q_scale=None, k_scale=None, v_scale=None, return_lse: bool = False, sinks=None,
            enable_pdl=None):
        return self._call("ragged", q, ((k, "k"), (v, "v")), plan, sinks, return_lse,
                          _scales(q_scale=q_scale, k_scale=k_scale, v_scale=v_scale), enable_pdl, self.max_tokens)

    def run_return_lse(self, q, k, v, plan, **kwargs):
        kwargs["return_lse"] = True
        return self.run(q, k, v, plan, **kwargs)


class BatchDecodeWithPagedKVCacheWrapper(_JitBatch):
    """BatchDecodeWithPagedKVCacheWrapper under jit: ``run(q, paged_kv_cache, plan)`` with q
    [max_batch_size * q_len_per_req, Hq, D] (q_len_per_req: the first plan's, frozen)."""

    NAME = "BatchDecodeWithPagedKVCacheWrapper"

    def __init__(self, kv_layout: str = "NHD", *, max_batch_size: int, max_num_pages: int,
                 float_workspace_bytes: int = 64 << 20, use_tensor_cores: bool = False, device=None):
        self.max_batch = B = operands.positive_int(max_batch_size, "max_batch_size")
        self.max_tokens = None  # B * q_len_per_req, at the first plan

        def make(ws):
            return _decode.BatchDecodeWithPagedKVCacheWrapper(
                ws, kv_layout, True, use_tensor_cores, _capacity("max_batch_size", B + 1),
                _capacity("max_num_pages", max_num_pages), _capacity("max_batch_size", B))

        super().__init__(make, device, float_workspace_bytes)

    def plan(self, indptr, indices, last_page_len, *args, **kwargs) -> Plan:
        if self.max_tokens is None:
            q_len = operands.positive_int(kwargs.get("q_len_per_req", 1), "q_len_per_req")
            self.engine.graph.fix_token_capacity(self.max_batch * q_len)
        def extent():
            if indptr is not None:
                return _paged_extent(indptr, indices)
            page_size = kwargs.get("page_size", args[3] if len(args) > 3 else None)
            arrays = _indices.block_table_arrays(kwargs.get("block_tables"), kwargs.get("seq_lens"), page_size)
            return _paged_extent(arrays[0], arrays[1])

        plan = self._plan(self.eager.plan, extent, indptr, indices, last_page_len, *args, **kwargs)
        self.max_tokens = self.engine.graph.max_total_q
        return plan

    def run(self, q, paged_kv_cache, plan, *, q_scale=None, k_scale=None, v_scale=None, return_lse: bool = False,
            sinks=None, enable_pdl=None):
        kv = tuple(zip(paged_kv_cache, ("k_cache", "v_cache"))) if isinstance(paged_kv_cache, (tuple, list)) \
            else ((paged_kv_cache, "paged_kv_cache"),)
        self._check_plan(plan)
        ks = operands.scale_arg(q_scale, "q_scale") * operands.scale_arg(k_scale, "k_scale")
        return self._call("paged", q, kv, plan, sinks, return_lse,
                          _scales(k_scale=None if ks == 1.0 else ks, v_scale=v_scale), enable_pdl, self.max_tokens)

    def run_return_lse(self, q, paged_kv_cache, plan, **kwargs):
        kwargs["return_lse"] = True
        return self.run(q, paged_kv_cache, plan, **kwargs)


def _scales(**given) -> dict:
    """run()'s number scales (static under jit), validated; None ones left out."""
    out = {}
    for name, val in given.items():
        if val is not None:
            if hasattr(val, "shape"):
                raise TypeError(f"{name} must be a Python number under pyflashattn.jax (it is baked into the "
                                "launch), got an array")
            out[name] = operands.scale_arg(val, name)
    return out
