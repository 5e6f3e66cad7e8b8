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

K/V may be fp8 (kv_data_type float8_e4m3fn / float8_e5m2 with fp16/bf16 queries): the kernels
widen it to q's dtype in shared memory. run()'s k_scale / v_scale apply to every KV dtype, in
the kernel: logits use sm_scale * k_scale (so the LSE includes k_scale, as FlashInfer's folded
sm_scale does), the output is multiplied by v_scale.
"""
from __future__ import annotations

import ctypes
import math
import sys

import numpy as np

from ._runtime import cuda as _cuda, dtypes as _dtypes, registry as _registry, tensor as _tensor
from . import _options, _plan
from .prefill import (HEAD_DIMS, LOG2E, _MERGE_ROWS_PER_BLOCK, _alibi_buffer, _decode_ctas_per_sm, decode_tile_rows,
                      decode_tiles)

_I32_MAX = 2**31 - 1
# numpy's descriptors: `is` tests them, and numpy takes them faster than the scalar types
_INT32, _INT64, _UINT32 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.uint32)
_PLAIN = frozenset((type(None), bool, int, float))  # immutable option types plan() may cache by value
_MASK_MIN_BYTES = 64 << 10  # smallest library-owned packed-mask buffer
_PACK_THREADS, _PACK_MAX_SEGMENTS = 256, 65535  # the packbits kernel: bytes per CTA, grid.y limit


def _host_int(x, name):
    """A host int32 numpy copy of an index array (numpy, list, or a device tensor: a sync)."""
    if x is None:
        raise ValueError(f"{name} is required")
    if type(x) is np.ndarray and x.dtype is _INT32 and x.ndim == 1:
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
            a = _device_to_host(x, v, name)
        else:
            a = np.from_dlpack(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got {a.dtype}")
    if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
        raise ValueError(f"{name} has values outside int32")
    return a.astype(np.int32, copy=False)


def _lengths(indptr):
    """(lengths as int64, their maximum as uint64): a negative length, i.e. an indptr that
    decreases, gives a maximum >= 2**63 (int64: the differences of int32 entries never wrap;
    a conversion first is cheaper than a mixed-type subtraction)."""
    a = indptr.astype(_INT64)
    lens = a[1:] - a[:-1]
    return lens, _plan.unsigned_max(lens)


def _device_to_host(x, v, name):
    """Copy a 1-D device index array to the host, ordered after its producer's pending writes:
    on torch's / CuPy's current stream, or (JAX, others) on the library stream after the DLPack
    handshake; then wait for that stream (this is the one sync a device index array costs)."""
    n = v.shape[0] if v.ndim == 1 else None
    if n is None:
        raise ValueError(f"{name} must be 1-D, got shape {v.shape}")
    if n > 1 and v.strides[0] != 1:
        raise ValueError(f"{name} must be contiguous")
    itemsize = v.dtype.bits // 8
    out = np.empty(n, dtype=np.int32 if itemsize == 4 else np.int64)
    if n:
        dev = v.device_id
        _cuda.ensure_context(dev)
        if v.framework in ("torch", "cupy"):
            s = _tensor.current_stream(v.framework, dev)
        else:
            s = _cuda.library_stream(dev)
            v = _tensor.view(x, name, stream=s)
        cu = _cuda.driver()
        _cuda.check(cu.cuMemcpyDtoHAsync(out.ctypes.data, v.ptr, n * itemsize, s), f"copy {name} to host")
        _cuda.check(cu.cuStreamSynchronize(s), f"cuStreamSynchronize (copy of {name})")
    return out


def _dtype_arg(x, name):
    try:
        return _dtypes.normalize(x)
    except TypeError:
        raise TypeError(f"{name}: unsupported dtype {x!r}") from None


def _plan_dtypes(q_data_type, kv_data_type):
    """(q dtype, K/V dtype, PrefillParams.kv_fp8): q fp16/bf16; K/V in q's dtype or fp8."""
    # DTypes are table singletons: identity tests (the dataclass __eq__ / __hash__ cost ~1 us each)
    qdt = _dtype_arg(q_data_type, "q_data_type")
    if qdt is not _dtypes.FLOAT16 and qdt is not _dtypes.BFLOAT16:
        raise TypeError(f"q_data_type must be float16 or bfloat16, got {qdt.name}")
    kdt = qdt if kv_data_type is None else _dtype_arg(kv_data_type, "kv_data_type")
    fp8 = 1 if kdt is _dtypes.FLOAT8_E4M3 else 2 if kdt is _dtypes.FLOAT8_E5M2 else 0  # PrefillParams.kv_fp8
    if kdt is not qdt and not fp8:
        raise TypeError(f"kv_data_type {kdt.name} with q_data_type {qdt.name}: K/V must be in q's dtype or fp8 "
                        "(float8_e4m3fn, float8_e5m2)")
    return qdt, kdt, fp8


def _scale_arg(x, name) -> float:
    """k_scale / v_scale: None -> 1.0; an int, float or numpy real scalar, finite and > 0."""
    if x is None:
        return 1.0
    if type(x) is not float:
        if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
            raise TypeError(f"{name} must be a number (int, float or numpy real scalar) or None, "
                            f"got {type(x).__name__}")
        x = float(x)
    if not (0.0 < x < math.inf):  # NaN fails too
        raise ValueError(f"{name} must be a finite number > 0, got {x!r}")
    return x


_FP8_DECODE_WAVES = 2  # the split-KV budget of the fp8 decode tiles, in waves of CTAs (see _resolve_config)


class _Staging:
    """The device buffer for all int metadata of a plan, filled by one async copy per plan from
    a small pool of pinned host buffers.

    plan() fills a pinned buffer and issues one cuMemcpyHtoDAsync on the plan stream; the copy's
    event guards that buffer. The next plan takes a pinned buffer whose copy has finished
    (cuEventQuery, no wait) or, while the GPU lags behind the host, adds one to the pool (up to
    MAX_PINNED): plan() never waits for the GPU to drain the stream its copy was queued on. The
    device buffer is one: copies and the runs that read it are ordered on the stream. Without a
    layout the arrays go back to back (the kernels read them as int32, 4-byte alignment is all
    they need); with fixed=True (CUDA graphs) every array has its own fixed room, so the device
    addresses captured launches point at never move.
    """

    MAX_PINNED = 4

    def __init__(self, device_id: int):
        self.dev = device_id
        self.device = 0
        self.size = 0
        self.fixed = False
        self.pinned = []  # [host address, int32 view, event or None]
        self.next = 0

    def reserve(self, nbytes: int, fixed: bool = False):
        if nbytes <= self.size:
            return
        if self.fixed:
            raise ValueError(f"plan needs {nbytes} bytes of int metadata but the CUDA-graph buffers hold "
                             f"{self.size}; construct the wrapper with larger buffers")
        cu = _cuda.driver()
        _cuda.ensure_context(self.dev)
        for host, _, event in self.pinned:  # rare (growth): let pending copies read their bytes first
            if event is not None:
                _cuda.check(cu.cuEventSynchronize(event), "cuEventSynchronize")
                _cuda.check(cu.cuEventDestroy(event), "cuEventDestroy")
            _cuda.check(cu.cuMemFreeHost(host), "cuMemFreeHost")
        self.pinned, self.next = [], 0
        if self.device:
            _cuda.mem_free(self.device)
        size = (max(nbytes, 2 * self.size, 4096) + 15) // 16 * 16
        self.device = _cuda.mem_alloc(size)
        self.size, self.fixed = size, fixed

    def _pinned_buffer(self, cu):
        """A pinned buffer no pending copy reads (see the class docstring); cu = the driver."""
        if self.pinned:
            # The last plan's buffer first: its copy is usually done by now, and its lines may
            # still be in the CPU cache (round-robin over the pool would write a cold buffer).
            entry = self.pinned[self.next - 1]
            event = entry[2]
            if len(self.pinned) > 1 and (event is None
                                         or cu.cuEventQuery(event)[0] == cu.CUresult.CUDA_SUCCESS):
                return entry
            entry = self.pinned[self.next]
            event = entry[2]
            if event is None or cu.cuEventQuery(event)[0] == cu.CUresult.CUDA_SUCCESS:
                self.next = (self.next + 1) % len(self.pinned)
                return entry
            if len(self.pinned) >= self.MAX_PINNED:  # the GPU is MAX_PINNED plans behind: wait
                _cuda.check(cu.cuEventSynchronize(event), "cuEventSynchronize")
                self.next = (self.next + 1) % len(self.pinned)
                return entry
        host = int(_cuda.check(cu.cuMemHostAlloc(self.size, 0), "cuMemHostAlloc"))
        entry = [host, np.ctypeslib.as_array((ctypes.c_int32 * (self.size // 4)).from_address(host)), None]
        self.pinned.insert(self.next, entry)
        self.next = (self.next + 1) % len(self.pinned)
        return entry

    def upload(self, arrays, stream: int, offsets=None, nbytes: int = 0) -> list:
        """Copy int32 arrays (an int stands for a one-element array) to the device in one async
        copy, written straight into a pinned buffer; returns each one's device address.
        offsets: each one's fixed int32 offset and nbytes the bytes to copy (the CUDA-graph
        layout), else back to back (a slice assignment per array: cheaper than one concatenate
        at these sizes)."""
        if offsets is None:
            offsets, n = [], 0
            for a in arrays:
                offsets.append(n)
                n += 1 if type(a) is int else a.size
            nbytes = 4 * n
        if nbytes > self.size:  # (reserve's own test, without a method call per plan)
            self.reserve(nbytes)
        cu = _cuda.driver()
        entry = self._pinned_buffer(cu)
        host32 = entry[1]
        for a, o in zip(arrays, offsets):
            if type(a) is int:
                host32[o] = a
            else:
                host32[o:o + a.size] = a
        # The two driver calls of every plan test their status inline (_cuda.check raises the
        # error; on success it only costs a call and another driver() lookup).
        ok = cu.CUresult.CUDA_SUCCESS
        if nbytes:
            r = cu.cuMemcpyHtoDAsync(self.device, entry[0], nbytes, stream)
            if r[0] != ok:
                _cuda.check(r, "cuMemcpyHtoDAsync")
        if entry[2] is None:
            entry[2] = _cuda.check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        r = cu.cuEventRecord(entry[2], stream)
        if r[0] != ok:
            _cuda.check(r, "cuEventRecord")
        base = self.device
        return [base + 4 * o for o in offsets]


class _MaskPlan:
    """What plan() validated about a custom mask (no driver touched yet) and where it goes."""

    __slots__ = ("kind", "obj", "view", "need", "byte_indptr", "elem_indptr", "seg_bytes", "dst")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


class _BatchPrefillBase:
    _paged: bool

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 custom_mask_buf=None, qk_indptr_buf=None):
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)
        self._set_workspace(float_workspace_buffer)
        # FlashInfer's mask buffers for CUDA graphs: plan() writes the packed mask / its byte
        # offsets there (in any mode, so they are never silently ignored).
        self._mask_user = self._aux_buffer(custom_mask_buf, "custom_mask_buf", _dtypes.UINT8)
        self._qk_user = self._aux_buffer(qk_indptr_buf, "qk_indptr_buf", _dtypes.INT32)
        self._staging = _Staging(self._dev)
        self._planned = False
        self._capacity = None
        self._launchers = {}
        self._configs = {}  # plan() settings -> _resolve_config() (see _plan_common)
        self._mask_dev = self._mask_cap = 0  # library-owned packed-mask buffer
        self._mask_keep = None  # the caller's mask tensor a plan reads (asynchronously) or points at
        self._captured = None  # graph mode: the plan settings a captured run() baked in (sig in _plan_common)
        self._graph_probe = self._use_cuda_graph

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

    def _aux_buffer(self, buf, name, dtype):
        """(tensor, address, elements) of a constructor buffer on the wrapper's device, or None."""
        if buf is None:
            return None
        v = _tensor.view(buf, name)
        if not v.is_cuda or v.device_id != self._dev:
            raise ValueError(f"{name} must be a CUDA tensor on cuda:{self._dev} (the float workspace's device)")
        if v.dtype != dtype:
            raise TypeError(f"{name} must be {dtype.name}, got {v.dtype.name}")
        if v.ndim != 1 or (v.shape[0] > 1 and v.strides[0] != 1):
            raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {v.shape} strides {v.strides}")
        return buf, v.ptr, v.shape[0]

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer=None):
        """Swap the float workspace (int metadata lives in the wrapper's own buffers; the
        int_workspace_buffer argument is accepted for FlashInfer compatibility). A buffer that is
        refused leaves the wrapper with its old one."""
        v, nbytes = self._workspace_view(float_workspace_buffer)
        if v.device_id != self._dev:
            raise ValueError("float_workspace_buffer must stay on the wrapper's device")
        if self._planned and self._ws_need > nbytes:
            raise ValueError(f"float_workspace_buffer holds {nbytes} bytes; the current plan needs {self._ws_need}")
        if self._captured is not None and v.ptr != self._ws_ptr:
            raise ValueError("float_workspace_buffer: run() was captured in a CUDA graph that reads the current "
                             "workspace; it cannot be swapped for another buffer")
        self._set_workspace(float_workspace_buffer)
        if self._planned:
            self._point_workspace()

    def workspace_size(self) -> int:
        """Exact float-workspace bytes the current plan uses (0 when no request is split)."""
        if not self._planned:
            raise RuntimeError("call plan() first")
        return self._ws_need

    # ---- plan --------------------------------------------------------------------------
    # The plan's arrays as the kernels name them; the wrapper's index arrays follow (_KV_ARRAYS).
    _PLAN_ARRAYS = ("work_request", "work_qtile", "work_chunk", "num_chunks", "o_indptr", "merge_indptr")
    _KV_ARRAYS: tuple

    def _plan_common(self, qo, qo_lens, kv_lens, max_qo, max_kv, kv_arrays: tuple, state: dict, num_qo_heads,
                     num_kv_heads, head_dim, custom_mask, packed_custom_mask, causal, pos_encoding_mode,
                     allow_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta,
                     q_data_type, kv_data_type, fixed_split_size, disable_split_kv, page_size, lse_base, stream):
        """Everything after the wrapper-specific index checks: qo = the host int32 qo_indptr,
        qo_lens / kv_lens int64, checked >= 0, with their maxima max_qo / max_kv; kv_arrays = the
        int32 index arrays the kernel reads, in _KV_ARRAYS order. `state` holds the wrapper fields
        the plan sets (page size, ...): they are committed only when the whole plan succeeded,
        so a refused plan leaves the previous one usable."""
        has_mask = custom_mask is not None or packed_custom_mask is not None
        args = (num_qo_heads, num_kv_heads, head_dim, pos_encoding_mode, allow_fp16_qk_reduction, logits_soft_cap,
                rope_scale, rope_theta, lse_base, q_data_type, kv_data_type, window_left, sm_scale, fixed_split_size,
                has_mask)
        # The mask is checked first (before the driver is touched, like every argument).
        mask = self._mask_plan(custom_mask, packed_custom_mask, qo_lens, kv_lens) if has_mask else None
        # A serving loop re-plans with the same settings every step: their validation and the
        # kernel choice are cached per wrapper, keyed by the values and their types (so 128.0 or
        # True never pass where 128 or 1 did), and only with plain scalars in the numeric options
        # (a tensor there hashes by identity and could change value between plans).
        # Only plain keys are ever stored and the key holds every type, so a hit is a plain key:
        # the plainness test is only needed before storing (off the hot path).
        key = (args, tuple(map(type, args)))
        try:
            cfg = self._configs.get(key)
        except TypeError:  # an unhashable argument: resolve it every time (and reject it there)
            cfg = key = None
        if cfg is None:
            cfg = self._resolve_config(*args)
            types = key[1] if key is not None else ()
            if types and _PLAIN.issuperset((types[4], types[5], types[6], types[7], types[11], types[12], types[13])):
                if len(self._configs) >= 64:
                    self._configs.clear()
                self._configs[key] = cfg
        opts, qdt, kdt, kv_fp8, window_left, sm_scale, fss, group, la, budget, ctas_per_sm, dec = cfg
        causal = 1 if causal and not has_mask else 0  # a custom mask replaces causal (FlashInfer)
        B = qo_lens.size

        _cuda.ensure_context(self._dev)
        cap = None
        # a decode tile when the longest request fits one of this plan's decode tiles, or (contiguous
        # 16-bit K/V) several within DECODE_MAX_ROWS: decode, speculative decode, short appends
        tile = decode_tile_rows(head_dim, max_qo * group, tuple(dec)) if dec else 0
        if self._use_cuda_graph:
            cap = self._graph_capacity(B, int(qo[-1]))
            # A captured kernel serves every later plan, so the first plan picks the tile for
            # good (decode graphs keep theirs). A decode tile stays correct for any later
            # lengths (more row tiles per request), only slower on long prefills.
            tile = cap.get("decode_rows", tile)
        if tile and dec:
            la, budget, ctas_per_sm = dec.get(tile) or dec[max(dec)]
        meta = la.meta
        plan = _plan.schedule_prefill(qo, qo_lens, kv_lens, max_qo, max_kv, group, num_kv_heads, meta["block_m"],
                                      meta["block_n"], budget, bool(causal), window_left, fss, disable_split_kv, cap,
                                      ctas_per_sm)
        # Graph mode keeps the partial-LSE offset fixed across plans (max_partial_rows bound).
        ws_rows = plan.max_partial_rows if cap else plan.num_partial_rows
        lse_off, need = plan.workspace_layout(num_qo_heads, head_dim, ws_rows) if ws_rows else (0, 0)
        if need > self._ws_bytes:  # checked before any state changes: a refused plan leaves no trace
            raise ValueError(f"float_workspace_buffer holds {self._ws_bytes} bytes but this plan needs "
                             f"{need}; pass a larger buffer (or disable_split_kv=True)")
        total_q = plan.total_q
        merge = self._launcher("merge", qdt.short) if plan.split or cap else None

        # What goes to the device, in this order: the plan's arrays, qo_indptr, the wrapper's
        # index arrays, the chunk size (graph mode only: elsewhere the kernel takes the by-value
        # kv_chunk_size), the mask's offsets.
        mask_arrays = () if mask is None else (
            (mask.byte_indptr, mask.elem_indptr) if mask.kind == "bool" else (mask.byte_indptr,))
        if cap is None:
            # Back to back, the plan's arrays in one piece (they are consecutive in plan.buffer).
            # Nothing merged: every request has one chunk, the kernel reads no o_indptr and no
            # merge runs, so o_indptr and merge_indptr (total_q + 1 entries, the largest) stay home.
            buf = plan.buffer
            staged = [buf if merge is not None else buf[:3 * plan.grid + B], qo, *kv_arrays, *mask_arrays]
            offsets = nbytes = None
        else:
            # Rows past this plan's tokens must merge nothing (the merge grid covers the capacity).
            mi = plan.merge_indptr
            staged = [plan.work_request, plan.work_qtile, plan.work_chunk, plan.num_chunks, plan.o_indptr,
                      np.concatenate([mi, np.full(cap["max_total_q"] + 1 - mi.size, mi[-1], np.int32)]),
                      qo, *kv_arrays, plan.kv_chunk_size, *mask_arrays]
            names = (*self._PLAN_ARRAYS, "qo_indptr", *self._KV_ARRAYS, "chunk_size",
                     "mask_indptr", "mask_in_indptr")
            layout = self._graph_layout({name: 1 if type(a) is int else a.size for name, a in zip(names, staged)},
                                        cap)
            offsets = [layout[name] // 4 for name in names[:len(staged)]]
            nbytes = layout["__end__"]
            sig = {"num_qo_heads": num_qo_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                   "q_data_type": qdt.name, "kv_data_type": kdt.name, "page_size": page_size, "causal": causal,
                   "window_left": window_left, "sm_scale": sm_scale, "logits_soft_cap": opts.soft_cap,
                   "pos_encoding_mode": opts.pos, "rope_scale": opts.rope_scale, "rope_theta": opts.rope_theta,
                   "lse_base": opts.lse_scale, "custom_mask": mask is not None,
                   "float workspace layout": (self._ws_ptr, lse_off), "kernel": (la.name, plan.grid)}
            if self._captured is not None:
                self._check_graph_sig(sig)

        # ---- nothing below refuses the plan: commit ----
        s = _plan_stream(stream, self._dev)
        ptrs = self._staging.upload(staged, s, offsets, nbytes)
        self._plan_stream, self._pending_copy = s, True
        nkv = len(kv_arrays)
        if cap is None:  # the plan's arrays follow each other from where plan.buffer landed
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
        # rest: qo_indptr, the wrapper's index arrays, (graph mode) the chunk size, the mask's offsets
        p = la.params
        p.work_request, p.work_qtile, p.work_chunk, p.num_chunks, p.o_indptr = wr, wq, wc, nc, o_ptr
        p.qo_indptr = rest[0]
        for name, ptr in zip(self._KV_ARRAYS, rest[1:1 + nkv]):
            setattr(p, name, ptr)
        p.kv_chunk_size_dev = chunk_ptr
        if mask is not None:
            p.custom_mask, p.mask_indptr = self._write_mask(mask, mask_ptrs, s)
        else:
            p.custom_mask = p.mask_indptr = 0
            self._mask_keep = None
        p.kv_chunk_size = plan.kv_chunk_size
        self._sm_log2 = sm_log2 = sm_scale * LOG2E
        consts = (la, num_qo_heads, num_kv_heads, causal, window_left, sm_log2, opts, kv_fp8, page_size)
        if consts != self._consts or self._scaled:
            # Option fields, written only when they change (a serving loop re-plans with the same
            # options every step); the launcher's struct is this wrapper's own.
            p.num_qo_heads, p.num_kv_heads, p.group_size = num_qo_heads, num_kv_heads, group
            p.causal, p.window_left, p.sm_scale_log2 = causal, window_left, sm_log2
            p.lse_scale, p.logits_soft_cap, p.v_scale = opts.lse_scale, opts.soft_cap, 1.0
            p.kv_fp8 = kv_fp8
            p.rope = int(opts.pos == "ROPE_LLAMA")
            p.rope_rcp_scale, p.rope_log2_theta = 1.0 / opts.rope_scale, math.log2(opts.rope_theta)
            p.alibi_slopes = _alibi_buffer(self._dev, num_qo_heads) if opts.pos == "ALIBI" else 0
            p.page_size = page_size
            p.page_shift = page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1
            self._consts = consts
        self._ks = self._vs = 1.0  # run()'s k_scale / v_scale currently in the struct
        self._scaled = False
        la.configure((num_kv_heads, 1, plan.grid))
        self._attn = la
        if merge is not None:  # a captured graph always holds the merge (a no-op for unsplit rows)
            mp = merge.params
            rows = cap["max_total_q"] if cap else total_q
            mp.merge_indptr = m_ptr
            mp.rows, mp.num_heads, mp.head_dim, mp.num_splits = rows, num_qo_heads, head_dim, 0
            mp.lse_scale = opts.lse_scale
            merge.configure((max(1, -(-rows * num_qo_heads // _MERGE_ROWS_PER_BLOCK)), 1, 1))
        self._merge = merge
        self._ws_rows, self._ws_lse_off, self._ws_need = ws_rows, lse_off, need
        self._plan = plan
        self._opts = opts
        self._dtype, self._kv_dtype = qdt, kdt
        self._kv_epc = 16 // (kdt.bits // 8)  # K/V elements per 16-byte chunk (alignment unit)
        self._shape = (total_q, num_qo_heads, num_kv_heads, head_dim)
        self.__dict__.update(state)
        self._point_workspace()
        self._planned = True
        if cap is not None:
            cap.setdefault("decode_rows", tile)  # the first successful plan's tile, for good
            self._capacity = cap
            self._sig = sig
        self._fast_key = None  # run()'s validated-signature cache belongs to one plan
        return plan

    def _resolve_config(self, num_qo_heads, num_kv_heads, head_dim, pos_encoding_mode, allow_fp16_qk_reduction,
                        logits_soft_cap, rope_scale, rope_theta, lse_base, q_data_type, kv_data_type, window_left,
                        sm_scale, fixed_split_size, has_mask):
        """plan()'s settings validated (errors name the argument), and the kernel they select:
        (opts, q dtype, kv dtype, kv_fp8, window_left, sm_scale, fixed_split_size or None,
        group size, attention launcher, CTAs per wave). Cached by _plan_common."""
        opts = _options.resolve(pos_encoding_mode, allow_fp16_qk_reduction, logits_soft_cap, rope_scale, rope_theta,
                                lse_base)
        for name, val in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        num_qo_heads, num_kv_heads, head_dim = int(num_qo_heads), int(num_kv_heads), int(head_dim)
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim {head_dim} is not supported (supported: {HEAD_DIMS})")
        qdt, kdt, kv_fp8 = _plan_dtypes(q_data_type, kv_data_type)
        window_left = _options.window(window_left)
        sm_scale = _options.softmax_scale(sm_scale, head_dim)
        fss = None if fixed_split_size is None else _plan._pos_int(fixed_split_size, "fixed_split_size")
        _cuda.ensure_context(self._dev)
        general = opts.general or has_mask
        kvs = "fp8" if kv_fp8 else qdt.short
        props = _cuda.properties(self._dev)
        la = self._launcher("prefill", qdt.short, kvs, head_dim, general)
        ctas_per_sm = 2 if la.meta["threads"] <= 128 else 1
        budget = props["sm_count"] * ctas_per_sm  # CTAs per wave
        # The decode tiles (16 rows on one warp or a pair; for paged or fp8 K/V also 32 and 64 rows
        # on two and four warps: decode_tiles) by their rows, smallest first; lean options only.
        # Their CTAs per SM are what the shared memory allows (single prefill's rule).
        dec = None
        if not general:
            dec = {}
            for rows in decode_tiles(head_dim, self._paged, bool(kv_fp8)):
                ld = self._launcher("prefill", qdt.short, kvs, head_dim, False, decode=rows)
                cps = _decode_ctas_per_sm(ld, props)
                # fp8 K/V: split KV for two waves of CTAs, not one. The fp8 tiles widen every K/V
                # tile (latency-bound), and one wave of equal chunks streamed slower than twice as
                # many half chunks (H200, hd128, 16 requests of 8K-32K keys: 1.42 TB/s with the
                # chunks of one wave, 1.82 with 2048-key chunks; bf16 4.12-4.13 either way).
                dec[rows] = (ld, props["sm_count"] * cps * (_FP8_DECODE_WAVES if kv_fp8 else 1), cps)
        return (opts, qdt, kdt, kv_fp8, window_left, sm_scale, fss, num_qo_heads // num_kv_heads, la, budget,
                ctas_per_sm, dec)

    def _mask_plan(self, custom_mask, packed_custom_mask, qo_lens, kv_lens) -> _MaskPlan:
        """Validate a per-request custom mask and decide where its packed bits go (no driver).

        FlashInfer's layout: request b's [qo_len, kv_len] boolean matrix, row-major, packed
        little-endian into its own byte-aligned segment. packed_custom_mask (FlashInfer's
        segment_packbits(..., bitorder="little") output) wins when both are given; a flat
        boolean custom_mask (the matrices concatenated) is packed on the device at plan time.
        """
        bits = qo_lens.astype(np.int64)
        bits *= kv_lens
        seg_bytes = bits + 7
        seg_bytes >>= 3
        byte_indptr = np.zeros(bits.size + 1, np.int64)
        np.cumsum(seg_bytes, out=byte_indptr[1:])
        need = int(byte_indptr[-1])
        if need > _I32_MAX:
            raise ValueError(f"the packed custom mask would take {need} bytes: more than 2 GiB (int32 byte offsets)")
        elem_indptr = None
        if packed_custom_mask is not None:
            kind, obj, name = "packed", packed_custom_mask, "packed_custom_mask"
            v = _tensor.view(obj, name)
            self._require_here(v, name)
            if v.dtype != _dtypes.UINT8:
                raise TypeError(f"packed_custom_mask must be uint8, got {v.dtype.name}")
            if v.ndim != 1 or (v.shape[0] > 1 and v.strides[0] != 1):
                raise ValueError(f"packed_custom_mask must be a contiguous 1-D tensor, got shape {v.shape}")
            if v.shape[0] < need:
                raise ValueError(f"packed_custom_mask has {v.shape[0]} bytes; the requests' masks need {need} "
                                 "(segments of ceil(qo_len * kv_len / 8) bytes)")
        else:
            kind, obj, name = "bool", custom_mask, "custom_mask"
            v = _tensor.view(obj, name)
            self._require_here(v, name)
            if v.dtype not in (_dtypes.BOOL, _dtypes.UINT8):
                raise TypeError(f"custom_mask must be bool (or uint8), got {v.dtype.name}")
            elem_indptr = np.zeros(bits.size + 1, np.int64)
            np.cumsum(bits, out=elem_indptr[1:])
            total = int(elem_indptr[-1])
            if v.ndim != 1 or v.shape[0] != total:
                raise ValueError(f"custom_mask must be 1-D with sum(qo_len * kv_len) = {total} entries, got shape "
                                 f"{v.shape}")
            if total > 1 and v.strides[0] != 1:
                raise ValueError(f"custom_mask must be contiguous, got strides {v.strides}")
            if total > _I32_MAX:
                raise ValueError(f"custom_mask has {total} entries, more than the device packer's int32 offsets "
                                 "take; pass packed_custom_mask")
        # Where the packed bits go: custom_mask_buf, else the library's fixed buffer (CUDA graphs:
        # sized once, at the first plan with a mask), else in place (packed) or a grow-only buffer.
        dst = None
        if self._mask_user is not None:
            dst, cap = self._mask_user[1], self._mask_user[2]
            if need > cap:
                raise ValueError(f"the packed custom mask of this plan needs {need} bytes but custom_mask_buf holds "
                                 f"{cap}")
        elif self._use_cuda_graph and self._mask_cap:
            dst, cap = self._mask_dev, self._mask_cap
            if need > cap:
                raise ValueError(f"the packed custom mask of this plan needs {need} bytes but the CUDA-graph mask "
                                 f"buffer (sized at the first plan with a mask) holds {cap}; pass custom_mask_buf "
                                 f"with at least {need} bytes to the constructor")
        if self._qk_user is not None and self._qk_user[2] < bits.size + 1:
            raise ValueError(f"qk_indptr_buf holds {self._qk_user[2]} entries; this plan needs batch size + 1 = "
                             f"{bits.size + 1}")
        return _MaskPlan(kind=kind, obj=obj, view=v, need=need, byte_indptr=byte_indptr.astype(np.int32),
                         elem_indptr=None if elem_indptr is None else elem_indptr.astype(np.int32),
                         seg_bytes=seg_bytes, dst=dst)

    def _require_here(self, v, name):
        if not v.is_cuda or v.device_id != self._dev:
            raise ValueError(f"{name} must be a CUDA tensor on cuda:{self._dev}")

    def _write_mask(self, m: _MaskPlan, ptrs, s):
        """Put the plan's packed mask and byte offsets where the kernel reads them, on the plan
        stream s (async: a device-to-device copy or the packbits kernel, no sync). ptrs: the
        device addresses of m.byte_indptr (and m.elem_indptr for a bool mask). Returns the
        (custom_mask, mask_indptr) addresses."""
        cu = _cuda.driver()
        v = m.view
        if v.framework not in ("torch", "cupy"):
            # JAX & co.: the plan stream waits for the producer's pending writes (DLPack handshake)
            v = _tensor.view(m.obj, "packed_custom_mask" if m.kind == "packed" else "custom_mask", stream=s)
        dst = m.dst
        if dst is None:
            if self._use_cuda_graph:
                # Fixed for the wrapper's lifetime: captured graphs keep this address.
                self._mask_cap = max(2 * m.need, _MASK_MIN_BYTES)
                self._mask_dev = dst = _cuda.mem_alloc(self._mask_cap)
            elif m.kind == "packed":
                dst = v.ptr  # used in place
            else:
                if m.need > self._mask_cap:
                    size = max(m.need, 2 * self._mask_cap, _MASK_MIN_BYTES)
                    new = _cuda.mem_alloc_async(size, s)
                    if self._mask_dev:
                        _cuda.check(cu.cuMemFreeAsync(self._mask_dev, s), "cuMemFreeAsync")
                    self._mask_dev, self._mask_cap = new, size
                dst = self._mask_dev
        if m.kind == "packed":
            if dst != v.ptr and m.need:
                _cuda.check(cu.cuMemcpyDtoDAsync(dst, v.ptr, m.need, s), "cuMemcpyDtoDAsync (packed_custom_mask)")
        elif m.need:
            la = _registry.launcher("packbits", self._dev)
            p = la.params
            nseg = m.seg_bytes.size
            for first in range(0, nseg, _PACK_MAX_SEGMENTS):
                count = min(_PACK_MAX_SEGMENTS, nseg - first)
                most = int(m.seg_bytes[first:first + count].max())
                if not most:
                    continue
                p.x, p.y = v.ptr, dst
                p.in_indptr, p.out_indptr = ptrs[1] + 4 * first, ptrs[0] + 4 * first
                p.n, p.num_segments, p.little = 0, count, 1
                la.launch((-(-most // _PACK_THREADS), count, 1), s)
        self._mask_keep = m.obj  # read asynchronously (or in place): alive as long as the plan
        indptr = ptrs[0]
        if self._qk_user is not None:
            nbytes = 4 * m.byte_indptr.size
            _cuda.check(cu.cuMemcpyDtoDAsync(self._qk_user[1], indptr, nbytes, s), "cuMemcpyDtoDAsync (qk_indptr_buf)")
            indptr = self._qk_user[1]
        return dst, indptr

    def _launcher(self, family, dtype, kv_dtype=None, head_dim=None, general=None, decode=0):
        """The wrapper's own Launcher per kernel, reused across plans (creating one costs ~10 us);
        decode = the decode tile's packed rows (0: the 128-row kernels)."""
        key = (family, dtype, kv_dtype, head_dim, general, decode)
        la = self._launchers.get(key)
        if la is None:
            if family == "merge":
                la = _registry.new_launcher("merge", self._dev, dtype=dtype)
            else:
                tile = dict(decode=True, block_m=decode) if decode else dict(decode=False)
                la = _registry.new_launcher("prefill", self._dev, dtype=dtype, kv_dtype=kv_dtype, head_dim=head_dim,
                                            general=general, paged=self._paged, **tile)
            self._launchers[key] = la
        return la

    def _point_workspace(self):
        p = self._attn.params
        p.o_partial, p.lse_partial = self._ws_ptr, self._ws_ptr + self._ws_lse_off
        if self._merge is not None:
            mp = self._merge.params
            mp.o_partial, mp.lse_partial = p.o_partial, p.lse_partial

    _pending_copy = False
    _consts = None  # the option fields last written into the attention launcher's struct

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

    def _graph_layout(self, sizes, cap):
        """Fixed offsets for CUDA-graph mode (sizes: name -> entries of each array this plan
        stages): every array gets its capacity's room, so device addresses never change between
        plans (the mask arrays have room whether or not the first plan has a mask)."""
        if "layout" not in cap:
            B, TQ = cap["max_batch"], cap["max_total_q"]
            bound = {"qo_indptr": B + 1, "kv_indptr": B + 1, "kv_last_page_len": B, "num_chunks": B,
                     "o_indptr": B + 1, "merge_indptr": TQ + 1, "chunk_size": 1,
                     "kv_page_indices": self._max_pages, "mask_indptr": B + 1, "mask_in_indptr": B + 1}
            first = dict(sizes)
            first.setdefault("mask_indptr", 0)
            first.setdefault("mask_in_indptr", 0)
            layout, off, room = {}, 0, {}
            for name, n in first.items():
                room[name] = max(n, bound.get(name, n))
                layout[name] = off
                off += (room[name] * 4 + 15) // 16 * 16
            layout["__end__"] = off
            # Reserve first: a refused reserve must not leave a layout behind.
            self._staging.reserve(off, fixed=True)
            cap["layout"], cap["sizes"] = layout, room
        room = cap["sizes"]
        for name, n in sizes.items():
            if n > room[name]:
                raise ValueError(f"{name} has {n} entries, more than the CUDA-graph buffers hold ({room[name]})")
        return cap["layout"]

    def _check_graph_sig(self, sig):
        """A captured graph replays the params struct, kernel and grid it was captured with; only
        device-resident metadata follows new plans. Refuse a plan the replay would not honour."""
        old = self._captured
        for key, val in sig.items():
            if old[key] == val:
                continue
            if key == "custom_mask":
                raise ValueError(
                    f"custom_mask / packed_custom_mask: run() was captured in a CUDA graph "
                    f"{'with' if old[key] else 'without'} a custom mask and replays that kernel as captured, so a "
                    f"plan {'without' if old[key] else 'with'} one would not be honoured; use another wrapper (and "
                    "graph) for it" + (", or pass an all-True mask" if old[key] else ""))
            raise ValueError(f"{key}: run() was captured in a CUDA graph with {key} = {old[key]!r}; the replay keeps "
                             f"it, so a plan with {val!r} would not be honoured; use another wrapper (and graph) "
                             "for it")

    def _note_capture(self, s):
        """Graph mode: the first run() recorded into a CUDA graph freezes the plan settings it
        baked in (checked by later plans)."""
        cu = _cuda.driver()
        err, status = cu.cuStreamIsCapturing(s)
        if err == cu.CUresult.CUDA_SUCCESS and status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE:
            self._captured = self._sig
            self._graph_probe = False

    # ---- run ---------------------------------------------------------------------------
    def _apply_scales(self, k_scale, v_scale):
        """k_scale folds into the logit scale, v_scale into the output multiplier (both in the
        kernel, split-KV partials included). The struct is only written when a value changes."""
        ks, vs = _scale_arg(k_scale, "k_scale"), _scale_arg(v_scale, "v_scale")
        if ks != self._ks or vs != self._vs:
            p = self._attn.params
            p.sm_scale_log2 = self._sm_log2 * ks
            p.v_scale = vs
            self._ks, self._vs = ks, vs
            self._scaled = ks != 1.0 or vs != 1.0

    def _check_q(self, q, out, lse, return_lse, stream):
        qv = _tensor.view(q, "q")
        total_q, Hq, Hkv, D = self._shape
        if qv.shape != (total_q, Hq, D):
            raise ValueError(f"q must have shape {(total_q, Hq, D)} (qo_indptr[-1], num_qo_heads, head_dim) "
                             f"as planned, got {qv.shape}")
        if qv.dtype is not self._dtype:
            raise TypeError(f"q has dtype {qv.dtype.name} but plan() was told q_data_type={self._dtype.name}")
        if not qv.is_cuda or qv.device_id != self._dev:
            raise ValueError(f"q must be a CUDA tensor on cuda:{self._dev}")
        if qv.strides[2] != 1 or qv.ptr % 16 or qv.strides[0] % 8 or qv.strides[1] % 8:
            raise ValueError(f"q must have a contiguous last dim and 16-byte aligned rows, got strides {qv.strides}")
        fw = qv.framework
        s = _tensor.stream_handle(stream) if stream is not None else _tensor.current_stream(fw, self._dev)
        # DLPack handshake for producers with their own streams (JAX): views taken with the
        # launch stream make it wait for the producer's pending writes. torch needs none.
        hs = None if fw == "torch" else s
        if hs is not None and fw != "cupy":
            qv = _tensor.view(q, "q", stream=hs)
        if out is None:
            out, ov = _tensor.empty(qv, (total_q, Hq, D), self._dtype, s)
        else:
            ov = _tensor.view(out, "out")
            if ov.dtype is not self._dtype:
                raise TypeError(f"out must be {self._dtype.name} (q's dtype), got {ov.dtype.name}")
            if ov.shape != (total_q, Hq, D) or not ov.is_cuda or ov.device_id != self._dev:
                raise ValueError(f"out must be {self._dtype.name} {(total_q, Hq, D)} on cuda:{self._dev}, got "
                                 f"{ov.dtype.name} {ov.shape}")
            if ov.strides[2] != 1 or ov.ptr % 16 or ov.strides[0] % 8 or ov.strides[1] % 8:
                raise ValueError(f"out must have a contiguous last dim and 16-byte aligned rows, got {ov.strides}")
        lv = None
        if lse is not None:
            lv = _tensor.view(lse, "lse")
            if lv.shape != (total_q, Hq) or lv.dtype != _dtypes.FLOAT32 or not lv.is_cuda or lv.device_id != self._dev:
                raise ValueError(f"lse must be float32 {(total_q, Hq)} on cuda:{self._dev}")
            if total_q * Hq > 1 and lv.strides != (Hq, 1):
                raise ValueError("lse must be contiguous")
        elif return_lse:
            lse, lv = _tensor.empty(qv, (total_q, Hq), _dtypes.FLOAT32, s)
        return qv, out, ov, lse, lv, s, hs

    def _kv_operand(self, x, name, hs):
        """View one K/V tensor (with the launch stream for producers that need the handshake)
        and check it against the plan: device, kv dtype, 16-byte aligned rows."""
        t = _tensor.view(x, name, stream=hs)
        if not t.is_cuda or t.device_id != self._dev:
            raise ValueError(f"{name} must be a CUDA tensor on cuda:{self._dev}")
        if t.dtype is not self._kv_dtype:
            raise TypeError(f"{name} has dtype {t.dtype.name} but plan() was told kv_data_type="
                            f"{self._kv_dtype.name}")
        # The kernel copies 16-byte chunks: every row start must be 16-byte aligned, i.e. the
        # strides multiples of 16 / itemsize elements (8 for 16-bit K/V, 16 for fp8).
        epc = self._kv_epc
        if t.strides[-1] != 1 or t.ptr % 16 or any(st % epc for st in t.strides[:-1]):
            raise ValueError(f"{name} must have a contiguous last dim and 16-byte aligned rows (strides multiples "
                             f"of {epc} elements, data pointer 16-byte aligned), got strides {t.strides}, address "
                             f"%16 = {t.ptr % 16}")
        return t

    def _launch(self, qv, ov, lv, s, pdl):
        if self._pending_copy:
            # The plan's metadata copy went on the plan's stream; order this stream after it once.
            _cuda.stream_wait(s, self._plan_stream)
            self._pending_copy = False
        if self._graph_probe:
            self._note_capture(s)
        p = self._attn.params
        p.q, p.o = qv.ptr, ov.ptr
        p.q_stride_n, p.q_stride_h = qv.strides[0], qv.strides[1]
        p.o_stride_n, p.o_stride_h = ov.strides[0], ov.strides[1]
        p.lse = lv.ptr if lv is not None else 0
        if self._shape[0] == 0:
            return
        self._attention(pdl)(s)
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
    def _key(q, kv_parts, out, lse, return_lse):
        """The torch attributes a validated run depends on (shapes, strides, dtypes, devices of
        every tensor); None for a tensor torch's attributes cannot describe. A flat tuple: no
        per-tensor helper calls (this is most of the fast path's own cost)."""
        try:
            key = (q.shape, q.stride(), q.dtype, q.get_device(), return_lse)
            for t in kv_parts:
                key += (t.shape, t.stride(), t.dtype, t.get_device())
            key += (None,) if out is None else (out.shape, out.stride(), out.dtype, out.get_device())
            key += (None,) if lse is None else (lse.shape, lse.stride(), lse.dtype, lse.get_device())
            return key
        except Exception:  # noqa: BLE001 - not a plain strided torch tensor
            return None

    def _remember(self, q, kv_parts, out, lse, return_lse):
        # `out`/`lse` are what the caller passed (None when we allocated).
        cls = q.__class__
        if cls not in _TORCH_TYPES:
            if _tensor.framework_of(q) != "torch":
                self._fast_key = None
                return
            _TORCH_TYPES.add(cls)
        self._fast_key = self._key(q, kv_parts, out, lse, bool(return_lse))

    def _torch_fast(self, q, kv_parts, out, lse, return_lse, stream, pdl):
        fk = self._fast_key
        if fk is None or q.__class__ not in _TORCH_TYPES or self._key(q, kv_parts, out, lse, bool(return_lse)) != fk:
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
        s = _tensor.stream_handle(stream) if stream is not None else _torch_stream(self._dev)
        total_q, Hq = self._shape[0], self._shape[1]
        if out is None:
            out = _tensor.torch_empty_like(q)  # o has q's shape (the plan's key fixed it)
            op = out.data_ptr()
        if lse is None and return_lse:
            lse = _tensor.torch_empty_f32(q, (total_q, Hq))
        p = self._attn.params
        p.q, p.k, p.v, p.o = qp, kp, vp, op
        p.lse = lp = lse.data_ptr() if lse is not None else 0
        if self._pending_copy:
            _cuda.stream_wait(s, self._plan_stream)
            self._pending_copy = False
        if self._graph_probe:
            self._note_capture(s)
        if total_q:
            self._attention(pdl)(s)
            merge = self._merge
            if merge is not None:
                mp = merge.params
                mp.o, mp.lse = op, lp
                merge(s)
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

    def _refuse_run(self, args):
        if args:
            raise TypeError(f"run() takes {self._run_positional} positionally; pass the rest by keyword")
        raise RuntimeError("call plan() before run()")

    _attn_pdl = None  # the attention kernel's programmatic launcher (enable_pdl=True), built on first use

    def _attention(self, pdl):
        """The attention launcher for this run: with enable_pdl, one launched programmatically
        (sm_90+: it may start while the kernel ahead of it on the stream finishes, and waits for
        it in griddepcontrol.wait before reading anything), over the same params struct. GPUs
        without programmatic launch (sm_8x) take the plain launch: the results are the same."""
        la = self._attn
        if not pdl:
            return la
        pl = self._attn_pdl
        if pl is None or pl.params is not la.params:
            if _cuda.properties(self._dev)["cc"] < (9, 0):
                return la
            pl = self._attn_pdl = _cuda.ProgrammaticLauncher.sharing(la)
        if pl.grid != la.grid:
            pl.configure(la.grid)
        return pl

    def run_return_lse(self, *args, **kwargs):
        kwargs["return_lse"] = True
        return self.run(*args, **kwargs)

    begin_forward = None  # set per class to plan (FlashInfer's old name)


_TORCH_TYPES: set = set()  # classes seen to be torch tensors (framework_of, once per class)


def _torch_stream(dev):
    """torch's current raw stream (what _tensor.current_stream("torch") reads), with the getter
    looked up once per torch module."""
    global _torch_getter
    mod = sys.modules["torch"]
    if _torch_getter[0] is not mod:
        _torch_getter = (mod, getattr(mod._C, "_cuda_getCurrentRawStream", None))
    raw = _torch_getter[1]
    return raw(dev) if raw is not None else _tensor.current_stream("torch", dev)


_torch_getter = (None, None)


def _plan_stream(stream, dev):
    """plan()'s copy stream: stream= if given, else torch's / CuPy's current stream when that
    framework is loaded (what run() will use by default), else the library stream."""
    if stream is not None:
        return _tensor.stream_handle(stream)
    for fw in ("torch", "cupy"):
        if fw in sys.modules:
            try:
                return _torch_stream(dev) if fw == "torch" else _tensor.current_stream(fw, dev)
            except Exception:  # noqa: BLE001 - framework without CUDA: fall through
                pass
    return _cuda.library_stream(dev)


class BatchPrefillWithPagedKVCacheWrapper(_BatchPrefillBase):
    """Prefill/append attention over a paged KV cache for a batch of requests (FlashInfer's API).

    paged_kv_cache: one tensor [num_pages, 2, page_size, Hkv, D] (NHD) or
    [num_pages, 2, Hkv, page_size, D] (HND), or a tuple (k_cache, v_cache) of
    [num_pages, page_size, Hkv, D] / [num_pages, Hkv, page_size, D]; any strides with a
    contiguous last dim and 16-byte aligned rows. Request b owns pages
    kv_indices[kv_indptr[b]:kv_indptr[b+1]], its last page holding kv_last_page_len[b] tokens
    (1..page_size); a request with no pages has kv_len 0.

    K/V dtype: q's (plan's q_data_type), or fp8 (kv_data_type=float8_e4m3fn / float8_e5m2).
    run(k_scale=, v_scale=) (default 1.0) scale the logits (sm_scale * k_scale, also in the LSE)
    and the output (times v_scale) inside the kernel, for every KV dtype.

    plan(non_blocking=...) is accepted for FlashInfer compatibility: the metadata copy is always
    asynchronous on the stream and ordered before run(), so the flag has nothing to change.

    use_cuda_graph=True: the buffers passed here (qo_indptr_buf, paged_kv_indptr_buf,
    paged_kv_indices_buf, paged_kv_last_page_len_buf) fix the capacity (batch size, pages);
    plan() runs outside capture and later plans may change lengths within that capacity, while
    the captured run() stays valid (fixed grid with padding items, metadata at fixed addresses).
    custom_mask_buf (uint8) / qk_indptr_buf (int32, >= batch size + 1 entries) receive each
    plan's packed custom mask and its byte offsets (in any mode); without them graph mode uses a
    library buffer sized at the first plan with a mask (twice that mask, at least 64 KiB). A
    captured run() keeps the kernel, options and k_scale / v_scale it was captured with: later
    plans that would change them (e.g. add or drop the custom mask) raise ValueError.
    """

    _paged = True
    _run_positional = "q and paged_kv_cache"
    _KV_ARRAYS = ("kv_indptr", "kv_page_indices", "kv_last_page_len")

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, qk_indptr_buf=None, backend: str = "auto"):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, custom_mask_buf, qk_indptr_buf)
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
        if type(page_size) is not int or page_size <= 0:
            if not isinstance(page_size, (int, np.integer)) or isinstance(page_size, bool) or page_size <= 0:
                raise ValueError(f"page_size must be a positive int, got {page_size!r}")
            page_size = int(page_size)
        B = qo.size - 1
        if B < 0 or ind.size != B + 1 or last.size != B:
            raise ValueError(f"qo_indptr ({qo.size}), paged_kv_indptr ({ind.size}) and paged_kv_last_page_len "
                             f"({last.size}) must describe the same batch (B+1, B+1, B)")
        qo_lens, max_qo = _lengths(qo)
        if max_qo >> 63:
            raise ValueError("qo_indptr must start at 0 and be non-decreasing")
        pages, max_pages = _lengths(ind)
        if max_pages >> 63:
            raise ValueError("paged_kv_indptr must start at 0 and be non-decreasing")
        # kv_len = (pages - 1) * page_size + last_page_len, 0 without pages (FlashInfer ignores
        # that request's last_page_len), in few numpy calls (their fixed cost dominates here).
        has = pages != _plan._k[0]
        full = pages * _plan._k[page_size]
        kv_lens = full + last
        kv_lens -= _plan._k[page_size]
        kv_lens *= has
        # full - kv_len = page_size - last_page_len, 0 without pages, must lie in [0, page_size):
        # as unsigned, anything else is >= page_size, so one argmax checks every request.
        if _plan.unsigned_max(full - kv_lens) >= page_size:
            raise ValueError(f"paged_kv_last_page_len must be in [1, page_size={page_size}] for requests with "
                             "pages")
        max_kv = kv_lens.item(kv_lens.argmax()) if B else 0
        if qo[0] != 0:
            raise ValueError("qo_indptr must start at 0 and be non-decreasing")
        if ind[0] != 0:
            raise ValueError("paged_kv_indptr must start at 0 and be non-decreasing")
        n_used = ind.item(-1)
        if n_used > idx.size:
            raise ValueError(f"paged_kv_indptr[-1] = {n_used} exceeds len(paged_kv_indices) = {idx.size}")
        used = idx[:n_used]
        max_page = -1
        if n_used:
            # One pass for both checks: negative ids become huge as unsigned (argmax + one index
            # are cheaper than a max reduction).
            u = used.view(_UINT32)
            max_page = u.item(u.argmax())
            if max_page > _I32_MAX:
                raise ValueError("paged_kv_indices must be >= 0")
        if self._use_cuda_graph and n_used > self._max_pages:
            raise ValueError(f"the plan uses {n_used} pages but paged_kv_indices_buf holds {self._max_pages} "
                             "(the CUDA-graph capacity)")
        return self._plan_common(qo, qo_lens, kv_lens, max_qo, max_kv, (ind, used, last),
                                 {"_max_page": max_page, "_page_size": page_size},
                                 num_qo_heads, num_kv_heads, head_dim, custom_mask, packed_custom_mask, causal,
                                 pos_encoding_mode, allow_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap,
                                 rope_scale, rope_theta, q_data_type, kv_data_type, fixed_split_size,
                                 disable_split_kv, page_size, lse_base, stream)

    begin_forward = plan

    def run(self, q, paged_kv_cache, *args, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse: bool = False, stream=None, enable_pdl=None):
        """Attention of q over the paged cache for the planned batch. k_scale / v_scale (float,
        default 1.0): see the class docstring; under a CUDA graph they are baked into the
        captured launch (a replay uses the values of the captured run()). enable_pdl=True
        launches the attention kernel programmatically (sm_90+, see _attention); None / False:
        a plain launch (FlashInfer's None means "if supported": here it means off)."""
        if args or not self._planned:
            self._refuse_run(args)
        if k_scale is not None or v_scale is not None or self._scaled:
            self._apply_scales(k_scale, v_scale)
        if isinstance(paged_kv_cache, (tuple, list)):
            kv_parts = tuple(paged_kv_cache)
            # only a (k_cache, v_cache) pair may take the fast path (a 1-tuple must not pass as
            # the bare 5-D cache it holds: the full path refuses it)
            fast = (self._torch_fast(q, kv_parts, out, lse, return_lse, stream, enable_pdl)
                    if len(kv_parts) == 2 else None)
        else:
            kv_parts = (paged_kv_cache,)
            fast = self._torch_fast(q, kv_parts, out, lse, return_lse, stream, enable_pdl)
        if fast is not None:
            return fast
        qv, out_, ov, lse_, lv, s, hs = self._check_q(q, out, lse, return_lse, stream)
        _, Hq, Hkv, D = self._shape
        ps = self._page_size
        if isinstance(paged_kv_cache, (tuple, list)):
            if len(kv_parts) != 2:
                raise ValueError("paged_kv_cache tuple must be (k_cache, v_cache)")
            kc, vc = (self._kv_operand(t, n, hs) for t, n in zip(kv_parts, ("k_cache", "v_cache")))
            want = (kc.shape[0], ps, Hkv, D) if self._kv_layout == "NHD" else (kc.shape[0], Hkv, ps, D)
            for t, n in ((kc, "k_cache"), (vc, "v_cache")):
                if t.ndim != 4 or t.shape != want:
                    raise ValueError(f"{n} must have shape {want} ({self._kv_layout}), got {t.shape}")
            k_ptr, v_ptr, ks, vs = kc.ptr, vc.ptr, kc.strides, vc.strides
            num_pages = kc.shape[0]
        else:
            c = self._kv_operand(paged_kv_cache, "paged_kv_cache", hs)
            want = (c.shape[0], 2, ps, Hkv, D) if self._kv_layout == "NHD" else (c.shape[0], 2, Hkv, ps, D)
            if c.ndim != 5 or c.shape != want:
                raise ValueError(f"paged_kv_cache must have shape {want} ({self._kv_layout}), got {c.shape}")
            item = c.dtype.bits // 8
            k_ptr, v_ptr = c.ptr, c.ptr + c.strides[1] * item
            ks = vs = (c.strides[0],) + c.strides[2:]
            num_pages = c.shape[0]
        if self._max_page >= num_pages:
            raise ValueError(f"paged_kv_indices refers to page {self._max_page} but paged_kv_cache has {num_pages} "
                             "pages")
        self._kv_ptr_offsets = (0, v_ptr - k_ptr) if len(kv_parts) == 1 else None
        p = self._attn.params
        p.k, p.v = k_ptr, v_ptr
        if self._kv_layout == "NHD":
            p.k_stride_page, p.k_stride_n, p.k_stride_h = ks[0], ks[1], ks[2]
            p.v_stride_page, p.v_stride_n, p.v_stride_h = vs[0], vs[1], vs[2]
        else:
            p.k_stride_page, p.k_stride_h, p.k_stride_n = ks[0], ks[1], ks[2]
            p.v_stride_page, p.v_stride_h, p.v_stride_n = vs[0], vs[1], vs[2]
        self._launch(qv, ov, lv, s, enable_pdl)
        self._remember(q, kv_parts, out, lse, return_lse)
        return self._finish(out_, lse_, return_lse)


class BatchPrefillWithRaggedKVCacheWrapper(_BatchPrefillBase):
    """Prefill attention over ragged (packed) K/V for a batch of requests (FlashInfer's API).

    k, v: [kv_indptr[-1], Hkv, D] (NHD) or [Hkv, kv_indptr[-1], D] (HND); request b owns key rows
    kv_indptr[b]:kv_indptr[b+1]. K/V in q's dtype or fp8 (kv_data_type); run()'s k_scale / v_scale
    apply in the kernel for every KV dtype (FlashInfer's ragged wrapper ignores them: not here).
    use_cuda_graph=True: qo_indptr_buf and kv_indptr_buf fix the batch capacity; custom masks
    and the mask buffers as in BatchPrefillWithPagedKVCacheWrapper.
    """

    _paged = False
    _max_pages = 0
    _run_positional = "q, k, v"
    _KV_ARRAYS = ("kv_indptr",)

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, kv_indptr_buf=None, custom_mask_buf=None, qk_indptr_buf=None,
                 backend: str = "auto"):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, custom_mask_buf, qk_indptr_buf)
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
        qo_lens, max_qo = _lengths(qo)
        kv_lens, max_kv = _lengths(kvi)
        if (max_qo | max_kv) >> 63:
            if max_qo >> 63:
                raise ValueError("qo_indptr must start at 0 and be non-decreasing")
            raise ValueError("kv_indptr must start at 0 and be non-decreasing")
        if qo[0] != 0:
            raise ValueError("qo_indptr must start at 0 and be non-decreasing")
        if kvi[0] != 0:
            raise ValueError("kv_indptr must start at 0 and be non-decreasing")
        return self._plan_common(qo, qo_lens, kv_lens, max_qo, max_kv, (kvi,), {"_total_kv": kvi.item(-1)},
                                 num_qo_heads, num_kv_heads, head_dim, custom_mask, packed_custom_mask, causal,
                                 pos_encoding_mode, allow_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap,
                                 rope_scale, rope_theta, q_data_type, kv_data_type, fixed_split_size,
                                 disable_split_kv, 1, lse_base, stream)

    begin_forward = plan

    def run(self, q, k, v, *args, k_scale=None, v_scale=None, out=None, lse=None, return_lse: bool = False,
            stream=None, enable_pdl=None):
        """Attention of q over the ragged k, v for the planned batch. k_scale / v_scale (float,
        default 1.0) scale the logits and the output in the kernel, for every KV dtype; under a
        CUDA graph they are baked into the captured launch. enable_pdl: as in the paged run()."""
        if args or not self._planned:
            self._refuse_run(args)
        if k_scale is not None or v_scale is not None or self._scaled:
            self._apply_scales(k_scale, v_scale)
        fast = self._torch_fast(q, (k, v), out, lse, return_lse, stream, enable_pdl)
        if fast is not None:
            return fast
        qv, out_, ov, lse_, lv, s, hs = self._check_q(q, out, lse, return_lse, stream)
        _, Hq, Hkv, D = self._shape
        kv, vv = self._kv_operand(k, "k", hs), self._kv_operand(v, "v", hs)
        want = (self._total_kv, Hkv, D) if self._kv_layout == "NHD" else (Hkv, self._total_kv, D)
        for t, n in ((kv, "k"), (vv, "v")):
            if t.shape != want:
                raise ValueError(f"{n} must have shape {want} (kv_indptr[-1], num_kv_heads, head_dim in "
                                 f"{self._kv_layout}), got {t.shape}")
        p = self._attn.params
        p.k, p.v = kv.ptr, vv.ptr
        ks, vs = kv.strides, vv.strides
        if self._kv_layout == "NHD":
            p.k_stride_n, p.k_stride_h, p.v_stride_n, p.v_stride_h = ks[0], ks[1], vs[0], vs[1]
        else:
            p.k_stride_n, p.k_stride_h, p.v_stride_n, p.v_stride_h = ks[1], ks[0], vs[1], vs[0]
        self._kv_ptr_offsets = None
        self._launch(qv, ov, lv, s, enable_pdl)
        self._remember(q, (k, v), out, lse, return_lse)
        return self._finish(out_, lse_, return_lse)
