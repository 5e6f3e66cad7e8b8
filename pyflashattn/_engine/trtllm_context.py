"""trtllm_batch_context_with_kv_cache (FlashInfer's TRT-LLM context phase, which FlashInfer runs
only on Blackwell) as a call of the batch engine over a paged cache by block tables: sm_80,
sm_89 and sm_90 (trtllm.attend runs it; device metadata without a sync, capturable:
trtllm_device.py)."""
from __future__ import annotations

from .._runtime import tensor as _tensor
from . import nvfp4_out, operands, options, trtllm
from .xqa import _block_scales


def _kv_block_scales(kv_block_scales, kv_cache, kshape, layout, nvfp4: bool, kdt, dev):
    """An NVFP4 cache's block scales (kv_block_scales, [num_pages, num_kv_heads, page_size,
    head_dim // 16] e4m3 in HND: a (k, v) tuple or one [num_pages, 2, ...] tensor), checked with
    the seed's contiguity rule for HND (each row of scales, and a page's rows of one head,
    contiguous), in the form run_paged takes; None for any other cache."""
    if not nvfp4:
        if kv_block_scales is not None:
            raise TypeError(f"kv_block_scales / kv_cache_sf: block scales belong to an NVFP4 cache (uint8 e2m1 code "
                            f"pairs), but kv_cache is {kdt.name}")
        return None
    if kv_block_scales is None:
        raise TypeError(f"kv_cache is {kdt.name}, an NVFP4 cache (e2m1 code pairs): pass its float8_e4m3fn block "
                        "scales as kv_block_scales (or kv_cache_sf)")
    if layout == "HND":
        sf_cols = kshape[-1] // 8  # head_dim // 16 of a cache with head_dim // 2 code bytes a row
        parts = kv_block_scales if isinstance(kv_block_scales, (tuple, list)) else (kv_block_scales,)
        for t in parts:
            v = _tensor.view(t, "kv_block_scales")
            if v.ndim >= 2 and v.shape[-2] > 1 and (v.strides[-1] != 1 or v.strides[-2] != sf_cols):
                raise ValueError(f"kv_block_scales: the last two dims (page_size, head_dim // 16) must be contiguous "
                                 f"(strides (..., {sf_cols}, 1)), got strides {v.strides}")
    return _block_scales(kv_block_scales, kv_cache, kshape, dev)


def batch_context(query, kv_cache, workspace_buffer, block_tables, seq_lens, max_q_len, max_kv_len, bmm1_scale,
                  bmm2_scale, batch_size, cum_seq_lens_q, cum_seq_lens_kv, window_left=-1, out=None, out_dtype=None,
                  o_sf_scale=None, o_sf_vec_size=None, kv_layout="HND", enable_pdl=None, sinks=None,
                  kv_block_scales=None, skip_softmax_threshold_scale_factor=None, uses_shared_paged_kv_idx=True,
                  causal=True, lse=None, return_lse=False, kv_cache_sf=None, multi_ctas_kv_counter_buffer=None):
    """TRT-LLM context attention over a paged cache (FlashInfer's signature, semantics 1.15).
    multi_ctas_kv_counter_buffer is accepted and unused: it is trtllm-gen's scratch for its
    multi-CTA reduction, which pyflashattn's split-KV merge does not need (it changes no result).
    out_dtype="nvfp4" (with o_sf_scale), or an FP4Tensor out, writes the NVFP4 output
    (nvfp4_out.py); a uint8 cache with kv_block_scales (alias kv_cache_sf) is an NVFP4 cache."""
    c = check(query, kv_cache, block_tables, seq_lens, max_q_len, max_kv_len, bmm1_scale, bmm2_scale, batch_size,
              cum_seq_lens_q, cum_seq_lens_kv, window_left, out, out_dtype, o_sf_scale, o_sf_vec_size, kv_layout,
              sinks, kv_block_scales, skip_softmax_threshold_scale_factor, uses_shared_paged_kv_idx, causal,
              kv_cache_sf)
    return trtllm.attend(c, workspace_buffer, out, lse, bool(return_lse), enable_pdl)


def check(query, kv_cache, block_tables, seq_lens, max_q_len, max_kv_len, bmm1_scale, bmm2_scale, batch_size,
          cum_seq_lens_q, cum_seq_lens_kv, window_left, out, out_dtype, o_sf_scale, o_sf_vec_size, kv_layout, sinks,
          kv_block_scales, skip_softmax_threshold_scale_factor, uses_shared_paged_kv_idx, causal,
          kv_cache_sf) -> trtllm.Call:
    """Every check of a context call that reads no device data, in the eager order and words
    (tensors or TensorViews: pyflashattn.jax runs it on trace-time views and on XLA's buffers)."""
    if kv_cache_sf is not None:
        if kv_block_scales is not None:
            raise ValueError("pass kv_block_scales or its alias kv_cache_sf, not both")
        kv_block_scales = kv_cache_sf
    fp4_out = nvfp4_out.wanted(out_dtype, out, o_sf_scale, o_sf_vec_size)
    layout = operands.kv_layout(kv_layout)
    qv = _tensor.view(query, "query")
    operands.require_cuda(qv, "query")
    dev = qv.device_id
    operands.trtllm_query(qv, "query")
    skip = options.skip_softmax_factor(skip_softmax_threshold_scale_factor)
    hq, hd = qv.shape[1], qv.shape[2]
    odt = operands.NVFP4_OUTPUT if fp4_out else trtllm.out_dtype_arg(out_dtype, out, qv.dtype)
    causal, window_left = operands.trtllm_context_mask(causal, window_left)
    separate = not operands.bool_arg(uses_shared_paged_kv_idx, "uses_shared_paged_kv_idx")
    cache, kshape, (ps, hkv, dk), _ = operands.paged_cache(kv_cache, layout)
    kdt = (_tensor.view(cache[0], "k_cache") if isinstance(cache, tuple) else _tensor.view(cache, "kv_cache")).dtype
    operands.trtllm_kv(kdt, hkv, dk, qv, fp8=True, nvfp4=True)
    sf = _kv_block_scales(kv_block_scales, kv_cache, kshape, layout, kdt in operands.NVFP4_CODES, kdt, dev)
    s1 = trtllm.scale_value(bmm1_scale, "bmm1_scale", dev)
    s2 = trtllm.scale_value(bmm2_scale, "bmm2_scale", dev)
    paging = trtllm.Paging(block_tables, separate, ps, kshape[0], kshape[0])
    return trtllm.new_call(dev, layout, query, cache, (hq, hkv, hd), (qv.dtype, kdt, odt), (causal, window_left, 0),
                           "NONE", None, s1, s2, trtllm.sinks_arg(sinks), False,
                           (seq_lens, cum_seq_lens_q, cum_seq_lens_kv, batch_size, max_q_len, max_kv_len), paging, skip,
                           sf, o_sf_scale if fp4_out else None)
