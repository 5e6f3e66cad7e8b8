"""single_prefill_with_kv_cache options on a CUDA GPU (torch inputs) against the float64 reference.

Options: custom_mask / packed_custom_mask, window_left, logits_soft_cap, pos_encoding_mode
ALIBI / ROPE_LLAMA (rope_scale, rope_theta), lse_base; alone, in the combinations users hit,
on split-KV shapes (short q, long kv) and in a seeded random sweep.

Every case draws fresh random inputs (seeded from the case, so a failure reproduces and no two
cases share data), writes into out=/lse= buffers prefilled with NaN and checks o and the LSE.
Where a test claims to cover a feature it also checks, on the float64 references, that the
feature moves the answer well outside the tolerance; otherwise a kernel that ignored the option
would pass and the test would prove nothing.

Conventions (FlashInfer, semantics notes section 1): LSE base 2 over the scaled logits;
bottom-right causal; window inclusive from the bottom-right position (left bound only without
causal); a custom mask replaces causal and is ANDed with the window; packed masks are
little-endian, bit q*kv_len + kv; the soft cap acts on the scaled logit; ALiBi uses FlashInfer's
slopes and the unshifted query row (so the LSE includes slope*(kv - q_row)); ROPE_LLAMA is
rotate-half with q at i + kv_len - qo_len and k at its index. A fully masked row gives o = 0 and
lse = -inf.

Cost: the float64 numpy reference dominates (tens of ns per logit, mostly single-threaded), so
sizes stay modest and big cases compare a subset of q heads (first, last and random others).
"""

from __future__ import annotations

import math
import random
import zlib
from types import SimpleNamespace

import numpy as np
import pytest

from pyflashattn.testing.gpu import require_cuda_torch

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()

import pyflashattn  # noqa: E402  (after the GPU probe: the CPU box must skip, not error)
from pyflashattn.testing import alibi_slopes, attention_ref, to_numpy, to_numpy_f64  # noqa: E402
from pyflashattn.testing.checks import assert_close  # noqa: E402
from pyflashattn.testing.reference import _rope_llama  # noqa: E402  (float64 rotate-half)

DEV = "cuda"
F16, BF16 = torch.float16, torch.bfloat16
DTYPES = {"fp16": F16, "bf16": BF16}
LN2 = math.log(2.0)

# Same tolerances as tests/gpu/test_prefill.py (FlashInfer's): the reference sees the same
# rounded q/k/v, so what is left is fp32 accumulation, P rounded to 16 bits before P@V and the
# output rounding.
O_TOL = {F16: dict(atol=1e-3, rtol=1e-3), BF16: dict(atol=1e-2, rtol=1e-2)}
LSE_TOL = {F16: dict(atol=2e-3, rtol=1e-4), BF16: dict(atol=1e-2, rtol=1e-4)}
# ROPE_LLAMA, fp16 o only: atol 2e-3 instead of 1e-3. The kernel rotates q and k in fp32 and
# rounds them back to 16 bits before the MMA (as FlashInfer does); the reference rotates the
# unrounded values in float64. That extra rounding (up to 2^-11 relative per element) plus the
# fp32 angle (pos * inv_freq rounds to ~5e-4 rad at pos 8192) moves each logit by ~1e-4..1e-3.
# An emulation of exactly that (fp32 rotation, fp16 rounding, float64 attention) against this
# reference showed o errors up to 7.8e-4 above the rtol part on causal 512x512 (rows with 2-3
# keys are the worst: no averaging), on top of the ~3e-4 the plain fp16 path already uses, so
# 1e-3 would sit at the edge. bf16 needs nothing extra: emulated RoPE error <= 5.4e-3 < 1e-2,
# LSE <= 6.3e-3 (bf16) / 6.5e-4 (fp16), inside LSE_TOL. Any real RoPE bug (interleaved pairs,
# unshifted q position, ignored rope_scale/theta) moves o by O(0.1-1).
ROPE_O_TOL = {F16: dict(atol=2e-3, rtol=1e-3), BF16: O_TOL[BF16]}

# Reference cost bound: above this many logits per case only a subset of q heads is compared.
REF_LOGIT_BUDGET = 1 << 23


# ---------------------------------------------------------------------------------------
# helpers (kept local: test modules are imported with importlib, not as a package)
# ---------------------------------------------------------------------------------------
def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def _randn(shape, dtype, seed, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(shape, device=DEV, dtype=torch.float32, generator=g) * scale).to(dtype)


def _make_qkv(qo_len, kv_len, hq, hkv, d, dtype, layout, seed, q_scale=1.0):
    q = _randn((qo_len, hq, d), dtype, seed, q_scale)
    kshape = (kv_len, hkv, d) if layout == "NHD" else (hkv, kv_len, d)
    return q, _randn(kshape, dtype, seed + 1), _randn(kshape, dtype, seed + 2)


def _rand_mask(qo_len, kv_len, density, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.rand((qo_len, kv_len), device=DEV, generator=g) < density


def _pack_np(mask_np: np.ndarray) -> np.ndarray:
    """Independent packer: numpy, little bit order, bit q*kv_len + kv."""
    return np.packbits(np.asarray(mask_np, dtype=bool).reshape(-1), bitorder="little")


def _pack(mask, pad_garbage=0):
    """Packed CUDA uint8 mask; the unused bits of the last byte and ``pad_garbage`` extra
    bytes are set to 1 so a kernel that reads past qo*kv bits shows it."""
    m = to_numpy(mask).astype(bool)
    bits = _pack_np(m)
    n = m.size
    if n % 8:
        bits[-1] |= np.uint8((0xFF << (n % 8)) & 0xFF)
    if pad_garbage:
        bits = np.concatenate([bits, np.full(pad_garbage, 0xFF, np.uint8)])
    return torch.from_numpy(bits).to(DEV)


def _pick_heads(qo_len, kv_len, hq, seed, budget=REF_LOGIT_BUDGET):
    n = budget // max(1, qo_len * kv_len)
    if n >= hq:
        return None
    rng = np.random.default_rng(seed)
    extra = rng.choice(np.arange(1, hq - 1), size=min(hq - 2, max(0, n - 2)), replace=False)
    return np.unique(np.concatenate([[0, hq - 1], extra])).astype(np.int64)




def _sel(t, heads):
    if heads is None or t is None:
        return t
    return t.index_select(1, torch.as_tensor(heads, device=t.device))


def _otol(dtype, opts):
    return (ROPE_O_TOL if opts.get("pos_encoding_mode") == "ROPE_LLAMA" else O_TOL)[dtype]


def _check(o, lse, o_ref, lse_ref, dtype, opts, heads=None, what=""):
    assert_close(_sel(o, heads), o_ref, what=f"{what} o", **_otol(dtype, opts))
    if lse is not None:
        assert_close(_sel(lse, heads), lse_ref, what=f"{what} lse", **LSE_TOL[dtype])


def _run(q, k, v, **kw):
    """One call into NaN-poisoned out=/lse= buffers; returns (o, lse)."""
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[1]), float("nan"), dtype=torch.float32, device=DEV)
    r = pyflashattn.single_prefill_with_kv_cache(q, k, v, out=out, lse=lse, return_lse=True, **kw)
    torch.cuda.synchronize()
    assert r[0] is out and r[1] is lse, "out=/lse= buffers not returned"
    return out, lse


_REF_KEYS = ("causal", "kv_layout", "sm_scale", "window_left", "logits_soft_cap", "pos_encoding_mode",
             "rope_scale", "rope_theta", "lse_base")


def _ref(q, k, v, opts, mask=None, heads=None):
    kw = {key: opts[key] for key in _REF_KEYS if key in opts}
    m = None if mask is None else to_numpy(mask).astype(bool)
    return attention_ref(q, k, v, custom_mask=m, heads=heads, **kw)


def _assert_visible(o_feat, o_other, dtype, what, factor=3.0):
    """The feature must move the float64 answer by > factor x the o tolerance somewhere."""
    tol = O_TOL[dtype]
    excess = np.abs(o_feat - o_other) - factor * (tol["atol"] + tol["rtol"] * np.abs(o_other))
    assert excess.max() > 0, (f"{what}: the reference barely changes (max |diff| "
                              f"{np.abs(o_feat - o_other).max():.2e}); this case cannot see the feature")


def _case(key, qo_len, kv_len, hq, hkv, d, dtype, layout="NHD", *, mask=None, packed=False,
          q_scale=1.0, visible=(), budget=REF_LOGIT_BUDGET, **opts):
    """Run one option case and check it against the reference.

    ``mask``: None, a density in (0, 1], or a callable (qo, kv, seed) -> bool CUDA tensor.
    ``visible``: (label, override opts, override mask) triples: the reference computed with the
    overrides must differ clearly from the real one (proves the case exercises the feature).
    Returns a namespace: q, k, v, mask, o, lse, heads, o_ref, lse_ref.
    """
    dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
    seed = _seed(key, qo_len, kv_len, hq, hkv, d, str(dt), layout, repr(sorted(opts.items())))
    q, k, v = _make_qkv(qo_len, kv_len, hq, hkv, d, dt, layout, seed, q_scale)
    m = None
    if mask is not None:
        m = mask(qo_len, kv_len, seed + 3) if callable(mask) else _rand_mask(qo_len, kv_len, mask, seed + 3)
    snap = [x.clone() for x in (q, k, v) + ((m,) if m is not None else ())]
    call = dict(opts, kv_layout=layout)
    if m is not None:
        call["packed_custom_mask" if packed else "custom_mask"] = _pack(m, pad_garbage=3) if packed else m
    o, lse = _run(q, k, v, **call)
    for a, b in zip((q, k, v) + ((m,) if m is not None else ()), snap):
        assert torch.equal(a, b), "an input was modified"
    heads = _pick_heads(qo_len, kv_len, hq, seed, budget)
    ref_opts = dict(opts, kv_layout=layout)
    o_ref, lse_ref = _ref(q, k, v, ref_opts, m, heads)
    _check(o, lse, o_ref, lse_ref, dt, opts, heads, what=key)
    for label, over, over_mask in visible:
        alt_mask = m if over_mask is None else (None if over_mask is False else over_mask(m))
        o_alt, _ = _ref(q, k, v, dict(ref_opts, **over), alt_mask, heads)
        _assert_visible(o_ref, o_alt, dt, f"{key}: vs {label}")
    return SimpleNamespace(q=q, k=k, v=v, mask=m, o=o, lse=lse, heads=heads, o_ref=o_ref, lse_ref=lse_ref)


def _causal_tril(qo_len, kv_len):
    return torch.ones((qo_len, kv_len), dtype=torch.bool, device=DEV).tril(kv_len - qo_len)


def _with_empty_rows(density, rows):
    """Random mask of ``density`` whose rows ``rows`` (negative = from the end) are all False."""
    def make(qo_len, kv_len, seed):
        m = _rand_mask(qo_len, kv_len, density, seed)
        for r in rows:
            if -qo_len <= r < qo_len:
                m[r] = False
        return m
    return make


NO_MASK = ("no mask", {}, False)


# ---------------------------------------------------------------------------------------
# Custom masks
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("density,qo_len,kv_len,hq,hkv,d,dtype,layout,causal", [
    (0.1, 100, 300, 8, 2, 64, "fp16", "NHD", False),
    (0.1, 257, 257, 16, 4, 128, "bf16", "HND", True),   # causal=True is ignored with a mask
    (0.5, 64, 1000, 32, 4, 128, "fp16", "HND", False),  # mask x GQA 32/4
    (0.5, 300, 128, 8, 8, 256, "bf16", "NHD", False),   # qo_len > kv_len
    (0.5, 200, 200, 8, 2, 128, "fp16", "NHD", True),    # kv_len = qo_len, causal ignored
    (0.9, 130, 700, 12, 3, 64, "bf16", "NHD", True),
    (0.9, 1, 513, 8, 1, 256, "fp16", "HND", False),     # qo_len = 1
    (0.9, 520, 1100, 32, 8, 128, "bf16", "HND", False),  # several row tiles, GQA 32/8
])
def test_custom_mask(density, qo_len, kv_len, hq, hkv, d, dtype, layout, causal):
    visible = [NO_MASK]
    if causal:
        # were causal ANDed in, rows would lose their keys above the diagonal
        visible.append(("mask & causal", {}, lambda m: m & _causal_tril(qo_len, kv_len)))
    _case("mask", qo_len, kv_len, hq, hkv, d, dtype, layout, mask=density, causal=causal,
          visible=visible if density < 1 else ())


@pytest.mark.parametrize("qo_len,kv_len,hq,hkv,d,dtype,layout", [
    (37, 91, 8, 2, 128, "fp16", "NHD"),    # 3367 bits: the last byte is partial (padding bits = 1)
    (128, 1024, 16, 16, 64, "bf16", "HND"),  # whole bytes
    (5, 3, 4, 4, 256, "fp16", "NHD"),      # 15 bits, qo_len > kv_len
    (1, 4099, 8, 2, 128, "bf16", "NHD"),   # one row, odd kv_len
])
def test_packed_custom_mask(qo_len, kv_len, hq, hkv, d, dtype, layout):
    # (the tiny 5x3 case is too small for the "mask is visible" guard to be reliable)
    r = _case("packed", qo_len, kv_len, hq, hkv, d, dtype, layout, mask=0.5, packed=True,
              visible=[NO_MASK] if qo_len * kv_len > 100 else ())
    q, k, v, m, o, lse = r.q, r.k, r.v, r.mask, r.o, r.lse
    # the bool mask (packed inside the call) and its packed form reach the same kernel: same bits
    o_b, lse_b = _run(q, k, v, kv_layout=layout, custom_mask=m)
    o_p, lse_p = _run(q, k, v, kv_layout=layout, packed_custom_mask=_pack(m))
    assert torch.equal(o_b, o_p) and torch.equal(lse_b, lse_p), "bool mask and packed mask differ"
    assert torch.equal(o_p, o) and torch.equal(lse_p, lse), "padding bits / trailing bytes changed the result"
    # both given: the packed one wins (FlashInfer); the bool one here is the complement
    o_w, lse_w = _run(q, k, v, kv_layout=layout, custom_mask=~m, packed_custom_mask=_pack(m))
    assert torch.equal(o_w, o_p) and torch.equal(lse_w, lse_p), "packed_custom_mask must win over custom_mask"


def test_packbits_api_matches_numpy():
    from pyflashattn.quantization import packbits

    for n in (1, 7, 8, 9, 64, 12345):
        x = torch.rand(n, device=DEV, generator=torch.Generator(device=DEV).manual_seed(n)) < 0.4
        xn = x.cpu().numpy()
        for order in ("little", "big"):
            y = packbits(x, bitorder=order)
            assert isinstance(y, torch.Tensor) and y.is_cuda and y.dtype == torch.uint8
            np.testing.assert_array_equal(y.cpu().numpy(), np.packbits(xn, bitorder=order), err_msg=order)
        # FlashInfer's default is numpy's "big", which is NOT what attention masks need
        np.testing.assert_array_equal(packbits(x).cpu().numpy(), np.packbits(xn))
    # 2-D mask flattened row-major, little order = the attention layout
    m = _rand_mask(13, 29, 0.5, 7)
    np.testing.assert_array_equal(packbits(m.flatten(), bitorder="little").cpu().numpy(),
                                  _pack_np(m.cpu().numpy()))


def test_custom_mask_equivalences():
    q, k, v = _make_qkv(150, 600, 16, 4, 128, F16, "NHD", _seed("equiv"))
    # tril(kv_len - qo_len) custom mask == causal (FlashInfer's docstring example)
    o_c, lse_c = _run(q, k, v, causal=True)
    o_m, lse_m = _run(q, k, v, custom_mask=_causal_tril(150, 600))
    o_ref, lse_ref = _ref(q, k, v, dict(causal=True))
    _check(o_c, lse_c, o_ref, lse_ref, F16, {}, what="causal")
    _check(o_m, lse_m, o_ref, lse_ref, F16, {}, what="tril mask")
    # an all-True mask == no mask
    o_t, lse_t = _run(q, k, v, packed_custom_mask=_pack(torch.ones(150, 600, dtype=torch.bool, device=DEV)))
    o_ref, lse_ref = _ref(q, k, v, {})
    _check(o_t, lse_t, o_ref, lse_ref, F16, {}, what="all-True mask")


def test_non_contiguous_mask_rejected_or_correct():
    q, k, v = _make_qkv(40, 96, 8, 2, 128, BF16, "NHD", _seed("mask-strided"))
    mt = _rand_mask(96, 40, 0.5, _seed("mask-strided-m")).t()  # [40, 96] view, strides (1, 40)
    assert not mt.is_contiguous()
    try:
        o, lse = _run(q, k, v, custom_mask=mt)
    except ValueError as e:
        assert "custom_mask" in str(e)
        return
    o_ref, lse_ref = _ref(q, k, v, {}, mt)
    _check(o, lse, o_ref, lse_ref, BF16, {}, what="strided mask")


def test_bool_mask_packed_on_the_call_stream():
    # The mask is written late on stream s; the in-call packing must run on s (stream=), so it
    # reads the real mask, not the all-False poison (which would give o = 0, lse = -inf).
    q, k, v = _make_qkv(64, 900, 8, 2, 128, BF16, "NHD", _seed("mask-stream"))
    m_src = _rand_mask(64, 900, 0.6, _seed("mask-stream-m"))
    o_ref, lse_ref = _ref(q, k, v, {}, m_src)
    m = torch.zeros_like(m_src)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((64, 8), float("nan"), dtype=torch.float32, device=DEV)
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(100_000_000)
        m.copy_(m_src)
    pyflashattn.single_prefill_with_kv_cache(q, k, v, custom_mask=m, out=out, lse=lse, return_lse=True, stream=s)
    s.synchronize()
    _check(out, lse, o_ref, lse_ref, BF16, {}, what="mask on stream=")


def test_bad_mask_inputs_raise_then_recover():
    q, k, v = _make_qkv(16, 40, 8, 2, 128, F16, "NHD", _seed("bad-mask"))
    good = _rand_mask(16, 40, 0.5, 1)
    bad = [
        (dict(custom_mask=good[:, :39]), ValueError, "custom_mask"),
        (dict(custom_mask=good.t().contiguous()), ValueError, "custom_mask"),
        (dict(custom_mask=good.cpu()), ValueError, "custom_mask"),
        (dict(custom_mask=good.half()), TypeError, "custom_mask"),
        (dict(packed_custom_mask=_pack(good)[:-1]), ValueError, "packed_custom_mask"),
        (dict(packed_custom_mask=_pack(good).cpu()), ValueError, "packed_custom_mask"),
        (dict(packed_custom_mask=_pack(good).int()), TypeError, "packed_custom_mask"),
        (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
        (dict(pos_encoding_mode="ALIBI", logits_soft_cap=30.0), ValueError, "(?i)alibi|logits_soft_cap"),
        (dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=-1.0), ValueError, "rope_theta"),
        (dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=0.0), ValueError, "rope_scale"),
        (dict(allow_fp16_qk_reduction=True), NotImplementedError, "allow_fp16_qk_reduction"),
    ]
    for kw, exc, pat in bad:
        with pytest.raises(exc, match=pat):
            pyflashattn.single_prefill_with_kv_cache(q, k, v, **kw)
    o, lse = _run(q, k, v, custom_mask=good)
    o_ref, lse_ref = _ref(q, k, v, {}, good)
    _check(o, lse, o_ref, lse_ref, F16, {}, what="after bad mask inputs")


# ---------------------------------------------------------------------------------------
# window_left
# ---------------------------------------------------------------------------------------
_WIN_SHAPES = [(128, 700, 16, 4, 128, "fp16", "NHD"), (300, 300, 8, 2, 64, "bf16", "HND"),
               (1, 2000, 32, 8, 256, "fp16", "HND"), (77, 1500, 12, 12, 128, "bf16", "NHD")]


def _window_cases():
    cases = []
    for i, w in enumerate((0, 1, 17, 1000)):
        for j, causal in enumerate((False, True)):
            qo, kv, hq, hkv, d, dt, lay = _WIN_SHAPES[(i + 2 * j) % 4]
            cases.append(pytest.param(w, causal, qo, kv, hq, hkv, d, dt, lay,
                                      id=f"w{w}-{'causal' if causal else 'full'}-q{qo}-kv{kv}-d{d}-{dt}-{lay}"))
    # non-causal with qo_len > kv_len: early rows sit at negative positions (window keeps all)
    cases.append(pytest.param(17, False, 200, 64, 8, 2, 128, "fp16", "NHD", id="w17-full-qo>kv"))
    cases.append(pytest.param(0, False, 200, 64, 8, 8, 64, "bf16", "HND", id="w0-full-qo>kv"))
    return cases


@pytest.mark.parametrize("window,causal,qo_len,kv_len,hq,hkv,d,dtype,layout", _window_cases())
def test_window_left(window, causal, qo_len, kv_len, hq, hkv, d, dtype, layout):
    # the window only bites where some row's left bound p - window lies above key 0
    bites = kv_len - 1 - window > 0
    _case("window", qo_len, kv_len, hq, hkv, d, dtype, layout, causal=causal, window_left=window,
          visible=[("no window", {"window_left": -1}, None)] if bites else ())


def test_window_covering_everything_equals_no_window():
    q, k, v = _make_qkv(100, 400, 8, 2, 128, BF16, "NHD", _seed("wide-window"))
    for causal in (False, True):
        o_ref, lse_ref = _ref(q, k, v, dict(causal=causal))
        for w in (399, 500, 10**6):
            o, lse = _run(q, k, v, causal=causal, window_left=w)
            _check(o, lse, o_ref, lse_ref, BF16, {}, what=f"window {w} causal={causal}")


# ---------------------------------------------------------------------------------------
# logits_soft_cap (q scaled up so logits reach tens: with N(0,1) logits a cap of 30 is a no-op)
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("cap", [1.0, 30.0])
@pytest.mark.parametrize("qo_len,kv_len,hq,hkv,d,dtype,layout,causal,sm_scale", [
    (150, 600, 8, 2, 128, "fp16", "NHD", False, None),
    (64, 64, 16, 4, 64, "bf16", "HND", True, 0.3),   # sm_scale inside the tanh, not outside
    (1, 1000, 8, 8, 256, "fp16", "HND", False, None),
    (333, 900, 12, 4, 128, "bf16", "NHD", True, None),
])
def test_soft_cap(cap, qo_len, kv_len, hq, hkv, d, dtype, layout, causal, sm_scale):
    _case("softcap", qo_len, kv_len, hq, hkv, d, dtype, layout, q_scale=6.0, causal=causal, sm_scale=sm_scale,
          logits_soft_cap=cap, visible=[("no cap", {"logits_soft_cap": None}, None)])


def test_soft_cap_saturated_logits_stay_finite():
    # |logits| in the hundreds: every score sits at +-cap; nothing may overflow or turn NaN.
    for dt in (F16, BF16):
        _case("softcap-sat", 96, 500, 8, 2, 128, dt, "NHD", q_scale=50.0, causal=True, sm_scale=1.0,
              logits_soft_cap=30.0)


# ---------------------------------------------------------------------------------------
# ALiBi (LSE includes slope * (kv - q_row) with the unshifted row: qo_len != kv_len tells)
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("hq,hkv,qo_len,kv_len,causal,dtype,d,layout", [
    (8, 2, 77, 500, False, "fp16", 128, "NHD"),
    (8, 8, 300, 300, True, "bf16", 64, "HND"),
    (12, 4, 50, 800, True, "fp16", 256, "HND"),    # 12 heads: the non-power-of-two slopes
    (12, 12, 200, 90, False, "bf16", 128, "NHD"),  # qo_len > kv_len: negative distances
    (12, 3, 1, 1000, False, "fp16", 64, "NHD"),    # decode-like row
    (32, 8, 128, 512, True, "bf16", 128, "NHD"),   # ALiBi x causal x GQA 32/8
    (32, 4, 96, 96, True, "fp16", 128, "HND"),     # ALiBi x causal x GQA 32/4
])
def test_alibi(hq, hkv, qo_len, kv_len, causal, dtype, d, layout):
    _case("alibi", qo_len, kv_len, hq, hkv, d, dtype, layout, causal=causal, pos_encoding_mode="ALIBI",
          visible=[("no ALiBi", {"pos_encoding_mode": "NONE"}, None)])


def test_alibi_lse_uses_unshifted_query_row():
    # One key per row (window 0, causal): o = v[p] whatever the bias, so only the LSE can show
    # the convention: lse = (q.k*sm_scale + slope*(p - i)) * log2(e) with p - i = kv_len - qo_len.
    qo_len, kv_len, hq = 20, 1000, 8
    q, k, v = _make_qkv(qo_len, kv_len, hq, 2, 128, F16, "NHD", _seed("alibi-row"))
    o, lse = _run(q, k, v, causal=True, window_left=0, pos_encoding_mode="ALIBI")
    o_ref, lse_ref = _ref(q, k, v, dict(causal=True, window_left=0, pos_encoding_mode="ALIBI"))
    _check(o, lse, o_ref, lse_ref, F16, {}, what="alibi one key")
    _, lse_plain = _ref(q, k, v, dict(causal=True, window_left=0))
    slopes = alibi_slopes(hq)
    np.testing.assert_allclose(lse_ref - lse_plain, np.broadcast_to(slopes * (kv_len - qo_len) / LN2,
                                                                     lse_ref.shape), rtol=1e-9)


# ---------------------------------------------------------------------------------------
# ROPE_LLAMA
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("rope_scale,rope_theta", [(None, None), (2.0, 5e5), (0.5, 500.0), (8.0, 1e6)])
@pytest.mark.parametrize("qo_len,kv_len,hq,hkv,d,dtype,layout,causal", [
    (100, 400, 8, 8, 128, "fp16", "NHD", True),
    (64, 1000, 32, 8, 128, "bf16", "HND", False),   # RoPE x GQA 32/8
    (200, 333, 32, 4, 64, "fp16", "NHD", True),     # RoPE x GQA 32/4
    (1, 2048, 8, 2, 256, "bf16", "NHD", False),     # q at position kv_len - 1
    (50, 50, 4, 1, 256, "fp16", "HND", True),
])
def test_rope_llama(rope_scale, rope_theta, qo_len, kv_len, hq, hkv, d, dtype, layout, causal):
    visible = [("no RoPE", {"pos_encoding_mode": "NONE"}, None)]
    if rope_scale is not None:
        visible.append(("default rope_scale/theta", {"rope_scale": None, "rope_theta": None}, None))
    r = _case("rope", qo_len, kv_len, hq, hkv, d, dtype, layout, causal=causal, pos_encoding_mode="ROPE_LLAMA",
              rope_scale=rope_scale, rope_theta=rope_theta, visible=visible)
    if qo_len != kv_len:
        # FlashInfer puts query i at position i + kv_len - qo_len. Guard: a kernel that rotated q
        # at position i instead would be visibly wrong here (RoPE depends on p_q - p_k only).
        rs = 1.0 if rope_scale is None else rope_scale
        rt = 1e4 if rope_theta is None else rope_theta
        qn, kn = to_numpy_f64(r.q), to_numpy_f64(r.k)
        if layout == "HND":
            kn = kn.transpose(1, 0, 2)
        qu = _rope_llama(qn, np.arange(qo_len), rs, rt)
        ku = _rope_llama(kn, np.arange(kv_len), rs, rt)
        o_unshifted, _ = attention_ref(qu, ku, to_numpy_f64(r.v).transpose(1, 0, 2) if layout == "HND"
                                       else to_numpy_f64(r.v), causal=causal, heads=r.heads)
        _assert_visible(r.o_ref, o_unshifted, DTYPES[dtype], "rope: vs unshifted q position")


def test_rope_defaults_explicit_equal_none():
    q, k, v = _make_qkv(70, 300, 8, 2, 128, BF16, "NHD", _seed("rope-defaults"))
    a = _run(q, k, v, causal=True, pos_encoding_mode="ROPE_LLAMA")
    b = _run(q, k, v, causal=True, pos_encoding_mode="ROPE_LLAMA", rope_scale=1.0, rope_theta=1e4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------------------------------
# Combinations users hit
# ---------------------------------------------------------------------------------------
def _mask_empty_by_window(window, density=0.7):
    """Random mask, but rows 0, 3 and the last keep only keys left of their window (p - window),
    so mask AND window leaves them empty: o = 0, lse = -inf."""
    def make(qo_len, kv_len, seed):
        m = _rand_mask(qo_len, kv_len, density, seed)
        for r in (0, 3, qo_len - 1):
            p = r + kv_len - qo_len
            m[r, :] = False
            m[r, : max(0, p - window)] = True
        return m
    return make


COMBOS = {
    "mask_x_window": dict(qo=120, kv=500, hq=8, hkv=2, d=128, dt="fp16", lay="NHD",
                          mask=_mask_empty_by_window(20), opts=dict(window_left=20),
                          visible=[("no window", {"window_left": -1}, None)]),
    "mask_x_window_causal_ignored": dict(qo=64, kv=64, hq=16, hkv=4, d=64, dt="bf16", lay="HND",
                                         mask=_mask_empty_by_window(5), opts=dict(window_left=5, causal=True)),
    "softcap_x_window_causal": dict(qo=200, kv=600, hq=8, hkv=2, d=128, dt="fp16", lay="NHD", q_scale=6.0,
                                    opts=dict(causal=True, window_left=33, logits_soft_cap=30.0),
                                    visible=[("no window", {"window_left": -1}, None),
                                             ("no cap", {"logits_soft_cap": None}, None)]),
    "softcap_x_window": dict(qo=50, kv=700, hq=16, hkv=16, d=256, dt="bf16", lay="HND", q_scale=6.0,
                             opts=dict(window_left=100, logits_soft_cap=5.0),
                             visible=[("no window", {"window_left": -1}, None)]),
    "softcap_x_mask": dict(qo=90, kv=300, hq=8, hkv=4, d=64, dt="fp16", lay="NHD", q_scale=6.0, mask=0.4,
                           opts=dict(logits_soft_cap=10.0), visible=[("no cap", {"logits_soft_cap": None}, None)]),
    "alibi_x_window_causal": dict(qo=256, kv=1024, hq=12, hkv=4, d=128, dt="bf16", lay="NHD",
                                  opts=dict(causal=True, window_left=64, pos_encoding_mode="ALIBI")),
    "alibi_x_mask": dict(qo=80, kv=400, hq=8, hkv=1, d=128, dt="fp16", lay="HND", mask=0.5,
                         opts=dict(pos_encoding_mode="ALIBI"),
                         visible=[("no ALiBi", {"pos_encoding_mode": "NONE"}, None)]),
    "rope_x_window_causal": dict(qo=100, kv=800, hq=32, hkv=8, d=128, dt="fp16", lay="NHD",
                                 opts=dict(causal=True, window_left=50, pos_encoding_mode="ROPE_LLAMA",
                                           rope_theta=5e5)),
    "rope_x_mask_gqa": dict(qo=60, kv=500, hq=32, hkv=4, d=128, dt="bf16", lay="HND", mask=0.5,
                            opts=dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=4.0)),
    "mask_x_softcap_x_window_ln": dict(qo=100, kv=300, hq=8, hkv=2, d=128, dt="fp16", lay="NHD", q_scale=4.0,
                                       mask=_mask_empty_by_window(40, 0.8),
                                       opts=dict(window_left=40, logits_soft_cap=20.0, lse_base="ln")),
    "alibi_x_window_x_mask_ln": dict(qo=33, kv=257, hq=12, hkv=12, d=64, dt="bf16", lay="NHD",
                                     mask=_mask_empty_by_window(9, 0.6),
                                     opts=dict(window_left=9, pos_encoding_mode="ALIBI", lse_base="ln")),
}


@pytest.mark.parametrize("name", list(COMBOS))
def test_combination(name):
    c = COMBOS[name]
    _case(name, c["qo"], c["kv"], c["hq"], c["hkv"], c["d"], c["dt"], c["lay"], mask=c.get("mask"),
          q_scale=c.get("q_scale", 1.0), visible=c.get("visible", ()), **c["opts"])


# ---------------------------------------------------------------------------------------
# lse_base = "ln"
# ---------------------------------------------------------------------------------------
LN_CASES = {
    "plain_causal": dict(qo=80, kv=300, opts=dict(causal=True)),
    "window": dict(qo=80, kv=300, opts=dict(causal=True, window_left=10)),
    "softcap": dict(qo=80, kv=300, opts=dict(logits_soft_cap=30.0)),
    "alibi": dict(qo=80, kv=300, opts=dict(pos_encoding_mode="ALIBI")),
    "rope": dict(qo=80, kv=300, opts=dict(pos_encoding_mode="ROPE_LLAMA")),
    "mask_empty_rows": dict(qo=80, kv=300, mask=_with_empty_rows(0.5, (0, 5, -1)), opts={}),
    "split_kv_window": dict(qo=4, kv=16384, opts=dict(causal=True, window_left=3000)),
    "split_kv_mask_empty_row": dict(qo=6, kv=12000, mask=_with_empty_rows(0.3, (2,)), opts={}),
}


@pytest.mark.parametrize("name", list(LN_CASES))
def test_lse_base_ln_is_ln2_times_log2(name):
    c = LN_CASES[name]
    dt = BF16 if "split" in name else F16
    hq, hkv = 16, 4
    seed = _seed("ln", name)
    q, k, v = _make_qkv(c["qo"], c["kv"], hq, hkv, 128, dt, "NHD", seed, 4.0 if "softcap" in name else 1.0)
    m = c["mask"](c["qo"], c["kv"], seed + 3) if "mask" in c else None
    kw = dict(c["opts"], **({"custom_mask": m} if m is not None else {}))
    o2, lse2 = _run(q, k, v, **kw)
    o_e, lse_e = _run(q, k, v, lse_base="ln", **kw)
    assert torch.equal(o2, o_e), "lse_base must not change o"
    assert_close(lse_e, to_numpy_f64(lse2) * LN2, atol=1e-6, rtol=1e-6, what="ln lse vs ln2 * log2 lse")
    heads = _pick_heads(c["qo"], c["kv"], hq, seed)
    o_ref, lse_ref = _ref(q, k, v, dict(c["opts"], lse_base="ln"), m, heads)
    _check(o_e, lse_e, o_ref, lse_ref, dt, c["opts"], heads, what=f"{name} ln")


# ---------------------------------------------------------------------------------------
# Fully masked rows (o = 0, lse = -inf, never NaN) and extreme logits
# ---------------------------------------------------------------------------------------
EMPTY_CASES = {
    "mask": dict(qo=40, kv=300, opts={}),
    "mask_causal_flag": dict(qo=40, kv=300, opts=dict(causal=True)),
    "mask_softcap": dict(qo=40, kv=300, opts=dict(logits_soft_cap=5.0)),
    "mask_alibi": dict(qo=40, kv=300, opts=dict(pos_encoding_mode="ALIBI")),
    "mask_rope": dict(qo=40, kv=300, opts=dict(pos_encoding_mode="ROPE_LLAMA")),
    "mask_window": dict(qo=40, kv=300, opts=dict(window_left=30)),
    "mask_ln": dict(qo=40, kv=300, opts=dict(lse_base="ln")),
    "split_kv": dict(qo=4, kv=16384, opts={}),
    "split_kv_alibi": dict(qo=3, kv=8192, opts=dict(pos_encoding_mode="ALIBI")),
    "split_kv_qo1": dict(qo=1, kv=16384, opts=dict(logits_soft_cap=30.0)),
}


@pytest.mark.parametrize("packed", [False, True], ids=["bool", "packed"])
@pytest.mark.parametrize("name", list(EMPTY_CASES))
def test_fully_masked_rows(name, packed):
    c = EMPTY_CASES[name]
    qo, kv, hq, hkv = c["qo"], c["kv"], 32, 8
    rows = (0, 1) if qo < 8 else (0, 7, 8, 23, qo - 1)
    rows = rows if qo > 1 else (0,)
    for dt in (F16, BF16):
        seed = _seed("empty", name, packed, str(dt))
        # large logits too (live rows peaked), except RoPE: its 16-bit re-rounding of rotated q/k
        # scales with |logit| and ROPE_O_TOL is sized for N(0,1) logits
        rope = c["opts"].get("pos_encoding_mode") == "ROPE_LLAMA"
        q, k, v = _make_qkv(qo, kv, hq, hkv, 128, dt, "HND" if packed else "NHD", seed,
                            q_scale=1.0 if rope else 20.0)
        m = _rand_mask(qo, kv, 0.3, seed + 3)
        m[list(rows)] = False
        opts = dict(c["opts"], kv_layout="HND" if packed else "NHD")
        o, lse = _run(q, k, v, **opts, **({"packed_custom_mask": _pack(m)} if packed else {"custom_mask": m}))
        r = torch.as_tensor(rows, device=DEV)
        assert not torch.isnan(o).any() and not torch.isnan(lse).any(), "NaN in o/lse"
        assert torch.equal(o[r], torch.zeros_like(o[r])), "fully masked rows must give o = 0"
        assert bool(torch.isneginf(lse[r]).all()), "fully masked rows must give lse = -inf"
        live = torch.ones(qo, dtype=torch.bool, device=DEV)
        live[r] = False
        if live.any():
            assert bool(torch.isfinite(lse[live]).all()) and bool(torch.isfinite(o[live]).all())
        heads = _pick_heads(qo, kv, hq, seed)
        o_ref, lse_ref = _ref(q, k, v, opts, m, heads)
        _check(o, lse, o_ref, lse_ref, dt, opts, heads, what=f"{name} {dt}")


def test_all_false_mask():
    for qo, kv in ((1, 1), (17, 333), (2, 9000)):
        q, k, v = _make_qkv(qo, kv, 8, 2, 64, BF16, "NHD", _seed("all-false", qo, kv))
        m = torch.zeros(qo, kv, dtype=torch.bool, device=DEV)
        for kw in ({"custom_mask": m}, {"packed_custom_mask": _pack(m)},
                   {"custom_mask": m, "logits_soft_cap": 3.0}, {"custom_mask": m, "pos_encoding_mode": "ALIBI"}):
            o, lse = _run(q, k, v, **kw)
            assert torch.equal(o, torch.zeros_like(o)), f"{kw.keys()}: o must be 0"
            assert bool(torch.isneginf(lse).all()), f"{kw.keys()}: lse must be -inf"


def test_extreme_logits_stay_finite():
    # sm_scale = 1 with q ~ N(0, 40^2): logits ~ +-500 (base-2 ~ 700); exp must not overflow
    # anywhere (row max subtraction), including with ALiBi over a long, split KV.
    for dt in (F16, BF16):
        for opts in (dict(causal=True), dict(window_left=100), dict(pos_encoding_mode="ALIBI"),
                     dict(logits_soft_cap=50.0, causal=True)):
            for qo, kv in ((64, 700), (2, 12000)):
                _case("extreme", qo, kv, 16, 4, 128, dt, "NHD", q_scale=40.0, sm_scale=1.0, **opts)


def test_extreme_logits_rope_finite():
    # RoPE at logits ~ +-500: the rotated q/k are re-rounded to 16 bits (as in FlashInfer), which
    # moves such logits by ~0.1-1, so no tight reference comparison; o must still be finite, a
    # convex combination of v rows (|o| <= max |v|), and the LSE finite and near the reference's.
    for dt in (F16, BF16):
        for qo, kv in ((64, 700), (2, 12000)):
            q, k, v = _make_qkv(qo, kv, 16, 4, 128, dt, "NHD", _seed("extreme-rope", qo, kv, str(dt)), 40.0)
            o, lse = _run(q, k, v, sm_scale=1.0, pos_encoding_mode="ROPE_LLAMA", causal=True)
            assert bool(torch.isfinite(o).all()) and bool(torch.isfinite(lse).all())
            assert float(o.abs().max()) <= float(v.abs().max()) * (1 + 1e-2)
            _, lse_ref = _ref(q, k, v, dict(sm_scale=1.0, pos_encoding_mode="ROPE_LLAMA", causal=True))
            assert_close(lse, lse_ref, atol=8.0, rtol=2e-2, what="rope extreme lse")


# ---------------------------------------------------------------------------------------
# Short query, long KV (split-KV + merge) with options
# ---------------------------------------------------------------------------------------
SPLIT_CASES = [
    # qo, kv, hq, hkv, d, dtype, layout, mask, q_scale, opts
    (1, 8192, 32, 8, 128, "bf16", "NHD", 0.5, 1.0, {}),
    (16, 16384, 16, 2, 128, "fp16", "HND", _with_empty_rows(0.3, (5,)), 1.0, {}),
    (3, 8192, 32, 4, 64, "fp16", "NHD", None, 6.0, dict(logits_soft_cap=30.0)),
    (8, 16384, 32, 8, 256, "bf16", "NHD", None, 6.0, dict(logits_soft_cap=1.0, causal=True)),
    (1, 16384, 32, 8, 128, "fp16", "NHD", None, 1.0, dict(pos_encoding_mode="ALIBI")),
    (16, 8192, 12, 4, 128, "bf16", "HND", None, 1.0, dict(pos_encoding_mode="ALIBI", causal=True)),
    (5, 8192, 32, 8, 128, "fp16", "NHD", None, 1.0, dict(causal=True, window_left=100)),
    (16, 16384, 16, 2, 64, "bf16", "NHD", None, 1.0, dict(window_left=5000)),
    (2, 8192, 32, 8, 128, "fp16", "HND", None, 1.0, dict(causal=True, window_left=0)),
    (4, 8192, 32, 4, 128, "bf16", "NHD", 0.5, 4.0, dict(window_left=3000, logits_soft_cap=10.0)),
    (7, 10000, 16, 4, 128, "fp16", "NHD", None, 1.0, dict(pos_encoding_mode="ROPE_LLAMA", causal=True)),
    (12, 9000, 32, 8, 128, "bf16", "NHD", 0.7, 1.0, dict(pos_encoding_mode="ALIBI", window_left=2000)),
]


@pytest.mark.parametrize("qo_len,kv_len,hq,hkv,d,dtype,layout,mask,q_scale,opts", [
    pytest.param(*c, id=f"q{c[0]}-kv{c[1]}-h{c[2]}_{c[3]}-d{c[4]}-{c[5]}-{c[6]}-"
                        + ("mask-" if c[7] is not None else "") + "-".join(f"{k}={v}" for k, v in c[9].items()))
    for c in SPLIT_CASES])
def test_short_query_long_kv_options(qo_len, kv_len, hq, hkv, d, dtype, layout, mask, q_scale, opts):
    _case("split", qo_len, kv_len, hq, hkv, d, dtype, layout, mask=mask, q_scale=q_scale, **opts)


# ---------------------------------------------------------------------------------------
# "Off" values leave the plain path bit-for-bit unchanged
# ---------------------------------------------------------------------------------------
OFF_VARIANTS = [
    dict(logits_soft_cap=None), dict(window_left=-1),
    dict(pos_encoding_mode="NONE"), dict(pos_encoding_mode="NONE", rope_scale=4.0, rope_theta=500.0),
    dict(custom_mask=None, packed_custom_mask=None), dict(allow_fp16_qk_reduction=False),
    dict(lse_base="log2"), dict(sm_scale=None),
    dict(logits_soft_cap=None, window_left=-1, pos_encoding_mode="NONE", custom_mask=None,
         packed_custom_mask=None, allow_fp16_qk_reduction=False, lse_base="log2", rope_scale=None,
         rope_theta=None),
]


@pytest.mark.parametrize("qo_len,kv_len,hq,hkv,dtype,layout", [
    (150, 700, 16, 4, "bf16", "NHD"), (4, 8192, 32, 8, "fp16", "HND"), (1, 1, 8, 8, "fp16", "NHD")])
@pytest.mark.parametrize("causal", [False, True])
def test_off_values_are_bitwise_plain(qo_len, kv_len, hq, hkv, dtype, layout, causal):
    dt = DTYPES[dtype]
    q, k, v = _make_qkv(qo_len, kv_len, hq, hkv, 128, dt, layout, _seed("off", qo_len, kv_len, dtype, causal))
    base_o, base_lse = _run(q, k, v, causal=causal, kv_layout=layout)
    o_ref, lse_ref = _ref(q, k, v, dict(causal=causal, kv_layout=layout))
    _check(base_o, base_lse, o_ref, lse_ref, dt, {}, what="plain")
    for kw in OFF_VARIANTS:
        o, lse = _run(q, k, v, causal=causal, kv_layout=layout, **kw)
        assert torch.equal(o, base_o) and torch.equal(lse, base_lse), f"{kw} changed the plain result"


# ---------------------------------------------------------------------------------------
# Seeded random sweep: (qo_len, kv_len, window, causal, mask density, head_dim, dtype, layout,
# heads, soft cap, position encoding, lse_base). Each case's id carries its parameters.
# ---------------------------------------------------------------------------------------
N_RANDOM = 40
_HEADS = ((8, 8), (8, 2), (16, 4), (12, 3), (32, 8), (4, 1), (12, 12))


def _random_cases():
    rnd = random.Random(0x5EED_0137)
    cases = []
    for i in range(N_RANDOM):
        d = rnd.choice((64, 128, 256))
        dtype = rnd.choice(("fp16", "bf16"))
        layout = rnd.choice(("NHD", "HND"))
        hq, hkv = rnd.choice(_HEADS)
        qo = max(1, int(math.exp(rnd.uniform(0, math.log(700)))))
        kv = max(1, int(math.exp(rnd.uniform(0, math.log(3000)))))
        r = rnd.random()
        if r < 0.15:
            kv = qo
        elif r < 0.25:
            qo = 1
        mode = rnd.choice(("NONE", "NONE", "NONE", "ALIBI", "ROPE_LLAMA"))
        # An explicit cap <= 0 is a ValueError by contract; None is "no cap".
        cap = None if mode == "ALIBI" else rnd.choice((None, None, 1.0, 30.0))
        density = rnd.choice((None, None, 0.05, 0.3, 0.7, 0.95, 1.0))
        causal = rnd.random() < 0.5
        if causal and density is None and kv < qo:
            qo, kv = kv, qo
        window = rnd.choice((-1, -1, 0, 1, 17, rnd.randint(0, kv + qo + 2)))
        packed = density is not None and rnd.random() < 0.5
        empty = density is not None and rnd.random() < 0.3
        lse_base = rnd.choice(("log2", "log2", "ln"))
        rope = rnd.choice(((None, None), (2.0, 5e5))) if mode == "ROPE_LLAMA" else (None, None)
        p = dict(qo=qo, kv=kv, hq=hq, hkv=hkv, d=d, dtype=dtype, layout=layout, causal=causal, window=window,
                 density=density, packed=packed, empty=empty, cap=cap, mode=mode, rope=rope, lse_base=lse_base)
        cid = (f"{i:02d}-q{qo}-kv{kv}-h{hq}_{hkv}-d{d}-{dtype}-{layout}-{'c' if causal else 'f'}-w{window}"
               f"-m{density}{'p' if packed else ''}{'e' if empty else ''}-cap{cap}-{mode}-{lse_base}")
        cases.append(pytest.param(p, id=cid))
    return cases


@pytest.mark.parametrize("p", _random_cases())
def test_random_options(p):
    dt = DTYPES[p["dtype"]]
    seed = _seed("random", repr(sorted(p.items())))
    # scaled q so a cap bites; not with RoPE (its tolerance is sized for N(0,1) logits)
    q, k, v = _make_qkv(p["qo"], p["kv"], p["hq"], p["hkv"], p["d"], dt, p["layout"], seed,
                        q_scale=4.0 if p["cap"] and p["mode"] != "ROPE_LLAMA" else 1.0)
    opts = dict(causal=p["causal"], window_left=p["window"], logits_soft_cap=p["cap"],
                pos_encoding_mode=p["mode"], lse_base=p["lse_base"], kv_layout=p["layout"])
    if p["mode"] == "ROPE_LLAMA":
        opts.update(rope_scale=p["rope"][0], rope_theta=p["rope"][1])
    m = None
    call = dict(opts)
    if p["density"] is not None:
        m = _rand_mask(p["qo"], p["kv"], p["density"], seed + 3)
        if p["empty"]:
            m[:: max(1, p["qo"] // 3)] = False
        call["packed_custom_mask" if p["packed"] else "custom_mask"] = _pack(m, 2) if p["packed"] else m
    o, lse = _run(q, k, v, **call)
    # the allocated path writes every element too, and gives the same bits
    o_a, lse_a = pyflashattn.single_prefill_with_kv_cache(q, k, v, return_lse=True, **call)
    torch.cuda.synchronize()
    assert torch.equal(o_a, o) and torch.equal(lse_a, lse), "allocated and out= results differ"
    heads = _pick_heads(p["qo"], p["kv"], p["hq"], seed, budget=1 << 22)
    o_ref, lse_ref = _ref(q, k, v, opts, m, heads)
    _check(o, lse, o_ref, lse_ref, dt, opts, heads, what="random")
