"""The sm90 consumers' lazy running max (OnlineSoftmax<true>, ConsumerSm90::LAZY_O and
ConsumerSm90Fp8::LAZY_O) against the float64 reference, on inputs built to cross its slack.

A row's running max may lag its true max by the slack (16-bit: 8 log2 units; e4m3: 1.75), and a
warp rescales O only where one of its rows moved past it. Random inputs rarely move a max that far
after the first tile, so these cases make them: every key carries a shared component that grows by
a step a 128-key tile, so a query row with a large share of that component sees its max rise by
more than the slack on every tile, while rows without it keep theirs. A warp then holds rows that
must be rescaled beside rows that must not, tile after tile: a skipped rescale, or one applied to
the wrong rows, leaves the early tiles' weights in O and its LSE far from the reference. The
strict rows (hd64, the contiguous e4m3 hd128 row) run the same inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

from pyflashattn.testing.gpu import cuda_generator, page_spans, require_cuda_torch, scratch_workspace

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()

import pyflashattn  # noqa: E402
from pyflashattn.testing import attention_ref, to_numpy_f64  # noqa: E402
from pyflashattn.testing.checks import assert_close, fp8_output_atol  # noqa: E402

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
O_TOL, LSE_TOL = dict(atol=1e-2, rtol=1e-2), dict(atol=1e-2, rtol=1e-4)
FP8_O_TOL, FP8_LSE_TOL = dict(atol=4e-2, rtol=8e-2), dict(atol=1e-2, rtol=1e-3)
TILE = 128
needs_sm90 = pytest.mark.skipif(torch.cuda.get_device_capability() != (9, 0),
                                reason="the lazy running max is the sm_90a family's")


def _rising(qo_len, kv_len, hq, hkv, d, step, g):
    """Float32 q [qo, hq, d], k / v [kv, hkv, d]: k's rows share a component (all ones) that grows
    by `step` a key tile; the query rows of even index carry it at weight 1 (their scaled logits rise
    by step * sqrt(d) a tile), the odd ones not at all (their maxes stay put)."""
    q = torch.randn(qo_len, hq, d, generator=g, device="cuda")
    share = torch.zeros(qo_len, hq, 1, device="cuda")
    share[0::2] = 1.0
    q = q + share
    ramp = step * torch.div(torch.arange(kv_len, device="cuda"), TILE, rounding_mode="floor").float()
    k = torch.randn(kv_len, hkv, d, generator=g, device="cuda") + ramp[:, None, None]
    v = torch.randn(kv_len, hkv, d, generator=g, device="cuda")
    return q, k, v


def _check(out, lse, q, k, v, *, causal, o_tol, lse_tol, what):
    qd, kd, vd = (to_numpy_f64(x.float()) for x in (q, k, v))
    o_ref, lse_ref = attention_ref(qd, kd, vd, causal=causal)
    atol = o_tol["atol"]
    if q.dtype == E4M3:
        atol = fp8_output_atol(atol, attention_ref(qd, kd, np.abs(vd), causal=causal)[0])
    assert_close(out.float(), o_ref, atol=atol, rtol=o_tol["rtol"], what=f"o {what}")
    assert_close(lse, lse_ref, **lse_tol, what=f"lse {what}")


# (qo_len, kv_len, heads q / kv, head_dim): the lazy 16-bit rows (hd128 and hd256, TMA) and the
# strict hd64 row; odd lengths, qo_len != kv_len, GQA
SINGLE = [(333, 2048, 8, 2, 128), (1000, 1537, 4, 4, 256), (257, 2100, 8, 1, 64)]


@needs_sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("qo_len,kv_len,hq,hkv,d", SINGLE)
def test_single_prefill_rising_maxes(qo_len, kv_len, hq, hkv, d, causal):
    g = cuda_generator("lazy-single", qo_len, kv_len, hq, hkv, d, causal)
    # logits rise by 0.9 * sqrt(128) = 10.2 a tile (natural units; 14.7 log2), past the slack of 8
    q, k, v = (x.to(BF16) for x in _rising(qo_len, kv_len, hq, hkv, d, 0.9 * 128 ** 0.5 / d ** 0.5, g))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((qo_len, hq), float("nan"), dtype=torch.float32, device="cuda")
    pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=causal, out=out, lse=lse, return_lse=True)
    torch.cuda.synchronize()
    _check(out, lse, q, k, v, causal=causal, o_tol=O_TOL, lse_tol=LSE_TOL,
           what=f"single qo={qo_len} kv={kv_len} {hq}/{hkv} d={d} causal={causal}")


def _paged(k, v, kv_lens, ps, g):
    """k / v rows on pages of ps in a shuffled order (NHD cache [P, 2, ps, Hkv, D]): cache, kv_indptr,
    kv_indices, kv_last_page_len. Copies through uint8 views (fp8 indexing may lack a kernel)."""
    pages = [-(-n // ps) for n in kv_lens]
    total = sum(pages) + 2
    table, spans = page_spans(kv_lens, ps, np.random.default_rng(ps).permutation(total), total - 1)
    store = torch.zeros((total, 2, ps) + tuple(k.shape[1:]), dtype=k.dtype, device="cuda")
    su, ku, vu = (x.view(torch.uint8) for x in (store, k, v))
    for pid, lo, hi in spans:
        su[pid, 0, :hi - lo], su[pid, 1, :hi - lo] = ku[lo:hi], vu[lo:hi]
    indices = np.concatenate([table[b, :n] for b, n in enumerate(pages)]).astype(np.int32)
    last = np.asarray([n - (p - 1) * ps for n, p in zip(kv_lens, pages)], np.int32)
    return store, np.concatenate([[0], np.cumsum(pages)]).astype(np.int32), indices, last


@needs_sm90
@pytest.mark.parametrize("dtype", [BF16, E4M3])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_batch_rising_maxes(dtype, causal):
    """The paged hd128 rows (16-bit: lazy; e4m3: lazy, its P up to 2^8.75 in e4m3), three requests."""
    qo_lens, kv_lens, hq, hkv, d, ps = [77, 300, 129], [1500, 900, 2200], 8, 2, 128, 16
    g = cuda_generator("lazy-paged", str(dtype), causal)
    qs, ks, vs = [], [], []
    # e4m3: 0.25 a tile, 2.8 log2 units, past its slack of 1.75 (logits stay within e4m3's range)
    step = 0.9 if dtype == BF16 else 0.25
    for qo, kv in zip(qo_lens, kv_lens):
        q, k, v = _rising(qo, kv, hq, hkv, d, step, g)
        qs.append(q), ks.append(k), vs.append(v)
    q, k, v = (torch.cat(x).to(dtype) for x in (qs, ks, vs))
    cache, kv_indptr, indices, last = _paged(k, v, kv_lens, ps, g)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    w = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(scratch_workspace(), "NHD")
    w.plan(qo_indptr, kv_indptr, indices, last, hq, hkv, d, ps, causal=causal, q_data_type=dtype,
           kv_data_type=dtype, o_data_type=BF16)
    out = torch.full((q.shape[0], hq, d), float("nan"), dtype=BF16, device="cuda")
    lse = torch.full((q.shape[0], hq), float("nan"), dtype=torch.float32, device="cuda")
    w.run(q, cache, out=out, lse=lse)
    torch.cuda.synchronize()
    kv_rows = np.concatenate([[0], np.cumsum(kv_lens)])
    for b in range(len(qo_lens)):
        qsl, ksl = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_rows[b], kv_rows[b + 1])
        _check(out[qsl], lse[qsl], q[qsl], k[ksl], v[ksl], causal=causal,
               o_tol=O_TOL if dtype == BF16 else FP8_O_TOL, lse_tol=LSE_TOL if dtype == BF16 else FP8_LSE_TOL,
               what=f"paged {dtype} causal={causal} request {b}")


@needs_sm90
@pytest.mark.parametrize("d, long_twin", [(128, False), (128, True), (256, False)])
@pytest.mark.parametrize("causal", [False, True])
def test_single_prefill_fp8_rising_maxes(monkeypatch, d, long_twin, causal):
    """e4m3 single prefill: hd256 (the serial loop: lazy), hd128 (contiguous: strict) and its
    long-KV twin (256-key serial steps; PFA_SM90_LONG_KV=1 runs it at this length). Logits rise
    by 1.7 a tile (2.45 log2 units, past the slack of 1.75) over 10 tiles: with 14 tiles of 2.8 (raw
    q.k up to ~750 at hd256), the LSE of 7 rows in 1600 missed by up to 0.09 log2 units, the same
    on the strict kernels of before the lazy max (NOTES.md, session 38: likely the fp8 wgmma's
    accumulation precision at that magnitude; the output stayed within tolerance)."""
    from pyflashattn._engine import routing, single
    monkeypatch.setenv(routing.LONG_ENV, "1" if long_twin else "0")
    monkeypatch.setattr(single._tls, "plans", {}, raising=False)
    qo_len, kv_len, hq, hkv = 200, 1200, 8, 2
    g = cuda_generator("lazy-fp8", d, causal)
    q, k, v = (x.to(E4M3) for x in _rising(qo_len, kv_len, hq, hkv, d, 1.7 / d ** 0.5, g))
    out = torch.full((qo_len, hq, d), float("nan"), dtype=BF16, device="cuda")
    lse = torch.full((qo_len, hq), float("nan"), dtype=torch.float32, device="cuda")
    pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=causal, o_dtype=BF16, out=out, lse=lse)
    torch.cuda.synchronize()
    _check(out, lse, q, k, v, causal=causal, o_tol=FP8_O_TOL, lse_tol=FP8_LSE_TOL,
           what=f"e4m3 single d={d} causal={causal} long twin={long_twin}")
    (plan,) = single._tls.plans.values()
    assert bool(plan.attn.meta.get("long_kv")) is long_twin, plan.attn.name
