"""The paged rows' twins on the simulated driver.
Dense twins: which plans take them (an HND cache, or NHD with one kv head, pages of 32+ slots;
PFA_SM90_DENSE_KV=0 never), the fallback to the row itself for a run() whose cache strides its page
slots, and the skip-softmax sibling of a dense plan.
Span twins (hd128): plans with pages of 16 slots take them in either layout and at any strides
(PFA_SM90_SPAN_KV=0 never), and skip-softmax runs the row's skip twin."""
from __future__ import annotations

import pathlib
import sys

import pytest

from pyflashattn._engine import routing
from pyflashattn._runtime import dtypes as _dtypes
from pyflashattn.testing.fake_driver import (
    D, HKV, KV_INDICES, KV_INDPTR, LAST, NPAGES, PS, T, FakeEnv, i32, last_attn, paged)

E4M3, BF16 = _dtypes.FLOAT8_E4M3, _dtypes.BFLOAT16

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "build_tools"))
import variants  # noqa: E402

HQ = 8
QO_LONG = i32(0, 40, 40, 57)  # 160 and 68 packed rows: past the paged decode tiles, the row-tile kernel


def _env(monkeypatch, dense_env=None, span_env=None):
    rows = variants.variants()
    env = FakeEnv(monkeypatch, rows)
    env.use_sm90_rows(monkeypatch, rows)
    for name, value in ((routing.DENSE_ENV, dense_env), (routing.SPAN_ENV, span_env)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    return env


PS32 = 32  # pages from which the twin pays (routing.DENSE_MIN_PAGE)


def _plan(w, hkv=HKV, ps=PS32):
    w.plan(QO_LONG, KV_INDPTR, KV_INDICES, LAST, HQ, hkv, D, ps)


def _cache(layout="HND", hkv=HKV, ps=PS32, strides=None):
    shape = (NPAGES, 2, ps, hkv, D) if layout == "NHD" else (NPAGES, 2, hkv, ps, D)
    return T(shape, strides=strides, data=0x200000)


def q_long():
    return T((57, HQ, D), data=0x100000)


def out_long():
    return T((57, HQ, D), data=0x400000)


@pytest.mark.parametrize("flag,key,suffix,head_dims,source_tail", [
    ("dense", "dense_kv", "_dense", variants.HOPPER_DENSE_KV, "true, false, "),
    ("span", "span_kv", "_span", variants.HOPPER_SPAN_KV, "false, true, ")])
def test_twin_rows_are_twins_of_the_paged_rows(flag, key, suffix, head_dims, source_tail):
    rows = {v.name: v for v in variants.variants() if isinstance(v, variants.HopperPrefillVariant)}
    twins = [v for v in rows.values() if getattr(v, flag)]
    assert {(v.dtype, v.head_dim) for v in twins} == {(t, hd) for t in ("bf16", "f16") for hd in head_dims}
    for v in twins:
        base = rows[v.name.removesuffix(suffix)]
        m = v.manifest()
        assert v.paged and not v.tma and not v.skip and m[key] and m["twin_of"] == base.name
        assert (v.block_m, v.block_n, v.stages, v.smem_bytes) == (base.block_m, base.block_n, base.stages, base.smem_bytes)
        # the macro's DENSE_KV, SPAN_KV, SMEM arguments
        assert source_tail + str(v.smem_bytes) in v.source() and not base.manifest()[key]
        assert "false, false, " + str(base.smem_bytes) in base.source()


DENSE_OFF, DENSE_ON, SPAN_OFF, SPAN_ON = ({env: v} for env in (routing.DENSE_ENV, routing.SPAN_ENV) for v in "01")


# (layout, kv heads, page size, switches, the twin the plan takes: "_dense", "_span" or "" = the row)
TWIN_ROUTES = [
    ("HND", HKV, PS32, {}, "_dense"), ("NHD", HKV, PS32, {}, ""), ("NHD", 1, PS32, {}, "_dense"),
    ("HND", HKV, PS32, DENSE_OFF, ""), ("HND", HKV, PS32, DENSE_ON, "_dense"), ("HND", HKV, 64, {}, "_dense"),
    ("NHD", HKV, 64, {}, ""), ("NHD", HKV, PS, {}, "_span"), ("HND", HKV, PS, {}, "_span"),
    ("NHD", 1, PS, {}, "_span"), ("HND", HKV, PS, DENSE_OFF, "_span"), ("NHD", HKV, PS, SPAN_ON, "_span"),
    ("NHD", HKV, PS, SPAN_OFF, ""), ("HND", HKV, PS, SPAN_OFF, ""), ("HND", HKV, PS32, SPAN_OFF, "_dense")]


@pytest.mark.parametrize("layout,hkv,ps,switches,want", TWIN_ROUTES)
def test_plans_take_the_twin_their_pages_pay(monkeypatch, layout, hkv, ps, switches, want):
    """Dense twins where a kv head's page slots are back to back and pages hold 32+ slots, span
    twins at pages of 16 in either layout, the row itself otherwise or where the switch is off."""
    env = _env(monkeypatch, switches.get(routing.DENSE_ENV), switches.get(routing.SPAN_ENV))
    w = paged(env, layout=layout)
    _plan(w, hkv, ps)
    la = w._engine.attn
    assert "_paged" in la.name and la.name.endswith("_paged_ps" + want), la.name
    assert (bool(la.meta["dense_kv"]), bool(la.meta["span_kv"])) == (want == "_dense", want == "_span")
    w.run(q_long(), _cache(layout, hkv, ps), out=out_long())
    launched, _, _, p = last_attn(env)
    assert launched == la.name and not w._engine.kv_fallback and p.page_size == ps
    assert p.k_stride_n == (D if layout == "HND" else hkv * D)


@pytest.mark.parametrize("env_name", [routing.DENSE_ENV, routing.SPAN_ENV])
def test_a_twin_switch_it_does_not_know_is_refused(monkeypatch, env_name):
    env = _env(monkeypatch)
    monkeypatch.setenv(env_name, "off")
    with pytest.raises(ValueError, match=env_name):
        _plan(paged(env, layout="HND"))


def test_strided_page_slots_fall_back_to_the_row(monkeypatch):
    env = _env(monkeypatch)
    w = paged(env, layout="HND")
    _plan(w)
    dense_name = w._engine.attn.name
    # an HND cache whose slots are D + 8 elements apart (a view of a padded cache): not dense
    pad = D + 8
    strides = (2 * HKV * PS32 * pad, HKV * PS32 * pad, PS32 * pad, pad, 1)
    w.run(q_long(), _cache(strides=strides), out=out_long())
    launched, grid, _, p = last_attn(env)
    assert launched == dense_name.removesuffix("_dense") and w._engine.kv_fallback
    assert (p.k_stride_n, p.v_stride_n, p.k_stride_h) == (pad, pad, PS32 * pad)
    assert grid == w._engine.attn.grid
    # no fast path on the fallback; a dense cache runs the twin again
    w.run(q_long(), _cache(), out=out_long())
    launched, _, _, p = last_attn(env)
    assert launched == dense_name and not w._engine.kv_fallback and p.k_stride_n == D


@pytest.mark.parametrize("ps,suffix", [(PS32, "_dense"), (PS, "_span")])
def test_skip_softmax_on_a_twin_plan_runs_the_rows_skip_twin(monkeypatch, ps, suffix):
    env = _env(monkeypatch)
    w = paged(env, layout="HND")
    _plan(w, HKV, ps)
    twin = w._engine.attn.name
    assert twin.endswith(suffix)
    w.run(q_long(), _cache(ps=ps), out=out_long(), skip_softmax_threshold_scale_factor=1.0)
    launched, _, _, p = last_attn(env)
    assert launched == twin.removesuffix(suffix) + "_skip" and p.skip_softmax_factor > 0
    w.run(q_long(), _cache(ps=ps), out=out_long())
    assert last_attn(env)[0] == twin


def test_span_plans_take_any_strides(monkeypatch):
    env = _env(monkeypatch)
    w = paged(env, layout="HND")
    _plan(w, HKV, PS)
    span_name = w._engine.attn.name
    assert span_name.endswith("_span")
    pad = D + 8  # page slots D + 8 apart: the span twin runs them (no fallback)
    strides = (2 * HKV * PS * pad, HKV * PS * pad, PS * pad, pad, 1)
    w.run(q_long(), _cache(ps=PS, strides=strides), out=out_long())
    launched, _, _, p = last_attn(env)
    assert launched == span_name and not w._engine.kv_fallback and p.k_stride_n == pad


# ---- the e4m3 paged row's dense twin (variants.HOPPER_FP8_DENSE_KV) --------------------------------
E4M3_PLAN = dict(q_data_type="float8_e4m3fn", kv_data_type="float8_e4m3fn", o_data_type="bfloat16")


def test_the_e4m3_dense_twin_is_a_twin_of_the_paged_row():
    rows = {v.name: v for v in variants.variants() if isinstance(v, variants.HopperFp8PrefillVariant)}
    twins = [v for v in rows.values() if v.dense]
    assert {v.head_dim for v in twins} == set(variants.HOPPER_FP8_DENSE_KV)
    for v in twins:
        base = rows[v.name.removesuffix("_dense")]
        m = v.manifest()
        assert v.paged and not v.tma and m["dense_kv"] and m["twin_of"] == base.name and not base.manifest()["dense_kv"]
        assert (v.block_m, v.block_n, v.stages, v.smem_bytes) == (base.block_m, base.block_n, base.stages, base.smem_bytes)
        assert f"true, false, true, {v.smem_bytes})" in v.source()  # the macro's PERSISTENT, TMA, DENSE_KV
        assert f"true, false, false, {base.smem_bytes})" in base.source()
    with pytest.raises(ValueError, match="dense twin"):
        variants.HopperFp8PrefillVariant(128, 2, 2, dense=True)


@pytest.mark.parametrize("layout,ps,switches,dense", [
    ("HND", PS32, {}, True), ("HND", 64, {}, True), ("NHD", PS32, {}, False), ("HND", PS, {}, False),
    ("HND", PS32, DENSE_OFF, False)])
def test_e4m3_paged_plans_take_the_dense_twin_their_pages_pay(monkeypatch, layout, ps, switches, dense):
    """As the 16-bit rows: an HND cache with pages of 32+ slots runs the dense twin (the e4m3 rows
    have no span twin), the row otherwise; strided slots fall back to the row at run()."""
    env = _env(monkeypatch, switches.get(routing.DENSE_ENV))
    w = paged(env, layout=layout)
    w.plan(QO_LONG, KV_INDPTR, KV_INDICES, LAST, HQ, HKV, D, ps, **E4M3_PLAN)
    la = w._engine.attn
    assert "_e4m3_" in la.name and la.name.endswith("_paged_ps" + ("_dense" if dense else "")), la.name
    q, out = T((57, HQ, D), E4M3, data=0x100000), T((57, HQ, D), BF16, data=0x400000)
    shape = (NPAGES, 2, ps, HKV, D) if layout == "NHD" else (NPAGES, 2, HKV, ps, D)
    w.run(q, T(shape, E4M3, data=0x200000), out=out)
    assert last_attn(env)[0] == la.name and not w._engine.kv_fallback
    if dense:  # slots D + 16 elements apart: the row itself
        pad = D + 16
        strides = (2 * HKV * ps * pad, HKV * ps * pad, ps * pad, pad, 1)
        w.run(q, T(shape, E4M3, strides=strides, data=0x200000), out=out)
        assert last_attn(env)[0] == la.name.removesuffix("_dense") and w._engine.kv_fallback
