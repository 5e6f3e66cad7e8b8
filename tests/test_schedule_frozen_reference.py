"""plan_prefill() against a frozen copy of the scheduler it replaced (commit 4c05d11).

The host-speed rewrite of pyflashattn._plan must compute exactly what the previous version
computed: every field of the plan, every int32 array bit for bit, and the same exception (type
and message) for every rejected input. ``_plan_prefill_reference`` below is that version,
verbatim except that it returns a dict of the PrefillPlan fields. Do not "fix" it: it is the
specification of the outputs; property checks against the kernel contract live in
test_plan_batch.py. (One deliberate difference: a window_left beyond every KV length schedules
like no window at all, where the reference raised OverflowError for one past the int64 range.
A second one, from the engine refactor: the automatic chunk's floor is MIN_CHUNK_TOKENS keys in
whole tiles, without the reference's extra "at least 4 tiles" (which only ever bound for
block_n > 64, a tile no kernel has); MIN_CHUNK_FLOOR_TILES below mirrors that.)
"""
import operator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyflashattn._engine.schedule import SHORT_KV_TILES, PrefillPlan, plan_prefill

# ---- the frozen reference: pyflashattn/_plan.py at 4c05d11, verbatim but for the _ref_ names and
# the returned dict (do not edit) ----------------------------------------------------------------
MIN_CHUNK_TOKENS = 256
MIN_CHUNK_FLOOR_TILES = 0  # the engine refactor's floor: MIN_CHUNK_TOKENS alone (see the docstring)
_I32_MAX = 2**31 - 1


def _ref_pos_int(v, name: str) -> int:
    try:
        i = operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(v).__name__}") from None
    if i <= 0:
        raise ValueError(f"{name} must be > 0, got {i}")
    return i


def _ref_int_array(x, name: str) -> np.ndarray:
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


def _ref_div(x: np.ndarray, d: int) -> np.ndarray:
    """x //= d in place (floor division, also of negatives); a shift when d is a power of 2."""
    if d & (d - 1) == 0:
        x >>= d.bit_length() - 1
    else:
        x //= d
    return x


def _ref_search_chunk_units(tiles_f, kv1_f: np.ndarray, T: int, limit: int, bn: int, u_min: int, u_max: int):
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



def _plan_prefill_reference(qo_indptr, kv_lens, *, group_size, num_kv_heads, block_m, block_n, num_sms, ctas_per_sm,
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
    g = _ref_pos_int(group_size, "group_size")
    hkv = _ref_pos_int(num_kv_heads, "num_kv_heads")
    bm = _ref_pos_int(block_m, "block_m")
    bn = _ref_pos_int(block_n, "block_n")
    budget = _ref_pos_int(num_sms, "num_sms") * _ref_pos_int(ctas_per_sm, "ctas_per_sm")
    wl = operator.index(window_left)
    if wl < -1:
        raise ValueError(f"window_left must be >= -1, got {wl}")
    if fixed_split_size is not None:
        fss = _ref_pos_int(fixed_split_size, "fixed_split_size")
    causal = bool(causal)
    window = wl >= 0

    qo = _ref_int_array(qo_indptr, "qo_indptr")
    kv = _ref_int_array(kv_lens, "kv_lens")
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
            cap_b = _ref_pos_int(cap["max_batch"], "graph_capacity['max_batch']")
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
        tiles = _ref_div(tiles, sg)
    else:
        sg = 0
        tiles = qo_lens * g
        tiles += bm - 1
        tiles = _ref_div(tiles, bm)
    T = int(tiles.sum())
    # decode-like: every request has exactly one q tile (then q tile index = 0, item = request)
    one_tile = T == B and (B == 0 or int(tiles.max()) == 1)
    limit = budget // hkv
    if cap is not None:
        if cap_w is not None:
            grid = _ref_pos_int(cap_w, "graph_capacity['max_work']")
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
        min_units = -(-max(MIN_CHUNK_FLOOR_TILES * bn, MIN_CHUNK_TOKENS) // bn)
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
            u, nc_f = _ref_search_chunk_units(t_f, kv_f, T, search_limit, bn, min_units, max_units)
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
    kvt = _ref_div(kvt, bn)
    ltile = None
    if one_tile:
        req_t = first = None
        htile = kvt  # the only tile holds the last token, which sees every key up to kv_len
        if window:
            ltile = kv - qo_lens
            ltile -= wl
            np.maximum(ltile, 0, out=ltile)
            ltile = _ref_div(ltile, bn)
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
                x = _ref_div(x, bn)
                htile = _clip(x, 0, kvt_t, out=x)
            else:
                htile = kvt_t
            if window:
                np.maximum(lo, 0, out=lo)
                lo = _ref_div(lo, bn)
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

    return dict(block_m=bm, block_n=bn, num_work=N, grid=grid, kv_chunk_size=int(chunk), split=split,
                work_request=work_request, work_qtile=work_qtile, work_chunk=work_chunk, num_chunks=num_chunks,
                o_indptr=o_indptr, merge_indptr=merge_indptr, num_partial_rows=num_partial_rows, total_q=total_q,
                max_partial_rows=max_partial_rows)



# ---- comparison ----------------------------------------------------------------------------------
ARRAYS = ("work_request", "work_qtile", "work_chunk", "num_chunks", "o_indptr", "merge_indptr")
SCALARS = {"block_m": int, "block_n": int, "num_work": int, "grid": int, "kv_chunk_size": int, "split": bool,
           "num_partial_rows": int, "total_q": int, "max_partial_rows": int}


def outcome(fn, qo_indptr, kv_lens, kw):
    """The plan's fields as a dict, or (exception type, message)."""
    try:
        p = fn(qo_indptr, kv_lens, **kw)
    except (ValueError, TypeError) as e:
        return type(e), str(e)
    if isinstance(p, dict):
        return p
    assert isinstance(p, PrefillPlan)
    d = {name: getattr(p, name) for name in (*SCALARS, *ARRAYS)}
    assert p.int_arrays() == {name: d[name] for name in ARRAYS}
    assert all(p.int_arrays()[name] is d[name] for name in ARRAYS)
    return d


def _short_kv_rule(qo_indptr, kv_lens, kw, want) -> bool:
    """Does the one deliberate change since the reference apply (pyflashattn._plan.SHORT_KV_TILES):
    a two-CTA-per-SM kernel, an automatic split the reference would search for, about a CTA per
    SM already and the longest request under SHORT_KV_TILES KV tiles: then nothing is split."""
    if not isinstance(want, dict) or kw.get("disable_split_kv") or kw.get("fixed_split_size") is not None:
        return False
    cps, sms, hkv = kw["ctas_per_sm"], kw["num_sms"], kw["num_kv_heads"]
    g, bm, bn = kw["group_size"], kw["block_m"], kw["block_n"]
    qo = np.asarray(qo_indptr, np.int64)
    kv = np.asarray(kv_lens, np.int64)
    T = int((-(-(qo[1:] - qo[:-1]) * g // bm)).sum())
    limit = sms * cps // hkv
    if kw.get("graph_capacity") is not None:
        limit = min(limit, want["grid"])
    max_units = max(-(-int(kv.max(initial=0)) // bn), 1)
    min_units = -(-max(MIN_CHUNK_FLOOR_TILES * bn, MIN_CHUNK_TOKENS) // bn)
    return (cps > 1 and 0 < T <= limit and min_units < max_units < SHORT_KV_TILES
            and 2 * T * hkv >= sms)


def assert_same(qo_indptr, kv_lens, kw):
    """New plan == frozen reference, bit for bit; outputs own their memory. Where the short-KV
    rule applies, the reference is the frozen one with the split disabled (the CUDA-graph
    partial-row bound stays the automatic mode's)."""
    want = outcome(_plan_prefill_reference, qo_indptr, kv_lens, kw)
    if _short_kv_rule(qo_indptr, kv_lens, kw, want):
        bound = want["max_partial_rows"]
        want = outcome(_plan_prefill_reference, qo_indptr, kv_lens, dict(kw, disable_split_kv=True))
        if kw.get("graph_capacity") is not None:
            want["max_partial_rows"] = bound
    got = outcome(plan_prefill, qo_indptr, kv_lens, kw)
    if isinstance(want, tuple):
        assert got == want
        return
    assert isinstance(got, dict), got
    for name, typ in SCALARS.items():
        assert type(got[name]) is typ and got[name] == want[name], (name, got[name], want[name])
    arrays = [got[name] for name in ARRAYS]
    for name, a in zip(ARRAYS, arrays):
        b = want[name]
        assert type(a) is np.ndarray and a.dtype == np.int32 and a.ndim == 1 and a.flags.c_contiguous, name
        assert a.shape == b.shape and np.array_equal(a, b), name
    inputs = [x for x in (qo_indptr, kv_lens) if isinstance(x, np.ndarray)]
    for i, a in enumerate(arrays):  # the caller may keep or modify any of them independently
        for other in arrays[i + 1:] + inputs:
            assert not np.shares_memory(a, other)


# ---- random inputs over every branch of the scheduler ---------------------------------------------
def random_case(rng):
    """(qo_indptr, kv_lens, plan_prefill kwargs) covering batch 0..2000, qo 0..2048, kv 0..1M, GQA,
    causal / window, every split mode, CUDA-graph capacities, input dtypes and rejected inputs."""
    r = rng.random
    B = int(rng.choice([0, 1, 2, rng.integers(3, 17), rng.integers(17, 300), rng.integers(300, 2001)],
                       p=[0.03, 0.12, 0.08, 0.3, 0.3, 0.17]))
    qmax = int(rng.choice([0, 1, 2, 8, 64, 512, 2048], p=[0.04, 0.22, 0.08, 0.2, 0.22, 0.14, 0.1]))
    if B > 300 and qmax > 64 and r() < 0.7:
        qmax = 64  # keeps most big batches at serving-like token counts (and the test fast)
    qo = rng.integers(1 if qmax and r() < 0.5 else 0, qmax + 1, B)
    if qmax == 1 and r() < 0.5:
        qo[:] = 1  # decode
    kmax = int(rng.choice([0, 300, 8192, 32768, 1 << 20], p=[0.03, 0.2, 0.3, 0.27, 0.2]))
    kv = rng.integers(0, kmax + 1, B)
    if r() < 0.2:
        kv = kv + qo  # causal-valid
    if r() < 0.1 and B:
        kv[:] = kv[0]
    if r() < 0.15 and B:
        kv[rng.integers(0, B, max(1, B // 8))] = 0
    kw = dict(group_size=int(rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 16, 32])),
              num_kv_heads=int(rng.choice([1, 2, 4, 8, 32])),
              block_m=int(rng.choice([16, 32, 64, 128, 48, 96])),
              block_n=int(rng.choice([16, 32, 64, 128, 80])),
              num_sms=int(rng.choice([1, 8, 108, 132])), ctas_per_sm=int(rng.choice([1, 2])),
              causal=bool(r() < 0.6))
    x = r()
    kw["window_left"] = -1 if x < 0.55 else 0 if x < 0.6 else int(rng.integers(1, 5000)) if x < 0.9 else \
        int(rng.integers(1, 1 << 21))
    x = r()
    if x < 0.15:
        kw["disable_split_kv"] = True
    elif x < 0.4:
        fss = int(rng.choice([1, 16, 100, 300, 1000, 4096, 65536, rng.integers(1, 20000)]))
        # at most ~300K work items (tiles x chunks), so a case stays cheap
        tiles = -(-qo * kw["group_size"] // kw["block_m"])
        fss = max(fss, int(tiles @ np.maximum(kv, 1)) // 300_000)
        kw["fixed_split_size"] = fss
    if r() < 0.3:
        total = int(qo.sum())
        kw["graph_capacity"] = {"max_batch": max(B + int(rng.integers(-1 if B else 0, 5)), 1),
                                "max_total_q": total + int(rng.integers(-1 if total else 0, 100)),
                                "max_work": None if r() < 0.6 else int(rng.integers(1, 3000))}
        if r() < 0.1:
            del kw["graph_capacity"]["max_work"]
    qo_indptr = np.zeros(B + 1, np.int64)
    np.cumsum(qo, out=qo_indptr[1:])
    x = r()
    if x < 0.05 and B:  # rejected inputs
        y = int(rng.integers(0, 3))
        if y == 0:
            kv[int(rng.integers(0, B))] = -1
        elif y == 1:
            qo_indptr[int(rng.integers(1, B + 1))] -= qmax + 1
        else:
            qo_indptr = qo_indptr[:-1]
    dt = rng.choice(["int32", "int64", "uint32", "list"], p=[0.5, 0.35, 0.05, 0.1])
    if dt == "list":
        return qo_indptr.tolist(), kv.tolist(), kw
    if dt == "uint32" and (qo_indptr < 0).any() | (kv < 0).any():
        dt = "int32"
    return qo_indptr.astype(dt), kv.astype(dt), kw


def test_random_inputs_match_reference():
    rng = np.random.default_rng(20240611)
    for _ in range(4000):
        qo, kv, kw = random_case(rng)
        assert_same(qo, kv, kw)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 1 << 20)), max_size=40),
       st.sampled_from([1, 2, 3, 4, 8]), st.sampled_from([1, 2, 8]), st.sampled_from([16, 64, 128, 48]),
       st.sampled_from([16, 64, 80]), st.sampled_from([1, 8, 132]), st.booleans(),
       st.one_of(st.just(-1), st.integers(0, 5000)),
       st.one_of(st.just("auto"), st.just("disable"), st.integers(1, 70000)),
       st.one_of(st.none(), st.tuples(st.integers(0, 3), st.integers(0, 50),
                                      st.one_of(st.none(), st.integers(1, 500)))))
def test_hypothesis_inputs_match_reference(reqs, g, hkv, bm, bn, sms, causal, wl, mode, graph):
    qo_lens = [q for q, _ in reqs]
    qo = np.zeros(len(reqs) + 1, np.int32)
    np.cumsum(qo_lens, out=qo[1:])
    kv = np.array([k for _, k in reqs], np.int64)
    kw = dict(group_size=g, num_kv_heads=hkv, block_m=bm, block_n=bn, num_sms=sms, ctas_per_sm=2, causal=causal,
              window_left=wl)
    if mode == "disable":
        kw["disable_split_kv"] = True
    elif mode != "auto":
        kw["fixed_split_size"] = mode
    if graph is not None:
        kw["graph_capacity"] = {"max_batch": len(reqs) + graph[0], "max_total_q": sum(qo_lens) + graph[1],
                                "max_work": graph[2]}
    assert_same(qo, kv, kw)


KW = dict(group_size=4, num_kv_heads=8, block_m=128, block_n=64, num_sms=132, ctas_per_sm=2)


@pytest.mark.parametrize("qo, kv, extra", [
    ([0], [], {}),
    ([0, 0], [0], {}),
    ([0, 1], [0], {"causal": True}),
    ([0, 1], [1 << 20], {}),
    ([0, 16], [1 << 20], {"causal": True}),
    ([0, 2**31], [1], {}),  # total_q past int32
    ([0, 1], [2**31], {}),  # kv past int32
    ([0, 1], [100], {"fixed_split_size": 2**31 - 1}),  # chunk rounds up past int32
    ([0, 1.0], [100], {}),
    ([0, 1], [1.5], {}),
    ([[0, 1]], [1], {}),
    ([0, 3], [10], {"window_left": -2}),
    ([0, 3], [10], {"graph_capacity": {"max_batch": 1}}),
    ([0, 3], [10], {"graph_capacity": {"max_batch": 1, "max_total_q": 2}}),
    ([0, 3, 6], [10, 10], {"graph_capacity": {"max_batch": 1, "max_total_q": 10}}),
    ([0, 3], [10], {"graph_capacity": {"max_batch": 1, "max_total_q": 3, "max_work": 0}}),
    ([0, 3], [100000], {"graph_capacity": {"max_batch": 1, "max_total_q": 3, "max_work": 1}, "fixed_split_size": 64}),
    ([0, 3], [100000], {"graph_capacity": {"max_batch": 1, "max_total_q": 3}, "fixed_split_size": 1}),
    ([0, 3], [10], {"group_size": 0}),
    ([0, 3], [10], {"num_sms": 1.5}),
    ([0, 3], [10], {"block_m": True}),  # a bool is an int to operator.index
    ([0, 3], [10], {"causal": 1, "window_left": np.int64(5)}),
    ([0, 512], [512], {"causal": True}),  # the short-KV rule: not split (the reference splits)
    ([0, 512], [512], {"causal": True, "graph_capacity": {"max_batch": 2, "max_total_q": 600}}),
    ([0, 512], [1024], {"causal": True}),  # 16 KV tiles: split as before
])
def test_edge_cases_match_reference(qo, kv, extra):
    assert_same(qo, kv, dict(KW, **extra))


def test_partial_rows_past_int32_match_reference():
    """Partial rows beyond int32 are rejected, below they are summed exactly (one request with
    a huge tile: 65536 tokens x 65536 chunks)."""
    kw = dict(KW, group_size=1, block_m=65536, block_n=16, fixed_split_size=16)
    assert_same(np.array([0, 65536]), np.array([1 << 20]), kw)
    many = np.ones(40000, np.int64)  # total_q x chunks of the longest > int32, the sum is not
    kv = np.full(40000, 16)
    kv[0] = 1 << 20
    qo = np.zeros(40001, np.int64)
    np.cumsum(many, out=qo[1:])
    assert_same(qo, kv, kw)


@pytest.mark.parametrize("causal", [False, True])
def test_window_past_every_kv_is_no_window(causal):
    """Windows that start before key 0 for every token schedule exactly like no window, up to
    window_left values numpy's int64 arithmetic could not hold."""
    rng = np.random.default_rng(5)
    qo = np.zeros(41, np.int64)
    np.cumsum(rng.integers(0, 300, 40), out=qo[1:])
    kv = rng.integers(0, 20000, 40)
    for mode in ({}, {"fixed_split_size": 1000}):
        kw = dict(KW, causal=causal, **mode)
        for wl in (int(kv.max()), int(kv.max()) + 1, 2**40):
            assert_same(qo, kv, dict(kw, window_left=wl))
        no_window = plan_prefill(qo, kv, **kw)
        huge = plan_prefill(qo, kv, window_left=2**70, **kw)
        for name, a in no_window.int_arrays().items():
            np.testing.assert_array_equal(a, huge.int_arrays()[name])
