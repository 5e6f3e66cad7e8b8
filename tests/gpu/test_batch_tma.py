"""K/V by TMA in the sm90 batch (and single) prefill kernels on a CUDA GPU, against the float64
reference, each case on both K/V loads (PFA_SM90_KV_LOAD=cpasync / tma; the TMA twins are tune
rows until variants.HOPPER_KV_LOAD ships them, so "tma" needs `make TUNE=1`).

The edges of producer_tma.cuh: page sizes whose pages make whole boxes (16..256; hd256's 80-key
tiles: 16, 40, 80, 160) and those that stay on cp.async (1, 8, 24, 48); pages in random order;
lengths around the tile and page boundaries (1, 63, 64, 65, 127, 128, 129, ps +- 1), so the tile
holding a request's last key (by TMA with V's rows past the request zeroed, or copied with zero
fill where its box would pass the tensor's end) is every kind of partial;
NaN and Inf in every cache slot no request owns (the tail of each last page, unused pages), in
the next request's rows of a ragged K/V, and NaN rows after a ragged K/V tensor's end (a slice
of a bigger buffer): a box that read them into O would poison it through 0 * NaN in P V; split KV (chunk ends inside a request); GQA, causal, NHD
and HND; a broadcast K view (stride 0) that TMA cannot address, which runs on the cp.async twin.
"""
from __future__ import annotations

import numpy as np
import pytest

from pyflashattn.testing.gpu import (cuda_generator, cuda_randn, require_cuda_torch, scratch_workspace, select_kv_load,
                                     tma_built)

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()

import pyflashattn  # noqa: E402
from pyflashattn._engine import single as single_engine  # noqa: E402
from pyflashattn._engine.routing import tma_fits  # noqa: E402
from pyflashattn._runtime import registry as _registry  # noqa: E402
from pyflashattn.testing import attention_ref, to_numpy_f64  # noqa: E402
from pyflashattn.testing.checks import assert_close, batch_heads_to_check  # noqa: E402

F16, BF16 = torch.float16, torch.bfloat16
O_TOL = {F16: dict(atol=1e-3, rtol=1e-3), BF16: dict(atol=1e-2, rtol=1e-2)}
LSE_TOL = {F16: dict(atol=2e-3, rtol=1e-4), BF16: dict(atol=1e-2, rtol=1e-4)}
NAN = float("nan")
# lengths at the 64 / 128-key tile and page edges, and long ones with interior tiles
EDGE_LENS = [1, 63, 64, 65, 127, 128, 129, 255, 257, 1000, 2049, 3001]


@pytest.fixture(params=["cpasync", "tma"])
def kv_load(request, monkeypatch):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 family's K/V loads: sm_90a only")
    select_kv_load(request.param, monkeypatch)
    yield request.param
    _registry.force("prefill", None)


def _indptr(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _check(q, k_of, v_of, qo_lens, kv_lens, o, lse, causal, dt, what, hq):
    """Every request against the reference on its own slices (k_of(i), v_of(i): its NHD K / V)."""
    qi = _indptr(qo_lens)
    heads = batch_heads_to_check(qo_lens, kv_lens, hq, 7, 1 << 23)
    o_np, lse_np = to_numpy_f64(o), to_numpy_f64(lse)
    for i, (qo, kv) in enumerate(zip(qo_lens, kv_lens)):
        if qo == 0:
            continue
        r0, r1 = int(qi[i]), int(qi[i + 1])
        o_ref, lse_ref = attention_ref(q[r0:r1], k_of(i), v_of(i), causal=causal, heads=heads[i])
        h = slice(None) if heads[i] is None else heads[i]
        tag = f"{what} req {i} (qo {qo}, kv {kv})"
        assert_close(o_np[r0:r1][:, h], o_ref, what=f"{tag} o", **O_TOL[dt])
        assert_close(lse_np[r0:r1][:, h], lse_ref, what=f"{tag} lse", **LSE_TOL[dt])


def _assert_load(w, kv_load, paged, page_size):
    meta = w._engine.attn.meta
    assert meta.get("impl") == "sm90" and not meta["decode"], meta["name"]
    want = kv_load == "tma" and tma_fits(paged, page_size, meta["block_n"], 0) and tma_built(paged)
    assert bool(meta.get("tma")) is want, meta["name"]


def _ragged_run(q, k, v, qi, ki, hkv, causal, dt, kv_load, layout="NHD"):
    """A ragged plan over (qi, ki), its K/V load checked, run into NaN-poisoned out / lse."""
    hq, d = q.shape[1], q.shape[2]
    w = pyflashattn.BatchPrefillWithRaggedKVCacheWrapper(scratch_workspace(), layout)
    w.plan(qi, ki, hq, hkv, d, causal=causal, q_data_type=dt)
    _assert_load(w, kv_load, False, 0)
    o = torch.full_like(q, NAN)
    lse = torch.full((q.shape[0], hq), NAN, dtype=torch.float32, device="cuda")
    w.run(q, k, v, out=o, lse=lse)
    torch.cuda.synchronize()
    return w, o, lse


# (head_dim, page_size, layout, dtype, causal, hq, hkv)
PAGED_CASES = [
    (128, 16, "NHD", BF16, True, 32, 8), (128, 16, "HND", F16, False, 32, 4), (128, 32, "NHD", F16, True, 16, 16),
    (128, 64, "HND", BF16, True, 32, 8), (128, 128, "NHD", BF16, False, 8, 1), (128, 256, "NHD", F16, True, 32, 8),
    (64, 16, "NHD", F16, True, 32, 8), (64, 64, "HND", BF16, False, 16, 2),
    (256, 16, "NHD", BF16, True, 16, 4), (256, 40, "HND", F16, False, 8, 8), (256, 80, "NHD", BF16, True, 16, 2),
    (256, 160, "NHD", F16, True, 8, 2),
    # page sizes without whole boxes: the cp.async kernel under either load
    (128, 1, "NHD", BF16, True, 32, 8), (128, 8, "HND", F16, False, 16, 4), (128, 24, "NHD", BF16, True, 32, 8),
    (256, 64, "NHD", F16, False, 8, 2), (64, 48, "HND", BF16, True, 16, 4),
]


@pytest.mark.parametrize("d,ps,layout,dt,causal,hq,hkv", PAGED_CASES,
                         ids=[f"d{c[0]}-ps{c[1]}-{c[2]}-{'c' if c[4] else 'nc'}-g{c[5] // c[6]}" for c in PAGED_CASES])
def test_paged_page_sizes_edges_and_poisoned_slots(d, ps, layout, dt, causal, hq, hkv, kv_load):
    g = cuda_generator("tma-paged", d, ps, layout, causal, hq, hkv)
    kv_lens = EDGE_LENS + [ps - 1, ps, ps + 1, 3 * ps + 5]
    kv_lens = [max(x, 1) for x in kv_lens]
    qo_lens = [min(kv, 300) for kv in kv_lens]  # causal: kv >= qo (an append)
    kv_lens[2] = 40  # and one request with fewer keys than queries: rows with nothing visible
    qo_lens[2] = 64
    pages = [-(-kv // ps) for kv in kv_lens]
    n_used = sum(pages)
    num_pages = n_used + 7
    rng = np.random.default_rng(ps * 1000 + d)
    perm = rng.permutation(num_pages).astype(np.int32)
    kv_indptr = _indptr(pages)
    indices = perm[:n_used]
    last = np.array([kv - (p - 1) * ps for kv, p in zip(kv_lens, pages)], np.int32)
    shape = (num_pages, 2, ps, hkv, d) if layout == "NHD" else (num_pages, 2, hkv, ps, d)
    cache = torch.full(shape, NAN, dtype=dt, device="cuda")  # every unowned slot NaN ...
    cache[perm[n_used:].tolist()] = float("inf")  # ... unused pages Inf
    nhd = cache if layout == "NHD" else cache.permute(0, 1, 3, 2, 4)
    ks, vs = [], []
    for i, kv in enumerate(kv_lens):
        k, v = cuda_randn((kv, hkv, d), g, dt), cuda_randn((kv, hkv, d), g, dt)
        t = np.arange(kv)
        pg = torch.as_tensor(indices[kv_indptr[i] + t // ps].astype(np.int64), device="cuda")
        sl = torch.as_tensor((t % ps).astype(np.int64), device="cuda")
        nhd[:, 0][pg, sl] = k
        nhd[:, 1][pg, sl] = v
        ks.append(k)
        vs.append(v)
    qi = _indptr(qo_lens)
    q = cuda_randn((int(qi[-1]), hq, d), g, dt)
    w = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(scratch_workspace(), layout)
    w.plan(qi, kv_indptr, indices, last, hq, hkv, d, ps, causal=causal, q_data_type=dt)
    _assert_load(w, kv_load, True, ps)
    o = torch.full_like(q, NAN)
    lse = torch.full((q.shape[0], hq), NAN, dtype=torch.float32, device="cuda")
    w.run(q, cache, out=o, lse=lse)
    torch.cuda.synchronize()
    _check(q, ks.__getitem__, vs.__getitem__, qo_lens, kv_lens, o, lse, causal, dt, f"paged ps{ps}", hq)


@pytest.mark.parametrize("d,dt,causal,hq,hkv,layout,split", [
    (128, BF16, True, 32, 8, "NHD", False), (128, F16, False, 32, 4, "HND", False), (64, F16, True, 16, 16, "NHD", False),
    (256, BF16, True, 16, 2, "NHD", False), (128, BF16, True, 32, 8, "NHD", True), (256, F16, False, 8, 8, "HND", True),
])
def test_ragged_edges_and_nan_after_the_tensor(d, dt, causal, hq, hkv, layout, split, kv_load):
    g = cuda_generator("tma-ragged", d, causal, hq, hkv, layout, split)
    kv_lens = EDGE_LENS
    qo_lens = [min(kv, 200) for kv in kv_lens]
    if split:  # short queries over long KV: chunk ends inside the requests
        qo_lens, kv_lens = [40, 5, 64, 3, 1], [9000, 12001, 5000, 129, 16384]  # past the decode tiles' rows
    total = sum(kv_lens)
    # K / V are the first `total` rows of buffers whose further rows are NaN
    bufs = [torch.full((total + 300, hkv, d), NAN, dtype=dt, device="cuda") for _ in range(2)]
    for b in bufs:
        b[:total] = cuda_randn((total, hkv, d), g, dt)
    k, v = (b[:total] for b in bufs)
    if layout == "HND":
        k, v = (t.transpose(0, 1).contiguous() for t in (k, v))
    ki, qi = _indptr(kv_lens), _indptr(qo_lens)
    q = cuda_randn((int(qi[-1]), hq, d), g, dt)
    w, o, lse = _ragged_run(q, k, v, qi, ki, hkv, causal, dt, kv_load, layout)
    if split:
        assert w.workspace_size() > 0, "this batch should be split across CTAs"
    nhd = (lambda t, i: t[ki[i]:ki[i + 1]]) if layout == "NHD" else (lambda t, i: t[:, ki[i]:ki[i + 1]].transpose(0, 1))
    _check(q, lambda i: nhd(k, i), lambda i: nhd(v, i), qo_lens, kv_lens, o, lse, causal, dt, "ragged", hq)


@pytest.mark.parametrize("d,dt,causal", [(128, BF16, False), (64, F16, True), (256, BF16, False)])
def test_ragged_nan_in_the_next_request_stays_there(d, dt, causal, kv_load):
    """A tail box of request i reads request i + 1's first rows (a ragged K/V holds them next):
    with NaN in that request's V and Inf in its K, every other request stays exact (the producer
    zeroes V's rows past a request before P V; masked keys ignore K). The poisoned request's own
    output is NaN, as it must be."""
    hq, hkv = 16, 4
    g = cuda_generator("tma-ragged-next", d, causal)
    kv_lens, bad = [300, 129, 1000, 65, 777], 2
    qo_lens = [100, 129, 64, 65, 200]
    ki, qi = _indptr(kv_lens), _indptr(qo_lens)
    total = int(ki[-1])
    k, v = cuda_randn((total, hkv, d), g, dt), cuda_randn((total, hkv, d), g, dt)
    k[ki[bad]:ki[bad + 1]] = float("inf")
    v[ki[bad]:ki[bad + 1]] = NAN
    q = cuda_randn((int(qi[-1]), hq, d), g, dt)
    _, o, lse = _ragged_run(q, k, v, qi, ki, hkv, causal, dt, kv_load)
    keep = [i for i in range(len(kv_lens)) if i != bad]
    rows = lambda t: torch.cat([t[qi[i]:qi[i + 1]] for i in keep])  # noqa: E731
    _check(rows(q), lambda i: k[ki[keep[i]]:ki[keep[i] + 1]], lambda i: v[ki[keep[i]]:ki[keep[i] + 1]],
           [qo_lens[i] for i in keep], [kv_lens[i] for i in keep],
           rows(o), rows(lse), causal, dt, "ragged next-request NaN", hq)
    assert torch.isnan(o[qi[bad]:qi[bad + 1]].float()).any(), "the poisoned request's own output should be NaN"


def test_broadcast_k_runs_on_the_cp_async_twin(kv_load):
    """K with a zero head stride (one head expanded over the kv heads) passes the operand checks
    but no tensor map: the TMA plan launches its cp.async twin for it, with the same result."""
    hq, hkv, d, dt = 32, 8, 128, BF16
    g = cuda_generator("tma-broadcast")
    kv_lens, qo_lens = [700, 129, 2000], [300, 129, 64]
    total = sum(kv_lens)
    k = cuda_randn((total, 1, d), g, dt).expand(total, hkv, d)
    v = cuda_randn((total, hkv, d), g, dt)
    ki, qi = _indptr(kv_lens), _indptr(qo_lens)
    q = cuda_randn((int(qi[-1]), hq, d), g, dt)
    w, o, lse = _ragged_run(q, k, v, qi, ki, hkv, True, dt, kv_load)
    assert w._engine.kv_fallback is (kv_load == "tma" and tma_built(False))
    kc = k.contiguous()
    _check(q, lambda i: kc[ki[i]:ki[i + 1]], lambda i: v[ki[i]:ki[i + 1]], qo_lens, kv_lens, o, lse, True, dt,
           "broadcast k", hq)
    # and K/V TMA can address again: back on the TMA kernel, the same answer
    o2 = torch.full_like(q, NAN)
    w.run(q, kc, v, out=o2)
    torch.cuda.synchronize()
    assert not w._engine.kv_fallback
    assert_close(o2, to_numpy_f64(o), what="contiguous k vs broadcast k", atol=0, rtol=0)


@pytest.mark.parametrize("d,kv_len,causal", [(128, 3001, False), (128, 1000, True), (64, 4097, True), (256, 777, False)])
def test_single_prefill_tail_tile(d, kv_len, causal, kv_load):
    """Single prefill on the TMA twin (its tail tile copied: a box would pass K / V's end; its map
    over ROW_EXTENT rows)."""
    hq, hkv, dt = 2048 // d, 2048 // d // 2, BF16
    g = cuda_generator("tma-single", d, kv_len, causal)
    qo = kv_len if not causal else kv_len // 2
    buf = torch.full((kv_len + 200, hkv, d), NAN, dtype=dt, device="cuda")
    buf[:kv_len] = cuda_randn((kv_len, hkv, d), g, dt)
    k, v = buf[:kv_len], cuda_randn((kv_len, hkv, d), g, dt)
    q = cuda_randn((qo, hq, d), g, dt)
    o, lse = pyflashattn.single_prefill_with_kv_cache_return_lse(q, k, v, causal=causal)
    torch.cuda.synchronize()
    names = [pl.attn.name for pl in single_engine._tls.plans.values() if pl.attn is not None]
    assert names and names[-1].endswith("_tma") is (kv_load == "tma" and tma_built(False)), names
    heads = np.array([0, hq - 1])
    o_ref, lse_ref = attention_ref(q, k, v, causal=causal, heads=heads)
    assert_close(to_numpy_f64(o)[:, heads], o_ref, what="single o", **O_TOL[dt])
    assert_close(to_numpy_f64(lse)[:, heads], lse_ref, what="single lse", **LSE_TOL[dt])
