"""Split-KV decision for one single-prefill launch: how many KV chunks each row tile gets.

Short queries over long KV give too few CTAs to fill the GPU; splitting KV into chunks (fp32
partials + a merge kernel) adds CTAs. It also adds work, so a split must shorten the launch.
Each candidate split count gets an estimated time in microseconds:

* the attention launch, in KV tiles of work: each CTA costs the tiles it walks, plus
  ``SPLIT_COST_TILES`` for its fp32 partial store when the launch is split (an empty chunk,
  wholly outside the causal or window range, still writes ``lse = -inf``: ``EMPTY_COST_TILES``);
  the launch takes the largest of three estimates: the heaviest CTA, the total work over the
  SMs, and (more CTAs than slots) the two lightest of the ``slots + 1`` heaviest CTAs, which
  must share a slot (256 CTAs on 264 slots must not become 512). Times ``TILE_US`` scaled by
  the tile's FLOPs;
* a split adds the merge: ``MERGE_LAUNCH_US`` plus writing and reading the fp32 partial
  outputs at ``PARTIAL_BYTES_PER_US``.

Calibrated on an H100 (20 short shapes, every split count timed, hd 64/128/256, GQA 1/4/4-8,
causal and not): the mean slowdown against the best split count went from 5.5 % (the earlier
tile-only model, which let a lone CTA of a two-per-SM kernel run at 0.8 of an SM and charged
no fixed merge cost) to 1.8 %; the worst from 37 % (hd64 seq 512 causal, split in two) to 20 %
(two long-KV GQA shapes where filling the second CTA slot of every SM pays and the model,
counting a lone CTA as a whole SM, calls it a tie). On 37 shapes (17 more: decode-like and
chunked-prefill GQA over 8K-128K keys, MQA, the sweep's 1536-4096): mean 4.6 %, worst 25 %, every
miss a long-KV GQA shape that wants about two CTAs per SM; the sweep's seq >= 2048 rows all pick
the best count. NOTES.md has the tables and the variant that was not kept.
"""
from __future__ import annotations

import numpy as np

__all__ = ["plan_splits", "SPLIT_COST_TILES", "EMPTY_COST_TILES", "MIN_CHUNK_TILES", "TILE_US", "MERGE_LAUNCH_US",
           "PARTIAL_BYTES_PER_US"]

SPLIT_COST_TILES = 1  # a CTA's fp32 partial store
EMPTY_COST_TILES = 1
MIN_CHUNK_TILES = 2  # shortest chunk (the merge and partial costs are in the estimate itself)
TILE_US = 1.0  # one 128-row x 64-key tile at head_dim 64 on one SM (FLOPs scale the others)
MERGE_LAUNCH_US = 4.0  # the merge kernel's launch and ramp
PARTIAL_BYTES_PER_US = 2.5e6  # fp32 partials written by the attention, read by the merge (HBM)


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
    """Estimated attention launch time in KV-tile units (see the module docstring)."""
    begin, end = ranges
    c0 = np.arange(0, max(kv_len, 1), chunk, dtype=np.int64)  # every row tile runs every chunk
    lo = np.maximum(begin[:, None], c0[None, :])
    hi = np.minimum(end[:, None], c0[None, :] + chunk)
    tiles = np.where(hi > lo, -(-hi // block_n) - lo // block_n, 0)
    if split:
        tiles = tiles + np.where(tiles > 0, SPLIT_COST_TILES, EMPTY_COST_TILES)
    w = np.sort(tiles.ravel())[::-1]  # each value stands for kv_heads CTAs
    est = max(float(w[0]), float(w.sum()) * kv_heads / sm_count)
    slots = sm_count * min_blocks
    if w.size * kv_heads > slots:  # two of the slots + 1 heaviest CTAs share a slot
        est = max(est, float(w[(slots - 1) // kv_heads] + w[slots // kv_heads]) * min_blocks)
    return est


def plan_splits(qo_len, kv_len, group, kv_heads, block_m, block_n, sm_count, min_blocks, causal=False,
                window_left=-1, *, head_dim):
    """(num_splits, kv_chunk_size) for one launch; the chunk is a multiple of block_n."""
    kv_tiles = -(-kv_len // block_n)
    ctas = -(-qo_len * group // block_m) * kv_heads
    slots = sm_count * min_blocks
    whole = (1, kv_tiles * block_n if kv_tiles else block_n)
    if ctas >= slots or kv_tiles < 2 * MIN_CHUNK_TILES:
        return whole
    ranges = _row_tile_ranges(qo_len, kv_len, group, block_m, causal, window_left)
    args = (ranges, kv_heads, kv_len)
    tile_us = TILE_US * (block_m / 128) * (block_n / 64) * (head_dim / 64)
    merge_bytes_per_split = qo_len * group * kv_heads * head_dim * 4 * 2  # fp32 partial O, written and read
    best_cost = _makespan(*args, max(kv_len, 1), block_n, False, sm_count, min_blocks) * tile_us
    best = whole
    # Candidates: a few small splits, and those that fill about half, one, 1.5 or two waves.
    cands = {2, 3, 4}
    for f in (0.5, 1.0, 1.5, 2.0):
        cands.update((int(f * slots // ctas), -(-int(f * slots) // ctas)))
    for splits in sorted(c for c in cands if 2 <= c <= kv_tiles // MIN_CHUNK_TILES):
        chunk_tiles = -(-kv_tiles // splits)
        chunk = chunk_tiles * block_n
        n = -(-kv_tiles // chunk_tiles)
        cost = (_makespan(*args, chunk, block_n, True, sm_count, min_blocks) * tile_us
                + MERGE_LAUNCH_US + n * merge_bytes_per_split / PARTIAL_BYTES_PER_US)
        if cost < best_cost:
            best_cost, best = cost, (n, chunk)
    return best
