"""pyflashattn inside ``jax.jit``: every attention entry point as a jittable JAX function.

Imported only when used (``import pyflashattn.jax``); the rest of pyflashattn never imports JAX.

    import pyflashattn.jax as pfj

    @jax.jit
    def layer(q, k, v):
        return pfj.single_prefill_with_kv_cache(q, k, v, causal=True)

    w = pfj.BatchPrefillWithPagedKVCacheWrapper(kv_layout="NHD", max_batch_size=64, max_num_pages=4096,
                                                max_num_tokens=8192)
    plan = w.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, 32, 8, 128, 16, causal=True)  # numpy, outside jit
    step = jax.jit(w.run)
    o = step(q, kv_cache, plan)    # re-plans within capacity reuse the trace

The functions take and return ``jax.Array``s with the eager API's names, arguments and
conventions; options are Python values (static under jit). Bad shapes and dtypes raise at trace
time with the eager API's messages. Each call runs through ``jax.experimental.buffer_callback``
on XLA's stream, ``command_buffer_compatible`` (XLA may record it into a CUDA graph): no host sync
and no allocation inside, and no call into ``jax``; memory a kernel needs beyond its outputs (the
float workspace, the tile scheduler's counters) is a scratch output XLA allocates with the call. A
launch failure surfaces as a ``JaxRuntimeError`` naming the kernel.

Transformations: ``vmap`` over leading axes of single prefill (one launch per element) and of
merge_state(s); the batch wrappers, decode and the page append refuse vmap (their batch is the
plan's). ``shard_map`` works (each device launches on its own buffers; plans are built for every
local GPU). Gradients are not supported: differentiating a call raises NotImplementedError naming it.
"""
from __future__ import annotations

from ._bridge import buffer_callback as _buffer_callback

_buffer_callback()  # ImportError naming the JAX version it needs, at import

from ._batch import (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper,  # noqa: E402
                     BatchPrefillWithRaggedKVCacheWrapper, Plan)
from ._cascade import merge_state, merge_state_in_place, merge_states  # noqa: E402
from ._page import append_paged_kv_cache, get_batch_indices_positions, get_seq_lens  # noqa: E402
from ._single import single_prefill_with_kv_cache  # noqa: E402
from ._trtllm import trtllm_batch_context_with_kv_cache, trtllm_fmha_v2_prefill  # noqa: E402
from ._xqa import xqa_batch_decode_with_kv_cache  # noqa: E402

__all__ = ["single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse",
           "BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
           "BatchDecodeWithPagedKVCacheWrapper", "Plan", "merge_state", "merge_state_in_place", "merge_states",
           "append_paged_kv_cache", "get_batch_indices_positions", "get_seq_lens", "xqa_batch_decode_with_kv_cache",
           "trtllm_fmha_v2_prefill", "trtllm_batch_context_with_kv_cache"]


def single_prefill_with_kv_cache_return_lse(q, k, v, *args, **kwargs):
    """single_prefill_with_kv_cache with return_lse=True: (o, lse)."""
    kwargs["return_lse"] = True
    return single_prefill_with_kv_cache(q, k, v, *args, **kwargs)
