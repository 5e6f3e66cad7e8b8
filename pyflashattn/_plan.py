"""Batch prefill scheduler: work items (request, q tile, KV chunk), split-KV sizing, LPT order.

Pure numpy, host only (no CUDA import), vectorised: plan_prefill() has no per-work-item Python
loop. ``python -m pyflashattn._plan`` prints its cost in microseconds.

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
  and never makes a chunk shorter than 4 KV tiles / 256 tokens.

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

__all__ = ["PrefillPlan", "plan_prefill", "MIN_CHUNK_TOKENS", "MIN_CHUNK_TILES", "WORKSPACE_ALIGN"]

MIN_CHUNK_TOKENS = 256  # automatic split: a chunk is never shorter than this many keys ...
MIN_CHUNK_TILES = 4  # ... nor than this many BLOCK_N tiles (amortises the epilogue + merge)
WORKSPACE_ALIGN = 256
_I32_MAX = 2**31 - 1


def _align(n: int) -> int:
    return (n + WORKSPACE_ALIGN - 1) // WORKSPACE_ALIGN * WORKSPACE_ALIGN


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

    def __post_init__(self):
        if self.max_partial_rows < 0:
            self.max_partial_rows = self.num_partial_rows

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
    a = x if isinstance(x, np.ndarray) else np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        if a.size:
            raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


# ---- KV chunk search ---------------------------------------------------------------------------
# numpy's Python-level wrappers (np.cumsum, np.repeat, np.clip, ...) cost more than the work at
# these sizes: the code below calls ndarray methods and ufuncs directly.
_acc = np.add.accumulate
try:  # the clip ufunc (np.clip is a Python wrapper around it)
    from numpy._core.umath import clip as _clip
except ImportError:  # numpy < 2
    from numpy.core.umath import clip as _clip


def _div(x: np.ndarray, d: int) -> np.ndarray:
    """x //= d in place (floor division, also of negatives); a shift when d is a power of 2."""
    if d & (d - 1) == 0:
        x >>= d.bit_length() - 1
    else:
        x //= d
    return x


def _search_chunk_units(tiles_f, kv1_f: np.ndarray, T: int, limit: int, bn: int, u_min: int, u_max: int):
    """Smallest u in [u_min, u_max] with f(u) = sum(tiles * ceil(kv1 / (u * bn))) <= limit,
    given f(u_max) <= limit (f is non-increasing in u).
    Returns (u, ceil(kv1 / (u * bn)) as float64 or None when not evaluated).

    Bounds first (x <= ceil(x) < x + 1): f(u) >= W / (u bn), so u >= W / (limit bn) is
    necessary; f(u) < W / (u bn) + T, so u >= W / ((limit - T) bn) is sufficient. What is
    left is searched K-ary: K candidate chunk sizes per numpy pass ([K, B] division + ceil +
    one mat-vec), exact in float64: all values are integers < 2**53, an integer quotient is
    computed exactly, and a non-integer one (at least 1/c away from an integer) never rounds
    onto an integer at these magnitudes, so ceil is exact.
    """
    W = int(tiles_f @ kv1_f)
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
        f = q @ tiles_f
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


# ---- the planner -------------------------------------------------------------------------------
def plan_prefill(qo_indptr, kv_lens, *, group_size, num_kv_heads, block_m, block_n, num_sms, ctas_per_sm,
                 causal=False, window_left=-1, fixed_split_size=None, disable_split_kv=False,
                 graph_capacity=None) -> PrefillPlan:
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
      multiple of block_n, at least ``max(4 * block_n, 256)`` keys, with
      ``sum_b tiles_b * ceil(max(kv_b, 1) / chunk) <= L``: the most parallelism that still fits
      one wave. Chunk counts use the full kv_len (chunks a causal/window mask hides from a tile
      are still launched and write lse = -inf; see the module docstring).

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
    budget = _pos_int(num_sms, "num_sms") * _pos_int(ctas_per_sm, "ctas_per_sm")
    wl = operator.index(window_left)
    if wl < -1:
        raise ValueError(f"window_left must be >= -1, got {wl}")
    if fixed_split_size is not None:
        fss = _pos_int(fixed_split_size, "fixed_split_size")
    causal = bool(causal)
    window = wl >= 0

    qo = _int_array(qo_indptr, "qo_indptr")
    kv = _int_array(kv_lens, "kv_lens")
    B = kv.size
    if qo.size != B + 1:
        raise ValueError(f"qo_indptr has {qo.size} entries but kv_lens has {B}: qo_indptr needs len(kv_lens) + 1")
    if qo[0] != 0:
        raise ValueError(f"qo_indptr must start at 0, got {int(qo[0])}")
    qo_lens = qo[1:] - qo[:-1]
    if B:
        if (qo_lens | kv).min() < 0:  # one reduction: negative iff either is
            if qo_lens.min() < 0:
                raise ValueError("qo_indptr must be non-decreasing (a request has a negative query length)")
            raise ValueError("kv_lens must be >= 0 (a request has a negative KV length)")
        max_kv = int(kv.max())
    else:
        max_kv = 0
    total_q = int(qo[-1])
    if total_q > _I32_MAX or max_kv > _I32_MAX:
        raise ValueError("qo_indptr / kv_lens exceed the int32 range of the kernel metadata")

    cap = graph_capacity
    if cap is not None:
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

    if bm % g == 0:  # a tile holds bm / g whole tokens
        sg = bm // g
        tiles = qo_lens + (sg - 1)
        tiles = _div(tiles, sg)
    else:
        sg = 0
        tiles = qo_lens * g
        tiles += bm - 1
        tiles = _div(tiles, bm)
    T = int(tiles.sum())
    # decode-like: every request has exactly one q tile (then q tile index = 0, item = request)
    one_tile = T == B and (B == 0 or int(tiles.max()) == 1)
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

    # ---- chunk size ----
    max_chunk = max(-(-max_kv // bn), 1) * bn
    nc_f = None
    if disable_split_kv:
        chunk = max_chunk
    elif fixed_split_size is not None:
        chunk = -(-fss // bn) * bn
        if chunk > _I32_MAX:
            raise ValueError(f"fixed_split_size {fss} exceeds the int32 range")
    else:
        min_units = -(-max(MIN_CHUNK_TILES * bn, MIN_CHUNK_TOKENS) // bn)
        max_units = max_chunk // bn
        if T == 0 or T > search_limit or max_units <= min_units:
            chunk = max_chunk
        elif B == 1:  # closed form: tiles * ceil(kv / c) <= L  <=>  c >= kv / (L // tiles)
            m = search_limit // T
            chunk = min(max(min_units, -(-(-(-max(max_kv, 1) // m)) // bn)), max_units) * bn
        else:
            # requests without queries weigh 0 (tiles = 0)
            t_f = tiles.astype(np.float64)
            kv_f = np.maximum(kv, 1.0)  # float64
            u, nc_f = _search_chunk_units(t_f, kv_f, T, search_limit, bn, min_units, max_units)
            chunk = u * bn
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
        N = int((nc if one_tile else tiles * nc).sum())
    split = N > T  # some request with queries has > 1 chunk
    if cap is not None and N > grid:
        what = "graph_capacity['max_work']" if cap_w is not None else "the CUDA-graph grid"
        raise ValueError(f"this batch needs {N} work items but {what} is {grid}"
                         + (f" (fixed_split_size={fss} makes chunk counts unbounded)"
                            if fixed_split_size is not None else ""))
    if cap is None:
        grid = N

    # ---- per q tile (request-major): the KV tiles [ltile, htile) the tile can see at all.
    # Token i of a request sits at i + shift (shift = kv_len - qo_len; packed row r is token
    # r // g): hi = causal end of the tile's last token, lo = window start of its first token;
    # htile = ceil(min(hi, kv) / bn) >= 0, ltile = floor(max(lo, 0) / bn). ----
    kvt = kv + (bn - 1)
    kvt = _div(kvt, bn)
    ltile = None
    if one_tile:
        req_t = first = None
        htile = kvt  # the only tile holds the last token, which sees every key up to kv_len
        if window:
            ltile = kv - qo_lens
            ltile -= wl
            np.maximum(ltile, 0, out=ltile)
            ltile = _div(ltile, bn)
    else:
        req_t = np.arange(B, dtype=np.int32).repeat(tiles)
        first = _acc(tiles).astype(np.int32)
        first -= tiles.astype(np.int32)  # first tile of each request (global tile index)
        kvt_t = kvt.repeat(tiles)
        if causal or window:
            shift = kv - qo_lens
            if sg:  # tile t holds tokens [t*s, (t+1)*s), s = bm / g, clipped by qo_len
                ts = np.arange(0, T * sg, sg, dtype=np.int64)  # (global tile) * s; own tile = that - first
                fs = first * sg
                if causal:
                    x = ts + (shift + (sg + bn - 1) - fs).repeat(tiles)
                if window:
                    lo = ts + (shift - wl - fs).repeat(tiles)
            else:
                t = np.arange(T, dtype=np.int64)
                t -= first.repeat(tiles)
                r0 = t * bm
                if causal:
                    x = np.minimum(r0 + bm, (qo_lens * g).repeat(tiles))
                    x += g - 1
                    x //= g
                    x += (shift + (bn - 1)).repeat(tiles)
                if window:
                    lo = r0 // g
                    lo += (shift - wl).repeat(tiles)
            if causal:  # x = hi + bn - 1; floor division of negatives rounds down: ceil(hi / bn)
                x = _div(x, bn)
                htile = _clip(x, 0, kvt_t, out=x)
            else:
                htile = kvt_t
            if window:
                np.maximum(lo, 0, out=lo)
                lo = _div(lo, bn)
                ltile = lo
        else:
            htile = kvt_t

    # ---- work items (tile-major, chunk fastest) and the KV tiles the kernel iterates for each:
    # chunk c covers KV tiles [c*cu, (c+1)*cu) (cu = chunk / bn), so an item iterates
    # max(min((c+1)*cu, htile) - max(c*cu, ltile), 0) tiles (the kernel's tile-aligned count) ----
    if not split:
        it = chk = None
        if ltile is None:
            ntile = htile
        else:
            ntile = htile - ltile
            np.maximum(ntile, 0, out=ntile)
    else:
        cu = chunk // bn
        if T == 1 and one_tile:  # a single request with a single q tile: item = chunk
            it = np.zeros(N, np.int32)
            chk = np.arange(N, dtype=np.int32)
        else:
            nc_t = nc if one_tile else nc.repeat(tiles)
            it = np.arange(T, dtype=np.int32).repeat(nc_t)
            fi = _acc(nc_t)
            fi -= nc_t
            chk = np.arange(N, dtype=np.int32)
            chk -= fi.take(it)  # chunk index inside the request
        ccu = chk * cu
        if ltile is None:
            ntile = htile.take(it)
            ntile -= ccu
            _clip(ntile, 0, cu, out=ntile)
        else:
            ntile = np.minimum(ccu + cu, htile.take(it))
            ntile -= np.maximum(ccu, ltile.take(it))
            np.maximum(ntile, 0, out=ntile)

    # ---- LPT order: stable sort by KV tiles descending ----
    mx = -(-max_kv // bn) if not split else min(cu, -(-max_kv // bn))  # ntile <= mx
    if N < 200 or mx >= 65536:
        order = (-ntile).argsort(kind="stable")
    else:  # numpy's stable sort is a radix sort for <= 16-bit keys
        order = np.subtract(mx, ntile, dtype=np.uint8 if mx < 256 else np.uint16, casting="unsafe").argsort(
            kind="stable")
    its = order if it is None else it.take(order)  # q tile of each item, in launch order
    if one_tile:
        wr = its.astype(np.int32)
        wq = None
    else:
        wr = req_t.take(its)
        wq = its.astype(np.int32) - first.take(wr)
    wc = chk.take(order) if chk is not None else None
    if cap is None:
        work_request = wr
        work_qtile = wq if wq is not None else np.zeros(N, np.int32)
        work_chunk = wc if wc is not None else np.zeros(N, np.int32)
    else:
        work_request = np.full(grid, -1, np.int32)
        work_qtile = np.zeros(grid, np.int32)
        work_chunk = np.zeros(grid, np.int32)
        work_request[:N] = wr
        if wq is not None:
            work_qtile[:N] = wq
        if wc is not None:
            work_chunk[:N] = wc

    # ---- partial rows (token-major, chunk fastest) and merge ranges ----
    if split:
        num_chunks = nc.astype(np.int32)
        cnt = num_chunks * (num_chunks > 1)  # partial rows per token of each request (0: written directly)
        every_qo_1 = one_tile and total_q == B  # decode-like: token b = request b
        part = cnt if every_qo_1 else qo_lens * cnt
        if total_q * -(-max_kv // chunk) > _I32_MAX:  # a bound on the partial rows
            num_partial_rows = int(part.sum())
            if num_partial_rows > _I32_MAX:
                raise ValueError(f"{num_partial_rows} partial rows exceed the int32 range; use a larger "
                                 "fixed_split_size or disable_split_kv")
        o_indptr = np.zeros(B + 1, np.int32)
        _acc(part.astype(np.int32), out=o_indptr[1:])
        num_partial_rows = int(o_indptr[-1])
        if every_qo_1:
            merge_indptr = o_indptr.copy()
        elif total_q <= 2048:
            merge_indptr = np.zeros(total_q + 1, np.int32)
            _acc(cnt.repeat(qo_lens), out=merge_indptr[1:])
        else:
            # token t of request b: o_indptr[b] + (t - qo_indptr[b]) * cnt[b] (a cumsum over many
            # tokens is slower). int32 products may wrap, but two's complement keeps the sum exact
            # because the result fits int32.
            cnt32 = cnt.astype(np.int32)
            merge_indptr = np.empty(total_q + 1, np.int32)
            m = merge_indptr[:-1]
            m[:] = np.arange(total_q, dtype=np.int32)
            m *= cnt32.repeat(qo_lens)
            m += (o_indptr[:-1] - qo[:-1].astype(np.int32) * cnt32).repeat(qo_lens)
            merge_indptr[-1] = num_partial_rows
    else:
        num_partial_rows = 0
        o_indptr = np.zeros(B + 1, np.int32)
        merge_indptr = np.zeros(total_q + 1, np.int32)
        num_chunks = nc.astype(np.int32) if nc is not None else np.ones(B, np.int32)

    # ---- a bound on partial rows for a fixed CUDA-graph workspace layout ----
    max_partial_rows = num_partial_rows
    if cap is not None:
        if disable_split_kv:
            max_partial_rows = 0
        else:
            # A CTA (item x kv head) covers at most block_m packed rows = block_m / g tokens of
            # its head group, so (split tokens x chunks) <= items * block_m / g.
            items_bound = grid if fixed_split_size is not None else min(search_limit, grid)
            max_partial_rows = min(items_bound * bm // g, cap_q * items_bound)

    return PrefillPlan(bm, bn, N, grid, int(chunk), split, work_request, work_qtile, work_chunk, num_chunks,
                       o_indptr, merge_indptr, num_partial_rows, total_q, max_partial_rows)


# ---- benchmark: python -m pyflashattn._plan ---------------------------------------------------
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
