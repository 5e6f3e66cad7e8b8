"""trtllm_batch_context_with_kv_cache (FlashInfer's TRT-LLM context phase, which FlashInfer runs
only on Blackwell) as a call of the batch engine over a paged cache by block tables: sm_80,
sm_89 and sm_90 (trtllm.attend runs it; device metadata without a sync, capturable:
trtllm_device.py)."""
from __future__ import annotations

from .._runtime import tensor as _tensor
from . import operands, options, trtllm


def _refuse_unbuilt(kv_block_scales):
    """NotImplementedError, naming the argument, for what the kernels do not do yet."""
    if kv_block_scales is not None:
        raise NotImplementedError("kv_block_scales / kv_cache_sf: an NVFP4 KV cache is not implemented for the "
                                  "context API yet (xqa_batch_decode_with_kv_cache takes one)")


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
    operands.trtllm_query(qv, "query", "an fp8 Q.K path is not built yet")
    _refuse_unbuilt(kv_block_scales)
    skip = options.skip_softmax_factor(skip_softmax_threshold_scale_factor)
    hq, hd = qv.shape[1], qv.shape[2]
    odt = trtllm.out_dtype_arg(out_dtype, out, qv.dtype)
    causal, window_left = operands.trtllm_context_mask(causal, window_left)
    separate = not operands.bool_arg(uses_shared_paged_kv_idx, "uses_shared_paged_kv_idx")
    cache, kshape, (ps, hkv, dk), _ = operands.paged_cache(kv_cache, layout)
    kdt = (_tensor.view(cache[0], "k_cache") if isinstance(cache, tuple) else _tensor.view(cache, "kv_cache")).dtype
    operands.trtllm_kv(kdt, hkv, dk, qv, fp8=True)
    s1 = trtllm.scale_value(bmm1_scale, "bmm1_scale", dev)
    s2 = trtllm.scale_value(bmm2_scale, "bmm2_scale", dev)
    paging = trtllm.Paging(block_tables, separate, ps, kshape[0], kshape[0])
    return trtllm.attend(dev, workspace_buffer, layout, query, cache, (hq, hkv, hd), (qv.dtype, kdt, odt),
                         (causal, window_left, 0), "NONE", None, s1, s2, trtllm.sinks_arg(sinks), False, out, lse,
                         bool(return_lse), enable_pdl,
                         (seq_lens, cum_seq_lens_q, cum_seq_lens_kv, batch_size, max_q_len, max_kv_len), paging, skip)
