"""TensorRT-LLM prefill entry points over the batch engine: FlashInfer's trtllm_fmha_v2_prefill
(five input layouts) and trtllm_batch_context_with_kv_cache (a paged cache by block tables).

Both are plan-free calls: each copies its length metadata (and block tables) to the host (one
sync), builds a ragged or paged KV source from it, plans a cached BatchEngine (one per shape and
option key) and runs it. bmm1_scale is the logit scale (sm_scale * q_scale * k_scale, semantics
1.13): the plan's sm_scale is 1 and bmm1 is run()'s k_scale, so a new value only rewrites one
struct field; bmm2_scale is run()'s v_scale, the in-kernel output multiplier (every output dtype,
fp8 included). Tensor scales are read on the device by the general kernels (scale_dev).
The workspace is split-KV scratch only: pyflashattn keeps no state in it, so it needs no zeros
(FlashInfer's contract that the caller zeroes it once is harmless here).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .._runtime import dtypes as _dtypes, tensor as _tensor
from . import indices, operands
from .batch import BatchEngine
from .problem import PlanSettings

_ENGINES: OrderedDict = OrderedDict()
_MAX_ENGINES = 16
_FP8 = (_dtypes.FLOAT8_E4M3, _dtypes.FLOAT8_E5M2)


def host_array(x, name: str, dev: int, dtypes=(_dtypes.INT32,)) -> np.ndarray:
    """A device (or host) index tensor of any rank, checked and copied to the host (a sync)."""
    if isinstance(x, np.ndarray):
        return x
    v = _tensor.view(x, name)
    operands.require_device(v, name, dev, "query")
    if v.dtype not in dtypes:
        raise TypeError(f"{name} must be {' or '.join(d.name for d in dtypes)}, got {v.dtype.name}")
    flat = indices.host_int(x if v.ndim == 1 else x.reshape(-1), name)
    return flat.reshape(v.shape)


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
        raise NotImplementedError("out_dtype='nvfp4': the NVFP4 (FP4Tensor) output is not implemented in "
                                  "pyflashattn yet (16-bit and float8_e4m3fn outputs are)")
    if out is not None and hasattr(out, "scale") and hasattr(out, "data"):
        raise NotImplementedError("out: an FP4Tensor output is not implemented in pyflashattn yet")
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
    seq = host_array(seq_lens, "seq_lens", dev, ints)
    cq = host_array(cum_seq_lens_q, "cum_seq_lens_q", dev, ints)
    ck = host_array(cum_seq_lens_kv, "cum_seq_lens_kv", dev, ints)
    ql, kl = operands.trtllm_lengths(seq, cq, ck, batch_size, max_q_len, max_kv_len)
    return cq, ck, ql, kl


def plan_engine(dev, workspace, kv_layout, src, paged, heads, dtypes, causal, window_left, chunk, pos, soft_cap,
                general, stats):
    """The cached engine for this key, planned for src. heads = (Hq, Hkv, D); dtypes = (q, kv,
    out). Stats calls plan without split KV (the epilogue holds each row's true max) on the
    general kernels (the sm80 epilogue writes them). A workspace too small for a split plan
    plans without split KV."""
    hq, hkv, hd = heads
    qdt, kdt, odt = dtypes
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


def run_engine(e, q, kv, ragged, out, lse, return_lse, s1, s2, sinks, stats, pdl, skip_softmax=0.0):
    """Point the per-call fields (device scales, stats) and run. kv: (k, v) rows (ragged) or the
    paged cache form run_paged takes; skip_softmax: the validated skip-softmax factor (0 = off)."""
    p = e.attn.params
    p.scale_dev, p.v_scale_dev = s1[1], s2[1]
    p.softmax_stats = stats
    if ragged:
        return e.run_ragged(q, kv[0], kv[1], k_scale=s1[0], v_scale=s2[0], out=out, lse=lse, return_lse=return_lse,
                            enable_pdl=pdl, sinks=sinks, skip_softmax_threshold_scale_factor=skip_softmax)
    return e.run_paged(q, kv, k_scale=s1[0], v_scale=s2[0], out=out, lse=lse, return_lse=return_lse,
                       enable_pdl=pdl, sinks=sinks, skip_softmax_threshold_scale_factor=skip_softmax)


def paged_source_from_tables(cum_q, kv_lens, k_ids, page_size):
    """A paged KV source from the pages each request uses (concatenated K ids)."""
    pages = -(-kv_lens // page_size)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    last = np.where(pages > 0, kv_lens - (pages - 1) * page_size, 0).astype(np.int32)
    return indices.paged_source(cum_q.astype(np.int32), indptr, k_ids, last, page_size)


def shared_page_ids(k_ids, v_ids, v_shift: int, arg: str):
    """Separate K / V page ids as the one list the kernels take: V's ids must be K's plus
    v_shift (the pages between the two bases), else NotImplementedError naming arg."""
    if v_ids is not None and not np.array_equal(v_ids.astype(np.int64) - v_shift, k_ids):
        raise NotImplementedError(f"{arg}: separate K and V page ids that are not K's ids shifted by one "
                                  "constant are not implemented (the kernels read one page list)")
    return k_ids
