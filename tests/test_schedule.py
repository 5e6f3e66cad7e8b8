"""Batch prefill scheduler (pyflashattn._engine.schedule): CPU-only properties of plan_prefill().

Every check is against an independent brute-force reference written here from the contract
(kernel_src/include/pfa/attention/{params.h,mask.cuh,work.cuh,merge.cuh}), including a
numpy simulation of the attention + merge launches driven only by the plan's arrays.
"""
import inspect
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyflashattn._engine.schedule import MIN_CHUNK_TOKENS, SHORT_KV_TILES, PrefillPlan, plan_prefill

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- references --------------------------------------------------------------------------------
def indptr(lens):
    out = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=out[1:])
    return out


def ntiles(qo, g, bm):
    return -(-qo * g // bm)


def ref_chunk(qo_lens, kv_lens, g, hkv, bm, bn, budget, limit=None, ctas=1):
    """The automatic split rule, by linear scan over every candidate chunk."""
    L = budget // hkv if limit is None else limit
    tiles = np.array([ntiles(q, g, bm) for q in qo_lens], np.int64)
    T = int(tiles.sum())
    max_kv = max(kv_lens, default=0)
    max_c = max(-(-max_kv // bn), 1) * bn
    min_c = -(-MIN_CHUNK_TOKENS // bn) * bn
    if T == 0 or T > L or max_c <= min_c:
        return max_c
    # two-CTA kernels with a CTA for every other SM and short KV: the merge would not pay
    if ctas > 1 and max_c < SHORT_KV_TILES * bn and T * hkv >= (budget // ctas) / 2:
        return max_c
    kv1 = np.maximum(np.asarray(kv_lens, np.int64), 1)
    for c in range(min_c, max_c + 1, bn):
        if int((tiles * (-(-kv1 // c))).sum()) <= L:
            return c
    raise AssertionError("unreachable: one chunk per request fits")


def item_kv_tiles(qo, kv, t, c, chunk, g, bm, bn, causal, wl):
    """KV tiles the kernel iterates for item (tile t, chunk c) of a request (work.cuh)."""
    rows = qo * g
    r0 = t * bm
    q_lo, q_hi = r0 // g, (min(r0 + bm, rows) - 1) // g
    pos = lambda q: q + kv - qo  # noqa: E731
    begin = max(0, pos(q_lo) - wl) if wl >= 0 else 0
    end = min(kv, max(0, pos(q_hi) + 1)) if causal else kv
    s_lo, s_hi = c * chunk, min(c * chunk + chunk, kv)
    lo, hi = max(begin, s_lo), min(end, s_hi)
    return (hi - lo // bn * bn + bn - 1) // bn if hi > lo else 0


def check_plan(p: PrefillPlan, qo_lens, kv_lens, *, g, hkv, bm, bn, budget, causal, wl, mode, graph=None,
               ctas=1):
    """Every structural property of a plan, against brute force."""
    B = len(qo_lens)
    qo_lens = [int(x) for x in qo_lens]
    kv_lens = [int(x) for x in kv_lens]
    total_q = sum(qo_lens)
    chunk = p.kv_chunk_size
    assert p.block_m == bm and p.block_n == bn and p.total_q == total_q
    for name in ("work_request", "work_qtile", "work_chunk", "num_chunks", "o_indptr", "merge_indptr"):
        a = getattr(p, name)
        assert a.dtype == np.int32 and a.ndim == 1, name
        assert p.int_arrays()[name] is a
    assert set(p.int_arrays()) == {"work_request", "work_qtile", "work_chunk", "num_chunks", "o_indptr",
                                   "merge_indptr"}
    assert p.work_request.size == p.work_qtile.size == p.work_chunk.size == p.grid
    assert p.num_chunks.size == B and p.o_indptr.size == B + 1 and p.merge_indptr.size == total_q + 1

    # chunks tile each request's KV exactly
    assert chunk > 0 and chunk % bn == 0
    nc = [int(x) for x in p.num_chunks]
    for b in range(B):
        assert nc[b] == max(1, -(-kv_lens[b] // chunk)), b
        assert (nc[b] - 1) * chunk < max(kv_lens[b], 1) <= nc[b] * chunk or kv_lens[b] == 0
    split_req = [nc[b] > 1 and qo_lens[b] > 0 for b in range(B)]
    assert p.split == any(split_req)

    # every (request, q tile, kv chunk) exactly once; padding after the real items
    expect = {(b, t, c) for b in range(B) for t in range(ntiles(qo_lens[b], g, bm)) for c in range(nc[b])}
    N = p.num_work
    got = list(zip(p.work_request[:N].tolist(), p.work_qtile[:N].tolist(), p.work_chunk[:N].tolist()))
    assert len(got) == len(set(got)) == N
    assert set(got) == expect
    if graph is None:
        assert p.grid == N
    else:
        assert p.grid >= N
        assert (p.work_request[N:] == -1).all()
        assert (p.work_qtile[N:] == 0).all() and (p.work_chunk[N:] == 0).all()

    # partial rows: token-major, chunk fastest; only split requests own any
    o = p.o_indptr.tolist()
    assert o[0] == 0
    for b in range(B):
        assert o[b + 1] - o[b] == (qo_lens[b] * nc[b] if nc[b] > 1 else 0)
    assert p.num_partial_rows == o[-1]
    m = p.merge_indptr.tolist()
    assert m[0] == 0 and m[-1] == p.num_partial_rows
    t0 = 0
    for b in range(B):
        for i in range(qo_lens[b]):
            if nc[b] > 1:
                assert m[t0 + i] == o[b] + i * nc[b]
                assert m[t0 + i + 1] - m[t0 + i] == nc[b]
            else:
                assert m[t0 + i + 1] == m[t0 + i]
        t0 += qo_lens[b]
    assert all(x <= y for x, y in zip(m, m[1:]))

    # workspace: exact formula, and at least what the kernel writes
    for hq, d in ((hkv * g, 64), (hkv * g, 128), (7, 256)):
        rows = p.num_partial_rows
        want = -(-rows * hq * d * 4 // 256) * 256 + -(-rows * hq * 4 // 256) * 256
        assert p.workspace_bytes(hq, d) == want
        assert p.workspace_bytes(hq, d) >= rows * hq * (d + 1) * 4
        lse_off, total = p.workspace_layout(hq, d)
        assert total == want and lse_off % 256 == 0 and lse_off >= rows * hq * d * 4
    assert p.max_partial_rows >= p.num_partial_rows
    if not p.split:
        assert p.workspace_bytes(32, 128) == 0

    # chunk choice
    tiles = [ntiles(q, g, bm) for q in qo_lens]
    max_c = max(-(-max(kv_lens, default=0) // bn), 1) * bn
    if mode == "disable":
        assert chunk == max_c and not p.split
    elif isinstance(mode, int):
        assert chunk == -(-mode // bn) * bn
    else:
        limit = budget // hkv
        if graph is not None:
            limit = min(limit, p.grid)
        assert chunk == ref_chunk(qo_lens, kv_lens, g, hkv, bm, bn, budget, limit, ctas)
        if p.split:
            assert N * hkv <= budget  # within one wave
            assert chunk >= max(4 * bn, 256)
        else:
            assert N == sum(tiles)

    # LPT: KV-tile cost non-increasing; ties in (request, tile, chunk) order (stable)
    cost = [item_kv_tiles(qo_lens[b], kv_lens[b], t, c, chunk, g, bm, bn, causal, wl) for b, t, c in got]
    if p.lpt is not None and p.lpt[0] is not None:  # the tiles the L2 sections' tail is sized by
        assert np.asarray(p.item_tiles(0)).tolist() == cost
    for k in range(N - 1):
        assert cost[k] >= cost[k + 1], (k, cost[k], cost[k + 1])
        if cost[k] == cost[k + 1]:
            assert got[k] < got[k + 1]


def run_plan(qo_lens, kv_lens, *, g, hkv, bm, bn, sms, ctas, causal, wl, mode, graph=None):
    kw = dict(group_size=g, num_kv_heads=hkv, block_m=bm, block_n=bn, num_sms=sms, ctas_per_sm=ctas,
              causal=causal, window_left=wl, graph_capacity=graph)
    if mode == "disable":
        kw["disable_split_kv"] = True
    elif isinstance(mode, int):
        kw["fixed_split_size"] = mode
    p = plan_prefill(indptr(qo_lens), np.asarray(kv_lens, np.int64), **kw)
    check_plan(p, qo_lens, kv_lens, g=g, hkv=hkv, bm=bm, bn=bn, budget=sms * ctas, causal=causal, wl=wl,
               mode=mode, graph=graph, ctas=ctas)
    return p


# ---- strategies ----------------------------------------------------------------------------------
qo_len = st.one_of(st.just(0), st.integers(1, 4), st.integers(1, 300))
kv_len = st.one_of(st.just(0), st.integers(1, 300), st.integers(1, 20000))
configs = st.fixed_dictionaries({
    "g": st.sampled_from([1, 2, 3, 4, 6, 8, 32]),
    "hkv": st.sampled_from([1, 2, 8, 32]),
    "bm": st.sampled_from([16, 64, 128]),
    "bn": st.sampled_from([16, 32, 64]),
    "sms": st.sampled_from([1, 8, 108, 132]),
    "ctas": st.sampled_from([1, 2]),
    "causal": st.booleans(),
    "wl": st.one_of(st.just(-1), st.just(0), st.integers(1, 5000)),
    "mode": st.sampled_from(["auto", "auto", "disable", 1, 7, 64, 300, 1000, 4096]),
})


@SETTINGS
@given(st.lists(st.tuples(qo_len, kv_len), min_size=0, max_size=12), configs)
def test_plan_properties(reqs, cfg):
    run_plan([q for q, _ in reqs], [k for _, k in reqs], **cfg)


@SETTINGS
@given(st.lists(st.tuples(qo_len, kv_len), min_size=0, max_size=12), configs, st.integers(0, 3), st.integers(0, 50),
       st.one_of(st.none(), st.integers(1, 400)))
def test_plan_properties_graph_mode(reqs, cfg, extra_b, extra_q, max_work):
    """Same properties with a CUDA-graph capacity; errors only when the fixed grid cannot hold the batch."""
    qo_lens, kv_lens = [q for q, _ in reqs], [k for _, k in reqs]
    g, bm = cfg["g"], cfg["bm"]
    cap = {"max_batch": max(len(reqs) + extra_b, 1), "max_total_q": sum(qo_lens) + extra_q, "max_work": max_work}
    limit = cfg["sms"] * cfg["ctas"] // cfg["hkv"]
    qmax = cap["max_total_q"]
    grid = max_work if max_work is not None else max(limit, (-(-qmax * g // bm) + min(cap["max_batch"], qmax) - 1)
                                                     if qmax else 0, 1)
    T = sum(ntiles(q, g, bm) for q in qo_lens)
    try:
        p = run_plan(qo_lens, kv_lens, graph=cap, **cfg)
    except ValueError as e:
        mode = cfg["mode"]
        if isinstance(mode, int):
            c = -(-mode // cfg["bn"]) * cfg["bn"]
            need = sum(ntiles(q, g, bm) * max(1, -(-kk // c)) for q, kk in zip(qo_lens, kv_lens))
        else:
            need = T
        assert need > grid, e
        assert "max_work" in str(e) or "grid" in str(e)
        return
    assert p.grid == grid


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 200000)), min_size=1, max_size=6),
       st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4]), st.booleans())
def test_auto_split_decode_like(reqs, g, hkv, causal):
    """Few short queries over long KV: the case the automatic split exists for."""
    p = run_plan([q for q, _ in reqs], [k for _, k in reqs], g=g, hkv=hkv, bm=64, bn=64, sms=132, ctas=2,
                 causal=causal, wl=-1, mode="auto")
    if any(q > 0 and k > 1024 for q, k in reqs):  # the slack (T <= 6 items, L >= 66) allows 2+ chunks
        assert p.split


# ---- numeric simulation: attention + merge launches driven only by the plan ---------------------
def simulate(p, q, k, v, qo_lens, kv_lens, g, causal, wl):
    """q [total_q, Hq, D], k/v [total_kv, Hkv, D] (ragged). Runs every work item x kv head like the
    kernel (keys of its chunk, mask rule), writes o / partial rows, then the merge; asserts no
    location is written twice and every partial row the merge reads was written."""
    Hq, D = q.shape[1], q.shape[2]
    qo_ptr, kv_ptr = indptr(qo_lens), indptr(kv_lens)
    out = np.full(q.shape, np.nan)
    lse = np.full(q.shape[:2], np.nan)
    po = np.full((p.num_partial_rows, Hq, D), np.nan)
    pl = np.full((p.num_partial_rows, Hq), np.nan)
    chunk, bm = p.kv_chunk_size, p.block_m
    for w in range(p.grid):
        b = int(p.work_request[w])
        if b < 0:
            continue
        t, c, nc = int(p.work_qtile[w]), int(p.work_chunk[w]), int(p.num_chunks[b])
        qo, kvl = int(qo_lens[b]), int(kv_lens[b])
        for kvh in range(k.shape[1]):
            for r in range(t * bm, min((t + 1) * bm, qo * g)):
                i, h = r // g, kvh * g + r % g
                keys = np.arange(c * chunk, min(c * chunk + chunk, kvl))
                pos = i + kvl - qo
                keep = np.ones(keys.size, bool)
                if causal:
                    keep &= keys <= pos
                if wl >= 0:
                    keep &= keys >= pos - wl
                keys = keys[keep]
                qi = q[qo_ptr[b] + i, h]
                if keys.size:
                    s = k[kv_ptr[b] + keys, kvh] @ qi
                    mx = s.max()
                    e = np.exp(s - mx)
                    o_ = e @ v[kv_ptr[b] + keys, kvh] / e.sum()
                    l_ = mx + math.log(e.sum())
                else:
                    o_, l_ = np.zeros(D), -np.inf
                if nc > 1:
                    row = p.o_indptr[b] + i * nc + c
                    assert np.isnan(pl[row, h]), "partial row written twice"
                    po[row, h], pl[row, h] = o_, l_
                else:
                    assert np.isnan(lse[qo_ptr[b] + i, h]), "output written twice"
                    out[qo_ptr[b] + i, h], lse[qo_ptr[b] + i, h] = o_, l_
    for tok in range(p.total_q):
        a, z = int(p.merge_indptr[tok]), int(p.merge_indptr[tok + 1])
        if a == z:
            continue
        ls = pl[a:z]  # [count, Hq]
        assert not np.isnan(ls).any() and not np.isnan(po[a:z]).any(), "merge reads an unwritten partial"
        mx = ls.max(axis=0)
        m_use = np.where(np.isinf(mx), 0.0, mx)
        wgt = np.exp(ls - m_use)
        den = wgt.sum(axis=0)
        assert np.isnan(lse[tok]).all(), "merged token was also written directly"
        out[tok] = np.where(den[:, None] > 0, (wgt[:, :, None] * po[a:z]).sum(0) / np.maximum(den, 1e-300)[:, None], 0)
        lse[tok] = np.where(den > 0, m_use + np.log(np.maximum(den, 1e-300)), -np.inf)
    return out, lse


def reference(q, k, v, qo_lens, kv_lens, g, causal, wl):
    out = np.zeros(q.shape)
    lse = np.full(q.shape[:2], -np.inf)
    qo_ptr, kv_ptr = indptr(qo_lens), indptr(kv_lens)
    for b in range(len(qo_lens)):
        qo, kvl = int(qo_lens[b]), int(kv_lens[b])
        for i in range(qo):
            pos = i + kvl - qo
            keys = np.arange(kvl)
            keep = np.ones(kvl, bool)
            if causal:
                keep &= keys <= pos
            if wl >= 0:
                keep &= keys >= pos - wl
            keys = keys[keep]
            if not keys.size:
                continue
            for h in range(q.shape[1]):
                s = k[kv_ptr[b] + keys, h // g] @ q[qo_ptr[b] + i, h]
                mx = s.max()
                e = np.exp(s - mx)
                out[qo_ptr[b] + i, h] = e @ v[kv_ptr[b] + keys, h // g] / e.sum()
                lse[qo_ptr[b] + i, h] = mx + math.log(e.sum())
    return out, lse


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 700)), min_size=1, max_size=4),
       st.sampled_from([1, 2, 3]), st.sampled_from([1, 2]), st.sampled_from([4, 8, 16]),
       st.booleans(), st.sampled_from([-1, 0, 5, 100]),
       st.one_of(st.just("auto"), st.just("disable"), st.integers(1, 400)), st.booleans(), st.randoms())
def test_simulated_attention_matches_reference(reqs, g, hkv, bm, causal, wl, mode, graph, rnd):
    qo_lens = [q for q, _ in reqs]
    kv_lens = [kk for _, kk in reqs]
    cap = {"max_batch": len(reqs) + 2, "max_total_q": sum(qo_lens) + 5, "max_work": None} if graph else None
    if cap is not None and isinstance(mode, int):
        n = sum(ntiles(q, g, bm) * max(1, -(-kk // (-(-mode // 16) * 16))) for q, kk in reqs)
        cap["max_work"] = max(n, 1) + rnd.randint(0, 3)
    p = run_plan(qo_lens, kv_lens, g=g, hkv=hkv, bm=bm, bn=16, sms=rnd.choice([1, 4, 132]), ctas=1,
                 causal=causal, wl=wl, mode=mode, graph=cap)
    rng = np.random.default_rng(rnd.randint(0, 2**31))
    D = 4
    q = rng.standard_normal((sum(qo_lens), hkv * g, D))
    k = rng.standard_normal((sum(kv_lens), hkv, D))
    v = rng.standard_normal((sum(kv_lens), hkv, D))
    o, l = simulate(p, q, k, v, qo_lens, kv_lens, g, causal, wl)
    o_ref, l_ref = reference(q, k, v, qo_lens, kv_lens, g, causal, wl)
    assert not np.isnan(o).any() and not np.isnan(l).any(), "some output was never written"
    np.testing.assert_allclose(o, o_ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(np.isinf(l), np.isinf(l_ref))
    fin = np.isfinite(l_ref)
    np.testing.assert_allclose(l[fin], l_ref[fin], rtol=1e-9, atol=1e-9)


def test_simulated_split_is_exercised():
    """The simulation above also runs with real splits (not only one chunk per request)."""
    qo_lens, kv_lens = [3, 0, 5], [700, 300, 90]
    p = run_plan(qo_lens, kv_lens, g=2, hkv=2, bm=8, bn=16, sms=132, ctas=1, causal=True, wl=100, mode=64)
    assert p.split and p.num_partial_rows == 3 * 11 + 5 * 2
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((8, 4, 4)), rng.standard_normal((1090, 2, 4)), rng.standard_normal((1090, 2, 4))
    o, l = simulate(p, q, k, v, qo_lens, kv_lens, 2, True, 100)
    o_ref, l_ref = reference(q, k, v, qo_lens, kv_lens, 2, True, 100)
    np.testing.assert_allclose(o, o_ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(l, l_ref, rtol=1e-9, atol=1e-9)


# ---- batch invariance, determinism, graph mode ---------------------------------------------------
@SETTINGS
@given(st.tuples(st.integers(1, 300), st.integers(0, 30000)),
       st.lists(st.tuples(qo_len, kv_len), max_size=8), st.lists(st.tuples(qo_len, kv_len), max_size=8),
       st.integers(1, 5000), st.sampled_from([1, 4]), st.booleans())
def test_fixed_split_size_is_batch_invariant(req, others_a, others_b, fss, g, causal):
    """A request's chunking and its items are the same whatever else is in the batch."""
    def items_of(reqs, at):
        p = run_plan([q for q, _ in reqs], [k for _, k in reqs], g=g, hkv=2, bm=64, bn=32, sms=132, ctas=2,
                     causal=causal, wl=-1, mode=fss)
        N = p.num_work
        sel = p.work_request[:N] == at
        mine = sorted(zip(p.work_qtile[:N][sel].tolist(), p.work_chunk[:N][sel].tolist()))
        return p.kv_chunk_size, int(p.num_chunks[at]), mine, int(p.o_indptr[at + 1] - p.o_indptr[at])

    a = items_of(others_a[:3] + [req] + others_a[3:], min(3, len(others_a)))
    b = items_of(others_b + [req], len(others_b))
    assert a == b


@pytest.mark.parametrize("g, bm", [(4, 128), (3, 64), (1, 16)])
@pytest.mark.parametrize("causal, wl", [(False, -1), (True, -1), (True, 300)])
def test_large_split_batch(g, bm, causal, wl):
    """Many tokens (the merge_indptr path for > 2048 tokens), multi-tile requests, real splits."""
    rng = np.random.default_rng(g * 7 + bm)
    qo = rng.integers(0, 400, 40)
    kv = qo + rng.integers(0, 6000, 40)
    assert qo.sum() > 2048
    for mode in (300, 1000, "auto", "disable"):
        p = run_plan(qo, kv, g=g, hkv=2, bm=bm, bn=16, sms=132, ctas=2, causal=causal, wl=wl, mode=mode)
        assert p.split == (mode not in ("auto", "disable"))
    p = run_plan(qo[:2], kv[:2] + 100000, g=g, hkv=1, bm=bm, bn=16, sms=132, ctas=2, causal=causal, wl=wl,
                 mode="auto")
    assert p.split


def test_deterministic():
    rng = np.random.default_rng(1)
    qo, kv = rng.integers(0, 300, 50), rng.integers(0, 20000, 50)
    kw = dict(group_size=4, num_kv_heads=8, block_m=128, block_n=64, num_sms=132, ctas_per_sm=2, causal=True)
    p1, p2 = plan_prefill(indptr(qo), kv, **kw), plan_prefill(indptr(qo), kv.copy(), **kw)
    for name, a in p1.int_arrays().items():
        np.testing.assert_array_equal(a, p2.int_arrays()[name])


@SETTINGS
@given(st.lists(st.lists(st.tuples(qo_len, kv_len), max_size=8), min_size=2, max_size=5),
       st.sampled_from([1, 4, 8]), st.sampled_from([1, 8]), st.booleans(),
       st.one_of(st.just("auto"), st.just("disable")))
def test_graph_mode_grid_is_fixed(batches, g, hkv, causal, mode):
    max_batch = max(len(b) for b in batches) + 1
    max_q = max(sum(q for q, _ in b) for b in batches) + 3
    cap = {"max_batch": max_batch, "max_total_q": max_q, "max_work": None}
    grids, bounds = set(), set()
    for reqs in batches:
        p = run_plan([q for q, _ in reqs], [k for _, k in reqs], g=g, hkv=hkv, bm=64, bn=64, sms=132, ctas=2,
                     causal=causal, wl=-1, mode=mode, graph=cap)
        grids.add(p.grid)
        bounds.add(p.max_partial_rows)
        assert p.num_partial_rows <= p.max_partial_rows
    assert len(grids) == 1 and len(bounds) == 1
    # the bound formula: the most q tiles any batch within capacity can have, or one wave
    assert grids.pop() == max(132 * 2 // hkv, -(-max_q * g // 64) + min(max_batch, max_q) - 1, 1)


def test_graph_mode_pads_with_minus_one_and_bounds_partials():
    cap = {"max_batch": 4, "max_total_q": 64, "max_work": None}
    kw = dict(group_size=4, num_kv_heads=2, block_m=64, block_n=64, num_sms=132, ctas_per_sm=2, graph_capacity=cap)
    p = plan_prefill(indptr([1, 2]), [1000, 50], **kw)
    assert p.split and p.grid == 132 and p.num_work < p.grid
    assert (p.work_request[p.num_work:] == -1).all()
    # worst case for the partial-row bound: every item a full tile of split tokens
    assert p.max_partial_rows == 132 * 64 // 4
    p2 = plan_prefill(indptr([16] * 4), [1 << 20] * 4, **kw)
    assert p2.grid == p.grid and p2.num_partial_rows <= p2.max_partial_rows
    assert p.workspace_layout(8, 128, p.max_partial_rows) == p2.workspace_layout(8, 128, p2.max_partial_rows)


def test_graph_capacity_overflow_raises():
    kw = dict(group_size=1, num_kv_heads=1, block_m=64, block_n=64, num_sms=4, ctas_per_sm=1)
    cap = {"max_batch": 2, "max_total_q": 10, "max_work": None}
    plan_prefill(indptr([5, 5]), [10, 10], graph_capacity=cap, **kw)
    with pytest.raises(ValueError, match="max_batch"):
        plan_prefill(indptr([1, 1, 1]), [10, 10, 10], graph_capacity=cap, **kw)
    with pytest.raises(ValueError, match="max_total_q"):
        plan_prefill(indptr([6, 5]), [10, 10], graph_capacity=cap, **kw)
    with pytest.raises(ValueError, match="max_work"):
        plan_prefill(indptr([5, 5]), [10, 10], graph_capacity=dict(cap, max_work=1), **kw)
    with pytest.raises(ValueError, match="max_work"):  # fixed splits are unbounded by the capacity
        plan_prefill(indptr([5, 5]), [5000, 10], graph_capacity=dict(cap, max_work=4), fixed_split_size=64, **kw)
    with pytest.raises(ValueError, match="grid"):
        plan_prefill(indptr([5, 5]), [100000, 10], graph_capacity=cap, fixed_split_size=64, **kw)
    with pytest.raises(ValueError, match="max_total_q"):
        plan_prefill(indptr([5, 5]), [10, 10], graph_capacity={"max_batch": 2}, **kw)
    # max_work given and large enough: it is the grid; the automatic split stays within it
    p = plan_prefill(indptr([1]), [100000], graph_capacity=dict(cap, max_work=3), **kw)
    assert p.grid == 3 and p.num_work <= 3 and p.split


# ---- edge cases ----------------------------------------------------------------------------------
KW = dict(group_size=4, num_kv_heads=8, block_m=128, block_n=64, num_sms=132, ctas_per_sm=2)


def test_empty_batch_and_empty_requests():
    p = plan_prefill(np.zeros(1, np.int32), np.zeros(0, np.int32), **KW)
    assert p.num_work == p.grid == 0 and p.total_q == 0 and not p.split and p.merge_indptr.tolist() == [0]
    assert p.workspace_bytes(32, 128) == 0
    # qo 0 requests: no work; kv 0 with queries: work items (the kernel writes o = 0, lse = -inf)
    p = run_plan([0, 3, 0, 2], [500, 0, 0, 70000], g=4, hkv=8, bm=128, bn=64, sms=132, ctas=2, causal=True,
                 wl=-1, mode="auto")
    assert sorted(p.work_request[:p.num_work].tolist()).count(1) == 1
    assert 0 not in p.work_request[:p.num_work].tolist() and 2 not in p.work_request[:p.num_work].tolist()
    assert p.num_chunks[1] == 1 and p.num_chunks[2] == 1
    # all-empty queries
    p = run_plan([0, 0], [5, 100000], g=1, hkv=1, bm=64, bn=64, sms=132, ctas=2, causal=False, wl=-1, mode="auto")
    assert p.num_work == 0 and not p.split and p.num_partial_rows == 0


def test_page_size_agnostic():
    """The plan sees token lengths only: the same lengths from any page size give the same plan."""
    rng = np.random.default_rng(3)
    kv = rng.integers(0, 50000, 20)
    qo = indptr(rng.integers(0, 40, 20))
    plans = []
    for ps in (1, 16, 64, 256):
        pages = -(-kv // ps)
        last = np.where(pages > 0, kv - (pages - 1) * ps, 0)
        kv_from_pages = np.where(pages > 0, (pages - 1) * ps + last, 0)
        plans.append(plan_prefill(qo, kv_from_pages, **KW))
    assert "page_size" not in inspect.signature(plan_prefill).parameters
    for p in plans[1:]:
        assert p.kv_chunk_size == plans[0].kv_chunk_size
        for name, a in p.int_arrays().items():
            np.testing.assert_array_equal(a, plans[0].int_arrays()[name])


def test_decode_like_split_fills_one_wave():
    p = plan_prefill(indptr([1]), [1 << 20], **KW)
    assert p.split and p.num_work * 8 <= 264 and p.num_work > 16
    assert p.num_partial_rows == int(p.num_chunks[0])
    # a big batch is not split
    p = plan_prefill(indptr([512] * 64), [4096] * 64, **KW)
    assert not p.split and p.num_work == 64 * 16 and p.kv_chunk_size == 4096


def test_short_kv_two_cta_kernels_do_not_split():
    # one 512-token causal request, 32/8 heads, 128-row tiles: 16 q tiles x 8 kv heads = 128 CTAs
    p = plan_prefill(indptr([512]), [512], **KW, causal=True)
    assert not p.split and p.num_work == 16 and p.kv_chunk_size == 512
    # a one-CTA-per-SM kernel (hd256, 16/4 heads: 64 CTAs) still splits (measured 35.6 vs 37.6 us)
    p = plan_prefill(indptr([512]), [512], **dict(KW, num_kv_heads=4, ctas_per_sm=1), causal=True)
    assert p.split
    # long enough KV (SHORT_KV_TILES tiles) splits as before, and so does a near-empty grid
    assert plan_prefill(indptr([512]), [SHORT_KV_TILES * 64], **KW, causal=True).split
    assert plan_prefill(indptr([16]), [512], **KW, causal=True).split


def test_accepts_lists_and_int32():
    a = plan_prefill([0, 3, 7], [100, 5000], **KW)
    b = plan_prefill(np.array([0, 3, 7], np.int32), np.array([100, 5000], np.int32), **KW)
    for name, x in a.int_arrays().items():
        np.testing.assert_array_equal(x, b.int_arrays()[name])


@pytest.mark.parametrize("kwargs, match", [
    (dict(qo_indptr=[0, 3, 2], kv_lens=[1, 1]), "qo_indptr"),
    (dict(qo_indptr=[1, 3], kv_lens=[1]), "qo_indptr"),
    (dict(qo_indptr=[0, 3], kv_lens=[-1]), "kv_lens"),
    (dict(qo_indptr=[0, 3, 4], kv_lens=[1]), "kv_lens"),
    (dict(qo_indptr=[0, 3], kv_lens=[1, 2]), "qo_indptr"),
    (dict(block_m=0), "block_m"),
    (dict(block_n=-64), "block_n"),
    (dict(fixed_split_size=0), "fixed_split_size"),
    (dict(fixed_split_size=-5), "fixed_split_size"),
    (dict(group_size=0), "group_size"),
    (dict(num_kv_heads=0), "num_kv_heads"),
    (dict(num_sms=0), "num_sms"),
    (dict(ctas_per_sm=0), "ctas_per_sm"),
    (dict(window_left=-2), "window_left"),
    (dict(graph_capacity={"max_batch": 0, "max_total_q": 8}), "max_batch"),
    (dict(graph_capacity={"max_batch": 4, "max_total_q": -1}), "max_total_q"),
    (dict(graph_capacity={"max_batch": 4, "max_total_q": 8, "max_work": 0}), "max_work"),
])
def test_validation(kwargs, match):
    args = dict(KW, qo_indptr=[0, 3], kv_lens=[10])
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        plan_prefill(args.pop("qo_indptr"), args.pop("kv_lens"), **args)


def test_non_integer_arrays_rejected():
    with pytest.raises(TypeError, match="kv_lens"):
        plan_prefill([0, 3], [1.5], **KW)
    with pytest.raises(ValueError, match="qo_indptr"):
        plan_prefill(np.zeros((2, 2), np.int32), [1], **KW)


# plan_prefill() timings are not a test (they assert nothing and vary with the machine): the
# batch 64 / 1024 report that lived here is one of the cases `python -m pyflashattn._engine.schedule`
# prints ("mixed qo 1..64, kv 256..8K causal").
