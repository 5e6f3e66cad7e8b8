"""Filling the kernels' params structs from a problem description: one place for every API."""
from __future__ import annotations

import functools
import math

from .._runtime import cuda as _cuda
from . import options as _options, switches

LOG2E = 1.4426950408889634
MERGE_ROWS_PER_BLOCK = 4  # the merge kernel: one warp per (token, head) row, four warps a CTA
MERGE_CTAS_PER_SM = 16  # the warp-per-pair kernel's grid cap per SM (it strides over the pairs past it)
# "0" / "1": the one-warp or the one-CTA-per-row merge kernel whatever the shape (read at plan
# time; an A/B switch, see merge_cta_per_row). Unset: chosen by shape.
MERGE_CTA_ENV = "PYFLASHATTN_MERGE_CTA_PER_ROW"
MAX_GRID_YZ = 65535  # the CUDA limit of gridDim.y / gridDim.z


@functools.lru_cache(maxsize=1024)
def fast_divisor(d: int) -> tuple[int, int]:
    """(mul, shift) of the divisor d >= 1 for the kernels' fast_div (fastdiv.cuh): for every
    0 <= n < 2^31, n // d == (umulhi(n, mul) + n) >> shift, with shift = ceil(log2 d) and mul =
    floor(2^32 (2^shift - d) / d) + 1 < 2^32 (Granlund and Montgomery's round-up method)."""
    if not 1 <= d < 1 << 31:
        raise ValueError(f"divisor {d} outside [1, 2^31)")
    shift = (d - 1).bit_length()
    return ((1 << 32) * ((1 << shift) - d)) // d + 1, shift


def set_grid_order(p, grid: tuple[int, int, int], section: int, section_z: int) -> None:
    """The logical grid's fields of an sm90 PrefillParams (work.cuh LogicalGrid): its extent, the
    sections of `section` x values over the z values below `section_z`, and the multipliers of
    the divisors LogicalGrid::at uses (a section's blocks, a section's width, the last section's,
    grid_y)."""
    gx, gy, gz = grid
    p.grid_x, p.grid_y, p.grid_z, p.grid_section, p.grid_section_z = gx, gy, gz, section, section_z
    last = gx - (gx - 1) // section * section  # the last section's x values
    p.div_section_mul, p.div_section_shift = fast_divisor(max(1, section * gy * section_z))
    p.div_x_mul, p.div_x_shift = fast_divisor(section)
    p.div_last_x_mul, p.div_last_x_shift = fast_divisor(last)
    p.div_y_mul, p.div_y_shift = fast_divisor(gy)


def fill_score_fields(p, dev: int, num_qo_heads: int, num_kv_heads: int, causal: bool, window_left: int,
                      sm_scale: float, opts) -> None:
    """The heads, mask and score-transform fields of a PrefillParams struct (v_scale reset to 1;
    o_format is the caller's)."""
    p.num_qo_heads, p.num_kv_heads, p.group_size = num_qo_heads, num_kv_heads, num_qo_heads // num_kv_heads
    p.div_group_mul, p.div_group_shift = fast_divisor(p.group_size)
    p.causal, p.window_left, p.sm_scale_log2 = int(causal), window_left, sm_scale * LOG2E
    p.lse_scale, p.logits_soft_cap, p.v_scale = opts.lse_scale, opts.soft_cap, 1.0
    p.rope = int(opts.pos == "ROPE_LLAMA")
    p.rope_rcp_scale, p.rope_log2_theta = 1.0 / opts.rope_scale, math.log2(opts.rope_theta)
    p.alibi_slopes = alibi_buffer(dev, num_qo_heads) if opts.pos == "ALIBI" else 0


def merge_cta_per_row(dev: int, rows: int, num_heads: int) -> bool:
    """Whether the split-KV merge of `rows` tokens runs one CTA per (token, head), its warps
    sharing the row's chunks, instead of one warp: when one warp per row would leave SMs without
    a CTA (few rows, e.g. one long decode request, whose every row then walks all its chunks
    alone). PYFLASHATTN_MERGE_CTA_PER_ROW=0 / 1 forces either kernel (another value: ValueError)."""
    forced = switches.choice(MERGE_CTA_ENV, ("0", "1"))
    if forced:
        return forced == "1"
    return -(-rows * num_heads // MERGE_ROWS_PER_BLOCK) < _cuda.properties(dev)["sm_count"]


def configure_merge(mg, rows: int, num_heads: int, head_dim: int, num_splits: int, lse_scale: float,
                    o_format: int, dev: int) -> None:
    """The merge kernel over `rows` tokens: num_splits chunks each (0: per-token merge_indptr),
    writing the output in o_format (operands.OUT_*); its grid from the kernel's (row, head)
    pairs per CTA (the manifest's rows_per_block). The warp-per-pair kernel strides over the
    pairs, so on `dev` its grid stops at MERGE_CTAS_PER_SM waves' worth of CTAs (merge.cuh: a
    fixed-capacity merge of a plan that split nothing then costs a few microseconds, not one CTA
    per four pairs of exits)."""
    mp = mg.params
    mp.rows, mp.num_heads, mp.head_dim, mp.num_kv_chunks = rows, num_heads, head_dim, num_splits
    mp.lse_scale, mp.o_format = lse_scale, o_format
    per_block = mg.meta.get("rows_per_block", MERGE_ROWS_PER_BLOCK)
    ctas = max(1, -(-rows * num_heads // per_block))
    if not mg.meta.get("cta_per_row"):
        ctas = min(ctas, _cuda.properties(dev)["sm_count"] * MERGE_CTAS_PER_SM)
    mg.configure((ctas, 1, 1))


_alibi_buffers: dict = {}


def alibi_buffer(dev: int, num_heads: int) -> int:
    """Device copy of FlashInfer's ALiBi slopes for num_heads, uploaded once per device."""
    ptr = _alibi_buffers.get((dev, num_heads))
    if ptr is None:
        ptr = _alibi_buffers[(dev, num_heads)] = _cuda.upload(_options.alibi_slopes(num_heads).tobytes())
    return ptr
