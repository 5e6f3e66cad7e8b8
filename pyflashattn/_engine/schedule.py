"""THE scheduler: work items (request, q tile, KV chunk), split-KV sizing, LPT order, for a
batch or a single request.

Pure numpy, host only (no CUDA import), vectorised: plan_prefill() has no per-work-item Python
loop. At serving batch sizes its cost is mostly numpy's fixed cost per call (0.5-1 us on a slow
host) times a few dozen calls, so the code keeps that count small (see the numpy helpers); large
batches add a dozen or so memory-bound passes over the per-tile / per-item arrays.
``python -m pyflashattn._engine.schedule`` prints its cost in microseconds.

Reference design: FlashInfer's FA2 prefill scheduler (``PrefillSplitQOKVIndptr`` /
``PrefillPlanImpl`` in include/flashinfer/attention/scheduler.cuh). Differences:

* Partial outputs are fp32 and sized by the rows that are actually split: a split request owns
  ``qo_len * num_chunks`` partial rows of ``[Hq, D]`` fp32 (+ ``[Hq]`` fp32 LSE). FlashInfer
  carves ``Hq * padded_batch * cta_tile_q`` rows whatever the batch, which over-allocates by
  the GQA group factor and stores the partial O in fp16/bf16.
* Requests that are not split write their output directly; ``merge_indptr`` is empty for their
  tokens, so the merge kernel skips them (also in CUDA-graph mode, where FlashInfer splits all).
* Work items are ordered longest first (LPT) by a causal/window-aware cost estimate.
* The KV chunk search counts ``items * num_kv_heads`` CTAs against ``num_sms * ctas_per_sm``
  and never makes a chunk shorter than 256 keys (whole KV tiles).

Layout contract (the kernels' side, see kernel_src/include/pfa/attention/params.h):

* work item w (``blockIdx.z``; every kv head is a separate CTA along ``blockIdx.x``) handles
  request ``work_request[w]`` (``-1`` = padding of a fixed CUDA-graph grid: the CTA exits),
  packed rows ``[t * block_m, (t + 1) * block_m)`` of the request's ``qo_len * group_size``
  rows (packed row r = token r // group, head r % group), keys
  ``[c * kv_chunk_size, min((c + 1) * kv_chunk_size, kv_len))`` with ``t = work_qtile[w]`` and
  ``c = work_chunk[w]``. Chunks outside every row's causal/window range are still launched
  (the kernel writes lse = -inf for them), so every request has uniform chunks.
* request b with ``num_chunks[b] > 1``: token i, chunk c -> partial row
  ``o_indptr[b] + i * num_chunks[b] + c``; the merge kernel combines partial rows
  ``[merge_indptr[t], merge_indptr[t + 1])`` of global token t.
* float workspace: partial O fp32 ``[num_partial_rows, Hq, D]`` at offset 0, then partial LSE
  fp32 ``[num_partial_rows, Hq]``; each region padded to 256 bytes
  (:meth:`PrefillPlan.workspace_layout`).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from . import cost_model, switches
from .geometry import tile_spans
from .npfast import accumulate as _acc, consts as _k, div as _div, lpt_order as _lpt_order, shared as _shared
from .npfast import unsigned_max

__all__ = ["PrefillPlan", "plan_prefill", "schedule_prefill", "stream_k_first", "stream_k_mode", "MIN_CHUNK_TOKENS", "SHORT_KV_TILES",
           "STREAM_K_MIN_TILES", "WORKSPACE_ALIGN"]

# The wave-filling search never makes a chunk shorter than this many keys (rounded up to whole
# BLOCK_N tiles): it amortises the partial store and the merge. (The one-request cost model
# prices those costs itself and has its own floor, cost_model.MIN_CHUNK_TILES.)
MIN_CHUNK_TOKENS = 256
# Two-CTA-per-SM kernels with about a CTA per SM already: no automatic split unless the longest
# request has at least this many KV tiles. Splitting then only fills the second CTA slot, which
# pays on long walks, while on short ones the merge launch and the fp32 partials cost more than
# the halved walk saves (measured on an H100; NOTES.md, "Measurements moved out of code comments").
SHORT_KV_TILES = 16
WORKSPACE_ALIGN = 256
_I32_MAX = 2**31 - 1


def _align(n: int) -> int:
    return (n + WORKSPACE_ALIGN - 1) // WORKSPACE_ALIGN * WORKSPACE_ALIGN


class ItemTiles:
    """A plan's KV tiles per work item in launch order, computed only for the items indexed:
    routing.section_head_z reads the first and the lightest few, where a gather of every item
    would cost plan() microseconds at thousands of items."""

    __slots__ = ("neg", "order", "n", "default")

    def __init__(self, neg, order, n: int, default: int):
        self.neg, self.order, self.n, self.default = neg, order, n, default

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if self.neg is None:
            return np.full(len(range(self.n)[i]), self.default, np.int64) if isinstance(i, slice) else self.default
        return -self.neg[self.order[i]]  # (order holds the num_work items exactly)

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self[:], dtype)


@dataclass(eq=False)
class PrefillPlan:
    """The schedule of one batch prefill launch (+ merge launch when ``split``).

    Extra field beyond the kernel contract: ``max_partial_rows``, an upper bound on
    ``num_partial_rows`` for every plan made with the same CUDA-graph capacity and settings
    (so a captured launch can keep a fixed LSE offset); equal to ``num_partial_rows``
    outside graph mode.
    """

    block_m: int
    block_n: int
    num_work: int
    grid: int
    kv_chunk_size: int
    split: bool
    work_request: np.ndarray
    work_qtile: np.ndarray
    work_chunk: np.ndarray
    num_chunks: np.ndarray
    o_indptr: np.ndarray
    merge_indptr: np.ndarray
    num_partial_rows: int
    total_q: int
    max_partial_rows: int = -1

    # Not a field: the int32 buffer the arrays are consecutive views of, in int_arrays() order
    # (set by plan_prefill; None for a plan built otherwise), so that a caller can copy all of
    # them in one piece. Without a split it ends after o_indptr (merge_indptr is then a shared
    # read-only zero view).
    buffer = None
    # Not a field: (-KV tiles per item or None, launch order) as _fill_work_items sorted them, read
    # by item_tiles() within the plan() that made it (the arrays may be reused by the next plan).
    lpt = None

    def __post_init__(self):
        if self.max_partial_rows < 0:
            self.max_partial_rows = self.num_partial_rows

    def item_tiles(self, default: int) -> "ItemTiles":
        """KV tiles each work item iterates, in launch order (heaviest first), worked out for the
        items read; `default` for every item where the planner found them all alike or kept no keys."""
        neg, order = self.lpt if self.lpt is not None else (None, None)
        return ItemTiles(neg, order, self.num_work, default)

    def workspace_layout(self, num_qo_heads: int, head_dim: int, rows: int | None = None):
        """(lse_offset, total_bytes) of the float workspace for ``rows`` partial rows
        (default ``num_partial_rows``; pass ``max_partial_rows`` for a layout that stays
        fixed across CUDA-graph replans). Partial O fp32 [rows, Hq, D] at 0, partial LSE
        fp32 [rows, Hq] at lse_offset, both regions 256-byte aligned."""
        r = self.num_partial_rows if rows is None else int(rows)
        o = _align(r * int(num_qo_heads) * int(head_dim) * 4)
        return o, o + _align(r * int(num_qo_heads) * 4)

    def workspace_bytes(self, num_qo_heads: int, head_dim: int) -> int:
        """Exact float-workspace bytes this plan uses (0 when nothing is split)."""
        return self.workspace_layout(num_qo_heads, head_dim)[1]

    def int_arrays(self) -> dict:
        """The int32 arrays the kernels read, by their params names (for staging)."""
        return {"work_request": self.work_request, "work_qtile": self.work_qtile, "work_chunk": self.work_chunk,
                "num_chunks": self.num_chunks, "o_indptr": self.o_indptr, "merge_indptr": self.merge_indptr}


# Stream-K (sm90/stream_k.cuh): a persistent launch of `blocks` equal blocks of `tiles` KV tiles on
# `ctas` CTAs runs ceil(blocks / ctas) rounds, the last one partly idle (a power-of-two shape on
# 132 SMs runs like 128: 3%; hd64's 192-row tile at 4096 keys, 5.33 rounds: 11%). Sharing the last
# blocks out as equal ranges of tiles ends every CTA together, at the price of a block boundary or
# two more a CTA and a hand-off: about 5.5 tiles a CTA by the same-process A/B (H200, NOTES.md
# session 37: hd128 1 x 4096, 3.9 tiles to gain, ran 0.987x; 1 x 8192, 15.5 tiles, 1.018x).
# Taken where the last round's idle share is worth at least STREAM_K_MIN_TILES tiles a CTA.
STREAM_K_MIN_TILES = 8
# "0": never (A/B runs); "1": wherever the shape allows, gain or not (tests); unset: where it pays
STREAM_K_ENV = "PFA_STREAM_K"
STREAM_K_MODES = ("", "0", "1")


def stream_k_mode() -> str:
    """PFA_STREAM_K as one of STREAM_K_MODES ("" = unset); any other value is a ValueError, not a
    switch read as its default."""
    return switches.choice(STREAM_K_ENV, STREAM_K_MODES[1:])


def stream_k_first(blocks: int, ctas: int, tiles: int, force: bool = False) -> int | None:
    """The first block stream-K shares out (whole rounds of `ctas` blocks before it, between one
    and two rounds' worth after it, so that every CTA's range is longer than a block and an item is
    split once at most), or None: a round of blocks or less, rounds that divide the blocks, or
    (unless `force`) less than STREAM_K_MIN_TILES tiles a CTA to gain."""
    rounds, rest = divmod(blocks, ctas)
    if rounds < 1 or rest == 0 or tiles < 2:
        return None
    if not force and (ctas - rest) * tiles < STREAM_K_MIN_TILES * ctas:
        return None
    return (rounds - 1) * ctas


# ---- validation helpers ---------------------------------------------------------------------
def _pos_int(v, name: str) -> int:
    try:
        i = operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(v).__name__}") from None
    if i <= 0:
        raise ValueError(f"{name} must be > 0, got {i}")
    return i


def _int_array(x, name: str) -> np.ndarray:
    """x as a 1-D integer ndarray, not copied (an empty array of another dtype becomes int64)."""
    a = x if isinstance(x, np.ndarray) else np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        if a.size:
            raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
        a = a.astype(np.int64)
    return a


# ---- KV chunk search ---------------------------------------------------------------------------
def _search_chunk_units(tiles_f, kv1_f: np.ndarray, T: int, limit: int, bn: int, u_min: int, u_max: int):
    """Smallest u in [u_min, u_max] with f(u) = sum(tiles * ceil(kv1 / (u * bn))) <= limit,
    given f(u_max) <= limit (f is non-increasing in u); tiles_f None means all ones.
    Returns (u, ceil(kv1 / (u * bn)) as float64 or None when not evaluated).

    Bounds first (x <= ceil(x) < x + 1): f(u) >= W / (u bn), so u >= W / (limit bn) is
    necessary; f(u) < W / (u bn) + T, so u >= W / ((limit - T) bn) is sufficient. What is
    left is searched K-ary: K candidate chunk sizes per numpy pass ([K, B] division + ceil +
    one row sum), exact in float64: all values are integers < 2**53, an integer quotient is
    computed exactly, and a non-integer one (at least 1/c away from an integer) never rounds
    onto an integer at these magnitudes, so ceil is exact.
    """
    W = int(np.add.reduce(kv1_f) if tiles_f is None else tiles_f @ kv1_f)
    lo = max(u_min, -(-W // (limit * bn)))
    hi = u_max
    if limit > T:
        hi = min(hi, max(lo, -(-W // ((limit - T) * bn))))
    k = min(64, max(8, 8192 // kv1_f.size))
    row = kv1_f[None, :]
    best = None
    while lo < hi:  # invariant: f(hi) <= limit, and f(u) > limit for every u < lo
        step = -(-(hi - lo) // k)
        cand = np.arange(lo * bn, hi * bn, step * bn, dtype=np.float64)  # <= k sizes, cand[0] = lo * bn
        q = row / cand[:, None]  # [K, B]
        np.ceil(q, out=q)
        f = np.add.reduce(q, 1) if tiles_f is None else q @ tiles_f
        # f is non-increasing: the infeasible ones come first; i = how many
        i = cand.size - int(f[::-1].searchsorted(limit, "right"))
        if i == cand.size:
            lo = int(cand[-1]) // bn + 1
        else:
            hi = int(cand[i]) // bn
            best = q[i]
            if not i:
                return hi, best
            lo = int(cand[i - 1]) // bn + 1
    return hi, best


def _split_items(nh, l, nc_t, item_end, N, cu):
    """Items of split q tiles (tile-major, chunk fastest): (-KV tiles of each item or None where
    they are all alike, LPT order, chunk index of each item).
    Chunk c of a tile covers KV tiles [c*cu, (c+1)*cu) (cu = chunk / bn), so an item iterates
    max(min((c+1)*cu, h) - max(c*cu, l), 0) of them, at most cu (cu < the longest request's
    tiles, as it is split). nh = -h per tile; item_end: one past each tile's last item."""
    c = np.arange(N, dtype=np.int32)  # int32: the largest arrays here, memory-bound
    if nc_t.size == 1 and l is None:  # one q tile: its items' tiles never grow with c
        return None, c, c
    c -= (item_end - nc_t).astype(np.int32).repeat(nc_t)
    neg = c * cu
    if l is None:  # -tiles = clip(c*cu - h, -cu, 0)
        neg += nh.astype(np.int32).repeat(nc_t)
        np.minimum(neg, 0, out=neg)
        np.maximum(neg, -cu, out=neg)
    else:  # -tiles = min(max(c*cu, l) - min((c+1)*cu, h), 0)
        lo = np.maximum(neg, l.astype(np.int32).repeat(nc_t))
        neg += cu
        np.negative(neg, out=neg)
        np.maximum(neg, nh.astype(np.int32).repeat(nc_t), out=neg)
        neg += lo
        np.minimum(neg, 0, out=neg)
    return neg, _lpt_order(neg, cu), c


# ---- the planner -------------------------------------------------------------------------------
def plan_prefill(qo_indptr, kv_lens, *, group_size, num_kv_heads, block_m, block_n, num_sms, ctas_per_sm,
                 causal=False, window_left=-1, fixed_split_size=None, disable_split_kv=False,
                 graph_capacity=None, cost_head_dim=None) -> PrefillPlan:
    """Schedule a batch prefill: one work item per (request, packed-row tile, KV chunk).

    qo_indptr: int [B+1] (starts at 0, non-decreasing); kv_lens: int [B] keys per request (a
    paged caller computes them from its indptr / last_page_len: the plan never sees pages).
    group_size = Hq / Hkv; rows of a request are packed token-major: qo_len * group_size rows.

    KV chunk size (``kv_chunk_size``, a multiple of block_n, one value for the whole batch):

    * ``disable_split_kv``: one chunk per request (chunk = max kv_len rounded up to block_n).
    * ``fixed_split_size=n``: chunk = n rounded up to block_n. Depends on nothing else, so each
      request's chunking, reduction order and therefore its output bits are batch-invariant.
    * otherwise (FlashInfer's binary search, with heads counted): the CTA budget is
      ``num_sms * ctas_per_sm``; every work item runs once per kv head, so the item limit is
      ``L = budget // num_kv_heads``. With ``T`` = q tiles of the batch: if ``T > L`` (the grid
      is already more than a wave without splitting) or the longest request fits one minimum
      chunk, nothing is split (chunk = max kv_len rounded up). Else the chunk is the smallest
      multiple of block_n, at least ``MIN_CHUNK_TOKENS`` (256) keys, with
      ``sum_b tiles_b * ceil(max(kv_b, 1) / chunk) <= L``: the most parallelism that still fits
      one wave. Chunk counts use the full kv_len (chunks a causal/window mask hides from a tile
      are still launched and write lse = -inf; see the module docstring).
      Exception (``ctas_per_sm > 1``, i.e. kernels that run two CTAs per SM): when the unsplit
      grid already has a CTA for every other SM (``2 * T * num_kv_heads >= num_sms``) and the
      longest request has fewer than ``SHORT_KV_TILES`` KV tiles, nothing is split (see
      SHORT_KV_TILES).
    * ``cost_head_dim`` given and a one-request batch outside graph mode (the row-tile kernels;
      single prefill and a one-request batch alike): the number of chunks comes from the cost
      model (cost_model.plan_chunks), which prices the causal/window work per row tile, the
      waves, the fp32 partial traffic and the merge launch.

    LPT order: items sorted by cost descending, stable (ties keep (request, tile, chunk)
    order, so the plan is a deterministic function of its inputs). cost = block_n * (KV tiles
    the kernel iterates for that tile and chunk: causal/window aware, from the tile's first
    and last token, tile-aligned exactly like the kernel) + block_m (the per-item Q load and
    epilogue; a constant, so it does not change the order).

    graph_capacity = {"max_batch", "max_total_q", "max_work" (or None)} (CUDA-graph mode): the
    grid is fixed for the capacity -- ``max_work`` if given, else
    ``max(L, ceil(max_total_q * group / block_m) + min(max_batch, max_total_q) - 1)`` (the
    most q tiles any batch within capacity can have; FlashInfer's padded_batch_size) -- and
    items past ``num_work`` are padding (work_request = -1). The automatic search allows
    ``min(L, grid)`` items. ValueError when the batch exceeds the capacity or needs more items
    than the grid (only possible with an explicit max_work or with fixed_split_size).
    ``max_partial_rows`` is then a bound valid for every plan within the capacity.
    """
    g = _pos_int(group_size, "group_size")
    hkv = _pos_int(num_kv_heads, "num_kv_heads")
    bm = _pos_int(block_m, "block_m")
    bn = _pos_int(block_n, "block_n")
    cps = _pos_int(ctas_per_sm, "ctas_per_sm")
    budget = _pos_int(num_sms, "num_sms") * cps
    wl = operator.index(window_left)
    if wl < -1:
        raise ValueError(f"window_left must be >= -1, got {wl}")
    fss = None if fixed_split_size is None else _pos_int(fixed_split_size, "fixed_split_size")

    qo = _int_array(qo_indptr, "qo_indptr").astype(np.int64, copy=False)
    kv_in = _int_array(kv_lens, "kv_lens")
    B = kv_in.size
    if qo.size != B + 1:
        raise ValueError(f"qo_indptr has {qo.size} entries but kv_lens has {B}: qo_indptr needs len(kv_lens) + 1")
    if qo[0] != 0:
        raise ValueError(f"qo_indptr must start at 0, got {int(qo[0])}")
    qo_lens = qo[1:] - qo[:-1]
    kv = kv_in.astype(np.int64, copy=False)
    max_qo, max_kv = unsigned_max(qo_lens), unsigned_max(kv)
    if (max_qo | max_kv) >> 63:
        if max_qo >> 63:
            raise ValueError("qo_indptr must be non-decreasing (a request has a negative query length)")
        raise ValueError("kv_lens must be >= 0 (a request has a negative KV length)")
    return schedule_prefill(qo, qo_lens, kv, max_qo, max_kv, g, hkv, bm, bn, budget, bool(causal), wl, fss,
                            disable_split_kv, graph_capacity, cps, cost_head_dim)


def schedule_prefill(qo, qo_lens, kv, max_qo, max_kv, g, hkv, bm, bn, budget, causal, wl, fss, disable_split_kv,
                     cap, ctas_per_sm=1, cost_head_dim=None, attn_chunk=0):
    """plan_prefill() after its argument checks, for callers that validated the lengths already
    (the engine): qo = the int32/int64 qo_indptr, qo_lens / kv the int64 lengths (>= 0, not
    modified), max_qo / max_kv their maxima (0 for an empty batch), the scalars checked ints
    (fss = fixed_split_size or None), cap = graph_capacity, budget = num_sms * ctas_per_sm.
    cost_head_dim: a one-request launch on a row-tile kernel of this head_dim takes its automatic
    split from the cost model (cost_model.plan_chunks), as single prefill does; None (the decode
    tiles, and plan_prefill's callers) keeps the wave-filling search. attn_chunk: chunked
    attention's chunk size (0 = none), a left bound per row the LPT order sees (geometry); the
    split search prices tiles without it (an over-estimate: it only splits more)."""
    B = kv.size
    total_q = qo.item(-1)
    if total_q > _I32_MAX or max_kv > _I32_MAX:
        raise ValueError("qo_indptr / kv_lens exceed the int32 range of the kernel metadata")
    if wl >= max_kv:  # every window starts before key 0: the KV tiles are those without a window
        wl = -1
    cap_b = cap_q = cap_w = None
    if cap is not None:
        cap_b, cap_q, cap_w = _check_capacity(cap, B, total_q)
    # ---- q tiles: ceil(qo_len * g / bm) per request. Decode-like batches (every request exactly
    # one tile) skip the per-tile arrays: tile = request (tiles = ends = None). ----
    if max_qo * g <= bm and np.count_nonzero(qo_lens) == B:
        tiles = ends = None
        T = B
    else:
        if bm % g == 0:  # a tile holds bm / g whole tokens
            tiles = _div(qo_lens + _k[bm // g - 1], bm // g)
        else:
            tiles = qo_lens * g
            tiles += bm - 1
            _div(tiles, bm)
        ends = _acc(tiles)  # one past each request's last tile (global tile index)
        T = ends.item(-1)
    limit = budget // hkv
    if cap is not None:
        if cap_w is not None:
            grid = _pos_int(cap_w, "graph_capacity['max_work']")
        else:
            tiles_bound = (-(-cap_q * g // bm) + min(cap_b, cap_q) - 1) if cap_q else 0
            grid = max(limit, tiles_bound, 1)
        search_limit = min(limit, grid)
    else:
        search_limit = limit
    one_request_cost = cost_head_dim is not None and B == 1 and cap is None
    chunk, nc_f = _chunk_size(qo_lens, kv, max_qo, max_kv, tiles, T, B, g, hkv, bm, bn, budget, causal, wl, fss,
                              disable_split_kv, search_limit, ctas_per_sm, cost_head_dim if one_request_cost else None)
    if chunk >= max_kv:
        nc = None  # one chunk per request
        N = T
    else:
        if nc_f is not None:  # the search evaluated this chunk size already
            nc = nc_f.astype(np.int64)
        else:
            nc = kv + (chunk - 1)
            nc //= chunk
            np.maximum(nc, 1, out=nc)  # ceil(max(kv, 1) / chunk)
        nc_t = nc if tiles is None else nc.repeat(tiles)  # chunks of each q tile
        item_end = _acc(nc_t)  # one past each q tile's last item
        N = int(item_end[-1]) if T else 0
    split = N > T  # some request with queries has > 1 chunk
    if cap is not None and N > grid:
        what = "graph_capacity['max_work']" if cap_w is not None else "the CUDA-graph grid"
        raise ValueError(f"this batch needs {N} work items but {what} is {grid}"
                         + (f" (fixed_split_size={fss} makes chunk counts unbounded)"
                            if fss is not None else ""))
    if cap is None:
        grid = N

    # Every int32 output is a slice of one zeroed buffer: one allocation, and what stays 0 is
    # written already. Without a split, merge_indptr (total_q + 1 entries, the largest) is all
    # zeros: a shared read-only view instead.
    buf = np.zeros(3 * grid + 2 * B + 1 + (total_q + 1 if split else 0), np.int32)
    work_request, work_qtile, work_chunk = buf[:grid], buf[grid:2 * grid], buf[2 * grid:3 * grid]
    num_chunks = buf[3 * grid:3 * grid + B]
    o_indptr = buf[3 * grid + B:3 * grid + 2 * B + 1]
    merge_indptr = buf[3 * grid + 2 * B + 1:] if split else _shared("zeros", total_q + 1)
    if grid > N:
        work_request[N:] = -1  # padding of a fixed CUDA-graph grid
    lpt = _fill_work_items(work_request, work_qtile, work_chunk, qo_lens, kv, tiles, ends, T, B, N, g, bm, bn, causal, wl,
                     max_kv, split, chunk, nc, None if nc is None else nc_t, None if nc is None else item_end,
                     attn_chunk)
    if split:
        num_partial_rows = _fill_partial_rows(num_chunks, o_indptr, merge_indptr, qo, qo_lens, nc, tiles, B,
                                              total_q, max_kv, chunk)
    else:
        num_partial_rows = 0
        if nc is None:
            num_chunks.fill(1)
        else:
            num_chunks[:] = nc

    # ---- a bound on partial rows for a fixed CUDA-graph workspace layout ----
    max_partial_rows = num_partial_rows
    if cap is not None:
        if disable_split_kv:
            max_partial_rows = 0
        else:
            # A CTA (item x kv head) covers at most block_m packed rows = block_m / g tokens of
            # its head group, so (split tokens x chunks) <= items * block_m / g.
            items_bound = grid if fss is not None else min(search_limit, grid)
            max_partial_rows = min(items_bound * bm // g, cap_q * items_bound)

    plan = PrefillPlan(bm, bn, N, grid, int(chunk), split, work_request, work_qtile, work_chunk, num_chunks,
                       o_indptr, merge_indptr, num_partial_rows, total_q, max_partial_rows)
    plan.buffer, plan.lpt = buf, lpt
    return plan


def _check_capacity(cap, B, total_q):
    """(max_batch, max_total_q, max_work or None) of a CUDA-graph capacity the batch fits."""
    try:
        cap_b = _pos_int(cap["max_batch"], "graph_capacity['max_batch']")
        cap_q = operator.index(cap["max_total_q"])
        cap_w = cap.get("max_work")
    except KeyError as e:
        raise ValueError(f"graph_capacity needs the key {e.args[0]!r}") from None
    if cap_q < 0:
        raise ValueError(f"graph_capacity['max_total_q'] must be >= 0, got {cap_q}")
    if B > cap_b:
        raise ValueError(f"batch size {B} exceeds graph_capacity['max_batch'] = {cap_b}")
    if total_q > cap_q:
        raise ValueError(f"{total_q} query tokens exceed graph_capacity['max_total_q'] = {cap_q}")
    return cap_b, cap_q, cap_w


def _chunk_size(qo_lens, kv, max_qo, max_kv, tiles, T, B, g, hkv, bm, bn, budget, causal, wl, fss, disable_split_kv,
                search_limit, ctas_per_sm, cost_head_dim):
    """(kv_chunk_size, the search's ceil(kv / chunk) per request as float64 or None)."""
    max_chunk = max(-(-max_kv // bn), 1) * bn
    if disable_split_kv:
        return max_chunk, None
    if fss is not None:
        chunk = -(-fss // bn) * bn
        if chunk > _I32_MAX:
            raise ValueError(f"fixed_split_size {fss} exceeds the int32 range")
        return chunk, None
    if cost_head_dim is not None:  # one request on a row-tile kernel: the cost model
        n, chunk = cost_model.plan_chunks(int(qo_lens[0]), int(kv[0]), g, hkv, bm, bn, budget // ctas_per_sm,
                                          ctas_per_sm, causal, wl, head_dim=cost_head_dim)
        return (max_chunk if n == 1 else chunk), None
    min_units = -(-MIN_CHUNK_TOKENS // bn)
    max_units = max_chunk // bn
    if (T == 0 or T > search_limit or max_units <= min_units
            or (ctas_per_sm > 1 and max_units < SHORT_KV_TILES and 2 * T * hkv * ctas_per_sm >= budget)):
        return max_chunk, None
    if B == 1:  # closed form: tiles * ceil(kv / c) <= L  <=>  c >= kv / (L // tiles)
        m = search_limit // T
        return min(max(min_units, -(-(-(-max(max_kv, 1) // m)) // bn)), max_units) * bn, None
    # requests without queries weigh 0 (tiles = 0)
    kv_f = np.maximum(kv, 1.0)  # float64
    u, nc_f = _search_chunk_units(None if tiles is None else tiles.astype(np.float64), kv_f, T, search_limit, bn,
                                  min_units, max_units)
    return u * bn, nc_f


def _fill_work_items(work_request, work_qtile, work_chunk, qo_lens, kv, tiles, ends, T, B, N, g, bm, bn, causal, wl,
                     max_kv, split, chunk, nc, nc_t, item_end, attn_chunk=0):
    """Work items (q tile-major, chunk fastest) in LPT order: a stable sort by the KV tiles the
    kernel iterates for each item, descending (ties keep the item order). Returns (the sort's
    keys, -KV tiles per item, or None where every item iterates the same; the launch order), for
    PrefillPlan.item_tiles."""
    first = req = None
    if tiles is not None:
        first = ends - tiles  # each request's first q tile
        req = _shared("iota", B).repeat(tiles)  # the request of each q tile
    nh, l = tile_spans(qo_lens, kv, tiles, first, req, g, bm, bn, causal, wl, attn_chunk)
    if not split:  # item = q tile; it iterates h - l KV tiles (>= 0: a tile's lo < its hi)
        neg = nh if l is None else np.add(nh, l, out=nh)
        order = _lpt_order(neg, -(-max_kv // bn))
        if tiles is None:  # q tile = request
            work_request[:N] = order
        else:
            req = req[order]
            work_request[:N] = req
            # the tile's index inside its request (order itself stays: item_tiles reads it)
            np.subtract(order, first[req], out=work_qtile[:N], casting="unsafe")
        return neg, order
    neg, order, c = _split_items(nh, l, nc_t, item_end, N, chunk // bn)
    work_chunk[:N] = c[order]
    # the request (and the tile's index inside it) of each item, in launch order
    if tiles is None:
        req = _shared("iota", B).repeat(nc)
    else:
        tq = np.arange(T)
        tq -= first[req]
        work_qtile[:N] = tq.astype(np.int32).repeat(nc_t)[order]
        req = req.astype(np.int32).repeat(nc_t)
    work_request[:N] = req[order]
    return neg, order


def _fill_partial_rows(num_chunks, o_indptr, merge_indptr, qo, qo_lens, nc, tiles, B, total_q, max_kv, chunk):
    """Partial rows (token-major, chunk fastest) and merge ranges of a split plan; returns the
    number of partial rows."""
    num_chunks[:] = nc
    cnt = nc * (nc > 1)  # partial rows per token of each request (0: written directly)
    every_qo_1 = tiles is None and total_q == B  # decode-like: token b = request b
    part = cnt if every_qo_1 else qo_lens * cnt
    if total_q * -(-max_kv // chunk) > _I32_MAX:  # a bound on the partial rows
        num_partial_rows = int(part.sum())
        if num_partial_rows > _I32_MAX:
            raise ValueError(f"{num_partial_rows} partial rows exceed the int32 range; use a larger "
                             "fixed_split_size or disable_split_kv")
    _acc(part.astype(np.int32), out=o_indptr[1:])
    num_partial_rows = int(o_indptr[-1])
    if every_qo_1:
        merge_indptr[:] = o_indptr
    elif total_q <= 2048:
        _acc(cnt.repeat(qo_lens), out=merge_indptr[1:])
    else:
        # token t of request b: o_indptr[b] + (t - qo_indptr[b]) * cnt[b] (a cumsum over many
        # tokens is slower). int32 products may wrap, but two's complement keeps the sum exact
        # because the result fits int32.
        cnt32 = cnt.astype(np.int32)
        m = merge_indptr[:-1]
        np.multiply(np.arange(total_q, dtype=np.int32), cnt32.repeat(qo_lens), out=m)
        m += (o_indptr[:-1] - qo[:-1].astype(np.int32) * cnt32).repeat(qo_lens)
        merge_indptr[-1] = num_partial_rows
    return num_partial_rows


# ---- benchmark: python -m pyflashattn._engine.schedule ---------------------------------------------------
def _bench():  # pragma: no cover - prints timings, asserts nothing
    import timeit

    rng = np.random.default_rng(0)
    kw = dict(group_size=4, num_kv_heads=8, block_m=128, block_n=64, num_sms=132, ctas_per_sm=2)

    def case(name, B, qo_lens, kv_lens, **extra):
        qo = np.zeros(B + 1, np.int32)
        np.cumsum(qo_lens, out=qo[1:])
        kv = np.asarray(kv_lens, np.int32)
        p = plan_prefill(qo, kv, **kw, **extra)
        # min over many short runs: robust against other processes sharing the CPU
        best = min(timeit.repeat(lambda: plan_prefill(qo, kv, **kw, **extra), number=10, repeat=300)) / 10
        print(f"  B={B:5d} {name:<38s} {best * 1e6:8.1f} us   work={p.num_work:6d} grid={p.grid:6d} "
              f"chunk={p.kv_chunk_size:6d} split={p.split} partial_rows={p.num_partial_rows}")

    print("plan_prefill() microseconds (wall time, min over 300 x 10 calls); 128x64 tiles, 132 SMs x 2 CTAs")
    print(" Hq=32 Hkv=8 (g=4):")
    for B in (64, 1024):
        case("decode-like qo=1, kv 1K..32K causal", B, np.ones(B, np.int64), rng.integers(1024, 32768, B),
             causal=True)
        case("spec-decode qo 1..8, kv 1K..32K causal", B, rng.integers(1, 9, B), rng.integers(1024, 32768, B),
             causal=True)
        case("mixed qo 1..64, kv 256..8K causal", B, rng.integers(1, 65, B), rng.integers(256, 8192, B),
             causal=True)
        case("mixed qo 1..64, kv 256..8K window 1024", B, rng.integers(1, 65, B), rng.integers(256, 8192, B),
             causal=True, window_left=1024)
        case("fixed_split_size=4096, qo 1..64 causal", B, rng.integers(1, 65, B), rng.integers(256, 32768, B),
             causal=True, fixed_split_size=4096)
        case("graph mode, qo=1 kv 1K..32K", B, np.ones(B, np.int64), rng.integers(1024, 32768, B),
             graph_capacity={"max_batch": B, "max_total_q": 8 * B, "max_work": None})
    case("chunked prefill qo 1..512 causal (8.5K items)", 1024, rng.integers(1, 513, 1024),
         rng.integers(512, 8192, 1024), causal=True)
    for B in (1, 8):
        case("long context qo=16 kv 1M causal (split)", B, np.full(B, 16), np.full(B, 1 << 20), causal=True)
    kw["group_size"], kw["num_kv_heads"] = 8, 1
    print(" Hq=8 Hkv=1 (MQA-like, splits often):")
    for B in (64, 1024):
        case("decode-like qo=1, kv 1K..32K causal", B, np.ones(B, np.int64), rng.integers(1024, 32768, B),
             causal=True)
        case("spec-decode qo 1..4, kv 1K..32K causal", B, rng.integers(1, 5, B), rng.integers(1024, 32768, B),
             causal=True)


if __name__ == "__main__":  # pragma: no cover
    _bench()
