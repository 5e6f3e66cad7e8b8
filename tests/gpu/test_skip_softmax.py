"""Skip-softmax sparsity (skip_softmax_threshold_scale_factor, semantics 1.12) on a CUDA GPU.

The inputs have dominant early keys: every query has a large component along one direction that
only keys 0..3 share, so those keys' logits stand GAP = 8 natural units above the rest (whose
noise has std 0.05), and the other keys' values sit apart from theirs. The factor is chosen so
that every request has exp(-GAP) << T <= 0.4: in a KV split that starts with the dominant keys,
every later tile's row maxes lie ~8 below the running max (ln T >= -5), so the kernels skip
them; in a split without them every tile's maxes lie within ~0.3 of the running max (ln T <=
-0.9), so nothing there is skipped. No decision is near its threshold, so fp32 and float64 agree
on every one. The full answer and the skipped one differ by far more than the tolerance
(asserted per case), and the kernel must match the skip reference (pyflashattn.testing.skip_softmax, at the launched kernel's tile, vote group and KV
split) and not the full one. factor 0 / None must give the exact answer. Every API that takes the
argument: trtllm_fmha_v2_prefill (ragged and paged layouts), trtllm_batch_context_with_kv_cache,
BatchPrefillWithPagedKVCacheWrapper.run, BatchDecodeWithPagedKVCacheWrapper.run; both kernel
families on sm_90 (the sm80 family forced by its implementation preference); a forced split KV;
causal and not; GQA 1 / 4 / 8; head dims 64 / 128 / 256.

    python -m pytest -q tests/gpu/test_skip_softmax.py
"""
from __future__ import annotations

import math
import zlib
from collections import OrderedDict

import numpy as np
import pytest

from pyflashattn.testing.gpu import page_spans, require_cuda_torch, scratch_workspace

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()

import pyflashattn  # noqa: E402
from pyflashattn._engine import trtllm as _trtllm, trtllm_device as _trtllm_device  # noqa: E402
from pyflashattn._runtime import registry as _registry  # noqa: E402
from pyflashattn.testing import attention_ref, to_numpy_f64  # noqa: E402
from pyflashattn.testing.checks import assert_close  # noqa: E402
from pyflashattn.testing.skip_softmax import skip_softmax_attention_ref  # noqa: E402

DEV = "cuda"
BF16, F16 = torch.bfloat16, torch.float16
TOL = {F16: dict(atol=1e-3, rtol=1e-3), BF16: dict(atol=1e-2, rtol=1e-2)}
GAP = 8.0        # natural units between the dominant keys' logits and the rest
N_DOMINANT = 4   # keys 0..3: inside the first tile of any kernel
T_MAX = 0.4      # factor = T_MAX * the shortest request: T <= T_MAX for every request
SM90 = torch.cuda.get_device_capability()[0] == 9


@pytest.fixture(params=["sm90", "sm80"])
def family(request, monkeypatch):
    """The kernel family the call must run on: sm90 (only on an sm_90 GPU) or sm80 (forced on sm_90
    by the implementation preference). The TRT-LLM facades' engine cache is emptied either way."""
    fam = request.param
    if fam == "sm90" and not SM90:
        pytest.skip("the sm90 family needs an sm_90 GPU")
    if fam == "sm80" and SM90:
        monkeypatch.setitem(_registry.IMPL_PREFERENCE, "sm_90a", ("sm80",))
        _registry.force("prefill", None)  # drops the cached launchers and decode-tile rows
    monkeypatch.setattr(_trtllm, "_ENGINES", OrderedDict())
    monkeypatch.setattr(_trtllm_device, "_ENGINES", OrderedDict())
    yield fam
    _registry.force("prefill", None)


def dominant_inputs(ql, kl, hq, hkv, d, dtype, seed):
    """Ragged q [sum ql, hq, d], k / v [sum kl, hkv, d] with dominant keys 0..3 in every request
    (see the module docstring); sm_scale = 1 / sqrt(d)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, device=DEV, dtype=torch.float32)  # noqa: E731
    q, k, v = 0.05 * rnd(sum(ql), hq, d), rnd(sum(kl), hkv, d), rnd(sum(kl), hkv, d) + 1.0
    amp = math.sqrt(GAP * math.sqrt(d))  # q[..., 0] * k[dom, :, 0] / sqrt(d) = GAP
    q[..., 0] = amp
    k[..., 0] = 0.0
    c0 = 0
    for n in kl:
        k[c0:c0 + min(n, N_DOMINANT), :, 0] = amp
        v[c0:c0 + min(n, N_DOMINANT)] -= 2.0
        c0 += n
    return q.to(dtype), k.to(dtype), v.to(dtype)


def factor_for(kl):
    """T_MAX * the shortest request; every request then has exp(-GAP) * e^3 < T <= T_MAX."""
    f = T_MAX * min(kl)
    assert f / max(kl) > math.exp(3 - GAP), "the lengths spread too far for one factor"
    return f


def cum(lens):
    return torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=DEV)


def paged(k, v, kl, ps, seed):
    """A [P, 2, ps, Hkv, D] (NHD) cache of k / v on shuffled pages, and its block table [B, M]."""
    rng = np.random.default_rng(seed)
    total = sum(-(-n // ps) for n in kl) + 1
    table, spans = page_spans(kl, ps, rng.permutation(total), total - 1)
    cache = torch.randn(total, 2, ps, k.shape[1], k.shape[2], device=DEV).to(k.dtype)
    for pid, lo, hi in spans:
        cache[pid, 0, :hi - lo], cache[pid, 1, :hi - lo] = k[lo:hi], v[lo:hi]
    return cache, torch.tensor(table, device=DEV)


def engine_geometry(e):
    """(vote group rows, tile keys, split keys) of the kernel an engine launched last."""
    meta = e.attn.meta
    rows = meta.get("skip_softmax_rows")
    assert rows, f"{meta['name']} ran a skip-softmax call without having skip-softmax"
    return rows, meta["block_n"], int(e.schedule.kv_chunk_size), meta


def check(out, q, k, v, ql, kl, factor, geometry, dtype, *, causal, what, sm_scale=None, lse=None):
    """out against the skip reference at the launched geometry, per request; when factor > 0 the
    full answer must differ from it by far more than the tolerance (so a kernel that skipped
    nothing fails)."""
    rows, bn, split, meta = geometry
    qn, kn, vn = (to_numpy_f64(x) for x in (q, k, v))
    d = qn.shape[-1]
    cq, ck = np.concatenate([[0], np.cumsum(ql)]), np.concatenate([[0], np.cumsum(kl)])
    o_skip, o_full, lse_skip = [], [], []
    for b in range(len(ql)):
        args = (qn[cq[b]:cq[b + 1]], kn[ck[b]:ck[b + 1]], vn[ck[b]:ck[b + 1]])
        o, ls = skip_softmax_attention_ref(*args, factor=factor, group_rows=rows, block_n=bn, split=split,
                                           causal=causal, sm_scale=sm_scale or 1 / math.sqrt(d))
        o_skip.append(o), lse_skip.append(ls)
        o_full.append(attention_ref(*args, causal=causal, sm_scale=sm_scale or 1 / math.sqrt(d))[0])
    o_skip, o_full = np.concatenate(o_skip), np.concatenate(o_full)
    tol = TOL[dtype]
    if factor:
        # the skip and full answers must be told apart: the kernel then matches the one and, by
        # more than twice the tolerance, not the other (a kernel that skipped nothing fails)
        gap = np.abs(o_skip - o_full).max()
        assert gap > 3 * tol["atol"], f"{what}: the case skips too little to tell ({gap:.2e}); inputs need fixing"
        off = np.abs(to_numpy_f64(out) - o_full).max()
        assert off > 2 * tol["atol"], f"{what}: the output is the full answer (off by {off:.2e}): nothing skipped"
    assert_close(out, o_skip, **tol, what=f"o {what} on {meta['name']}")
    if lse is not None:
        assert_close(lse, np.concatenate(lse_skip), atol=2e-3, rtol=2e-3, what=f"lse {what}")


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), device=DEV, dtype=dtype)


def last_trtllm_engine():
    """The engine of the test's TRT-LLM call (device metadata: trtllm_device's; host: trtllm's)."""
    engines = _trtllm_device._ENGINES or _trtllm._ENGINES
    return next(reversed(engines.values()))


def assert_family(meta, family):
    assert meta["impl"] == family or meta.get("decode"), f"{meta['name']} is not of the {family} family"


# ---------------------------------------------------------------------------------------------
# trtllm_fmha_v2_prefill
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["SEPARATE_Q_K_V", "Q_PAGED_KV_NHD"])
@pytest.mark.parametrize("mask_mode", ["causal", "padding"])
@pytest.mark.parametrize("factor_kind", ["skip", "zero", "none"])
def test_fmha_v2(family, layout, mask_mode, factor_kind):
    ql, kl, hq, hkv, d, dtype = [300, 1, 77], [1500, 600, 200], 8, 2, 128, BF16
    q, k, v = dominant_inputs(ql, kl, hq, hkv, d, dtype, seed=zlib.crc32(f"{layout}{mask_mode}".encode()))
    factor = {"skip": factor_for(kl), "zero": 0, "none": None}[factor_kind]
    out = poisoned(q.shape, dtype)
    if layout == "SEPARATE_Q_K_V":
        qkv, extra = (q, k, v), {}
    else:
        cache, table = paged(k, v, kl, 32, seed=1)
        qkv, extra = (q, cache), dict(block_tables=table)
    kw = {} if factor_kind == "none" else dict(skip_softmax_threshold_scale_factor=factor)
    pyflashattn.prefill.trtllm_fmha_v2_prefill(
        qkv, layout, scratch_workspace(), torch.tensor(kl, dtype=torch.int32, device=DEV), max(ql), max(kl),
        1 / math.sqrt(d), 1.0, len(ql), cum(ql), cum(kl), out=out, mask_mode=mask_mode, **extra, **kw)
    geo = engine_geometry(last_trtllm_engine()) if factor else (1, 1, 1 << 30, last_trtllm_engine().attn.meta)
    assert_family(geo[3], family)
    check(out, q, k, v, ql, kl, factor, geo, dtype, causal=mask_mode == "causal", what=f"fmha {layout} {mask_mode}")


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_fmha_v2_geometry(family, d, group):
    ql, kl, dtype = [130, 7], [1100, 700], F16
    hkv = 2
    q, k, v = dominant_inputs(ql, kl, hkv * group, hkv, d, dtype, seed=d * 10 + group)
    out = poisoned(q.shape, dtype)
    factor = factor_for(kl)
    pyflashattn.prefill.trtllm_fmha_v2_prefill(
        (q, k, v), "SEPARATE_Q_K_V", scratch_workspace(), torch.tensor(kl, dtype=torch.int32, device=DEV), max(ql),
        max(kl), 1 / math.sqrt(d), 1.0, len(ql), cum(ql), cum(kl), out=out, mask_mode="causal",
        skip_softmax_threshold_scale_factor=factor)
    geo = engine_geometry(last_trtllm_engine())
    assert_family(geo[3], family)
    check(out, q, k, v, ql, kl, factor, geo, dtype, causal=True, what=f"fmha d{d} g{group}")


# ---------------------------------------------------------------------------------------------
# trtllm_batch_context_with_kv_cache
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("factor_kind", ["skip", "none"])
def test_context(family, factor_kind):
    ql, kl, hq, hkv, d, dtype = [200, 64], [900, 64], 8, 1, 128, BF16
    q, k, v = dominant_inputs(ql, kl, hq, hkv, d, dtype, seed=11)
    cache, table = paged(k, v, kl, 64, seed=2)
    cache = cache.transpose(2, 3).contiguous()  # HND, the API's default
    factor = factor_for(kl) if factor_kind == "skip" else None
    out = poisoned(q.shape, dtype)
    lse = poisoned((q.shape[0], hq), torch.float32)
    pyflashattn.prefill.trtllm_batch_context_with_kv_cache(
        q, cache, scratch_workspace(), table, torch.tensor(kl, dtype=torch.int32, device=DEV), max(ql), max(kl),
        1 / math.sqrt(d), 1.0, len(ql), cum(ql), cum(kl), out=out, lse=lse,
        skip_softmax_threshold_scale_factor=factor)
    e = last_trtllm_engine()
    geo = engine_geometry(e) if factor else (1, 1, 1 << 30, e.attn.meta)
    assert_family(geo[3], family)
    check(out, q, k, v, ql, kl, factor, geo, dtype, causal=True, what="context", lse=lse)


# ---------------------------------------------------------------------------------------------
# BatchPrefillWithPagedKVCacheWrapper.run: split KV, GQA, head dims; the factor per run
# ---------------------------------------------------------------------------------------------
def _paged_wrapper(q, k, v, ql, kl, hq, hkv, d, dtype, ps, causal, kv_dtype=None, **plan_kw):
    cache, table = paged(k, v, kl, ps, seed=3)
    if kv_dtype is not None:  # k / v hold kv_dtype's values already: the cast is exact
        cache = cache.to(kv_dtype)
    pages = [-(-n // ps) for n in kl]
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(pages)]), dtype=torch.int32, device=DEV)
    indices = torch.cat([table[b, :pages[b]] for b in range(len(kl))])
    last = torch.tensor([n - (p - 1) * ps for n, p in zip(kl, pages)], dtype=torch.int32, device=DEV)
    w = pyflashattn.prefill.BatchPrefillWithPagedKVCacheWrapper(scratch_workspace(), "NHD")
    w.plan(cum(ql), indptr, indices, last, hq, hkv, d, ps, causal=causal, q_data_type=dtype,
           kv_data_type=kv_dtype or dtype, **plan_kw)
    return w, cache


@pytest.mark.parametrize("split", [None, 256], ids=["auto", "split256"])
@pytest.mark.parametrize("causal", [True, False])
def test_paged_prefill_wrapper(family, split, causal):
    ql, kl, hq, hkv, d, dtype = [96, 200], [2000, 333], 8, 2, 128, F16
    q, k, v = dominant_inputs(ql, kl, hq, hkv, d, dtype, seed=21 + causal)
    w, cache = _paged_wrapper(q, k, v, ql, kl, hq, hkv, d, dtype, 16, causal, fixed_split_size=split)
    factor = factor_for(kl)
    for f in (factor, 0, factor, None):  # the factor changes per run on one plan
        out = poisoned(q.shape, dtype)
        w.run(q, cache, out=out, skip_softmax_threshold_scale_factor=f)
        geo = engine_geometry(w._engine) if f else (1, 1, 1 << 30, w._engine.attn.meta)
        assert_family(geo[3], family)
        if split:
            assert int(w._engine.schedule.num_chunks.max()) > 1, "the plan did not split the KV"
        check(out, q, k, v, ql, kl, f, geo, dtype, causal=causal, what=f"paged wrapper f={f} split={split}")


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_paged_prefill_wrapper_geometry(family, d, group):
    ql, kl, hkv, dtype = [150], [1200], 1, BF16
    q, k, v = dominant_inputs(ql, kl, hkv * group, hkv, d, dtype, seed=31 * d + group)
    w, cache = _paged_wrapper(q, k, v, ql, kl, hkv * group, hkv, d, dtype, 32, True)
    factor = factor_for(kl)
    out = poisoned(q.shape, dtype)
    w.run(q, cache, out=out, skip_softmax_threshold_scale_factor=factor)
    geo = engine_geometry(w._engine)
    assert_family(geo[3], family)
    check(out, q, k, v, ql, kl, factor, geo, dtype, causal=True, what=f"paged wrapper d{d} g{group}")


@pytest.mark.parametrize("d", [64, 128])
def test_paged_prefill_wrapper_fp8_kv(family, d):
    """An e4m3 cache under a 16-bit q (sm_90: the sm90 family's widening rows' skip twins). fp16:
    with the keys rounded to e4m3, bf16's tolerance cannot tell the skipped answer from the full one."""
    ql, kl, hq, hkv, dtype = [130, 40], [1500, 700], 8, 2, F16
    q, k, v = dominant_inputs(ql, kl, hq, hkv, d, dtype, seed=41 * d)
    k, v = (x.float().to(torch.float8_e4m3fn).float().to(dtype) for x in (k, v))  # e4m3's values
    w, cache = _paged_wrapper(q, k, v, ql, kl, hq, hkv, d, dtype, 16, True, kv_dtype=torch.float8_e4m3fn)
    factor = factor_for(kl)
    out = poisoned(q.shape, dtype)
    w.run(q, cache, out=out, skip_softmax_threshold_scale_factor=factor)
    geo = engine_geometry(w._engine)
    assert_family(geo[3], family)
    assert geo[3]["kv_dtype"] == "fp8", geo[3]["name"]
    check(out, q, k, v, ql, kl, factor, geo, dtype, causal=True, what=f"paged wrapper fp8 K/V d{d}")


# ---------------------------------------------------------------------------------------------
# BatchDecodeWithPagedKVCacheWrapper.run: the decode tiles (16 rows a vote group)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_decode_wrapper(d, group):
    kl, hkv, dtype = [3000, 700, 64], 2, BF16
    ql = [1] * len(kl)
    hq = hkv * group
    q, k, v = dominant_inputs(ql, kl, hq, hkv, d, dtype, seed=41 * d + group)
    ps = 16
    cache, table = paged(k, v, kl, ps, seed=4)
    pages = [-(-n // ps) for n in kl]
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(pages)]), dtype=torch.int32, device=DEV)
    indices = torch.cat([table[b, :pages[b]] for b in range(len(kl))])
    last = torch.tensor([n - (p - 1) * ps for n, p in zip(kl, pages)], dtype=torch.int32, device=DEV)
    w = pyflashattn.decode.BatchDecodeWithPagedKVCacheWrapper(scratch_workspace(), "NHD")
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type=dtype, kv_data_type=dtype)
    factor = factor_for(kl)
    for f in (factor, None):
        out = poisoned(q.shape, dtype)
        lse = poisoned((q.shape[0], hq), torch.float32)
        w.run(q, cache, out=out, lse=lse, skip_softmax_threshold_scale_factor=f)
        geo = engine_geometry(w._engine) if f else (1, 1, 1 << 30, w._engine.attn.meta)
        check(out, q, k, v, ql, kl, f, geo, dtype, causal=False, what=f"decode d{d} g{group} f={f}", lse=lse)
