"""FP8 prefill (e4m3 Q, K, V) on the simulated driver: the arguments (scale_q / scale_k / scale_v /
o_dtype of single prefill, q_scale / k_scale / v_scale and o_data_type of the ragged wrapper)
become the sm90 fp8 kernel's params; what the fp8 kernels do not cover raises before any launch.
Numerics: tests/gpu/test_fp8_prefill.py."""
from __future__ import annotations

import numpy as np
import pytest

import pyflashattn
from pyflashattn._engine import fp8, single
from pyflashattn._runtime import cuda as _cuda, dtypes as _dtypes, tensor as _tensor
from pyflashattn.testing.fake_driver import (
    BF16, D, E4M3, F16, HKV, HQ, LOG2E, PS, QO, T, TQ, cache_t, f32, i32, kv_t, last_attn, paged, plan_paged,
    plan_ragged, q_t, ragged)

F32 = _dtypes.FLOAT32
N, HQS, HKVS = 300, 8, 2  # single prefill: qo_len = kv_len, GQA 4


@pytest.fixture(autouse=True)
def no_cached_single_plans(monkeypatch):
    monkeypatch.setattr(single._tls, "plans", {}, raising=False)


def _single(fake, d=128, kv_dtype=E4M3, **kw):
    q = T((N, HQS, d), E4M3, data=0x100000)
    k, v = (T((N, HKVS, d), kv_dtype, data=a) for a in (0x200000, 0x300000))
    out = kw.pop("out", None)
    return pyflashattn.single_prefill_with_kv_cache(q, k, v, out=out, **kw)


def _scales(hq=HQS, hkv=HKVS):
    return (T((hq,), F32, data=0x610000), T((hkv,), F32, data=0x620000), T((hkv,), F32, data=0x630000))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("o_dtype, odt, fmt", [(None, E4M3, 2), ("bfloat16", BF16, 0), ("float16", F16, 1),
                                               ("float8_e4m3fn", E4M3, 2)])
def test_single_prefill_runs_the_fp8_kernel_in_the_asked_format(fake, o_dtype, odt, fmt, d):
    out = T((N, HQS, d), odt, data=0x400000)
    assert _single(fake, d, out=out, o_dtype=o_dtype) is out
    name, _, _, p = last_attn(fake)
    assert "dtype=e4m3" in name and "kv_dtype=e4m3" in name and f"head_dim={d}" in name
    assert p.o_format == fmt and p.o == 0x400000
    assert (p.q_scale_heads, p.k_scale_heads, p.v_scale_heads) == (0, 0, 0)
    # strides in elements (one byte each) and 16-element rows
    assert (p.q_stride_n, p.q_stride_h, p.k_stride_n, p.k_stride_h) == (HQS * d, d, HKVS * d, d)


def test_single_prefill_points_the_kernel_at_per_head_scale_tensors(fake):
    sq, sk, sv = _scales()
    _single(fake, scale_q=sq, scale_k=sk, scale_v=sv, o_dtype="bfloat16", out=T((N, HQS, D), BF16, data=0x400000))
    p = last_attn(fake)[3]
    assert (p.q_scale_heads, p.k_scale_heads, p.v_scale_heads) == (0x610000, 0x620000, 0x630000)
    assert p.sm_scale_log2 == f32(LOG2E / D ** 0.5) and p.v_scale == 1.0
    # the next call without tensors points at none (the plan is cached, the pointers are per call)
    _single(fake, o_dtype="bfloat16", out=T((N, HQS, D), BF16, data=0x400000))
    p = last_attn(fake)[3]
    assert (p.q_scale_heads, p.k_scale_heads, p.v_scale_heads) == (0, 0, 0)


def test_single_prefill_folds_number_scales_on_the_host(fake):
    _single(fake, scale_q=0.5, scale_k=3.0, scale_v=0.25, sm_scale=0.1, out=T((N, HQS, D), E4M3, data=0x400000))
    p = last_attn(fake)[3]
    assert p.sm_scale_log2 == f32(0.1 * 1.5 * LOG2E) and p.v_scale == 0.25
    assert (p.q_scale_heads, p.k_scale_heads, p.v_scale_heads) == (0, 0, 0)


def test_split_kv_merges_in_bf16_with_the_output_format(fake):
    # one row tile, a long KV: the scheduler splits it, and the merge writes the fp8 output
    q = T((16, HQS, D), E4M3, data=0x100000)
    k, v = (T((65536, HKVS, D), E4M3, data=a) for a in (0x200000, 0x300000))
    pyflashattn.single_prefill_with_kv_cache(q, k, v, out=T((16, HQS, D), E4M3, data=0x400000))
    merges = [x for x in fake.cu.launches if x[0].startswith("merge")]
    assert merges and "dtype=bf16" in merges[0][0] and merges[0][3].o_format == 2


@pytest.mark.parametrize("kw, exc, pattern", [
    (dict(kv_dtype=BF16), TypeError, r"k has dtype bfloat16 but q has float8_e4m3fn"),
    (dict(o_dtype="float8_e5m2"), TypeError, r"o_dtype: the output of an fp8 prefill must be"),
    (dict(logits_soft_cap=30.0), NotImplementedError, r"fp8 \(float8_e4m3fn\) q with a custom mask, logits_soft_cap"),
    (dict(scale_q=-1.0), ValueError, r"scale_q must be a finite number > 0"),
])
def test_single_prefill_refuses_what_the_fp8_kernels_do_not_cover(fake, kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _single(fake, **kw)
    assert not fake.attn_launches()


@pytest.mark.parametrize("which, tensor, exc, pattern", [
    (0, T((HKVS,), F32, data=0x610000), ValueError, r"scale_q must have shape \(8,\) \(one scale per query head\)"),
    (1, T((HQS,), F32, data=0x620000), ValueError, r"scale_k must have shape \(2,\) \(one scale per kv head\)"),
    (2, T((HKVS,), F16, data=0x630000), TypeError, r"scale_v must be float32"),
    (0, T((HQS,), F32, strides=(2,), data=0x610000), ValueError, r"scale_q must be contiguous"),
])
def test_bad_scale_tensors_raise_naming_the_argument(fake, which, tensor, exc, pattern):
    scales = dict(zip(("scale_q", "scale_k", "scale_v"), _scales()))
    scales[("scale_q", "scale_k", "scale_v")[which]] = tensor
    with pytest.raises(exc, match=pattern):
        _single(fake, **scales)
    assert not fake.attn_launches()


@pytest.mark.parametrize("cc", [(8, 0), (8, 9)])
def test_fp8_q_without_an_fp8_qk_path_is_not_implemented(fake, monkeypatch, cc):
    monkeypatch.setattr(_cuda, "properties", lambda dev: {"sm_count": 132, "cc": cc, "smem_per_sm": 233472})
    with pytest.raises(NotImplementedError, match=rf"sm_90a.*compute capability {cc[0]}\.{cc[1]}"):
        _single(fake)
    w = ragged(fake)
    with pytest.raises(NotImplementedError, match=r"compute capability"):
        plan_ragged(w, q_data_type="float8_e4m3fn", kv_data_type="float8_e4m3fn")
    assert not fake.attn_launches()


def test_a_16_bit_q_takes_number_scales_and_refuses_tensors(fake):
    q = T((N, HQS, D), BF16, data=0x100000)
    k, v = (T((N, HKVS, D), BF16, data=a) for a in (0x200000, 0x300000))
    with pytest.raises(NotImplementedError, match=r"scale_k as a per-head tensor applies to fp8"):
        pyflashattn.single_prefill_with_kv_cache(q, k, v, scale_k=_scales()[1])
    pyflashattn.single_prefill_with_kv_cache(q, k, v, scale_q=2.0, scale_v=0.5, o_dtype="float16",
                                             out=T((N, HQS, D), F16, data=0x400000))
    p = last_attn(fake)[3]
    assert "dtype=bf16" in last_attn(fake)[0] and p.o_format == 1
    assert p.sm_scale_log2 == f32(2.0 * LOG2E / D ** 0.5) and p.v_scale == 0.5
    assert (p.q_scale_heads, p.k_scale_heads, p.v_scale_heads) == (0, 0, 0)


# ---------------------------------------------------------------------------------------------
# the batch wrappers
# ---------------------------------------------------------------------------------------------
def _fp8_ragged(fake, **plan):
    w = ragged(fake)
    plan_ragged(w, q_data_type="float8_e4m3fn", kv_data_type="float8_e4m3fn", **plan)
    return w


def test_ragged_fp8_plan_and_run_with_per_head_scales(fake):
    w = _fp8_ragged(fake, o_data_type="bfloat16")
    assert w._engine.attn.meta["dtype"] == "e4m3" and w._engine.attn.meta["kv_dtype"] == "e4m3"
    sq, sk, sv = _scales(HQ, HKV)
    out = T((TQ, HQ, D), BF16, data=0x400000)
    w.run(q_t(E4M3), kv_t(E4M3), kv_t(E4M3, data=0x380000), q_scale=sq, k_scale=sk, v_scale=sv, out=out)
    p = last_attn(fake)[3]
    assert (p.q_scale_heads, p.k_scale_heads, p.v_scale_heads) == (0x610000, 0x620000, 0x630000)
    assert p.o_format == 0 and p.sm_scale_log2 == f32(LOG2E / D ** 0.5)
    # numbers fold, and a run without scales points at none
    w.run(q_t(E4M3), kv_t(E4M3), kv_t(E4M3, data=0x380000), q_scale=2.0, k_scale=1.5, v_scale=0.5, out=out)
    p = last_attn(fake)[3]
    assert (p.q_scale_heads, p.k_scale_heads, p.v_scale_heads) == (0, 0, 0)
    assert p.sm_scale_log2 == f32(3.0 * LOG2E / D ** 0.5) and p.v_scale == 0.5
    w.run(q_t(E4M3), kv_t(E4M3), kv_t(E4M3, data=0x380000), out=out)
    p = last_attn(fake)[3]
    assert p.sm_scale_log2 == f32(LOG2E / D ** 0.5) and p.v_scale == 1.0


def test_ragged_fp8_default_output_is_e4m3_and_merges_in_bf16(fake):
    w = ragged(fake)
    w.plan(i32(0, 1, 2), i32(0, 20000, 40000), HQ, HKV, D, fixed_split_size=1024, q_data_type="float8_e4m3fn",
           kv_data_type="float8_e4m3fn")
    assert (w._engine.cfg.o_dtype, w._engine.cfg.o_format) == (E4M3, 2)
    assert w._engine.merge is not None and w._engine.merge.meta["dtype"] == "bf16"
    w.run(T((2, HQ, D), E4M3), T((40000, HKV, D), E4M3), T((40000, HKV, D), E4M3, data=0x900000),
          out=T((2, HQ, D), E4M3, data=0x400000))
    (attn, merge) = fake.cu.launches[-2:]
    assert attn[0].startswith("prefill") and merge[0].startswith("merge")
    assert attn[3].o_format == merge[3].o_format == 2


@pytest.mark.parametrize("plan, exc, pattern", [
    (dict(kv_data_type="bfloat16"), TypeError, r"kv_data_type bfloat16 with an fp8 query"),
    (dict(kv_data_type="float8_e4m3fn", logits_soft_cap=30.0), NotImplementedError, r"logits_soft_cap"),
    (dict(kv_data_type="float8_e4m3fn", o_data_type="float8_e5m2"), TypeError, r"o_data_type: the output"),
])
def test_ragged_fp8_plan_refusals(fake, plan, exc, pattern):
    w = ragged(fake)
    with pytest.raises(exc, match=pattern):
        plan_ragged(w, q_data_type="float8_e4m3fn", **plan)


def test_ragged_fp8_run_refuses_bad_scales_and_other_dtypes(fake):
    w = _fp8_ragged(fake)
    out = T((TQ, HQ, D), E4M3, data=0x400000)
    with pytest.raises(ValueError, match=r"k_scale must have shape \(2,\)"):
        w.run(q_t(E4M3), kv_t(E4M3), kv_t(E4M3, data=0x380000), k_scale=_scales(HQ, HQ)[1], out=out)
    with pytest.raises(TypeError, match=r"k has dtype bfloat16"):
        w.run(q_t(E4M3), kv_t(BF16), kv_t(BF16, data=0x380000), out=out)
    assert not fake.attn_launches()


def test_ragged_16_bit_plan_refuses_scale_tensors(fake):
    w = ragged(fake)
    plan_ragged(w, q_data_type="bfloat16")
    with pytest.raises(NotImplementedError, match=r"q_scale as a per-head tensor applies to fp8"):
        w.run(q_t(BF16), kv_t(BF16), kv_t(BF16, data=0x380000), q_scale=_scales(HQ, HKV)[0])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_fp8_plan_and_run_launch_the_paged_fp8_kernel(fake, layout):
    """An e4m3 q over an e4m3 paged cache plans the paged sm90 fp8 row (lean); run() points the
    cache, its page metadata and the per-head scales as for the ragged wrapper."""
    w = paged(fake, layout=layout)
    plan_paged(w, q_data_type="float8_e4m3fn", kv_data_type="float8_e4m3fn", o_data_type="bfloat16", causal=True)
    m = w._engine.attn.meta
    assert (m["dtype"], m["kv_dtype"], m["paged"], m["general"]) == ("e4m3", "e4m3", True, False)
    sq, sk, sv = _scales(HQ, HKV)
    out = T((TQ, HQ, D), BF16, data=0x400000)
    cache = cache_t(E4M3, layout)
    w.run(q_t(E4M3), cache, q_scale=sq, k_scale=sk, v_scale=sv, out=out)
    name, _, _, p = last_attn(fake)
    assert "dtype=e4m3" in name and "paged=True" in name
    assert (p.q_scale_heads, p.k_scale_heads, p.v_scale_heads) == (0x610000, 0x620000, 0x630000)
    assert p.o_format == 0 and p.causal == 1 and p.kv_fp8 == 0
    assert (p.page_size, p.page_shift) == (PS, 4) and p.v_page_indices == 0
    assert fake.read(p.kv_page_indices, 3, np.int32).tolist() == [4, 1, 0]
    # strides in one-byte elements; V one page-half past K
    page, slot = (2 * PS * HKV * D, HKV * D) if layout == "NHD" else (2 * HKV * PS * D, D)
    assert (p.k_stride_page, p.k_stride_n, p.v_stride_page, p.v_stride_n) == (page, slot, page, slot)
    assert p.v - p.k == page // 2
    w.run(q_t(E4M3), cache, q_scale=2.0, k_scale=1.5, v_scale=0.5, out=out)
    p = last_attn(fake)[3]
    assert (p.q_scale_heads, p.k_scale_heads, p.v_scale_heads) == (0, 0, 0)
    assert p.sm_scale_log2 == f32(3.0 * LOG2E / D ** 0.5) and p.v_scale == 0.5


def test_paged_fp8_any_page_size_and_e4m3_output(fake):
    w = paged(fake)
    w.plan(QO, i32(0, 4, 6, 6), i32(4, 1, 0, 3, 2, 5), i32(2, 5, 0), HQ, HKV, D, 5, q_data_type="float8_e4m3fn",
           kv_data_type="float8_e4m3fn")
    assert w._engine.cfg.o_format == 2
    w.run(q_t(E4M3), T((6, 2, 5, HKV, D), E4M3, data=0x200000), out=T((TQ, HQ, D), E4M3, data=0x400000))
    p = last_attn(fake)[3]
    assert (p.page_size, p.page_shift, p.o_format) == (5, -1, 2)


@pytest.mark.parametrize("plan, run_cache, exc, pattern", [
    (dict(kv_data_type="float8_e5m2"), None, TypeError, r"kv_data_type float8_e5m2 with an fp8 query"),
    (dict(kv_data_type="float8_e4m3fn", logits_soft_cap=30.0), None, NotImplementedError, r"logits_soft_cap"),
    (dict(kv_data_type="float8_e4m3fn"), BF16, TypeError, r"bfloat16"),
])
def test_paged_fp8_refusals(fake, plan, run_cache, exc, pattern):
    w = paged(fake)
    if run_cache is None:
        with pytest.raises(exc, match=pattern):
            plan_paged(w, q_data_type="float8_e4m3fn", **plan)
    else:
        plan_paged(w, q_data_type="float8_e4m3fn", **plan)
        with pytest.raises(exc, match=pattern):
            w.run(q_t(E4M3), cache_t(run_cache), out=T((TQ, HQ, D), E4M3, data=0x400000))
    assert not fake.attn_launches()


@pytest.mark.parametrize("cc", [(8, 0), (8, 9)])
def test_paged_fp8_off_sm90_is_not_implemented(fake, monkeypatch, cc):
    monkeypatch.setattr(_cuda, "properties", lambda dev: {"sm_count": 132, "cc": cc, "smem_per_sm": 233472})
    w = paged(fake)
    with pytest.raises(NotImplementedError, match=rf"sm_90a.*compute capability {cc[0]}\.{cc[1]}"):
        plan_paged(w, q_data_type="float8_e4m3fn", kv_data_type="float8_e4m3fn")
    assert not fake.attn_launches()


def test_fp8_rows_of_the_variant_table():
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "build_tools"))
    import variants
    rows = [v for v in variants.variants() if isinstance(v, variants.HopperFp8PrefillVariant)]
    # every head dim of routing.HEAD_DIMS, ragged and paged
    assert {(v.head_dim, v.paged) for v in rows} == {(hd, pg) for hd in (64, 128, 256) for pg in (False, True)}
    for v in rows:
        assert v.archs == ("sm_90a",) and v.smem_bytes <= variants.SMEM_OPTIN["sm_90a"]
        assert v.manifest()["dtype"] == v.manifest()["kv_dtype"] == E4M3.short
        assert v.manifest()["paged"] == v.paged and ("_paged" in v.name) == v.paged
        # persistent (the scheduler's walk) where variants.HOPPER_FP8_PERSISTENT(_PAGED) says so
        want = (variants.HOPPER_FP8_PERSISTENT_PAGED if v.paged else variants.HOPPER_FP8_PERSISTENT)[v.head_dim]
        assert v.manifest()["persistent"] == v.persistent == want
        assert v.name.removesuffix("_tma").removesuffix("_dense").endswith("_ps") == v.persistent
        # the TMA twins: rows of whole 128-byte rows, a twin's tile (and persistence: a plan falls
        # back to the sibling with the same struct and grid) its sibling's
        assert v.manifest()["tma"] == v.tma == v.name.endswith("_tma")
        if v.tma:
            assert v.head_dim in variants.HOPPER_FP8_TMA_HEAD_DIMS and v.head_dim % 128 == 0
            base = next(b for b in rows if b.name == v.name.removesuffix("_tma"))
            assert (base.block_m, base.block_n, base.persistent, base.paged) == (v.block_m, v.block_n, v.persistent,
                                                                                 v.paged)
            # the raw V buffers' mbarriers: full, and (paged: the issuer warp's) empty
            assert v.smem_bytes == base.smem_bytes + (4 if v.paged else 2) * v.BARRIER_BYTES
    for storage, shipped in variants.HOPPER_FP8_TMA_SHIPPED.items():
        twins = {v.head_dim for v in rows if v.tma and v.paged == (storage == "paged")}
        assert twins == set(shipped) <= set(variants.HOPPER_FP8_TMA_HEAD_DIMS)
    assert fp8.FP8 is E4M3


def test_fp8_and_o_dtype_calls_never_take_the_torch_fast_path(fake, fake_torch, monkeypatch):
    # the fast path points no per-head scales and allocates q's dtype: such plans stay off it
    q, k, v = (fake_torch.tensor(s, "float8_e4m3fn") for s in ((64, 8, 128), (256, 2, 128), (256, 2, 128)))
    sq = fake_torch.tensor((8,), "float32")
    for _ in range(2):
        pyflashattn.single_prefill_with_kv_cache(q, k, v, scale_q=sq, o_dtype="bfloat16")
        assert last_attn(fake)[3].q_scale_heads == sq.data_ptr()
    views = []
    real_view = _tensor.view
    monkeypatch.setattr(_tensor, "view", lambda *a, **kw: views.append(a[1]) or real_view(*a, **kw))
    pyflashattn.single_prefill_with_kv_cache(q, k, v)  # same tensors, no scales: the full path
    assert "q" in views and last_attn(fake)[3].q_scale_heads == 0 and last_attn(fake)[3].o_format == 2
    h, hk = (fake_torch.tensor(s, "float16") for s in ((64, 8, 128), (256, 2, 128)))
    pyflashattn.single_prefill_with_kv_cache(h, hk, hk, o_dtype="bfloat16")
    views.clear()
    pyflashattn.single_prefill_with_kv_cache(h, hk, hk, o_dtype="bfloat16")
    assert "q" in views and last_attn(fake)[3].o_format == 1


def test_skip_softmax_with_an_fp8_q_is_not_implemented(fake):
    w = _fp8_ragged(fake)
    with pytest.raises(NotImplementedError, match=r"skip_softmax_threshold_scale_factor with an fp8"):
        w.run(q_t(E4M3), kv_t(E4M3), kv_t(E4M3, data=0x380000), skip_softmax_threshold_scale_factor=500.0,
              out=T((TQ, HQ, D), E4M3, data=0x400000))
    assert not fake.attn_launches()
