"""Decode attention with FlashInfer's API (``flashinfer.decode``).

    o = single_decode_with_kv_cache(q, k, v)                 # q [Hq, D], k/v [kv_len, Hkv, D]

    w = BatchDecodeWithPagedKVCacheWrapper(float_workspace)
    w.plan(kv_indptr, kv_indices, kv_last_page_len, Hq, Hkv, D, page_size, q_data_type=...)
    o = w.run(q, paged_kv_cache)                             # q [B, Hq, D] (or [B * q_len_per_req, Hq, D])

    o = xqa_batch_decode_with_kv_cache(q, kv_cache, workspace, block_tables, seq_lens, max_seq_len)

Decode is attention of each request's newest token(s) over its whole cache: the same engine as
prefill (a batch plan whose requests have q_len_per_req query rows each), run on the decode
tiles, which pack a request's query heads (and draft tokens) into the rows of one MMA tile so a
KV-cache stream feeds every query head of a KV head at once. Any GQA group size works (FlashInfer's
CUDA-core decode takes only some). ``use_tensor_cores`` is accepted and changes nothing: every
path here runs on tensor cores.

Conventions: FlashInfer's (see ``pyflashattn.prefill``): base-2 LSE over the scaled logits, an
empty request gives o = 0 and lse = -inf. q_len_per_req > 1 (speculative decoding): draft i of a
request sits at position kv_len - q_len_per_req + i and sees the keys up to itself (causal,
FlashInfer's tensor-core decode).
"""
from __future__ import annotations

import numpy as np

from ._engine import indices, operands, xqa as _xqa
from ._engine.batch import BatchEngine
from ._engine.problem import PlanSettings
from ._engine.single import single_prefill
from ._runtime import tensor as _tensor

__all__ = ["single_decode_with_kv_cache", "BatchDecodeWithPagedKVCacheWrapper", "xqa_batch_decode_with_kv_cache"]

_settings = tuple.__new__  # PlanSettings from its fields in order (as prefill.py)


def _unsupported(name, value, what):
    if value is not None:
        raise NotImplementedError(f"{name}: {what} is not implemented in pyflashattn yet")


def single_decode_with_kv_cache(q, k, v, kv_layout: str = "NHD", pos_encoding_mode: str = "NONE",
                                use_tensor_cores: bool = False, q_scale=None, k_scale=None, v_scale=None,
                                window_left: int = -1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
                                rope_theta=None, return_lse: bool = False, *, out=None, lse=None, stream=None,
                                lse_base: str = "log2"):
    """Attention of one query token q [num_qo_heads, head_dim] over k, v [kv_len, Hkv, D] (NHD)
    or [Hkv, kv_len, D] (HND). q_scale and k_scale multiply the logit scale, v_scale the output
    (in the kernel). RoPE (pos_encoding_mode="ROPE_LLAMA") places the query at kv_len - 1.
    Returns o [Hq, D] (and lse [Hq] with return_lse); out= / lse= take those shapes."""
    qv = _tensor.view(q, "q")
    if qv.ndim != 2:
        raise ValueError(f"q must be 2-D [num_qo_heads, head_dim], got shape {qv.shape}")
    if q_scale is not None:
        k_scale = operands.scale_arg(q_scale, "q_scale") * operands.scale_arg(k_scale, "k_scale")
    out3 = None if out is None else _one_token(out, "out", 2)
    lse2 = None if lse is None else _one_token(lse, "lse", 1)
    res = single_prefill(q[None], k, v, causal=False, kv_layout=kv_layout, pos_encoding_mode=pos_encoding_mode,
                         sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap,
                         rope_scale=rope_scale, rope_theta=rope_theta, return_lse=return_lse, out=out3, lse=lse2,
                         stream=stream, lse_base=lse_base, k_scale=k_scale, v_scale=v_scale)
    if return_lse:
        o, s = res
        return (out if out is not None else o[0]), (lse if lse is not None else s[0])
    if out is not None:
        return out
    return res[0]


def _one_token(x, name, ndim):
    """out / lse of single decode as the one-token prefill's [1, ...] view."""
    t = _tensor.view(x, name)
    if t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {t.shape}")
    return x[None]


class BatchDecodeWithPagedKVCacheWrapper:
    """Decode attention over a paged KV cache for a batch of requests (FlashInfer's API).

    The cache, index arrays, dtypes (fp8 K/V included), k_scale / v_scale and CUDA-graph mode are
    those of ``BatchPrefillWithPagedKVCacheWrapper``; a request's query is q_len_per_req tokens
    (plan's keyword, default 1), so q is [B * q_len_per_req, Hq, D]. An NVFP4 cache:
    plan(kv_data_type=torch.uint8) and run(..., kv_cache_sf=scales) (see run()).

    use_cuda_graph=True needs paged_kv_indptr_buffer, paged_kv_indices_buffer and
    paged_kv_last_page_len_buffer: they bound the batch size and the pages; the first plan fixes
    the query-token capacity (its batch size x q_len_per_req, so plan the full batch first, as
    FlashInfer's graph mode expects). plan() runs outside capture; later plans may change lengths
    within the capacity, and q_len_per_req stays that of the first plan. A captured run() keeps
    the scales and sinks it was captured with (as the prefill wrappers' k_scale / v_scale).
    Without use_cuda_graph, run() on a stream that is being captured raises RuntimeError before
    launching anything (a later plan() would invalidate the captured launch).
    """

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend: str = "auto", jit_args=None):
        if backend not in ("auto", "fa2"):
            raise ValueError(f"backend must be 'auto' or 'fa2', got {backend!r}")
        _unsupported("jit_args", jit_args, "JIT compilation (every kernel here is prebuilt)")
        e = self._engine = BatchEngine(float_workspace_buffer, kv_layout, use_cuda_graph, True)
        if use_cuda_graph:
            for name, buf in (("paged_kv_indptr_buffer", paged_kv_indptr_buffer),
                              ("paged_kv_indices_buffer", paged_kv_indices_buffer),
                              ("paged_kv_last_page_len_buffer", paged_kv_last_page_len_buffer)):
                if buf is None:
                    raise ValueError(f"use_cuda_graph=True needs {name} (it fixes the capacity)")
            e.enable_graph(operands.entries(paged_kv_indptr_buffer, "paged_kv_indptr_buffer") - 1,
                           operands.entries(paged_kv_indices_buffer, "paged_kv_indices_buffer"))
        self.use_tensor_cores = bool(use_tensor_cores)
        self._q_len = None  # q_len_per_req of the plan (graph mode: of the first plan, frozen)
        self._window = -1

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._engine.graph is not None

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer=None):
        """Swap the float workspace (int_workspace_buffer is accepted for FlashInfer
        compatibility; the int metadata lives in the wrapper's own buffers)."""
        self._engine.reset_workspace(float_workspace_buffer)

    def plan(self, indptr, indices_, last_page_len, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1, logits_soft_cap=None,
             q_data_type="float16", kv_data_type=None, data_type=None, sm_scale=None, rope_scale=None,
             rope_theta=None, non_blocking: bool = True, block_tables=None, seq_lens=None, fixed_split_size=None,
             disable_split_kv: bool = False, *, q_len_per_req: int = 1, o_data_type=None, lse_base: str = "log2",
             stream=None):
        """Plan a decode batch: request b owns pages indices[indptr[b]:indptr[b+1]], its last
        page holding last_page_len[b] tokens; or (indptr etc. None) block_tables [B, max_pages]
        with seq_lens [B] (host arrays, or device arrays copied once: a sync). data_type is
        FlashInfer's deprecated name for both q_data_type and kv_data_type. o_data_type: the
        output dtype (default q's): float16, bfloat16 or float8_e4m3fn (saturated to +-448, round
        to nearest even; v_scale is applied before the conversion, so o = fp8(attention * v_scale)).
        run()'s out= must then have that dtype. Index arrays are read
        on the host here (device arrays: one sync); non_blocking is accepted and changes nothing
        (the metadata copy is always asynchronous)."""
        e = self._engine
        if data_type is not None:
            q_data_type = kv_data_type = data_type
        q_len = operands.positive_int(q_len_per_req, "q_len_per_req")
        if e.graph is not None and self._q_len is not None and q_len != self._q_len:
            raise ValueError(f"q_len_per_req is frozen at {self._q_len} by the first plan of a CUDA-graph wrapper")
        if indptr is None:
            indptr, indices_, last_page_len = indices.block_table_arrays(block_tables, seq_lens, page_size)
        ind = indices.host_int(indptr, "indptr")
        qo = np.arange(ind.size, dtype=np.int32) * np.int32(q_len)
        src = indices.paged_source(qo, ind, indices_, last_page_len, page_size,
                                   e.graph.max_pages if e.graph is not None else None)
        settings = _settings(PlanSettings, (num_qo_heads, num_kv_heads, head_dim, pos_encoding_mode, False,
                                            logits_soft_cap, rope_scale, rope_theta, lse_base, q_data_type,
                                            kv_data_type, window_left, sm_scale, fixed_split_size, False, False,
                                            o_data_type))
        # Several draft tokens: each sees the keys up to its own position (FlashInfer's tensor-core
        # decode, whose kernel is the prefill one with qo_indptr = arange * q_len_per_req).
        plan = e.plan(src, settings, q_len > 1, None, None, disable_split_kv, stream)
        self._q_len, self._window = q_len, e.cfg.window_left
        return plan

    begin_forward = plan

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse: bool = False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=None,
            skip_softmax_threshold_scale_factor=None, kv_cache_sf=None, stream=None):
        """Attention of q [B * q_len_per_req, Hq, D] over the paged cache for the planned batch.
        q_scale and k_scale multiply the logit scale, v_scale the output (in the kernel); sinks:
        float32 [Hq] attention sinks (FlashInfer's fa2 path ignores them; applied here).
        window_left / q_len_per_req, when given, must be the plan's (they shape the schedule).
        kv_cache_sf: an NVFP4 cache's block scales (plan(kv_data_type=torch.uint8); the cache
        holds uint8 e2m1 code pairs [..., D/2], low nibble first): float8_e4m3fn [..., D/16], one
        scale per 16 head-dim elements of a token, in the cache's form (one tensor
        [P, 2, ...] or a (k_sf, v_sf) tuple). An element is code * scale * the global scale,
        whose K part goes into k_scale and V part into v_scale. Split-KV works as for any cache.
        skip_softmax_threshold_scale_factor: skip-softmax sparsity, as in
        BatchPrefillWithPagedKVCacheWrapper.run (None / 0 = off)."""
        if window_left is not None and window_left != self._window:
            raise ValueError(f"window_left={window_left} differs from plan()'s {self._window}; plan() with it")
        if q_len_per_req is not None and q_len_per_req != self._q_len:
            raise ValueError(f"q_len_per_req={q_len_per_req} differs from plan()'s {self._q_len}; plan() with it")
        if q_scale is not None:
            k_scale = operands.scale_arg(q_scale, "q_scale") * operands.scale_arg(k_scale, "k_scale")
        return self._engine.run_paged(q, paged_kv_cache, *args, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse,
                                      return_lse=return_lse, stream=stream, enable_pdl=enable_pdl, sinks=sinks,
                                      kv_cache_sf=kv_cache_sf,
                                      skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor)

    def run_return_lse(self, *args, **kwargs):
        kwargs["return_lse"] = True
        return self.run(*args, **kwargs)

    forward = run
    forward_return_lse = run_return_lse


xqa_batch_decode_with_kv_cache = _xqa.xqa_batch_decode
