"""fp8 KV caches (float8_e4m3fn, float8_e5m2) in the batch prefill wrappers, GPU, against the
float64 reference on the DEQUANTISED values.

K/V are drawn as random fp32, cast to the fp8 torch dtype, and the reference attends over
k.double() * k_scale and v.double() * v_scale (fp8 -> 16-bit widening in the kernel is exact, so
the reference sees exactly the kernel's inputs). k_scale / v_scale are random per case in
[0.3, 2.0] (never 1), so a kernel that ignored either fails: k_scale moves every logit (and the
LSE, which includes it, base 2), v_scale every output. The output tolerance is the 16-bit batch
tests' (FlashInfer's) applied to o / v_scale: the kernel computes o / v_scale with exactly the
16-bit path's rounding, then multiplies once in fp32 before the final rounding.

Every fp8 torch operation that may lack a kernel in some torch version (indexing, cat,
contiguous copies) is done on uint8 views of the same bytes; only fp32 <-> fp8 casts touch the
fp8 dtypes. Outputs go into NaN-poisoned out= / lse= buffers with guard rows behind them.
"""
from __future__ import annotations

import zlib
from types import SimpleNamespace

import numpy as np
import pytest

from pyflashattn.testing.gpu import require_cuda_torch

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this torch has no float8 dtypes", allow_module_level=True)

import pyflashattn  # noqa: E402
from pyflashattn._engine.routing import built_decode_tiles, decode_tile_rows  # noqa: E402
from pyflashattn._runtime import registry as _registry  # noqa: E402
from pyflashattn.quantization import segment_packbits  # noqa: E402
from pyflashattn.testing import attention_ref, to_numpy_f64  # noqa: E402
from pyflashattn.testing.checks import assert_close, batch_heads_to_check  # noqa: E402

DEV = "cuda"
F16, BF16 = torch.float16, torch.bfloat16
QDT = {"fp16": F16, "bf16": BF16}
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
NAN = float("nan")
U8 = torch.uint8

# The 16-bit batch tests' tolerances (tests/gpu/test_batch_prefill.py, FlashInfer's).
O_TOL = {F16: dict(atol=1e-3, rtol=1e-3), BF16: dict(atol=1e-2, rtol=1e-2)}
LSE_TOL = {F16: dict(atol=2e-3, rtol=1e-4), BF16: dict(atol=1e-2, rtol=1e-4)}
# bf16: the rotated q and k are rounded to bf16 (2^-9 relative) before the MMA, as FlashInfer does;
# with the scaled fp8 keys' logits (|x| up to ~10) that moves a softmax weight by up to ~1 %.
ROPE_O_TOL = {F16: dict(atol=2e-3, rtol=1e-3), BF16: dict(atol=2e-2, rtol=1e-2)}
# ROPE_LLAMA rounds the rotated q and k to 16 bits before the MMA, so a logit's error grows with
# its size: relative, not absolute, for the LSE (bf16: 2^-9 per operand).
ROPE_LSE_TOL = {F16: LSE_TOL[F16], BF16: dict(atol=1e-2, rtol=1e-3)}
REF_LOGIT_BUDGET = 1 << 24
GARBAGE_SCALE = 4.0  # slots that belong to no request: random, larger, finite (e4m3 max is 448)
GUARD_ROWS = 64
SM90 = torch.cuda.get_device_capability()[0] == 9

_WS = []


@pytest.fixture(params=["default", "sm80"])
def family(request, monkeypatch):
    """Which family runs the call: the registry's choice ("default": on sm_90 the sm90 family's
    fp8-K/V rows wherever they cover it: no general option, head_dim <= 128, not a decode tile), or
    the sm80 family, forced on sm_90 by the implementation preference (elsewhere it is the default:
    skipped)."""
    if request.param == "sm80":
        if not SM90:
            pytest.skip("the sm80 family is the default off sm_90")
        monkeypatch.setitem(_registry.IMPL_PREFERENCE, "sm_90a", ("sm80",))
        _registry.force("prefill", None)  # drops the cached launchers and decode-tile rows
    yield request.param
    _registry.force("prefill", None)


def _workspace():
    if not _WS:
        _WS.append(torch.empty(1 << 30, dtype=torch.uint8, device=DEV))
    return _WS[0]


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def _randn(shape, seed, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(shape, device=DEV, dtype=torch.float32, generator=g) * scale


def _indptr(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _scales(seed):
    """(k_scale, v_scale) in [0.3, 2.0], never near 1."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        x = 1.0
        while abs(x - 1.0) < 0.1:
            x = float(rng.uniform(0.3, 2.0))
        out.append(x)
    return tuple(out)


def _lens(seed, batch, qo_max, kv_max, mode):
    """Random (qo_lens, kv_lens) with an empty request (no queries), a request without keys and
    qo_len != kv_len (append: kv >= qo; mixed: independent, so causal rows with no key occur)."""
    rng = np.random.default_rng(seed)
    n = batch - 2
    qo = rng.integers(1, qo_max + 1, n)
    kv = qo + rng.integers(0, kv_max, n) if mode == "append" else rng.integers(1, kv_max + 1, n)
    qo, kv = [int(x) for x in qo], [int(x) for x in kv]
    for pair in ((0, int(rng.integers(1, kv_max))), (int(rng.integers(1, qo_max + 1)), 0)):
        i = int(rng.integers(0, len(qo) + 1))
        qo.insert(i, pair[0])
        kv.insert(i, pair[1])
    return qo, kv


def _batch(qo_lens, kv_lens, hq, hkv, d, qdt, kvdt, seed, q_scale=1.0):
    qi, ki = _indptr(qo_lens), _indptr(kv_lens)
    q = _randn((int(qi[-1]), hq, d), seed, q_scale).to(qdt)
    k8 = _randn((int(ki[-1]), hkv, d), seed + 1).to(FP8[kvdt])
    v8 = _randn((int(ki[-1]), hkv, d), seed + 2).to(FP8[kvdt])
    return SimpleNamespace(qo_lens=list(qo_lens), kv_lens=list(kv_lens), qo_indptr=qi, kv_indptr=ki, q=q, k8=k8, v8=v8,
                           hq=hq, hkv=hkv, d=d, qdt=qdt, kvdt=kvdt)


def _paginate(b, ps, layout, form, seed):
    """The batch's fp8 K/V scattered into a paged cache among garbage pages (uint8 views)."""
    rng = np.random.default_rng(seed)
    pages = [-(-kv // ps) for kv in b.kv_lens]
    n_used = sum(pages)
    num_pages = n_used + max(3, n_used // 4)
    perm = rng.permutation(num_pages)
    kv_indptr = _indptr(pages)
    indices = perm[:n_used].astype(np.int32)
    last = np.asarray([kv - (p - 1) * ps if p else 0 for kv, p in zip(b.kv_lens, pages)], np.int32)
    shape = (num_pages, 2, ps, b.hkv, b.d) if layout == "NHD" else (num_pages, 2, b.hkv, ps, b.d)
    store = _randn(shape, seed + 17, GARBAGE_SCALE).to(FP8[b.kvdt])
    raw = store.view(U8)
    nhd = raw if layout == "NHD" else raw.permute(0, 1, 3, 2, 4)
    if n_used:
        tok_page = np.concatenate([indices[kv_indptr[i] + np.arange(kv) // ps] for i, kv in enumerate(b.kv_lens)])
        tok_slot = np.concatenate([np.arange(kv) % ps for kv in b.kv_lens])
        tp = torch.as_tensor(tok_page.astype(np.int64), device=DEV)
        ts = torch.as_tensor(tok_slot.astype(np.int64), device=DEV)
        nhd[:, 0][tp, ts] = b.k8.view(U8)
        nhd[:, 1][tp, ts] = b.v8.view(U8)
    if form == "5d":
        cache = store
    elif form == "tuple":
        cache = tuple(raw[:, j].contiguous().view(FP8[b.kvdt]) for j in (0, 1))
    elif form == "tuple_views":
        cache = (store[:, 0], store[:, 1])
    else:
        raise ValueError(form)
    return SimpleNamespace(cache=cache, store=store, kv_indptr=kv_indptr, indices=indices, last=last, page_size=ps,
                           num_pages=num_pages)


def _ragged_kv(b, layout):
    if layout == "NHD":
        return b.k8, b.v8
    return tuple(t.view(U8).transpose(0, 1).contiguous().view(FP8[b.kvdt]) for t in (b.k8, b.v8))


def _poisoned(b):
    T = b.q.shape[0]
    ob = torch.full((T + GUARD_ROWS, b.hq, b.d), NAN, dtype=b.qdt, device=DEV)
    lb = torch.full((T + GUARD_ROWS, b.hq), NAN, dtype=torch.float32, device=DEV)
    return ob[:T], lb[:T]


def _run_into(w, b, kv_args, **kw):
    out, lse = _poisoned(b)
    r = w.run(b.q, *kv_args, out=out, lse=lse, return_lse=True, **kw)
    torch.cuda.synchronize()
    assert r[0] is out and r[1] is lse
    assert torch.isnan(out._base[out.shape[0]:]).all() and torch.isnan(lse._base[lse.shape[0]:]).all(), \
        "written past the last row"
    return out, lse


def _plan(w, kind, b, pg, causal, **opts):
    if kind == "paged":
        return w.plan(b.qo_indptr, pg.kv_indptr, pg.indices, pg.last, b.hq, b.hkv, b.d, pg.page_size, causal=causal,
                      q_data_type=b.qdt, kv_data_type=FP8[b.kvdt], **opts)
    return w.plan(b.qo_indptr, b.kv_indptr, b.hq, b.hkv, b.d, causal=causal, q_data_type=b.qdt,
                  kv_data_type=FP8[b.kvdt], **opts)


def _wrapper(kind, layout):
    cls = (pyflashattn.BatchPrefillWithPagedKVCacheWrapper if kind == "paged"
           else pyflashattn.BatchPrefillWithRaggedKVCacheWrapper)
    return cls(_workspace(), layout)


_REF_KEYS = ("sm_scale", "window_left", "logits_soft_cap", "pos_encoding_mode", "rope_scale", "rope_theta")


def _dequant(t8, scale):
    """float64 numpy of an fp8 tensor times its scale (fp8 -> fp32 on the GPU is exact)."""
    return t8.float().cpu().double().numpy() * scale


def _refs(b, causal, opts, ks, vs, masks=None, seed=0):
    """{request: (o_ref, lse_ref, heads)} on the dequantised K/V."""
    K, V, Q = _dequant(b.k8, ks), _dequant(b.v8, vs), to_numpy_f64(b.q)
    heads = batch_heads_to_check(b.qo_lens, b.kv_lens, b.hq, seed, REF_LOGIT_BUDGET)
    kw = dict({k: opts[k] for k in _REF_KEYS if k in opts}, causal=causal)
    out = {}
    for i in range(len(b.qo_lens)):
        if b.qo_lens[i] == 0:
            continue
        q0, q1, k0, k1 = b.qo_indptr[i], b.qo_indptr[i + 1], b.kv_indptr[i], b.kv_indptr[i + 1]
        m = None if masks is None else masks[i]
        o, lse = attention_ref(Q[q0:q1], K[k0:k1], V[k0:k1], heads=heads[i], custom_mask=m, **kw)
        out[i] = (o, lse, heads[i])
    return out


def _check(b, o, lse, refs, vs, opts, what):
    o_np, lse_np = to_numpy_f64(o), to_numpy_f64(lse)
    otol = (ROPE_O_TOL if opts.get("pos_encoding_mode") == "ROPE_LLAMA" else O_TOL)[b.qdt]
    for i, (o_ref, lse_ref, heads) in refs.items():
        r0, r1 = int(b.qo_indptr[i]), int(b.qo_indptr[i + 1])
        h = slice(None) if heads is None else heads
        tag = f"{what} req {i} (qo {b.qo_lens[i]}, kv {b.kv_lens[i]})"
        assert_close(o_np[r0:r1][:, h] / vs, o_ref / vs, what=f"{tag} o / v_scale", **otol)
        ltol = (ROPE_LSE_TOL if opts.get("pos_encoding_mode") == "ROPE_LLAMA" else LSE_TOL)[b.qdt]
        assert_close(lse_np[r0:r1][:, h], lse_ref, what=f"{tag} lse", **ltol)


# ---------------------------------------------------------------------------------------
# The grid: (id, kind, batch, qo_max, kv_max, mode, page_size, hq, hkv, d, q dtype, kv dtype,
# layout, causal, form). GQA groups 1 (32/32), 4 (32/8), 8 (32/4); head dims 64/128/256.
# ---------------------------------------------------------------------------------------
GRID = [
    ("p-e4m3-f16-ps16-nhd-5d", "paged", 12, 200, 1500, "append", 16, 32, 8, 128, "fp16", "e4m3", "NHD", True, "5d"),
    ("p-e5m2-bf16-ps1-hnd-tuple", "paged", 9, 150, 900, "mixed", 1, 32, 32, 64, "bf16", "e5m2", "HND", False, "tuple"),
    ("p-e4m3-bf16-ps64-hnd-5d-d256", "paged", 6, 300, 2000, "append", 64, 32, 4, 256, "bf16", "e4m3", "HND", True,
     "5d"),
    ("p-e5m2-f16-ps16-nhd-tuple", "paged", 10, 200, 1200, "mixed", 16, 32, 4, 128, "fp16", "e5m2", "NHD", False,
     "tuple"),
    ("p-e4m3-f16-ps64-nhd-tuple-g1", "paged", 8, 128, 1000, "mixed", 64, 32, 32, 64, "fp16", "e4m3", "NHD", True,
     "tuple"),
    ("p-e5m2-bf16-ps1-nhd-5d-d256", "paged", 5, 100, 700, "append", 1, 32, 8, 256, "bf16", "e5m2", "NHD", True, "5d"),
    ("p-e4m3-bf16-ps16-hnd-views", "paged", 7, 160, 1100, "append", 16, 32, 8, 128, "bf16", "e4m3", "HND", True,
     "tuple_views"),
    ("p-e5m2-f16-ps64-hnd-5d-full", "paged", 6, 256, 1500, "mixed", 64, 32, 4, 64, "fp16", "e5m2", "HND", False, "5d"),
    ("p-e4m3-f16-ps1-hnd-5d-g8", "paged", 8, 64, 600, "mixed", 1, 32, 4, 128, "fp16", "e4m3", "HND", True, "5d"),
    ("r-e4m3-f16-nhd", "ragged", 16, 256, 1500, "append", 0, 32, 8, 128, "fp16", "e4m3", "NHD", True, None),
    ("r-e5m2-bf16-hnd", "ragged", 7, 200, 1000, "mixed", 0, 32, 4, 64, "bf16", "e5m2", "HND", False, None),
    ("r-e4m3-bf16-nhd-d256-g1", "ragged", 5, 200, 800, "mixed", 0, 32, 32, 256, "bf16", "e4m3", "NHD", True, None),
    ("r-e5m2-f16-nhd-decode", "ragged", 20, 4, 3000, "mixed", 0, 32, 4, 128, "fp16", "e5m2", "NHD", True, None),
    ("r-e4m3-f16-hnd-full-g8", "ragged", 9, 300, 1200, "append", 0, 32, 4, 128, "fp16", "e4m3", "HND", False, None),
    # decode tiles (qo_len * group <= 16)
    ("r-e4m3-bf16-nhd-dec16", "ragged", 24, 4, 5000, "mixed", 0, 32, 8, 128, "bf16", "e4m3", "NHD", True, None),
    ("p-e5m2-f16-ps16-dec16-d256", "paged", 16, 2, 3000, "mixed", 16, 32, 4, 256, "fp16", "e5m2", "NHD", False,
     "5d"),
    ("p-e4m3-bf16-ps1-hnd-dec16-d64", "paged", 12, 1, 2500, "mixed", 1, 32, 2, 64, "bf16", "e4m3", "HND", True,
     "tuple"),
    # hd128 (16-key tiles) and the hd256 warp-pair decode tile, ragged too
    ("r-e4m3-bf16-hnd-dec16-d256", "ragged", 12, 4, 3000, "mixed", 0, 32, 8, 256, "bf16", "e4m3", "HND", True,
     None),
    ("p-e4m3-bf16-ps16-nhd-dec16-d128", "paged", 16, 4, 4000, "mixed", 16, 32, 8, 128, "bf16", "e4m3", "NHD", True,
     "5d"),
    ("p-e5m2-f16-ps64-hnd-dec16-d128", "paged", 10, 2, 3000, "append", 64, 32, 4, 128, "fp16", "e5m2", "HND", False,
     "tuple"),
    # 17-32 packed rows at hd64 / hd128: the 32-row fp8 decode tile (two warps share the widening)
    ("p-e4m3-bf16-ps16-nhd-dec32-d128", "paged", 16, 8, 5000, "mixed", 16, 32, 8, 128, "bf16", "e4m3", "NHD", True,
     "5d"),
    ("r-e5m2-f16-hnd-dec32-d64", "ragged", 12, 8, 3000, "append", 0, 32, 8, 64, "fp16", "e5m2", "HND", True, None),
    # 33-64 packed rows: the 64-row fp8 decode tile (four warps share the widening)
    ("p-e4m3-bf16-ps16-nhd-dec64-g8", "paged", 16, 8, 5000, "mixed", 16, 64, 8, 128, "bf16", "e4m3", "NHD", True,
     "5d"),
    ("r-e4m3-f16-nhd-dec64-d64", "ragged", 10, 16, 2500, "append", 0, 32, 8, 64, "fp16", "e4m3", "NHD", False, None),
]


def _build(key, kind, batch, qo_max, kv_max, mode, ps, hq, hkv, d, qdt, kvdt, layout, form, q_scale=1.0):
    seed = _seed(key)
    qo, kv = _lens(seed, batch, qo_max, kv_max, mode)
    b = _batch(qo, kv, hq, hkv, d, QDT[qdt], kvdt, seed + 100, q_scale)
    if kind == "paged":
        pg = _paginate(b, ps, layout, form, seed + 200)
        return b, pg, (pg.cache,)
    return b, None, _ragged_kv(b, layout)


@pytest.mark.parametrize("key,kind,batch,qo_max,kv_max,mode,ps,hq,hkv,d,qdt,kvdt,layout,causal,form",
                         [pytest.param(*c, id=c[0]) for c in GRID])
def test_fp8_batch_grid(family, key, kind, batch, qo_max, kv_max, mode, ps, hq, hkv, d, qdt, kvdt, layout, causal,
                        form):
    b, pg, kv_args = _build(key, kind, batch, qo_max, kv_max, mode, ps, hq, hkv, d, qdt, kvdt, layout, form)
    ks, vs = _scales(_seed(key, "scales"))
    w = _wrapper(kind, layout)
    _plan(w, kind, b, pg, causal)
    # the decode tiles the manifest has for this K/V (fp8: the wide ones too, paged or not)
    tiles = built_decode_tiles(torch.cuda.current_device(), {"fp16": "f16", "bf16": "bf16"}[qdt], "fp8", d,
                               kind == "paged")
    tile = decode_tile_rows(d, max(b.qo_lens) * (hq // hkv), tiles)
    meta = w._engine.attn.meta
    assert meta["decode"] is bool(tile) and w._engine.schedule.block_m == (tile or meta["block_m"]), meta["name"]
    # the sm90 family's widening rows where they cover the call, else the sm80 family
    sm90 = family == "default" and SM90 and not tile and d <= 128
    assert (meta["impl"] == "sm90") is sm90 and meta["kv_dtype"] == "fp8", meta["name"]
    o, lse = _run_into(w, b, kv_args, k_scale=ks, v_scale=vs)
    _check(b, o, lse, _refs(b, causal, {}, ks, vs, seed=_seed(key, "heads")), vs, {}, key)
    # the allocated path, same plan and scales: the same bits
    o2, lse2 = w.run(b.q, *kv_args, k_scale=ks, v_scale=vs, return_lse=True)
    torch.cuda.synchronize()
    assert o2.dtype == b.qdt and torch.equal(o2, o) and torch.equal(lse2, lse)
    # rows with no visible key (a request without keys): o = 0, lse = -inf
    for i, kvl in enumerate(b.kv_lens):
        if kvl == 0 and b.qo_lens[i]:
            r0, r1 = int(b.qo_indptr[i]), int(b.qo_indptr[i + 1])
            assert torch.all(o[r0:r1] == 0) and torch.all(torch.isneginf(lse[r0:r1]))


@pytest.mark.parametrize("kind", ["paged", "ragged"])
@pytest.mark.parametrize("kvdt", ["e4m3", "e5m2"])
def test_fp8_matches_the_16bit_path_on_widened_kv(kind, kvdt):
    """The fp8 kernels against the 16-bit kernels fed the widened (exact) K/V, same scales."""
    key = ("vs16", kind, kvdt)
    b, pg, kv_args = _build(key, kind, 10, 200, 1500, "append", 16, 32, 8, 128, "bf16", kvdt, "NHD", "5d")
    ks, vs = _scales(_seed(key))
    w = _wrapper(kind, "NHD")
    _plan(w, kind, b, pg, True)
    o8, lse8 = _run_into(w, b, kv_args, k_scale=ks, v_scale=vs)
    if kind == "paged":
        wide = pg.store.float().to(BF16)
        w.plan(b.qo_indptr, pg.kv_indptr, pg.indices, pg.last, b.hq, b.hkv, b.d, 16, causal=True, q_data_type=BF16)
        args = (wide,)
    else:
        args = (b.k8.float().to(BF16), b.v8.float().to(BF16))
        w.plan(b.qo_indptr, b.kv_indptr, b.hq, b.hkv, b.d, causal=True, q_data_type=BF16)
    o16, lse16 = _run_into(w, b, args, k_scale=ks, v_scale=vs)
    assert_close(o8, to_numpy_f64(o16), what="fp8 vs 16-bit o", **O_TOL[BF16])
    assert_close(lse8, to_numpy_f64(lse16), what="fp8 vs 16-bit lse", **LSE_TOL[BF16])


# ---------------------------------------------------------------------------------------
# Options on fp8 K/V: window, soft cap, ALiBi, RoPE (FlashInfer refuses fp8 + RoPE; our kernel
# widens K before rotating it), custom masks, split-KV (the merge path with v_scale)
# ---------------------------------------------------------------------------------------
OPTION_CASES = [
    # (id, kind, kvdt, qdt, layout, causal, opts, visible override)
    ("window-paged", "paged", "e4m3", "fp16", "NHD", True, dict(window_left=33), dict(window_left=-1)),
    ("window-ragged-full", "ragged", "e5m2", "bf16", "NHD", False, dict(window_left=100), dict(window_left=-1)),
    ("softcap-paged", "paged", "e5m2", "bf16", "HND", True, dict(logits_soft_cap=2.0), dict(logits_soft_cap=None)),
    ("softcap-ragged", "ragged", "e4m3", "fp16", "NHD", False, dict(logits_soft_cap=3.0), dict(logits_soft_cap=None)),
    ("rope-paged", "paged", "e4m3", "fp16", "HND", True, dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=500.0),
     dict(pos_encoding_mode="NONE")),
    ("rope-ragged", "ragged", "e5m2", "bf16", "NHD", True, dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0),
     dict(pos_encoding_mode="NONE")),
    ("alibi-paged", "paged", "e5m2", "fp16", "NHD", True, dict(pos_encoding_mode="ALIBI"),
     dict(pos_encoding_mode="NONE")),
    ("sm-scale-ragged", "ragged", "e4m3", "bf16", "HND", False, dict(sm_scale=0.2), dict(sm_scale=None)),
]


def _assert_visible(b, refs, causal, opts, override, ks, vs, what):
    i = max(refs, key=lambda j: b.qo_lens[j] * b.kv_lens[j])
    alt = {k: v for k, v in dict(opts, **override).items() if v is not None}
    o_ref = refs[i][0]
    K, V, Q = _dequant(b.k8, ks), _dequant(b.v8, vs), to_numpy_f64(b.q)
    q0, q1, k0, k1 = b.qo_indptr[i], b.qo_indptr[i + 1], b.kv_indptr[i], b.kv_indptr[i + 1]
    kw = dict({k: alt[k] for k in _REF_KEYS if k in alt}, causal=causal)
    o_alt, _ = attention_ref(Q[q0:q1], K[k0:k1], V[k0:k1], heads=refs[i][2], **kw)
    tol = O_TOL[b.qdt]
    excess = np.abs(o_ref - o_alt) / vs - 3 * (tol["atol"] + tol["rtol"] * np.abs(o_alt) / vs)
    assert excess.max() > 0, f"{what}: the option barely changes the reference; this case cannot see it"


@pytest.mark.parametrize("key,kind,kvdt,qdt,layout,causal,opts,visible", [pytest.param(*c, id=c[0])
                                                                           for c in OPTION_CASES])
def test_fp8_options(key, kind, kvdt, qdt, layout, causal, opts, visible):
    ps = 16 if layout == "NHD" else 64
    b, pg, kv_args = _build(key, kind, 10, 250, 1800, "append", ps, 32, 8, 128, qdt, kvdt, layout, "5d")
    ks, vs = _scales(_seed(key, "scales"))
    w = _wrapper(kind, layout)
    _plan(w, kind, b, pg, causal, **opts)
    o, lse = _run_into(w, b, kv_args, k_scale=ks, v_scale=vs)
    refs = _refs(b, causal, opts, ks, vs, seed=_seed(key, "heads"))
    _check(b, o, lse, refs, vs, opts, key)
    _assert_visible(b, refs, causal, opts, visible, ks, vs, key)


@pytest.mark.parametrize("kind", ["paged", "ragged"])
@pytest.mark.parametrize("packed", [False, True])
def test_fp8_custom_mask(kind, packed):
    key = ("mask", kind, packed)
    kvdt, qdt = ("e4m3", "fp16") if packed else ("e5m2", "bf16")
    b, pg, kv_args = _build(key, kind, 8, 120, 900, "mixed", 16, 32, 8, 128, qdt, kvdt, "NHD", "5d")
    rng = np.random.default_rng(_seed(key, "bits"))
    masks = [rng.random((a, c)) < 0.4 for a, c in zip(b.qo_lens, b.kv_lens)]
    flat = np.concatenate([m.reshape(-1) for m in masks])
    flat_t = torch.as_tensor(flat, device=DEV)
    if packed:
        seg = _indptr([m.size for m in masks])
        kw = dict(packed_custom_mask=segment_packbits(flat_t, seg, bitorder="little")[0])
    else:
        kw = dict(custom_mask=flat_t)
    ks, vs = _scales(_seed(key, "scales"))
    w = _wrapper(kind, "NHD")
    _plan(w, kind, b, pg, True, **kw)
    o, lse = _run_into(w, b, kv_args, k_scale=ks, v_scale=vs)
    _check(b, o, lse, _refs(b, True, {}, ks, vs, masks=masks, seed=1), vs, {}, f"mask {kind} packed={packed}")


@pytest.mark.parametrize("kind,layout,causal,kvdt,qdt", [
    ("paged", "HND", True, "e4m3", "fp16"), ("paged", "NHD", False, "e5m2", "bf16"),
    ("ragged", "NHD", True, "e5m2", "fp16"), ("ragged", "HND", False, "e4m3", "bf16"),
])
def test_fp8_split_kv_merge_with_scales(kind, layout, causal, kvdt, qdt):
    """Short queries over long KV with a small fixed split: partials carry v_scale into the merge."""
    qo_lens = [1, 0, 7, 33, 2, 16]
    kv_lens = [6000, 300, 4096, 5000, 0, 3000]
    key = ("split", kind, layout, causal, kvdt)
    b = _batch(qo_lens, kv_lens, 32, 8, 128, QDT[qdt], kvdt, _seed(key))
    if kind == "paged":
        pg = _paginate(b, 16, layout, "5d", _seed(key, "pages"))
        kv_args = (pg.cache,)
    else:
        pg, kv_args = None, _ragged_kv(b, layout)
    ks, vs = _scales(_seed(key, "scales"))
    w = _wrapper(kind, layout)
    _plan(w, kind, b, pg, causal, fixed_split_size=256)
    assert w.workspace_size() > 0, "this plan must split KV (the merge path is what it tests)"
    o, lse = _run_into(w, b, kv_args, k_scale=ks, v_scale=vs)
    _check(b, o, lse, _refs(b, causal, {}, ks, vs, seed=2), vs, {}, f"split {key}")


# ---------------------------------------------------------------------------------------
# k_scale / v_scale on 16-bit K/V (FlashInfer's ragged wrapper ignores them: we apply them)
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["ragged", "paged"])
@pytest.mark.parametrize("qdt", ["fp16", "bf16"])
def test_scales_on_16bit_kv(kind, qdt):
    dt = QDT[qdt]
    key = ("scales16", kind, qdt)
    qo, kv = _lens(_seed(key), 9, 200, 1500, "append")
    qi, ki = _indptr(qo), _indptr(kv)
    q = _randn((int(qi[-1]), 32, 128), _seed(key, "q")).to(dt)
    k = _randn((int(ki[-1]), 8, 128), _seed(key, "k")).to(dt)
    v = _randn((int(ki[-1]), 8, 128), _seed(key, "v")).to(dt)
    ks, vs = _scales(_seed(key, "scales"))
    if kind == "ragged":
        w = _wrapper("ragged", "NHD")
        w.plan(qi, ki, 32, 8, 128, causal=True, q_data_type=dt)
        kv_args = (k, v)
    else:
        ps = 16
        pages = [-(-n // ps) for n in kv]
        pin = _indptr(pages)
        cache = torch.zeros((int(pin[-1]) + 1, 2, ps, 8, 128), dtype=dt, device=DEV)
        tok_page = np.concatenate([pin[i] + np.arange(n) // ps for i, n in enumerate(kv)]).astype(np.int64)
        tok_slot = np.concatenate([np.arange(n) % ps for n in kv]).astype(np.int64)
        tp, ts = torch.as_tensor(tok_page, device=DEV), torch.as_tensor(tok_slot, device=DEV)
        cache[:, 0][tp, ts] = k
        cache[:, 1][tp, ts] = v
        last = np.asarray([n - (p - 1) * ps if p else 0 for n, p in zip(kv, pages)], np.int32)
        w = _wrapper("paged", "NHD")
        w.plan(qi, pin, np.arange(int(pin[-1]), dtype=np.int32), last, 32, 8, 128, ps, causal=True, q_data_type=dt)
        kv_args = (cache,)
    out = torch.full_like(q, NAN)
    lse = torch.full((q.shape[0], 32), NAN, device=DEV)
    w.run(q, *kv_args, out=out, lse=lse, return_lse=True, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    Q, K, V = to_numpy_f64(q), to_numpy_f64(k) * ks, to_numpy_f64(v) * vs
    o_np, lse_np = to_numpy_f64(out), to_numpy_f64(lse)
    for i in range(len(qo)):
        if qo[i] == 0:
            continue
        o_ref, lse_ref = attention_ref(Q[qi[i]:qi[i + 1]], K[ki[i]:ki[i + 1]], V[ki[i]:ki[i + 1]], causal=True)
        assert_close(o_np[qi[i]:qi[i + 1]] / vs, o_ref / vs, what=f"req {i} o / v_scale", **O_TOL[dt])
        assert_close(lse_np[qi[i]:qi[i + 1]], lse_ref, what=f"req {i} lse (includes k_scale)", **LSE_TOL[dt])
    # and a run without scales right after: 1.0 again (the struct is not left scaled)
    o1, lse1 = w.run(q, *kv_args, return_lse=True)
    w.run(q, *kv_args, out=out, lse=lse, return_lse=True, k_scale=1.0, v_scale=1.0)
    torch.cuda.synchronize()
    assert torch.equal(o1, out) and torch.equal(lse1, lse)


# ---------------------------------------------------------------------------------------
# run() against an fp8 plan rejects mismatched inputs before launching anything
# ---------------------------------------------------------------------------------------
def test_fp8_run_rejects_mismatches_before_launch():
    b, pg, kv_args = _build(("badrun",), "paged", 5, 64, 400, "append", 16, 16, 4, 128, "fp16", "e4m3", "NHD", "5d")
    w = _wrapper("paged", "NHD")
    _plan(w, "paged", b, pg, True)
    good_o, good_lse = _run_into(w, b, kv_args, k_scale=0.5)
    e5 = pg.store.view(U8).view(torch.float8_e5m2)
    bad = [
        ("cache_16bit", (b.q, pg.store.float().to(F16)), {}, TypeError, r"paged_kv_cache.*float16"),
        ("cache_other_fp8", (b.q, e5), {}, TypeError, r"paged_kv_cache.*float8_e5m2"),
        ("q_bf16", (b.q.to(BF16), pg.cache), {}, TypeError, r"\bq\b"),
        ("k_scale_str", (b.q, pg.cache), dict(k_scale="1"), TypeError, r"k_scale"),
        ("v_scale_zero", (b.q, pg.cache), dict(v_scale=0.0), ValueError, r"v_scale"),
        ("k_scale_tensor", (b.q, pg.cache), dict(k_scale=torch.tensor(0.5)), NotImplementedError, r"k_scale"),
        ("misaligned_view", (b.q, pg.store.view(U8)[..., 8:].view(torch.float8_e4m3fn)[..., :120]), {}, ValueError,
         r"paged_kv_cache"),
    ]
    for name, args, kw, exc, pattern in bad:
        out, lse = _poisoned(b)
        with pytest.raises(exc, match=pattern):
            w.run(*args, out=out, lse=lse, return_lse=True, **kw)
        torch.cuda.synchronize()
        assert torch.isnan(out).all() and torch.isnan(lse).all(), f"{name}: a kernel ran before the error"
        o, l2 = _run_into(w, b, kv_args, k_scale=0.5)
        assert torch.equal(o, good_o) and torch.equal(l2, good_lse), f"after {name}"


# ---------------------------------------------------------------------------------------
# CUDA graphs: fp8 K/V, the scales of the captured run() are baked into the graph
# ---------------------------------------------------------------------------------------
def test_fp8_cuda_graph_replay_bakes_the_captured_scales():
    hq, hkv, d, ps, qdt, kvdt = 16, 4, 128, 16, BF16, "e4m3"
    max_batch, max_pages, pool = 4, 512, 600
    store = _randn((pool, 2, ps, hkv, d), _seed("g-store"), GARBAGE_SCALE).to(FP8[kvdt])
    bufs = dict(qo_indptr_buf=torch.empty(max_batch + 1, dtype=torch.int32, device=DEV),
                paged_kv_indptr_buf=torch.empty(max_batch + 1, dtype=torch.int32, device=DEV),
                paged_kv_indices_buf=torch.empty(max_pages, dtype=torch.int32, device=DEV),
                paged_kv_last_page_len_buf=torch.empty(max_batch, dtype=torch.int32, device=DEV))
    w = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(_workspace(), "NHD", use_cuda_graph=True, **bufs)
    rounds = [([40, 1, 60, 27], [300, 2000, 60, 900]), ([2, 100], [3000, 150]), ([128], [128])]
    T = sum(rounds[0][0])
    q_static = torch.zeros((T, hq, d), dtype=qdt, device=DEV)
    out = torch.full((T, hq, d), NAN, dtype=qdt, device=DEV)
    lse = torch.full((T, hq), NAN, dtype=torch.float32, device=DEV)
    ks, vs = 0.625, 1.75
    g = None
    for j, (qo, kv) in enumerate(rounds):
        b = _batch(qo, kv, hq, hkv, d, qdt, kvdt, _seed("g", j))
        pages = [-(-n // ps) for n in kv]
        kv_indptr = _indptr(pages)
        indices = np.random.default_rng(j).permutation(pool)[:int(kv_indptr[-1])].astype(np.int32)
        last = np.asarray([n - (p - 1) * ps for n, p in zip(kv, pages)], np.int32)
        tok_page = np.concatenate([indices[kv_indptr[i] + np.arange(n) // ps] for i, n in enumerate(kv)])
        tok_slot = np.concatenate([np.arange(n) % ps for n in kv])
        tp = torch.as_tensor(tok_page.astype(np.int64), device=DEV)
        ts = torch.as_tensor(tok_slot.astype(np.int64), device=DEV)
        raw = store.view(U8)
        raw[:, 0][tp, ts] = b.k8.view(U8)
        raw[:, 1][tp, ts] = b.v8.view(U8)
        n = b.q.shape[0]
        q_static[:n].copy_(b.q)
        w.plan(b.qo_indptr, kv_indptr, indices, last, hq, hkv, d, ps, causal=True, q_data_type=qdt,
               kv_data_type=FP8[kvdt])
        if g is None:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                w.run(q_static, store, out=out, lse=lse, return_lse=True, k_scale=ks, v_scale=vs)
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                w.run(q_static, store, out=out, lse=lse, return_lse=True, k_scale=ks, v_scale=vs)
            torch.cuda.synchronize()
        out.fill_(NAN)
        lse.fill_(NAN)
        g.replay()
        torch.cuda.synchronize()
        _check(b, out[:n], lse[:n], _refs(b, True, {}, ks, vs, seed=j), vs, {}, f"graph replay {j}")
