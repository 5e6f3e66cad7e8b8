"""FP8 prefill (float8_e4m3fn q, k and v on the sm_90a fp8 wgmma kernels), GPU, against the
float64 reference on the DEQUANTISED inputs.

q, k, v are drawn as random fp32 and cast to float8_e4m3fn; per-head scales scale_q [Hq],
scale_k [Hkv], scale_v [Hkv] are random in [0.3, 2.0] (never 1), and the reference attends over
q.double() * scale_q[h], k.double() * scale_k[g], v.double() * scale_v[g] with the same sm_scale:
exactly FlashInfer's fp8 semantics (1.9), so a kernel that dropped or misplaced any scale fails
(scale_q / scale_k move the logits and the LSE, scale_v the output). Tolerances are FlashInfer's
fp8 tests': a 16-bit output atol 4e-2, rtol 8e-2; an e4m3 output 1e-1 / 1e-1; plus, per element,
the bound of P's rounding to e4m3 before P V (as FA3 does; checks.fp8_output_atol: 2^-4 of the
attention of |V|), which rows of two or three keys (causal, qo ~ kv) need: one such row missed the
flat atol by 1.1x on an H200. The LSE (fp32 logits of exact fp8 products) gets 1e-2 / 1e-3. V is
drawn with std V_STD = 0.5 (any misplaced key, scale or tile is far outside).

The paged wrapper (the paged fp8 rows) runs the same batches from a cache of float8_e4m3fn pages
in a random page order among garbage pages (finite values 4x larger, never read): page sizes 1,
16 and 64 at GQA 1 / 4 / 8, head dims 64 / 128 / 256, causal or not, odd lengths, a request
without queries and one without keys; page sizes 5 (not a power of two), 32 and 128 in both
layouts, the e4m3 output, window_left and split KV.

The contiguous hd128 row's long-KV twin (256-key serial steps, routing.long_twin), which plans take
only for long requests, runs the single and ragged cases at every length under PFA_SM90_LONG_KV=1
(each test checks that it ran).

Outputs go into poisoned buffers (NaN; an e4m3 output filled with 0x7f, e4m3fn's NaN), the LSE
always requested. On a GPU other than sm_90 the module checks the NotImplementedError instead.

    python -m pytest -q tests/gpu/test_fp8_prefill.py
"""
from __future__ import annotations

import numpy as np
import pytest

from pyflashattn.testing.gpu import cuda_generator, page_spans, require_cuda_torch, scratch_workspace

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this torch has no float8 dtypes", allow_module_level=True)

import pyflashattn  # noqa: E402
from pyflashattn.testing import attention_ref, to_numpy_f64  # noqa: E402
from pyflashattn.testing.checks import assert_close, fp8_output_atol  # noqa: E402

DEV = "cuda"
E4M3 = torch.float8_e4m3fn
SM90 = torch.cuda.get_device_capability() == (9, 0)
O_TOL = {torch.bfloat16: dict(atol=4e-2, rtol=8e-2), torch.float16: dict(atol=4e-2, rtol=8e-2),
         E4M3: dict(atol=1e-1, rtol=1e-1)}
LSE_TOL = dict(atol=1e-2, rtol=1e-3)
LENGTHS = (1, 63, 64, 65, 127, 129, 1000)
V_STD = 0.5
needs_sm90 = pytest.mark.skipif(not SM90, reason="the fp8 prefill kernels are sm_90a only")


def _fp8(shape, g, scale=1.0):
    return (torch.randn(shape, generator=g, device=DEV, dtype=torch.float32) * scale).to(E4M3)


def _head_scales(n, g):
    return (0.3 + 1.7 * torch.rand(n, generator=g, device=DEV, dtype=torch.float32)).contiguous()


def _poisoned(shape, dtype):
    if dtype == E4M3:
        return torch.full(shape, 0x7F, dtype=torch.uint8, device=DEV).view(E4M3)  # e4m3fn NaN
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def _dequant(x, scales, head_axis):
    """x (fp8) * per-head scales, float64 numpy."""
    a = to_numpy_f64(x.float())
    s = to_numpy_f64(scales).reshape([-1 if i == head_axis else 1 for i in range(3)])
    return a * s


def _check(out, lse, q, k, v, sq, sk, sv, *, causal, window_left=-1, kv_layout="NHD", what=""):
    kh = 1 if kv_layout == "NHD" else 0
    qd, kd, vd = _dequant(q, sq, 1), _dequant(k, sk, kh), _dequant(v, sv, kh)
    o_ref, lse_ref = attention_ref(qd, kd, vd, causal=causal, window_left=window_left, kv_layout=kv_layout)
    o_abs, _ = attention_ref(qd, kd, np.abs(vd), causal=causal, window_left=window_left, kv_layout=kv_layout)
    tol = O_TOL[out.dtype]
    assert_close(out.float(), o_ref, atol=fp8_output_atol(tol["atol"], o_abs), rtol=tol["rtol"], what=f"o {what}")
    assert_close(lse, lse_ref, **LSE_TOL, what=f"lse {what}")


def _single_case(qo_len, kv_len, hq, hkv, d, causal, o_dtype, window_left=-1, kv_layout="NHD", tensors=True):
    g = cuda_generator("fp8-single", qo_len, kv_len, hq, hkv, d, causal, str(o_dtype), window_left, kv_layout)
    q = _fp8((qo_len, hq, d), g)
    kv_shape = (kv_len, hkv, d) if kv_layout == "NHD" else (hkv, kv_len, d)
    k, v = _fp8(kv_shape, g), _fp8(kv_shape, g, V_STD)
    sq, sk, sv = _head_scales(hq, g), _head_scales(hkv, g), _head_scales(hkv, g)
    out = _poisoned((qo_len, hq, d), o_dtype)
    lse = _poisoned((qo_len, hq), torch.float32)
    scales = (sq, sk, sv) if tensors else tuple(float(x[0]) for x in (sq, sk, sv))
    if not tensors:  # one number per tensor: every head the same
        sq, sk, sv = (torch.full_like(t, x) for t, x in zip((sq, sk, sv), scales))
    res = pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=causal, window_left=window_left,
                                                   kv_layout=kv_layout, scale_q=scales[0], scale_k=scales[1],
                                                   scale_v=scales[2], o_dtype=o_dtype, out=out, lse=lse)
    assert res is out
    torch.cuda.synchronize()
    _check(out, lse, q, k, v, sq, sk, sv, causal=causal, window_left=window_left, kv_layout=kv_layout,
           what=f"qo={qo_len} kv={kv_len} Hq={hq} Hkv={hkv} d={d} causal={causal} {o_dtype}")


@needs_sm90
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", LENGTHS)
def test_single_prefill_fp8_lengths(n, causal, d):
    _single_case(n, n, 8, 2, d, causal, torch.bfloat16)


@needs_sm90
@pytest.mark.parametrize("qo_len, kv_len", [(1, 1000), (17, 129), (65, 300), (129, 1000), (300, 1025)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq, hkv", [(8, 2), (4, 4), (8, 1)])
def test_single_prefill_fp8_qo_len_differs(qo_len, kv_len, causal, hq, hkv):
    _single_case(qo_len, kv_len, hq, hkv, 128, causal, torch.bfloat16)


@needs_sm90
@pytest.mark.parametrize("o_dtype", [torch.float16, torch.bfloat16, E4M3])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_single_prefill_fp8_output_dtypes(o_dtype, d):
    _single_case(129, 1000, 8, 2, d, True, o_dtype)


@needs_sm90
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_single_prefill_fp8_layouts_window_and_number_scales(kv_layout):
    _single_case(1000, 1000, 8, 2, 128, True, torch.bfloat16, window_left=100, kv_layout=kv_layout)
    _single_case(300, 500, 8, 2, 128, False, torch.bfloat16, kv_layout=kv_layout, tensors=False)


@needs_sm90
@pytest.mark.parametrize("d", [64, 128, 256])
def test_single_prefill_fp8_split_kv(d):
    # few row tiles over a long KV: the scheduler splits it, partials merge into the output
    _single_case(16, 16384, 8, 2, d, False, torch.bfloat16)
    _single_case(16, 16384, 8, 2, d, True, E4M3)


@needs_sm90
def test_single_prefill_fp8_default_output_is_e4m3():
    g = cuda_generator("fp8-default-out")
    q, k, v = _fp8((65, 4, 128), g), _fp8((65, 4, 128), g), _fp8((65, 4, 128), g, V_STD)
    o = pyflashattn.single_prefill_with_kv_cache(q, k, v)
    assert o.dtype == E4M3 and o.shape == q.shape
    ones = torch.ones(4, device=DEV)
    o_ref, _ = attention_ref(_dequant(q, ones, 1), _dequant(k, ones, 1), _dequant(v, ones, 1))
    assert_close(o.float(), o_ref, **O_TOL[E4M3], what="default e4m3 output")


@needs_sm90
@pytest.mark.parametrize("o_dtype", [torch.bfloat16, E4M3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_ragged_batch_fp8(d, causal, o_dtype):
    _ragged_case(d, causal, o_dtype)


def _ragged_case(d, causal, o_dtype):
    """A ragged batch of odd lengths (one of a single key, qo < kv and qo = kv), per-head scales and
    then number scales; returns the wrapper."""
    hq, hkv = 8, 2
    qo_lens = [1, 63, 65, 129, 1000, 64]
    kv_lens = [1, 127, 65, 1000, 1000, 300]
    g = cuda_generator("fp8-ragged", d, causal, str(o_dtype))
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    q = _fp8((int(qo_indptr[-1]), hq, d), g)
    k, v = _fp8((int(kv_indptr[-1]), hkv, d), g), _fp8((int(kv_indptr[-1]), hkv, d), g, V_STD)
    sq, sk, sv = _head_scales(hq, g), _head_scales(hkv, g), _head_scales(hkv, g)
    w = pyflashattn.BatchPrefillWithRaggedKVCacheWrapper(scratch_workspace(), "NHD")
    w.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=causal, q_data_type=E4M3, kv_data_type=E4M3,
           o_data_type=o_dtype)
    for run in range(2):  # the second run with numbers: the per-head pointers must be gone
        out = _poisoned(q.shape[:2] + (d,), o_dtype)
        lse = _poisoned(q.shape[:2], torch.float32)
        if run == 0:
            w.run(q, k, v, q_scale=sq, k_scale=sk, v_scale=sv, out=out, lse=lse)
            rq, rk, rv = sq, sk, sv
        else:
            # v_scale scales V and with it P's e4m3 rounding error (up to 1/16 of each weight),
            # against a fixed atol: 2.0 on V_STD 0.5 put one element of 2M 1% past FlashInfer's
            # tolerance on an H200 (hd256 causal); the per-head run above covers scales up to 2
            w.run(q, k, v, q_scale=1.5, k_scale=0.5, v_scale=0.75, out=out, lse=lse)
            rq, rk, rv = (torch.full_like(t, x) for t, x in zip((sq, sk, sv), (1.5, 0.5, 0.75)))
        torch.cuda.synchronize()
        for b in range(len(qo_lens)):
            qs, ks = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_indptr[b], kv_indptr[b + 1])
            _check(out[qs], lse[qs], q[qs], k[ks], v[ks], rq, rk, rv, causal=causal,
                   what=f"run {run} request {b} (qo {qo_lens[b]}, kv {kv_lens[b]})")
    return w


# ---------------------------------------------------------------------------------------------
# the long-KV twin of the contiguous hd128 row (256-key serial steps; routing.long_twin), run at
# every length by PFA_SM90_LONG_KV=1
# ---------------------------------------------------------------------------------------------
def _long_twin(monkeypatch):
    from pyflashattn._engine import routing, single
    monkeypatch.setenv(routing.LONG_ENV, "1")
    monkeypatch.setattr(single._tls, "plans", {}, raising=False)  # no plan made without the switch
    return single._tls.plans


def _ran_long_twin(plans):
    (plan,) = plans.values()
    meta = plan.attn.meta
    assert meta.get("decode") or (meta.get("long_kv") and meta["block_n"] == 256), plan.attn.name


@needs_sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", LENGTHS + (255, 257, 4097))
def test_single_prefill_fp8_long_twin_lengths(monkeypatch, n, causal):
    plans = _long_twin(monkeypatch)
    _single_case(n, n, 8, 2, 128, causal, torch.bfloat16)
    _ran_long_twin(plans)


@needs_sm90
@pytest.mark.parametrize("qo_len, kv_len", [(17, 129), (65, 300), (300, 1025), (1, 1000)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq, hkv", [(8, 2), (4, 4), (8, 1)])
def test_single_prefill_fp8_long_twin_qo_len_differs(monkeypatch, qo_len, kv_len, causal, hq, hkv):
    plans = _long_twin(monkeypatch)
    _single_case(qo_len, kv_len, hq, hkv, 128, causal, torch.bfloat16)
    _ran_long_twin(plans)


@needs_sm90
def test_single_prefill_fp8_long_twin_outputs_window_split_kv(monkeypatch):
    cases = [(129, 1000, True, o_dtype, {}) for o_dtype in (torch.float16, torch.bfloat16, E4M3)]
    cases += [(1000, 1000, True, torch.bfloat16, dict(window_left=100, kv_layout="HND")),
              (300, 500, False, torch.bfloat16, dict(tensors=False)),
              (16, 16384, False, torch.bfloat16, {}), (16, 16384, True, E4M3, {})]  # split KV: partials merge
    for qo_len, kv_len, causal, o_dtype, kw in cases:
        plans = _long_twin(monkeypatch)
        _single_case(qo_len, kv_len, 8, 2, 128, causal, o_dtype, **kw)
        _ran_long_twin(plans)


@needs_sm90
@pytest.mark.parametrize("o_dtype", [torch.bfloat16, E4M3])
@pytest.mark.parametrize("causal", [False, True])
def test_ragged_batch_fp8_long_twin(monkeypatch, causal, o_dtype):
    _long_twin(monkeypatch)
    w = _ragged_case(128, causal, o_dtype)
    assert w._engine.attn.meta.get("long_kv") and w._engine.attn.meta["block_n"] == 256


# ---------------------------------------------------------------------------------------------
# the paged wrapper over an e4m3 cache (the paged fp8 rows)
# ---------------------------------------------------------------------------------------------
PAGED_QO = (1, 63, 0, 129, 17, 300)  # a request without queries, one without keys (17 x 0)
PAGED_KV = (1, 127, 65, 1000, 0, 301)


def _indptr(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _paged_cache(k, v, kv_lens, ps, layout, g):
    """The requests' e4m3 K / V rows [tokens, Hkv, D] on pages of ps rows, handed out in a random
    order among garbage pages: (cache [P, 2, ps, Hkv, D] (NHD) or [P, 2, Hkv, ps, D] (HND),
    kv_indptr, kv_indices, kv_last_page_len). Copies go through uint8 views (fp8 indexing may lack
    a torch kernel)."""
    pages = [-(-n // ps) for n in kv_lens]
    total = sum(pages) + 3
    table, spans = page_spans(kv_lens, ps, np.random.default_rng(ps).permutation(total), total - 1)
    store = _fp8((total, 2, ps) + tuple(k.shape[1:]), g, 4.0).view(torch.uint8)
    k8, v8 = k.view(torch.uint8), v.view(torch.uint8)
    for pid, lo, hi in spans:
        store[pid, 0, :hi - lo], store[pid, 1, :hi - lo] = k8[lo:hi], v8[lo:hi]
    if layout == "HND":
        store = store.transpose(2, 3).contiguous()
    indices = np.concatenate([table[b, :n] for b, n in enumerate(pages)]).astype(np.int32)
    last = np.asarray([n - (p - 1) * ps if p else 0 for n, p in zip(kv_lens, pages)], np.int32)
    return store.view(E4M3), _indptr(pages), indices, last


def _paged_case(ps, hq, hkv, d, causal, o_dtype=torch.bfloat16, layout="NHD", window_left=-1, qo_lens=PAGED_QO,
                kv_lens=PAGED_KV, number_run=False):
    """Plan and run the paged wrapper with per-head scale tensors (and, number_run, again with
    numbers: the per-head pointers must be gone), checking every request's rows and LSE."""
    g = cuda_generator("fp8-paged", ps, hq, hkv, d, causal, str(o_dtype), layout, window_left, qo_lens, kv_lens)
    qo_indptr, kv_rows = _indptr(qo_lens), _indptr(kv_lens)
    q = _fp8((int(qo_indptr[-1]), hq, d), g)
    k, v = _fp8((int(kv_rows[-1]), hkv, d), g), _fp8((int(kv_rows[-1]), hkv, d), g, V_STD)
    sq, sk, sv = _head_scales(hq, g), _head_scales(hkv, g), _head_scales(hkv, g)
    cache, kv_indptr, indices, last = _paged_cache(k, v, kv_lens, ps, layout, g)
    w = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(scratch_workspace(), layout)
    w.plan(qo_indptr, kv_indptr, indices, last, hq, hkv, d, ps, causal=causal, window_left=window_left,
           q_data_type=E4M3, kv_data_type=E4M3, o_data_type=o_dtype)
    assert w._engine.attn.meta["paged"] and w._engine.attn.meta["dtype"] == "e4m3"
    for run in range(2 if number_run else 1):
        out = _poisoned((q.shape[0], hq, d), o_dtype)
        lse = _poisoned((q.shape[0], hq), torch.float32)
        if run == 0:
            w.run(q, cache, q_scale=sq, k_scale=sk, v_scale=sv, out=out, lse=lse)
            rq, rk, rv = sq, sk, sv
        else:
            w.run(q, cache, q_scale=1.5, k_scale=0.5, v_scale=0.75, out=out, lse=lse)
            rq, rk, rv = (torch.full_like(t, x) for t, x in zip((sq, sk, sv), (1.5, 0.5, 0.75)))
        torch.cuda.synchronize()
        for b in range(len(qo_lens)):
            qs, ks = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_rows[b], kv_rows[b + 1])
            if qo_lens[b]:
                _check(out[qs], lse[qs], q[qs], k[ks], v[ks], rq, rk, rv, causal=causal, window_left=window_left,
                       what=f"paged ps={ps} {layout} Hq={hq} Hkv={hkv} d={d} run {run} request {b} "
                            f"(qo {qo_lens[b]}, kv {kv_lens[b]})")
    return w


@needs_sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 2), (16, 2)])
@pytest.mark.parametrize("ps", [1, 16, 64])
def test_paged_batch_fp8(ps, hq, hkv, d, causal):
    _paged_case(ps, hq, hkv, d, causal)


@needs_sm90
@pytest.mark.parametrize("o_dtype", [torch.bfloat16, E4M3])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("ps", [5, 32, 128])
def test_paged_batch_fp8_page_sizes_layouts_outputs(ps, layout, o_dtype):
    _paged_case(ps, 8, 2, 128, True, o_dtype, layout, number_run=True)


@needs_sm90
@pytest.mark.parametrize("d", [64, 128, 256])
def test_paged_batch_fp8_window_and_split_kv(d):
    _paged_case(16, 8, 2, d, True, window_left=100)
    # few rows over many keys: the plan splits KV (asserted), partials merge into the output
    w = _paged_case(16, 8, 2, d, False, qo_lens=(16, 1), kv_lens=(16384, 5000))
    assert w._engine.schedule.split


@pytest.mark.skipif(SM90, reason="checks the refusal on GPUs without the fp8 prefill")
def test_fp8_q_elsewhere_is_not_implemented():
    g = cuda_generator("fp8-refusal")
    q, k, v = _fp8((64, 4, 128), g), _fp8((64, 4, 128), g), _fp8((64, 4, 128), g)
    with pytest.raises(NotImplementedError, match="sm_90a"):
        pyflashattn.single_prefill_with_kv_cache(q, k, v)
    cache, kv_indptr, indices, last = _paged_cache(k, v, (64,), 16, "NHD", g)
    w = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(scratch_workspace(), "NHD")
    with pytest.raises(NotImplementedError, match="sm_90a"):
        w.plan(_indptr((64,)), kv_indptr, indices, last, 4, 4, 128, 16, q_data_type=E4M3, kv_data_type=E4M3)
