"""trtllm_batch_context_with_kv_cache (FlashInfer's TRT-LLM context phase, which FlashInfer runs
only on Blackwell) as a call of the batch engine over a paged cache by block tables: sm_80,
sm_89 and sm_90 (trtllm.py runs it)."""
from __future__ import annotations

import numpy as np

from .._runtime import dtypes as _dtypes, tensor as _tensor
from . import operands, options, trtllm
from .trtllm import host_array
from .xqa import _cache_parts

_16BIT = (_dtypes.FLOAT16, _dtypes.BFLOAT16)
_KV = (_dtypes.FLOAT16, _dtypes.BFLOAT16, _dtypes.FLOAT8_E4M3, _dtypes.FLOAT8_E5M2)


def _refuse_unbuilt(query_dtype, out_dtype, kv_block_scales):
    """NotImplementedError, naming the argument, for what the kernels do not do yet."""
    if query_dtype not in _16BIT:
        if query_dtype in (_dtypes.FLOAT8_E4M3, _dtypes.FLOAT8_E5M2):
            raise NotImplementedError("query: fp8 queries are not implemented in pyflashattn yet (an fp8 Q.K path is "
                                      "not built yet); pass float16 or bfloat16")
        raise TypeError(f"query must be float16 or bfloat16, got {query_dtype.name}")
    if kv_block_scales is not None:
        raise NotImplementedError("kv_block_scales / kv_cache_sf: an NVFP4 KV cache is not implemented for the "
                                  "context API yet (xqa_batch_decode_with_kv_cache takes one)")


def _page_ids(block_tables, uses_shared, batch, page_size, kv_lens, num_pages, dev):
    """The pages each request uses, from 2-D tables or (uses_shared_paged_kv_idx=False) 3-D
    [B, 2, M] K / V ids, which the kernels take only when they are equal."""
    if not isinstance(uses_shared, (bool, np.bool_)):
        raise TypeError(f"uses_shared_paged_kv_idx must be a bool, got {type(uses_shared).__name__}")
    table = host_array(block_tables, "block_tables", dev)
    k_ids, v_ids = operands.block_table_rows(table, batch, page_size, kv_lens, num_pages, not uses_shared)
    if v_ids is not None:
        trtllm.shared_page_ids(k_ids, v_ids, 0, "uses_shared_paged_kv_idx")
    return k_ids


def batch_context(query, kv_cache, workspace_buffer, block_tables, seq_lens, max_q_len, max_kv_len, bmm1_scale,
                  bmm2_scale, batch_size, cum_seq_lens_q, cum_seq_lens_kv, window_left=-1, out=None, out_dtype=None,
                  o_sf_scale=None, o_sf_vec_size=None, kv_layout="HND", enable_pdl=None, sinks=None,
                  kv_block_scales=None, skip_softmax_threshold_scale_factor=None, uses_shared_paged_kv_idx=True,
                  causal=True, lse=None, return_lse=False, kv_cache_sf=None, multi_ctas_kv_counter_buffer=None):
    """TRT-LLM context attention over a paged cache (FlashInfer's signature, semantics 1.15).
    multi_ctas_kv_counter_buffer is accepted and unused: it is trtllm-gen's scratch for its
    multi-CTA reduction, which pyflashattn's split-KV merge does not need (it changes no result)."""
    if kv_cache_sf is not None:
        if kv_block_scales is not None:
            raise ValueError("pass kv_block_scales or its alias kv_cache_sf, not both")
        kv_block_scales = kv_cache_sf
    for name, value in (("o_sf_scale", o_sf_scale), ("o_sf_vec_size", o_sf_vec_size)):
        if value is not None:  # they describe an NVFP4 output, which is not built
            raise NotImplementedError(f"{name}: the NVFP4 output (FP4Tensor) is not implemented in pyflashattn yet")
    layout = operands.kv_layout(kv_layout)
    qv = _tensor.view(query, "query")
    operands.require_cuda(qv, "query")
    dev = qv.device_id
    _refuse_unbuilt(qv.dtype, out_dtype, kv_block_scales)
    skip = options.skip_softmax_factor(skip_softmax_threshold_scale_factor)
    if qv.ndim != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got shape {qv.shape}")
    hq, hd = qv.shape[1], qv.shape[2]
    odt = trtllm.out_dtype_arg(out_dtype, out, qv.dtype)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    window_left = options.window(window_left)
    if not causal and window_left != -1:
        raise NotImplementedError("window_left: a sliding window without causal masking is not implemented (as in "
                                  "FlashInfer)")
    cache, kshape = _cache_parts(kv_cache, layout)
    num_pages = kshape[0]
    ps, hkv, dk = (kshape[1], kshape[2], kshape[3]) if layout == "NHD" else (kshape[2], kshape[1], kshape[3])
    kdt = (_tensor.view(cache[0], "k_cache") if isinstance(cache, tuple) else _tensor.view(cache, "kv_cache")).dtype
    if kdt is not qv.dtype and kdt not in _KV[2:]:
        raise TypeError(f"kv_cache must have the query's dtype ({qv.dtype.name}) or fp8, got {kdt.name}")
    if dk != hd:
        raise ValueError(f"kv_cache head_dim {dk} differs from query's {hd}")
    s1 = trtllm.scale_value(bmm1_scale, "bmm1_scale", dev)
    s2 = trtllm.scale_value(bmm2_scale, "bmm2_scale", dev)
    cq, ck, ql, kl = trtllm.host_lengths(seq_lens, cum_seq_lens_q, cum_seq_lens_kv, batch_size, max_q_len,
                                         max_kv_len, dev)
    if qv.shape[0] != int(cq[-1]):
        raise ValueError(f"query has {qv.shape[0]} tokens but cum_seq_lens_q[-1] = {int(cq[-1])}")
    k_ids = _page_ids(block_tables, uses_shared_paged_kv_idx, len(ql), ps, kl, num_pages, dev)
    src = trtllm.paged_source_from_tables(cq, kl, k_ids, ps)
    wl = int(window_left)
    e = trtllm.plan_engine(dev, workspace_buffer, layout, src, True, (hq, hkv, hd), (qv.dtype, kdt, odt), bool(causal),
                           wl, 0, "NONE", None, bool(s1[1] or s2[1]), False)
    return trtllm.run_engine(e, query, cache, False, out, lse, bool(return_lse), s1, s2, trtllm.sinks_arg(sinks), 0,
                             enable_pdl, skip)
