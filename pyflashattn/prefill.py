"""Prefill / append attention with FlashInfer's API (``flashinfer.prefill``).

    o = single_prefill_with_kv_cache(q, k, v, causal=True)
    o, lse = single_prefill_with_kv_cache_return_lse(q, k, v)

    w = BatchPrefillWithPagedKVCacheWrapper(float_workspace)
    w.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, Hq, Hkv, D, page_size, causal=True)
    o = w.run(q, paged_kv_cache)          # any number of times (e.g. once per layer)

Single prefill: q [qo_len, num_qo_heads, head_dim]; k, v [kv_len, num_kv_heads, head_dim]
(kv_layout "NHD") or [num_kv_heads, kv_len, head_dim] ("HND"); any DLPack CUDA tensor (torch,
CuPy, JAX), fp16 or bf16, strided views allowed as long as the last dim is contiguous.
Conventions (FlashInfer's): causal is bottom-right aligned (query i sits at i + kv_len - qo_len),
window_left is an inclusive left window from that position, lse is base 2 over the scaled
logits (log2(sum_j 2^(s_j * log2 e))), a row with no visible key gives o = 0 and lse = -inf.

Each function and method here only turns its signature into the engine's problem description
(pyflashattn._engine.problem), calls the engine and returns; where the call is on the serving
hot path (single prefill, run()), the engine's entry with FlashInfer's signature is used as is.
"""
from __future__ import annotations

import functools

from ._engine import indices, operands, trtllm_context as _trtllm_context, trtllm_fmha as _trtllm_fmha
from ._engine.batch import BatchEngine
from ._engine.problem import PlanSettings
from ._engine.single import single_prefill

__all__ = ["single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse",
           "BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
           "trtllm_fmha_v2_prefill", "trtllm_batch_context_with_kv_cache"]


# The public function is the engine's entry itself, with FlashInfer's signature: a single-prefill
# call is on a serving loop's hot path, and a facade function around it would add a Python call.
single_prefill_with_kv_cache = single_prefill
single_prefill_with_kv_cache_return_lse = functools.partial(single_prefill_with_kv_cache, return_lse=True)
single_prefill_with_kv_cache_return_lse.__doc__ = "single_prefill_with_kv_cache with return_lse=True: (o, lse)."


_settings = tuple.__new__  # PlanSettings from its fields in order: no NamedTuple argument parsing per plan()


def _check_backend(backend):
    if backend not in ("auto", "fa2"):
        raise ValueError(f"backend must be 'auto' or 'fa2', got {backend!r}")


def _graph_buffers(named: tuple):
    for name, buf in named:
        if buf is None:
            raise ValueError(f"use_cuda_graph=True needs {name} (it fixes the capacity)")


class _BatchPrefillWrapper:
    """What both batch wrappers share: the engine, the workspace, FlashInfer's old names."""

    _engine: BatchEngine

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer=None):
        """Swap the float workspace (int metadata lives in the wrapper's own buffers; the
        int_workspace_buffer argument is accepted for FlashInfer compatibility). A buffer that is
        refused leaves the wrapper with its old one."""
        self._engine.reset_workspace(float_workspace_buffer)

    def workspace_size(self) -> int:
        """Exact float-workspace bytes the current plan uses (0 when no request is split)."""
        if not self._engine.planned:
            raise RuntimeError("call plan() first")
        return self._engine.ws_need

    def run_return_lse(self, *args, **kwargs):
        kwargs["return_lse"] = True
        return self.run(*args, **kwargs)


class BatchPrefillWithPagedKVCacheWrapper(_BatchPrefillWrapper):
    """Prefill/append attention over a paged KV cache for a batch of requests (FlashInfer's API).

    paged_kv_cache: one tensor [num_pages, 2, page_size, Hkv, D] (NHD) or
    [num_pages, 2, Hkv, page_size, D] (HND), or a tuple (k_cache, v_cache) of
    [num_pages, page_size, Hkv, D] / [num_pages, Hkv, page_size, D]; any strides with a
    contiguous last dim and 16-byte aligned rows. Request b owns pages
    kv_indices[kv_indptr[b]:kv_indptr[b+1]], its last page holding kv_last_page_len[b] tokens
    (1..page_size); a request with no pages has kv_len 0.

    K/V dtype: q's (plan's q_data_type), fp8 (kv_data_type=float8_e4m3fn / float8_e5m2), or NVFP4
    (kv_data_type=uint8: e2m1 code pairs [..., D/2], low nibble first, with run(kv_cache_sf=...)
    their float8_e4m3fn block scales [..., D/16] in the cache's form; lean options only, and run
    on the decode tiles, so long queries are correct but not fast).
    Output dtype: q's, or plan(o_data_type=) float16 / bfloat16 / float8_e4m3fn (saturated to
    +-448, round to nearest even, after v_scale); run()'s out= must have it (both wrappers).
    run(k_scale=, v_scale=) (default 1.0) scale the logits (sm_scale * k_scale, also in the LSE)
    and the output (times v_scale) inside the kernel, for every KV dtype; q_scale multiplies the
    logits like k_scale. An fp8 query (q_data_type float8_e4m3fn, kv_data_type float8_e4m3fn)
    runs on the sm90 fp8 prefill's paged rows (H100 / H200; any page size): run(q_scale=,
    k_scale=, v_scale=) then also take float32 per-head tensors, as in the ragged wrapper.

    plan() reads the index arrays on the host (device arrays are copied to the host once, which
    synchronises: pass numpy arrays to avoid it). plan(non_blocking=...) is accepted for
    FlashInfer compatibility: the metadata copy is always asynchronous on the stream and ordered
    before run(), so the flag has nothing to change.

    use_cuda_graph=True: the buffers passed here (qo_indptr_buf, paged_kv_indptr_buf,
    paged_kv_indices_buf, paged_kv_last_page_len_buf) fix the capacity (batch size, pages);
    plan() runs outside capture and later plans may change lengths within that capacity, while
    the captured run() stays valid (fixed grid with padding items, metadata at fixed addresses).
    custom_mask_buf (uint8) / qk_indptr_buf (int32, >= batch size + 1 entries) receive each
    plan's packed custom mask and its byte offsets (in any mode); without them graph mode uses a
    library buffer sized at the first plan with a mask (twice that mask, at least 64 KiB). A
    captured run() keeps the kernel, options and k_scale / v_scale it was captured with: later
    plans that would change them (e.g. add or drop the custom mask) raise ValueError. Without
    use_cuda_graph, run() on a stream that is being captured raises RuntimeError before launching
    anything (a later plan() would invalidate the captured launch; both batch wrappers).
    """

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, qk_indptr_buf=None, backend: str = "auto"):
        e = self._engine = BatchEngine(float_workspace_buffer, kv_layout, use_cuda_graph, True, custom_mask_buf,
                                       qk_indptr_buf)
        _check_backend(backend)
        if use_cuda_graph:
            _graph_buffers((("qo_indptr_buf", qo_indptr_buf), ("paged_kv_indptr_buf", paged_kv_indptr_buf),
                            ("paged_kv_indices_buf", paged_kv_indices_buf),
                            ("paged_kv_last_page_len_buf", paged_kv_last_page_len_buf)))
            e.enable_graph(operands.entries(qo_indptr_buf, "qo_indptr_buf") - 1,
                           operands.entries(paged_kv_indices_buf, "paged_kv_indices_buf"))
        self.run = e.run_paged  # run() on the hot path: the engine's entry, no facade call in between

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, custom_mask=None, packed_custom_mask=None,
             causal: bool = False, pos_encoding_mode: str = "NONE", allow_fp16_qk_reduction: bool = False,
             sm_scale=None, window_left: int = -1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
             q_data_type="float16", kv_data_type=None, non_blocking: bool = True, *, fixed_split_size=None,
             disable_split_kv: bool = False, lse_base: str = "log2", stream=None, o_data_type=None):
        e = self._engine
        src = indices.paged_source(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size,
                                   e.graph.max_pages if e.graph is not None else None)
        settings = _settings(PlanSettings, (num_qo_heads, num_kv_heads, head_dim, pos_encoding_mode,
                                            allow_fp16_qk_reduction, logits_soft_cap, rope_scale, rope_theta, lse_base,
                                            q_data_type, kv_data_type, window_left, sm_scale, fixed_split_size,
                                            custom_mask is not None or packed_custom_mask is not None, False,
                                            o_data_type))
        return e.plan(src, settings, causal, custom_mask, packed_custom_mask, disable_split_kv, stream)

    begin_forward = plan

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse: bool = False, stream=None, enable_pdl=None, sinks=None, kv_cache_sf=None,
            skip_softmax_threshold_scale_factor=None):
        """Attention of q over the paged cache for the planned batch. k_scale / v_scale (float,
        default 1.0): see the class docstring; under a CUDA graph they are baked into the
        captured launch (a replay uses the values of the captured run()). enable_pdl=True
        launches the attention kernel programmatically (sm_90+); None / False: a plain launch
        (FlashInfer's None means "if supported": here it means off). sinks: float32 [Hq]
        attention sinks (semantics of FlashInfer's trtllm-gen path: e^sink joins each row's
        normaliser, and the LSE); FlashInfer's fa2/fa3 paths silently ignore them, this one
        applies them. kv_cache_sf: an NVFP4 cache's block scales (see the class docstring).
        skip_softmax_threshold_scale_factor: skip-softmax sparsity (TRT-LLM's, semantics 1.12;
        FlashInfer's fa2/fa3 paths drop it, this one applies it): a KV tile whose every row max in
        a vote group lies below the row's running max by more than ln(kv_len / factor) is skipped
        (ARCHITECTURE.md gives the tile and group geometry per kernel family); None / 0 = off."""
        return self._engine.run_paged(q, paged_kv_cache, *args, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                                      out=out, lse=lse, return_lse=return_lse, stream=stream, enable_pdl=enable_pdl,
                                      sinks=sinks, kv_cache_sf=kv_cache_sf,
                                      skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor)


class BatchPrefillWithRaggedKVCacheWrapper(_BatchPrefillWrapper):
    """Prefill attention over ragged (packed) K/V for a batch of requests (FlashInfer's API).

    k, v: [kv_indptr[-1], Hkv, D] (NHD) or [Hkv, kv_indptr[-1], D] (HND); request b owns key rows
    kv_indptr[b]:kv_indptr[b+1]. K/V in q's dtype or fp8 (kv_data_type); run()'s k_scale / v_scale
    apply in the kernel for every KV dtype (FlashInfer's ragged wrapper ignores them: not here).
    FP8 prefill: plan(q_data_type=float8_e4m3fn, kv_data_type=float8_e4m3fn, o_data_type=bfloat16 /
    float16 / float8_e4m3fn (default q's)) runs e4m3 Q, K and V on the sm_90a fp8 kernels (head_dim
    64 / 128 / 256, lean options; other GPUs and options raise NotImplementedError), with run(q_scale
    [Hq], k_scale [Hkv], v_scale [Hkv]) as per-head float32 tensors or numbers: logits of query
    head h over kv head g times q_scale[h] * k_scale[g], output rows of kv head g times v_scale[g]
    (FlashInfer 0.7's fp8 scales, semantics 1.9).
    use_cuda_graph=True: qo_indptr_buf and kv_indptr_buf fix the batch capacity; custom masks
    and the mask buffers as in BatchPrefillWithPagedKVCacheWrapper.
    """

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, kv_indptr_buf=None, custom_mask_buf=None, qk_indptr_buf=None,
                 backend: str = "auto"):
        e = self._engine = BatchEngine(float_workspace_buffer, kv_layout, use_cuda_graph, False, custom_mask_buf,
                                       qk_indptr_buf)
        _check_backend(backend)
        if use_cuda_graph:
            _graph_buffers((("qo_indptr_buf", qo_indptr_buf), ("kv_indptr_buf", kv_indptr_buf)))
            e.enable_graph(operands.entries(qo_indptr_buf, "qo_indptr_buf") - 1, 0)
        self.run = e.run_ragged  # run() on the hot path: the engine's entry, no facade call in between

    def plan(self, qo_indptr, kv_indptr, num_qo_heads: int, num_kv_heads: int, head_dim: int, custom_mask=None,
             packed_custom_mask=None, causal: bool = False, pos_encoding_mode: str = "NONE",
             allow_fp16_qk_reduction: bool = False, window_left: int = -1, logits_soft_cap=None, sm_scale=None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None, *, fixed_split_size=None,
             disable_split_kv: bool = False, lse_base: str = "log2", stream=None, o_data_type=None):
        src = indices.ragged_source(qo_indptr, kv_indptr)
        settings = _settings(PlanSettings, (num_qo_heads, num_kv_heads, head_dim, pos_encoding_mode,
                                            allow_fp16_qk_reduction, logits_soft_cap, rope_scale, rope_theta, lse_base,
                                            q_data_type, kv_data_type, window_left, sm_scale, fixed_split_size,
                                            custom_mask is not None or packed_custom_mask is not None, False,
                                            o_data_type))
        return self._engine.plan(src, settings, causal, custom_mask, packed_custom_mask, disable_split_kv, stream)

    begin_forward = plan

    def run(self, q, k, v, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse: bool = False, stream=None, enable_pdl=None, sinks=None):
        """Attention of q over the ragged k, v for the planned batch. q_scale / k_scale / v_scale
        (float, default 1.0) scale the logits (q_scale * k_scale) and the output (v_scale) in the
        kernel, for every KV dtype; an fp8 plan (see the class docstring) also takes them as
        per-head float32 tensors. Under a CUDA graph they are baked into the captured launch (a
        tensor's values are read at each replay). enable_pdl, sinks: as in the paged run()."""
        return self._engine.run_ragged(q, k, v, *args, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out,
                                       lse=lse, return_lse=return_lse, stream=stream, enable_pdl=enable_pdl,
                                       sinks=sinks)


# TensorRT-LLM entry points (FlashInfer's signatures; README "TRT-LLM prefill"): plan-free calls
# of the batch engine; device metadata stays on the device (no sync, capturable).
trtllm_fmha_v2_prefill = _trtllm_fmha.fmha_v2_prefill
trtllm_batch_context_with_kv_cache = _trtllm_context.batch_context
