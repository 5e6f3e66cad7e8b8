"""TRT-LLM prefill entry points on a CUDA GPU (torch inputs) against a float64 reference.

trtllm_fmha_v2_prefill: every input layout x mask mode (padding, causal, sliding_window,
chunked 64 / 256), queries shorter than keys (the last positions, bottom-right), sinks (with a
forced split KV: counted once), ALiBi, soft cap, bmm scales as floats, fp8 / other-16-bit
outputs, softmax stats, page sizes 16..128, GQA 1 / 4 / 8, head dims 64 / 128 / 256.
trtllm_batch_context_with_kv_cache: HND / NHD caches, one tensor or a tuple, 2-D and 3-D
block tables, bmm scales as device tensors, window_left, lse.

Every case draws fresh seeded inputs; outputs are NaN-poisoned out= buffers; NaN never passes
(checks.assert_close). Unused cache pages hold random values (a wrong page is a wrong answer).

    python -m pytest -q tests/gpu/test_trtllm.py
"""
from __future__ import annotations

import math
import zlib
from collections import OrderedDict

import numpy as np
import pytest

from pyflashattn.testing.gpu import page_spans, require_cuda_torch, select_kv_load

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()

import pyflashattn  # noqa: E402
from pyflashattn._engine import trtllm as _trtllm, trtllm_device as _trtllm_device  # noqa: E402
from pyflashattn._runtime import registry as _registry  # noqa: E402
from pyflashattn.testing import to_numpy_f64  # noqa: E402
from pyflashattn.testing.checks import assert_close  # noqa: E402
from pyflashattn.testing.reference import alibi_slopes, trtllm_request_ref as ref_request  # noqa: E402

DEV = "cuda"
F16, BF16, E4M3 = torch.float16, torch.bfloat16, torch.float8_e4m3fn
TOL = {F16: dict(atol=1e-3, rtol=1e-3), BF16: dict(atol=1e-2, rtol=1e-2), E4M3: dict(atol=6e-2, rtol=7e-2)}
WS = []
fmha = pyflashattn.prefill.trtllm_fmha_v2_prefill
context = pyflashattn.prefill.trtllm_batch_context_with_kv_cache


@pytest.fixture(params=["default", "tma"])
def kv_load(request, monkeypatch):
    """The sm90 family's K/V load: what the variant table ships, or the TMA twins; the facades'
    engine caches start empty either way."""
    select_kv_load(request.param, monkeypatch)
    monkeypatch.setattr(_trtllm, "_ENGINES", OrderedDict())
    monkeypatch.setattr(_trtllm_device, "_ENGINES", OrderedDict())
    yield request.param
    _registry.force("prefill", None)


def workspace():
    if not WS:
        WS.append(torch.zeros(512 << 20, dtype=torch.uint8, device=DEV))
    return WS[0]


def make_inputs(ql, kl, hq, hkv, d, dtype, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=DEV, dtype=torch.float32).to(dtype)  # noqa: E731
    q, k, v = rnd(sum(ql), hq, d), rnd(sum(kl), hkv, d), rnd(sum(kl), hkv, d)
    cum = lambda x: torch.tensor(np.concatenate([[0], np.cumsum(x)]), dtype=torch.int32, device=DEV)  # noqa: E731
    return q, k, v, cum(ql), cum(kl), torch.tensor(kl, dtype=torch.int32, device=DEV)


def page_cache(k, v, kl, ps, layout, seed):
    """A paged cache [P, 2, ...] of k / v (a random page permutation, random garbage elsewhere)
    and its int32 block tables [B, M]."""
    rng = np.random.default_rng(seed)
    total = sum(-(-n // ps) for n in kl) + 3
    table, spans = page_spans(kl, ps, rng.permutation(total), total - 1)
    cache = torch.randn(total, 2, ps, k.shape[1], k.shape[2], device=DEV).to(k.dtype) * 4
    for pid, lo, hi in spans:
        cache[pid, 0, :hi - lo], cache[pid, 1, :hi - lo] = k[lo:hi], v[lo:hi]
    if layout == "HND":
        cache = cache.transpose(2, 3).contiguous()
    return cache, torch.tensor(table, device=DEV)


def check(out, q, k, v, ql, kl, dtype, *, scale1, scale2=1.0, causal=True, wl=-1, chunk=0, cap=None, alibi=False,
          sinks=None, stats=None, what=""):
    qn, kn, vn = (to_numpy_f64(x) for x in (q, k, v))
    hq = qn.shape[1]
    slopes = alibi_slopes(hq).astype(np.float64) if alibi else None
    sk = None if sinks is None else to_numpy_f64(sinks)
    o_ref, mx_ref, sum_ref = [], [], []
    cq, ck = np.concatenate([[0], np.cumsum(ql)]), np.concatenate([[0], np.cumsum(kl)])
    for b in range(len(ql)):
        o, mx, sm = ref_request(qn[cq[b]:cq[b + 1]], kn[ck[b]:ck[b + 1]], vn[ck[b]:ck[b + 1]], scale1, scale2, causal,
                                wl, chunk, cap, slopes, sk)
        o_ref.append(o), mx_ref.append(mx), sum_ref.append(sm)
    assert_close(out, np.concatenate(o_ref), **TOL[dtype], what=f"o {what}")
    if stats is not None:
        st = to_numpy_f64(stats)
        lse_ref = np.concatenate(mx_ref) + np.log(np.concatenate(sum_ref))
        assert_close(st[..., 0] + np.log(st[..., 1]), lse_ref, atol=2e-3, rtol=1e-4, what=f"stats lse {what}")
        assert_close(st[..., 0], np.concatenate(mx_ref), atol=2e-3, rtol=1e-3, what=f"stats max {what}")


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), device=DEV).to(dtype)


LAYOUTS = ["PACKED_QKV", "CONTIGUOUS_Q_KV", "SEPARATE_Q_K_V", "Q_PAGED_KV_NHD", "Q_PAGED_KV_HND"]
MASKS = [("padding", -1, 0), ("causal", -1, 0), ("sliding_window", 40, 0), ("causal", 17, 0), ("chunked", -1, 64),
         ("chunked", -1, 256)]


def run_fmha(layout, q, k, v, cq, ck, sl, ql, kl, ps=32, seed=0, host=False, **kw):
    """host: the metadata as numpy arrays (the host path: exact plans, split KV where it pays)."""
    if layout == "PACKED_QKV":
        qkv = torch.stack([q, k, v], 1)
    elif layout == "CONTIGUOUS_Q_KV":
        qkv = (q, torch.stack([k, v], 1))
    elif layout == "SEPARATE_Q_K_V":
        qkv = (q, k, v)
    else:
        cache, table = page_cache(k, v, kl, ps, layout[-3:], seed)
        qkv, kw["block_tables"] = (q, cache), (table.cpu().numpy() if host else table)
    if host:
        cq, ck, sl = (x.cpu().numpy() for x in (cq, ck, sl))
    return fmha(qkv, layout, workspace(), sl, max(ql), max(kl), batch_size=len(ql), cum_seq_lens_q=cq,
                cum_seq_lens_kv=ck, **kw)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: f"{m[0]}{m[1]}c{m[2]}")
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_fmha_layouts_and_masks(layout, mask, dtype):
    mode, wl, chunk = mask
    packed = layout == "PACKED_QKV"
    ql = [300, 1, 77, 513] if packed else [100, 1, 77, 513]
    kl = [300, 1, 77, 513] if packed else [300, 1, 200, 513]
    hq, hkv, d = (8, 8, 128) if packed else (8, 2, 128)
    seed = zlib.crc32(f"{layout}{mask}{dtype}".encode()) % 1000
    q, k, v, cq, ck, sl = make_inputs(ql, kl, hq, hkv, d, dtype, seed=seed)
    out = poisoned(q.shape, dtype)
    res = run_fmha(layout, q, k, v, cq, ck, sl, ql, kl, bmm1_scale=0.9 / math.sqrt(d), bmm2_scale=1.0, out=out,
                   mask_mode=mode, window_left=wl, chunked_attention_size=chunk)
    assert res is out
    check(out, q, k, v, ql, kl, dtype, scale1=0.9 / math.sqrt(d), causal=mode != "padding", wl=wl, chunk=chunk,
          what=f"{layout} {mask}")


@pytest.mark.parametrize("ps", [16, 32, 64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fmha_paged_geometry(ps, group, d, kv_load):
    ql, kl = [33, 200, 1], [500, 200, 129]
    q, k, v, cq, ck, sl = make_inputs(ql, kl, 2 * group, 2, d, BF16, seed=ps * d + group)
    out = poisoned(q.shape, BF16)
    run_fmha("Q_PAGED_KV_HND", q, k, v, cq, ck, sl, ql, kl, ps=ps, bmm1_scale=1 / math.sqrt(d), bmm2_scale=1.0,
             out=out)
    check(out, q, k, v, ql, kl, BF16, scale1=1 / math.sqrt(d), what=f"ps{ps} g{group} d{d}")


@pytest.mark.parametrize("layout", ["SEPARATE_Q_K_V", "Q_PAGED_KV_NHD"])
def test_fmha_sinks_alibi_softcap_scales(layout):
    ql, kl = [64, 900], [2000, 900]  # long keys: the plan splits KV; sinks must count once
    q, k, v, cq, ck, sl = make_inputs(ql, kl, 8, 2, 128, F16, seed=7)
    sinks = torch.randn(8, device=DEV, dtype=torch.float32) * 2
    for kw, ref in ((dict(sinks=[sinks]), dict(sinks=sinks)), (dict(pos_encoding_mode="alibi"), dict(alibi=True)),
                    (dict(logits_soft_cap_scale=5.0), dict(cap=5.0))):
        out = poisoned(q.shape, F16)
        run_fmha(layout, q, k, v, cq, ck, sl, ql, kl, bmm1_scale=0.2, bmm2_scale=0.75, out=out, **kw)
        check(out, q, k, v, ql, kl, F16, scale1=0.2, scale2=0.75, what=f"{layout} {list(kw)}", **ref)


@pytest.mark.parametrize("out_dtype", [BF16, E4M3])
def test_fmha_output_dtypes(out_dtype):
    ql, kl = [128, 50], [256, 300]
    q, k, v, cq, ck, sl = make_inputs(ql, kl, 4, 4, 128, F16, seed=11)
    out = run_fmha("CONTIGUOUS_Q_KV", q, k, v, cq, ck, sl, ql, kl, bmm1_scale=0.1, bmm2_scale=0.5,
                   out_dtype=out_dtype)
    assert out.dtype == out_dtype
    check(out.float(), q, k, v, ql, kl, out_dtype if out_dtype is E4M3 else BF16, scale1=0.1, scale2=0.5,
          what=str(out_dtype))


@pytest.mark.parametrize("sinks", [False, True])
def test_fmha_softmax_stats(sinks):
    ql, kl = [100, 3, 400], [100, 300, 400]
    q, k, v, cq, ck, sl = make_inputs(ql, kl, 8, 2, 128, BF16, seed=13)
    s = torch.randn(8, device=DEV, dtype=torch.float32) if sinks else None
    out, stats = run_fmha("CONTIGUOUS_Q_KV", q, k, v, cq, ck, sl, ql, kl, bmm1_scale=0.15, bmm2_scale=1.0,
                          save_softmax_stats=True, sinks=s)
    assert stats.shape == (sum(ql), 8, 2) and stats.dtype == torch.float32
    check(out, q, k, v, ql, kl, BF16, scale1=0.15, sinks=s, stats=stats, what="stats")


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("form", ["tensor", "tuple", "separate_ids"])
@pytest.mark.parametrize("tensor_scales", [False, True])
@pytest.mark.parametrize("host", [False, True], ids=["device_meta", "host_meta"])
def test_context(layout, form, tensor_scales, host, kv_load):
    ql, kl = [17, 256, 1], [300, 256, 64]
    q, k, v, cq, ck, sl = make_inputs(ql, kl, 8, 1, 128, BF16, seed=17)
    cache, table = page_cache(k, v, kl, 32, layout, seed=5)
    kv = (cache[:, 0], cache[:, 1]) if form == "tuple" else cache
    if form == "separate_ids":  # V's ids: another random permutation of V's pages
        perm = torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(3)).to(DEV)
        vcache = cache.clone()
        vcache[:, 1][perm.long()] = cache[:, 1]
        kv = cache = vcache
        table = torch.stack([table, perm[table.long()].to(torch.int32)], 1)
    if host:
        table, sl, cq, ck = (x.cpu().numpy() for x in (table, sl, cq, ck))
    s1, s2 = 0.08, 1.5
    if tensor_scales:
        s1, s2 = (torch.tensor([x], device=DEV, dtype=torch.float32) for x in (s1, s2))
    out = poisoned(q.shape, BF16)
    lse = torch.full((q.shape[0], 8), float("nan"), device=DEV)
    res = context(q, kv, workspace(), table, sl, max(ql),
                  max(kl), s1, s2, len(ql), cq, ck, window_left=100, out=out, kv_layout=layout, lse=lse,
                  uses_shared_paged_kv_idx=form != "separate_ids")
    assert res is out
    check(out, q, k, v, ql, kl, BF16, scale1=0.08, scale2=1.5, wl=100, what=f"context {layout} {form}")
    assert not torch.isnan(lse).any()


@pytest.mark.parametrize("layout", ["CONTIGUOUS_Q_KV", "Q_PAGED_KV_HND"])
def test_fmha_sinks_under_split_kv(layout):
    """One short query block over many keys, host metadata: the plan splits KV (asserted), and the
    sink is added once, where the merge finishes each row (device metadata never splits)."""
    from pyflashattn._engine import trtllm as _trtllm
    ql, kl = [16], [8000]
    q, k, v, cq, ck, sl = make_inputs(ql, kl, 8, 2, 128, BF16, seed=23)
    sinks = torch.randn(8, device=DEV, dtype=torch.float32) * 3
    out = poisoned(q.shape, BF16)
    run_fmha(layout, q, k, v, cq, ck, sl, ql, kl, bmm1_scale=0.1, bmm2_scale=1.0, out=out, sinks=sinks, host=True)
    engine = next(reversed(_trtllm._ENGINES.values()))
    assert engine.schedule.split, "the plan did not split KV: the case tests nothing"
    check(out, q, k, v, ql, kl, BF16, scale1=0.1, sinks=sinks, what=f"split sinks {layout}")
