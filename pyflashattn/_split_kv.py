"""Split-KV decision for one single-prefill launch: how many KV chunks each row tile gets.

Short queries over long KV give too few CTAs to fill the GPU; splitting KV into chunks (fp32
partials + a merge kernel) adds CTAs. It also adds work, so a split must shorten the launch:

* each CTA costs the KV tiles it walks, plus ``SPLIT_COST_TILES`` for its fp32 partial write
  and share of the merge when the launch is split (an empty chunk, wholly outside the causal
  or window range, still writes ``lse = -inf``: ``EMPTY_COST_TILES``);
* the launch time, in units of one KV tile on a whole SM, is the largest of three estimates:
  the heaviest CTA at the rate one CTA gets alone, the total work over the SMs, and (more
  CTAs than slots) the two lightest of the ``slots + 1`` heaviest CTAs, which must share a
  slot: that last one sees a second wave of uniform CTAs (256 CTAs on 264 slots must not
  become 512).

Causal and window ranges enter through the row tiles' key ranges, so a causal launch whose
bottom row tiles are heavy splits, while a uniform one that already fills the GPU does not.
"""
from __future__ import annotations

import numpy as np

__all__ = ["plan_splits", "SPLIT_COST_TILES", "EMPTY_COST_TILES", "MIN_CHUNK_TILES", "PAIRED_CTA_RATE"]

SPLIT_COST_TILES = 3  # fp32 partial store (~1 tile of time), merge read (~1) and its launch
EMPTY_COST_TILES = 1
MIN_CHUNK_TILES = 4  # a chunk amortises its epilogue and merge over at least this many tiles
# Share of an SM one CTA of a 2-per-SM kernel gets when it runs alone. Measured (H100, hd128
# causal seq 2048, 256 CTAs): unsplit beat a 2-way split by 10 %, so a lone CTA gets most of
# the SM: a heavy causal tile paired with a light one finishes almost as fast as alone.
PAIRED_CTA_RATE = 0.8


def _row_tile_ranges(qo_len, kv_len, group, block_m, causal, window_left):
    """[kv_begin, kv_end) of the keys any row of each packed-row tile may attend to."""
    rows = qo_len * group
    r0 = np.arange(0, rows, block_m, dtype=np.int64)
    q_lo, q_hi = r0 // group, (np.minimum(r0 + block_m, rows) - 1) // group
    shift = kv_len - qo_len  # bottom-right alignment: query i sits at key position i + shift
    end = np.minimum(kv_len, q_hi + shift + 1) if causal else np.full_like(r0, kv_len)
    begin = np.maximum(0, q_lo + shift - window_left) if window_left >= 0 else np.zeros_like(r0)
    return begin, np.maximum(begin, end)


def _makespan(ranges, kv_heads, kv_len, chunk, block_n, split, sm_count, min_blocks):
    """Estimated launch time in KV-tile units (see the module docstring)."""
    begin, end = ranges
    c0 = np.arange(0, max(kv_len, 1), chunk, dtype=np.int64)  # every row tile runs every chunk
    lo = np.maximum(begin[:, None], c0[None, :])
    hi = np.minimum(end[:, None], c0[None, :] + chunk)
    tiles = np.where(hi > lo, -(-hi // block_n) - lo // block_n, 0)
    if split:
        tiles = tiles + np.where(tiles > 0, SPLIT_COST_TILES, EMPTY_COST_TILES)
    w = np.sort(tiles.ravel())[::-1]  # each value stands for kv_heads CTAs
    rate = 1.0 if min_blocks == 1 else PAIRED_CTA_RATE
    est = max(w[0] / rate, float(w.sum()) * kv_heads / sm_count)
    slots = sm_count * min_blocks
    if w.size * kv_heads > slots:  # two of the slots + 1 heaviest CTAs share a slot
        est = max(est, float(w[(slots - 1) // kv_heads] + w[slots // kv_heads]) * min_blocks)
    return est


def plan_splits(qo_len, kv_len, group, kv_heads, block_m, block_n, sm_count, min_blocks, causal=False,
                window_left=-1):
    """(num_splits, kv_chunk_size) for one launch; the chunk is a multiple of block_n."""
    kv_tiles = -(-kv_len // block_n)
    ctas = -(-qo_len * group // block_m) * kv_heads
    slots = sm_count * min_blocks
    whole = (1, kv_tiles * block_n if kv_tiles else block_n)
    if ctas >= slots or kv_tiles < 2 * MIN_CHUNK_TILES:
        return whole
    ranges = _row_tile_ranges(qo_len, kv_len, group, block_m, causal, window_left)
    args = (ranges, kv_heads, kv_len)
    best_cost = _makespan(*args, max(kv_len, 1), block_n, False, sm_count, min_blocks)
    best = whole
    # Candidates: a few small splits, and those that fill about half, one, 1.5 or two waves.
    cands = {2, 3, 4}
    for f in (0.5, 1.0, 1.5, 2.0):
        cands.update((int(f * slots // ctas), -(-int(f * slots) // ctas)))
    for splits in sorted(c for c in cands if 2 <= c <= kv_tiles // MIN_CHUNK_TILES):
        chunk_tiles = -(-kv_tiles // splits)
        chunk = chunk_tiles * block_n
        cost = _makespan(*args, chunk, block_n, True, sm_count, min_blocks)
        if cost < best_cost:
            best_cost, best = cost, (-(-kv_tiles // chunk_tiles), chunk)
    return best
