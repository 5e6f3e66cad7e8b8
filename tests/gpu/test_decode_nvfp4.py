"""NVFP4 KV cache on a CUDA GPU (torch inputs) against the float64 reference of the dequantised
cache: the decode wrapper, XQA and the prefill paged wrapper with kv_cache_sf.

Every case draws fresh seeded random codes over all 16 e2m1 codes (negative ones and -0 too,
which FlashInfer's own tests never generate) and random e4m3 block scales (mostly 1/16 .. 1/2,
some subnormal, some zero); each request's pages sit at random page ids among garbage pages
(random codes with larger scales), so a wrong page, slot, nibble order or scale row gives a wrong
answer. The reference attends over exactly e2m1 * scale (pyflashattn.testing.nvfp4.dequantize,
the kernels' own values: the product is exact in fp16 and bf16) times the global scales, which
the API folds into k_scale / bmm1_scale and v_scale / bmm2_scale. Outputs (and LSE) go into
NaN-poisoned buffers. Page sizes 1 / 16 / 64, GQA 1 / 4 / 8, head dims 64 / 128 / 256, split-KV
forced (8k keys) and disabled, one-token and speculative (several-token) requests.
"""
from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from pyflashattn.testing.gpu import require_cuda_torch

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()

import pyflashattn  # noqa: E402
from pyflashattn import decode  # noqa: E402
from pyflashattn._engine import xqa as _xqa  # noqa: E402
from pyflashattn.testing import attention_ref, nvfp4, to_numpy_f64  # noqa: E402
from pyflashattn.testing.checks import assert_close  # noqa: E402
from pyflashattn.testing.gpu import scratch_workspace as _ws  # noqa: E402

DEV = "cuda"
F16, BF16 = torch.float16, torch.bfloat16
O_TOL = {F16: dict(atol=1e-3, rtol=1e-3), BF16: dict(atol=1e-2, rtol=1e-2)}
LSE_TOL = dict(atol=2e-3, rtol=1e-4)
K_GLOBAL, V_GLOBAL = 0.37, 1.3  # the quantiser's global scales (K's into the logit scale, V's into the output)


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _scales(rng, shape, garbage=False):
    """e4m3 scale bits: 1/16 .. 1/2, with ~5% subnormal and ~2% zero scales (garbage: up to 8)."""
    if garbage:
        return nvfp4.random_scales(rng, shape, 0.5, 8.0)
    sf = nvfp4.random_scales(rng, shape, 2.0**-4, 0.5)
    pick = rng.random(shape)
    sf = np.where(pick < 0.05, rng.integers(1, 8, shape), sf)  # 0x01 .. 0x07: subnormal e4m3
    return np.where(pick > 0.98, 0, sf).astype(np.uint8)


class Nvfp4Paged:
    """A batch's NVFP4 K/V scattered into a paged cache (codes [P, 2, ...D/2] and scales
    [P, 2, ...D/16]) among garbage pages; k / v: the dequantised float64 rows of each request."""

    def __init__(self, kv_lens, hkv, d, ps, layout, rng, spare=3):
        self.kv_lens, self.ps, self.layout = list(kv_lens), ps, layout
        pages = [-(-n // ps) for n in kv_lens]
        total = sum(pages) + spare
        codes = nvfp4.random_codes(rng, (total, 2, ps, hkv, d // 2))
        sf = _scales(rng, (total, 2, ps, hkv, d // 16), garbage=True)
        perm = rng.permutation(total).tolist()
        self.k, self.v, self.indices, self.indptr = [], [], [], [0]
        self.table = np.zeros((len(kv_lens), max(max(pages), 1)), np.int32)
        for b, n in enumerate(kv_lens):
            kc, vc = nvfp4.random_codes(rng, (n, hkv, d // 2)), nvfp4.random_codes(rng, (n, hkv, d // 2))
            ks, vs = _scales(rng, (n, hkv, d // 16)), _scales(rng, (n, hkv, d // 16))
            self.k.append(nvfp4.dequantize(kc, ks))
            self.v.append(nvfp4.dequantize(vc, vs))
            ids, perm = perm[:pages[b]], perm[pages[b]:]
            self.indices += ids
            self.indptr.append(len(self.indices))
            self.table[b, :len(ids)] = ids
            for j, pid in enumerate(ids):
                t0, t1 = j * ps, min(n, (j + 1) * ps)
                codes[pid, 0, :t1 - t0], codes[pid, 1, :t1 - t0] = kc[t0:t1], vc[t0:t1]
                sf[pid, 0, :t1 - t0], sf[pid, 1, :t1 - t0] = ks[t0:t1], vs[t0:t1]
        self.last = [n - (p - 1) * ps if p else 0 for n, p in zip(kv_lens, pages)]
        if layout == "HND":
            codes, sf = codes.transpose(0, 1, 3, 2, 4), sf.transpose(0, 1, 3, 2, 4)
        self.codes = torch.from_numpy(np.ascontiguousarray(codes)).to(DEV)
        self.sf = torch.from_numpy(np.ascontiguousarray(sf)).to(DEV).view(torch.float8_e4m3fn)
        assert (codes & 0x8).any() and (codes & 0x80).any()  # negative codes in both nibbles

    def args(self):
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
        return i32(self.indptr), i32(self.indices), i32(self.last)

    def form(self, kind):
        """(cache, kv_cache_sf) as one tensor [P, 2, ...] or as (k, v) tuples."""
        if kind == "tuple":
            return (self.codes[:, 0], self.codes[:, 1]), (self.sf[:, 0], self.sf[:, 1])
        return self.codes, self.sf


def _refs(q, pg, q_len, causal, sm_scale):
    """float64 (o, lse) of every request over the dequantised cache times the global scales."""
    os_, ls = [], []
    for b in range(len(pg.kv_lens)):
        o, lse = attention_ref(q[b * q_len:(b + 1) * q_len], pg.k[b] * K_GLOBAL, pg.v[b] * V_GLOBAL, causal=causal,
                               sm_scale=sm_scale)
        os_.append(o)
        ls.append(lse)
    return np.concatenate(os_), np.concatenate(ls)


def _check(o, lse, ref, dtype, what):
    assert_close(to_numpy_f64(o), ref[0], what=f"{what} o", **O_TOL[dtype])
    if lse is not None:
        assert_close(to_numpy_f64(lse), ref[1], what=f"{what} lse", **LSE_TOL)


# ---------------------------------------------------------------- the decode wrapper
DECODE_CASES = [
    # name, kv_lens, hq, hkv, d, page_size, layout, dtype, q_len, split ("auto", "forced", "off"), cache form
    ("ps16-g4-d128", [1, 0, 37, 300, 1000], 32, 8, 128, 16, "NHD", BF16, 1, "auto", "5d"),
    ("ps1-g1-d64-hnd-nosplit", [5, 64, 129], 4, 4, 64, 1, "HND", F16, 1, "off", "5d"),
    ("ps64-g8-d256", [33, 257, 700], 16, 2, 256, 64, "NHD", BF16, 1, "auto", "tuple"),
    ("ps16-g8-d128-split8k", [8192, 3], 16, 2, 128, 16, "HND", F16, 1, "forced", "5d"),
    ("ps64-g1-d256-split8k", [8000], 4, 4, 256, 64, "NHD", F16, 1, "forced", "tuple"),
    ("ps1-g4-d64-split8k", [8192, 100], 8, 2, 64, 1, "NHD", BF16, 1, "forced", "5d"),
    ("ps16-g4-d256-nosplit8k", [8192], 8, 2, 256, 16, "NHD", BF16, 1, "off", "5d"),
    ("spec4-g8-d128", [40, 300, 9], 16, 2, 128, 16, "NHD", BF16, 4, "auto", "5d"),  # 32 packed rows
    ("spec8-g8-d64-split", [64, 5000], 16, 2, 64, 16, "HND", F16, 8, "forced", "tuple"),  # 64 rows
    ("spec4-g8-d256", [50, 600], 16, 2, 256, 16, "NHD", F16, 4, "auto", "5d"),  # 32 rows as two 16-row tiles
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode_wrapper_nvfp4(case):
    name, kv_lens, hq, hkv, d, ps, layout, dtype, q_len, split, form = case
    rng = _rng("dec", name)
    kv_lens = [max(n, q_len) for n in kv_lens] if q_len > 1 else kv_lens  # drafts within their request
    pg = Nvfp4Paged(kv_lens, hkv, d, ps, layout, rng)
    q = torch.from_numpy(rng.standard_normal((len(kv_lens) * q_len, hq, d))).to(DEV, dtype)
    w = decode.BatchDecodeWithPagedKVCacheWrapper(_ws(), layout)
    w.plan(*pg.args(), hq, hkv, d, ps, q_data_type=dtype, kv_data_type=torch.uint8, q_len_per_req=q_len,
           fixed_split_size=1024 if split == "forced" else None, disable_split_kv=split == "off")
    e = w._engine
    assert e.attn.meta["kv_dtype"] == "nvfp4" and e.attn.meta["decode"]
    if split == "forced":
        assert e.merge is not None and e.schedule.split, "the plan was meant to split the KV"
    elif split == "off":
        assert e.merge is None
    cache, sf = pg.form(form)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], hq), float("nan"), device=DEV)
    res = w.run(q, cache, kv_cache_sf=sf, k_scale=K_GLOBAL, v_scale=V_GLOBAL, out=out, lse=lse)
    assert res is out
    ref = _refs(q, pg, q_len, q_len > 1, 1 / math.sqrt(d))
    _check(out, lse, ref, dtype, name)
    o2, l2 = w.run_return_lse(q, cache, kv_cache_sf=sf, k_scale=K_GLOBAL, v_scale=V_GLOBAL)  # allocated outputs
    _check(o2, l2, ref, dtype, name + " (allocated)")


# ---------------------------------------------------------------- XQA
XQA_CASES = [
    # name, kv_lens, hq, hkv, d, page_size, layout, dtype, q_len, cache form
    ("ps16-g4-d128", [1, 0, 300, 1000], 32, 8, 128, 16, "NHD", BF16, 1, "5d"),
    ("ps1-g1-d64-hnd", [64, 3], 4, 4, 64, 1, "HND", F16, 1, "tuple"),
    ("ps64-g8-d256-hnd", [129, 700], 16, 2, 256, 64, "HND", BF16, 1, "5d"),
    ("ps16-g8-d64-split8k", [8192], 16, 2, 64, 16, "NHD", F16, 1, "5d"),
    ("ps64-g4-d128-split8k", [8192, 20], 16, 4, 128, 64, "NHD", BF16, 1, "tuple"),
    ("ps1-g8-d256-split8k", [8100], 8, 1, 256, 1, "NHD", F16, 1, "5d"),
    ("spec4-causal-g4", [40, 300], 16, 4, 128, 16, "NHD", BF16, 4, "5d"),
]


@pytest.mark.parametrize("case", XQA_CASES, ids=[c[0] for c in XQA_CASES])
def test_xqa_nvfp4(case):
    name, kv_lens, hq, hkv, d, ps, layout, dtype, q_len, form = case
    rng = _rng("xqa", name)
    kv_lens = [max(n, q_len) for n in kv_lens] if q_len > 1 else kv_lens  # drafts within their request
    pg = Nvfp4Paged(kv_lens, hkv, d, ps, layout, rng)
    B = len(kv_lens)
    q = torch.from_numpy(rng.standard_normal((B * q_len, hq, d))).to(DEV, dtype)
    bt = torch.from_numpy(pg.table).to(DEV)
    seq = torch.tensor(kv_lens, dtype=torch.int32, device=DEV)
    cache, sf = pg.form(form)
    out = torch.full_like(q, float("nan"))
    sm_scale = 0.8 / math.sqrt(d)
    res = decode.xqa_batch_decode_with_kv_cache(q, cache, _ws(), bt, seq, max(kv_lens), bmm1_scale=sm_scale * K_GLOBAL,
                                                bmm2_scale=V_GLOBAL, out=out, kv_layout=layout, q_len_per_req=q_len,
                                                kv_cache_sf=sf, enable_pdl=True)
    assert res is out
    e = next(reversed(_xqa._ENGINES.values()))
    assert e.attn.meta["kv_dtype"] == "nvfp4"
    if "split" in name:
        assert e.merge is not None and e.schedule.split, "a long request on few CTAs was meant to split"
    _check(out, None, _refs(q, pg, q_len, q_len > 1, sm_scale), dtype, name)


def test_xqa_nvfp4_device_scales_and_graph_replay():
    """Tensor bmm1 / bmm2 scales and new seq_lens seen by a replayed CUDA graph."""
    rng = _rng("xqa-graph")
    pg = Nvfp4Paged([700, 20, 1500], 8, 128, 16, "NHD", rng)
    q = torch.from_numpy(rng.standard_normal((3, 32, 128))).to(DEV, BF16)
    bt = torch.from_numpy(pg.table).to(DEV)
    seq = torch.tensor(pg.kv_lens, dtype=torch.int32, device=DEV)
    s1 = torch.tensor([0.05 * K_GLOBAL], device=DEV)
    s2 = torch.tensor([V_GLOBAL], device=DEV)
    out = torch.empty_like(q)

    def call():
        return decode.xqa_batch_decode_with_kv_cache(q, pg.codes, _ws(), bt, seq, 1500, bmm1_scale=s1, bmm2_scale=s2,
                                                     out=out, kv_cache_sf=pg.sf)

    call()
    _check(out, None, _refs(q, pg, 1, False, 0.05), BF16, "xqa nvfp4 device scales")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    seq.copy_(torch.tensor([650, 1, 1499], dtype=torch.int32))
    s1.fill_(0.08 * K_GLOBAL)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    pg.kv_lens = [650, 1, 1499]
    pg.k = [x[:n] for x, n in zip(pg.k, pg.kv_lens)]
    pg.v = [x[:n] for x, n in zip(pg.v, pg.kv_lens)]
    _check(out, None, _refs(q, pg, 1, False, 0.08), BF16, "xqa nvfp4 graph replay")


# ---------------------------------------------------------------- the prefill paged wrapper
@pytest.mark.parametrize("d", [64, 128, 256])
def test_prefill_paged_wrapper_nvfp4_causal(d):
    """Prefill-sized requests run as several decode-tile row tiles (no 128-row NVFP4 kernel)."""
    rng = _rng("prefill", d)
    kv_lens, qo = [300, 17, 2000], [37, 17, 1]
    pg = Nvfp4Paged(kv_lens, 2, d, 16, "NHD", rng)
    q = torch.from_numpy(rng.standard_normal((sum(qo), 8, d))).to(DEV, F16)
    w = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(_ws(), "NHD")
    qo_indptr = torch.tensor(np.concatenate([[0], np.cumsum(qo)]), dtype=torch.int32, device=DEV)
    w.plan(qo_indptr, *pg.args(), 8, 2, d, 16, causal=True, q_data_type=F16, kv_data_type=torch.uint8)
    out = torch.full_like(q, float("nan"))
    o, lse = w.run(q, pg.codes, kv_cache_sf=pg.sf, k_scale=K_GLOBAL, v_scale=V_GLOBAL, out=out, return_lse=True)
    os_, ls, r0 = [], [], 0
    for b, n in enumerate(qo):
        ro, rl = attention_ref(q[r0:r0 + n], pg.k[b] * K_GLOBAL, pg.v[b] * V_GLOBAL, causal=True)
        os_.append(ro)
        ls.append(rl)
        r0 += n
    _check(o, lse, (np.concatenate(os_), np.concatenate(ls)), F16, f"prefill nvfp4 d{d}")
