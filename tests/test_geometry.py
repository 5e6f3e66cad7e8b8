"""The host's tile geometry (pyflashattn._engine.geometry.tile_spans) against the device's mask rule.

`MaskRule` below transliterates kernel_src/include/pfa/attention/mask.cuh (keep_structural,
row_range, keeps_all, kept_by_all, kv_begin, kv_end) and the kernel's KV-tile loop bounds (the first tile starts at
kv_begin(first row) rounded down to BLOCK_N, the last ends at kv_end(last row)). The scheduler
orders and prices work by tile_spans, so the two must agree on every tile: checked here against
the loop bounds and, by brute force, against the keys the rule keeps.
"""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pyflashattn._engine import cost_model
from pyflashattn._engine.geometry import tile_spans


class MaskRule:
    """mask.cuh's MaskRule (structural part), in Python."""

    def __init__(self, qo_len, kv_len, causal, window_left, chunk_shift=0):
        self.qo_len, self.kv_len, self.causal, self.window_left = qo_len, kv_len, causal, window_left
        self.chunk_shift = chunk_shift

    def has_left(self):
        return self.window_left >= 0 or self.chunk_shift > 0

    def left(self, q):
        p = self.pos(q)
        lo = p - self.window_left if self.window_left >= 0 else 0
        if self.chunk_shift > 0:
            lo = max(lo, (p >> self.chunk_shift) << self.chunk_shift)
        return lo

    def pos(self, q):
        return q + self.kv_len - self.qo_len

    def keep_structural(self, q, kv):
        ok = 0 <= kv < self.kv_len
        if self.causal:
            ok = ok and kv <= self.pos(q)
        if self.has_left():
            ok = ok and kv >= self.left(q)
        return ok

    def row_range(self, q):
        p = self.pos(q)
        hi = min(self.kv_len, p + 1) if self.causal else self.kv_len
        lo = max(0, self.left(q)) if self.has_left() else 0
        return lo, hi

    def first_draft(self):
        return self.kv_len - self.qo_len

    def keeps_all(self, q0, q1, k0, k1, bits=False, spec=False):
        """keeps_all (the non-RANGE form): a custom mask (bits) keeps no rectangle but, for a
        speculative one (spec), a rectangle wholly before the drafts."""
        no_bits = not bits or (spec and k1 < self.first_draft())
        return no_bits and self.keep_structural(q0, k1) and self.keep_structural(q1, k0)

    def kept_by_all(self, q0, q1, bits=False, spec=False):
        lo0, hi0 = self.row_range(q0)
        lo1, _ = self.row_range(q1)
        lo = lo1
        hi = hi0 if not bits else (min(hi0, self.first_draft()) if spec else lo)
        return lo, hi

    def kv_begin(self, q0):
        return max(0, self.left(q0)) if self.has_left() else 0

    def kv_end(self, q1):
        return min(self.kv_len, max(0, self.pos(q1) + 1)) if self.causal else self.kv_len


def _device_tiles(rule, r0, rows_total, group, bm, bn):
    """The kernel's [first tile, one past the last) for the row tile starting at packed row r0."""
    q_lo, q_hi = r0 // group, (min(r0 + bm, rows_total) - 1) // group
    kv_lo, kv_hi = rule.kv_begin(q_lo), rule.kv_end(q_hi)
    start = kv_lo // bn
    return (start, start + (-(-(kv_hi - start * bn) // bn) if kv_hi > kv_lo else 0))


def _host_spans(qo_lens, kv_lens, g, bm, bn, causal, wl, chunk=0):
    """tile_spans for a whole batch as [(l, h)] per q tile, request-major."""
    qo = np.asarray(qo_lens, np.int64)
    kv = np.asarray(kv_lens, np.int64)
    tiles = -(-qo * g // bm)
    ends = np.cumsum(tiles)
    first = ends - tiles
    req = np.repeat(np.arange(qo.size), tiles)
    wl = wl if wl < kv.max(initial=0) else -1  # the scheduler's rule: a window past every key is none
    nh, l = tile_spans(qo, kv, tiles, first, req, g, bm, bn, causal, wl, chunk)
    l = np.zeros_like(nh) if l is None else l
    return list(zip(l.tolist(), (-nh).tolist()))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 700)), min_size=1, max_size=5),
       st.sampled_from([1, 2, 3, 4, 8]), st.sampled_from([16, 32, 64, 128]), st.sampled_from([16, 32, 64]),
       st.booleans(), st.sampled_from([-1, 0, 1, 17, 64, 100, 1000]))
def test_tile_spans_match_the_device_rule(reqs, g, bm, bn, causal, wl):
    reqs = [(q, max(k, q) if causal else k) for q, k in reqs]
    host = _host_spans([q for q, _ in reqs], [k for _, k in reqs], g, bm, bn, causal, wl)
    i = 0
    for qo_len, kv_len in reqs:
        rule = MaskRule(qo_len, kv_len, causal, wl)
        rows_total = qo_len * g
        for r0 in range(0, rows_total, bm):
            l, h = host[i]
            i += 1
            d0, d1 = _device_tiles(rule, r0, rows_total, g, bm, bn)
            assert (l, h) == (d0, d1), (qo_len, kv_len, r0)
            # brute force: the tiles holding a kept key of any row of this tile span exactly [l, h)
            rows = range(r0 // g, (min(r0 + bm, rows_total) - 1) // g + 1)
            kept = [kv for kv in range(kv_len) if any(rule.keep_structural(q, kv) for q in rows)]
            if kept:
                assert l == kept[0] // bn and h == kept[-1] // bn + 1, (qo_len, kv_len, r0)
    assert i == len(host)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 600), st.integers(0, 3000), st.sampled_from([1, 4, 8]), st.sampled_from([64, 128]),
       st.sampled_from([32, 64]), st.booleans(), st.sampled_from([-1, 0, 50, 999, 100000]))
def test_cost_model_prices_the_same_spans(qo_len, kv_len, g, bm, bn, causal, wl):
    kv_len = max(kv_len, qo_len) if causal else kv_len
    lo, hi = cost_model._row_tile_spans(qo_len, kv_len, g, bm, bn, causal, wl)
    assert list(zip(lo.tolist(), hi.tolist())) == _host_spans([qo_len], [kv_len], g, bm, bn, causal, wl)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 700)), min_size=1, max_size=5),
       st.sampled_from([1, 2, 3, 4, 8]), st.sampled_from([16, 32, 64, 128]), st.sampled_from([16, 32, 64]),
       st.sampled_from([1, 2, 4, 6, 8]), st.sampled_from([-1, 0, 17, 100]))
def test_chunked_spans_match_the_device_rule(reqs, g, bm, bn, shift, wl):
    """Chunked attention (TRT-LLM's, always causal): the chunk start is each row's left bound, so
    the host's spans match the kernel's loop bounds and the brute-force kept keys; with a window
    too, the larger bound wins (the API refuses the pair, the predicate takes it)."""
    reqs = [(q, max(k, q)) for q, k in reqs]
    host = _host_spans([q for q, _ in reqs], [k for _, k in reqs], g, bm, bn, True, wl, 1 << shift)
    i = 0
    for qo_len, kv_len in reqs:
        rule = MaskRule(qo_len, kv_len, True, wl if wl < max(k for _, k in reqs) else -1, shift)
        rows_total = qo_len * g
        for r0 in range(0, rows_total, bm):
            l, h = host[i]
            i += 1
            assert (l, h) == _device_tiles(rule, r0, rows_total, g, bm, bn), (qo_len, kv_len, r0)
            rows = range(r0 // g, (min(r0 + bm, rows_total) - 1) // g + 1)
            kept = [kv for kv in range(kv_len) if any(rule.keep_structural(q, kv) for q in rows)]
            if kept:
                assert l == kept[0] // bn and h == kept[-1] // bn + 1, (qo_len, kv_len, r0)
    assert i == len(host)


def test_chunked_rule_matches_a_numpy_model():
    """keep_structural with a chunk equals FMHAv2's chunked mask: floor(p / C) * C <= kv <= p."""
    for qo_len, kv_len, shift in ((5, 9, 2), (64, 300, 6), (1, 1000, 8), (37, 37, 3)):
        rule = MaskRule(qo_len, kv_len, True, -1, shift)
        q = np.arange(qo_len)[:, None]
        kv = np.arange(kv_len)[None, :]
        p = q + kv_len - qo_len
        want = (kv <= p) & (kv >= (p // (1 << shift)) * (1 << shift))
        got = np.array([[rule.keep_structural(a, b) for b in range(kv_len)] for a in range(qo_len)])
        assert (got == want).all()


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 200), st.integers(0, 400), st.booleans(), st.sampled_from([-1, 0, 1, 7, 64, 1000]),
       st.sampled_from([0, 0, 4, 6]), st.sampled_from([(False, False), (True, False), (True, True)]),
       st.data())
def test_kept_by_all_is_keeps_all(qo_len, kv_len, causal, wl, chunk, custom, data):
    """The sm90 consumers test a tile by two compares against kept_by_all (once per work item)
    instead of keeps_all per tile: the two agree on every rectangle of rows and keys, and both
    agree with the element-wise predicate where no custom bits apply."""
    if chunk and not causal:
        chunk = 0  # chunked attention comes with causal (mask.cuh)
    bits, spec = custom
    rule = MaskRule(qo_len, kv_len, causal, wl, chunk)
    q0 = data.draw(st.integers(0, qo_len - 1))
    q1 = data.draw(st.integers(q0, qo_len - 1))
    lo, hi = rule.kept_by_all(q0, q1, bits, spec)
    for k0 in range(-2, kv_len + 2, 3):
        for width in (1, 16, 64, 128):
            k1 = k0 + width - 1
            want = rule.keeps_all(q0, q1, k0, k1, bits, spec)
            assert (k0 >= lo and k1 < hi) == want, (q0, q1, k0, k1, lo, hi)
            if not bits and 0 <= k0 and want:
                assert all(rule.keep_structural(q, kv) for q in (q0, (q0 + q1) // 2, q1) for kv in (k0, k1))
