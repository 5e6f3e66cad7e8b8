"""NVFP4 in trtllm_batch_context_with_kv_cache on a CUDA GPU (torch inputs), against float64
references.

The NVFP4 output (out_dtype="nvfp4", an FP4Tensor) is checked by dequantising it
(pyflashattn.testing.nvfp4.dequantize_output: e2m1 * e4m3 scale / o_sf_scale, scales read through
the 128x4 swizzle) and comparing each element with the float64 attention output. The tolerance is
e2m1's resolution: half the grid step at the element's magnitude in units of its block's scale
(0.25 units below 2, 0.5 below 4, 1 above; plus what saturation at 6 cuts off), times
scale / o_sf_scale (testing.nvfp4.output_error_bound), plus the 16-bit outputs' tolerance for the
attention itself (its fp32 rows differ from float64 by that much, which may move a value across a
rounding midpoint). Every block scale must be e4m3(o_sf_scale * amax / 6) of the reference row's
block, or the e4m3 value next to it. The query is 16-bit or (FlashInfer's form, sm_90 only: the
paged fp8 rows) float8_e4m3fn over an e4m3 cache; fp8 cases take FlashInfer's fp8 tolerance for
the attention itself (4e-2 / 8e-2, V at std 0.5: tests/gpu/test_fp8_prefill.py says why) and
1e-2 / 1e-3 for the LSE.

In-place FP4Tensor outputs start at a non-zero scale_start_index inside a larger scale tensor whose
every byte (and the data) is poisoned with 0xFF (an e4m3 NaN): the rows the call owns must come
back finite, every other row still poisoned. Split-KV rows (quantised by the merge kernel), tensor
bmm scales (the general kernels), GQA 1 / 4 / 8, head dims 64 / 128 / 256 (hd256 on sm_90a: the
sm80 paged kernels, routed by the manifest's nvfp4_out), page sizes 16 / 32 / 64, HND / NHD, and
two calls sharing one scale tensor (prefill then a decode-sized batch).

The NVFP4 KV cache (kv_block_scales, e4m3 [pages, 2, heads, page_size, D/16] or a tuple; the alias
kv_cache_sf) draws random codes over all 16 e2m1 codes, negative ones included, and the reference
attends over exactly e2m1 * scale * the global scales (folded into bmm1_scale / bmm2_scale).

    python -m pytest -q tests/gpu/test_trtllm_nvfp4.py
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
from pyflashattn._engine import trtllm as _trtllm, trtllm_device as _trtllm_device  # noqa: E402
from pyflashattn.testing import attention_ref, nvfp4, to_numpy_f64  # noqa: E402
from pyflashattn.testing.checks import assert_close  # noqa: E402
from pyflashattn.testing.gpu import page_spans, scratch_workspace as _ws  # noqa: E402

DEV = "cuda"
F16, BF16 = torch.float16, torch.bfloat16
E4M3 = getattr(torch, "float8_e4m3fn", None)
SM90 = torch.cuda.get_device_capability() == (9, 0)
O_TOL = {F16: dict(atol=1e-3, rtol=1e-3), BF16: dict(atol=1e-2, rtol=1e-2), E4M3: dict(atol=4e-2, rtol=8e-2)}
LSE_TOL = {F16: dict(atol=2e-3, rtol=1e-4), BF16: dict(atol=2e-3, rtol=1e-4), E4M3: dict(atol=1e-2, rtol=1e-3)}
FP8_V_STD = 0.5
G = 300.0  # o_sf_scale, as FlashInfer's tests
S1, S2 = 0.08, 1.5  # bmm1_scale, bmm2_scale (bmm2 multiplies before the block amax)
POISON = 0xFF
context = pyflashattn.prefill.trtllm_batch_context_with_kv_cache


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _meta(ql, kl, table, host):
    """(seq_lens, cum_seq_lens_q, cum_seq_lens_kv, block_tables): numpy (host metadata: an exact plan,
    split KV where it pays) or CUDA tensors (device metadata: a cached plan, never split)."""
    arrays = (np.asarray(kl, np.int32), np.concatenate([[0], np.cumsum(ql)]).astype(np.int32),
              np.concatenate([[0], np.cumsum(kl)]).astype(np.int32), table.cpu().numpy())
    return arrays if host else tuple(torch.from_numpy(a).to(DEV) for a in arrays)


def _last_engine(host):
    return next(reversed((_trtllm if host else _trtllm_device)._ENGINES.values()))


def _scatter(kl, ps, rows, pool, perm):
    """Each request's rows ([sum(kl), Hkv, X] per part, parts K then V) into pool [P, 2, ps, Hkv, X]
    at the page ids perm hands out, in order; returns the block table [B, M]."""
    table, spans = page_spans(kl, ps, perm, pool.shape[0] - 1)
    for pid, lo, hi in spans:
        for part, r in enumerate(rows):
            pool[pid, part, :hi - lo] = r[lo:hi]
    return table


def _to_layout(x, layout):
    """[P, 2, ps, Hkv, X] (NHD) as the cache layout wants, contiguous, on the GPU."""
    x = x.transpose(0, 1, 3, 2, 4) if layout == "HND" else x
    return torch.from_numpy(np.ascontiguousarray(x)).to(DEV)


def _refs(q, k, v, ql, kl, s1, s2, wl=-1):
    """float64 (o [T, Hq, D], base-2 lse [T, Hq]) of every request (causal, bottom-right)."""
    os_, ls = [], []
    cq, ck = np.concatenate([[0], np.cumsum(ql)]), np.concatenate([[0], np.cumsum(kl)])
    for b in range(len(ql)):
        o, lse = attention_ref(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], causal=True, sm_scale=s1,
                               window_left=wl)
        os_.append(o * s2)
        ls.append(lse)
    return np.concatenate(os_), np.concatenate(ls)


def _bits(scale):
    return scale.view(torch.uint8).cpu().numpy() if scale.dtype != torch.uint8 else scale.cpu().numpy()


def check_nvfp4(res, o_ref, dtype, what, start=0):
    """res (an FP4Tensor) against the float64 output o_ref [T, H, D] (module docstring)."""
    data, scale = res.data.cpu().numpy(), _bits(res.scale)
    T, H, D = o_ref.shape
    assert data.shape == (T, H, D // 2) and res.scale_start_index == start and tuple(res.original_shape) == (T, H, D)
    lin = nvfp4.unswizzle_scales(scale)[start:start + T, :H * D // 16]
    assert not np.isin(lin, (0x7F, 0xFF)).any(), f"{what}: NaN (unwritten) block scales"
    deq = nvfp4.dequantize_output(data, scale, start, G)
    tol = O_TOL[dtype]
    bound = nvfp4.output_error_bound(o_ref, scale, start, G) + tol["atol"] + tol["rtol"] * np.abs(o_ref)
    err = np.abs(deq - o_ref)
    bad = ~(err <= bound)  # NaN fails
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} elements beyond e2m1's resolution, first at "
                           f"{np.argwhere(bad)[:3].tolist()}: {deq[bad][:3]} vs {o_ref[bad][:3]}")
    amax = np.abs(o_ref).reshape(T, H, D // 16, 16).max(-1).reshape(T, -1)
    want = nvfp4.encode_e4m3(G * amax / 6).astype(np.int16)
    off = np.abs(lin.astype(np.int16) - want)  # e4m3 bit patterns of one sign are ordered like their values
    assert off.max() <= 1, f"{what}: block scales {int((off > 1).sum())} off e4m3(o_sf_scale * amax / 6)"
    assert (data & 0x8).any() and (data & 0x80).any(), f"{what}: no negative codes in either nibble"


def _cast(x, dtype):
    """x (float64 torch) in dtype; fp8 through float32 (the conversion every torch has)."""
    return x.float().to(dtype) if dtype is E4M3 else x.to(dtype)


def _inputs(ql, kl, hq, hkv, d, dtype, ps, layout, rng):
    q = _cast(torch.from_numpy(rng.standard_normal((sum(ql), hq, d))).to(DEV), dtype)
    k = _cast(torch.from_numpy(rng.standard_normal((sum(kl), hkv, d))), dtype)
    v = _cast(torch.from_numpy(rng.standard_normal((sum(kl), hkv, d)) * (FP8_V_STD if dtype is E4M3 else 1)), dtype)
    pages = sum(-(-n // ps) for n in kl) + 3
    pool = rng.standard_normal((pages, 2, ps, hkv, d)) * 4  # garbage pages: a wrong page is a wrong answer
    table = _scatter(kl, ps, (k.float().numpy(), v.float().numpy()), pool, rng.permutation(pages))
    cache = _cast(_to_layout(pool, layout), dtype)
    return q, to_numpy_f64(k.float()), to_numpy_f64(v.float()), cache, torch.from_numpy(table).to(DEV)


def _in_place(tokens, hq, d, start, extra=150):
    """A poisoned FP4Tensor whose scale tensor holds `extra` more rows, the call's from `start`."""
    rows = -(-(start + tokens + extra) // 128) * 128
    data = torch.full((tokens, hq, d // 2), POISON, dtype=torch.uint8, device=DEV)
    scale = torch.full((rows, hq * d // 16), POISON, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
    return pyflashattn.FP4Tensor(data, scale, start)


def _others_poisoned(res, start, tokens, what):
    lin = nvfp4.unswizzle_scales(_bits(res.scale))
    outside = np.ones(lin.shape[0], bool)
    outside[start:start + tokens] = False
    assert (lin[outside] == POISON).all(), f"{what}: scale rows outside the call's were written"


# name, q lens, kv lens, Hq, Hkv, D, page size, layout, dtype, out ("alloc" / start row), bmm scales, window_left,
# host metadata (the split cases: device metadata plans never split)
OUT_CASES = [
    ("bf16-d128-g4-alloc", [17, 256, 1], [300, 256, 64], 8, 2, 128, 32, "HND", BF16, "alloc", "float", -1, False),
    ("f16-d64-g1-inplace37-host", [5, 130], [5, 200], 4, 4, 64, 16, "NHD", F16, 37, "float", -1, True),
    ("bf16-d256-g8-inplace129", [33, 7], [100, 700], 16, 2, 256, 64, "HND", BF16, 129, "float", 50, False),
    ("f16-d128-g4-tensor-scales", [40, 3], [90, 300], 8, 2, 128, 16, "HND", F16, 5, "tensor", -1, False),
    ("bf16-d128-g8-split8k", [4, 1], [8000, 6000], 16, 2, 128, 16, "HND", BF16, 200, "float", -1, True),
    ("bf16-d64-g4-split8k-tensor", [2], [9000], 8, 2, 64, 64, "NHD", BF16, "alloc", "tensor", -1, True),
]
# FlashInfer's form: an e4m3 query and cache (the paged sm90 fp8 rows, every head dim), each case again
OUT_CASES += [("e4m3-" + c[0].split("-", 1)[1], *c[1:8], E4M3, *c[9:]) for c in OUT_CASES]


@pytest.mark.parametrize("case", OUT_CASES, ids=[c[0] for c in OUT_CASES])
def test_nvfp4_output(case):
    name, ql, kl, hq, hkv, d, ps, layout, dtype, out_kind, scales, wl, host = case
    if dtype is E4M3 and not SM90:
        pytest.skip("an fp8 query runs on the sm_90a fp8 prefill only")
    rng = _rng("out", name)
    q, k, v, cache, table = _inputs(ql, kl, hq, hkv, d, dtype, ps, layout, rng)
    s1, s2 = S1, S2
    if scales == "tensor":
        s1, s2 = (torch.tensor([x], device=DEV, dtype=torch.float32) for x in (S1, S2))
    start = 0 if out_kind == "alloc" else out_kind
    out = None if out_kind == "alloc" else _in_place(sum(ql), hq, d, start)
    lse = torch.full((sum(ql), hq), float("nan"), device=DEV)
    sl, cq, ck, bt = _meta(ql, kl, table, host)
    res = context(q, cache, _ws(), bt, sl, max(ql), max(kl), s1, s2, len(ql), cq, ck, window_left=wl, out=out,
                  out_dtype="nvfp4", o_sf_scale=G, o_sf_vec_size=16, kv_layout=layout, lse=lse)
    assert isinstance(res, pyflashattn.FP4Tensor) and res.dtype == "nvfp4"
    if out is None:
        assert res.scale.dtype == torch.float8_e4m3fn and tuple(res.scale.shape) == (-(-sum(ql) // 128) * 128,
                                                                                       hq * d // 16)
    else:
        assert res.data.data_ptr() == out.data.data_ptr() and res.scale.data_ptr() == out.scale.data_ptr()
        _others_poisoned(res, start, sum(ql), name)
    e = _last_engine(host)
    assert e.attn.meta.get("nvfp4_out") and e.cfg.o_format == 3
    assert (e.attn.meta["dtype"] == "e4m3") == (dtype is E4M3)
    if "split" in name:
        assert e.merge is not None and e.schedule.split, "a few queries over many keys were meant to split"
    o_ref, lse_ref = _refs(to_numpy_f64(q.float()), k, v, ql, kl, S1, S2, wl)
    check_nvfp4(res, o_ref, dtype, name, start)
    assert_close(lse, lse_ref, what=f"{name} lse", **LSE_TOL[dtype])


def test_nvfp4_output_shared_scale_tensor():
    """Two calls fill one scale tensor (FlashInfer's reason for scale_start_index): a prefill batch
    from row 0 and a decode-sized batch right after it; neither disturbs the other's rows."""
    rng = _rng("shared")
    hq, hkv, d, ps = 8, 2, 128, 32
    ql1, kl1, ql2, kl2 = [20, 9], [20, 300], [1, 1, 1], [50, 700, 3]
    t1, t2 = sum(ql1), sum(ql2)
    scale = torch.full((128, hq * d // 16), POISON, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
    results = []
    for ql, kl, start in ((ql1, kl1, 0), (ql2, kl2, t1)):
        q, k, v, cache, table = _inputs(ql, kl, hq, hkv, d, BF16, ps, "HND", rng)
        data = torch.full((sum(ql), hq, d // 2), POISON, dtype=torch.uint8, device=DEV)
        sl, cq, ck, bt = _meta(ql, kl, table, False)
        res = context(q, cache, _ws(), bt, sl, max(ql), max(kl), S1, S2, len(ql), cq, ck,
                      out=pyflashattn.FP4Tensor(data, scale, start), o_sf_scale=G)
        results.append((res, _refs(to_numpy_f64(q), k, v, ql, kl, S1, S2)[0], start))
    for i, (res, o_ref, start) in enumerate(results):
        check_nvfp4(res, o_ref, BF16, f"call {i}", start)
    _others_poisoned(results[0][0], 0, t1 + t2, "both calls")


# ---------------------------------------------------------------- the NVFP4 KV cache
K_GLOBAL, V_GLOBAL = 0.37, 1.3  # the cache's global scales, folded into bmm1_scale / bmm2_scale


def _nvfp4_cache(kl, hkv, d, ps, layout, rng):
    """(codes [P, 2, ...D/2] uint8, scales [P, 2, ...D/16] e4m3, block table, dequantised K, V):
    random codes over all 16 e2m1 codes, random scales 1/16 .. 1/2, garbage pages elsewhere."""
    n = sum(kl)
    codes = [nvfp4.random_codes(rng, (n, hkv, d // 2)) for _ in range(2)]
    sfs = [nvfp4.random_scales(rng, (n, hkv, d // 16), 2.0**-4, 0.5) for _ in range(2)]
    pages = sum(-(-x // ps) for x in kl) + 3
    perm = rng.permutation(pages)
    code_pool = nvfp4.random_codes(rng, (pages, 2, ps, hkv, d // 2))
    sf_pool = nvfp4.random_scales(rng, (pages, 2, ps, hkv, d // 16), 0.5, 8.0)
    table = _scatter(kl, ps, codes, code_pool, perm)
    _scatter(kl, ps, sfs, sf_pool, perm)
    assert (code_pool & 0x8).any() and (code_pool & 0x80).any()  # negative codes in both nibbles
    k, v = (nvfp4.dequantize(c, s) for c, s in zip(codes, sfs))
    return (_to_layout(code_pool, layout), _to_layout(sf_pool, layout).view(torch.float8_e4m3fn),
            torch.from_numpy(table).to(DEV), k, v)


# name, q lens, kv lens, Hq, Hkv, D, page size, layout, dtype, cache form, output
KV_CASES = [
    ("bf16-d128-g4-hnd-tensor", [17, 200, 1], [300, 200, 64], 8, 2, 128, 16, "HND", BF16, "tensor", "bf16"),
    ("f16-d64-g1-nhd-tuple", [5, 40], [5, 129], 4, 4, 64, 32, "NHD", F16, "tuple", "f16"),
    ("bf16-d256-g8-hnd-tuple-alias", [9, 3], [60, 500], 16, 2, 256, 64, "HND", BF16, "tuple_alias", "bf16"),
    ("bf16-d128-g8-hnd-nvfp4-out-host", [30, 2], [64, 3000], 16, 2, 128, 32, "HND", BF16, "tensor", "nvfp4"),
]


@pytest.mark.parametrize("case", KV_CASES, ids=[c[0] for c in KV_CASES])
def test_context_nvfp4_kv(case):
    name, ql, kl, hq, hkv, d, ps, layout, dtype, form, out_kind = case
    rng = _rng("kv", name)
    codes, sf, table, k, v = _nvfp4_cache(kl, hkv, d, ps, layout, rng)
    q = torch.from_numpy(rng.standard_normal((sum(ql), hq, d))).to(DEV, dtype)
    cache, scales = (codes, sf) if form == "tensor" else ((codes[:, 0], codes[:, 1]), (sf[:, 0], sf[:, 1]))
    sm = 1 / math.sqrt(d)
    kw = dict(kv_cache_sf=scales) if form.endswith("alias") else dict(kv_block_scales=scales)
    if out_kind == "nvfp4":
        kw.update(out=_in_place(sum(ql), hq, d, 3), o_sf_scale=G)
    else:
        kw.update(out=torch.full_like(q, float("nan")))
    lse = torch.full((sum(ql), hq), float("nan"), device=DEV)
    host = "host" in name
    sl, cq, ck, bt = _meta(ql, kl, table, host)
    res = context(q, cache, _ws(), bt, sl, max(ql), max(kl), sm * K_GLOBAL, V_GLOBAL, len(ql), cq, ck,
                  kv_layout=layout, lse=lse, **kw)
    assert _last_engine(host).attn.meta["kv_dtype"] == "nvfp4"
    o_ref, lse_ref = _refs(to_numpy_f64(q), k * K_GLOBAL, v * V_GLOBAL, ql, kl, sm, 1.0)
    if out_kind == "nvfp4":
        check_nvfp4(res, o_ref, dtype, name, 3)
        _others_poisoned(res, 3, sum(ql), name)
    else:
        assert res is kw["out"]
        assert_close(res, o_ref, what=f"{name} o", **O_TOL[dtype])
    assert_close(lse, lse_ref, what=f"{name} lse", **LSE_TOL[dtype])
