"""The split-KV cost model for one request: how many KV chunks its row tiles get.

Short queries over long KV give too few CTAs to fill the GPU; splitting KV into chunks (fp32
partials + a merge kernel) adds CTAs. It also adds work, so a split must shorten the launch.
Each candidate split count gets an estimated time in microseconds:

* the attention launch, in KV tiles of work: each CTA costs the tiles it walks (from the one
  tile geometry, geometry.tile_spans), plus ``SPLIT_COST_TILES`` for its fp32 partial store when
  the launch is split (an empty chunk, wholly outside the causal or window range, still writes
  ``lse = -inf``: ``EMPTY_COST_TILES``); the launch takes the largest of three estimates: the
  heaviest CTA, the total work over the SMs, and (more CTAs than slots) the two lightest of the
  ``slots + 1`` heaviest CTAs, which must share a slot (256 CTAs on 264 slots must not become
  512). Times ``TILE_US`` scaled by the tile's FLOPs;
* a split adds the merge: ``MERGE_LAUNCH_US`` plus writing and reading the fp32 partial
  outputs at ``PARTIAL_BYTES_PER_US``.

The constants were calibrated on an H100 by timing every split count of short single-request
shapes (NOTES.md has the tables). The scheduler (schedule.py) uses this model for one-request
launches on the row-tile kernels, single prefill and a one-request batch alike.
"""
from __future__ import annotations

import numpy as np

from .geometry import tile_spans

__all__ = ["plan_chunks", "SPLIT_COST_TILES", "EMPTY_COST_TILES", "MIN_CHUNK_TILES", "TILE_US", "MERGE_LAUNCH_US",
           "PARTIAL_BYTES_PER_US"]

SPLIT_COST_TILES = 1  # a CTA's fp32 partial store
EMPTY_COST_TILES = 1
MIN_CHUNK_TILES = 2  # shortest chunk (the merge and partial costs are in the estimate itself)
TILE_US = 1.0  # one 128-row x 64-key tile at head_dim 64 on one SM (FLOPs scale the others)
MERGE_LAUNCH_US = 4.0  # the merge kernel's launch and ramp
PARTIAL_BYTES_PER_US = 2.5e6  # fp32 partials written by the attention, read by the merge (HBM)


def _row_tile_spans(qo_len, kv_len, group, block_m, block_n, causal, window_left):
    """[l, h) in KV tiles for each packed-row tile of one request (geometry.tile_spans)."""
    qo, kv = np.array([qo_len], np.int64), np.array([kv_len], np.int64)
    tiles = np.array([-(-qo_len * group // block_m)], np.int64)
    wl = window_left if window_left < kv_len else -1  # a window past every key is no window
    nh, l = tile_spans(qo, kv, tiles, np.zeros(1, np.int64), np.zeros(int(tiles[0]), np.intp), group, block_m,
                       block_n, causal, wl)
    return (np.zeros_like(nh) if l is None else l), -nh


def _makespan(spans, kv_heads, kv_tiles, chunk_tiles, split, sm_count, min_blocks):
    """Estimated attention launch time in KV-tile units (see the module docstring). Chunk c covers
    KV tiles [c * chunk_tiles, (c + 1) * chunk_tiles): a chunk boundary is a tile boundary, so the
    tiles a row tile walks in it are the overlap of the two ranges."""
    lo_t, hi_t = spans
    c0 = np.arange(0, max(kv_tiles, 1), chunk_tiles, dtype=np.int64)  # every row tile runs every chunk
    lo = np.maximum(lo_t[:, None], c0[None, :])
    hi = np.minimum(hi_t[:, None], c0[None, :] + chunk_tiles)
    tiles = np.maximum(hi - lo, 0)
    if split:
        tiles = tiles + np.where(tiles > 0, SPLIT_COST_TILES, EMPTY_COST_TILES)
    w = np.sort(tiles.ravel())[::-1]  # each value stands for kv_heads CTAs
    est = max(float(w[0]), float(w.sum()) * kv_heads / sm_count)
    slots = sm_count * min_blocks
    if w.size * kv_heads > slots:  # two of the slots + 1 heaviest CTAs share a slot
        est = max(est, float(w[(slots - 1) // kv_heads] + w[slots // kv_heads]) * min_blocks)
    return est


def plan_chunks(qo_len, kv_len, group, kv_heads, block_m, block_n, sm_count, min_blocks, causal=False,
                window_left=-1, *, head_dim):
    """(number of chunks, kv_chunk_size) for one request; the chunk is a multiple of block_n."""
    kv_tiles = -(-kv_len // block_n)
    ctas = -(-qo_len * group // block_m) * kv_heads
    slots = sm_count * min_blocks
    whole = (1, kv_tiles * block_n if kv_tiles else block_n)
    if ctas >= slots or kv_tiles < 2 * MIN_CHUNK_TILES:
        return whole
    spans = _row_tile_spans(qo_len, kv_len, group, block_m, block_n, causal, window_left)
    tile_us = TILE_US * (block_m / 128) * (block_n / 64) * (head_dim / 64)
    merge_bytes_per_chunk = qo_len * group * kv_heads * head_dim * 4 * 2  # fp32 partial O, written and read
    best_cost = _makespan(spans, kv_heads, kv_tiles, max(kv_tiles, 1), False, sm_count, min_blocks) * tile_us
    best = whole
    # Candidates: a few small chunk counts, and those that fill about half, one, 1.5 or two waves.
    cands = {2, 3, 4}
    for f in (0.5, 1.0, 1.5, 2.0):
        cands.update((int(f * slots // ctas), -(-int(f * slots) // ctas)))
    for want in sorted(c for c in cands if 2 <= c <= kv_tiles // MIN_CHUNK_TILES):
        chunk_tiles = -(-kv_tiles // want)
        n = -(-kv_tiles // chunk_tiles)  # equal chunks of whole tiles: maybe fewer than wanted
        cost = (_makespan(spans, kv_heads, kv_tiles, chunk_tiles, True, sm_count, min_blocks) * tile_us
                + MERGE_LAUNCH_US + n * merge_bytes_per_chunk / PARTIAL_BYTES_PER_US)
        if cost < best_cost:
            best_cost, best = cost, (n, chunk_tiles * block_n)
    return best
