"""pyflashattn: FlashInfer-compatible attention kernels for LLM serving.

Prebuilt SASS cubins (kernel_src/ -> cubins/ via make) launched from pure Python on any
DLPack CUDA tensor (torch, CuPy, JAX); outputs come back in the caller's framework, on the
caller's stream.
"""
from . import cascade, decode, fp4, page, prefill, quantization, utils
from .cascade import merge_state, merge_state_in_place, merge_states
from .fp4 import FP4Tensor
from .decode import BatchDecodeWithPagedKVCacheWrapper, single_decode_with_kv_cache, xqa_batch_decode_with_kv_cache
from .page import append_paged_kv_cache, get_batch_indices_positions, get_seq_lens
from .prefill import (BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper,
                      single_prefill_with_kv_cache, single_prefill_with_kv_cache_return_lse,
                      trtllm_batch_context_with_kv_cache, trtllm_fmha_v2_prefill)

__version__ = "0.1.0"
__all__ = ["cascade", "decode", "fp4", "page", "prefill", "quantization", "utils", "FP4Tensor",
           "merge_state", "merge_state_in_place", "merge_states",
           "BatchDecodeWithPagedKVCacheWrapper", "single_decode_with_kv_cache", "xqa_batch_decode_with_kv_cache",
           "append_paged_kv_cache", "get_batch_indices_positions", "get_seq_lens",
           "single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse",
           "BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
           "trtllm_fmha_v2_prefill", "trtllm_batch_context_with_kv_cache"]
