"""single_prefill_with_kv_cache on a CUDA GPU (torch inputs) against the float64 reference.

Every case draws fresh random inputs (seeded from the case, so failures reproduce and no two
cases share data), poisons the outputs with NaN first (the out= buffers directly, the
allocated path through torch's caching allocator) and checks o and the base-2 LSE.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from pyflashattn.testing.gpu import require_cuda_torch

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()

import pyflashattn  # noqa: E402  (after the GPU probe: the CPU box must skip, not error)
from pyflashattn.testing import attention_ref, to_numpy_f64  # noqa: E402
from pyflashattn.testing.checks import assert_close  # noqa: E402

DEV = "cuda"
F16, BF16 = torch.float16, torch.bfloat16
DTYPES = {"fp16": F16, "bf16": BF16}

# FlashInfer's own tolerances. The reference sees the same rounded q/k/v, so what is left is
# fp32 accumulation, P rounded to 16 bits before P@V, and the output rounding (half an ulp:
# 2**-11 relative for fp16, covered by rtol). FlashInfer passes fp16 at 1e-3 with kv up to
# 4096 for the same reasons; if a split-KV merge ever needs more, widen here, not per test.
O_TOL = {F16: dict(atol=1e-3, rtol=1e-3), BF16: dict(atol=1e-2, rtol=1e-2)}
# The LSE is fp32 end to end (row max + log2 of an fp32 sum), so it is far tighter than o in
# principle; the bound allows for a sum accumulated from 16-bit-rounded P.
LSE_TOL = {F16: dict(atol=2e-3, rtol=1e-4), BF16: dict(atol=1e-2, rtol=1e-4)}

# Float64 reference cost is ~qo*kv logits per head; above this many logits per case only a
# subset of q heads is compared (always the first and last, so GQA edges stay covered).
REF_LOGIT_BUDGET = 1 << 27


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def _randn(shape, dtype, seed, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(shape, device=DEV, dtype=torch.float32, generator=g) * scale).to(dtype)


def _make_qkv(qo_len, kv_len, hq, hkv, d, dtype, layout, seed):
    q = _randn((qo_len, hq, d), dtype, seed)
    kshape = (kv_len, hkv, d) if layout == "NHD" else (hkv, kv_len, d)
    k = _randn(kshape, dtype, seed + 1)
    v = _randn(kshape, dtype, seed + 2)
    return q, k, v


def _poison_allocator(*nbytes: int):
    # The caching allocator hands a freed block of the right size back to the next request,
    # so a library-allocated output that is not fully written shows NaN instead of stale data.
    # Best effort (the allocator may pick another block); the out= path is the hard check.
    ts = [torch.full((max(1, n // 2),), float("nan"), dtype=torch.float16, device=DEV)
          for n in nbytes]
    del ts


def _pick_heads(qo_len, kv_len, hq, seed):
    per_head = max(1, qo_len * kv_len)
    n = REF_LOGIT_BUDGET // per_head
    if n >= hq:
        return None
    rng = np.random.default_rng(seed)
    extra = rng.choice(np.arange(1, hq - 1), size=max(1, n - 2), replace=False)
    return np.unique(np.concatenate([[0, hq - 1], extra]))




def _check(o, lse, o_ref, lse_ref, dtype, heads=None, what=""):
    if heads is not None:
        hidx = torch.as_tensor(heads, device=o.device)
        o = o.index_select(1, hidx)
        lse = lse.index_select(1, hidx) if lse is not None else None
    assert_close(o, o_ref, what=f"{what} o", **O_TOL[dtype])
    if lse is not None:
        assert_close(lse, lse_ref, what=f"{what} lse", **LSE_TOL[dtype])


def _ref(q, k, v, heads=None, **kw):
    return attention_ref(q, k, v, heads=heads, **kw)


# ---------------------------------------------------------------------------------------
# Main grid. 21 (qo_len, kv_len) pairs x 4 cases each = 84 cases covering all 72 combinations
# of head_dim x dtype x causal x layout x head config; every pair sees both dtypes, both
# causal modes, both layouts and every head_dim (the formula was chosen by search for that).
# ---------------------------------------------------------------------------------------
LENS = (1, 7, 64, 127, 1000, 4096)
PAIRS = [(a, b) for a in LENS for b in LENS if a <= b]
HEAD_CFGS = ((32, 32), (32, 8), (32, 4))
HEAD_DIMS = (64, 128, 256)


def _grid():
    cases = []
    for p, (qo, kv) in enumerate(PAIRS):
        for j in range(4):
            causal = bool(j % 2)
            dtype = ("fp16", "bf16")[j // 2]
            layout = ("NHD", "HND")[(p + j // 2) % 2]
            d = HEAD_DIMS[(j + p) % 3]
            hq, hkv = HEAD_CFGS[(j + p // 3) % 3]
            cases.append(pytest.param(qo, kv, hq, hkv, d, dtype, causal, layout,
                                      id=f"q{qo}-kv{kv}-h{hq}_{hkv}-d{d}-{dtype}-"
                                         f"{'causal' if causal else 'full'}-{layout}"))
    return cases


@pytest.mark.parametrize("qo_len,kv_len,hq,hkv,d,dtype,causal,layout", _grid())
def test_prefill_grid(qo_len, kv_len, hq, hkv, d, dtype, causal, layout):
    dt = DTYPES[dtype]
    seed = _seed("grid", qo_len, kv_len, hq, hkv, d, dtype, causal, layout)
    q, k, v = _make_qkv(qo_len, kv_len, hq, hkv, d, dt, layout, seed)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()

    # allocated path, poisoned through the allocator
    _poison_allocator(q.numel() * q.element_size(), qo_len * hq * 4)
    o1, lse1 = pyflashattn.single_prefill_with_kv_cache_return_lse(
        q, k, v, causal=causal, kv_layout=layout)
    # out=/lse= path with NaN-filled buffers
    out = torch.full_like(q, float("nan"))
    lse_buf = torch.full((qo_len, hq), float("nan"), dtype=torch.float32, device=DEV)
    o2, lse2 = pyflashattn.single_prefill_with_kv_cache(
        q, k, v, causal=causal, kv_layout=layout, out=out, lse=lse_buf, return_lse=True)
    torch.cuda.synchronize()

    assert o2 is out and lse2 is lse_buf
    assert o1.shape == q.shape and o1.dtype == dt and o1.device == q.device
    assert lse1.shape == (qo_len, hq) and lse1.dtype == torch.float32
    # Same kernel, same inputs: a bitwise difference can only be a race or an unwritten element.
    assert torch.equal(o1, o2) and torch.equal(lse1, lse2), "allocated and out= results differ"
    assert torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(v, v0), "inputs modified"

    heads = _pick_heads(qo_len, kv_len, hq, seed)
    o_ref, lse_ref = _ref(q, k, v, heads=heads, causal=causal, kv_layout=layout)
    _check(o1, lse1, o_ref, lse_ref, dt, heads)


# ---------------------------------------------------------------------------------------
# Short query, long KV: the shapes the implementation splits across CTAs (split-KV + merge).
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("qo_len,kv_len,dtype,causal,layout", [
    (1, 4096, "bf16", False, "NHD"),
    (1, 32768, "fp16", True, "HND"),
    (3, 8192, "fp16", False, "NHD"),
    (5, 16384, "bf16", True, "NHD"),
    (8, 32768, "bf16", False, "HND"),
    (16, 4096, "fp16", True, "NHD"),
    (16, 16384, "fp16", False, "HND"),
    (16, 32768, "bf16", True, "NHD"),
])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (32, 32, 64), (16, 2, 256)])
def test_short_query_long_kv(qo_len, kv_len, dtype, causal, layout, hq, hkv, d):
    dt = DTYPES[dtype]
    seed = _seed("splitkv", qo_len, kv_len, dtype, causal, layout, hq, hkv, d)
    q, k, v = _make_qkv(qo_len, kv_len, hq, hkv, d, dt, layout, seed)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((qo_len, hq), float("nan"), dtype=torch.float32, device=DEV)
    pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=causal, kv_layout=layout,
                                             out=out, lse=lse, return_lse=True)
    torch.cuda.synchronize()
    o_ref, lse_ref = _ref(q, k, v, causal=causal, kv_layout=layout)
    _check(out, lse, o_ref, lse_ref, dt, what=f"qo{qo_len} kv{kv_len}")


def test_peaked_softmax_large_logits():
    # Large sm_scale makes the softmax nearly one-hot and the row max matter: an online
    # softmax that rescales wrongly across KV tiles shows up here, not on flat N(0,1) logits.
    for dt in (F16, BF16):
        q, k, v = _make_qkv(130, 3000, 8, 2, 128, dt, "NHD", _seed("peaked", str(dt)))
        for sm_scale in (0.05, 0.5, 2.0):
            o, lse = pyflashattn.single_prefill_with_kv_cache_return_lse(
                q, k, v, causal=True, sm_scale=sm_scale)
            o_ref, lse_ref = _ref(q, k, v, causal=True, sm_scale=sm_scale)
            _check(o, lse, o_ref, lse_ref, dt, what=f"sm_scale={sm_scale}")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_running_max_jumps(dtype, d):
    # Small logits everywhere except planted keys in later KV tiles that lift one row's max by
    # a chosen amount: below the lazy rescale's slack (8 in log2 units: the stale max is kept),
    # just above it, and far above it (O and l must be rescaled), rising and then falling again.
    dt = DTYPES[dtype]
    qo_len, kv_len, h = 64, 1024, 2
    q, k, v = _make_qkv(qo_len, kv_len, h, h, d, torch.float32, "NHD", _seed("jumps", dtype, d))
    k *= 0.05
    scale = 1.0 / math.sqrt(d)
    plants = [(5, 200, 3.0), (5, 450, 9.0), (5, 700, 40.0), (20, 300, 6.5), (20, 900, 60.0), (40, 130, 50.0),
              (40, 800, 20.0)]  # (row, key, logit in natural units)
    for hd in range(h):
        for row, key, logit in plants:
            qr = q[row, hd]
            k[key, hd] = qr * (logit / (scale * float(qr @ qr)))
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    for causal in (False, True):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((qo_len, h), float("nan"), dtype=torch.float32, device=DEV)
        pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=causal, out=out, lse=lse, return_lse=True)
        o_ref, lse_ref = _ref(q, k, v, causal=causal)
        _check(out, lse, o_ref, lse_ref, dt, what=f"causal={causal}")


def test_lse_single_key_is_scaled_logit_times_log2e():
    q, k, v = _make_qkv(1, 1, 4, 1, 64, F16, "NHD", _seed("onekey"))
    o, lse = pyflashattn.single_prefill_with_kv_cache_return_lse(q, k, v)
    s = (q.double()[0] @ k.double()[0, 0]) / 8.0  # [4] scaled logits
    np.testing.assert_allclose(lse[0].double().cpu().numpy(), (s / math.log(2)).cpu().numpy(),
                               atol=1e-4, rtol=1e-5)
    assert_close(o[0], to_numpy_f64(v[0]).repeat(4, 0), what="o", **O_TOL[F16])


def test_lse_base_ln():
    # lse_base="ln": the natural-log LSE (implemented; a NotImplementedError here is a regression)
    q, k, v = _make_qkv(33, 300, 8, 8, 128, BF16, "NHD", _seed("ln"))
    o, lse = pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True, lse_base="ln")
    o_ref, lse_ref = _ref(q, k, v, causal=True, lse_base="ln")
    _check(o, lse, o_ref, lse_ref, BF16)


# ---------------------------------------------------------------------------------------
# out= / lse= handling
# ---------------------------------------------------------------------------------------
def test_out_and_lse_buffers_honoured():
    dt = F16
    q, k, v = _make_qkv(100, 700, 16, 4, 128, dt, "NHD", _seed("outbuf"))
    o_ref, lse_ref = _ref(q, k, v, causal=True)

    out = torch.full_like(q, float("nan"))
    r = pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=True, out=out)
    assert r is out
    _check(out, None, o_ref, None, dt, what="out= only")

    lse = torch.full((100, 16), float("nan"), dtype=torch.float32, device=DEV)
    r_o, r_lse = pyflashattn.single_prefill_with_kv_cache_return_lse(q, k, v, causal=True, lse=lse)
    assert r_lse is lse
    _check(r_o, lse, o_ref, lse_ref, dt, what="lse= only")

    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    r_o, r_lse = pyflashattn.single_prefill_with_kv_cache_return_lse(
        q, k, v, causal=True, out=out, lse=lse)
    assert r_o is out and r_lse is lse
    _check(out, lse, o_ref, lse_ref, dt, what="out= and lse=")


def test_lse_buffer_without_return_lse_still_written_or_rejected():
    # FlashInfer fills a passed lse buffer; returning o alone must not leave it unwritten
    # silently. Either it is written, or the call refuses the combination.
    q, k, v = _make_qkv(20, 50, 4, 4, 64, BF16, "NHD", _seed("lse-noret"))
    lse = torch.full((20, 4), float("nan"), dtype=torch.float32, device=DEV)
    try:
        r = pyflashattn.single_prefill_with_kv_cache(q, k, v, lse=lse)
    except (ValueError, TypeError):
        return
    assert isinstance(r, torch.Tensor)
    _, lse_ref = _ref(q, k, v)
    assert_close(lse, lse_ref, what="lse= without return_lse", **LSE_TOL[BF16])


# GQA groups that divide neither the row tile (128 / 192 packed rows) nor the sm90 producer's Q row
# step (16 / 8 / 4 rows at head_dim 64 / 128 / 256): row tiles start inside a token's heads, and a
# producer thread's rows wrap past the group's last head.
@pytest.mark.parametrize("hq,hkv,d", [(15, 3, 64), (24, 1, 64), (21, 3, 128), (32, 2, 128), (9, 3, 256),
                                      (10, 2, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_uneven_gqa_groups(monkeypatch, hq, hkv, d, causal):
    from pyflashattn._engine import single
    monkeypatch.setattr(single._tls, "plans", {}, raising=False)
    qo_len, kv_len = 301, 517
    seed = _seed("uneven-group", hq, hkv, d, causal)
    q, k, v = _make_qkv(qo_len, kv_len, hq, hkv, d, BF16, "NHD", seed)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((qo_len, hq), float("nan"), dtype=torch.float32, device=DEV)
    pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=causal, out=out, lse=lse, return_lse=True)
    if torch.cuda.get_device_capability() == (9, 0):  # the rows this covers: the sm90 family's producers
        metas = [pl.attn.meta for pl in single._tls.plans.values()]
        assert metas and all(m.get("impl") == "sm90" for m in metas), [m.get("name") for m in metas]
    o_ref, lse_ref = _ref(q, k, v, causal=causal)
    _check(out, lse, o_ref, lse_ref, BF16, what=f"group {hq // hkv}")


# ---------------------------------------------------------------------------------------
# Strided inputs
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_non_contiguous_views(layout, dtype):
    dt = DTYPES[dtype]
    qo_len, kv_len, hq, hkv, d = 77, 513, 16, 4, 128
    seed = _seed("strided", layout, dtype)
    # q: the first D columns of a [T, H, 2D] tensor (last dim contiguous, larger row stride)
    q = _randn((qo_len, hq, 2 * d), dt, seed)[..., :d]
    # k: the other layout's storage transposed into this one (token and head strides swap)
    if layout == "NHD":
        k = _randn((hkv, kv_len, d), dt, seed + 1).transpose(0, 1)
    else:
        k = _randn((kv_len, hkv, d), dt, seed + 1).transpose(0, 1)
    # v: one head of a fused [kv, 3, Hkv, D]-style buffer (K/V interleaved storage)
    fused = _randn((kv_len, 3, hkv, d), dt, seed + 2)
    v = fused[:, 2] if layout == "NHD" else fused[:, 2].transpose(0, 1)
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    for causal in (False, True):
        o, lse = pyflashattn.single_prefill_with_kv_cache_return_lse(
            q, k, v, causal=causal, kv_layout=layout)
        o_ref, lse_ref = _ref(q, k, v, causal=causal, kv_layout=layout)
        _check(o, lse, o_ref, lse_ref, dt, what=f"strided causal={causal}")
        # and equal to the contiguous copies' answer
        oc, lsec = pyflashattn.single_prefill_with_kv_cache_return_lse(
            q.contiguous(), k.contiguous(), v.contiguous(), causal=causal, kv_layout=layout)
        torch.testing.assert_close(o, oc, atol=0, rtol=0)
        torch.testing.assert_close(lse, lsec, atol=0, rtol=0)


def test_last_dim_stride_not_one_is_rejected_or_correct():
    q, k, v = _make_qkv(16, 64, 4, 4, 128, F16, "NHD", _seed("stride-last"))
    q_bad = _randn((16, 4, 256), F16, _seed("stride-last-q"))[..., ::2]
    try:
        o = pyflashattn.single_prefill_with_kv_cache(q_bad, k, v)
    except ValueError as e:
        assert "q" in str(e)
        return
    o_ref, _ = _ref(q_bad, k, v)
    _check(o, None, o_ref, None, F16, what="q with stride(-1)=2")


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------
def test_causal_kv_shorter_than_qo_raises():
    q, k, v = _make_qkv(64, 32, 4, 4, 128, F16, "NHD", _seed("causal-short"))
    with pytest.raises(ValueError, match="(?i)kv_len|qo_len"):
        pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=True)
    # non-causal with kv_len < qo_len is fine
    o = pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=False)
    o_ref, _ = _ref(q, k, v)
    _check(o, None, o_ref, None, F16)


def _good():
    return _make_qkv(16, 40, 8, 2, 128, F16, "NHD", _seed("good"))


def _bad_cases():
    # (id, builder -> (args, kwargs), exception types, regex naming the argument)
    def rank(q, k, v):
        return (q[:, 0], k, v), {}

    def heads(q, k, v):
        return (q, _randn((40, 3, 128), F16, 5), _randn((40, 3, 128), F16, 6)), {}

    def hd96(q, k, v):
        return tuple(_randn((n, h, 96), F16, 7 + n) for n, h in ((16, 8), (40, 2), (40, 2))), {}

    def dtype_mismatch(q, k, v):
        return (q, k.to(BF16), v), {}

    def fp32(q, k, v):
        return (q.float(), k.float(), v.float()), {}

    def cpu(q, k, v):
        return (q.cpu(), k, v), {}

    def out_shape(q, k, v):
        return (q, k, v), {"out": torch.empty(16, 8, 64, dtype=F16, device=DEV)}

    def out_dtype(q, k, v):
        return (q, k, v), {"out": torch.empty(16, 8, 128, dtype=BF16, device=DEV)}

    def lse_shape(q, k, v):
        return (q, k, v), {"lse": torch.empty(8, 16, dtype=torch.float32, device=DEV),
                           "return_lse": True}

    def lse_dtype(q, k, v):
        return (q, k, v), {"lse": torch.empty(16, 8, dtype=F16, device=DEV), "return_lse": True}

    def kv_mismatch(q, k, v):
        return (q, k, v[:39]), {}

    def layout(q, k, v):
        return (q, k, v), {"kv_layout": "NDH"}

    def hd_mismatch(q, k, v):
        return (q, _randn((40, 2, 64), F16, 9), v), {}

    VE, TE = ValueError, TypeError
    return [
        ("rank", rank, (VE,), r"(?i)\bq\b|rank|dim"),
        ("heads_not_divisible", heads, (VE,), r"(?i)head"),
        ("head_dim_96", hd96, (VE, TE), r"(?i)head_dim"),
        ("dtype_mismatch", dtype_mismatch, (VE, TE), r"(?i)dtype"),
        ("fp32", fp32, (VE, TE), r"(?i)dtype|float32"),
        ("cpu_tensor", cpu, (VE, TE), r"(?i)\bq\b|device|cuda"),
        ("out_shape", out_shape, (VE,), r"(?i)\bout\b"),
        ("out_dtype", out_dtype, (VE, TE), r"(?i)\bout\b"),
        ("lse_shape", lse_shape, (VE,), r"(?i)\blse\b"),
        ("lse_dtype", lse_dtype, (VE, TE), r"(?i)\blse\b"),
        ("kv_len_mismatch", kv_mismatch, (VE,), r"(?i)\bv\b|\bk\b|kv"),
        ("bad_layout", layout, (VE,), r"(?i)kv_layout"),
        ("head_dim_mismatch", hd_mismatch, (VE,), r"(?i)head_dim|\bk\b"),
    ]


@pytest.mark.parametrize("name,build,exc,pattern", [pytest.param(*c, id=c[0]) for c in _bad_cases()])
def test_bad_inputs_raise_then_recover(name, build, exc, pattern):
    q, k, v = _good()
    args, kwargs = build(q, k, v)
    with pytest.raises(exc, match=pattern):
        pyflashattn.single_prefill_with_kv_cache(*args, **kwargs)
    # nothing sticky: a correct call right after still works
    o = pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=True)
    torch.cuda.synchronize()
    o_ref, _ = _ref(q, k, v, causal=True)
    _check(o, None, o_ref, None, F16, what=f"after {name}")


def test_explicit_defaults_accepted():
    q, k, v = _make_qkv(24, 90, 8, 4, 64, BF16, "NHD", _seed("defaults"))
    o = pyflashattn.single_prefill_with_kv_cache(
        q, k, v, custom_mask=None, packed_custom_mask=None, causal=True, kv_layout="NHD",
        pos_encoding_mode="NONE", allow_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
        logits_soft_cap=None, rope_scale=None, rope_theta=None)
    o_ref, _ = _ref(q, k, v, causal=True)
    _check(o, None, o_ref, None, BF16)
    # An explicit cap <= 0 is rejected by contract (None is "no cap"), and the library keeps working.
    with pytest.raises(ValueError, match="logits_soft_cap"):
        pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=True, logits_soft_cap=0.0)
    o0 = pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=True, logits_soft_cap=None)
    torch.testing.assert_close(o0, o, atol=0, rtol=0)


def _matches_reference(call, ref_kwargs, q, k, v, dt, tol=None):
    # These options are implemented: each must compute the reference (any exception, including
    # NotImplementedError, fails the test).
    o, lse = call()
    o_ref, lse_ref = _ref(q, k, v, **ref_kwargs)
    if tol is None:
        _check(o, lse, o_ref, lse_ref, dt)
    else:
        assert_close(o, o_ref, what="o", **tol)


@pytest.mark.parametrize("option", ["custom_mask", "packed_custom_mask", "window_left",
                                    "logits_soft_cap", "alibi", "rope_llama"])
def test_options_match_reference(option):
    dt = F16
    qo_len, kv_len = 40, 96
    q, k, v = _make_qkv(qo_len, kv_len, 8, 2, 128, dt, "NHD", _seed("later", option))
    f = pyflashattn.single_prefill_with_kv_cache_return_lse
    g = torch.Generator(device=DEV).manual_seed(_seed("mask", option))
    mask = torch.rand(qo_len, kv_len, device=DEV, generator=g) < 0.7
    if option == "custom_mask":
        _matches_reference(lambda: f(q, k, v, custom_mask=mask),
                           dict(custom_mask=mask.cpu().numpy()), q, k, v, dt)
    elif option == "packed_custom_mask":
        bits = np.packbits(mask.cpu().numpy().reshape(-1), bitorder="little")
        packed = torch.from_numpy(bits).to(DEV)
        _matches_reference(lambda: f(q, k, v, packed_custom_mask=packed),
                           dict(custom_mask=mask.cpu().numpy()), q, k, v, dt)
    elif option == "window_left":
        _matches_reference(lambda: f(q, k, v, causal=True, window_left=17),
                           dict(causal=True, window_left=17), q, k, v, dt)
    elif option == "logits_soft_cap":
        _matches_reference(lambda: f(q, k, v, logits_soft_cap=2.0, sm_scale=0.5),
                           dict(logits_soft_cap=2.0, sm_scale=0.5), q, k, v, dt)
    elif option == "alibi":
        _matches_reference(lambda: f(q, k, v, causal=True, pos_encoding_mode="ALIBI"),
                           dict(causal=True, pos_encoding_mode="ALIBI"), q, k, v, dt)
    elif option == "rope_llama":
        # the kernel rotates in fp32 and rounds q/k back to 16 bits before the MMA
        _matches_reference(
            lambda: f(q, k, v, causal=True, pos_encoding_mode="ROPE_LLAMA", rope_theta=500.0),
            dict(causal=True, pos_encoding_mode="ROPE_LLAMA", rope_theta=500.0), q, k, v, dt,
            tol=dict(atol=1e-2, rtol=1e-2))


def test_fp16_qk_reduction_is_not_implemented_by_design():
    # Rejected on purpose (options.resolve: QK^T is always reduced in fp32), before any launch;
    # the library keeps working after it.
    q, k, v = _make_qkv(40, 96, 8, 2, 128, F16, "NHD", _seed("later", "fp16_qk_reduction"))
    with pytest.raises(NotImplementedError, match="allow_fp16_qk_reduction"):
        pyflashattn.single_prefill_with_kv_cache(q, k, v, allow_fp16_qk_reduction=True)
    o = pyflashattn.single_prefill_with_kv_cache(q, k, v, allow_fp16_qk_reduction=False)
    o_ref, _ = _ref(q, k, v)
    _check(o, None, o_ref, None, F16)


# ---------------------------------------------------------------------------------------
# Streams
# ---------------------------------------------------------------------------------------
def _delayed_write(stream, dst, src):
    # Spin ~tens of ms on `stream`, then fill dst: work queued on any other stream reads the
    # NaN poison instead, so the result proves which stream the kernel ran on.
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)
        dst.copy_(src)


def test_stream_argument_orders_after_stream_work():
    dt = BF16
    q_src, k, v = _make_qkv(200, 1500, 16, 4, 128, dt, "NHD", _seed("stream"))
    o_ref, lse_ref = _ref(q_src, k, v, causal=True)
    s = torch.cuda.Stream()
    q = torch.full_like(q_src, float("nan"))
    out = torch.full_like(q_src, float("nan"))
    lse = torch.full((200, 16), float("nan"), dtype=torch.float32, device=DEV)
    torch.cuda.synchronize()
    _delayed_write(s, q, q_src)
    pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=True, out=out, lse=lse,
                                             return_lse=True, stream=s)
    s.synchronize()
    _check(out, lse, o_ref, lse_ref, dt, what="stream=")
    # and the same bits as the default-stream call
    o_d, lse_d = pyflashattn.single_prefill_with_kv_cache_return_lse(q_src, k, v, causal=True)
    torch.cuda.synchronize()
    assert torch.equal(o_d, out) and torch.equal(lse_d, lse)


def test_current_torch_stream_used_by_default():
    dt = F16
    q_src, k, v = _make_qkv(64, 800, 8, 8, 64, dt, "HND", _seed("curstream"))
    o_ref, lse_ref = _ref(q_src, k, v, kv_layout="HND")
    s = torch.cuda.Stream()
    q = torch.full_like(q_src, float("nan"))
    torch.cuda.synchronize()
    _delayed_write(s, q, q_src)
    with torch.cuda.stream(s):
        o, lse = pyflashattn.single_prefill_with_kv_cache_return_lse(q, k, v, kv_layout="HND")
    s.synchronize()
    _check(o, lse, o_ref, lse_ref, dt, what="current stream")


# ---------------------------------------------------------------------------------------
# L2 sections (routing.l2_section, forced to one kv head a section) and the tail after them
# (routing.section_head_z): a grid of several waves, so both parts of LogicalGrid's order run.
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("qo_len,kv_len,hq,hkv,d,dtype", [
    (4096, 4096, 32, 8, 128, "bf16"),   # persistent rows on the stream's scheduler counters
    (6001, 6001, 16, 16, 64, "fp16"),   # persistent, partial last row tile
    (4096, 4096, 16, 4, 256, "bf16"),   # a CTA a block: the hardware's launch order
])
def test_l2_sections_and_their_tail_cover_every_block(monkeypatch, qo_len, kv_len, hq, hkv, d, dtype):
    from pyflashattn._engine import routing, single
    monkeypatch.setenv(routing.L2_SECTION_ENV, "1e-9")
    monkeypatch.setattr(single._tls, "plans", {}, raising=False)
    dt = DTYPES[dtype]
    seed = _seed("sections", qo_len, kv_len, hq, hkv, d, dtype)
    q, k, v = _make_qkv(qo_len, kv_len, hq, hkv, d, dt, "NHD", seed)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((qo_len, hq), float("nan"), dtype=torch.float32, device=DEV)
    pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=True, out=out, lse=lse, return_lse=True)
    torch.cuda.synchronize()
    ps = [pl.attn.params for pl in single._tls.plans.values()]
    assert any(p.grid_section == 1 and 0 < p.grid_section_z < p.grid_z for p in ps), \
        [(p.grid_x, p.grid_z, p.grid_section, p.grid_section_z) for p in ps]
    heads = _pick_heads(qo_len, kv_len, hq, seed)
    o_ref, lse_ref = _ref(q, k, v, heads=heads, causal=True)
    _check(out, lse, o_ref, lse_ref, dt, heads, what="sections")
