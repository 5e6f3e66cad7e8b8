"""trtllm_fmha_v2_prefill (FlashInfer's TRT-LLM FMHAv2 prefill) as a call of the batch engine:
its five input layouts become ragged K/V rows or a paged cache (trtllm.attend runs them; device
metadata without a sync, capturable: trtllm_device.py)."""
from __future__ import annotations

import math

import numpy as np

from .._runtime import dtypes as _dtypes, tensor as _tensor
from . import fp8, operands, options, trtllm
from .metadata_check import metadata_checks_enabled
from .trtllm_device import host_array


def _parts(qkv, n: int, layout: str) -> tuple:
    if not isinstance(qkv, (tuple, list)) or len(qkv) != n:
        raise ValueError(f"qkv must be a tuple of {n} tensors for input_layout={layout!r}, got "
                         f"{type(qkv).__name__}{'' if not isinstance(qkv, (tuple, list)) else f' of {len(qkv)}'}")
    return tuple(qkv)


def parse_layout(qkv, layout: str):
    """(q, K/V, kv_layout, ragged): K/V = (k, v) row tensors [tokens, Hkv, D] for the ragged
    layouts; for the paged ones the 5-D cache [P, 2, ...] or a (k_cache, v_cache) pair of 4-D
    page tensors."""
    if layout == "PACKED_QKV":
        t = qkv[0] if isinstance(qkv, (tuple, list)) and len(qkv) == 1 else qkv
        v = _tensor.view(t, "qkv")
        if v.ndim != 4 or v.shape[1] != 3:
            raise ValueError(f"qkv must be [num_tokens, 3, num_heads, head_dim] for PACKED_QKV, got shape {v.shape}")
        v = _tensor.launch_view(t, "qkv", v)  # (checked first: bad input raises before the driver is asked)
        return _tensor.slice_dim1(t, v, 0), (_tensor.slice_dim1(t, v, 1), _tensor.slice_dim1(t, v, 2)), "NHD", True
    if layout == "CONTIGUOUS_Q_KV":
        q, kv = _parts(qkv, 2, layout)
        v = _tensor.view(kv, "qkv[1] (KV)")
        if v.ndim != 4 or v.shape[1] != 2:
            raise ValueError(f"KV must be [num_tokens, 2, num_kv_heads, head_dim] for CONTIGUOUS_Q_KV, got shape "
                             f"{v.shape}")
        v = _tensor.launch_view(kv, "qkv[1] (KV)", v)
        return q, (_tensor.slice_dim1(kv, v, 0), _tensor.slice_dim1(kv, v, 1)), "NHD", True
    if layout == "SEPARATE_Q_K_V":
        q, k, v = _parts(qkv, 3, layout)
        return q, (k, v), "NHD", True
    kv_layout = layout[-3:]
    if isinstance(qkv, (tuple, list)) and len(qkv) == 3:
        return qkv[0], (qkv[1], qkv[2]), kv_layout, False
    q, cache = _parts(qkv, 2, layout)
    return q, (tuple(cache) if isinstance(cache, (tuple, list)) else cache), kv_layout, False


def _paging(cache, kv_layout, block_tables):
    """(run form of the cache, trtllm.Paging, (kv dtype, Hkv, D)) of a Q_PAGED_KV_* call. [B, 2, M]
    tables (the tuple form) hold K / V page offsets from K's base: V is then read from K's base
    (the pair (k, k)), its ids reaching V's last page."""
    if block_tables is None:
        raise ValueError("block_tables is required for the paged input layouts (Q_PAGED_KV_NHD / HND)")
    form, shape, (ps, hkv, hd), shift = operands.paged_cache(cache, kv_layout, kv_dims=(2,))
    separate = _ndim(block_tables) == 3
    pages = shape[0]
    if separate:
        if not isinstance(cache, tuple) or shift is None:
            raise ValueError("block_tables [batch_size, 2, max_pages] (K / V offsets from K's base) needs the (k, v) "
                             "tuple form of one allocation: V alike K (dtype, strides), a whole number of K pages "
                             "after it")
        form = (cache[0], cache[0])
    kv_dtype = _tensor.view(form[0] if isinstance(form, tuple) else form, "paged_kv").dtype
    return form, trtllm.Paging(block_tables, separate, ps, pages, pages + shift if separate else pages), \
        (kv_dtype, hkv, hd)


def _ndim(x) -> int:
    return x.ndim if isinstance(x, np.ndarray) else _tensor.view(x, "block_tables").ndim


def fmha_v2_prefill(qkv, input_layout, workspace_buffer, seq_lens, max_q_len, max_kv_len, bmm1_scale, bmm2_scale,
                    batch_size, cum_seq_lens_q, cum_seq_lens_kv, block_tables=None, out=None, out_dtype=None,
                    sinks=None, pos_encoding_mode=None, logits_soft_cap_scale=None, mask_mode="causal",
                    window_left=-1, chunked_attention_size=0, save_softmax_stats=False,
                    skip_softmax_threshold_scale_factor=0):
    """TRT-LLM FMHAv2 prefill (FlashInfer's signature and semantics 1.14; see the README)."""
    c = check(qkv, input_layout, seq_lens, max_q_len, max_kv_len, bmm1_scale, bmm2_scale, batch_size, cum_seq_lens_q,
              cum_seq_lens_kv, block_tables, out, out_dtype, sinks, pos_encoding_mode, logits_soft_cap_scale,
              mask_mode, window_left, chunked_attention_size, save_softmax_stats, skip_softmax_threshold_scale_factor)
    return trtllm.attend(c, workspace_buffer, out, None, False, None)


def check(qkv, input_layout, seq_lens, max_q_len, max_kv_len, bmm1_scale, bmm2_scale, batch_size, cum_seq_lens_q,
          cum_seq_lens_kv, block_tables, out, out_dtype, sinks, pos_encoding_mode, logits_soft_cap_scale, mask_mode,
          window_left, chunked_attention_size, save_softmax_stats, skip_softmax_threshold_scale_factor) -> trtllm.Call:
    """Every check of an fmha call that reads no device data, in the eager order and words
    (tensors or TensorViews: pyflashattn.jax runs it on trace-time views and on XLA's buffers)."""
    layout = operands.trtllm_input_layout(input_layout)
    mask = operands.trtllm_mask(mask_mode, window_left, chunked_attention_size)
    skip = options.skip_softmax_factor(skip_softmax_threshold_scale_factor)
    q, kv, kv_layout, ragged = parse_layout(qkv, layout)
    qv = _tensor.view(q, "qkv (query)")
    operands.require_cuda(qv, "qkv (query)")
    dev = qv.device_id
    operands.trtllm_query(qv, "qkv")
    hq, hd = qv.shape[1], qv.shape[2]
    stats = operands.bool_arg(save_softmax_stats, "save_softmax_stats")
    pos = operands.trtllm_pos_encoding(pos_encoding_mode)
    cap = None if logits_soft_cap_scale in (None, 0, 0.0) else float(logits_soft_cap_scale)
    if fp8.is_fp8(qv.dtype):
        _fp8_options(pos, cap, stats, skip)
    odt = trtllm.out_dtype_arg(out_dtype, out, qv.dtype)
    s1 = trtllm.scale_value(1.0 / math.sqrt(hd) if _is_zero(bmm1_scale) else bmm1_scale, "bmm1_scale", dev)
    s2 = trtllm.scale_value(bmm2_scale, "bmm2_scale", dev)
    paging = None
    if ragged:
        kview = _tensor.view(kv[0], "k")
        kdt, hkv, dk = kview.dtype, kview.shape[-2], kview.shape[-1]
        if layout == "PACKED_QKV" and cum_seq_lens_q is not cum_seq_lens_kv:
            _same_lengths(cum_seq_lens_q, cum_seq_lens_kv)
    else:
        kv, paging, (kdt, hkv, dk) = _paging(kv, kv_layout, block_tables)
    operands.trtllm_kv(kdt, hkv, dk, qv, packed=layout == "PACKED_QKV")
    return trtllm.new_call(dev, kv_layout, q, kv, (hq, hkv, hd), (qv.dtype, kdt, odt), mask, pos, cap, s1, s2,
                           trtllm.sinks_arg(sinks), stats,
                           (seq_lens, cum_seq_lens_q, cum_seq_lens_kv, batch_size, max_q_len, max_kv_len), paging, skip)


def _fp8_options(pos, cap, stats, skip) -> None:
    """The options the fp8 prefill kernels lack (fp8.py: lean options only), refused by name
    before any plan; sm_90 and the K/V layout are fp8.check_call's (at plan)."""
    for on, name in ((pos != "NONE", "pos_encoding_mode='alibi'"), (cap is not None, "logits_soft_cap_scale"),
                     (stats, "save_softmax_stats")):
        if on:
            raise NotImplementedError(f"{name} with fp8 (float8_e4m3fn) qkv is not implemented in pyflashattn (the "
                                      "fp8 prefill kernels take causal, padding, sliding-window and chunked masks, "
                                      "sinks and bmm1 / bmm2 scales)")
    if skip:
        fp8.refuse_skip_softmax()


def _same_lengths(cum_q, cum_kv):
    """PACKED_QKV holds each token's query, key and value: the two indptrs must agree (checked
    where they are on the host; device arrays only in the checked mode: no sync)."""
    if isinstance(cum_q, np.ndarray) and isinstance(cum_kv, np.ndarray):
        a, b = cum_q, cum_kv
    elif metadata_checks_enabled():
        a = host_array(cum_q, "cum_seq_lens_q", _tensor.view(cum_q, "cum_seq_lens_q").device_id,
                       (_dtypes.INT32, _dtypes.UINT32))
        b = host_array(cum_kv, "cum_seq_lens_kv", _tensor.view(cum_kv, "cum_seq_lens_kv").device_id,
                       (_dtypes.INT32, _dtypes.UINT32))
    else:
        return
    if not np.array_equal(np.asarray(a, np.int64), np.asarray(b, np.int64)):
        raise ValueError("PACKED_QKV holds each token's query, key and value: cum_seq_lens_q must equal "
                         "cum_seq_lens_kv")


def _is_zero(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and x == 0
