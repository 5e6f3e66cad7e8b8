"""The batch engine behind FlashInfer's plan / run wrappers: plan() resolves, schedules and stages
everything; run() checks operands against the plan, refills pointers and launches.

plan() reads the index arrays on the host (device arrays are copied to the host once, which
synchronises with the device: pass numpy arrays to avoid it), runs the scheduler, sizes the
float workspace exactly, and stages every int array of the plan through one pinned host buffer
with one async copy on the stream. run() allocates nothing when out= (and lse=) are given and
never synchronises, so it can be captured in a CUDA graph (use_cuda_graph=True keeps every
device address and the grid fixed across plans: graph.py).
"""
from __future__ import annotations

import numpy as np

from .._runtime import cuda as _cuda, dtypes as _dtypes, registry as _registry, tensor as _tensor
from . import fp8, launch, operands, options, params, routing, schedule, tma
from .graph import GraphState, refuse_capture
from .masks import MaskBuffers
from .problem import Config, KVSource, PlanSettings
from .run_options import RunOptions
from .staging import Staging

_PLAIN = frozenset((type(None), bool, int, float))  # immutable option types plan() may cache by value
# PlanSettings fields that may hold numbers a tensor could stand in for: a config is cached only
# when they are plain values (a tensor hashes by identity and could change value between plans).
_NUMERIC_SETTINGS = (4, 5, 6, 7, 11, 12, 13)
_CONFIG_CACHE_SIZE = 64
# The plan's arrays as the kernels name them; the KV source's index arrays follow.
_PLAN_DEVICE = "the wrapper (its float workspace)"
_PLAN_ARRAYS = ("work_request", "work_qtile", "work_chunk", "num_chunks", "o_indptr", "merge_indptr")


class BatchEngine(RunOptions):
    """One wrapper's engine state: its workspace, staging, masks, graph capacity, launchers and
    the current plan."""

    def __init__(self, float_workspace_buffer, kv_layout: str, use_cuda_graph: bool, paged: bool,
                 custom_mask_buf=None, qk_indptr_buf=None, capture_safe: bool = False):
        self.kv_layout = operands.kv_layout(kv_layout)
        self.paged = paged
        self.set_workspace(float_workspace_buffer)
        self.masks = MaskBuffers(self.dev, bool(use_cuda_graph), custom_mask_buf, qk_indptr_buf)
        self.graph = None  # CUDA-graph mode: enable_graph()
        # Without graph mode run() refuses a capture (graph.refuse_capture), unless its owner never
        # re-plans a planned engine (XQA: one engine per shape), so a captured run() stays valid.
        self.watch_capture = not use_cuda_graph and not capture_safe
        self.staging = Staging(self.dev)
        self.planned = False
        self.launchers = {}
        self.configs = {}  # PlanSettings -> Config (see plan)
        self.attn = self.merge = self.schedule = None
        # a TMA kernel's K/V maps (tma.KvMaps, pointed by run()) and its cp.async twin, which runs
        # instead where run()'s K/V have strides TMA cannot address (kv_fallback)
        self.kv_maps = self.kv_twin = None
        self.q_map = None  # its Q map (tma.QMap: a 16-bit TMA kernel), pointed by run() too
        self.kv_fallback = False
        self.consts = None  # the option fields last written into the attention launcher's struct
        self.pending_copy = False
        self.fast_key = None  # run()'s validated torch signature (launch.torch_key), per plan
        self.kv_ptr_offset = None  # one-tensor paged cache: v's address - k's
        self.pdl = launch.PdlLauncher(self.dev)
        self.scaled = False
        self.sinks = 0  # the sinks address in the structs (run(sinks=...)); 0 = none
        # Lengths from the caller's device arrays (TRT-LLM, trtllm_device.py): the plan covers every
        # request at its maximum lengths, q / o (and ragged K / V) may hold any number of tokens,
        # which the kernel clamps each request's rows into (PrefillParams.q_tokens / kv_tokens).
        self.device_lengths = False
        self.skip = 0.0  # run()'s skip_softmax_threshold_scale_factor in the struct (0 = off)
        self.skip_home = None  # the plan's launcher while its skip-softmax sibling runs (apply_skip_softmax)

    def enable_graph(self, max_batch: int, max_pages: int):
        """CUDA-graph mode with this capacity (batch size, pages; query tokens: the first plan's, or
        GraphState.max_total_q set before it, as pyflashattn.jax does)."""
        self.graph = GraphState(max_batch, max_pages)
        self.watch_capture = False

    def detach_metadata(self) -> list:
        """pyflashattn.jax after a graph-mode plan: the kernels will read the plan's metadata from a
        copy XLA passes each call (the plan's bytes, Staging.last), not from the staging buffer, so
        run() waits for no staging copy. Returns (struct, field, byte offset) of every pointer into
        the staged metadata (the fixed graph layout: the same offsets for every later plan)."""
        self.pending_copy = False
        base, end = self.staging.device, self.staging.device + self.staging.size
        fields = []
        for la in {id(la): la for la in (self.attn, self.merge) if la is not None}.values():
            p = la.params
            for name, _ in type(p)._fields_:
                val = getattr(p, name)
                if type(val) is int and base <= val < end:
                    fields.append((p, name, val - base))
        return fields

    def point_workspace(self, ptr: int) -> None:
        """The float workspace at another address of the same size (pyflashattn.jax: XLA's scratch)."""
        self.ws_ptr = ptr
        if self.planned:
            self._point_workspace()

    # ---- workspace ---------------------------------------------------------------------
    @staticmethod
    def _workspace_view(buf):
        """(view, bytes) of a float workspace: a contiguous 1-D CUDA buffer, 16-byte aligned."""
        v = operands.contiguous_1d(buf, "float_workspace_buffer")
        if v.ptr % 16:
            raise ValueError("float_workspace_buffer must be 16-byte aligned")
        return v, v.shape[0] * max(v.dtype.bits // 8, 1)

    def set_workspace(self, buf):
        v, nbytes = self._workspace_view(buf)
        self.ws_buf = buf  # keep the caller's tensor alive with the wrapper
        self.ws_ptr, self.ws_bytes, self.dev = v.ptr, nbytes, v.device_id

    def reset_workspace(self, buf):
        """Swap the float workspace; a buffer that is refused leaves the old one."""
        v, nbytes = self._workspace_view(buf)
        if v.device_id != self.dev:
            raise ValueError("float_workspace_buffer must stay on the wrapper's device")
        if self.planned and self.ws_need > nbytes:
            raise ValueError(f"float_workspace_buffer holds {nbytes} bytes; the current plan needs {self.ws_need}")
        if self.graph is not None and self.graph.captured is not None and v.ptr != self.ws_ptr:
            raise ValueError("float_workspace_buffer: run() was captured in a CUDA graph that reads the current "
                             "workspace; it cannot be swapped for another buffer")
        self.set_workspace(buf)
        if self.planned:
            self._point_workspace()

    def _point_workspace(self):
        p = self.attn.params
        p.o_partial, p.lse_partial = self.ws_ptr, self.ws_ptr + self.ws_lse_off
        if self.merge is not None:
            mp = self.merge.params
            mp.o_partial, mp.lse_partial = p.o_partial, p.lse_partial

    # ---- plan --------------------------------------------------------------------------
    def plan(self, src: KVSource, settings: PlanSettings, causal, custom_mask, packed_custom_mask,
             disable_split_kv, stream, attn_chunk: int = 0):
        """Resolve, schedule and stage one batch plan. Everything that can refuse the plan runs
        before anything is committed, so a refused plan leaves the previous one usable.
        attn_chunk: chunked attention's chunk size, a power of two >= 2 (TRT-LLM's; 0 = none),
        validated by the caller (operands.attention_chunk)."""
        has_mask = settings.has_mask
        # The mask is checked first (before the driver is touched, like every argument).
        mask = self.masks.plan(custom_mask, packed_custom_mask, src.qo_lens, src.kv_lens) if has_mask else None
        # A serving loop re-plans with the same settings every step: their validation and routing
        # are cached per wrapper (_config), keyed by the values and their types.
        try:
            cfg = self.configs.get((settings, tuple(map(type, settings))))
        except TypeError:  # an unhashable argument: _config resolves it (and rejects it there)
            cfg = None
        if cfg is None:
            cfg = self._config(settings)
        causal = 1 if causal and not has_mask else 0  # a custom mask replaces causal (FlashInfer)
        _cuda.ensure_context(self.dev)
        cap = None
        g = self.graph
        if g is not None:
            cap = g.check_capacity(src.qo_lens.size, int(src.qo[-1]))
        # The kernel: a decode tile when the longest request fits one of them (or, contiguous 16-bit
        # K/V, several within DECODE_MAX_ROWS), else the row-tile kernel. A captured graph keeps the
        # tile its first plan chose (a decode tile stays correct for any lengths, only slower).
        route = cfg.route
        dec = route.decode
        tile = (routing.decode_tile_rows(cfg.head_dim, src.max_qo * cfg.group, route.tiles, route.decode_only)
                if dec else 0)
        if cap is not None:
            tile = cap.get("decode_rows", tile)
        la, budget, ctas = (dec.get(tile) or dec[route.tiles[-1]]) if tile and dec else \
            (route.attn, route.budget, route.ctas)
        la = self._twin(route, la, src, cfg, bool(causal), cap is not None, disable_split_kv)
        meta = la.meta
        plan = schedule.schedule_prefill(src.qo, src.qo_lens, src.kv_lens, src.max_qo, src.max_kv, cfg.group,
                                         cfg.num_kv_heads, meta["block_m"], meta["block_n"], budget, bool(causal),
                                         cfg.window_left, cfg.fixed_split_size, disable_split_kv, cap, ctas,
                                         None if tile else cfg.head_dim, attn_chunk)
        if plan.grid > params.MAX_GRID_YZ:  # work items run along gridDim.z
            raise ValueError(f"this plan needs {plan.grid} work items (q tiles x KV chunks), more than the "
                             f"{params.MAX_GRID_YZ} one launch takes; split the batch (or use a larger "
                             "fixed_split_size / disable_split_kv)")
        # Graph mode keeps the partial-LSE offset fixed across plans (max_partial_rows bound).
        ws_rows = plan.max_partial_rows if cap else plan.num_partial_rows
        lse_off, need = plan.workspace_layout(cfg.num_qo_heads, cfg.head_dim, ws_rows) if ws_rows else (0, 0)
        if need > self.ws_bytes:  # checked before any state changes: a refused plan leaves no trace
            raise ValueError(f"float_workspace_buffer holds {self.ws_bytes} bytes but this plan needs "
                             f"{need}; pass a larger buffer (or disable_split_kv=True)")
        merge_rows = cap["max_total_q"] if cap else plan.total_q
        merge = (self.launcher("merge", fp8.merge_dtype(cfg.q_dtype),
                               cta_per_row=params.merge_cta_per_row(self.dev, merge_rows, cfg.num_qo_heads))
                 if plan.split or cap else None)
        # What goes to the device, in this order: the plan's arrays, qo_indptr, the KV source's index
        # arrays, (graph mode) the chunk size, the mask's offsets.
        if cap is None:
            # Back to back, the plan's arrays in one piece (they are consecutive in plan.buffer).
            # Nothing merged: every request has one chunk, the kernel reads no o_indptr and no
            # merge runs, so o_indptr and merge_indptr (total_q + 1 entries, the largest) stay home.
            buf = plan.buffer
            staged = [buf if merge is not None else buf[:3 * plan.grid + src.qo_lens.size], src.qo, *src.arrays]
            if mask is not None:
                staged += mask.offset_arrays
            offsets = nbytes = sig = None
        else:
            staged, offsets, nbytes, sig = self._graph_staged(src, plan, mask, cap, cfg, causal, la, lse_off)
        # ---- nothing below refuses the plan: commit ----
        s = launch.plan_stream(stream, self.dev)
        ptrs = self.staging.upload(staged, s, offsets, nbytes)
        self.plan_stream, self.pending_copy = s, True
        self._point_metadata(la, plan, src, mask, merge, cap, ptrs, s)
        consts = (la, cfg, causal, src.page_size)
        if consts != self.consts or self.scaled:  # a serving loop re-plans with the same options
            self._write_options(la, cfg, causal, src.page_size)
            self.consts = consts
        la.params.chunk_shift = attn_chunk.bit_length() - 1 if attn_chunk else 0  # MaskRule::chunk_shift
        self.sm_log2 = cfg.sm_scale * params.LOG2E
        self.sinks = la.params.sinks = 0  # run(sinks=...) sets them for its launch
        self.ks = self.vs = 1.0  # run()'s k_scale / v_scale currently in the struct
        self.scale_ptrs = (0, 0, 0)  # fp8 q: run()'s per-head scale tensors in the struct
        self.scaled = False
        launch.configure_grid(la, (cfg.num_kv_heads, 1, plan.grid), self.dev, *self._sections(la, cfg, src, plan, s))
        self.attn = la
        self.skip, self.skip_home = 0.0, None  # run(skip_softmax_threshold_scale_factor=...) sets it
        la.params.skip_softmax_factor = 0.0
        self.kv_maps = tma.KvMaps(cfg.q_dtype.short, la.params) if la.meta.get("tma") else None
        # (the long TMA twin's: the long twin, the same schedule)
        self.kv_twin = (route.long if la is route.long_tma else route.attn) \
            if la.meta.get("tma") or la.meta.get("dense_kv") else None
        self.q_map = tma.q_map(cfg.q_dtype.short, la.params, la.meta, cfg.num_qo_heads, cfg.head_dim,
                               cfg.num_qo_heads // cfg.num_kv_heads, cfg.q_dtype.bits // 8)
        self.kv_fallback = False
        if merge is not None:  # a captured graph always holds the merge (a no-op for unsplit rows)
            params.configure_merge(merge, merge_rows, cfg.num_qo_heads,
                                   cfg.head_dim, 0, cfg.opts.lse_scale, cfg.o_format, self.dev)
        self.merge = merge
        if merge is not None:
            merge.params.sinks = 0
        self.ws_rows, self.ws_lse_off, self.ws_need = ws_rows, lse_off, need
        self.schedule, self.cfg, self.src = plan, cfg, src
        self.shape = (plan.total_q, cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim)
        self._point_workspace()
        self.planned = True
        if cap is not None:
            g.commit(cap, tile, sig)
        self.fast_key = None  # run()'s validated-signature cache belongs to one plan
        return plan

    def _twin(self, route, la, src: KVSource, cfg, causal: bool, graph: bool, disable_split_kv):
        """The kernel a plan runs for row-tile kernel la: its long-KV twin (its own tile: the
        schedule is the twin's, the same CTAs an SM; paged: the long twin's TMA twin where that
        pays without a mask, and la's TMA twin before the long twin's copies) where long_pays,
        else its TMA, dense or span twin (the same tile: the schedule is la's) where that pays,
        else la. A decode tile is its own. Batch-invariant plans (fixed_split_size, or disable_split_kv over host-planned
        lengths) and graph-mode plans keep one tile; a device-lengths plan (TRT-LLM's device
        metadata) never splits KV and is planned once per shape key at its max lengths, so the
        key fixes its tile."""
        if la is not route.attn:
            return la
        invariant = cfg.fixed_split_size is not None or (disable_split_kv and not self.device_lengths)

        def tma_twin(twin):  # a TMA twin that fits the call's K/V and pays
            if twin is None:
                return False
            n = twin.meta["block_n"]
            return routing.tma_fits(self.paged, src.page_size, n, src.total_kv) \
                and routing.tma_pays(self.paged, src.page_size, src.kv_lens, n, graph)
        tma = tma_twin(route.tma)
        # Paged, TMA twins (e4m3: boxes, no copies) run ahead of the copies: the long twin's where
        # it pays and no mask (causal at 16k it ran 0.97x the row's TMA twin, without a mask 0.99x
        # at 4k and 1.03x at 16k), else the row's even where the long (copies) twin would
        # (NOTES.md, session 47).
        if route.long is not None and routing.long_pays(src.kv_lens, causal, graph or invariant):
            if not causal and tma_twin(route.long_tma):
                return route.long_tma
            if not (tma and self.paged):
                return route.long
        if tma:
            return route.tma
        if route.dense is not None and routing.dense_pays(self.kv_layout, cfg.num_kv_heads, src.page_size):
            return route.dense  # a run() over strided page slots falls back (kv_fallback)
        if route.span is not None and routing.span_pays(src.page_size):
            return route.span  # any strides
        return la

    def _sections(self, la, cfg, src, plan, stream: int) -> tuple[int, int, int]:
        """(kv heads per L2 section, the tile scheduler's counters, work items in sections before
        the tail) of an sm90 kernel's launch (no counters: a kernel a CTA a block); zeros for the
        others and for one section."""
        if la.meta.get("impl") != "sm90":
            return 0, 0, 0
        sched = self.staging.counters(stream) if la.meta.get("persistent") else 0
        if la.meta.get("persistent") and not sched:  # fixed shares balance one section only
            return 0, sched, 0
        section, head_z = routing.l2_order(
            _cuda.properties(self.dev), la.meta, cfg.num_kv_heads, int(src.kv_lens.sum()), cfg.head_dim,
            max(1, cfg.kv_dtype.bits // 8),
            lambda: plan.item_tiles(-(-plan.kv_chunk_size // plan.block_n) if plan.kv_chunk_size else 1),
            cfg.num_kv_heads)
        return section, sched, head_z

    def _config(self, settings: PlanSettings) -> Config:
        """plan()'s settings validated and routed, cached per wrapper: a serving loop re-plans with
        the same settings every step. Keyed by the values and their types (so 128.0 or True never
        pass where 128 or 1 did), and stored only with plain scalars in the numeric options."""
        key = (settings, tuple(map(type, settings)))
        try:
            cfg = self.configs.get(key)
        except TypeError:  # an unhashable argument: resolve it every time (and reject it there)
            cfg = key = None
        if cfg is None:
            cfg = self._resolve(settings)
            if key is not None and _PLAIN.issuperset(key[1][i] for i in _NUMERIC_SETTINGS):
                if len(self.configs) >= _CONFIG_CACHE_SIZE:
                    self.configs.clear()
                self.configs[key] = cfg
        return cfg

    def _resolve(self, st: PlanSettings) -> Config:
        """Validate the settings (errors name the argument) and route them to kernels."""
        opts = options.resolve(st.pos_encoding_mode, st.allow_fp16_qk_reduction, st.logits_soft_cap, st.rope_scale,
                               st.rope_theta, st.lse_base)
        hq = operands.positive_int(st.num_qo_heads, "num_qo_heads")
        hkv = operands.positive_int(st.num_kv_heads, "num_kv_heads")
        hd = operands.positive_int(st.head_dim, "head_dim")
        if hq % hkv:
            raise ValueError(f"num_qo_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
        if hd not in routing.HEAD_DIMS:
            raise ValueError(f"head_dim {hd} is not supported (supported: {routing.HEAD_DIMS})")
        qdt = operands.dtype_arg(st.q_data_type, "q_data_type")
        if fp8.is_fp8(qdt):  # fp8 prefill: e4m3 Q, K and V (fp8.py)
            kdt, kv_fp8 = fp8.kv_dtype(st.kv_data_type), 0
            odt, o_format = fp8.output_dtype(st.o_data_type)
        else:
            qdt, kdt, kv_fp8 = operands.kv_dtype_pair(st.q_data_type, st.kv_data_type)
            odt, o_format = operands.output_dtype(st.o_data_type, qdt)
        nvfp4 = kdt in operands.NVFP4_CODES
        window_left = options.window(st.window_left)
        sm_scale = options.softmax_scale(st.sm_scale, hd)
        fss = None if st.fixed_split_size is None else schedule._pos_int(st.fixed_split_size, "fixed_split_size")
        general = opts.general or st.has_mask or st.general
        if nvfp4:
            operands.nvfp4_settings(self.paged, general, hd)
        _cuda.ensure_context(self.dev)
        if fp8.is_fp8(qdt):
            fp8.check_call(self.dev, general)
        kind = "fp8" if kv_fp8 else "nvfp4" if nvfp4 else qdt.short  # the kernels' kv_dtype
        fp4_out = o_format == operands.OUT_NVFP4
        if fp4_out and not routing.nvfp4_out_built(self.dev, qdt.short, kind, hd, general, self.paged):
            raise NotImplementedError(
                f"out_dtype='nvfp4': no kernel writes the NVFP4 output for this call (paged KV, head_dim {hd}, "
                f"{'general options / tensor bmm scales' if general else 'lean'}): the hd256 general kernels lack "
                "it (their registers cannot spare it); use float bmm scales")
        route = routing.Route(self.launcher, self.dev, qdt.short, kind, hd, general, self.paged, kind != qdt.short,
                              fp4_out)
        return Config(hq, hkv, hd, hq // hkv, opts, qdt, kdt, kv_fp8, nvfp4, window_left, sm_scale, fss, route, odt,
                      o_format)

    def _graph_staged(self, src, plan, mask, cap, cfg, causal, la, lse_off):
        """Graph mode's staging: (arrays, their fixed int32 offsets, bytes, the plan's signature)."""
        mask_arrays = () if mask is None else mask.offset_arrays
        # Rows past this plan's tokens must merge nothing (the merge grid covers the capacity).
        mi = plan.merge_indptr
        staged = [plan.work_request, plan.work_qtile, plan.work_chunk, plan.num_chunks, plan.o_indptr,
                  np.concatenate([mi, np.full(cap["max_total_q"] + 1 - mi.size, mi[-1], np.int32)]),
                  src.qo, *src.arrays, plan.kv_chunk_size, *mask_arrays]
        names = (*_PLAN_ARRAYS, "qo_indptr", *src.names, "chunk_size", "mask_indptr", "mask_in_indptr")
        layout = self.graph.layout({name: 1 if type(a) is int else a.size for name, a in zip(names, staged)}, cap,
                                   self.staging)
        offsets = [layout[name] // 4 for name in names[:len(staged)]]
        opts = cfg.opts
        sig = {"num_qo_heads": cfg.num_qo_heads, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
               "q_data_type": cfg.q_dtype.name, "kv_data_type": cfg.kv_dtype.name, "o_data_type": cfg.o_dtype.name,
               "page_size": src.page_size,
               "causal": causal, "window_left": cfg.window_left, "sm_scale": cfg.sm_scale,
               "logits_soft_cap": opts.soft_cap, "pos_encoding_mode": opts.pos, "rope_scale": opts.rope_scale,
               "rope_theta": opts.rope_theta, "lse_base": opts.lse_scale, "custom_mask": mask is not None,
               "float workspace layout": (self.ws_ptr, lse_off), "kernel": (la.name, plan.grid)}
        self.graph.check_sig(sig)
        return staged, offsets, layout["__end__"], sig

    def _point_metadata(self, la, plan, src, mask, merge, cap, ptrs, s):
        """Point the params structs at the staged arrays (ptrs: their device addresses)."""
        nkv = len(src.arrays)
        if cap is None:  # the plan's arrays follow each other from where plan.buffer landed
            B = src.qo_lens.size
            wr, rest = ptrs[0], ptrs[1:]
            wq, wc, nc = wr + 4 * plan.grid, wr + 8 * plan.grid, wr + 12 * plan.grid
            o_ptr = m_ptr = chunk_ptr = 0
            if merge is not None:
                o_ptr = nc + 4 * B
                m_ptr = o_ptr + 4 * (B + 1)
            mask_ptrs = rest[1 + nkv:]
        else:
            (wr, wq, wc, nc, o_ptr, m_ptr), rest = ptrs[:6], ptrs[6:]
            chunk_ptr, mask_ptrs = rest[1 + nkv], rest[2 + nkv:]
        # rest: qo_indptr, the KV source's index arrays, (graph mode) the chunk size, the mask's offsets
        p = la.params
        p.work_request, p.work_qtile, p.work_chunk, p.num_chunks, p.o_indptr = wr, wq, wc, nc, o_ptr
        p.qo_indptr = rest[0]
        for name, ptr in zip(src.names, rest[1:1 + nkv]):
            setattr(p, name, ptr)
        p.kv_chunk_size_dev = chunk_ptr
        if mask is not None:
            p.custom_mask, p.mask_indptr = self.masks.write(mask, mask_ptrs, s)
        else:  # (a block-table source stages its own mask offsets: XQA's speculative-decoding masks)
            p.custom_mask = 0
            if "mask_indptr" not in src.names:
                p.mask_indptr = 0
            self.masks.keep = None
        if "v_page_indices" not in src.names:  # V shares K's page ids
            p.v_page_indices = 0
        p.kv_chunk_size = plan.kv_chunk_size
        if merge is not None:
            merge.params.merge_indptr = m_ptr

    def _write_options(self, la, cfg: Config, causal: int, page_size: int):
        """The option fields of the launcher's struct (this wrapper's own): written only when the
        plan's options changed."""
        p = la.params
        params.fill_score_fields(p, self.dev, cfg.num_qo_heads, cfg.num_kv_heads, causal, cfg.window_left,
                                 cfg.sm_scale, cfg.opts)
        p.kv_fp8 = cfg.kv_fp8
        p.o_format = cfg.o_format
        fp8.point_scales(p, (0, 0, 0))  # run()'s per-head scales (plan() resets scale_ptrs)
        p.page_size = page_size
        p.page_shift = page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1

    def launcher(self, family, dtype, kv_dtype=None, head_dim=None, general=None, decode=0, cta_per_row=False,
                 name=None, nvfp4_out=False):
        """The wrapper's own Launcher per kernel, reused across plans (creating one costs ~10 us);
        decode = the decode tile's packed rows (0: the row-tile kernels); cta_per_row: the merge
        kernel with one CTA per (row, head) (params.merge_cta_per_row); name: a kernel by name;
        nvfp4_out: one that writes the NVFP4 output (the manifest's nvfp4_out)."""
        key = (family, dtype, kv_dtype, head_dim, general, decode, cta_per_row, name, nvfp4_out)
        la = self.launchers.get(key)
        if la is None:
            if name is not None:
                la = _registry.new_launcher(family, self.dev, name=name)
            elif family == "merge":
                la = _registry.new_launcher("merge", self.dev, dtype=dtype, cta_per_row=cta_per_row)
            else:
                la = routing.new_attention(self.dev, dtype, kv_dtype, head_dim, general, self.paged, decode,
                                           nvfp4_out)
            self.launchers[key] = la
        return la

    # ---- run ---------------------------------------------------------------------------
    def check_q(self, q, out, lse, return_lse, stream):
        """q, out and lse against the plan; allocates out / lse when not given. Returns
        (q view, out, out view, lse, lse view, stream, handshake stream or None)."""
        qv = _tensor.view(q, "q")
        total_q, Hq, Hkv, D = self.shape
        if self.device_lengths and qv.ndim == 3:
            total_q = qv.shape[0]
        if qv.shape != (total_q, Hq, D):
            raise ValueError(f"q must have shape {(total_q, Hq, D)} (qo_indptr[-1], num_qo_heads, head_dim) "
                             f"as planned, got {qv.shape}")
        dtype = self.cfg.q_dtype
        operands.check_rows("q", qv, dtype, self.dev, expected="plan() was told q_data_type=", ref=_PLAN_DEVICE)
        fw = qv.framework
        s = launch.call_stream(stream, fw, self.dev)
        # DLPack handshake for producers with their own streams (JAX): views taken with the
        # launch stream make it wait for the producer's pending writes. torch needs none.
        hs = None if fw == "torch" else s
        if hs is not None and fw != "cupy":
            qv = _tensor.view(q, "q", stream=hs)
        odt = self.cfg.o_dtype
        od = D // 2 if self.cfg.o_format == operands.OUT_NVFP4 else D  # NVFP4: code pairs, two a byte
        if out is None:
            out, ov = _tensor.empty(qv, (total_q, Hq, od), odt, s)
        else:
            ov = _tensor.view(out, "out")
            operands.check_out(ov, (total_q, Hq, od), odt, self.dev, _PLAN_DEVICE,
                               "q has " if odt is dtype else "plan() was told o_data_type=")
        lv = None
        if lse is not None:
            lv = _tensor.view(lse, "lse")
            operands.check_lse(lv, (total_q, Hq), self.dev)
        elif return_lse:
            lse, lv = _tensor.empty(qv, (total_q, Hq), _dtypes.FLOAT32, s)
        return qv, out, ov, lse, lv, s, hs

    def kv_operand(self, x, name, hs):
        """View one K/V tensor (with the launch stream for producers that need the handshake)
        and check it against the plan: device, kv dtype, 16-byte aligned rows."""
        t = _tensor.view(x, name, stream=hs)
        operands.check_rows(name, t, self.cfg.kv_dtype, self.dev, expected="plan() was told kv_data_type=",
                            ref=_PLAN_DEVICE)
        return t

    def _before_launch(self, s):
        """The first run on stream s after a plan waits for the plan's metadata copy (issued on the
        plan's stream) once; graph mode notices a capture. (Without graph mode a capture was
        refused before this: refuse_capture.)"""
        if self.pending_copy:
            _cuda.stream_wait(s, self.plan_stream)
            self.pending_copy = False
        g = self.graph
        if g is not None and g.probe:
            g.note_capture(s)

    def launch(self, qv, ov, lv, s, pdl):
        if self.watch_capture:
            refuse_capture(s)
        if self.pending_copy or self.graph is not None:
            self._before_launch(s)
        la = self.attn
        p = la.params
        p.q, p.o = qv.ptr, ov.ptr
        p.q_stride_n, p.q_stride_h = qv.strides[0], qv.strides[1]
        if self.q_map is not None:  # (the plan's own struct: a skip-softmax sibling copies it, ignoring Q's map)
            self.q_map.configure(qv.shape[0], qv.strides[0], qv.strides[1])
            self.q_map.point(qv.ptr)
        osn, osh = ov.strides[0], ov.strides[1]
        if self.cfg.o_format == operands.OUT_NVFP4:  # the kernels count e2m1 elements, two a byte
            osn, osh = 2 * osn, 2 * osh
        p.o_stride_n, p.o_stride_h = osn, osh
        p.lse = lv.ptr if lv is not None else 0
        if self.device_lengths:
            p.q_tokens = qv.shape[0]
            if not qv.shape[0]:
                return
        elif self.shape[0] == 0:
            return
        # K/V that TMA cannot address, or a dense twin's cache with strided page slots: the row itself, same struct
        if self.kv_fallback and (la.meta.get("tma") or la.meta.get("dense_kv")):
            _cuda.copy_params(self.kv_twin, la)
            la = self.kv_twin
        self.pdl(la, pdl)(s)
        if self.merge is not None:
            mp = self.merge.params
            mp.o, mp.lse = ov.ptr, (lv.ptr if lv is not None else 0)
            mp.o_stride_n, mp.o_stride_h = osn, osh
            self.merge(s)

    def remember(self, q, kv_parts, out, lse, return_lse):
        """After a validated run: its torch signature, for the fast path (out / lse as the caller
        passed them: None when we allocated; none for K/V on the cp.async fallback)."""
        self.fast_key = launch.torch_key(q, kv_parts, out, lse, bool(return_lse)) \
            if launch.is_torch(q) and not self.kv_fallback else None

    def _point_maps(self, p, k_ptr: int, v_ptr: int, num_pages: int):
        """A TMA plan's K/V maps from the struct's strides (num_pages: the paged cache's pages, 0 =
        ragged); K/V that TMA cannot address run on the cp.async twin (kv_fallback)."""
        _, _, Hkv, D = self.shape
        kg, vg = tma.kv_geometries(p, Hkv, D, self.cfg.kv_dtype.bits // 8, self.attn.meta["block_n"],
                                   self.src.page_size if self.paged else 0, num_pages)
        self.kv_fallback = not self.kv_maps.point(k_ptr, v_ptr, kg, vg)

    def torch_fast(self, q, kv_parts, out, lse, return_lse, stream, pdl):
        """A run() whose torch tensors have the signature of the last validated run: pointers
        only (the full path otherwise: None)."""
        fk = self.fast_key
        if fk is None or q.__class__ not in launch.TORCH_TYPES or \
                launch.torch_key(q, kv_parts, out, lse, bool(return_lse)) != fk:
            return None
        qp = q.data_ptr()
        kp = kv_parts[0].data_ptr()
        vp = kp + self.kv_ptr_offset if self.kv_ptr_offset is not None else kv_parts[1].data_ptr()
        op = out.data_ptr() if out is not None else 0
        if (qp | kp | vp | op) & 15:
            return None  # the full path raises the precise error
        s = _tensor.stream_handle(stream) if stream is not None else launch.torch_stream(self.dev)
        # before anything is allocated or launched: every run() (cuStreamIsCapturing, ~0.4 us of
        # Python on the fake driver; a capture can start between any two calls)
        if self.watch_capture:
            refuse_capture(s)
        if self.pending_copy or self.graph is not None:
            self._before_launch(s)
        total_q, Hq = q.shape[0] if self.device_lengths else self.shape[0], self.shape[1]
        if out is None:  # o has q's shape (the plan's key fixed it), and q's dtype unless planned otherwise
            odt = self.cfg.o_dtype
            out = _tensor.torch_empty_like(q) if odt is self.cfg.q_dtype else _tensor.torch_empty_as(q, odt)
            op = out.data_ptr()
        if lse is None and return_lse:
            lse = _tensor.torch_empty_f32(q, (total_q, Hq))
        p = self.attn.params
        p.q, p.k, p.v, p.o = qp, kp, vp, op
        if self.kv_maps is not None:
            self.kv_maps.repoint(kp, vp)
        if self.q_map is not None:
            self.q_map.point(qp)
        p.lse = lp = lse.data_ptr() if lse is not None else 0
        if total_q:
            self.pdl(self.attn, pdl)(s)
            merge = self.merge
            if merge is not None:
                mp = merge.params
                mp.o, mp.lse = op, lp
                merge(s)
        if lse is None:
            return out
        return (out, lse) if return_lse else out

    def refuse_run(self, args, positional: str):
        if args:
            raise TypeError(f"run() takes {positional} positionally; pass the rest by keyword")
        raise RuntimeError("call plan() before run()")

    def run_paged(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
                  return_lse: bool = False, stream=None, enable_pdl=None, sinks=None, kv_cache_sf=None,
                  skip_softmax_threshold_scale_factor=None):
        """run() over a paged cache: one tensor [pages, 2, ...] or a (k_cache, v_cache) pair
        (BatchPrefillWithPagedKVCacheWrapper.run's contract); an NVFP4 cache (plan's
        kv_data_type uint8) with its block scales kv_cache_sf in the same form."""
        if args or not self.planned:
            self.refuse_run(args, "q and paged_kv_cache")
        if skip_softmax_threshold_scale_factor is not None or self.skip:
            self.apply_skip_softmax(skip_softmax_threshold_scale_factor)
        if k_scale is not None or v_scale is not None or q_scale is not None or self.scaled:
            self.apply_scales(k_scale, v_scale, q_scale)
        if sinks is not None or self.sinks:
            self.apply_sinks(sinks)
        if isinstance(paged_kv_cache, (tuple, list)):
            kv_parts = tuple(paged_kv_cache)
            # only a (k_cache, v_cache) pair may take the fast path (a 1-tuple must not pass as
            # the bare 5-D cache it holds: the full path refuses it); block scales never do (an
            # NVFP4 plan remembers no fast signature, and scales given to another plan are refused)
            fast = (self.torch_fast(q, kv_parts, out, lse, return_lse, stream, enable_pdl)
                    if len(kv_parts) == 2 and kv_cache_sf is None else None)
        else:
            kv_parts = (paged_kv_cache,)
            fast = self.torch_fast(q, kv_parts, out, lse, return_lse, stream, enable_pdl) if kv_cache_sf is None \
                else None
        if fast is not None:
            return fast
        qv, out_, ov, lse_, lv, s, hs = self.check_q(q, out, lse, return_lse, stream)
        k_ptr, v_ptr, ks, vs, num_pages = self._paged_operands(paged_kv_cache, kv_parts, hs)
        self._point_block_scales(kv_cache_sf, isinstance(paged_kv_cache, (tuple, list)), num_pages, hs)
        if self.src.max_page >= num_pages:
            raise ValueError(f"paged_kv_indices refers to page {self.src.max_page} but paged_kv_cache has "
                             f"{num_pages} pages")
        self.kv_ptr_offset = v_ptr - k_ptr if len(kv_parts) == 1 else None
        p = self.attn.params
        p.k, p.v = k_ptr, v_ptr
        p.k_stride_page, p.k_stride_n, p.k_stride_h = operands.paged_kv_strides(self.kv_layout, ks)
        p.v_stride_page, p.v_stride_n, p.v_stride_h = operands.paged_kv_strides(self.kv_layout, vs)
        if self.kv_maps is not None:
            self._point_maps(p, k_ptr, v_ptr, num_pages)
        elif self.kv_twin is not None:  # a dense twin: its copies step HEAD_DIM elements a page slot
            self.kv_fallback = not (p.k_stride_n == p.v_stride_n == self.shape[3])
        self.launch(qv, ov, lv, s, enable_pdl)
        if kv_cache_sf is None:  # (NVFP4: every run points the scales, no fast path)
            self.remember(q, kv_parts, out, lse, return_lse)
        return finish(out_, lse_, return_lse)

    def _point_block_scales(self, kv_cache_sf, pair: bool, num_pages: int, hs):
        """An NVFP4 plan: check kv_cache_sf against the cache's form and pages, and point the
        params at it. Any other plan: refuse block scales."""
        cfg = self.cfg
        if not cfg.kv_nvfp4:
            if kv_cache_sf is not None:
                raise TypeError(f"kv_cache_sf: block scales belong to an NVFP4 cache, but plan() was told "
                                f"kv_data_type={cfg.kv_dtype.name} (plan with kv_data_type=uint8 for NVFP4)")
            return
        if kv_cache_sf is None:
            raise TypeError("kv_cache_sf is required: plan() was told kv_data_type=uint8, an NVFP4 cache (e2m1 code "
                            "pairs), whose float8_e4m3fn block scales kv_cache_sf holds")
        _, _, Hkv, D = self.shape
        ps = self.src.page_size
        codes = (num_pages, ps, Hkv, D // 2) if self.kv_layout == "NHD" else (num_pages, Hkv, ps, D // 2)
        kp, vp, ks, vs = operands.nvfp4_scales(kv_cache_sf, pair, 2, codes, self.dev, hs)
        p = self.attn.params
        p.k_sf, p.v_sf = kp, vp
        p.k_sf_stride_page, p.k_sf_stride_n, p.k_sf_stride_h = operands.paged_kv_strides(self.kv_layout, ks)
        p.v_sf_stride_page, p.v_sf_stride_n, p.v_sf_stride_h = operands.paged_kv_strides(self.kv_layout, vs)

    def _paged_operands(self, paged_kv_cache, kv_parts, hs):
        """(k address, v address, k page strides, v page strides, pages) of a paged cache (an NVFP4
        cache: its codes, D / 2 bytes a row)."""
        _, Hq, Hkv, D = self.shape
        D = D // 2 if self.cfg.kv_nvfp4 else D
        ps = self.src.page_size
        nhd = self.kv_layout == "NHD"
        if isinstance(paged_kv_cache, (tuple, list)):
            if len(kv_parts) != 2:
                raise ValueError("paged_kv_cache tuple must be (k_cache, v_cache)")
            kc, vc = (self.kv_operand(t, n, hs) for t, n in zip(kv_parts, ("k_cache", "v_cache")))
            want = (kc.shape[0], ps, Hkv, D) if nhd else (kc.shape[0], Hkv, ps, D)
            for t, n in ((kc, "k_cache"), (vc, "v_cache")):
                if t.ndim != 4 or t.shape != want:
                    raise ValueError(f"{n} must have shape {want} ({self.kv_layout}), got {t.shape}")
            return kc.ptr, vc.ptr, kc.strides, vc.strides, kc.shape[0]
        c = self.kv_operand(paged_kv_cache, "paged_kv_cache", hs)
        want = (c.shape[0], 2, ps, Hkv, D) if nhd else (c.shape[0], 2, Hkv, ps, D)
        if c.ndim != 5 or c.shape != want:
            raise ValueError(f"paged_kv_cache must have shape {want} ({self.kv_layout}), got {c.shape}")
        item = c.dtype.bits // 8
        strides = (c.strides[0],) + c.strides[2:]
        return c.ptr, c.ptr + c.strides[1] * item, strides, strides, c.shape[0]

    def ragged_kv(self, k, v, hs):
        """k and v's views, checked against the plan, and their rows: [rows, Hkv, D] (NHD) or
        [Hkv, rows, D] (HND), rows = kv_indptr[-1], or K's own row count under device_lengths (the
        kernel clamps each request's rows into K / V). hs: the stream's handshake (None: trace time)."""
        _, _, Hkv, D = self.shape
        kv, vv = self.kv_operand(k, "k", hs), self.kv_operand(v, "v", hs)
        total_kv = self.src.total_kv
        if self.device_lengths and kv.ndim == 3:
            total_kv = kv.shape[0 if self.kv_layout == "NHD" else 1]
        want = (total_kv, Hkv, D) if self.kv_layout == "NHD" else (Hkv, total_kv, D)
        for t, n in ((kv, "k"), (vv, "v")):
            if t.shape != want:
                raise ValueError(f"{n} must have shape {want} (kv_indptr[-1], num_kv_heads, head_dim in "
                                 f"{self.kv_layout}), got {t.shape}")
        return kv, vv, total_kv

    def run_ragged(self, q, k, v, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
                   return_lse: bool = False, stream=None, enable_pdl=None, sinks=None,
                   skip_softmax_threshold_scale_factor=None):
        """run() over ragged K/V [kv_indptr[-1], Hkv, D] (NHD) or [Hkv, kv_indptr[-1], D] (HND)."""
        if args or not self.planned:
            self.refuse_run(args, "q, k, v")
        if skip_softmax_threshold_scale_factor is not None or self.skip:
            self.apply_skip_softmax(skip_softmax_threshold_scale_factor)
        if k_scale is not None or v_scale is not None or q_scale is not None or self.scaled:
            self.apply_scales(k_scale, v_scale, q_scale)
        if sinks is not None or self.sinks:
            self.apply_sinks(sinks)
        fast = self.torch_fast(q, (k, v), out, lse, return_lse, stream, enable_pdl)
        if fast is not None:
            return fast
        qv, out_, ov, lse_, lv, s, hs = self.check_q(q, out, lse, return_lse, stream)
        kv, vv, total_kv = self.ragged_kv(k, v, hs)
        p = self.attn.params
        # K / V's rows: device lengths are clamped into them; a TMA kernel's boxes stay within them
        p.kv_tokens = total_kv
        p.k, p.v = kv.ptr, vv.ptr
        p.k_stride_n, p.k_stride_h = operands.ragged_kv_strides(self.kv_layout, kv.strides)
        p.v_stride_n, p.v_stride_h = operands.ragged_kv_strides(self.kv_layout, vv.strides)
        self.kv_ptr_offset = None
        if self.kv_maps is not None:
            self._point_maps(p, kv.ptr, vv.ptr, 0)
        self.launch(qv, ov, lv, s, enable_pdl)
        self.remember(q, (k, v), out, lse, return_lse)
        return finish(out_, lse_, return_lse)


def finish(out, lse, return_lse):
    """Hand outputs to the caller's framework (JAX outputs only now, ordered after the launch)."""
    out = _tensor.finalize(out)
    if lse is None:
        return out
    lse = _tensor.finalize(lse)
    return (out, lse) if return_lse else out
