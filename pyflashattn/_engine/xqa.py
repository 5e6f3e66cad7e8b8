"""XQA-style batch decode (FlashInfer's xqa_batch_decode_with_kv_cache): a plan-free call whose
page table (block_tables) and lengths (seq_lens) stay on the device.

The batch engine runs it: a batch plan over a "block_table" KV source whose requests are all
planned at max_seq_len (rounded up to a coarse grid of pages, so a growing decode batch re-plans
rarely), with the kernel reading each request's real length from seq_lens and its page ids from
its block-table row. Plans are cached per shape key, so a steady serving loop only fills
pointers and launches: no sync, no allocation when out= is given, capturable in a CUDA graph
after one warm-up call with the same shapes (the first call of a shape plans: it allocates).

Device metadata is not checked on the host (that would sync): the kernel clamps each request's
length to the pages the plan covers and every page id into the cache, so bad metadata gives a
wrong answer but never reads outside the cache. PYFLASHATTN_CHECK_METADATA=1 checks them on
the host (a sync per call) and raises ValueError naming the argument.

The call is split for pyflashattn.jax (jax/_xqa.py), which runs the same steps at trace time
and in an XLA callback: check() (every check that needs no device data, on tensors or views),
plan_engine() (a planned engine for the checked shape) and point() (a call's device metadata
into the planned struct), then the engine's run_paged.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from .._runtime import dtypes as _dtypes, tensor as _tensor
from . import indices, launch, operands
from .batch import BatchEngine
from .metadata_check import check_range, metadata_checks_enabled
from .problem import PlanSettings

_settings = tuple.__new__
_ENGINES: OrderedDict = OrderedDict()  # plan key -> a planned BatchEngine
_MAX_ENGINES = 16
SPEC_GENERAL_ENV = "PYFLASHATTN_XQA_SPEC_GENERAL"  # "1": spec masks on the general kernels (read at plan time)
_INT32_MAX = 2**31 - 1
_MASK_DTYPES = (_dtypes.UINT16, _dtypes.INT16)
_FAST: dict = {}  # torch call signature -> (engine, its per-call constants): the validated calls
_NUMBERS = (int, float)


def planned_pages(max_seq_len: int, page_size: int, width: int) -> int:
    """Pages the plan covers for max_seq_len: rounded up to 1/8 of its power of two (at most
    12.5% more), so a decode batch whose longest request grows by a token re-plans rarely;
    never more than a block-table row holds."""
    need = max(1, -(-max_seq_len // page_size))
    grid = max(1, 1 << max(need.bit_length() - 4, 0))
    return min(-(-need // grid) * grid, width)


def _block_scales(kv_cache_sf, kv_cache, kshape, dev):
    """An NVFP4 cache's kv_cache_sf, checked against the cache (operands.nvfp4_scales), in the form
    run_paged takes for the cache operands.paged_cache returned: as given, or for a [P, 1, ...] cache the
    pair of its views."""
    pair = isinstance(kv_cache, (tuple, list))
    kv_dim = 0 if pair else _tensor.view(kv_cache, "kv_cache").shape[1]
    operands.nvfp4_scales(kv_cache_sf, pair, kv_dim, kshape, dev)
    if pair:
        return tuple(kv_cache_sf)
    if kv_dim == 2:
        return kv_cache_sf
    half = _tensor.slice_dim1(kv_cache_sf, _tensor.launch_view(kv_cache_sf, "kv_cache_sf"), 0)
    return half, half


def _check_mask(mask, batch: int, q_len: int, dev: int) -> tuple:
    """XQA's speculative-decoding mask: uint16 [B, q_len, ceil(q_len / 32) * 2], contiguous on dev.
    Returns (its 32-bit words per query row, its address)."""
    v = _tensor.view(mask, "mask")
    operands.require_device(v, "mask", dev, "query")
    words = -(-q_len // 32)
    if v.dtype not in _MASK_DTYPES:
        raise TypeError(f"mask must be uint16 (32-bit little-endian words as pairs), got {v.dtype.name}")
    if v.shape != (batch, q_len, 2 * words):
        raise ValueError(f"mask must have shape {(batch, q_len, 2 * words)} (batch, q_len_per_req, "
                         f"ceil(q_len_per_req / 32) * 2), got {v.shape}")
    if not operands._contiguous(v.shape, v.strides) or v.ptr % 4:
        raise ValueError("mask must be contiguous and 4-byte aligned")
    return words, v.ptr


def _scale(x, name, dev):
    """(float, device address): a Python number, or a one-element float32 device tensor."""
    if isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool):
        return operands.scale_arg(x, name), 0
    return 1.0, operands.device_scalar(x, name, dev)


def _check_metadata(bt, sl, max_seq_len, planned_keys, num_pages, page_size):
    """PYFLASHATTN_CHECK_METADATA=1: seq_lens within max_seq_len and the plan, the pages they use
    inside the cache (copies both arrays to the host: a sync)."""
    lens = indices.host_int(sl.reshape(-1), "seq_lens").view(np.uint32).astype(np.int64)
    check_range(lens, 0, min(max_seq_len, planned_keys) + 1, "seq_lens", "max_seq_len")
    table = indices.host_int(bt.reshape(-1), "block_tables").reshape(len(lens), -1)
    for b, n in enumerate(-(-lens // page_size)):
        check_range(table[b, :n], 0, num_pages, "block_tables", "pages in kv_cache", offset=b * table.shape[1])


class Checked(NamedTuple):
    """An XQA call's arguments, checked (check()): the plan's shape and the launch's operands."""
    dev: int
    layout: str
    batch: int
    q_len: int
    hq: int
    hkv: int
    hd: int
    page_size: int
    pages: int  # block-table pages the plan covers (planned_pages)
    row_stride: int  # block_tables entries between rows
    words: int  # 32-bit mask words per query row (0: no mask)
    qdt: _dtypes.DType
    kdt: _dtypes.DType
    odt: _dtypes.DType
    cache: object  # what run_paged takes (operands.paged_cache's form)
    sf: object  # NVFP4 block scales in that form, else None
    bt: _tensor.TensorView
    sl: _tensor.TensorView
    msl: int
    num_pages: int
    mask_ptr: int
    s1: float
    s1_dev: int  # a device scale's address (0: the float s1)
    s2: float
    s2_dev: int

    def plan_key(self) -> tuple:
        """What the planned engine depends on (the launch's operands aside)."""
        return (self.dev, self.layout, self.batch, self.q_len, self.hq, self.hkv, self.hd, self.page_size, self.pages,
                self.row_stride, self.words, self.qdt.name, self.kdt.name, self.odt.name)


def xqa_batch_decode(query, kv_cache, workspace_buffer, block_tables, seq_lens, max_seq_len: int,
                     bmm1_scale=1.0, bmm2_scale=1.0, window_left: int = -1, out=None, sinks=None,
                     kv_layout: str = "NHD", enable_pdl=None, q_len_per_req: int | None = 1, o_scale=1.0,
                     mask=None, kv_cache_sf=None):
    """Batch decode over a paged cache addressed by block tables (FlashInfer's XQA API).

    query [B * q_len_per_req, Hq, D] fp16/bf16; kv_cache [P, 1|2, page_size, Hkv, D] (NHD) /
    [P, 1|2, Hkv, page_size, D] (HND), or a (k, v) tuple of 4-D pages, in query's dtype or fp8
    (e4m3 / e5m2), or NVFP4: uint8 e2m1 code pairs [..., D/2] (low nibble first) with
    kv_cache_sf, their float8_e4m3fn block scales [..., D/16] in the cache's form (one per 16
    head-dim elements; the global scales go into bmm1_scale / bmm2_scale; no mask). block_tables
    int32 [B, max_pages] (rows may be strided); seq_lens int32 or
    uint32 [B] on the device (<= max_seq_len); bmm1_scale = sm_scale * q_scale * k_scale,
    bmm2_scale = v_scale / o_scale, each a float or a one-element float32 device tensor (read by
    the kernel at launch: a CUDA graph replay sees the current value). Any page size, head dim
    64 / 128 / 256 and GQA group. sinks: float32 [Hq] or [Hkv, group]. q_len_per_req > 1
    (speculative decoding): draft i sits at seq_len - q_len_per_req + i; mask (uint16
    [B, q_len, ceil(q_len/32)*2], bit j of row i: draft i sees draft j; every key before the
    drafts is visible) or, without one, causal over the drafts. out: [B * q_len_per_req, Hq, D]
    in query's dtype, the other 16-bit dtype or float8_e4m3fn (any KV dtype; FlashInfer's XQA
    takes fp8 out only over an fp8 cache). The output is attention * bmm2_scale converted to
    out's dtype (e4m3: saturated to +-448, round to nearest even), so an fp8 out dequantises as
    out * o_scale: bmm2_scale = v_scale / o_scale already holds 1 / o_scale, and o_scale itself
    is only validated (as in FlashInfer, where it cancels). Returns out (allocated in query's
    dtype without one). workspace_buffer: the split-KV scratch (it need not be zeroed).
    """
    if query.__class__ in launch.TORCH_TYPES and kv_cache_sf is None:
        key = _torch_signature(query, kv_cache, block_tables, seq_lens, max_seq_len, bmm1_scale, bmm2_scale,
                               window_left, out, sinks, kv_layout, q_len_per_req, o_scale, mask)
        hit = _FAST.get(key) if key is not None else None
        if hit is not None and not metadata_checks_enabled():
            res = _run_fast(hit, query, kv_cache, workspace_buffer, block_tables, seq_lens, bmm1_scale, bmm2_scale,
                            out, sinks, mask, enable_pdl)
            if res is not None:
                return res
    else:
        key = None
    c = check(query, kv_cache, block_tables, seq_lens, max_seq_len, bmm1_scale, bmm2_scale, out, kv_layout,
              q_len_per_req, o_scale, mask, kv_cache_sf)
    planned_keys = c.pages * c.page_size
    if metadata_checks_enabled():
        _check_metadata(block_tables, seq_lens, c.msl, planned_keys, c.num_pages, c.page_size)
    e = _engine(workspace_buffer, c, window_left, bool(c.s1_dev))
    point(e.attn.params, c.bt.ptr, c.sl.ptr, planned_keys, c.num_pages, c.s1_dev, c.s2_dev, c.words, c.mask_ptr)
    res = e.run_paged(query, c.cache, k_scale=c.s1, v_scale=c.s2, out=out, enable_pdl=enable_pdl, sinks=sinks,
                      kv_cache_sf=c.sf)
    # validated: later calls of this signature take the fast path (not a [P, 1, ...] cache, run as two views)
    if key is not None and (c.cache is kv_cache or isinstance(kv_cache, tuple)):
        if len(_FAST) >= 4 * _MAX_ENGINES:
            _FAST.clear()
        _FAST[key] = (e, planned_keys, c.num_pages, c.words)
    return res


def check(query, kv_cache, block_tables, seq_lens, max_seq_len, bmm1_scale, bmm2_scale, out, kv_layout,
          q_len_per_req, o_scale, mask, kv_cache_sf, out_dtype=None) -> Checked:
    """Every check of an XQA call that needs no device data, in the eager API's order and words
    (tensors or TensorViews: pyflashattn.jax checks the views of its traced arguments). The
    output dtype is out's, else out_dtype's (pyflashattn.jax), else query's."""
    operands.scale_arg(o_scale, "o_scale")
    q_len = operands.positive_int(1 if q_len_per_req is None else q_len_per_req, "q_len_per_req")
    layout = operands.kv_layout(kv_layout)
    qv = _tensor.view(query, "query")
    operands.require_device(qv, "query", qv.device_id)
    dev = qv.device_id
    if qv.ndim != 3 or qv.shape[0] % q_len:
        raise ValueError(f"query must be [batch * q_len_per_req, num_heads, head_dim] with q_len_per_req="
                         f"{q_len}, got shape {qv.shape}")
    if qv.dtype not in (_dtypes.FLOAT16, _dtypes.BFLOAT16):
        raise TypeError(f"query must be float16 or bfloat16, got {qv.dtype.name}")
    # The output dtype is out's (query's without one): fp16, bf16 or e4m3 (checked in full at run)
    if out is not None:
        odt = operands.output_dtype(_tensor.view(out, "out").dtype, qv.dtype, "out")[0]
    else:
        odt = qv.dtype if out_dtype is None else operands.output_dtype(out_dtype, qv.dtype, "out_dtype")[0]
    batch, hq, hd = qv.shape[0] // q_len, qv.shape[1], qv.shape[2]
    cache, kshape, (page_size, hkv, dk), _ = operands.paged_cache(kv_cache, layout)
    num_pages = kshape[0]
    kdt = (_tensor.view(cache[0], "k_cache") if isinstance(cache, tuple) else _tensor.view(cache, "kv_cache")).dtype
    nvfp4 = kdt in operands.NVFP4_CODES
    if nvfp4 and kv_cache_sf is None:
        raise TypeError(f"kv_cache has dtype {kdt.name}, an NVFP4 cache (e2m1 code pairs): pass its float8_e4m3fn "
                        "block scales as kv_cache_sf")
    if kv_cache_sf is not None and not nvfp4:
        raise TypeError(f"kv_cache_sf is given, so kv_cache must be uint8 NVFP4 code pairs, got {kdt.name}")
    if kdt is not qv.dtype and kdt not in (_dtypes.FLOAT8_E4M3, _dtypes.FLOAT8_E5M2) and not nvfp4:
        raise TypeError(f"kv_cache has dtype {kdt.name}: it must be query's ({qv.dtype.name}), fp8 "
                        "(float8_e4m3fn, float8_e5m2) or uint8 NVFP4 codes with kv_cache_sf")
    if (2 * dk if nvfp4 else dk) != hd:
        raise ValueError(f"kv_cache head_dim {2 * dk if nvfp4 else dk} differs from query's {hd}"
                         + (f" (NVFP4: {dk} bytes of code pairs a row)" if nvfp4 else ""))
    if nvfp4 and mask is not None:
        raise NotImplementedError("mask: a speculative-decoding mask over an NVFP4 cache is not implemented in "
                                  "pyflashattn yet")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv_cache heads ({hkv})")
    bt = _tensor.view(block_tables, "block_tables")
    operands.require_device(bt, "block_tables", dev, "query")
    if bt.dtype is not _dtypes.INT32:
        raise TypeError(f"block_tables must be int32, got {bt.dtype.name}")
    if bt.ndim != 2 or bt.shape[0] != batch or (bt.shape[1] > 1 and bt.strides[1] != 1):
        raise ValueError(f"block_tables must be [batch={batch}, max_pages] with contiguous rows, got shape "
                         f"{bt.shape} strides {bt.strides}")
    sl = _tensor.view(seq_lens, "seq_lens")
    operands.index_array(sl, "seq_lens", dev, "query", (_dtypes.INT32, _dtypes.UINT32))
    if sl.shape != (batch,):
        raise ValueError(f"seq_lens must have shape ({batch},) (one length per request), got {sl.shape}")
    msl = operands.positive_int(max_seq_len, "max_seq_len")
    width = bt.shape[1]
    if msl > width * page_size:
        raise ValueError(f"max_seq_len={msl} exceeds what block_tables rows hold ({width} pages of {page_size})")
    row_stride = bt.strides[0] if batch > 1 else width
    if row_stride * batch > _INT32_MAX:
        raise ValueError("block_tables is too large for int32 page offsets")
    sf = _block_scales(kv_cache_sf, kv_cache, kshape, dev) if nvfp4 else None
    words, mask_ptr = _check_mask(mask, batch, q_len, dev) if mask is not None else (0, 0)
    s1, s1_dev = _scale(bmm1_scale, "bmm1_scale", dev)
    s2, s2_dev = _scale(bmm2_scale, "bmm2_scale", dev)
    return Checked(dev, layout, batch, q_len, hq, hkv, hd, page_size, planned_pages(msl, page_size, width),
                   row_stride, words, qv.dtype, kdt, odt, cache, sf, bt, sl, msl, num_pages, mask_ptr, s1, s1_dev,
                   s2, s2_dev)


def point(p, bt_ptr: int, sl_ptr: int, planned_keys: int, num_pages: int, s1_dev: int, s2_dev: int, words: int,
          mask_ptr: int) -> None:
    """A call's device metadata into the planned kernel's struct: the block table, the lengths, the
    device scales (0: the float ones) and the speculative-decoding mask."""
    p.kv_page_indices, p.kv_seq_lens, p.kv_max_len, p.num_pages = bt_ptr, sl_ptr, planned_keys, num_pages
    p.scale_dev, p.v_scale_dev = s1_dev, s2_dev
    if words:
        p.custom_mask, p.spec_mask_words = mask_ptr, words


def _sig(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.get_device())


def _torch_signature(query, kv_cache, bt, sl, max_seq_len, s1, s2, window_left, out, sinks, layout, q_len, o_scale,
                     mask):
    """What a validated torch call depends on besides addresses (None: not plain torch tensors)."""
    try:
        cache = tuple(map(_sig, kv_cache)) if isinstance(kv_cache, tuple) else _sig(kv_cache)
        return (_sig(query), cache, _sig(bt), _sig(sl), max_seq_len,
                s1 if s1.__class__ in _NUMBERS else _sig(s1), s2 if s2.__class__ in _NUMBERS else _sig(s2),
                window_left, _sig(out), _sig(sinks), layout, q_len, o_scale, _sig(mask))
    except (AttributeError, TypeError):  # not torch tensors (or an unhashable argument): the full path
        return None


def _run_fast(hit, query, kv_cache, workspace, bt, sl, s1, s2, out, sinks, mask, enable_pdl):
    """A torch call whose signature a validated call had: pointers, scales, launch (None: take
    the full path)."""
    e, planned_keys, num_pages, words = hit
    if workspace is not e.ws_buf:
        return None
    point(e.attn.params, bt.data_ptr(), sl.data_ptr(), planned_keys, num_pages,
          0 if s1.__class__ in _NUMBERS else s1.data_ptr(), 0 if s2.__class__ in _NUMBERS else s2.data_ptr(), words,
          mask.data_ptr() if words else 0)
    e.point_sinks(0 if sinks is None else sinks.data_ptr())  # validated with this signature
    e.apply_scales(float(s1) if s1.__class__ in _NUMBERS else None, float(s2) if s2.__class__ in _NUMBERS else None)
    kv_parts = tuple(kv_cache) if isinstance(kv_cache, tuple) else (kv_cache,)
    return e.torch_fast(query, kv_parts, out, None, False, None, enable_pdl)


def _engine(workspace, c: Checked, window_left, scale_on_device) -> BatchEngine:
    """The planned engine for this shape key (planned on first use, then reused)."""
    key = c.plan_key() + (window_left, scale_on_device)
    e = _ENGINES.get(key)
    if e is None:
        e = plan_engine(workspace, c, window_left, scale_on_device)
        if len(_ENGINES) >= _MAX_ENGINES:
            _ENGINES.popitem(last=False)
        _ENGINES[key] = e
    else:
        _ENGINES.move_to_end(key)
        if workspace is not e.ws_buf and _tensor.view(workspace, "workspace_buffer").ptr != e.ws_ptr:
            e.reset_workspace(workspace)
    return e


def plan_engine(workspace, c: Checked, window_left, scale_on_device: bool) -> BatchEngine:
    """A new engine planned for a checked call's shape (never re-planned after: capturable)."""
    e = BatchEngine(workspace, c.layout, False, True, capture_safe=True)
    words, q_len = c.words, c.q_len
    # A speculative-decoding mask takes the kernels that honour it (the manifest's spec_mask:
    # the lean paged decode tiles, else the general kernels); a device-side logit scale the
    # kernels that read it (device_scale: not the 128-row lean ones). SPEC_GENERAL_ENV=1
    # plans spec masks on the general kernels always (an A/B switch).
    general = bool(words) and os.environ.get(SPEC_GENERAL_ENV) == "1"
    settings = _settings(PlanSettings, (c.hq, c.hkv, c.hd, "NONE", False, None, None, None, "log2", c.qdt, c.kdt,
                                        window_left, 1.0, None, False, general, c.odt))
    src = indices.block_table_source(c.batch, q_len, c.pages * c.page_size, c.row_stride, c.page_size,
                                     q_len * words * 4)
    try:
        e.plan(src, settings, q_len > 1 and not words, None, None, False, None)
    except ValueError as err:  # the engine speaks of its own argument name
        if str(err).startswith("float_workspace_buffer"):
            raise ValueError("workspace_buffer" + str(err)[len("float_workspace_buffer"):].split(";")[0] +
                             "; pass a larger workspace_buffer") from None
        raise
    if (words and not e.attn.meta.get("spec_mask")) or (scale_on_device and not e.attn.meta.get("device_scale")):
        e.plan(src, settings._replace(general=True), q_len > 1 and not words, None, None, False, None)
    return e
