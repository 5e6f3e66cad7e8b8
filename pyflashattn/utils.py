"""The names of ``flashinfer.utils`` that pyflashattn provides: ``FP4Tensor`` (pyflashattn.fp4), the
NVFP4 output of ``trtllm_batch_context_with_kv_cache``."""
from .fp4 import FP4Tensor

__all__ = ["FP4Tensor"]
