"""The problem description every API facade turns its signature into.

A batch plan is described by a KV source (where each request's keys are and how they are
addressed), its settings (heads, dtypes, the mask's structural part, score transforms, output
format) and the custom mask, if any; operands (a pointer plus strides) arrive at run(). Single
prefill describes the same thing for one request with its operands at once (single.py).
"""
from __future__ import annotations

from typing import NamedTuple


class KVSource(NamedTuple):
    """Where a batch's keys come from, as validated host arrays.

    kind "ragged": request b owns key rows kv_indptr[b]:kv_indptr[b+1] of contiguous K/V;
    "paged": request b owns pages kv_page_indices[kv_indptr[b]:kv_indptr[b+1]], its last page
    holding kv_last_page_len[b] keys ("paged_v": V's pages at the same places of its own list,
    TRT-LLM's separate K / V page ids); "block_table": request b's page ids are row b of a block
    table (kv_indptr[b] = b * its row stride) and its length is seq_lens[b], both device arrays
    set at run (XQA): the plan covers every request up to a planned length, the kernel clamps.
    qo = the int32 qo_indptr; qo_lens / kv_lens int64 per request with their maxima; arrays =
    the int32 index arrays the kernel reads, named by `names` (PrefillParams fields)."""

    kind: str
    qo: object
    qo_lens: object
    kv_lens: object
    max_qo: int
    max_kv: int
    arrays: tuple
    page_size: int
    max_page: int
    total_kv: int

    @property
    def names(self) -> tuple:
        return KV_ARRAY_NAMES[self.kind]


KV_ARRAY_NAMES = {"ragged": ("kv_indptr",), "paged": ("kv_indptr", "kv_page_indices", "kv_last_page_len"),
                  "paged_v": ("kv_indptr", "kv_page_indices", "kv_last_page_len", "v_page_indices"),
                  "block_table": ("kv_indptr", "mask_indptr")}


class PlanSettings(NamedTuple):
    """What a batch plan() was told besides its index arrays and masks, as given (the engine
    validates and resolves them once per distinct value: options.resolve_settings)."""
    num_qo_heads: object
    num_kv_heads: object
    head_dim: object
    pos_encoding_mode: object
    allow_fp16_qk_reduction: object
    logits_soft_cap: object
    rope_scale: object
    rope_theta: object
    lse_base: object
    q_data_type: object
    kv_data_type: object
    window_left: object
    sm_scale: object
    fixed_split_size: object
    has_mask: bool
    general: bool  # the general kernels even without a custom mask or transform (XQA: spec masks, device scales)
    o_data_type: object  # the output dtype (None: q's); XQA passes out's


class Config(NamedTuple):
    """PlanSettings validated: heads, dtypes (the output's too), mask window, score transforms and
    output format (opts: soft cap, positional encoding, RoPE parameters, LSE base), and the route."""
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    group: int  # num_qo_heads // num_kv_heads
    opts: object  # options.Options
    q_dtype: object
    kv_dtype: object
    kv_fp8: int  # PrefillParams.kv_fp8: 0 = K/V in q's dtype (or NVFP4), 1 = e4m3, 2 = e5m2
    kv_nvfp4: bool  # NVFP4 K/V: uint8 code pairs [..., D/2], block scales at run (kv_cache_sf)
    window_left: int
    sm_scale: float
    fixed_split_size: int | None
    route: object  # routing.Route
    o_dtype: object  # the output dtype (q's unless plan() was told another)
    o_format: int  # PrefillParams.o_format (operands.OUT_*)
