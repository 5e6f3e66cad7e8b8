"""pyflashattn.jax's xqa_batch_decode_with_kv_cache inside jax.jit against the float64 reference, on
fresh seeded random inputs.

Paged caches put each request's pages at random page ids among garbage pages (random, larger
values), and block-table entries past a request's pages point at garbage too, so a wrong page or a
slot past a request's length gives a wrong answer. Beyond the reference: the jitted call equals the
eager call on the same JAX arrays bit for bit (one kernel, one plan); new seq_lens, block tables and
device scales reuse the trace; the fp8 output dequantises as out * o_scale; trace-time errors name
the argument; vmap, out= and PYFLASHATTN_CHECK_METADATA refuse.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("jax")

from pyflashattn.testing import attention_ref  # noqa: E402
from pyflashattn.testing.checks import assert_close  # noqa: E402
from pyflashattn.testing.frameworks import jax_gpu  # noqa: E402

pytestmark = pytest.mark.gpu

jax, jnp, GPU = jax_gpu()

import pyflashattn.jax as pfj  # noqa: E402
from pyflashattn import decode  # noqa: E402
from pyflashattn.jax import _xqa  # noqa: E402

xqa = _xqa.xqa_batch_decode_with_kv_cache
O_TOL = {"float16": dict(atol=1e-3, rtol=1e-3), "bfloat16": dict(atol=1e-2, rtol=1e-2)}
FP8_O_TOL = dict(atol=2e-2, rtol=2e-2)
LOG2E = 1.4426950408889634
WS = None  # the workspace_buffer of most calls (see _ws)


def _ws():
    """A FlashInfer-style workspace (128 MiB uint8): accepted, never touched under jit. Made outside
    any trace (a first call inside a jitted function would keep a tracer)."""
    global WS
    if WS is None:
        with jax.ensure_compile_time_eval():
            WS = jax.device_put(jnp.zeros(128 << 20, jnp.uint8), GPU)
    return WS


def _put(x, dtype=None):
    return jax.device_put(jnp.asarray(x, dtype=dtype), GPU)


def _f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


class Paged:
    """A batch's K/V scattered into a paged cache among garbage pages; block-table rows padded with
    garbage page ids. f64: what the cache holds (rounded to its dtype), NHD, float64."""

    def __init__(self, rng, kv_lens, hkv, d, ps, layout, kv_dtype, width=None, spare=3):
        self.ps = ps
        pages = [-(-n // ps) for n in kv_lens]
        self.total = total = sum(pages) + spare
        perm = rng.permutation(total)
        cache = (rng.standard_normal((total, 2, ps, hkv, d)) * 4).astype(np.float32)  # garbage: larger values
        self.width = width or max(max(pages), 1) + 2
        self.table = self.garbage_table(rng, len(kv_lens))
        for b, n in enumerate(kv_lens):
            ids, perm = perm[:pages[b]], perm[pages[b]:]
            self.table[b, :len(ids)] = ids
            cache[ids] = rng.standard_normal((len(ids), 2, ps, hkv, d)).astype(np.float32)
        nhd = jnp.asarray(cache, kv_dtype)
        self.f64 = _f64(nhd)
        self.cache = _put(jnp.swapaxes(nhd, 2, 3) if layout == "HND" else nhd)

    def garbage_table(self, rng, batch):
        return rng.integers(0, self.total, (batch, self.width)).astype(np.int32)

    def kv(self, row, n):
        """K and V [n, Hkv, D] of a request whose block-table row is `row` (as the kernel must read them)."""
        pages = self.f64[row[:-(-n // self.ps)]]
        return tuple(pages[:, i].reshape(-1, *self.f64.shape[3:])[:n] for i in (0, 1))


def _sink_ref(o, lse, sinks):
    """(o, lse) of rows [tokens, heads] with sinks [heads] (natural-log units) added."""
    new = np.logaddexp2(lse, np.asarray(sinks, np.float64)[None, :] * LOG2E)
    return o * np.where(np.isneginf(lse), 0.0, np.exp2(lse - new))[..., None]


def _ref(q, pg, kv_lens, q_len, bmm1, bmm2, sinks=None, masks=None, table=None):
    """float64 attention * bmm2 of every request, concatenated on tokens (q_len > 1: causal drafts
    at the end of each request, or masks[b] [q_len, kv_len]); table: pg.table unless given."""
    table = pg.table if table is None else table
    outs = []
    for b, n in enumerate(kv_lens):
        k, v = pg.kv(table[b], n)
        qb = _f64(q[b * q_len:(b + 1) * q_len])
        o, lse = attention_ref(qb, k, v, sm_scale=bmm1, causal=q_len > 1 and masks is None,
                               custom_mask=None if masks is None else masks[b])
        outs.append(o if sinks is None else _sink_ref(o, lse, np.asarray(sinks, np.float64).reshape(-1)))
    return np.concatenate(outs) * bmm2


CASES = [
    # name, kv_lens, hq, hkv, d, ps, layout, q dtype, kv dtype, sinks, device scales, (k, v) tuple
    ("bf16-nhd-ps16-g4", [1, 37, 300, 1000], 32, 8, 128, 16, "NHD", "bfloat16", "bfloat16", False, False, False),
    ("bf16-hnd-ps64-g8-sinks-tuple", [64, 5, 700], 64, 8, 128, 64, "HND", "bfloat16", "bfloat16", True, False, True),
    ("fp8-hnd-ps64-g4-scales", [129, 2000, 3], 16, 4, 128, 64, "HND", "bfloat16", "float8_e4m3fn", False, True,
     False),
    ("fp8-nhd-ps16-g8-sinks-scales", [900, 17], 16, 2, 64, 16, "NHD", "float16", "float8_e4m3fn", True, True, False),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_xqa_jit_matches_reference(case):
    name, kv_lens, hq, hkv, d, ps, layout, qdt, kvdt, with_sinks, dev_scales, pair = case
    rng = np.random.default_rng(sum(map(ord, name)))
    pg = Paged(rng, kv_lens, hkv, d, ps, layout, kvdt)
    B = len(kv_lens)
    q = _put(rng.standard_normal((B, hq, d)), qdt)
    bt, seq = _put(pg.table), _put(np.asarray(kv_lens, np.int32))
    sinks = _put(rng.standard_normal((hkv, hq // hkv)), jnp.float32) if with_sinks else None
    bmm1, bmm2 = 0.7 / math.sqrt(d), 1.3
    s1, s2 = (_put([bmm1], jnp.float32), _put([bmm2], jnp.float32)) if dev_scales else (bmm1, bmm2)
    cache = (pg.cache[:, 0], pg.cache[:, 1]) if pair else pg.cache
    msl = max(kv_lens)

    @jax.jit
    def step(q, cache, bt, seq, sinks, s1, s2):
        return xqa(q, cache, _ws(), bt, seq, msl, bmm1_scale=s1 if dev_scales else bmm1,
                   bmm2_scale=s2 if dev_scales else bmm2, sinks=sinks, kv_layout=layout)

    o = step(q, cache, bt, seq, sinks, s1, s2)
    assert o.shape == (B, hq, d) and o.dtype == jnp.dtype(qdt)
    ref = _ref(q, pg, kv_lens, 1, bmm1, bmm2, None if sinks is None else np.asarray(sinks))
    assert_close(_f64(o), ref, **(FP8_O_TOL if kvdt != qdt else O_TOL[qdt]), what=f"{name} o")
    if name == CASES[0][0]:  # the eager call on the same JAX arrays: the same kernel and plan, bit for bit
        eo = decode.xqa_batch_decode_with_kv_cache(q, cache, _ws(), bt, seq, msl, bmm1_scale=bmm1, bmm2_scale=bmm2,
                                                   kv_layout=layout)
        assert np.array_equal(np.asarray(o).view(np.uint16), np.asarray(eo).view(np.uint16)), "jit and eager differ"


def test_xqa_jit_new_lengths_tables_and_scales_reuse_the_trace():
    """A decode loop: new seq_lens (shorter and longer, up to max_seq_len), new block tables and new
    device scales run without re-tracing, each against the reference (which reads the pages the
    table names)."""
    rng = np.random.default_rng(11)
    hq, hkv, d, ps, msl = 32, 8, 128, 16, 1200
    pg = Paged(rng, [1200, 513, 90], hkv, d, ps, "NHD", "bfloat16", width=msl // ps + 4)
    traces = []

    @jax.jit
    def step(q, cache, bt, seq, s1, s2, sinks):
        traces.append(1)
        return xqa(q, cache, _ws(), bt, seq, msl, bmm1_scale=s1, bmm2_scale=s2, sinks=sinks)

    sinks = _put(rng.standard_normal(hq), jnp.float32)
    for i, (lens, bmm1, bmm2) in enumerate((([1200, 513, 90], 0.08, 1.0), ([7, 1, 1199], 0.05, 0.7),
                                            ([640, 512, 1], 0.1, 2.0))):
        q = _put(rng.standard_normal((3, hq, d)), "bfloat16")
        table = pg.table if i == 0 else pg.garbage_table(rng, 3)
        o = step(q, pg.cache, _put(table), _put(np.asarray(lens, np.int32)), _put([bmm1], jnp.float32),
                 _put([bmm2], jnp.float32), sinks)
        ref = _ref(q, pg, lens, 1, bmm1, bmm2, np.asarray(sinks), table=table)
        # bmm2_scale multiplies the output and its rounding errors: the tolerance is in unscaled units
        assert_close(_f64(o), ref, atol=1e-2 * max(1.0, bmm2), rtol=1e-2, what=f"step {i}, lens {lens}")
    assert len(traces) == 1, f"new lengths / tables / scales re-traced ({len(traces)} traces)"


def test_xqa_jit_spec_decode_mask_and_causal_drafts():
    rng = np.random.default_rng(5)
    q_len, hq, hkv, d, ps, kv_lens = 4, 16, 4, 128, 16, [300, 45]
    pg = Paged(rng, kv_lens, hkv, d, ps, "NHD", "bfloat16")
    B = len(kv_lens)
    q = _put(rng.standard_normal((B * q_len, hq, d)), "bfloat16")
    bits = (rng.random((B, q_len, q_len)) < 0.6) | np.eye(q_len, dtype=bool)[None]
    words = np.zeros((B, q_len, 1), np.uint32)
    for j in range(q_len):
        words[:, :, 0] |= bits[:, :, j].astype(np.uint32) << np.uint32(j)
    mask = _put(words.view(np.uint16))
    masks = [np.concatenate([np.ones((q_len, n - q_len), bool), bits[b]], 1) for b, n in enumerate(kv_lens)]
    bt, seq = _put(pg.table), _put(np.asarray(kv_lens, np.int32))
    f = jax.jit(lambda q, c, bt, seq, m: xqa(q, c, None, bt, seq, 300, bmm1_scale=0.09, q_len_per_req=q_len, mask=m))
    assert_close(_f64(f(q, pg.cache, bt, seq, mask)), _ref(q, pg, kv_lens, q_len, 0.09, 1.0, masks=masks),
                 **O_TOL["bfloat16"], what="spec mask")
    g = jax.jit(lambda q, c, bt, seq: xqa(q, c, None, bt, seq, 300, bmm1_scale=0.09, q_len_per_req=q_len))
    assert_close(_f64(g(q, pg.cache, bt, seq)), _ref(q, pg, kv_lens, q_len, 0.09, 1.0), **O_TOL["bfloat16"],
                 what="causal drafts")


def test_xqa_jit_fp8_output():
    """out_dtype=float8_e4m3fn: out * o_scale is the attention * v_scale (bmm2_scale = v_scale / o_scale)."""
    rng = np.random.default_rng(8)
    kv_lens, hq, hkv, d = [1500, 40], 32, 8, 128
    pg = Paged(rng, kv_lens, hkv, d, 16, "NHD", "float8_e4m3fn")
    q = _put(rng.standard_normal((2, hq, d)), "bfloat16")
    o_scale, v_scale, bmm1 = 0.25, 1.3, 0.8 / math.sqrt(d)
    f = jax.jit(lambda q, c, bt, seq: xqa(q, c, _ws(), bt, seq, 1500, bmm1_scale=bmm1, bmm2_scale=v_scale / o_scale,
                                          o_scale=o_scale, out_dtype=jnp.float8_e4m3fn))
    o = f(q, pg.cache, _put(pg.table), _put(np.asarray(kv_lens, np.int32)))
    assert o.dtype == jnp.float8_e4m3fn
    ref = _ref(q, pg, kv_lens, 1, bmm1, v_scale)
    assert_close(_f64(o) * o_scale, ref, atol=2.0**-10 * o_scale + 1e-2 * v_scale, rtol=0.07, what="e4m3 out")


def _lower(fn, *avals):
    return jax.jit(fn).lower(*avals)


S = jax.ShapeDtypeStruct
Q, CACHE = S((3, 32, 128), jnp.bfloat16), S((40, 2, 16, 8, 128), jnp.bfloat16)
BT, SEQ, WSA = S((3, 12), jnp.int32), S((3,), jnp.int32), S((1 << 20,), jnp.uint8)


@pytest.mark.parametrize("over, kw, exc, pattern", [
    (dict(cache=S((40, 2, 16, 3, 128), jnp.bfloat16)), {}, ValueError, r"multiple of kv_cache heads \(3\)"),
    (dict(cache=S((40, 2, 16, 8, 64), jnp.bfloat16)), {}, ValueError, r"kv_cache head_dim"),
    (dict(q=S((3, 32, 128), jnp.float32)), {}, TypeError, r"query must be float16 or bfloat16"),
    (dict(bt=S((3, 12), jnp.float32)), {}, TypeError, r"block_tables must be int32"),
    (dict(bt=S((4, 12), jnp.int32)), {}, ValueError, r"block_tables must be \[batch=3"),
    (dict(seq=S((4,), jnp.int32)), {}, ValueError, r"seq_lens must have shape \(3,\)"),
    (dict(ws=S((16, 16), jnp.uint8)), {}, ValueError, r"workspace_buffer must be a contiguous 1-D"),
    ({}, dict(max_seq_len=12 * 16 + 1), ValueError, r"max_seq_len=193 exceeds"),
    ({}, dict(kv_layout="NDH"), ValueError, r"kv_layout"),
    ({}, dict(o_scale=0.0), ValueError, r"o_scale"),
    ({}, dict(out_dtype="float8_e5m2"), NotImplementedError, r"out_dtype: a float8_e5m2 output"),
    ({}, dict(bmm1_scale=np.zeros(2, np.float32)), ValueError, r"bmm1_scale as a tensor must hold one value"),
    ({}, dict(bmm2_scale=np.ones(1, np.float16)), TypeError, r"bmm2_scale as a tensor must be float32"),
    ({}, dict(sinks=np.zeros(33, np.float32)), ValueError, r"sinks must have shape \(32,\) or \(8, 4\)"),
    ({}, dict(mask=np.zeros((3, 1, 4), np.uint16)), ValueError, r"mask must have shape"),
    ({}, dict(out=np.zeros((3, 32, 128), np.float16)), TypeError, r"out= is not supported: JAX arrays are immutable"),
], ids=["gqa", "head_dim", "query_dtype", "bt_dtype", "bt_rows", "seq_lens", "workspace", "max_seq_len", "layout",
        "o_scale", "e5m2", "bmm1_size", "bmm2_dtype", "sinks", "mask", "out"])
def test_xqa_jit_trace_time_errors(over, kw, exc, pattern):
    avals = dict(q=Q, cache=CACHE, ws=WSA, bt=BT, seq=SEQ)
    avals.update(over)
    kw = {"max_seq_len": 150, **kw}
    with pytest.raises(exc, match=pattern):
        _lower(lambda q, cache, ws, bt, seq: xqa(q, cache, ws, bt, seq, **kw), *avals.values())


def test_xqa_jit_refusals(monkeypatch):
    args = (Q, CACHE, WSA, BT, SEQ)
    with pytest.raises(TypeError, match="max_seq_len must be a Python value"):
        _lower(lambda q, c, w, b, s, m: xqa(q, c, w, b, s, m), *args, S((), jnp.int32))
    batched = (S((2,) + Q.shape, Q.dtype), CACHE, WSA, BT, SEQ)
    with pytest.raises(NotImplementedError, match="does not support vmap"):
        jax.jit(jax.vmap(lambda q, c, w, b, s: xqa(q, c, w, b, s, 150), in_axes=(0, None, None, None, None))) \
            .lower(*batched)
    monkeypatch.setenv("PYFLASHATTN_CHECK_METADATA", "1")
    with pytest.raises(NotImplementedError, match="PYFLASHATTN_CHECK_METADATA"):
        _lower(lambda q, c, w, b, s: xqa(q, c, w, b, s, 150), *args)


def test_xqa_public_name():
    """pyflashattn.jax exports it."""
    assert pfj.xqa_batch_decode_with_kv_cache is xqa
