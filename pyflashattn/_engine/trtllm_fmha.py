"""trtllm_fmha_v2_prefill (FlashInfer's TRT-LLM FMHAv2 prefill) as a call of the batch engine:
its five input layouts become ragged K/V rows or a paged cache (trtllm.py runs them)."""
from __future__ import annotations

import math

import numpy as np

from .._runtime import dtypes as _dtypes, tensor as _tensor
from . import indices, launch, operands, options, trtllm
from .trtllm import host_array

_16BIT = (_dtypes.FLOAT16, _dtypes.BFLOAT16)
_FP8_IN = (_dtypes.FLOAT8_E4M3, _dtypes.FLOAT8_E5M2)


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
        return t[:, 0], (t[:, 1], t[:, 2]), "NHD", True
    if layout == "CONTIGUOUS_Q_KV":
        q, kv = _parts(qkv, 2, layout)
        v = _tensor.view(kv, "qkv[1] (KV)")
        if v.ndim != 4 or v.shape[1] != 2:
            raise ValueError(f"KV must be [num_tokens, 2, num_kv_heads, head_dim] for CONTIGUOUS_Q_KV, got shape "
                             f"{v.shape}")
        return q, (kv[:, 0], kv[:, 1]), "NHD", True
    if layout == "SEPARATE_Q_K_V":
        q, k, v = _parts(qkv, 3, layout)
        return q, (k, v), "NHD", True
    kv_layout = layout[-3:]
    if isinstance(qkv, (tuple, list)) and len(qkv) == 3:
        return qkv[0], (qkv[1], qkv[2]), kv_layout, False
    q, cache = _parts(qkv, 2, layout)
    return q, (tuple(cache) if isinstance(cache, (tuple, list)) else cache), kv_layout, False


def _cache_geometry(cache, kv_layout):
    """(K view, pages, page_size, Hkv, D, V's offset from K in K pages or None) of a paged cache."""
    if isinstance(cache, tuple):
        if len(cache) != 2:
            raise ValueError("the paged KV tuple must be (k_cache, v_cache)")
        k, v = _tensor.view(cache[0], "k_cache"), _tensor.view(cache[1], "v_cache")
        if k.ndim != 4 or v.shape != k.shape:
            raise ValueError(f"k_cache and v_cache must be alike 4-D [num_pages, ...] ({kv_layout}), got {k.shape} "
                             f"and {v.shape}")
        shape = k.shape
        unit = k.strides[0] * (k.dtype.bits // 8)
        diff = v.ptr - k.ptr
        shift = diff // unit if unit and diff % unit == 0 else None
    else:
        k = _tensor.view(cache, "paged_kv")
        if k.ndim != 5 or k.shape[1] != 2:
            raise ValueError(f"paged KV must be [num_pages, 2, ...] ({kv_layout}) or a (k, v) tuple, got shape "
                             f"{k.shape}")
        shape, shift = (k.shape[0],) + k.shape[2:], None
    ps, hkv = (shape[1], shape[2]) if kv_layout == "NHD" else (shape[2], shape[1])
    return k, shape[0], ps, hkv, shape[3], shift


def _paged_source(cache, kv_layout, block_tables, cum_q, kv_lens, batch, dev):
    """The paged KV source of a Q_PAGED_KV_* call; [B, 2, M] tables (the tuple form) hold K / V
    page offsets from K's base, which must be K's ids plus V's distance from K."""
    if block_tables is None:
        raise ValueError("block_tables is required for the paged input layouts (Q_PAGED_KV_NHD / HND)")
    k, pages, ps, hkv, hd, shift = _cache_geometry(cache, kv_layout)
    table = host_array(block_tables, "block_tables", dev)
    separate = table.ndim == 3
    if separate and shift is None:
        raise ValueError("block_tables [batch_size, 2, max_pages] (K / V offsets from K's base) needs the (k, v) "
                         "tuple form of one allocation, V at a whole number of K pages from K")
    span = pages + (max(shift, 0) if separate else 0)  # offsets may reach into V's pages
    k_ids, v_ids = operands.block_table_rows(table, batch, ps, kv_lens, span, separate)
    if separate:
        if k_ids.size and k_ids.max() >= pages:
            raise ValueError(f"block_tables holds K offset {int(k_ids.max())} outside k_cache's {pages} pages")
        trtllm.shared_page_ids(k_ids, v_ids, shift, "block_tables")
    return trtllm.paged_source_from_tables(cum_q, kv_lens, k_ids, ps), (k.dtype, hkv, hd)


def fmha_v2_prefill(qkv, input_layout, workspace_buffer, seq_lens, max_q_len, max_kv_len, bmm1_scale, bmm2_scale,
                    batch_size, cum_seq_lens_q, cum_seq_lens_kv, block_tables=None, out=None, out_dtype=None,
                    sinks=None, pos_encoding_mode=None, logits_soft_cap_scale=None, mask_mode="causal",
                    window_left=-1, chunked_attention_size=0, save_softmax_stats=False,
                    skip_softmax_threshold_scale_factor=0):
    """TRT-LLM FMHAv2 prefill (FlashInfer's signature and semantics 1.14; see the README)."""
    layout = operands.trtllm_input_layout(input_layout)
    causal, wl, chunk = operands.trtllm_mask(mask_mode, window_left, chunked_attention_size)
    skip = options.skip_softmax_factor(skip_softmax_threshold_scale_factor)
    q, kv, kv_layout, ragged = parse_layout(qkv, layout)
    qv = _tensor.view(q, "qkv (query)")
    operands.require_cuda(qv, "qkv (query)")
    dev = qv.device_id
    if qv.dtype in _FP8_IN:
        raise NotImplementedError("qkv: fp8 e4m3 inputs are not implemented in pyflashattn yet (an fp8 Q.K path is "
                                  "not built yet); pass float16 or bfloat16")
    if qv.dtype not in _16BIT:
        raise TypeError(f"qkv must be float16 or bfloat16, got {qv.dtype.name}")
    if qv.ndim != 3:
        raise ValueError(f"the query must be [num_tokens, num_heads, head_dim], got shape {qv.shape}")
    hq, hd = qv.shape[1], qv.shape[2]
    if not isinstance(save_softmax_stats, (bool, np.bool_)):
        raise TypeError(f"save_softmax_stats must be a bool, got {type(save_softmax_stats).__name__}")
    pos = _pos_encoding(pos_encoding_mode)
    cap = None if logits_soft_cap_scale in (None, 0, 0.0) else float(logits_soft_cap_scale)
    odt = trtllm.out_dtype_arg(out_dtype, out, qv.dtype)
    s1 = trtllm.scale_value(1.0 / math.sqrt(hd) if _is_zero(bmm1_scale) else bmm1_scale, "bmm1_scale", dev)
    s2 = trtllm.scale_value(bmm2_scale, "bmm2_scale", dev)
    cq, ck, ql, kl = trtllm.host_lengths(seq_lens, cum_seq_lens_q, cum_seq_lens_kv, batch_size, max_q_len,
                                         max_kv_len, dev)
    if layout == "PACKED_QKV" and not np.array_equal(ql, kl):
        raise ValueError("PACKED_QKV holds each token's query, key and value: cum_seq_lens_q must equal "
                         "cum_seq_lens_kv")
    if ragged:
        src = indices.ragged_source(cq.astype(np.int32), ck.astype(np.int32))
        kdt, hkv = _tensor.view(kv[0], "k").dtype, _tensor.view(kv[0], "k").shape[-2]
    else:
        src, (kdt, hkv, dk) = _paged_source(kv, kv_layout, block_tables, cq, kl, len(ql), dev)
        if dk != hd:
            raise ValueError(f"the paged KV head_dim {dk} differs from the query's {hd}")
    if kdt is not qv.dtype:
        raise TypeError(f"K/V must have the query's dtype ({qv.dtype.name}), got {kdt.name}")
    if layout == "PACKED_QKV" and hkv != hq:
        raise ValueError("PACKED_QKV is multi-head attention: num_kv_heads must equal num_heads")
    stats = stats_v = None
    if save_softmax_stats:
        stats, stats_v = _tensor.empty(qv, (qv.shape[0], hq, 2), _dtypes.FLOAT32,
                                       launch.call_stream(None, qv.framework, dev))
    e = trtllm.plan_engine(dev, workspace_buffer, kv_layout, src, not ragged, (hq, hkv, hd), (qv.dtype, kdt, odt),
                           causal, wl, chunk, pos, cap, bool(s1[1] or s2[1]), bool(save_softmax_stats))
    res = trtllm.run_engine(e, q, kv, ragged, out, None, False, s1, s2, trtllm.sinks_arg(sinks),
                            stats_v.ptr if stats_v is not None else 0, None, skip)
    return (res, _tensor.finalize(stats)) if save_softmax_stats else res


def _is_zero(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and x == 0


def _pos_encoding(mode) -> str:
    """pos_encoding_mode: None / 'none' or 'alibi' (FlashInfer's slopes)."""
    if mode is None:
        return "NONE"
    m = mode.upper() if isinstance(mode, str) else None
    if m not in ("NONE", "ALIBI"):
        raise ValueError(f"pos_encoding_mode must be None or 'alibi', got {mode!r}")
    return m
