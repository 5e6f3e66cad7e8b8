"""Batch engine on the simulated driver: fp8 K/V kernel choice and addressing, k_scale / v_scale,
and plan()'s settings cache."""
from __future__ import annotations

import ctypes
import math
import sys
import time

import numpy as np
import pytest

import pyflashattn
from pyflashattn._engine import routing
from pyflashattn._runtime import cuda as _cuda, dtypes as _dtypes, registry as _registry, tensor as _tensor
from pyflashattn.testing.fake_tensors import FakeProducer, fake_cuda_tensor
from pyflashattn.testing.fake_driver import (  # noqa: F401 - the shared fixtures' vocabulary
    Paged, Ragged, f32, BF16, BOOL, D, E4M3, E5M2, F16, FakeDriver, FakeEnv, FakeTorch, FakeTorchTensor, HKV,
    HQ, I32, KV_INDICES, KV_INDPTR, LAST, LOG2E, MASK_BITS, NPAGES, PS, QO, RAGGED_KV, T, TKV, TQ, U8, WS,
    _META, _TorchDtype, _decode_variant, _simulate_packbits, cache_t, i32, kv_t, last_attn, lse_t, out_t,
    paged, plan_paged, plan_ragged, q_t, ragged)


# ---------------------------------------------------------------------------------------------
# fp8 KV
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qdt", [F16, BF16])
@pytest.mark.parametrize("kvdt, code", [(E4M3, 1), (E5M2, 2), (None, 0)])
@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_plan_picks_the_kv_dtype_kernel(fake, kind, qdt, kvdt, code):
    w = paged(fake) if kind == "paged" else ragged(fake)
    (plan_paged if kind == "paged" else plan_ragged)(w, q_data_type=qdt.name,
                                                     kv_data_type=None if kvdt is None else kvdt.name)
    la = w._engine.attn
    assert la.meta["kv_dtype"] == ("fp8" if kvdt else qdt.short) and la.meta["dtype"] == qdt.short
    assert la.meta["paged"] is (kind == "paged")
    assert la.params.kv_fp8 == code
    kv_dtype = kvdt or qdt
    if kind == "paged":
        w.run(q_t(qdt), cache_t(kv_dtype), out=out_t(qdt))
    else:
        w.run(q_t(qdt), kv_t(kv_dtype), kv_t(kv_dtype, data=0x380000), out=out_t(qdt))
    name, grid, stream, p = last_attn(fake)
    assert p.kv_fp8 == code and name == la.name


def test_fp8_paged_pointers_and_strides_are_in_elements(fake):
    w = paged(fake, layout="HND")
    plan_paged(w, q_data_type="bfloat16", kv_data_type="float8_e5m2")
    c = cache_t(E5M2, "HND")  # [P, 2, Hkv, PS, D], one byte per element
    w.run(q_t(BF16), c, out=out_t(BF16))
    p = last_attn(fake)[3]
    assert p.k == 0x200000 and p.v == 0x200000 + HKV * PS * D  # strides[1] elements = bytes
    assert (p.k_stride_page, p.k_stride_h, p.k_stride_n) == (2 * HKV * PS * D, PS * D, D)
    assert (p.v_stride_page, p.v_stride_h, p.v_stride_n) == (2 * HKV * PS * D, PS * D, D)
    # a (k, v) tuple of separate fp8 caches
    kc = T((NPAGES, HKV, PS, D), E5M2, data=0x600000)
    vc = T((NPAGES, HKV, PS, D), E5M2, data=0x700000)
    w.run(q_t(BF16), (kc, vc), out=out_t(BF16))
    p = last_attn(fake)[3]
    assert (p.k, p.v, p.k_stride_page, p.v_stride_n) == (0x600000, 0x700000, HKV * PS * D, D)


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_run_rejects_kv_of_another_dtype_than_planned(fake, kind):
    w = paged(fake) if kind == "paged" else ragged(fake)
    (plan_paged if kind == "paged" else plan_ragged)(w, kv_data_type="float8_e4m3fn")
    bad = [
        (F16, r"(paged_kv_cache|\bk\b).*float16.*float8_e4m3fn"),  # the 16-bit cache on an fp8 plan
        (E5M2, r"float8_e5m2.*float8_e4m3fn"),  # the other fp8 format
    ]
    for dt, pattern in bad:
        with pytest.raises(TypeError, match=pattern):
            if kind == "paged":
                w.run(q_t(), cache_t(dt), out=out_t())
            else:
                w.run(q_t(), kv_t(dt), kv_t(dt), out=out_t())
    with pytest.raises(TypeError, match=r"\bq\b.*bfloat16.*float16"):
        w.run(q_t(BF16), *((cache_t(E4M3),) if kind == "paged" else (kv_t(E4M3), kv_t(E4M3))), out=out_t())
    assert not fake.attn_launches(), "a kernel ran before the error"
    # 16-bit plan, fp8 cache: also refused
    (plan_paged if kind == "paged" else plan_ragged)(w)
    with pytest.raises(TypeError, match=r"float8_e4m3fn.*float16"):
        w.run(q_t(), *((cache_t(E4M3),) if kind == "paged" else (kv_t(E4M3), kv_t(E4M3))), out=out_t())
    assert not fake.attn_launches()


def test_fp8_alignment_is_16_bytes_not_8_elements(fake):
    # Row strides of 136 elements: 16-byte rows for 16-bit K/V (272 bytes), not for fp8 (136 bytes).
    st = (HKV * 136, 136, 1)
    for kvdt, ok in ((F16, True), (E4M3, False)):
        w = ragged(fake)
        plan_ragged(w, kv_data_type=kvdt.name)
        args = (q_t(), kv_t(kvdt, strides=st), kv_t(kvdt, strides=st, data=0x380000))
        if ok:
            w.run(*args, out=out_t())
        else:
            with pytest.raises(ValueError, match=r"\bk\b.*16-byte.*16 elements"):
                w.run(*args, out=out_t())
    # fp8 data pointer 8 bytes off a 16-byte boundary
    w = ragged(fake)
    plan_ragged(w, kv_data_type="e4m3")
    n = len(fake.attn_launches())
    with pytest.raises(ValueError, match=r"\bv\b.*address %16 = 8"):
        w.run(q_t(), kv_t(E4M3), kv_t(E4M3, data=0x380008), out=out_t())
    # a paged fp8 cache whose K -> V offset (strides[1]) is not a multiple of 16 bytes
    w = paged(fake)
    plan_paged(w, kv_data_type="e4m3")
    odd = T((NPAGES, 2, PS, HKV, D), E4M3, strides=(2 * PS * HKV * D + 16, PS * HKV * D + 8, HKV * D, D, 1))
    with pytest.raises(ValueError, match=r"paged_kv_cache.*16-byte"):
        w.run(q_t(), odd, out=out_t())
    assert len(fake.attn_launches()) == n


def test_fp8_with_rope_and_general_options_uses_the_general_fp8_kernel(fake):
    # FlashInfer rejects fp8 KV + ROPE_LLAMA; our kernel widens K/V to 16 bits before RoPE.
    w = paged(fake)
    plan_paged(w, kv_data_type="float8_e4m3fn", pos_encoding_mode="ROPE_LLAMA", rope_theta=5e5)
    assert w._engine.attn.meta["general"] is True and w._engine.attn.meta["kv_dtype"] == "fp8"
    assert w._engine.attn.params.rope == 1 and w._engine.attn.params.kv_fp8 == 1


# ---------------------------------------------------------------------------------------------
# k_scale / v_scale
# ---------------------------------------------------------------------------------------------
def _run(w, kind, kvdt=F16, **kw):
    if kind == "paged":
        return w.run(q_t(), cache_t(kvdt), out=out_t(), **kw)
    return w.run(q_t(), kv_t(kvdt), kv_t(kvdt, data=0x380000), out=out_t(), **kw)


@pytest.mark.parametrize("kvdt", [F16, E4M3])
@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_scales_fold_into_the_kernel_params(fake, kind, kvdt):
    # every KV dtype, both wrappers (FlashInfer's ragged wrapper ignores them: not here)
    w = paged(fake) if kind == "paged" else ragged(fake)
    (plan_paged if kind == "paged" else plan_ragged)(w, kv_data_type=kvdt.name, sm_scale=0.125)
    base = 0.125 * LOG2E
    for ks, vs in [(None, None), (0.5, 2.0), (0.5, 2.0), (3, None), (np.float32(0.75), np.int64(4)),
                   (None, np.float64(1.5)), (None, None)]:
        _run(w, kind, kvdt, k_scale=ks, v_scale=vs)
        p = last_attn(fake)[3]
        assert p.sm_scale_log2 == pytest.approx(f32(base * (1.0 if ks is None else float(ks))), rel=1e-7)
        assert p.v_scale == pytest.approx(1.0 if vs is None else float(vs))


@pytest.mark.parametrize("kind", ["paged", "ragged"])
@pytest.mark.parametrize("kw, exc, pattern", [
    (dict(k_scale="0.5"), TypeError, r"k_scale"),
    (dict(v_scale=True), TypeError, r"v_scale"),
    (dict(k_scale=[0.5]), TypeError, r"k_scale"),
    (dict(k_scale=np.array(0.5)), TypeError, r"k_scale"),
    (dict(v_scale=object()), TypeError, r"v_scale"),
    (dict(v_scale=1 + 0j), TypeError, r"v_scale"),
    (dict(k_scale=0.0), ValueError, r"k_scale"),
    (dict(k_scale=-1), ValueError, r"k_scale"),
    (dict(v_scale=float("nan")), ValueError, r"v_scale"),
    (dict(v_scale=float("inf")), ValueError, r"v_scale"),
    (dict(k_scale=np.float32("nan")), ValueError, r"k_scale"),
    (dict(k_scale=0.5, v_scale=-2.0), ValueError, r"v_scale"),
])
def test_bad_scales_raise_before_launch_and_change_nothing(fake, kind, kw, exc, pattern):
    w = paged(fake) if kind == "paged" else ragged(fake)
    (plan_paged if kind == "paged" else plan_ragged)(w, kv_data_type="e5m2")
    _run(w, kind, E5M2, k_scale=2.0, v_scale=0.25)
    good = last_attn(fake)[3]
    n = len(fake.attn_launches())
    with pytest.raises(exc, match=pattern):
        _run(w, kind, E5M2, **kw)
    assert len(fake.attn_launches()) == n, "a kernel ran before the error"
    _run(w, kind, E5M2, k_scale=2.0, v_scale=0.25)  # still usable, the same struct as before
    assert bytes(last_attn(fake)[3]) == bytes(good)


# ---------------------------------------------------------------------------------------------
# plan()'s settings cache: the same checks and results as resolving every time
# ---------------------------------------------------------------------------------------------
class _Knob:
    """A mutable number (like a 0-d tensor): float() reads its current value."""

    def __init__(self, v):
        self.v = v

    def __float__(self):
        return self.v


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_cached_settings_still_check_types_and_follow_mutable_values(fake, kind):
    w = paged(fake) if kind == "paged" else ragged(fake)
    plan = plan_paged if kind == "paged" else plan_ragged
    plan(w, sm_scale=0.5)
    plan(w, sm_scale=0.5)  # cached
    assert w._engine.attn.params.sm_scale_log2 == pytest.approx(0.5 * LOG2E)
    # equal values of other types are checked as such, not served from the cache
    args = (QO, KV_INDPTR, KV_INDICES, LAST) if kind == "paged" else (QO, RAGGED_KV)
    tail = (PS,) if kind == "paged" else ()
    with pytest.raises(ValueError, match="head_dim"):
        w.plan(*args, HQ, HKV, float(D), *tail, sm_scale=0.5)
    with pytest.raises(TypeError, match="window_left"):
        plan(w, sm_scale=0.5, window_left=-1.0)
    with pytest.raises(ValueError, match="sm_scale"):
        plan(w, sm_scale=True)
    # a mutable scale is read again at every plan
    knob = _Knob(0.25)
    plan(w, sm_scale=knob)
    assert w._engine.attn.params.sm_scale_log2 == pytest.approx(0.25 * LOG2E)
    knob.v = 0.125
    plan(w, sm_scale=knob)
    assert w._engine.attn.params.sm_scale_log2 == pytest.approx(0.125 * LOG2E)
    plan(w, sm_scale=np.float64(0.75))  # numpy scalars work (resolved each time)
    assert w._engine.attn.params.sm_scale_log2 == pytest.approx(0.75 * LOG2E)


def test_scales_stay_per_run_and_reset_at_plan(fake):
    w = ragged(fake)
    plan_ragged(w, sm_scale=0.5)
    _run(w, "ragged", k_scale=0.25, v_scale=3.0)
    plan_ragged(w, sm_scale=0.5)  # a new plan: run() without scales means 1.0 again
    _run(w, "ragged")
    p = last_attn(fake)[3]
    assert p.sm_scale_log2 == pytest.approx(f32(0.5 * LOG2E)) and p.v_scale == 1.0


def test_v_scale_reaches_split_kv_partials(fake):
    # The merge kernel has no v_scale: the attention kernel applies it to every partial.
    w = ragged(fake)
    w.plan(i32(0, 1, 2), i32(0, 20000, 40000), HQ, HKV, D, fixed_split_size=1024)
    assert w._engine.merge is not None and w.workspace_size() > 0
    w.run(T((2, HQ, D)), T((40000, HKV, D)), T((40000, HKV, D), data=0x900000), out=T((2, HQ, D)), v_scale=0.5)
    names = [x[0] for x in fake.cu.launches[-2:]]
    assert names[0].startswith("prefill") and names[1].startswith("merge")
    assert fake.cu.launches[-2][3].v_scale == 0.5
