"""TensorRT-LLM prefill entry points over the batch engine: FlashInfer's trtllm_fmha_v2_prefill
(five input layouts, trtllm_fmha.py) and trtllm_batch_context_with_kv_cache (a paged cache by
block tables, trtllm_context.py) both end in attend().

Device metadata (cum_seq_lens_q, and cum_seq_lens_kv or seq_lens + block_tables, as device
tensors) takes trtllm_device.py's path: a plan per shape key, the kernel reading the arrays, no
sync, CUDA-graph capturable. Host metadata (numpy) is checked on the host and planned exactly
per call (split KV where it pays); a device array among host ones is copied to the host (a sync).
bmm1_scale is the logit scale (sm_scale * q_scale * k_scale, semantics 1.13): the plan's sm_scale
is 1 and bmm1 is run()'s k_scale, so a new value only rewrites one struct field; bmm2_scale is
run()'s v_scale, the in-kernel output multiplier (every output dtype, fp8 included). Tensor
scales are read on the device (scale_dev / v_scale_dev) by the kernels whose manifest says device_scale.
An e4m3 query (every fmha layout, and the context API over an e4m3 cache) plans the sm_90a fp8
prefill (fp8.py; its paged rows for a paged cache): the same
plan with q / kv dtype float8_e4m3fn, bmm1 / bmm2 run()'s number k_scale / v_scale as above.
The workspace is split-KV scratch only: pyflashattn keeps no state in it, so it needs no zeros
(FlashInfer's contract that the caller zeroes it once is harmless here).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from .._runtime import dtypes as _dtypes, tensor as _tensor
from . import indices, launch, nvfp4_out, operands, trtllm_device
from .batch import BatchEngine
from .problem import PlanSettings

_ENGINES: OrderedDict = OrderedDict()
_MAX_ENGINES = 16
_FP8 = (_dtypes.FLOAT8_E4M3, _dtypes.FLOAT8_E5M2)


def sinks_arg(sinks):
    """sinks as FlashInfer types it: a [H] tensor, or a list holding one."""
    if isinstance(sinks, (list, tuple)):
        if len(sinks) != 1:
            raise ValueError(f"sinks as a list must hold one [num_heads] float32 tensor, got {len(sinks)}")
        return sinks[0]
    return sinks


def out_dtype_arg(out_dtype, out, q_dtype):
    """The output dtype: out_dtype, else out's, else q's (16-bit or e4m3; fp32 refused)."""
    if isinstance(out_dtype, str) and out_dtype.lower() == "nvfp4":
        raise NotImplementedError("out_dtype='nvfp4': trtllm_fmha_v2_prefill has no NVFP4 output (16-bit and "
                                  "float8_e4m3fn outputs; trtllm_batch_context_with_kv_cache writes FP4Tensors)")
    if out is not None and hasattr(out, "scale") and hasattr(out, "data"):
        raise NotImplementedError("out: trtllm_fmha_v2_prefill has no FP4Tensor output (trtllm_batch_context_with_"
                                  "kv_cache has)")
    if out_dtype is not None:
        return operands.output_dtype(out_dtype, q_dtype, "out_dtype")[0]
    if out is not None:
        return operands.output_dtype(_tensor.view(out, "out").dtype, q_dtype, "out")[0]
    return q_dtype


def scale_value(x, name, dev):
    """(float, device address or 0): a number, or a one-element float32 device tensor."""
    if isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool):
        return operands.scale_arg(x, name), 0
    return 1.0, operands.device_scalar(x, name, dev)


def host_lengths(seq_lens, cum_seq_lens_q, cum_seq_lens_kv, batch_size, max_q_len, max_kv_len, dev) -> tuple:
    """Both APIs' length metadata on the host (one sync), checked against each other and the
    bounds: (cum_seq_lens_q, q lengths, kv lengths)."""
    ints = (_dtypes.INT32, _dtypes.UINT32)
    seq = trtllm_device.host_array(seq_lens, "seq_lens", dev, ints)
    cq = trtllm_device.host_array(cum_seq_lens_q, "cum_seq_lens_q", dev, ints)
    ck = trtllm_device.host_array(cum_seq_lens_kv, "cum_seq_lens_kv", dev, ints)
    ql, kl = operands.trtllm_lengths(seq, cq, ck, batch_size, max_q_len, max_kv_len)
    return cq, ck, ql, kl


class Paging(NamedTuple):
    """A paged call's block tables: [B, M], or (separate) [B, 2, M] K then V page ids; K ids
    address k_pages pages from K's base, V ids v_pages from V's base (the fmha tuple form's V
    base is K's: v_pages reaches V's last page)."""
    block_tables: object
    separate: bool
    page_size: int
    k_pages: int
    v_pages: int


class Call(NamedTuple):
    """A checked TRT-LLM call (trtllm_fmha.check / trtllm_context.check: no device data read) as
    attend() runs it. kv: (k, v) rows [tokens, Hkv, D] (paging None) or the paged cache form
    run_paged takes; heads = (Hq, Hkv, D); dtypes = (q, kv, out); mask = (causal, window_left,
    chunk); s1 / s2 = scale_value()s; lengths = (seq_lens, cum_seq_lens_q, cum_seq_lens_kv,
    batch_size, max_q_len, max_kv_len); skip: the validated skip-softmax factor (0 = off);
    kv_cache_sf: an NVFP4 cache's block scales (run_paged's form); o_sf_scale: given for the NVFP4
    output (out dtype operands.NVFP4_OUTPUT; out an FP4Tensor or None, nvfp4_out.bind)."""
    dev: int
    kv_layout: str
    q: object
    kv: object
    heads: tuple
    dtypes: tuple
    mask: tuple
    pos: str
    cap: object
    s1: tuple
    s2: tuple
    sinks: object
    stats: bool
    lengths: tuple
    paging: object
    skip: float
    kv_cache_sf: object = None
    o_sf_scale: object = None


_NEW_TUPLE = tuple.__new__


def new_call(*fields) -> Call:
    """A Call from its fields in order (the last two default to None), without NamedTuple's
    argument parsing: the eager calls build one each, on the serving path."""
    if len(fields) < len(Call._fields):
        fields += (None,) * (len(Call._fields) - len(fields))
    return _NEW_TUPLE(Call, fields)


def attend(c: Call, workspace, out, lse, return_lse, pdl):
    """Run one checked TRT-LLM call. Returns out (with stats / lse)."""
    dev, kv_layout, q, kv, heads, dtypes, mask, pos, cap, s1, s2, sinks, stats, lengths, paging, skip, kv_cache_sf, \
        o_sf_scale = c
    seq_lens, cum_q, cum_kv, batch, max_q, max_kv = lengths
    B, mq, mk = operands.trtllm_bounds(batch, max_q, max_kv)
    qv = _tensor.view(q, "query")
    ragged = paging is None
    kernel_reads = (cum_q, seq_lens) + ((cum_kv,) if ragged else (paging.block_tables,))
    on_device = trtllm_device.on_device(*kernel_reads)

    def plan(general):
        if on_device:
            return _device_plan(dev, workspace, kv_layout, qv, kv, heads, dtypes, mask, pos, cap, general, stats,
                                (B, mq, mk), lengths, paging)
        return _host_plan(dev, workspace, kv_layout, qv, heads, dtypes, mask, pos, cap, general, stats, (B, mq, mk),
                          lengths, paging)

    e = plan(False)
    # a tensor bmm1_scale needs a kernel that reads scale_dev (the manifest's device_scale: the
    # sm90 families, fp8 included, the general sm80 kernels, the decode tiles); every epilogue
    # reads v_scale_dev
    if s1[1] and not e.attn.meta.get("device_scale"):
        e = plan(True)
    st = st_v = None
    if stats:
        st, st_v = _tensor.empty(qv, (qv.shape[0], heads[0], 2), _dtypes.FLOAT32,
                                 launch.call_stream(None, qv.framework, dev))
    p = e.attn.params
    p.scale_dev, p.v_scale_dev = s1[1], s2[1]
    if paging is not None and not on_device:
        # the pages the ids may address, as trtllm_device.point sets them: the tuple form's V ids
        # count from K's base past K's pages, and V's TMA map (BatchEngine._point_maps) spans them
        p.num_pages = max(paging.k_pages, paging.v_pages)
    p.softmax_stats = st_v.ptr if st_v is not None else 0
    finish = None
    if o_sf_scale is not None:  # out: the FP4Tensor's data from here on
        out, finish = nvfp4_out.bind(e, out, qv, heads[2], o_sf_scale, launch.call_stream(None, qv.framework, dev))
    if ragged:
        res = e.run_ragged(q, kv[0], kv[1], k_scale=s1[0], v_scale=s2[0], out=out, lse=lse, return_lse=return_lse,
                           enable_pdl=pdl, sinks=sinks, skip_softmax_threshold_scale_factor=skip)
    else:
        res = e.run_paged(q, kv, k_scale=s1[0], v_scale=s2[0], out=out, lse=lse, return_lse=return_lse,
                          enable_pdl=pdl, sinks=sinks, skip_softmax_threshold_scale_factor=skip,
                          kv_cache_sf=kv_cache_sf)
    if finish is not None:
        res = finish(res)
    return (res, _tensor.finalize(st)) if stats else res


class DeviceMeta(NamedTuple):
    """device_metadata()'s addresses (0: not given) and the block table's geometry."""
    cum_q: int
    cum_kv: int = 0  # ragged K/V
    seq_lens: int = 0  # paged: the lengths, K's and V's page ids (V's 0: in K's table)
    k_ids: int = 0
    v_ids: int = 0
    row_stride: int = 0  # block-table entries between rows
    width: int = 0  # entries a row holds
    pages: int = 0  # pages the ids may address
    paged: bool = False


def device_metadata(dev, lengths, bounds, paging) -> DeviceMeta:
    """The device metadata's checks (views only: nothing read, no sync) and addresses.
    pyflashattn.jax runs it on trace-time views and again on XLA's buffers."""
    seq_lens, cum_q, cum_kv = lengths[:3]
    B, mq, mk = bounds
    named = (("cum_seq_lens_q", cum_q), ("seq_lens", seq_lens), ("cum_seq_lens_kv", cum_kv))
    if paging is None:
        cq, _, ck = operands.trtllm_device_lengths(named, B, dev)
        return DeviceMeta(cq, cum_kv=ck)
    cq, sl = operands.trtllm_device_lengths(named[:2], B, dev)
    if cum_kv is not None and not isinstance(cum_kv, np.ndarray):
        operands.trtllm_device_lengths(named[2:], B, dev)
    ps = paging.page_size
    bt, v_ids, row, width = operands.trtllm_device_block_table(paging.block_tables, B, paging.separate, -(-mk // ps),
                                                               dev)
    return DeviceMeta(cq, seq_lens=sl, k_ids=bt, v_ids=v_ids, row_stride=row, width=width,
                      pages=max(paging.k_pages, paging.v_pages), paged=True)


def point_metadata(e, meta: DeviceMeta, max_q: int, max_kv: int) -> None:
    """Point a device-lengths plan at device_metadata()'s addresses."""
    if not meta.paged:
        trtllm_device.point(e, meta.cum_q, max_q, max_kv, ragged_kv=meta.cum_kv)
    else:
        trtllm_device.point(e, meta.cum_q, max_q, max_kv, paged=(meta.seq_lens, meta.k_ids, meta.v_ids, meta.pages))


def _device_plan(dev, workspace, kv_layout, qv, kv, heads, dtypes, mask, pos, cap, general, stats, bounds, lengths,
                 paging):
    """trtllm_device's cached plan, pointed at this call's device metadata (no sync)."""
    seq_lens, cum_q, cum_kv = lengths[:3]
    B, mq, mk = bounds
    causal, wl, chunk = mask
    meta = device_metadata(dev, lengths, bounds, paging)
    if paging is None:
        trtllm_device.check_on_host(dev, seq_lens, cum_q, cum_kv, B, mq, mk, qv.shape[0],
                                    _tensor.view(kv[0], "k").shape[0])
        e = trtllm_device.plan(dev, workspace, kv_layout, False, heads, dtypes, B, mq, mk, causal, wl, chunk, pos,
                               cap, general, stats)
    else:
        trtllm_device.check_on_host(dev, seq_lens, cum_q, cum_kv, B, mq, mk, qv.shape[0],
                                    tables=(paging.block_tables, paging.page_size, paging.k_pages, paging.separate,
                                            paging.v_pages))
        e = trtllm_device.plan(dev, workspace, kv_layout, True, heads, dtypes, B, mq, mk, causal, wl, chunk, pos, cap,
                               general, stats, (paging.page_size, meta.row_stride, meta.width))
    point_metadata(e, meta, mq, mk)
    return e


def _host_plan(dev, workspace, kv_layout, qv, heads, dtypes, mask, pos, cap, general, stats, bounds, lengths, paging):
    """An exact plan from host metadata (device arrays among them copied: a sync), checked."""
    cq, ck, ql, kl = host_lengths(*lengths[:3], *bounds, dev)
    if qv.shape[0] != int(cq[-1]):
        raise ValueError(f"the query has {qv.shape[0]} tokens but cum_seq_lens_q[-1] = {int(cq[-1])}")
    if paging is None:
        src = indices.ragged_source(cq.astype(np.int32), ck.astype(np.int32))
    else:
        if paging.block_tables is None:
            raise ValueError("block_tables is required for a paged KV cache")
        table = trtllm_device.host_array(paging.block_tables, "block_tables", dev)
        k_ids, v_ids = operands.block_table_rows(table, bounds[0], paging.page_size, kl,
                                                 max(paging.k_pages, paging.v_pages), paging.separate)
        if paging.separate and k_ids.size and int(k_ids.max()) >= paging.k_pages:
            raise ValueError(f"block_tables holds K page id {int(k_ids.max())} outside the cache's "
                             f"{paging.k_pages} pages")
        src = paged_source_from_tables(cq, kl, k_ids, paging.page_size, v_ids)
    return plan_engine(dev, workspace, kv_layout, src, paging is not None, heads, dtypes, mask, pos, cap, general,
                       stats)


def plan_engine(dev, workspace, kv_layout, src, paged, heads, dtypes, mask, pos, soft_cap, general, stats):
    """The host path's cached engine for this key, planned for src. heads = (Hq, Hkv, D); dtypes
    = (q, kv, out). Stats calls plan without split KV (the epilogue holds each row's true max) on
    the general kernels (the sm80 epilogue writes them). A workspace too small for a split plan
    plans without split KV."""
    hq, hkv, hd = heads
    qdt, kdt, odt = dtypes
    causal, window_left, chunk = mask
    general = general or stats
    key = (dev, kv_layout, paged, heads, qdt.name, kdt.name, odt.name, pos, soft_cap, general, stats)
    e = _ENGINES.get(key)
    if e is None:
        e = BatchEngine(workspace, kv_layout, False, paged)
        if len(_ENGINES) >= _MAX_ENGINES:
            _ENGINES.popitem(last=False)
        _ENGINES[key] = e
    else:
        _ENGINES.move_to_end(key)
        if workspace is not e.ws_buf:
            e.reset_workspace(workspace)
    settings = PlanSettings(hq, hkv, hd, pos, False, soft_cap, None, None, "log2", qdt, kdt, window_left, 1.0, None,
                            False, general, odt)
    try:
        e.plan(src, settings, causal, None, None, stats, None, chunk)
    except ValueError as err:
        if not str(err).startswith("float_workspace_buffer") or stats:
            raise
        e.plan(src, settings, causal, None, None, True, None, chunk)
    return e


def paged_source_from_tables(cum_q, kv_lens, k_ids, page_size, v_ids=None):
    """A paged KV source from the pages each request uses (concatenated K ids, and V's own ids
    in the same order when they are separate)."""
    pages = -(-kv_lens // page_size)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    last = np.where(pages > 0, kv_lens - (pages - 1) * page_size, 0).astype(np.int32)
    src = indices.paged_source(cum_q.astype(np.int32), indptr, k_ids, last, page_size)
    if v_ids is None:
        return src
    return src._replace(kind="paged_v", arrays=src.arrays + (np.ascontiguousarray(v_ids, np.int32),))
