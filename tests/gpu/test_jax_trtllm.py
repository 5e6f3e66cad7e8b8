"""pyflashattn.jax's trtllm_fmha_v2_prefill and trtllm_batch_context_with_kv_cache inside jax.jit
against the float64 reference (tests/gpu/test_trtllm.py's, with its tolerances), on fresh seeded
random inputs.

Paged caches put each request's pages at random page ids among garbage pages (random, larger
values), and block-table entries past a request's pages point at garbage too, so a wrong page or a
slot past a request's length gives a wrong answer. Covered: CONTIGUOUS_Q_KV, SEPARATE_Q_K_V and
Q_PAGED_KV_NHD / HND; causal, padding and sliding-window masks; sinks; save_softmax_stats; bf16,
fp16 and an e4m3 input (sm_90 only); the context API over HND / NHD caches (5-D and tuple) with
device scales and its LSE. Beyond the reference: the jitted call equals the eager call on the same
JAX arrays bit for bit (one kernel, one plan); new lengths and block tables reuse the trace;
trace-time errors name the argument; vmap, out= and the NVFP4 output refuse.

    python -m pytest -q tests/gpu/test_jax_trtllm.py
"""
from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

pytest.importorskip("jax")

from pyflashattn.testing.reference import trtllm_request_ref  # noqa: E402
from pyflashattn.testing.checks import assert_close  # noqa: E402
from pyflashattn.testing.frameworks import jax_gpu  # noqa: E402

pytestmark = pytest.mark.gpu

jax, jnp, GPU = jax_gpu()

from pyflashattn import prefill  # noqa: E402
from pyflashattn.jax import _trtllm  # noqa: E402

fmha = _trtllm.trtllm_fmha_v2_prefill
context = _trtllm.trtllm_batch_context_with_kv_cache
TOL = {"float16": dict(atol=1e-3, rtol=1e-3), "bfloat16": dict(atol=1e-2, rtol=1e-2)}
FP8_TOL = dict(atol=4e-2, rtol=8e-2)  # test_trtllm_fp8.py: FlashInfer's fp8 -> 16-bit tolerance
LOG2E = 1.4426950408889634
SM90 = str(getattr(GPU, "compute_capability", "")) in ("9.0", "90")
# A FlashInfer-style workspace: accepted, never touched under jit (a concrete array, made outside any trace)
WS = jax.device_put(jnp.zeros(32 << 20, jnp.uint8), GPU)


def _put(x, dtype=None):
    return jax.device_put(jnp.asarray(x, dtype=dtype), GPU)


def _f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def reference(q, k, v, ql, kl, scale1, scale2=1.0, causal=True, wl=-1, sinks=None):
    """(o, natural LSE [tokens, Hq], row max [tokens, Hq]) of a batch in float64, from the arrays as
    the kernel read them (trtllm_request_ref per request, test_trtllm.py's reference; a sink adds
    exp(sink) to each row's sum, semantics 1.14)."""
    qn, kn, vn = _f64(q), _f64(k), _f64(v)
    sk = None if sinks is None else _f64(sinks)
    cq, ck = np.concatenate([[0], np.cumsum(ql)]), np.concatenate([[0], np.cumsum(kl)])
    os, mxs, sums = [], [], []
    for i in range(len(ql)):
        o, mx, sm = trtllm_request_ref(qn[cq[i]:cq[i + 1]], kn[ck[i]:ck[i + 1]], vn[ck[i]:ck[i + 1]], scale1, scale2,
                                       causal, wl, 0, None, None, sk)
        os.append(o), mxs.append(mx), sums.append(sm)
    mx = np.concatenate(mxs)
    with np.errstate(divide="ignore"):
        lse = mx + np.log(np.concatenate(sums))
    return np.concatenate(os), lse, mx


class Batch:
    """Seeded ragged inputs: q [sum(ql), Hq, D], k / v [sum(kl), Hkv, D] and the length metadata."""

    def __init__(self, ql, kl, hq, hkv, d, dtype, seed, v_std=1.0):
        rng = np.random.default_rng(seed)
        self.ql, self.kl, self.d, self.rng = list(ql), list(kl), d, rng
        self.q = _put(rng.standard_normal((sum(ql), hq, d)), dtype)
        self.k = _put(rng.standard_normal((sum(kl), hkv, d)), dtype)
        self.v = _put(rng.standard_normal((sum(kl), hkv, d)) * v_std, dtype)
        self.cq = _put(np.concatenate([[0], np.cumsum(ql)]), jnp.int32)
        self.ck = _put(np.concatenate([[0], np.cumsum(kl)]), jnp.int32)
        self.sl = _put(kl, jnp.int32)

    def paged(self, ps, layout, spare=3):
        """(5-D cache [P, 2, ...] in layout, int32 block tables [B, M]): each request's pages at random
        ids among garbage pages, row entries past its pages garbage ids too."""
        rng, k, v = self.rng, np.asarray(self.k, np.float32), np.asarray(self.v, np.float32)
        pages = [-(-n // ps) for n in self.kl]
        total = sum(pages) + spare
        perm = rng.permutation(total)
        cache = (rng.standard_normal((total, 2, ps) + k.shape[1:]) * 4).astype(np.float32)
        width = max(pages) + 2
        table = rng.integers(0, total, (len(self.kl), width)).astype(np.int32)
        lo = 0
        for b, n in enumerate(self.kl):
            ids, perm = perm[:pages[b]], perm[pages[b]:]
            table[b, :pages[b]] = ids
            for j, pid in enumerate(ids):
                rows = slice(lo + j * ps, lo + min((j + 1) * ps, n))
                cnt = rows.stop - rows.start
                cache[pid, 0, :cnt], cache[pid, 1, :cnt] = k[rows], v[rows]
            lo += n
        if layout == "HND":
            cache = cache.transpose(0, 1, 3, 2, 4)
        return _put(np.ascontiguousarray(cache), self.q.dtype), _put(table, jnp.int32)


def _check(out, b, scale1, dtype, stats=None, **kw):
    o_ref, lse_ref, mx_ref = reference(b.q, b.k, b.v, b.ql, b.kl, scale1, **kw)
    assert_close(_f64(out), o_ref, **(FP8_TOL if dtype == "float8_e4m3fn" else TOL[dtype]), what="o")
    if stats is not None:  # (row max, row sum) in natural units: the sum counts the max's own term, 1
        st = _f64(stats)
        assert_close(st[..., 0] + np.log(st[..., 1]), lse_ref, atol=2e-3, rtol=1e-4, what="stats lse")
        assert_close(st[..., 0], mx_ref, atol=2e-3, rtol=1e-3, what="stats max")  # as test_trtllm.py checks it


QL, KL = [100, 1, 77, 300], [300, 1, 200, 300]


@pytest.mark.parametrize("mask", [("causal", -1), ("padding", -1), ("sliding_window", 40)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fmha_contiguous_masks(mask, dtype):
    mode, wl = mask
    b = Batch(QL, KL, 8, 2, 128, dtype, seed=zlib.crc32(f"{mode}{dtype}".encode()) % 1000)
    f = jax.jit(lambda q, kv, sl, cq, ck: fmha((q, kv), "CONTIGUOUS_Q_KV", WS, sl, max(QL), max(KL), 0.1, 1.0,
                                               len(QL), cq, ck, mask_mode=mode, window_left=wl))
    out = f(b.q, jnp.stack([b.k, b.v], 1), b.sl, b.cq, b.ck)
    assert out.shape == b.q.shape and out.dtype == b.q.dtype
    _check(out, b, 0.1, dtype, causal=mode != "padding", wl=wl)


@pytest.mark.parametrize("layout", ["Q_PAGED_KV_HND", "Q_PAGED_KV_NHD"])
def test_fmha_paged_sinks(layout):
    b = Batch(QL, KL, 8, 2, 128, "bfloat16", seed=3)
    cache, table = b.paged(32, layout[-3:])
    sinks = _put(np.random.default_rng(4).standard_normal(8) * 2, jnp.float32)
    f = jax.jit(lambda q, c, t, sl, cq, s: fmha((q, c), layout, None, sl, max(QL), max(KL), 0.1, 0.75, len(QL), cq,
                                                None, block_tables=t, sinks=[s]))
    _check(f(b.q, cache, table, b.sl, b.cq, sinks), b, 0.1, "bfloat16", scale2=0.75, sinks=sinks)


@pytest.mark.parametrize("sinks", [False, True])
def test_fmha_softmax_stats(sinks):
    b = Batch([100, 3, 400], [100, 300, 400], 8, 2, 128, "bfloat16", seed=13)
    s = _put(np.random.default_rng(5).standard_normal(8), jnp.float32) if sinks else None
    f = jax.jit(lambda q, k, v, sl, cq, ck, s: fmha((q, k, v), "SEPARATE_Q_K_V", WS, sl, 400, 400, 0.15, 1.0, 3,
                                                    cq, ck, sinks=s, save_softmax_stats=True))
    out, stats = f(b.q, b.k, b.v, b.sl, b.cq, b.ck, s)
    assert stats.shape == (b.q.shape[0], 8, 2) and stats.dtype == jnp.float32
    _check(out, b, 0.15, "bfloat16", stats=stats, sinks=s)


@pytest.mark.skipif(not SM90, reason="the fp8 prefill kernels are sm_90a only")
def test_fmha_e4m3_input():
    b = Batch([128, 50, 7], [256, 300, 7], 8, 2, 128, jnp.float8_e4m3fn, seed=21, v_std=0.5)
    f = jax.jit(lambda q, kv, sl, cq, ck: fmha((q, kv), "CONTIGUOUS_Q_KV", WS, sl, 128, 300, 0.1, 1.0, 3, cq, ck,
                                               out_dtype=jnp.bfloat16))
    out = f(b.q, jnp.stack([b.k, b.v], 1), b.sl, b.cq, b.ck)
    assert out.dtype == jnp.bfloat16
    _check(out, b, 0.1, "float8_e4m3fn")


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("form", ["tensor", "tuple"])
def test_context(layout, form):
    ql, kl = [17, 256, 1], [300, 256, 64]
    b = Batch(ql, kl, 8, 1, 128, "bfloat16", seed=17)
    cache, table = b.paged(32, layout)
    kv = (cache[:, 0], cache[:, 1]) if form == "tuple" else cache
    s1, s2 = _put([0.08], jnp.float32), _put([1.5], jnp.float32)
    f = jax.jit(lambda q, kv, t, sl, cq, ck, s1, s2: context(q, kv, WS, t, sl, max(ql), max(kl), s1, s2, len(ql),
                                                             cq, ck, window_left=100, kv_layout=layout,
                                                             return_lse=True))
    out, lse = f(b.q, kv, table, b.sl, b.cq, b.ck, s1, s2)
    _check(out, b, 0.08, "bfloat16", scale2=1.5, wl=100)
    _, lse_ref, _ = reference(b.q, b.k, b.v, ql, kl, 0.08, wl=100)
    assert_close(_f64(lse), lse_ref * LOG2E, atol=1e-2, rtol=1e-3, what="lse (base 2)")


def test_jit_equals_eager():
    b = Batch(QL, KL, 8, 2, 128, "bfloat16", seed=31)
    cache, table = b.paged(16, "NHD")
    args = (b.sl, max(QL), max(KL), 0.12, 1.0, len(QL), b.cq, None)
    jitted = jax.jit(lambda q, c, t: fmha((q, c), "Q_PAGED_KV_NHD", WS, *args, block_tables=t))(b.q, cache, table)
    eager = prefill.trtllm_fmha_v2_prefill((b.q, cache), "Q_PAGED_KV_NHD", WS, *args, block_tables=table)
    _check(jitted, b, 0.12, "bfloat16")  # (agreeing on a wrong answer cannot pass)
    assert np.array_equal(np.asarray(jitted).view(np.uint16), np.asarray(eager).view(np.uint16))


def test_new_lengths_reuse_the_trace():
    traces = []

    @jax.jit
    def f(q, c, t, sl, cq):
        traces.append(1)
        return context(q, c, None, t, sl, 128, 400, 0.1, 1.0, 3, cq, None)

    for seed, (ql, kl) in enumerate([([100, 1, 27], [300, 1, 200]), ([28, 60, 40], [28, 400, 100])]):
        b = Batch(ql, kl, 8, 2, 128, "bfloat16", seed=40 + seed)
        pad = 128 - sum(ql)  # same shapes: q holds 128 rows, the rows past cum_seq_lens_q[-1] unused
        q = jnp.concatenate([b.q, jnp.zeros((pad,) + b.q.shape[1:], b.q.dtype)])
        cache, table = b.paged(32, "HND", spare=20 - sum(-(-n // 32) for n in kl))
        table = jnp.pad(table, ((0, 0), (0, 15 - table.shape[1])))
        out = f(q, cache, table, b.sl, b.cq)
        _check(out[:sum(ql)], b, 0.1, "bfloat16")
    assert len(traces) == 1


def test_trace_time_errors():
    b = Batch([10, 20], [30, 40], 4, 2, 64, "bfloat16", seed=50)
    kv = jnp.stack([b.k, b.v], 1)

    def call(**kw):
        a = dict(qkv=(b.q, kv), input_layout="CONTIGUOUS_Q_KV", workspace_buffer=None, seq_lens=b.sl, max_q_len=20,
                 max_kv_len=40, bmm1_scale=0.1, bmm2_scale=1.0, batch_size=2, cum_seq_lens_q=b.cq,
                 cum_seq_lens_kv=b.ck)
        a.update(kw)
        return jax.jit(lambda: fmha(**a))()

    with pytest.raises(ValueError, match="seq_lens must have shape"):
        call(seq_lens=b.cq)
    with pytest.raises(TypeError, match="cum_seq_lens_q must be int32"):
        call(cum_seq_lens_q=b.cq.astype(jnp.float32))
    with pytest.raises(ValueError, match="sinks must have shape"):
        call(sinks=jnp.zeros(3, jnp.float32))
    with pytest.raises(ValueError, match="workspace_buffer"):
        call(workspace_buffer=jnp.zeros((4, 4), jnp.uint8))
    with pytest.raises(TypeError, match="out= is not supported"):
        call(out=b.q)
    with pytest.raises(TypeError, match="max_q_len must be a Python value"):
        jax.jit(lambda m: fmha((b.q, kv), "CONTIGUOUS_Q_KV", None, b.sl, m, 40, 0.1, 1.0, 2, b.cq, b.ck))(20)
    with pytest.raises(NotImplementedError, match="does not support vmap"):
        jax.vmap(lambda q: fmha((q, kv), "CONTIGUOUS_Q_KV", None, b.sl, 20, 40, 0.1, 1.0, 2, b.cq, b.ck))(b.q[None])
    # SEPARATE_Q_K_V: V against the plan (the engine's ragged_kv, as the eager run checks it)
    with pytest.raises(ValueError, match="v must have shape"):
        call(qkv=(b.q, b.k, b.v[:-1]), input_layout="SEPARATE_Q_K_V")
    with pytest.raises(TypeError, match="v has dtype float16"):
        call(qkv=(b.q, b.k, b.v.astype(jnp.float16)), input_layout="SEPARATE_Q_K_V")
    cache, table = b.paged(16, "HND")
    with pytest.raises(TypeError, match="block_tables must be int32"):
        jax.jit(lambda: context(b.q, cache, None, table.astype(jnp.uint32), b.sl, 20, 40, 0.1, 1.0, 2, b.cq,
                                b.ck))()
    with pytest.raises(NotImplementedError, match="nvfp4"):
        jax.jit(lambda: context(b.q, cache, None, table, b.sl, 20, 40, 0.1, 1.0, 2, b.cq, b.ck, out_dtype="nvfp4",
                                o_sf_scale=1.0))()
    assert math.isfinite(float(jnp.abs(call()).max()))
