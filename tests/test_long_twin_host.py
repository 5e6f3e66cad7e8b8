"""The e4m3 rows' long-KV twins (variants.HOPPER_FP8_LONG: 256-key serial steps, by cp.async; of the
contiguous row and, HOPPER_FP8_LONG_PAGED, of the paged row) on the simulated driver: their rows in
the variant table, which plans take them (routing.long_pays: long requests; never a graph-mode or
batch-invariant plan; PFA_SM90_LONG_KV=0 never, 1 always), and that their own tile schedules the
plan. Numerics: tests/gpu/test_fp8_prefill.py, tests/gpu/test_trtllm_fp8.py."""
from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

import pyflashattn
from pyflashattn._engine import routing, single, trtllm, trtllm_device
from pyflashattn._runtime import dtypes as _dtypes
from pyflashattn.testing.fake_driver import WS, FakeEnv, T, i32, last_attn, ragged

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "build_tools"))
import variants  # noqa: E402

E4M3, BF16 = _dtypes.FLOAT8_E4M3, _dtypes.BFLOAT16
HQ, HKV, D = 8, 2, 128
LONG = variants.HopperFp8PrefillVariant(D, *variants.HOPPER_FP8_TILES[D][:2], *variants.HOPPER_FP8_LONG[D][1:],
                                        block_n=variants.HOPPER_FP8_LONG[D][0], long_kv=True)
DEFAULT = LONG.default_row()
LONG_PAGED = variants.HopperFp8PrefillVariant(D, *variants.HOPPER_FP8_TILES[D][:2], *variants.HOPPER_FP8_LONG[D][1:],
                                              block_n=variants.HOPPER_FP8_LONG[D][0], long_kv=True, paged=True)


def _env(monkeypatch, long_env=None):
    rows = variants.variants()
    env = FakeEnv(monkeypatch, rows)
    env.use_sm90_rows(monkeypatch, rows)
    monkeypatch.setattr(single._tls, "plans", {}, raising=False)
    monkeypatch.delenv(routing.KV_LOAD_ENV, raising=False)
    if long_env is None:
        monkeypatch.delenv(routing.LONG_ENV, raising=False)
    else:
        monkeypatch.setenv(routing.LONG_ENV, long_env)
    return env


def test_the_long_twin_row_stands_in_for_the_default_contiguous_row():
    rows = {v.name: v for v in variants.variants() if isinstance(v, variants.HopperFp8PrefillVariant)}
    longs = [v for v in rows.values() if v.long_kv]
    assert [v.name for v in longs] == [LONG.name, LONG_PAGED.name, LONG_PAGED.name + routing.TMA_SUFFIX]
    assert set(variants.HOPPER_FP8_LONG) == {D} and rows[LONG_PAGED.name + routing.TMA_SUFFIX].tma
    m = LONG.manifest()
    assert m["long_kv"] and m["twin_of"] == DEFAULT.name and DEFAULT.name in rows
    assert not (LONG.paged or LONG.tma or LONG.tune or LONG.overlap or LONG.pingpong)
    assert (LONG.block_m, LONG.block_n, m["ctas_per_sm"]) == (DEFAULT.block_m, 256, DEFAULT.manifest()["ctas_per_sm"])
    assert LONG.fits("sm_90a") and not DEFAULT.manifest()["twin_of"]
    # the macro's BLOCK_N and the serial loop (OVERLAP false), no ping-pong
    assert f"{LONG.name}, 128, 256, 2, 2, false, false, false, true, false, false, {LONG.smem_bytes})" in LONG.source()


@pytest.mark.parametrize("kv_lens,causal,frozen,env,want", [
    ([4096], False, False, None, True), ([4095], False, False, None, False),
    ([8192, 0], False, False, None, True), ([6000, 100], False, False, None, False),
    ([8192], True, False, None, False), ([16384], True, False, None, True),
    ([65536], False, True, None, False), ([], False, False, None, False),
    ([65536], False, False, "0", False), ([1], True, True, "1", True)])
def test_long_pays_on_long_requests_of_a_free_plan(monkeypatch, kv_lens, causal, frozen, env, want):
    if env is None:
        monkeypatch.delenv(routing.LONG_ENV, raising=False)
    else:
        monkeypatch.setenv(routing.LONG_ENV, env)
    assert routing.long_pays(np.asarray(kv_lens), causal, frozen) is want


@pytest.mark.parametrize("kv,causal,env,want_long", [
    (4096, False, None, True), (2048, False, None, False), (8192, True, None, False), (16384, True, None, True),
    (8192, False, "0", False), (300, True, "1", True)])
def test_single_prefill_takes_the_long_twin_for_long_keys(monkeypatch, kv, causal, env, want_long):
    env_ = _env(monkeypatch, env)
    q = T((256, HQ, D), E4M3, data=0x1000000)
    k, v = (T((kv, HKV, D), E4M3, data=a) for a in (0x5000000, 0x9000000))
    pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=causal, o_dtype="bfloat16",
                                             out=T((256, HQ, D), BF16, data=0xd000000))
    name, _, _, p = last_attn(env_)
    assert (name == LONG.name) is want_long, name
    if want_long:  # copies, not boxes: no tensor maps, Q by cp.async
        assert p.q_tma == 0
    else:
        assert name == DEFAULT.name + routing.TMA_SUFFIX


def _ragged_plan(monkeypatch, kv_lens, long_env=None, **kw):
    env = _env(monkeypatch, long_env)
    w = ragged(env)
    qo = i32(0, *np.cumsum([128] * len(kv_lens)))
    kv = i32(0, *np.cumsum(kv_lens))
    w.plan(qo, kv, HQ, HKV, D, q_data_type="float8_e4m3fn", kv_data_type="float8_e4m3fn", o_data_type="bfloat16",
           **kw)
    return env, w, int(qo[-1]), int(kv[-1])


@pytest.mark.parametrize("kw,want_long", [
    (dict(), True), (dict(causal=True), False), (dict(fixed_split_size=512), False),
    (dict(disable_split_kv=True), False)])
def test_ragged_plans_take_the_long_twin_unless_causal_short_or_invariant(monkeypatch, kw, want_long):
    env, w, tq, tkv = _ragged_plan(monkeypatch, [8192, 4096], **kw)
    la = w._engine.attn
    assert (la.name == LONG.name) is want_long, la.name
    assert la.meta["block_n"] == (256 if want_long else 128)
    w.run(T((tq, HQ, D), E4M3, data=0x1000000), T((tkv, HKV, D), E4M3, data=0x5000000),
          T((tkv, HKV, D), E4M3, data=0x9000000), out=T((tq, HQ, D), BF16, data=0xd000000))
    name, _, _, p = last_attn(env)
    assert name == la.name
    if want_long:  # the plan's KV chunks are whole 256-key tiles of its own schedule
        assert p.kv_chunk_size % 256 == 0 and not w._engine.kv_twin and w._engine.kv_maps is None


def test_a_graph_mode_plan_keeps_the_default_row(monkeypatch):
    env = _env(monkeypatch)
    w = ragged(env, use_cuda_graph=True, qo_indptr_buf=T((3,), _dtypes.INT32, data=0x700000),
               kv_indptr_buf=T((3,), _dtypes.INT32, data=0x710000))
    w.plan(i32(0, 128, 256), i32(0, 8192, 16384), HQ, HKV, D, q_data_type="float8_e4m3fn",
           kv_data_type="float8_e4m3fn", o_data_type="bfloat16")
    assert w._engine.attn.name != LONG.name and w._engine.attn.meta["block_n"] == 128


def test_a_long_switch_it_does_not_know_is_refused(monkeypatch):
    env = _env(monkeypatch, "yes")
    with pytest.raises(ValueError, match=routing.LONG_ENV):
        _ragged_plan(monkeypatch, [8192], "yes")
    assert not env.attn_launches()


def test_a_row_forced_by_name_runs_as_named(monkeypatch):
    """registry.force (build_tools/tune_prefill.py) times the row it names, never its long twin."""
    from pyflashattn._runtime import registry as _registry
    env = _env(monkeypatch)
    monkeypatch.setattr(_registry, "_forced", {"prefill": DEFAULT.name})
    q = T((256, HQ, D), E4M3, data=0x1000000)
    k, v = (T((8192, HKV, D), E4M3, data=a) for a in (0x5000000, 0x9000000))
    pyflashattn.single_prefill_with_kv_cache(q, k, v, o_dtype="bfloat16", out=T((256, HQ, D), BF16, data=0xd000000))
    assert last_attn(env)[0] != LONG.name


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("max_kv,want_long", [(8192, True), (2048, False)])
def test_trtllm_contiguous_calls_take_the_long_twin_for_long_keys(monkeypatch, device, max_kv, want_long):
    """TRT-LLM's plans never split KV (disable_split_kv), which is not a batch-invariance request:
    the host path plans the requests' lengths, the device path its shape key's max_kv_len."""
    from collections import OrderedDict
    from pyflashattn import prefill
    env = _env(monkeypatch)
    monkeypatch.setattr(trtllm, "_ENGINES", OrderedDict())
    monkeypatch.setattr(trtllm_device, "_ENGINES", OrderedDict())
    b, tq = 2, 256
    lens = (i32(max_kv, max_kv), i32(0, 128, 256), i32(0, max_kv, 2 * max_kv))
    if device:
        lens = tuple(env.dev(a, _dtypes.INT32) for a in lens)
    q = T((tq, HQ, D), E4M3, data=0x1000000)
    k, v = (T((2 * max_kv, HKV, D), E4M3, data=a) for a in (0x5000000, 0x9000000))
    prefill.trtllm_fmha_v2_prefill((q, k, v), "SEPARATE_Q_K_V", WS(env), lens[0], 128, max_kv, 0.1, 1.0, b,
                                   lens[1], lens[2], mask_mode="padding", out=T((tq, HQ, D), BF16, data=0xd000000),
                                   out_dtype="bfloat16")
    name = last_attn(env)[0]
    assert (name == LONG.name) is want_long, name


def test_a_twin_whose_tile_differs_from_its_row_is_a_build_error():
    """routing._twin_launcher (every twin: TMA, dense, span, long-KV) refuses a twin row whose meta
    differs from its row's at what they must share."""
    from types import SimpleNamespace
    meta = {"name": "row", "block_m": 128, "block_n": 128, "ctas_per_sm": 1}
    named = lambda name: SimpleNamespace(meta=dict(meta, name=name, block_n=256))  # noqa: E731
    assert routing._twin_launcher(named, None, meta, ("block_m",), "twin") is None
    twin = routing._twin_launcher(named, {"name": "t"}, meta, ("block_m", "ctas_per_sm"), "long-KV twin")
    assert twin.meta["name"] == "t"
    with pytest.raises(RuntimeError, match="t is no TMA twin of row: their block_m, block_n differ"):
        routing._twin_launcher(named, {"name": "t"}, meta, ("block_m", "block_n"), "TMA twin")


def test_the_paged_long_twin_stands_in_for_the_paged_row():
    rows = {v.name: v for v in variants.variants() if isinstance(v, variants.HopperFp8PrefillVariant)}
    row = LONG_PAGED.default_row()
    m = LONG_PAGED.manifest()
    assert variants.HOPPER_FP8_LONG_PAGED == (D,) and row.name in rows and LONG_PAGED.name in rows
    assert row.paged and not row.dense and m["twin_of"] == row.name and m["long_kv"] and m["paged"]
    assert (LONG_PAGED.block_m, LONG_PAGED.block_n, LONG_PAGED.persistent) == (row.block_m, 256, row.persistent)
    assert LONG_PAGED.fits("sm_90a") and m["nvfp4_out"] and not (LONG_PAGED.overlap or LONG_PAGED.pingpong)
    # the macro's BLOCK_N, serial loop, PAGED, persistent, no TMA, strided copies (no dense twin)
    assert f"{LONG_PAGED.name}, 128, 256, 2, 2, false, false, true, true, false, false, " in LONG_PAGED.source()


PS_LONG = 32


def _paged_long_plan(monkeypatch, kv_lens, long_env=None, layout="HND", ps=PS_LONG, **kw):
    """A paged e4m3 plan of 128 queries a request over kv_lens keys (pages of ps slots in reverse
    order), and its run over an HND cache (strides: the cache's, None = contiguous)."""
    from pyflashattn.testing.fake_driver import paged
    env = _env(monkeypatch, long_env)
    monkeypatch.delenv(routing.DENSE_ENV, raising=False)
    monkeypatch.delenv(routing.KV_LOAD_ENV, raising=False)
    w = paged(env, layout=layout, **kw.pop("wrapper", {}))
    pages = [-(-n // ps) for n in kv_lens]
    npages = sum(pages)
    qo = i32(0, *np.cumsum([128] * len(kv_lens)))
    w.plan(qo, i32(0, *np.cumsum(pages)), i32(*range(npages - 1, -1, -1)),
           i32(*[n - (p - 1) * ps for n, p in zip(kv_lens, pages)]), HQ, HKV, D, ps,
           q_data_type="float8_e4m3fn", kv_data_type="float8_e4m3fn", o_data_type="bfloat16", **kw)
    return env, w, int(qo[-1]), npages


@pytest.mark.parametrize("ps,kv_lens,kw,env,want", [
    # page 32: boxes of 32 rows, the TMA twins wherever routing.tma_pays (a mean of 1024+ keys; the
    # long twin's where long_pays without a mask)
    (32, [8192, 4096], {}, None, "long_tma"), (32, [2048, 1024], {}, None, "tma"), (32, [512, 300], {}, None, "dense"),
    (32, [16384], dict(causal=True), None, "tma"), (32, [8192], dict(causal=True), None, "tma"),
    (32, [8192], dict(fixed_split_size=512), None, "tma"), (32, [300], {}, "1", "long"),
    # page 16: no TMA twin (16-row boxes) and no dense twin (pages under 32 slots)
    (16, [8192, 4096], {}, None, "long"), (16, [8192], dict(causal=True), None, "row"),
    (16, [16384], dict(causal=True), None, "long"), (16, [8192], dict(fixed_split_size=512), None, "row"),
    (16, [8192], {}, "0", "row")])
def test_paged_plans_take_the_paged_long_twin_for_long_keys(monkeypatch, ps, kv_lens, kw, env, want):
    """The paged long twin copies strided slots (no dense fallback): a run() over padded slots
    keeps it; shorter or frozen plans take the paged row (HND page 32: its dense twin). Where the
    pages make TMA boxes of 32+ rows, the paged TMA twin runs instead of either (batch._twin)."""
    env_, w, tq, npages = _paged_long_plan(monkeypatch, kv_lens, env, ps=ps, **kw)
    la = w._engine.attn
    row = LONG_PAGED.default_row().name
    want_name = {"long": LONG_PAGED.name, "long_tma": LONG_PAGED.name + routing.TMA_SUFFIX,
                 "dense": row + routing.DENSE_SUFFIX, "tma": row + routing.TMA_SUFFIX, "row": row}[want]
    assert la.name == want_name and la.meta["block_n"] == (256 if want.startswith("long") else 128)
    q, out = T((tq, HQ, D), E4M3, data=0x1000000), T((tq, HQ, D), BF16, data=0xd000000)
    pad = D + 16
    for strides in (None, (2 * HKV * ps * pad, HKV * ps * pad, ps * pad, pad, 1)):
        w.run(q, T((npages, 2, HKV, ps, D), E4M3, strides=strides, data=0x5000000), out=out)
        name, _, _, p = last_attn(env_)
        if want == "long":  # its own schedule: whole 256-key tiles; any slot strides
            assert name == la.name and p.kv_chunk_size % 256 == 0 and not w._engine.kv_fallback
            assert w._engine.kv_twin is None and w._engine.kv_maps is None


def test_the_paged_long_tma_twin_falls_back_to_the_long_twin(monkeypatch):
    """A run() whose cache TMA cannot address (a broadcast kv-head stride of 0) runs the long TMA
    twin's fallback: the paged long twin (the same 256-key schedule), not the 128-key row."""
    env, w, tq, npages = _paged_long_plan(monkeypatch, [8192, 4096])
    assert w._engine.attn.name == LONG_PAGED.name + routing.TMA_SUFFIX
    q, out = T((tq, HQ, D), E4M3, data=0x1000000), T((tq, HQ, D), BF16, data=0xd000000)
    for head_stride, want in ((0, LONG_PAGED.name), (PS_LONG * D, LONG_PAGED.name + routing.TMA_SUFFIX)):
        strides = (2 * HKV * PS_LONG * D, HKV * PS_LONG * D, head_stride, D, 1)
        w.run(q, T((npages, 2, HKV, PS_LONG, D), E4M3, strides=strides, data=0x5000000), out=out)
        assert last_attn(env)[0] == want and w._engine.kv_fallback is (head_stride == 0)


def test_a_graph_mode_paged_plan_keeps_the_paged_row(monkeypatch):
    env, w, tq, npages = _paged_long_plan(monkeypatch, [8192], wrapper=dict(
        use_cuda_graph=True, qo_indptr_buf=T((2,), _dtypes.INT32, data=0x700000),
        paged_kv_indptr_buf=T((2,), _dtypes.INT32, data=0x710000),
        paged_kv_indices_buf=T((256,), _dtypes.INT32, data=0x720000),
        paged_kv_last_page_len_buf=T((1,), _dtypes.INT32, data=0x730000)))
    assert w._engine.attn.name != LONG_PAGED.name and w._engine.attn.meta["block_n"] == 128
