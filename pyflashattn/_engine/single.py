"""Single-request prefill through the engine: one cached plan per problem signature.

Full validation, routing and scheduling (a one-request schedule from the same scheduler as the
batch wrappers, so a request gets the same chunks, hence the same bits, in both APIs) happen
once per signature (shapes, strides, dtypes, devices, options); repeated calls reuse the plan
and its params struct, and repeated torch calls take a fast path of attribute reads, one dict
lookup and the launch. The exception to the same bits: where stream-K shares out a long
non-causal call's last round (schedule.stream_k_first), a split item's two parts meet in one more
online-softmax step, so those rows can differ from the batch API's by its rounding.
"""
from __future__ import annotations

import threading

import numpy as np

from .._runtime import cuda as _cuda, dtypes as _dtypes, registry as _registry, tensor as _tensor
from . import fp8, launch, operands, options, packbits, params, routing, schedule, tma

_PLAN_CACHE_SIZE = 1024
_MISS = object()
# Plans own a mutable params struct, so each thread keeps its own cache.
_tls = threading.local()
_registry._on_force.append(lambda: getattr(_tls, "plans", {}).clear())


def single_prefill(q, k, v, custom_mask=None, packed_custom_mask=None, causal: bool = False,
                   kv_layout: str = "NHD", pos_encoding_mode: str = "NONE", allow_fp16_qk_reduction: bool = False,
                   sm_scale: float | None = None, window_left: int = -1, logits_soft_cap: float | None = None,
                   rope_scale: float | None = None, rope_theta: float | None = None, *, return_lse: bool = False,
                   out=None, lse=None, stream=None, lse_base: str = "log2", k_scale=None, v_scale=None,
                   scale_q=None, scale_k=None, scale_v=None, o_dtype=None):
    """Attention of one request's queries over its KV cache (FlashInfer's single prefill).

    q [qo_len, num_qo_heads, head_dim]; k, v [kv_len, num_kv_heads, head_dim] (kv_layout "NHD")
    or [num_kv_heads, kv_len, head_dim] ("HND"). Parameters beyond FlashInfer's: ``out`` /
    ``lse`` (preallocated outputs, written in place and returned; ``lse`` is filled whenever
    given), ``stream`` (a CUDA stream handle or stream object; default: the caller framework's
    current stream), ``lse_base`` ("log2", FlashInfer's convention, or "ln").

    ``k_scale`` / ``v_scale`` (FlashInfer's, default 1.0): k_scale multiplies the logit scale
    (sm_scale * k_scale, also in the LSE), v_scale the output, both inside the kernel.

    FP8 prefill (FlashInfer 0.7's fp8 arguments, keywords here): float8_e4m3fn q, k and v with
    ``scale_q`` [Hq], ``scale_k`` [Hkv], ``scale_v`` [Hkv] (float32 per-head tensors on q's device,
    or numbers; default 1): the logits of query head h over kv head g are scaled by
    sm_scale * scale_q[h] * scale_k[g] (the LSE too), its output by scale_v[g]. ``o_dtype``:
    bfloat16, float16 or float8_e4m3fn (default q's dtype, as FlashInfer); with a 16-bit q it
    picks the output dtype too, and scale_q / scale_k / scale_v may be numbers only. Runs on
    sm_90a (H100 / H200) at head_dim 64, 128 and 256 without custom masks or score transforms;
    window_left applies (FlashInfer asserts -1 there). Anything else raises NotImplementedError
    (pyflashattn/_engine/fp8.py).

    Returns o [qo_len, num_qo_heads, head_dim] in o_dtype (q's by default) and q's framework, and
    with ``return_lse`` also lse [qo_len, num_qo_heads] float32.
    """
    opts = options.resolve(pos_encoding_mode, allow_fp16_qk_reduction, logits_soft_cap, rope_scale, rope_theta,
                           lse_base)
    has_mask = custom_mask is not None or packed_custom_mask is not None
    framework = _tensor.framework_of(q)
    if k_scale is not None:
        sm_scale = options.softmax_scale(sm_scale, q.shape[-1]) * operands.scale_arg(k_scale, "k_scale")
    vs = operands.scale_arg(v_scale, "v_scale")
    fp8_args = scale_q is not None or scale_k is not None or scale_v is not None or o_dtype is not None
    if not fp8_args and framework == "torch" and opts is options.PLAIN and not has_mask and vs == 1.0:
        res = _torch_fast_path(q, k, v, causal, kv_layout, window_left, sm_scale, return_lse, out, lse, stream)
        if res is not _MISS:
            return res
    # Views are taken without a stream first so bad input raises before the driver is touched;
    # JAX arrays are exported again below with the launch stream (the DLPack handshake makes that
    # stream wait for JAX's pending writes).
    qv, kv, vv = _tensor.view(q, "q"), _tensor.view(k, "k"), _tensor.view(v, "v")
    if fp8_args:  # number scales fold here; tensors are the plan's to check (scale_pointers)
        sm_scale, vs = fp8.fold_numbers((scale_q, scale_k, scale_v), sm_scale, vs, qv.shape[-1])
    ov = _tensor.view(out, "out") if out is not None else None
    lv = _tensor.view(lse, "lse") if lse is not None else None
    # FlashInfer: a packed mask, when given, wins over the boolean one.
    mask_kind = "packed" if packed_custom_mask is not None else "bool" if custom_mask is not None else None
    mask_obj = packed_custom_mask if mask_kind == "packed" else custom_mask
    mv = _tensor.view(mask_obj, _mask_name(mask_kind)) if mask_kind else None
    plan = _cached_plan(qv, kv, vv, ov, lv, causal, kv_layout, window_left, sm_scale, opts, mask_kind, mv, o_dtype)
    scale_ptrs = plan.scale_pointers((scale_q, scale_k, scale_v)) if fp8_args or plan.fp8 else None
    # (the torch fast path allocates q's dtype and points no per-head scales: plain plans only)
    if framework == "torch" and opts is options.PLAIN and mask_kind is None and plan.odt is plan.dtype and not plan.fp8:
        key = launch.torch_key(q, (k, v), out, lse, (causal, kv_layout, window_left, sm_scale))
        if key is not None:  # later calls with this signature take the fast path
            _tls.plans[key] = plan
    if (qv.ptr | kv.ptr | vv.ptr | (ov.ptr if ov is not None else 0)) & 15:
        for name, t in (("q", qv), ("k", kv), ("v", vv), ("out", ov)):
            if t is not None and t.ptr % 16:
                raise ValueError(f"{name} must start on a 16-byte boundary, got address %16 = {t.ptr % 16}")

    dev = qv.device_id
    _cuda.ensure_context(dev)
    s = launch.call_stream(stream, framework, dev)
    if framework == "jax":
        qv, kv, vv = _tensor.view(q, "q", stream=s), _tensor.view(k, "k", stream=s), _tensor.view(v, "v", stream=s)
    if out is None:
        out, ov = _tensor.empty(qv, plan.o_shape, plan.odt, s)
    if lse is None and return_lse:
        lse, lv = _tensor.empty(qv, plan.lse_shape, _dtypes.FLOAT32, s)
    if plan.attn is not None:
        if framework == "jax" and mv is not None:
            mv = _tensor.view(mask_obj, _mask_name(mask_kind), stream=s)
        plan.run(qv.ptr, kv.ptr, vv.ptr, ov.ptr, lv.ptr if lv is not None else 0, s, mv, vs, scale_ptrs)
    # JAX outputs are handed to JAX only now, so JAX's reads are ordered after the launch.
    out = _tensor.finalize(out)
    if lse is None:
        return out
    lse = _tensor.finalize(lse)
    return (out, lse) if return_lse else out


def _mask_name(kind):
    return "packed_custom_mask" if kind == "packed" else "custom_mask"


def _sig(v):
    return None if v is None else (v.shape, v.strides, v.dtype, v.device_type, v.device_id)


def _cached_plan(qv, kv, vv, ov, lv, causal, kv_layout, window_left, sm_scale, opts, mask_kind, mv, o_dtype=None):
    key = (_sig(qv), _sig(kv), _sig(vv), _sig(ov), _sig(lv), causal, kv_layout, window_left, sm_scale, opts,
           mask_kind, _sig(mv), o_dtype)
    plans = getattr(_tls, "plans", None)
    if plans is None:
        plans = _tls.plans = {}
    plan = plans.get(key)
    if plan is None:
        plan = SinglePlan(qv, kv, vv, ov, lv, bool(causal), kv_layout, window_left, sm_scale, opts, mask_kind, mv,
                          o_dtype)
        if len(plans) >= _PLAN_CACHE_SIZE:
            plans.clear()
        plans[key] = plan
    return plan


def _torch_fast_path(q, k, v, causal, kv_layout, window_left, sm_scale, return_lse, out, lse, stream):
    """Repeated torch calls with a known signature: attribute reads, one dict lookup, launch.

    Only plans built (and fully validated) by the general path are found here, keyed by the
    same torch attributes (out=/lse= buffers included); anything else returns _MISS.
    """
    plans = getattr(_tls, "plans", None)
    if plans is None:
        return _MISS
    try:  # the key of launch.torch_key, spelled out: this is most of the fast path's own cost
        plan = plans.get((q.shape, q.stride(), q.dtype, q.get_device(), (causal, kv_layout, window_left, sm_scale),
                          k.shape, k.stride(), k.dtype, k.get_device(), v.shape, v.stride(), v.dtype, v.get_device(),
                          *((None,) if out is None else (out.shape, out.stride(), out.dtype, out.get_device())),
                          *((None,) if lse is None else (lse.shape, lse.stride(), lse.dtype, lse.get_device()))))
    except Exception:  # noqa: BLE001 - not a plain strided torch tensor: the general path decides
        return _MISS
    if plan is None:
        return _MISS
    qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
    op = out.data_ptr() if out is not None else 0
    if (qp | kp | vp | op) & 15:
        return _MISS  # the general path raises the precise error
    dev = plan.dev
    _cuda.ensure_context(dev)
    s = _tensor.stream_handle(stream) if stream is not None else launch.torch_stream(dev)
    if out is None:
        out = _tensor.torch_empty_like(q)  # o has q's shape (the plan's key fixed it)
        op = out.data_ptr()
    if lse is None and return_lse:
        lse = _tensor.torch_empty_f32(q, plan.lse_shape)
    if plan.attn is not None:
        plan.run(qp, kp, vp, op, lse.data_ptr() if lse is not None else 0, s)
    if lse is None:
        return out
    return (out, lse) if return_lse else out


class SinglePlan:
    """Everything about one problem signature except its pointers: validated shapes, the chosen
    kernel with its own params struct (constant fields filled once), grid and KV split."""

    __slots__ = ("o_shape", "o_strides", "lse_shape", "dtype", "odt", "o_format", "fp8", "heads", "attn", "merge",
                 "num_chunks", "ws_mask_bytes", "ws_o_bytes", "ws_bytes", "dev", "mask_kind", "mask_bits",
                 "kv_maps", "tma_geometry", "section", "q_map", "stream_k", "ws_sk_bytes")

    def __init__(self, qv, kv, vv, ov, lv, causal, kv_layout, window_left, sm_scale, opts=options.PLAIN,
                 mask_kind=None, mv=None, o_dtype=None):
        kv_layout = operands.kv_layout(kv_layout)
        window_left = options.window(window_left)
        dims = self._check_operands(qv, kv, vv, ov, lv, kv_layout, o_dtype)
        qo_len, kv_len, num_qo_heads, num_kv_heads, head_dim = dims
        self.mask_kind, self.mask_bits = mask_kind, qo_len * kv_len
        if mask_kind is not None:
            operands.check_mask_operand(mask_kind, mv, self.dev, -(-qo_len * kv_len // 8), (qo_len, kv_len))
            causal = False  # a custom mask replaces causal (FlashInfer)
        if causal and kv_len < qo_len:
            raise ValueError(f"causal attention needs kv_len >= qo_len, got kv_len={kv_len}, qo_len={qo_len}")
        sm_scale = options.softmax_scale(sm_scale, head_dim)
        self.attn = self.merge = self.kv_maps = self.tma_geometry = self.q_map = self.stream_k = None
        if qo_len * num_qo_heads == 0:
            return  # nothing to compute: empty outputs
        _cuda.ensure_context(self.dev)
        general = opts.general or mask_kind is not None
        if self.fp8:
            fp8.check_call(self.dev, general)
        ks = operands.ragged_kv_strides(kv_layout, kv.strides)
        vs = operands.ragged_kv_strides(kv_layout, vv.strides)
        item = self.dtype.bits // 8
        # K/V by TMA where the routing says so (routing.kv_load_pair) and TMA can address them: the
        # maps encode these strides (run() adds the pointers)
        geometry = lambda bn: (tma.ragged_geometry(num_kv_heads, head_dim, *ks, item, bn),  # noqa: E731
                               tma.ragged_geometry(num_kv_heads, head_dim, *vs, item, bn))
        tma_ok = kv_len < tma.ROW_EXTENT and all(map(tma.addressable, geometry(1)))
        self._route_and_schedule(qo_len, kv_len, num_qo_heads, num_kv_heads, head_dim, causal, window_left, general,
                                 tma_ok)
        p = self.attn.params
        p.q_stride_n, p.q_stride_h = qv.strides[0], qv.strides[1]
        p.k_stride_n, p.k_stride_h = ks
        p.v_stride_n, p.v_stride_h = vs
        if self.attn.meta.get("tma"):
            self.tma_geometry = geometry(self.attn.meta["block_n"])
            self.kv_maps = tma.KvMaps(self.dtype.short, p)
        self.q_map = tma.q_map(self.dtype.short, p, self.attn.meta, num_qo_heads, head_dim,
                               num_qo_heads // num_kv_heads, qv.dtype.bits // 8)
        if self.q_map is not None:
            self.q_map.configure(qo_len, qv.strides[0], qv.strides[1])
        p.qo_len, p.kv_len = qo_len, kv_len
        p.kv_tokens = kv_len  # K / V's rows: a TMA kernel's boxes stay within them
        params.fill_score_fields(p, self.dev, num_qo_heads, num_kv_heads, causal, window_left, sm_scale, opts)
        p.o_format = self.o_format
        self._size_workspace(qo_len, num_qo_heads, head_dim, opts)

    def _check_operands(self, qv, kv, vv, ov, lv, kv_layout, o_dtype) -> tuple:
        """The operand validator's checks; returns (qo_len, kv_len, Hq, Hkv, head_dim)."""
        operands.require_device(qv, "q", qv.device_id)  # q fixes the device the others must share
        dev = self.dev = qv.device_id
        dtype = self.dtype = qv.dtype
        if dtype not in (_dtypes.FLOAT16, _dtypes.BFLOAT16, fp8.FP8):
            raise TypeError(f"q must be float16, bfloat16 or float8_e4m3fn, got {dtype.name}")
        self.fp8 = fp8.is_fp8(dtype)  # k and v then float8_e4m3fn too (check_rows: q's dtype)
        self.odt, self.o_format = (fp8.output_dtype(o_dtype, "o_dtype") if self.fp8 else
                                   operands.output_dtype(o_dtype, dtype, "o_dtype"))
        for name, t in (("q", qv), ("k", kv), ("v", vv)):
            operands.check_rows(name, t, dtype, dev, ndim=3)
        qo_len, num_qo_heads, head_dim = qv.shape
        kv_len, num_kv_heads, head_dim_k = operands.ragged_kv_dims(kv_layout, kv.shape)
        if vv.shape != kv.shape:
            raise ValueError(f"v must have k's shape {kv.shape}, got {vv.shape}")
        if head_dim_k != head_dim:
            raise ValueError(f"k head_dim {head_dim_k} differs from q head_dim {head_dim}")
        if head_dim not in routing.HEAD_DIMS:
            raise ValueError(f"head_dim {head_dim} is not supported (supported: {routing.HEAD_DIMS})")
        if num_kv_heads == 0 or num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.o_shape, self.lse_shape = (qo_len, num_qo_heads, head_dim), (qo_len, num_qo_heads)
        self.heads = (num_qo_heads, num_kv_heads)
        # Output strides: the caller's out= (part of the plan's key), else our contiguous allocation.
        self.o_strides = ov.strides if ov is not None else (num_qo_heads * head_dim, head_dim, 1)
        if ov is not None:
            operands.check_out(ov, self.o_shape, self.odt, dev, expected="q has " if self.odt is dtype else
                               "o_dtype is ")
        if lv is not None:
            operands.check_lse(lv, self.lse_shape, dev)
        return qo_len, kv_len, num_qo_heads, num_kv_heads, head_dim

    def _route_and_schedule(self, qo_len, kv_len, num_qo_heads, num_kv_heads, head_dim, causal, window_left,
                            general, tma_ok):
        """The kernel (a decode tile for a request of few packed rows: decode, speculative decode,
        a short append, whose launch is a stream over K/V; else the row-tile kernel, or its TMA
        twin where tma_ok), its KV chunks from the one scheduler, and the grid."""
        dev, short = self.dev, self.dtype.short
        group = num_qo_heads // num_kv_heads
        props = _cuda.properties(dev)
        tile = 0 if general else routing.decode_tile_rows(
            head_dim, qo_len * group, routing.built_decode_tiles(dev, short, short, head_dim, False))
        la = routing.new_attention(dev, short, short, head_dim, general, False, tile)
        if not tile:
            bm = routing.row_tile_block_m(la.meta, num_kv_heads, qo_len * group,
                                          props["sm_count"] * routing.ctas_per_sm(la.meta, props))
            if bm != la.meta["block_m"]:
                la = routing.new_attention(dev, short, short, head_dim, general, False, block_m=bm)
            named = lambda name: _registry.new_launcher("prefill", dev, name=name)  # noqa: E731
            long = routing.long_twin(dev, la, named)
            if long is not None and routing.long_pays((kv_len,), causal, False):
                la = long  # its own tile (cp.async K/V: no TMA twin to fall back from)
            else:
                la, twin = routing.kv_load_pair(dev, la, named)
                la = twin if twin is not None and tma_ok else la
        self.attn = la
        meta = la.meta
        row_tiles = -(-qo_len * group // meta["block_m"])
        if row_tiles > params.MAX_GRID_YZ:
            raise ValueError(f"qo_len * (num_qo_heads / num_kv_heads) = {qo_len * group} rows exceeds the "
                             f"{params.MAX_GRID_YZ * meta['block_m']} a single launch covers")
        ctas = routing.ctas_per_sm(meta, props)
        wl = window_left
        one = schedule.schedule_prefill(np.array([0, qo_len], np.int64), np.array([qo_len], np.int64),
                                        np.array([kv_len], np.int64), qo_len, kv_len, group, num_kv_heads,
                                        meta["block_m"], meta["block_n"], props["sm_count"] * ctas, causal, wl, None,
                                        False, None, ctas, None if tile else head_dim)
        chunks = self.num_chunks = int(one.num_chunks[0])
        p = la.params
        p.num_kv_chunks, p.kv_chunk_size = chunks, one.kv_chunk_size
        # Equal-cost tiles (no causal/window range), in a kernel that supports it (hd256): a head's row
        # tiles run together, for L2 reuse of its K/V; otherwise heads vary fastest so every head's
        # heaviest row tiles go first.
        p.rows_fastest = rows_fastest = int(meta.get("rows_fastest", False) and not causal and window_left < 0)
        # L2 sections of kv heads (routing.l2_section; a rows-fastest grid already runs a head at a
        # time): a kernel a CTA a block takes them here, a persistent one in run(), where the
        # stream's tile-scheduler counters are known (without counters it keeps one section).
        def row_tile_tiles():  # the KV tiles of a block of each row tile, heaviest first (the plan's LPT items)
            tiles = np.asarray(one.item_tiles(-(-one.kv_chunk_size // meta["block_n"]) if one.kv_chunk_size else 1))
            return tiles[::max(1, tiles.size // row_tiles)][:row_tiles]
        section, head_z = (0, 0) if rows_fastest or meta.get("impl") != "sm90" else routing.l2_order(
            props, meta, num_kv_heads, kv_len, head_dim, 1 if self.fp8 else self.dtype.bits // 8, row_tile_tiles,
            num_kv_heads * chunks)
        self.section = (section, head_z) if meta.get("persistent") and section else None
        launch.configure_grid(la, (row_tiles, chunks, num_kv_heads) if rows_fastest else
                              (num_kv_heads, chunks, row_tiles), dev, section, section_z=head_z)
        # Equal blocks on a persistent row: the last round's blocks shared out as ranges of tiles
        # (schedule.stream_k_first; run() turns it on where the stream has the flags)
        want = schedule.stream_k_mode()
        if meta.get("stream_k") and rows_fastest and chunks == 1 and want != "0":
            blocks, ctas, tiles = row_tiles * num_kv_heads, la.grid[0], -(-kv_len // meta["block_n"])
            first = schedule.stream_k_first(blocks, ctas, tiles, force=want == "1")
            if first is not None and ctas * (meta["block_m"] // 64) * 4 <= _cuda.Workspace.FLAG_BYTES:
                self.stream_k = (tiles, first, ctas)

    def _size_workspace(self, qo_len, num_qo_heads, head_dim, opts):
        """Workspace: [packed bool mask, 16-byte padded] [split partial o] [split partial lse]; then,
        apart (stream-K, not in a caller's scratch), a slot a CTA of its consumers' registers."""
        self.ws_sk_bytes = 0
        if self.stream_k is not None:
            consumers = self.attn.meta["block_m"] // 64  # warpgroups of 64 rows, 128 threads each
            self.ws_sk_bytes = self.stream_k[2] * consumers * (head_dim // 2 + 4) * 128 * 4
        self.ws_mask_bytes = (-(-self.mask_bits // 8) + 15) // 16 * 16 if self.mask_kind == "bool" else 0
        self.ws_o_bytes = self.ws_bytes = self.ws_mask_bytes
        if self.num_chunks > 1:
            pairs = qo_len * num_qo_heads
            self.ws_o_bytes = self.ws_mask_bytes + self.num_chunks * pairs * head_dim * 4
            self.ws_bytes = self.ws_o_bytes + self.num_chunks * pairs * 4
            cta = params.merge_cta_per_row(self.dev, qo_len, num_qo_heads)
            self.merge = _registry.new_launcher("merge", self.dev, dtype=fp8.merge_dtype(self.dtype), cta_per_row=cta)
            params.configure_merge(self.merge, qo_len, num_qo_heads, head_dim, self.num_chunks, opts.lse_scale,
                                   self.o_format, self.dev)

    def scale_pointers(self, scales: tuple):
        """The per-head scale tensors among (scale_q, scale_k, scale_v) checked against this plan:
        their addresses (0 = none); a 16-bit q refuses tensors."""
        if not self.fp8:
            fp8.refuse_tensors(scales)
            return None
        return fp8.scale_operands(scales, *self.heads, self.dev)[0]

    def run(self, q, k, v, o, lse, stream, mask_view=None, v_scale=1.0, scale_ptrs=None, ws=None, sched=None):
        """Refill the pointers and launch (mask packing, attention, merge when KV is split). ws /
        sched: the workspace (ws_bytes) and the tile scheduler's zeroed counters when the caller
        provides them (pyflashattn.jax: XLA's scratch), else the stream's own (cuda.Workspace)."""
        p = self.attn.params
        p.q, p.k, p.v, p.o = q, k, v, o
        if self.fp8:
            fp8.point_scales(p, scale_ptrs or (0, 0, 0))
        if self.kv_maps is not None:
            self.kv_maps.point(k, v, *self.tma_geometry)
        if self.q_map is not None:
            self.q_map.point(q)
        p.v_scale = v_scale
        p.o_stride_n, p.o_stride_h = self.o_strides[0], self.o_strides[1]
        sk = self.stream_k if ws is None else None  # (a caller's scratch has no room for it)
        if ws is None:
            total = self.ws_bytes + self.ws_sk_bytes
            ws = _cuda.Workspace.get(self.dev, stream, total) if total else 0
        if self.stream_k is not None:
            flags = _cuda.Workspace.flags(self.dev, stream) if sk else 0
            p.sk_tiles, p.sk_first = (sk[0], sk[1]) if flags else (0, 0)
            p.sk_partial, p.sk_flags = (ws + self.ws_bytes, flags) if flags else (0, 0)
        if self.section:  # a persistent row in L2 sections: the stream's tile-scheduler counters
            if sched is None:
                sched = _cuda.Workspace.counters(self.dev, stream)
            p.sched = sched
            order = self.section if sched else (p.grid_x, p.grid_z)  # without counters: one section
            if (p.grid_section, p.grid_section_z) != order:  # plan() left one section; the divisors follow
                params.set_grid_order(p, (p.grid_x, p.grid_y, p.grid_z), *order)
        if self.mask_kind == "packed":
            p.custom_mask = mask_view.ptr
        elif self.mask_kind == "bool":
            packbits.launch_flat(self.dev, mask_view.ptr, ws, self.mask_bits, 1, stream)
            p.custom_mask = ws
        if self.merge is None:
            p.lse = lse
            self.attn(stream)
            return
        p.lse, p.o_partial, p.lse_partial = 0, ws + self.ws_mask_bytes, ws + self.ws_o_bytes
        self.attn(stream)
        mp = self.merge.params
        mp.o_partial, mp.lse_partial, mp.o, mp.lse = p.o_partial, p.lse_partial, o, lse
        mp.o_stride_n, mp.o_stride_h = self.o_strides[0], self.o_strides[1]
        self.merge(stream)
