"""Batch prefill wrappers over paged and ragged KV (FlashInfer's plan / run contract).

    w = BatchPrefillWithPagedKVCacheWrapper(float_workspace)
    w.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, Hq, Hkv, D, page_size, causal=True)
    o = w.run(q, paged_kv_cache)          # any number of times (e.g. once per layer)

plan() does all host work: it reads the index arrays on the host (device arrays are copied
to the host once, which synchronises with the device: pass numpy arrays to avoid it), runs the
load-balancing scheduler (pyflashattn._plan), sizes the float workspace exactly, and stages
every int array of the plan through one pinned host buffer with one async copy on the stream.
run() checks q/KV against the plan, refills a few pointers and launches: it allocates nothing
when out= (and lse=) are given and never synchronises, so it can be captured in a CUDA graph
(use_cuda_graph=True keeps every device address and the grid fixed across plans).
"""
from __future__ import annotations

import ctypes
import math

import numpy as np

from . import _cuda, _dtypes, _options, _plan, _registry, _tensor
from .prefill import HEAD_DIMS, LOG2E, _MERGE_ROWS_PER_BLOCK, _alibi_buffer



def _host_int(x, name):
    """A host int32 numpy copy of an index array (numpy, list, or a device tensor: a sync)."""
    if x is None:
        raise ValueError(f"{name} is required")
    if type(x) is np.ndarray and x.dtype == np.int32 and x.ndim == 1:
        return x  # the common case, kept cheap: plan() is on the serving loop's critical path
    if isinstance(x, np.ndarray):
        a = x
    elif isinstance(x, (list, tuple)):
        a = np.asarray(x)
    else:
        if not hasattr(x, "__dlpack__"):
            raise TypeError(f"{name} must be an integer array (numpy or a DLPack tensor), got {type(x).__name__}")
        v = _tensor.view(x, name)
        if v.dtype not in (_dtypes.INT32, _dtypes.INT64):
            raise TypeError(f"{name} must be int32 (or int64), got {v.dtype.name}")
        if v.is_cuda:
            a = _device_to_host(v, name)
        else:
            a = np.from_dlpack(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got {a.dtype}")
    if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
        raise ValueError(f"{name} has values outside int32")
    return a.astype(np.int32, copy=False)


def _device_to_host(v, name):
    n = v.shape[0] if v.ndim == 1 else None
    if n is None:
        raise ValueError(f"{name} must be 1-D, got shape {v.shape}")
    if n > 1 and v.strides[0] != 1:
        raise ValueError(f"{name} must be contiguous")
    itemsize = v.dtype.bits // 8
    out = np.empty(n, dtype=np.int32 if itemsize == 4 else np.int64)
    if n:
        _cuda.ensure_context(v.device_id)
        _cuda.check(_cuda.driver().cuMemcpyDtoH(out.ctypes.data, v.ptr, n * itemsize), f"copy {name} to host")
    return out


class _Staging:
    """One pinned host buffer and one device buffer for all int metadata of a plan.

    plan() lays the arrays out (16-byte aligned), writes them into the pinned buffer and issues
    one cuMemcpyHtoDAsync on the stream; an event guards the pinned buffer so a later plan never
    overwrites bytes an earlier copy has not read yet. With fixed=True (CUDA graphs) the device
    buffer never moves, so captured launches keep pointing at valid metadata.
    """

    def __init__(self, device_id: int):
        self.dev = device_id
        self.host = self.device = 0
        self.size = 0
        self.event = None
        self.fixed = False

    def reserve(self, nbytes: int, fixed: bool = False):
        if nbytes <= self.size:
            return
        if self.fixed:
            raise ValueError(f"plan needs {nbytes} bytes of int metadata but the CUDA-graph buffers hold "
                             f"{self.size}; construct the wrapper with larger buffers")
        cu = _cuda.driver()
        _cuda.ensure_context(self.dev)
        self._wait()
        if self.host:
            _cuda.check(cu.cuMemFreeHost(self.host), "cuMemFreeHost")
            _cuda.mem_free(self.device)
        size = max(nbytes, 2 * self.size, 4096)
        self.host = int(_cuda.check(cu.cuMemHostAlloc(size, 0), "cuMemHostAlloc"))
        self.device = _cuda.mem_alloc(size)
        self.size, self.fixed = size, fixed
        self.host_view = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(self.host))

    def _wait(self):
        if self.event is not None:
            _cuda.check(_cuda.driver().cuEventSynchronize(self.event), "cuEventSynchronize")

    def upload(self, arrays: dict, stream: int, layout: dict | None = None) -> dict:
        """Copy int32 arrays to the device in one async copy; returns name -> device address."""
        if layout is None:
            layout, off = {}, 0
            for name, a in arrays.items():
                layout[name] = off
                off += (a.size * 4 + 15) // 16 * 16
            total = off
        else:
            total = layout["__end__"]
        self.reserve(total)
        self._wait()
        host = self.host_view
        for name, a in arrays.items():
            off = layout[name]
            host[off:off + a.size * 4] = a.view(np.uint8) if a.dtype == np.int32 else a.astype(np.int32).view(np.uint8)
        cu = _cuda.driver()
        if total:
            _cuda.check(cu.cuMemcpyHtoDAsync(self.device, self.host, total, stream), "cuMemcpyHtoDAsync")
        if self.event is None:
            self.event = _cuda.check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        _cuda.check(cu.cuEventRecord(self.event, stream), "cuEventRecord")
        return {name: self.device + layout[name] for name in arrays}


class _BatchPrefillBase:
    _paged: bool

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False):
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)
        self._set_workspace(float_workspace_buffer)
        self._staging = _Staging(self._dev)
        self._planned = False
        self._capacity = None

    # ---- workspace ---------------------------------------------------------------------
    @staticmethod
    def _workspace_view(buf):
        v = _tensor.view(buf, "float_workspace_buffer")
        if not v.is_cuda:
            raise ValueError("float_workspace_buffer must be a CUDA tensor")
        if v.ndim != 1 or (v.shape[0] > 1 and v.strides[0] != 1):
            raise ValueError(f"float_workspace_buffer must be a contiguous 1-D tensor, got shape {v.shape}")
        if v.ptr % 16:
            raise ValueError("float_workspace_buffer must be 16-byte aligned")
        return v, v.shape[0] * max(v.dtype.bits // 8, 1)

    def _set_workspace(self, buf):
        v, nbytes = self._workspace_view(buf)
        self._ws_buf = buf  # keep the caller's tensor alive with the wrapper
        self._ws_ptr, self._ws_bytes, self._dev = v.ptr, nbytes, v.device_id

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer=None):
        """Swap the float workspace (int metadata lives in the wrapper's own buffers; the
        int_workspace_buffer argument is accepted for FlashInfer compatibility). A buffer that is
        refused leaves the wrapper with its old one."""
        v, nbytes = self._workspace_view(float_workspace_buffer)
        if v.device_id != self._dev:
            raise ValueError("float_workspace_buffer must stay on the wrapper's device")
        if self._planned and self._ws_need > nbytes:
            raise ValueError(f"float_workspace_buffer holds {nbytes} bytes; the current plan needs {self._ws_need}")
        self._set_workspace(float_workspace_buffer)
        if self._planned:
            self._point_workspace()

    def workspace_size(self) -> int:
        """Exact float-workspace bytes the current plan uses (0 when no request is split)."""
        if not self._planned:
            raise RuntimeError("call plan() first")
        return self._ws_need

    # ---- plan --------------------------------------------------------------------------
    def _plan_common(self, qo_indptr, kv_lens, kv_arrays: dict, num_qo_heads, num_kv_heads, head_dim,
                     custom_mask, packed_custom_mask, causal, pos_encoding_mode, allow_fp16_qk_reduction,
                     sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta, q_data_type, kv_data_type,
                     fixed_split_size, disable_split_kv, page_size, lse_base, stream):
        opts = _options.resolve(pos_encoding_mode, allow_fp16_qk_reduction, logits_soft_cap, rope_scale,
                                rope_theta, lse_base)
        for name, val in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(val, (int, np.integer)) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim {head_dim} is not supported (supported: {HEAD_DIMS})")
        qdt = _dtypes.normalize(q_data_type)
        if qdt not in (_dtypes.FLOAT16, _dtypes.BFLOAT16):
            raise TypeError(f"q_data_type must be float16 or bfloat16, got {qdt.name}")
        kdt = qdt if kv_data_type is None else _dtypes.normalize(kv_data_type)
        if kdt != qdt:
            raise NotImplementedError(f"kv_data_type {kdt.name} with q_data_type {qdt.name}: only equal 16-bit "
                                      "types are implemented (fp8 KV is not yet)")
        window_left = _options.window(window_left)
        sm_scale = _options.softmax_scale(sm_scale, head_dim)
        B = qo_indptr.size - 1
        qo_lens = np.diff(qo_indptr)
        has_mask = custom_mask is not None or packed_custom_mask is not None
        if has_mask and self._use_cuda_graph:
            raise NotImplementedError("custom masks with use_cuda_graph=True are not implemented yet")
        group = num_qo_heads // num_kv_heads
        mask_bytes_indptr = None
        if has_mask:
            # FlashInfer's layout: request b's [qo_len, kv_len] boolean matrix, row-major, packed
            # little-endian into its own byte-aligned segment; a custom mask replaces causal.
            bits = qo_lens.astype(np.int64) * np.asarray(kv_lens, np.int64)
            mask_bytes_indptr = np.concatenate([[0], np.cumsum((bits + 7) // 8)]).astype(np.int64)
            if mask_bytes_indptr[-1] > np.iinfo(np.int32).max:
                raise ValueError("the packed custom mask exceeds 2 GiB (int32 byte offsets)")
            mask_buf = self._prepare_mask(custom_mask, packed_custom_mask, bits, mask_bytes_indptr)
            causal = False
        else:
            mask_buf = None

        _cuda.ensure_context(self._dev)
        general = opts.general or has_mask
        la = self._launcher("prefill", dtype=qdt.short, head_dim=head_dim, general=general, paged=self._paged)
        meta = la.meta
        cap = None
        if self._use_cuda_graph:
            cap = self._graph_capacity(B, int(qo_indptr[-1]))
        plan = _plan.plan_prefill(qo_indptr, kv_lens, group_size=group, num_kv_heads=num_kv_heads,
                                  block_m=meta["block_m"], block_n=meta["block_n"],
                                  num_sms=_cuda.properties(self._dev)["sm_count"],
                                  ctas_per_sm=2 if meta["threads"] <= 128 else 1, causal=bool(causal),
                                  window_left=window_left, fixed_split_size=fixed_split_size,
                                  disable_split_kv=disable_split_kv, graph_capacity=cap)
        # Graph mode keeps the partial-LSE offset fixed across plans (max_partial_rows bound).
        ws_rows = plan.max_partial_rows if cap else plan.num_partial_rows
        lse_off, need = plan.workspace_layout(num_qo_heads, head_dim, ws_rows)
        if need > self._ws_bytes:  # checked before any state changes: a refused plan leaves no trace
            raise ValueError(f"float_workspace_buffer holds {self._ws_bytes} bytes but this plan needs "
                             f"{need}; pass a larger buffer (or disable_split_kv=True)")
        self._ws_rows, self._ws_lse_off, self._ws_need = ws_rows, lse_off, need

        arrays = dict(plan.int_arrays())
        arrays["qo_indptr"] = qo_indptr
        arrays.update(kv_arrays)
        arrays["chunk_size"] = np.asarray([plan.kv_chunk_size], np.int32)
        if mask_bytes_indptr is not None:
            arrays["mask_indptr"] = mask_bytes_indptr.astype(np.int32)
        if cap:
            # Rows past this plan's tokens must merge nothing (the merge grid covers the capacity).
            mi = arrays["merge_indptr"]
            arrays["merge_indptr"] = np.concatenate([mi, np.full(cap["max_total_q"] + 1 - mi.size, mi[-1], np.int32)])
        s = _plan_stream(stream, self._dev)
        ptrs = self._staging.upload(arrays, s, self._graph_layout(arrays, cap) if cap else None)
        self._plan_stream, self._pending_copy = s, True

        p = la.params
        p.work_request, p.work_qtile, p.work_chunk = ptrs["work_request"], ptrs["work_qtile"], ptrs["work_chunk"]
        p.num_chunks, p.o_indptr = ptrs["num_chunks"], ptrs["o_indptr"]
        p.qo_indptr, p.kv_indptr = ptrs["qo_indptr"], ptrs["kv_indptr"]
        p.kv_page_indices = ptrs.get("kv_page_indices", 0)
        p.kv_last_page_len = ptrs.get("kv_last_page_len", 0)
        p.kv_chunk_size_dev = ptrs["chunk_size"]
        p.mask_indptr = ptrs.get("mask_indptr", 0)
        self._mask_buf = mask_buf  # the packed mask lives as long as the plan that points at it
        p.custom_mask = mask_buf[1] if mask_buf is not None else 0
        p.kv_chunk_size = plan.kv_chunk_size
        p.num_qo_heads, p.num_kv_heads, p.group_size = num_qo_heads, num_kv_heads, group
        p.causal, p.window_left, p.sm_scale_log2 = int(bool(causal)), window_left, sm_scale * LOG2E
        p.lse_scale, p.logits_soft_cap, p.v_scale = opts.lse_scale, opts.soft_cap, 1.0
        p.rope = int(opts.pos == "ROPE_LLAMA")
        p.rope_rcp_scale, p.rope_log2_theta = 1.0 / opts.rope_scale, math.log2(opts.rope_theta)
        p.alibi_slopes = _alibi_buffer(self._dev, num_qo_heads) if opts.pos == "ALIBI" else 0
        p.page_size = page_size
        p.page_shift = int(math.log2(page_size)) if page_size & (page_size - 1) == 0 else -1
        la.configure((num_kv_heads, 1, plan.grid))
        self._attn = la
        self._merge = None
        total_q = int(qo_indptr[-1])
        if plan.split or cap:  # a captured graph always holds the merge (a no-op for unsplit rows)
            mg = self._launcher("merge", dtype=qdt.short)
            mp = mg.params
            rows = cap["max_total_q"] if cap else total_q
            mp.merge_indptr = ptrs["merge_indptr"]
            mp.rows, mp.num_heads, mp.head_dim, mp.num_splits = rows, num_qo_heads, head_dim, 0
            mp.lse_scale = opts.lse_scale
            mg.configure((max(1, -(-rows * num_qo_heads // _MERGE_ROWS_PER_BLOCK)), 1, 1))
            self._merge = mg
        self._plan = plan
        self._opts = opts
        self._dtype = qdt
        self._shape = (total_q, num_qo_heads, num_kv_heads, head_dim)
        self._point_workspace()
        self._planned = True
        if cap is not None:
            self._capacity = cap
        self._fast_key = None  # run()'s validated-signature cache belongs to one plan
        return plan

    def _prepare_mask(self, custom_mask, packed_custom_mask, bits, byte_indptr):
        """(tensor kept alive, device address) of the packed per-request mask segments.

        packed_custom_mask (uint8, already segment-packed little-endian, FlashInfer's
        segment_packbits layout) is used in place; a flat boolean custom_mask (the requests'
        [qo_len, kv_len] matrices concatenated) is packed on the device here, once per plan."""
        from . import quantization
        if packed_custom_mask is not None:
            v = _tensor.view(packed_custom_mask, "packed_custom_mask")
            if not v.is_cuda or v.device_id != self._dev:
                raise ValueError(f"packed_custom_mask must be a CUDA tensor on cuda:{self._dev}")
            if v.dtype != _dtypes.UINT8:
                raise TypeError(f"packed_custom_mask must be uint8, got {v.dtype.name}")
            if v.ndim != 1 or (v.shape[0] > 1 and v.strides[0] != 1):
                raise ValueError(f"packed_custom_mask must be a contiguous 1-D tensor, got shape {v.shape}")
            if v.shape[0] < byte_indptr[-1]:
                raise ValueError(f"packed_custom_mask has {v.shape[0]} bytes; the requests' masks need "
                                 f"{int(byte_indptr[-1])} (segments of ceil(qo_len * kv_len / 8) bytes)")
            return packed_custom_mask, v.ptr
        v = _tensor.view(custom_mask, "custom_mask")
        if not v.is_cuda or v.device_id != self._dev:
            raise ValueError(f"custom_mask must be a CUDA tensor on cuda:{self._dev}")
        if v.dtype not in (_dtypes.BOOL, _dtypes.UINT8):
            raise TypeError(f"custom_mask must be bool (or uint8), got {v.dtype.name}")
        total = int(bits.sum())
        if v.ndim != 1 or v.shape[0] != total:
            raise ValueError(f"custom_mask must be 1-D with sum(qo_len * kv_len) = {total} entries, got shape {v.shape}")
        seg = np.concatenate([[0], np.cumsum(bits)]).astype(np.int64)
        packed, _ = quantization.segment_packbits(custom_mask, seg, bitorder="little")
        return packed, _tensor.view(packed, "packed").ptr

    def _launcher(self, family, **match):
        """The wrapper's own Launcher per kernel, reused across plans (creating one costs ~10 us)."""
        cache = self.__dict__.setdefault("_launchers", {})
        key = (family, tuple(sorted(match.items())))
        la = cache.get(key)
        if la is None:
            la = cache[key] = _registry.new_launcher(family, self._dev, **match)
        return la

    def _point_workspace(self):
        p = self._attn.params
        p.o_partial, p.lse_partial = self._ws_ptr, self._ws_ptr + self._ws_lse_off
        if self._merge is not None:
            mp = self._merge.params
            mp.o_partial, mp.lse_partial = p.o_partial, p.lse_partial

    _pending_copy = False

    def _graph_capacity(self, B, total_q):
        # The first plan that succeeds fixes the token capacity; a rejected plan leaves no trace
        # (the dict is only stored on self at the end of a successful plan()).
        cap = self._capacity
        if cap is None:
            cap = {"max_batch": self._max_batch, "max_total_q": max(total_q, self._max_total_q_hint()),
                   "max_work": None}
        if B > cap["max_batch"]:
            raise ValueError(f"batch size {B} exceeds the CUDA-graph capacity {cap['max_batch']} "
                             "(the length of qo_indptr_buf - 1)")
        if total_q > cap["max_total_q"]:
            raise ValueError(f"{total_q} query tokens exceed the CUDA-graph capacity {cap['max_total_q']} "
                             "fixed by the first plan()")
        return cap

    def _max_total_q_hint(self):
        return 0

    def _graph_layout(self, arrays, cap):
        """Fixed offsets for CUDA-graph mode: every array gets its capacity's room, so device
        addresses never change between plans."""
        if "layout" not in cap:
            sizes = {name: a.size for name, a in arrays.items()}
            # Room for the largest arrays a plan within capacity can produce.
            B, TQ = cap["max_batch"], cap["max_total_q"]
            bound = {"qo_indptr": B + 1, "kv_indptr": B + 1, "kv_last_page_len": B, "num_chunks": B,
                     "o_indptr": B + 1, "merge_indptr": TQ + 1, "chunk_size": 1,
                     "kv_page_indices": self._max_pages}
            layout, off = {}, 0
            for name, n in sizes.items():
                room = max(n, bound.get(name, n))
                layout[name] = off
                off += (room * 4 + 15) // 16 * 16
            layout["__end__"] = off
            cap["layout"] = layout
            cap["sizes"] = {name: max(n, bound.get(name, n)) for name, n in sizes.items()}
            self._staging.reserve(off, fixed=True)
        for name, a in arrays.items():
            if a.size > cap["sizes"][name]:
                raise ValueError(f"{name} has {a.size} entries, more than the CUDA-graph buffers hold "
                                 f"({cap['sizes'][name]})")
        return cap["layout"]

    # ---- run ---------------------------------------------------------------------------
    def _check_q(self, q, out, lse, return_lse, stream):
        if not self._planned:
            raise RuntimeError("call plan() before run()")
        qv = _tensor.view(q, "q")
        total_q, Hq, Hkv, D = self._shape
        if qv.shape != (total_q, Hq, D):
            raise ValueError(f"q must have shape {(total_q, Hq, D)} (qo_indptr[-1], num_qo_heads, head_dim) "
                             f"as planned, got {qv.shape}")
        if qv.dtype != self._dtype:
            raise ValueError(f"q has dtype {qv.dtype.name} but plan() was told q_data_type={self._dtype.name}")
        if not qv.is_cuda or qv.device_id != self._dev:
            raise ValueError(f"q must be a CUDA tensor on cuda:{self._dev}")
        if qv.strides[2] != 1 or qv.ptr % 16 or qv.strides[0] % 8 or qv.strides[1] % 8:
            raise ValueError(f"q must have a contiguous last dim and 16-byte aligned rows, got strides {qv.strides}")
        fw = _tensor.framework_of(q)
        s = _tensor.stream_handle(stream) if stream is not None else _tensor.current_stream(fw, self._dev)
        if out is None:
            out, ov = _tensor.empty(qv, (total_q, Hq, D), self._dtype, s)
        else:
            ov = _tensor.view(out, "out")
            if ov.shape != (total_q, Hq, D) or ov.dtype != self._dtype or ov.device_id != self._dev:
                raise ValueError(f"out must be {self._dtype.name} {(total_q, Hq, D)} on cuda:{self._dev}, got "
                                 f"{ov.dtype.name} {ov.shape}")
            if ov.strides[2] != 1 or ov.ptr % 16 or ov.strides[0] % 8 or ov.strides[1] % 8:
                raise ValueError(f"out must have a contiguous last dim and 16-byte aligned rows, got {ov.strides}")
        lv = None
        if lse is not None:
            lv = _tensor.view(lse, "lse")
            if lv.shape != (total_q, Hq) or lv.dtype != _dtypes.FLOAT32 or lv.device_id != self._dev:
                raise ValueError(f"lse must be float32 {(total_q, Hq)} on cuda:{self._dev}")
            if total_q * Hq > 1 and lv.strides != (Hq, 1):
                raise ValueError("lse must be contiguous")
        elif return_lse:
            lse, lv = _tensor.empty(qv, (total_q, Hq), _dtypes.FLOAT32, s)
        return qv, out, ov, lse, lv, s

    def _launch(self, qv, ov, lv, s):
        if self._pending_copy:
            # The plan's metadata copy went on the plan's stream; order this stream after it once.
            _cuda.stream_wait(s, self._plan_stream)
            self._pending_copy = False
        p = self._attn.params
        p.q, p.o = qv.ptr, ov.ptr
        p.q_stride_n, p.q_stride_h = qv.strides[0], qv.strides[1]
        p.o_stride_n, p.o_stride_h = ov.strides[0], ov.strides[1]
        p.lse = lv.ptr if lv is not None else 0
        if self._shape[0] == 0:
            return
        self._attn(s)
        if self._merge is not None:
            mp = self._merge.params
            mp.o, mp.lse = ov.ptr, (lv.ptr if lv is not None else 0)
            mp.o_stride_n, mp.o_stride_h = ov.strides[0], ov.strides[1]
            self._merge(s)

    # ---- torch fast path: a run() whose tensors have the signature of the last validated run
    # skips every view and check; only pointers are re-read (~half the host time) ----
    _fast_key = None
    _kv_ptr_offsets = None

    @staticmethod
    def _sig(t):
        return None if t is None else (t.shape, t.stride(), t.dtype, t.get_device())

    def _key(self, q, kv_parts, out, lse, return_lse):
        if _tensor.framework_of(q) != "torch":
            return None
        try:
            return (self._sig(q), tuple(self._sig(t) for t in kv_parts), self._sig(out), self._sig(lse),
                    bool(return_lse))
        except Exception:  # noqa: BLE001 - not a plain strided torch tensor
            return None

    def _remember(self, q, kv_parts, out, lse, return_lse):
        # `out`/`lse` here are what the caller passed (None when we allocated).
        self._fast_key = self._key(q, kv_parts, self._caller_out, self._caller_lse, return_lse)

    def _torch_fast(self, q, kv_parts, out, lse, return_lse, stream):
        self._caller_out, self._caller_lse = out, lse
        if self._fast_key is None or self._key(q, kv_parts, out, lse, return_lse) != self._fast_key:
            return None
        qp = q.data_ptr()
        kp = kv_parts[0].data_ptr()
        if self._kv_ptr_offsets is not None:
            vp = kp + self._kv_ptr_offsets[1]
        else:
            vp = kv_parts[1].data_ptr()
        op = out.data_ptr() if out is not None else 0
        if (qp | kp | vp | op) & 15:
            return None  # the full path raises the precise error
        s = _tensor.stream_handle(stream) if stream is not None else _tensor.current_stream("torch", self._dev)
        total_q, Hq = self._shape[0], self._shape[1]
        if out is None:
            out = q.new_empty((total_q, Hq, self._shape[3]))
            op = out.data_ptr()
        if lse is None and return_lse:
            lse = q.new_empty((total_q, Hq), dtype=_tensor.torch_float32())
        p = self._attn.params
        p.q, p.k, p.v, p.o = qp, kp, vp, op
        p.lse = lse.data_ptr() if lse is not None else 0
        if self._pending_copy:
            _cuda.stream_wait(s, self._plan_stream)
            self._pending_copy = False
        if total_q:
            self._attn(s)
            if self._merge is not None:
                mp = self._merge.params
                mp.o, mp.lse = op, p.lse
                self._merge(s)
        if lse is None:
            return out
        return (out, lse) if return_lse else out

    @staticmethod
    def _finish(out, lse, return_lse):
        out = _tensor.finalize(out)
        if lse is None:
            return out
        lse = _tensor.finalize(lse)
        return (out, lse) if return_lse else out

    def run_return_lse(self, *args, **kwargs):
        kwargs["return_lse"] = True
        return self.run(*args, **kwargs)

    begin_forward = None  # set per class to plan (FlashInfer's old name)


def _plan_stream(stream, dev):
    """plan()'s copy stream: stream= if given, else torch's / CuPy's current stream when that
    framework is loaded (what run() will use by default), else the library stream."""
    if stream is not None:
        return _tensor.stream_handle(stream)
    import sys
    for fw in ("torch", "cupy"):
        if fw in sys.modules:
            try:
                return _tensor.current_stream(fw, dev)
            except Exception:  # noqa: BLE001 - framework without CUDA: fall through
                pass
    return _cuda.library_stream(dev)


def _check_pdl(enable_pdl):
    if enable_pdl:
        raise NotImplementedError("enable_pdl=True: programmatic dependent launch is not implemented yet")


def _check_mask_bufs(custom_mask_buf, qk_indptr_buf):
    if custom_mask_buf is not None or qk_indptr_buf is not None:
        raise NotImplementedError("custom_mask_buf / qk_indptr_buf (custom masks under CUDA graphs) are not "
                                  "implemented yet")


def _kv_operand(t, name, dtype, dev):
    if not t.is_cuda or t.device_id != dev:
        raise ValueError(f"{name} must be a CUDA tensor on cuda:{dev}")
    if t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype.name} but the plan expects {dtype.name}")
    if t.strides[-1] != 1 or t.ptr % 16 or any(st % 8 for st in t.strides[:-1]):
        raise ValueError(f"{name} must have a contiguous last dim and 16-byte aligned rows, got strides {t.strides}")


class BatchPrefillWithPagedKVCacheWrapper(_BatchPrefillBase):
    """Prefill/append attention over a paged KV cache for a batch of requests (FlashInfer's API).

    paged_kv_cache: one tensor [num_pages, 2, page_size, Hkv, D] (NHD) or
    [num_pages, 2, Hkv, page_size, D] (HND), or a tuple (k_cache, v_cache) of
    [num_pages, page_size, Hkv, D] / [num_pages, Hkv, page_size, D]; any strides with a
    contiguous last dim. Request b owns pages kv_indices[kv_indptr[b]:kv_indptr[b+1]], its last
    page holding kv_last_page_len[b] tokens (1..page_size); a request with no pages has kv_len 0.

    plan(non_blocking=...) is accepted for FlashInfer compatibility: the metadata copy is always
    asynchronous on the stream and ordered before run(), so the flag has nothing to change.

    use_cuda_graph=True: the buffers passed here (qo_indptr_buf, paged_kv_indptr_buf,
    paged_kv_indices_buf, paged_kv_last_page_len_buf) fix the capacity (batch size, pages);
    plan() runs outside capture and later plans may change lengths within that capacity, while
    the captured run() stays valid (fixed grid with padding items, metadata at fixed addresses).
    """

    _paged = True

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, qk_indptr_buf=None, backend: str = "auto"):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph)
        _check_mask_bufs(custom_mask_buf, qk_indptr_buf)
        if backend not in ("auto", "fa2"):
            raise ValueError(f"backend must be 'auto' or 'fa2', got {backend!r}")
        if use_cuda_graph:
            for name, buf in (("qo_indptr_buf", qo_indptr_buf), ("paged_kv_indptr_buf", paged_kv_indptr_buf),
                              ("paged_kv_indices_buf", paged_kv_indices_buf),
                              ("paged_kv_last_page_len_buf", paged_kv_last_page_len_buf)):
                if buf is None:
                    raise ValueError(f"use_cuda_graph=True needs {name} (it fixes the capacity)")
            self._max_batch = _tensor.view(qo_indptr_buf, "qo_indptr_buf").shape[0] - 1
            self._max_pages = _tensor.view(paged_kv_indices_buf, "paged_kv_indices_buf").shape[0]
            self._bufs = (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, custom_mask=None, packed_custom_mask=None,
             causal: bool = False, pos_encoding_mode: str = "NONE", allow_fp16_qk_reduction: bool = False,
             sm_scale=None, window_left: int = -1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
             q_data_type="float16", kv_data_type=None, non_blocking: bool = True, *, fixed_split_size=None,
             disable_split_kv: bool = False, lse_base: str = "log2", stream=None):
        qo = _host_int(qo_indptr, "qo_indptr")
        ind = _host_int(paged_kv_indptr, "paged_kv_indptr")
        idx = _host_int(paged_kv_indices, "paged_kv_indices")
        last = _host_int(paged_kv_last_page_len, "paged_kv_last_page_len")
        if not isinstance(page_size, (int, np.integer)) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        B = qo.size - 1
        if B < 0 or ind.size != B + 1 or last.size != B:
            raise ValueError(f"qo_indptr ({qo.size}), paged_kv_indptr ({ind.size}) and paged_kv_last_page_len "
                             f"({last.size}) must describe the same batch (B+1, B+1, B)")
        if (qo[0] != 0 if qo.size else True) or np.any(np.diff(qo) < 0):
            raise ValueError("qo_indptr must start at 0 and be non-decreasing")
        if ind[0] != 0 or np.any(np.diff(ind) < 0):
            raise ValueError("paged_kv_indptr must start at 0 and be non-decreasing")
        if ind[-1] > idx.size:
            raise ValueError(f"paged_kv_indptr[-1] = {ind[-1]} exceeds len(paged_kv_indices) = {idx.size}")
        pages = np.diff(ind)
        has = pages > 0
        if np.any((last[has] < 1) | (last[has] > page_size)):
            raise ValueError(f"paged_kv_last_page_len must be in [1, page_size={page_size}] for requests with pages")
        if idx[:ind[-1]].size and idx[:ind[-1]].min() < 0:
            raise ValueError("paged_kv_indices must be >= 0")
        if self._use_cuda_graph and ind[-1] > self._max_pages:
            raise ValueError(f"the plan uses {ind[-1]} pages but paged_kv_indices_buf holds {self._max_pages} "
                             "(the CUDA-graph capacity)")
        kv_lens = np.where(has, (pages - 1) * page_size + np.where(has, last, 0), 0).astype(np.int64)
        self._max_page = int(idx[:ind[-1]].max()) if ind[-1] else -1
        self._page_size = int(page_size)
        return self._plan_common(qo, kv_lens, {"kv_indptr": ind, "kv_page_indices": idx[:max(ind[-1], 1)],
                                               "kv_last_page_len": last},
                                 num_qo_heads, num_kv_heads, head_dim, custom_mask, packed_custom_mask, causal,
                                 pos_encoding_mode, allow_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap,
                                 rope_scale, rope_theta, q_data_type, kv_data_type, fixed_split_size,
                                 disable_split_kv, int(page_size), lse_base, stream)

    begin_forward = plan

    def run(self, q, paged_kv_cache, *args, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse: bool = False, stream=None, enable_pdl=None):
        if args:
            raise TypeError("run() takes q and paged_kv_cache positionally; pass the rest by keyword")
        if k_scale not in (None, 1.0) or v_scale not in (None, 1.0):
            raise NotImplementedError("k_scale / v_scale apply to fp8 KV caches, which are not implemented yet")
        _check_pdl(enable_pdl)
        kv_parts = tuple(paged_kv_cache) if isinstance(paged_kv_cache, (tuple, list)) else (paged_kv_cache,)
        fast = self._torch_fast(q, kv_parts, out, lse, return_lse, stream)
        if fast is not None:
            return fast
        qv, out, ov, lse, lv, s = self._check_q(q, out, lse, return_lse, stream)
        _, Hq, Hkv, D = self._shape
        ps = self._page_size
        if isinstance(paged_kv_cache, (tuple, list)):
            if len(paged_kv_cache) != 2:
                raise ValueError("paged_kv_cache tuple must be (k_cache, v_cache)")
            kc, vc = (_tensor.view(t, n) for t, n in zip(paged_kv_cache, ("k_cache", "v_cache")))
            want = (kc.shape[0], ps, Hkv, D) if self._kv_layout == "NHD" else (kc.shape[0], Hkv, ps, D)
            for t, n in ((kc, "k_cache"), (vc, "v_cache")):
                if t.ndim != 4 or t.shape != want:
                    raise ValueError(f"{n} must have shape {want} ({self._kv_layout}), got {t.shape}")
                _kv_operand(t, n, self._dtype, self._dev)
            k_ptr, v_ptr, ks, vs = kc.ptr, vc.ptr, kc.strides, vc.strides
            num_pages = kc.shape[0]
        else:
            c = _tensor.view(paged_kv_cache, "paged_kv_cache")
            want = (c.shape[0], 2, ps, Hkv, D) if self._kv_layout == "NHD" else (c.shape[0], 2, Hkv, ps, D)
            if c.ndim != 5 or c.shape != want:
                raise ValueError(f"paged_kv_cache must have shape {want} ({self._kv_layout}), got {c.shape}")
            _kv_operand(c, "paged_kv_cache", self._dtype, self._dev)
            item = c.dtype.bits // 8
            k_ptr, v_ptr = c.ptr, c.ptr + c.strides[1] * item
            ks = vs = (c.strides[0],) + c.strides[2:]
            num_pages = c.shape[0]
        if self._max_page >= num_pages:
            raise ValueError(f"paged_kv_indices refers to page {self._max_page} but paged_kv_cache has {num_pages} pages")
        self._kv_ptr_offsets = (0, v_ptr - k_ptr) if len(kv_parts) == 1 else None
        p = self._attn.params
        p.k, p.v = k_ptr, v_ptr
        if self._kv_layout == "NHD":
            p.k_stride_page, p.k_stride_n, p.k_stride_h = ks[0], ks[1], ks[2]
            p.v_stride_page, p.v_stride_n, p.v_stride_h = vs[0], vs[1], vs[2]
        else:
            p.k_stride_page, p.k_stride_h, p.k_stride_n = ks[0], ks[1], ks[2]
            p.v_stride_page, p.v_stride_h, p.v_stride_n = vs[0], vs[1], vs[2]
        self._launch(qv, ov, lv, s)
        self._remember(q, kv_parts, out, lse, return_lse)
        return self._finish(out, lse, return_lse)


class BatchPrefillWithRaggedKVCacheWrapper(_BatchPrefillBase):
    """Prefill attention over ragged (packed) K/V for a batch of requests (FlashInfer's API).

    k, v: [kv_indptr[-1], Hkv, D] (NHD) or [Hkv, kv_indptr[-1], D] (HND); request b owns key rows
    kv_indptr[b]:kv_indptr[b+1]. use_cuda_graph=True: qo_indptr_buf and kv_indptr_buf fix the
    batch capacity.
    """

    _paged = False
    _max_pages = 0

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, kv_indptr_buf=None, custom_mask_buf=None, qk_indptr_buf=None,
                 backend: str = "auto"):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph)
        _check_mask_bufs(custom_mask_buf, qk_indptr_buf)
        if backend not in ("auto", "fa2"):
            raise ValueError(f"backend must be 'auto' or 'fa2', got {backend!r}")
        if use_cuda_graph:
            for name, buf in (("qo_indptr_buf", qo_indptr_buf), ("kv_indptr_buf", kv_indptr_buf)):
                if buf is None:
                    raise ValueError(f"use_cuda_graph=True needs {name} (it fixes the capacity)")
            self._max_batch = _tensor.view(qo_indptr_buf, "qo_indptr_buf").shape[0] - 1
            self._bufs = (qo_indptr_buf, kv_indptr_buf)

    def plan(self, qo_indptr, kv_indptr, num_qo_heads: int, num_kv_heads: int, head_dim: int, custom_mask=None,
             packed_custom_mask=None, causal: bool = False, pos_encoding_mode: str = "NONE",
             allow_fp16_qk_reduction: bool = False, window_left: int = -1, logits_soft_cap=None, sm_scale=None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None, *, fixed_split_size=None,
             disable_split_kv: bool = False, lse_base: str = "log2", stream=None):
        qo = _host_int(qo_indptr, "qo_indptr")
        kvi = _host_int(kv_indptr, "kv_indptr")
        B = qo.size - 1
        if B < 0 or kvi.size != B + 1:
            raise ValueError(f"qo_indptr ({qo.size}) and kv_indptr ({kvi.size}) must both have B+1 entries")
        if qo[0] != 0 or np.any(np.diff(qo) < 0):
            raise ValueError("qo_indptr must start at 0 and be non-decreasing")
        if kvi[0] != 0 or np.any(np.diff(kvi) < 0):
            raise ValueError("kv_indptr must start at 0 and be non-decreasing")
        self._total_kv = int(kvi[-1])
        return self._plan_common(qo, np.diff(kvi).astype(np.int64), {"kv_indptr": kvi}, num_qo_heads, num_kv_heads,
                                 head_dim, custom_mask, packed_custom_mask, causal, pos_encoding_mode,
                                 allow_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale,
                                 rope_theta, q_data_type, kv_data_type, fixed_split_size, disable_split_kv, 1,
                                 lse_base, stream)

    begin_forward = plan

    def run(self, q, k, v, *args, k_scale=None, v_scale=None, out=None, lse=None, return_lse: bool = False,
            stream=None, enable_pdl=None):
        if args:
            raise TypeError("run() takes q, k, v positionally; pass the rest by keyword")
        if k_scale not in (None, 1.0) or v_scale not in (None, 1.0):
            raise NotImplementedError("k_scale / v_scale apply to fp8 KV, which is not implemented yet")
        _check_pdl(enable_pdl)
        fast = self._torch_fast(q, (k, v), out, lse, return_lse, stream)
        if fast is not None:
            return fast
        qv, out, ov, lse, lv, s = self._check_q(q, out, lse, return_lse, stream)
        _, Hq, Hkv, D = self._shape
        kv, vv = _tensor.view(k, "k"), _tensor.view(v, "v")
        want = (self._total_kv, Hkv, D) if self._kv_layout == "NHD" else (Hkv, self._total_kv, D)
        for t, n in ((kv, "k"), (vv, "v")):
            if t.shape != want:
                raise ValueError(f"{n} must have shape {want} (kv_indptr[-1], num_kv_heads, head_dim in "
                                 f"{self._kv_layout}), got {t.shape}")
            _kv_operand(t, n, self._dtype, self._dev)
        p = self._attn.params
        p.k, p.v = kv.ptr, vv.ptr
        if self._kv_layout == "NHD":
            p.k_stride_n, p.k_stride_h, p.v_stride_n, p.v_stride_h = kv.strides[0], kv.strides[1], vv.strides[0], vv.strides[1]
        else:
            p.k_stride_n, p.k_stride_h, p.v_stride_n, p.v_stride_h = kv.strides[1], kv.strides[0], vv.strides[1], vv.strides[0]
        self._kv_ptr_offsets = None
        self._launch(qv, ov, lv, s)
        self._remember(q, (k, v), out, lse, return_lse)
        return self._finish(out, lse, return_lse)
