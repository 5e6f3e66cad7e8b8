"""Filling the kernels' params structs from a problem description: one place for every API."""
from __future__ import annotations

import math

from .._runtime import cuda as _cuda
from . import options as _options

LOG2E = 1.4426950408889634
MERGE_ROWS_PER_BLOCK = 4  # the merge kernel: one warp per (token, head) row, four warps a CTA
MAX_GRID_YZ = 65535  # the CUDA limit of gridDim.y / gridDim.z


def fill_score_fields(p, dev: int, num_qo_heads: int, num_kv_heads: int, causal: bool, window_left: int,
                      sm_scale: float, opts) -> None:
    """The heads, mask and score-transform fields of a PrefillParams struct (v_scale reset to 1;
    o_format is the caller's)."""
    p.num_qo_heads, p.num_kv_heads, p.group_size = num_qo_heads, num_kv_heads, num_qo_heads // num_kv_heads
    p.causal, p.window_left, p.sm_scale_log2 = int(causal), window_left, sm_scale * LOG2E
    p.lse_scale, p.logits_soft_cap, p.v_scale = opts.lse_scale, opts.soft_cap, 1.0
    p.rope = int(opts.pos == "ROPE_LLAMA")
    p.rope_rcp_scale, p.rope_log2_theta = 1.0 / opts.rope_scale, math.log2(opts.rope_theta)
    p.alibi_slopes = alibi_buffer(dev, num_qo_heads) if opts.pos == "ALIBI" else 0


def configure_merge(mg, rows: int, num_heads: int, head_dim: int, num_splits: int, lse_scale: float,
                    o_format: int = 0) -> None:
    """The merge kernel over `rows` tokens: num_splits chunks each (0: per-token merge_indptr),
    writing the output in o_format (operands.OUT_*)."""
    mp = mg.params
    mp.rows, mp.num_heads, mp.head_dim, mp.num_kv_chunks = rows, num_heads, head_dim, num_splits
    mp.lse_scale, mp.o_format = lse_scale, o_format
    mg.configure((max(1, -(-rows * num_heads // MERGE_ROWS_PER_BLOCK)), 1, 1))


_alibi_buffers: dict = {}


def alibi_buffer(dev: int, num_heads: int) -> int:
    """Device copy of FlashInfer's ALiBi slopes for num_heads, uploaded once per device."""
    ptr = _alibi_buffers.get((dev, num_heads))
    if ptr is None:
        ptr = _alibi_buffers[(dev, num_heads)] = _cuda.upload(_options.alibi_slopes(num_heads).tobytes())
    return ptr
