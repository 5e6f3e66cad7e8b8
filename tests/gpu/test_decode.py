"""Decode APIs on a CUDA GPU (torch inputs) against the float64 reference: the batch decode
wrapper, single decode, XQA (block tables + device seq_lens), attention sinks (also in the
prefill wrappers), speculative decoding (causal and XQA's bit masks), CUDA graphs.

Every case draws fresh seeded random inputs; paged caches put each request's pages at random
page ids among garbage pages (random, larger, finite values), so a wrong page or a slot past a
request's length gives a wrong answer. Outputs go into NaN-poisoned buffers. Sinks: the
reference's (o, lse) with the sink's virtual key added, o * 2^(lse - lse'), lse' = log2(2^lse +
e^sink) (FlashInfer's sink_attention_reference: a softmax over [logits, sink] with the last
column dropped).
"""
from __future__ import annotations

import math
import types

import numpy as np
import pytest

from pyflashattn.testing.gpu import require_cuda_torch

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()

import pyflashattn  # noqa: E402
from pyflashattn import decode  # noqa: E402
from pyflashattn._engine import xqa as xqa_engine  # noqa: E402
from pyflashattn.testing import attention_ref, to_numpy_f64  # noqa: E402
from pyflashattn.testing.checks import assert_close  # noqa: E402
from pyflashattn.testing.gpu import scratch_workspace as _ws, cuda_generator as _gen, cuda_randn as _randn  # noqa: E402

DEV = "cuda"
F16, BF16 = torch.float16, torch.bfloat16
O_TOL = {F16: dict(atol=1e-3, rtol=1e-3), BF16: dict(atol=1e-2, rtol=1e-2)}
LSE_TOL = dict(atol=2e-3, rtol=1e-4)
FP8_O_TOL = dict(atol=2e-2, rtol=2e-2)
LOG2E = 1.4426950408889634


def _sink_ref(o, lse, sinks):
    """(o, lse) of rows [tokens, heads] with sinks [heads] (natural-log units) added."""
    s2 = np.asarray(sinks, np.float64)[None, :] * LOG2E
    new = np.logaddexp2(lse, s2)
    f = np.where(np.isneginf(lse), 0.0, np.exp2(lse - new))
    return o * f[..., None], new


class Paged:
    """A batch's K/V scattered into a paged cache among garbage pages."""

    def __init__(self, kv_lens, hkv, d, ps, layout, dtype, g, kv_dtype=None, spare=3):
        self.kv_lens, self.ps, self.layout = list(kv_lens), ps, layout
        kvdt = kv_dtype or dtype
        self.k = [_randn((n, hkv, d), g, torch.float32) for n in kv_lens]
        self.v = [_randn((n, hkv, d), g, torch.float32) for n in kv_lens]
        pages = [-(-n // ps) for n in kv_lens]
        total = sum(pages) + spare
        perm = torch.randperm(total, generator=torch.Generator().manual_seed(sum(kv_lens) + ps)).tolist()
        cache = _randn((total, 2, ps, hkv, d), g, torch.float32, 4.0)
        self.indices, self.indptr, self.table = [], [0], torch.zeros(len(kv_lens), max(max(pages), 1), dtype=torch.int32)
        for b, n in enumerate(kv_lens):
            ids = perm[:pages[b]]
            perm = perm[pages[b]:]
            self.indices += ids
            self.indptr.append(len(self.indices))
            self.table[b, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
            for j, pid in enumerate(ids):
                t0, t1 = j * ps, min(n, (j + 1) * ps)
                cache[pid, 0, :t1 - t0] = self.k[b][t0:t1]
                cache[pid, 1, :t1 - t0] = self.v[b][t0:t1]
        self.last = [n - (p - 1) * ps if p else 0 for n, p in zip(kv_lens, pages)]
        if layout == "HND":
            cache = cache.transpose(2, 3).contiguous()
        self.cache = cache.to(kvdt)
        # the reference reads exactly what the cache holds (rounded to its dtype)
        self.k = [x.to(kvdt).double() for x in self.k]
        self.v = [x.to(kvdt).double() for x in self.v]

    def args(self):
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
        return i32(self.indptr), i32(self.indices), i32(self.last)


def _refs(q, pg, q_len, hq, masks=None, sinks=None, k_scale=1.0, v_scale=1.0, **opts):
    """float64 (o, lse) of every request, concatenated on tokens."""
    os_, ls = [], []
    for b, n in enumerate(pg.kv_lens):
        qb = q[b * q_len:(b + 1) * q_len]
        o, lse = attention_ref(qb, pg.k[b] * k_scale, pg.v[b] * v_scale,
                               custom_mask=None if masks is None else masks[b], **opts)
        os_.append(o)
        ls.append(lse)
    o, lse = np.concatenate(os_), np.concatenate(ls)
    if sinks is not None:
        o, lse = _sink_ref(o, lse, to_numpy_f64(sinks).reshape(-1))
    return o, lse


def _check(o, lse, ref, dtype, what, o_tol=None):
    assert_close(to_numpy_f64(o), ref[0], what=f"{what} o", **(o_tol or O_TOL[dtype]))
    if lse is not None:
        assert_close(to_numpy_f64(lse), ref[1], what=f"{what} lse", **LSE_TOL)


# ---------------------------------------------------------------- batch decode wrapper
DECODE_CASES = [
    # name, kv_lens, hq, hkv, d, ps, layout, dtype, q_len, options
    ("g4-ps16", [1, 0, 37, 300, 1000], 32, 8, 128, 16, "NHD", BF16, 1, {}),
    ("g1-ps1-hnd", [5, 64, 129], 4, 4, 64, 1, "HND", F16, 1, {}),
    ("g5-ps64", [70, 3, 500], 10, 2, 128, 64, "NHD", F16, 1, {}),
    ("g8-d256", [33, 257], 16, 2, 256, 16, "HND", BF16, 1, {}),
    ("g16-ps32", [100, 2000], 32, 2, 128, 32, "NHD", BF16, 1, {}),
    ("g7", [45, 129], 7, 1, 64, 16, "NHD", F16, 1, {}),
    ("spec4-g4", [8, 50, 700], 16, 4, 128, 16, "NHD", BF16, 4, {}),
    ("window-softcap", [300, 90], 8, 2, 128, 16, "NHD", F16, 1, dict(window_left=40, logits_soft_cap=20.0)),
    ("rope-alibi", [120, 31], 8, 4, 64, 16, "HND", F16, 1, dict(pos_encoding_mode="ROPE_LLAMA")),
    ("alibi", [77, 200], 8, 8, 128, 16, "NHD", F16, 1, dict(pos_encoding_mode="ALIBI")),
    ("ps128-long", [4000, 1], 8, 2, 128, 128, "NHD", BF16, 1, {}),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_batch_decode_wrapper(case):
    name, kv_lens, hq, hkv, d, ps, layout, dtype, q_len, opts = case
    g = _gen("dec", name)
    pg = Paged(kv_lens, hkv, d, ps, layout, dtype, g)
    q = _randn((len(kv_lens) * q_len, hq, d), g, dtype)
    w = decode.BatchDecodeWithPagedKVCacheWrapper(_ws(), layout)
    w.plan(*pg.args(), hq, hkv, d, ps, q_data_type=dtype, q_len_per_req=q_len, **opts)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], hq), float("nan"), device=DEV)
    sinks = torch.randn(hq, generator=g, device=DEV) if name.startswith("g4") else None
    res = w.run(q, pg.cache, out=out, lse=lse, sinks=sinks)
    assert res is out
    ref = _refs(q, pg, q_len, hq, sinks=sinks, causal=q_len > 1, kv_layout="NHD", **opts)
    _check(out, lse, ref, dtype, name, O_TOL[dtype] if "rope" not in name else dict(atol=2e-3, rtol=2e-3))
    o2, l2 = w.run_return_lse(q, pg.cache)  # allocated outputs; sinks cleared
    ref2 = _refs(q, pg, q_len, hq, causal=q_len > 1, kv_layout="NHD", **opts)
    _check(o2, l2, ref2, dtype, name + " (no sinks)",
           O_TOL[dtype] if "rope" not in name else dict(atol=2e-3, rtol=2e-3))


def test_batch_decode_fp8_scales_and_tuple_cache():
    g = _gen("fp8")
    pg = Paged([10, 333, 1200], 4, 128, 16, "NHD", BF16, g, kv_dtype=torch.float8_e4m3fn)
    q = _randn((3, 16, 128), g, BF16)
    w = decode.BatchDecodeWithPagedKVCacheWrapper(_ws(), "NHD", use_tensor_cores=True)
    w.plan(*pg.args(), 16, 4, 128, 16, q_data_type=BF16, kv_data_type=torch.float8_e4m3fn)
    kc, vc = pg.cache[:, 0], pg.cache[:, 1]
    o = w.run(q, (kc, vc), q_scale=0.5, k_scale=0.8, v_scale=1.7)
    ref = _refs(q, pg, 1, 16, k_scale=0.4, v_scale=1.7)
    _check(o, None, ref, BF16, "fp8 decode", FP8_O_TOL)


def test_batch_decode_block_tables_plan_and_graph():
    g = _gen("graph")
    pg = Paged([100, 7, 600, 1], 8, 64, 16, "NHD", F16, g, spare=40)
    q = _randn((4, 32, 64), g, F16)
    B, cap_pages = 4, 200
    bufs = [torch.zeros(B + 1, dtype=torch.int32, device=DEV), torch.zeros(cap_pages, dtype=torch.int32, device=DEV),
            torch.zeros(B, dtype=torch.int32, device=DEV)]
    w = decode.BatchDecodeWithPagedKVCacheWrapper(_ws(), "NHD", True, False, *bufs)
    lens = torch.tensor(pg.kv_lens, dtype=torch.int32)
    w.plan(None, None, None, 32, 8, 64, 16, q_data_type=F16, block_tables=pg.table.numpy(), seq_lens=lens.numpy())
    out = torch.empty_like(q)
    w.run(q, pg.cache, out=out)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q, pg.cache, out=out)
    pg2 = pg
    pg2.kv_lens = [90, 5, 599, 0]  # shorter only: the cache holds each request's first kv_lens tokens
    pg2.k = [x[:n] for x, n in zip(pg.k, pg2.kv_lens)]
    pg2.v = [x[:n] for x, n in zip(pg.v, pg2.kv_lens)]
    w.plan(None, None, None, 32, 8, 64, 16, q_data_type=F16, block_tables=pg.table.numpy(),
           seq_lens=np.array(pg2.kv_lens, np.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, None, _refs(q, pg2, 1, 32), F16, "graph replay after re-plan")


# ---------------------------------------------------------------- split-KV merge forms
@pytest.mark.parametrize("cta", ["1", "0"], ids=["cta_per_row", "warp_per_row"])
@pytest.mark.parametrize("d,dtype", [(64, F16), (128, BF16), (256, F16)])
@pytest.mark.parametrize("kv_lens,fss,window", [
    ([5000], 32, -1),         # 157 chunks (hd64: 79): 40 a warp in the CTA form, past one 32-chunk weight word
    ([0, 3000], 256, -1),     # two requests, one empty; 12 chunks
    ([70], 32, -1),           # 3 chunks: fewer than the CTA's warps
    ([2500, 900], 64, 100),   # a window: most chunks hold no visible key (lse = -inf partials)
], ids=["one-157chunks", "two-12chunks", "one-3chunks", "two-window"])
def test_split_merge_forms(monkeypatch, cta, d, dtype, kv_lens, fss, window):
    """Few rows over many KV chunks, merged by either merge kernel (PYFLASHATTN_MERGE_CTA_PER_ROW
    forces one at plan time); o and lse against float64, with sinks on the first request set."""
    monkeypatch.setenv("PYFLASHATTN_MERGE_CTA_PER_ROW", cta)
    hq, hkv, ps = 16, 4, 16
    g = _gen("merge", cta, d, len(kv_lens), fss)
    pg = Paged(kv_lens, hkv, d, ps, "NHD", dtype, g)
    q = _randn((len(kv_lens), hq, d), g, dtype)
    w = decode.BatchDecodeWithPagedKVCacheWrapper(_ws(), "NHD")
    w.plan(*pg.args(), hq, hkv, d, ps, q_data_type=dtype, fixed_split_size=fss, window_left=window)
    assert w._engine.merge is not None and bool(w._engine.merge.meta["cta_per_row"]) == (cta == "1")
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], hq), float("nan"), device=DEV)
    sinks = torch.randn(hq, generator=g, device=DEV) if fss == 32 else None
    w.run(q, pg.cache, out=out, lse=lse, sinks=sinks)
    ref = _refs(q, pg, 1, hq, sinks=sinks, window_left=window)
    _check(out, lse, ref, dtype, f"merge cta_per_row={cta}")


# ---------------------------------------------------------------- fp8 widening
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_widening_is_exact_for_every_code(fmt, dtype, d):
    """Every fp8 code but the Inf/NaN encodings, widened by the decode tiles: one key a request, so
    o is exactly its V row (bit for bit) and the LSE its logit over K's codes (in another order)."""
    fp8 = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    codes = torch.arange(256, dtype=torch.int32)
    special = (codes & 0x7F) == 0x7F if fmt == "e4m3" else (codes & 0x7C) == 0x7C
    codes = torch.where(special, torch.zeros_like(codes), codes).to(torch.uint8)
    B, ps = 256 // d, 16
    raw = torch.zeros(B + 1, 2, ps, 1, d, dtype=torch.uint8)  # page 0 unused
    for b in range(B):
        raw[b + 1, 0, 0, 0] = codes.roll(37)[b * d:(b + 1) * d]
        raw[b + 1, 1, 0, 0] = codes[b * d:(b + 1) * d]
    cache = raw.to(DEV).view(fp8)
    k = [cache[b + 1, 0, :1].float().double() for b in range(B)]  # [1, 1, d]: exact
    v = [cache[b + 1, 1, :1].float().double() for b in range(B)]
    g = _gen("fp8-codes", fmt, str(dtype), d)
    q = _randn((B, 1, d), g, dtype, 1e-3)  # e5m2 keys reach 57344: keep the logits moderate
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
    w = decode.BatchDecodeWithPagedKVCacheWrapper(_ws(), "NHD")
    w.plan(i32(list(range(B + 1))), i32(list(range(1, B + 1))), i32([1] * B), 1, 1, d, ps, q_data_type=dtype,
           kv_data_type=fp8)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, 1), float("nan"), device=DEV)
    w.run(q, cache, out=out, lse=lse)
    want = torch.stack([x[0] for x in v]).to(DEV)  # [B, 1, d]
    assert torch.equal(out.double(), want), f"{fmt} -> {dtype}: a widened V code differs"
    ref_lse = np.concatenate([attention_ref(q[b:b + 1], k[b], v[b])[1] for b in range(B)])
    assert_close(to_numpy_f64(lse), ref_lse, what=f"{fmt} -> {dtype} lse", **LSE_TOL)


# ---------------------------------------------------------------- single decode
@pytest.mark.parametrize("layout,d,hq,hkv,n,opts", [
    ("NHD", 128, 32, 8, 5000, {}),
    ("HND", 64, 6, 3, 1, {}),
    ("NHD", 256, 16, 16, 777, dict(window_left=100)),
    ("NHD", 128, 8, 1, 300, dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=5e5)),
    ("HND", 128, 8, 2, 400, dict(logits_soft_cap=10.0, sm_scale=0.05)),
])
def test_single_decode(layout, d, hq, hkv, n, opts):
    g = _gen("single", layout, d, n)
    q = _randn((hq, d), g, F16)
    shape = (n, hkv, d) if layout == "NHD" else (hkv, n, d)
    k, v = _randn(shape, g, F16), _randn(shape, g, F16)
    o, lse = decode.single_decode_with_kv_cache(q, k, v, layout, return_lse=True, q_scale=0.9, k_scale=1.1,
                                                v_scale=0.7, **opts)
    assert o.shape == (hq, d) and lse.shape == (hq,)
    sm = opts.pop("sm_scale", 1 / math.sqrt(d)) * 0.99
    ro, rl = attention_ref(q[None], k, v, kv_layout=layout, sm_scale=sm, **opts)
    tol = dict(atol=2e-3, rtol=2e-3) if opts.get("pos_encoding_mode") else O_TOL[F16]
    _check(o, lse, (ro[0] * 0.7, rl[0]), F16, "single decode", tol)


# ---------------------------------------------------------------- XQA
XQA_CASES = [
    # name, kv_lens, hq, hkv, d, ps, layout, dtype, q_len, mask kind, cache form
    ("ps16-g4", [1, 0, 300, 1000], 32, 8, 128, 16, "NHD", BF16, 1, None, "5d"),
    ("ps1-g1-hnd", [64, 3], 4, 4, 64, 1, "HND", F16, 1, None, "tuple"),
    ("ps32-g5", [500, 33], 10, 2, 128, 32, "NHD", F16, 1, None, "5d"),
    ("ps64-d256-g8", [129, 700], 16, 2, 256, 64, "HND", BF16, 1, None, "5d"),
    ("ps128-g16", [2000, 1], 16, 1, 64, 128, "NHD", F16, 1, None, "tuple"),
    ("spec4-causal", [40, 300], 16, 4, 128, 16, "NHD", BF16, 4, None, "5d"),
    ("spec4-mask", [40, 300, 9], 16, 4, 128, 16, "NHD", F16, 4, "random", "5d"),
    ("spec40-mask", [200, 95], 8, 8, 64, 16, "NHD", F16, 40, "random", "tuple"),
    ("spec8-g4-mask", [300, 2500, 8], 32, 8, 128, 16, "NHD", BF16, 8, "random", "5d"),
    ("spec16-g4-d64-mask", [700, 16], 16, 4, 64, 16, "HND", F16, 16, "random", "tuple"),
]


def _spec_masks(q_len, kv_lens, g):
    """XQA masks (uint16 [B, q_len, 2W]) and the reference's bool masks [q_len, kv_len]."""
    words = -(-q_len // 32)
    bits = torch.rand((len(kv_lens), q_len, q_len), generator=g, device=DEV) < 0.6
    bits |= torch.eye(q_len, dtype=torch.bool, device=DEV)[None]
    packed = np.zeros((len(kv_lens), q_len, words), np.uint32)
    bn = bits.cpu().numpy()
    for j in range(q_len):
        packed[:, :, j // 32] |= bn[:, :, j].astype(np.uint32) << np.uint32(j % 32)
    mask = torch.from_numpy(packed.view(np.uint16).copy()).to(DEV)
    refs = []
    for b, n in enumerate(kv_lens):
        m = np.ones((q_len, n), bool)
        m[:, n - q_len:] = bn[b]
        refs.append(m)
    return mask, refs


@pytest.mark.parametrize("case", XQA_CASES, ids=[c[0] for c in XQA_CASES])
def test_xqa(case):
    name, kv_lens, hq, hkv, d, ps, layout, dtype, q_len, mask_kind, form = case
    g = _gen("xqa", name)
    kv_lens = [n if q_len == 1 else max(n, q_len) for n in kv_lens]
    pg = Paged(kv_lens, hkv, d, ps, layout, dtype, g)
    B = len(kv_lens)
    q = _randn((B * q_len, hq, d), g, dtype)
    # strided block tables: rows padded by 3 entries
    bt = torch.zeros(B, pg.table.shape[1] + 3, dtype=torch.int32)
    bt[:, :pg.table.shape[1]] = pg.table
    bt = bt.to(DEV)[:, :pg.table.shape[1]]
    seq = torch.tensor(kv_lens, dtype=torch.int32, device=DEV)
    seq = seq.to(torch.uint32) if hasattr(torch, "uint32") and "g4" in name else seq
    mask, masks = _spec_masks(q_len, kv_lens, g) if mask_kind else (None, None)
    sinks = torch.randn(hkv, hq // hkv, generator=g, device=DEV) if "g5" in name or "mask" in name else None
    cache = (pg.cache[:, 0], pg.cache[:, 1]) if form == "tuple" else pg.cache
    out = torch.full_like(q, float("nan"))
    bmm1 = 0.7 / math.sqrt(d)
    res = decode.xqa_batch_decode_with_kv_cache(q, cache, _ws(), bt, seq, max(kv_lens), bmm1_scale=bmm1,
                                                bmm2_scale=1.3, out=out, sinks=sinks, kv_layout=layout,
                                                q_len_per_req=q_len, mask=mask, enable_pdl=True)
    assert res is out
    ref = _refs(q, pg, q_len, hq, masks=masks, sinks=sinks, v_scale=1.3, sm_scale=bmm1,
                causal=q_len > 1 and masks is None)
    _check(out, None, ref, dtype, name)


@pytest.mark.parametrize("general", ["0", "1"], ids=["decode_tile", "general"])
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_xqa_spec_mask_on_either_kernel(monkeypatch, general, kv_dtype):
    """An 8-token draft mask at GQA 4 (32 packed rows): on the lean paged decode tile that honours
    it, or on the general kernel (PYFLASHATTN_XQA_SPEC_GENERAL=1); long requests split KV."""
    monkeypatch.setenv("PYFLASHATTN_XQA_SPEC_GENERAL", general)
    xqa_engine._ENGINES.clear()  # XQA caches a plan per shape, whatever the switch said then
    xqa_engine._FAST.clear()
    q_len, hq, hkv, d, ps = 8, 32, 8, 128, 16
    kv_lens = [5000, 64, 1500]
    g = _gen("xqa-spec", general, str(kv_dtype))
    pg = Paged(kv_lens, hkv, d, ps, "NHD", BF16, g, kv_dtype=kv_dtype)
    q = _randn((len(kv_lens) * q_len, hq, d), g, BF16)
    mask, masks = _spec_masks(q_len, kv_lens, g)
    seq = torch.tensor(kv_lens, dtype=torch.int32, device=DEV)
    out = torch.full_like(q, float("nan"))
    bmm1 = 1 / math.sqrt(d)
    decode.xqa_batch_decode_with_kv_cache(q, pg.cache, _ws(), pg.table.to(DEV), seq, max(kv_lens), bmm1_scale=bmm1,
                                          out=out, q_len_per_req=q_len, mask=mask)
    (e,) = [e for e in xqa_engine._ENGINES.values() if e.shape[0] == q.shape[0]]
    assert e.attn.meta["general"] == (general == "1") and e.attn.meta["block_m"] == (128 if general == "1" else 32)
    xqa_engine._ENGINES.clear()
    xqa_engine._FAST.clear()
    ref = _refs(q, pg, q_len, hq, masks=masks, sm_scale=bmm1)
    _check(out, None, ref, BF16, f"spec mask general={general} {kv_dtype}", FP8_O_TOL if kv_dtype else None)


def test_xqa_device_scales_fp8_and_graph():
    g = _gen("xqa-graph")
    pg = Paged([700, 20, 1500], 8, 128, 16, "NHD", BF16, g, kv_dtype=torch.float8_e4m3fn)
    q = _randn((3, 32, 128), g, BF16)
    bt = pg.table.to(DEV)
    seq = torch.tensor(pg.kv_lens, dtype=torch.int32, device=DEV)
    s1 = torch.tensor([0.05], device=DEV)
    s2 = torch.tensor([0.9], device=DEV)
    out = torch.empty_like(q)
    call = lambda: decode.xqa_batch_decode_with_kv_cache(q, pg.cache, _ws(), bt, seq, 1500, bmm1_scale=s1,  # noqa
                                                          bmm2_scale=s2, out=out)
    call()
    _check(out, None, _refs(q, pg, 1, 32, sm_scale=0.05, v_scale=0.9), BF16, "xqa fp8 device scales", FP8_O_TOL)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    seq.copy_(torch.tensor([650, 1, 1499], dtype=torch.int32))
    s1.fill_(0.08)
    s2.fill_(1.2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    pg.kv_lens = [650, 1, 1499]
    pg.k = [x[:n] for x, n in zip(pg.k, pg.kv_lens)]
    pg.v = [x[:n] for x, n in zip(pg.v, pg.kv_lens)]
    _check(out, None, _refs(q, pg, 1, 32, sm_scale=0.08, v_scale=1.2), BF16, "xqa graph replay", FP8_O_TOL)


def test_xqa_bad_page_ids_stay_inside_and_checked_mode(monkeypatch):
    g = _gen("xqa-bad")
    pg = Paged([100, 50], 2, 64, 16, "NHD", F16, g)
    q = _randn((2, 4, 64), g, F16)
    bt = pg.table.to(DEV)
    bt[0, 1] = 10**6
    bt[1, 0] = -5
    seq = torch.tensor(pg.kv_lens, dtype=torch.int32, device=DEV)
    o = decode.xqa_batch_decode_with_kv_cache(q, pg.cache, _ws(), bt, seq, 100, bmm1_scale=0.125)
    torch.cuda.synchronize()  # no fault: ids were clamped into the cache
    assert torch.isfinite(o).all()
    monkeypatch.setenv("PYFLASHATTN_CHECK_METADATA", "1")
    with pytest.raises(ValueError, match="block_tables"):
        decode.xqa_batch_decode_with_kv_cache(q, pg.cache, _ws(), bt, seq, 100)
    with pytest.raises(ValueError, match="seq_lens"):
        decode.xqa_batch_decode_with_kv_cache(q, pg.cache, _ws(), pg.table.to(DEV), seq + 1, 100)
    monkeypatch.delenv("PYFLASHATTN_CHECK_METADATA")
    o = decode.xqa_batch_decode_with_kv_cache(q, pg.cache, _ws(), pg.table.to(DEV), seq, 100, bmm1_scale=0.125)
    _check(o, None, _refs(q, pg, 1, 4, sm_scale=0.125), F16, "after errors")


def test_xqa_interop_cupy_and_jax():
    cp = pytest.importorskip("cupy")
    g = _gen("xqa-interop")
    pg = Paged([90, 200], 2, 128, 16, "NHD", F16, g)
    q = _randn((2, 8, 128), g, F16)
    bt, seq = pg.table.to(DEV), torch.tensor(pg.kv_lens, dtype=torch.int32, device=DEV)
    ref = _refs(q, pg, 1, 8, sm_scale=1.0)  # XQA's bmm1_scale defaults to 1.0 (not 1/sqrt(D))
    args = [q, pg.cache, _ws(), bt, seq]
    o = decode.xqa_batch_decode_with_kv_cache(*[cp.from_dlpack(a) for a in args], 200)
    assert isinstance(o, cp.ndarray)
    _check(torch.from_dlpack(o), None, ref, F16, "xqa cupy")
    jax = pytest.importorskip("jax")
    torch.cuda.synchronize()  # JAX's imports of the torch tensors are not ordered on torch's stream
    o = decode.xqa_batch_decode_with_kv_cache(*[jax.dlpack.from_dlpack(a) for a in args], 200)
    _check(torch.from_dlpack(o), None, ref, F16, "xqa jax")
    # a [P, 1, ...] cache (K and V share the pages): a JAX array's half is a view, not a JAX slice;
    # torch's result (into a poisoned out) against the reference with V = K, JAX's bit for bit with it
    shared = pg.cache[:, :1].contiguous()
    want = decode.xqa_batch_decode_with_kv_cache(q, shared, _ws(), bt, seq, 200,
                                                 out=torch.full_like(q, float("nan")))
    _check(want, None, _refs(q, types.SimpleNamespace(kv_lens=pg.kv_lens, k=pg.k, v=pg.k), 1, 8, sm_scale=1.0), F16,
           "xqa [P, 1] cache")
    torch.cuda.synchronize()
    got = decode.xqa_batch_decode_with_kv_cache(*[jax.dlpack.from_dlpack(a) for a in (q, shared, _ws(), bt, seq)],
                                                200)
    assert torch.equal(torch.from_dlpack(got), want), "jax and torch differ on a [P, 1, ...] cache"


# ---------------------------------------------------------------- sinks in the prefill wrappers
def test_prefill_wrapper_sinks_split_and_unsplit():
    g = _gen("prefill-sinks")
    pg = Paged([3000, 17, 0], 4, 128, 16, "NHD", BF16, g)
    qo = [5, 17, 2]
    q = _randn((sum(qo), 16, 128), g, BF16)
    sinks = torch.randn(16, generator=g, device=DEV) * 2
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
    for fss in (None, 256):  # one chunk per request, and split KV (sinks in the merge)
        w = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(_ws(), "NHD")
        w.plan(i32([0, 5, 22, 24]), *pg.args(), 16, 4, 128, 16, causal=True, q_data_type=BF16,
               fixed_split_size=fss)
        o, lse = w.run(q, pg.cache, sinks=sinks, return_lse=True)
        os_, ls = [], []
        r0 = 0
        for b, n in enumerate(qo):
            ro, rl = attention_ref(q[r0:r0 + n], pg.k[b], pg.v[b], causal=True)
            os_.append(ro)
            ls.append(rl)
            r0 += n
        ref = _sink_ref(np.concatenate(os_), np.concatenate(ls), sinks.cpu().numpy())
        _check(o, lse, ref, BF16, f"prefill sinks fss={fss}")
