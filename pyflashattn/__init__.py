"""pyflashattn: FlashInfer-compatible attention kernels for LLM serving.

Prebuilt SASS cubins (kernel_src/ -> cubins/ via make) launched from pure Python on any
DLPack CUDA tensor (torch, CuPy, JAX); outputs come back in the caller's framework, on the
caller's stream.
"""
from . import prefill, quantization
from .prefill import (BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper,
                      single_prefill_with_kv_cache, single_prefill_with_kv_cache_return_lse)

__version__ = "0.1.0"
__all__ = ["prefill", "quantization", "single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse",
           "BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper"]
