"""K/V by TMA in the batch plans, on the simulated driver: which kernel a plan routes to (the
variant table's HOPPER_KV_LOAD, PFA_SM90_KV_LOAD, page sizes), the tensor maps run() writes
(geometry, addresses patched without a new encode, the fast path), and the cp.async twin for K/V
that TMA cannot address."""
from __future__ import annotations

import ctypes
import dataclasses
import pathlib
import sys

import numpy as np
import pytest

import pyflashattn
from pyflashattn._engine import routing, single, tma
from pyflashattn._runtime import cuda as _cuda
from pyflashattn._runtime.params_gen import PrefillParams
from pyflashattn.testing.fake_driver import (
    T, D, HKV, KV_INDICES, KV_INDPTR, LAST, NPAGES, PS, TKV, TQ, FakeEnv, FakeTorch, cache_t, i32, kv_t, last_attn,
    out_t, paged, plan_ragged, q_t, ragged)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "build_tools"))
import variants  # noqa: E402

HQ = 8
# paged plans: 160 and 68 packed rows, past the paged decode tiles (64 rows): the row-tile kernel
QO_LONG = i32(0, 40, 40, 57)


def q_long():
    return T((57, HQ, D), data=0x100000)


def out_long():
    return T((57, HQ, D), data=0x400000)


def _env(monkeypatch, kv_load=None, ship=None):
    """A fake env whose 16-bit lean row-tile launchers are the sm90 rows of the variant table
    (TUNE=1 rows included); ship: the HOPPER_KV_LOAD entries that say "tma" (the others "cpasync",
    whatever the shipped table says)."""
    monkeypatch.setattr(variants, "HOPPER_KV_LOAD", {s: "tma" if s in (ship or ()) else "cpasync"
                                                     for s in variants.HOPPER_KV_LOAD})
    rows = variants.variants(tune=True)
    env = FakeEnv(monkeypatch, rows)
    env.use_sm90_rows(monkeypatch, rows)
    for name in ("_FIELD", "_TEMPLATES"):
        monkeypatch.setattr(tma, name, {})
    if kv_load is None:
        monkeypatch.delenv(routing.KV_LOAD_ENV, raising=False)
    else:
        monkeypatch.setenv(routing.KV_LOAD_ENV, kv_load)
    return env


def _maps(env):
    return [x for x in env.cu.log if x[0] == "tmap"]


def _map_bytes(p, field):
    return ctypes.string_at(ctypes.addressof(p) + getattr(PrefillParams, field).offset, 128)


def _expected(ptr, dims, strides, box):
    return _cuda.tensor_map_bytes(_cuda.encode_tensor_map("f16", ptr, dims, strides, box))


def test_ragged_tma_plan_writes_3d_maps_and_patches_new_addresses(monkeypatch):
    env = _env(monkeypatch, "tma")
    w = ragged(env)
    plan_ragged(w)
    assert w._engine.attn.name.endswith("_tma") and w._engine.attn.meta["tma"]
    k, v = kv_t(data=0x300000), kv_t(data=0x380000)
    w.run(q_t(), k, v, out=out_t())
    name, _, _, p = last_attn(env)
    assert name.endswith("_tma")
    dims, strides, box = (D, HKV, tma.ROW_EXTENT), (D * 2, HKV * D * 2), (64, 1, 128)
    assert _map_bytes(p, "k_tmap") == _expected(0x300000, dims, strides, box)
    assert _map_bytes(p, "v_tmap") == _expected(0x380000, dims, strides, box)
    encoded = len(_maps(env))
    # new K/V addresses, the same geometry: patched, not encoded
    w.run(q_t(), kv_t(data=0x600000), kv_t(data=0x680000), out=out_t())
    p = last_attn(env)[3]
    assert len(_maps(env)) == encoded
    assert _map_bytes(p, "k_tmap") == _expected(0x600000, dims, strides, box)
    assert _map_bytes(p, "v_tmap") == _expected(0x680000, dims, strides, box)


@pytest.mark.parametrize("heads,s,block_m", [(32, 1024, 128), (32, 2048, 192), (32, 8192, 192), (2, 300, 128)])
def test_single_prefill_hd64_takes_the_row_tile_whose_last_round_fills(monkeypatch, heads, s, block_m):
    # 32 x 1024: 192 blocks of 192 rows on 132 SMs end in a round 0.45 full, 256 of 128 rows in one
    # 0.94 full (routing.row_tile_block_m); long prompts keep the faster 192-row tile
    env = _env(monkeypatch, ship=("ragged",))
    monkeypatch.setattr(single._tls, "plans", {}, raising=False)
    q, k, v = (T((s, heads, 64), data=base) for base in (0x1000000, 0x5000000, 0x9000000))
    pyflashattn.single_prefill_with_kv_cache(q, k, v, out=T((s, heads, 64), data=0xd000000))
    name = last_attn(env)[0]
    assert f"_hd64_m{block_m}n128" in name and name.endswith("_tma"), name
    rows = {v.block_m for v in variants.variants() if isinstance(v, variants.HopperPrefillVariant)
            and v.head_dim == 64 and not v.paged and not v.tune}
    assert rows == set(routing.SM90_ROW_TILE_SPEED[64]) == {128, 192}  # the speeds cover the built rows


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_single_prefill_runs_the_tma_twin_with_one_byte_boxes(monkeypatch, d):
    env = _env(monkeypatch)
    monkeypatch.setattr(single._tls, "plans", {}, raising=False)
    from pyflashattn._runtime import dtypes as _dtypes
    e4m3 = _dtypes.FLOAT8_E4M3
    q = T((300, HQ, d), e4m3, data=0x100000)
    k, v = T((300, HKV, d), e4m3, data=0x300000), T((300, HKV, d), e4m3, data=0x380000)
    pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=True, o_dtype="bfloat16",
                                             out=T((300, HQ, d), _dtypes.BFLOAT16, data=0x400000))
    name, _, _, p = last_attn(env)
    assert "_e4m3_" in name and name.endswith("_tma") == (d in variants.HOPPER_FP8_TMA_HEAD_DIMS)
    if d in variants.HOPPER_FP8_TMA_HEAD_DIMS:  # boxes of 128 one-byte columns x the row's tile, strides in bytes
        block_n = variants.HopperFp8PrefillVariant(d, *variants.HOPPER_FP8_TILES[d]).block_n
        assert f"n{block_n}c" in name
        dims, strides, box = (d, HKV, tma.ROW_EXTENT), (d, HKV * d), (128, 1, block_n)
        want = lambda ptr: _cuda.tensor_map_bytes(_cuda.encode_tensor_map("e4m3", ptr, dims, strides, box))  # noqa: E731
        assert _map_bytes(p, "k_tmap") == want(0x300000) and _map_bytes(p, "v_tmap") == want(0x380000)
        # Q too (QByTma): 128 one-byte columns x group heads x 128 / group tokens
        group = HQ // HKV
        q_box = (128, group, 128 // group)
        assert p.q_tma == 1 and p.q_tokens == 300
        assert _map_bytes(p, "q_tmap") == _cuda.tensor_map_bytes(_cuda.encode_tensor_map(
            "e4m3", 0x100000, (d, HQ, tma.ROW_EXTENT), (d, HQ * d), q_box))
    else:
        assert p.q_tma == 0


@pytest.mark.parametrize("ps,tma_kernel", [(16, True), (64, True), (32, True), (1, False), (8, False), (24, False),
                                           (256, True)])
def test_paged_tma_only_where_pages_make_whole_boxes(monkeypatch, ps, tma_kernel):
    env = _env(monkeypatch, "tma")
    w = paged(env)
    pages = i32(0, 2, 3, 3)
    lens = i32(min(3, ps), ps, 0)
    w.plan(QO_LONG, pages, KV_INDICES, lens, HQ, HKV, D, ps)
    assert bool(w._engine.attn.meta.get("tma")) is tma_kernel
    assert routing.tma_fits(True, ps, 128, 0) is tma_kernel
    cache = cache_t() if ps == PS else None
    if cache is None:
        cache = T((NPAGES, 2, ps, HKV, D), data=0x200000)
    w.run(q_long(), cache, out=out_long())
    name, _, _, p = last_attn(env)
    assert name.endswith("_tma") is tma_kernel
    if tma_kernel:
        rows = min(ps, 128)
        dims = (D, ps, HKV, NPAGES)
        strides = (HKV * D * 2, D * 2, 2 * ps * HKV * D * 2)
        assert _map_bytes(p, "k_tmap") == _expected(0x200000, dims, strides, (64, rows, 1, 1))
        assert _map_bytes(p, "v_tmap") == _expected(0x200000 + ps * HKV * D * 2, dims, strides, (64, rows, 1, 1))
    else:
        assert not _maps(env)


@pytest.mark.parametrize("ps,tma_kernel", [(16, True), (32, True), (8, False)])
def test_fp8_paged_prefill_runs_the_tma_twin_with_a_box_a_page(monkeypatch, ps, tma_kernel):
    from pyflashattn._runtime import dtypes as _dtypes
    e4m3 = _dtypes.FLOAT8_E4M3
    env = _env(monkeypatch, "tma")  # (short requests: the twin only where the override asks)
    w = paged(env)
    pages = i32(0, 2, 3, 3)
    lens = i32(min(3, ps), ps, 0)
    w.plan(QO_LONG, pages, KV_INDICES, lens, HQ, HKV, D, ps, q_data_type="float8_e4m3fn",
           kv_data_type="float8_e4m3fn", o_data_type="bfloat16")
    meta = w._engine.attn.meta
    assert meta["dtype"] == "e4m3" and bool(meta.get("tma")) is tma_kernel
    w.run(T((57, HQ, D), e4m3, data=0x100000), T((NPAGES, 2, ps, HKV, D), e4m3, data=0x200000),
          out=T((57, HQ, D), _dtypes.BFLOAT16, data=0x400000))
    name, _, _, p = last_attn(env)
    if name.endswith("_tma"):  # one-byte elements: boxes of 128 columns, strides in bytes
        dims, strides = (D, ps, HKV, NPAGES), (HKV * D, D, 2 * ps * HKV * D)
        want = lambda ptr: _cuda.tensor_map_bytes(  # noqa: E731
            _cuda.encode_tensor_map("e4m3", ptr, dims, strides, (128, min(ps, 128), 1, 1)))
        assert _map_bytes(p, "k_tmap") == want(0x200000) and _map_bytes(p, "v_tmap") == want(0x200000 + ps * HKV * D)


def test_hnd_paged_map_strides(monkeypatch):
    env = _env(monkeypatch, "tma")
    w = paged(env, layout="HND")
    w.plan(QO_LONG, KV_INDPTR, KV_INDICES, LAST, HQ, HKV, D, PS)
    w.run(q_long(), cache_t(layout="HND"), out=out_long())
    p = last_attn(env)[3]
    # [pages, 2, heads, slots, D]: slot stride D, head stride PS * D
    dims, strides = (D, PS, HKV, NPAGES), (D * 2, PS * D * 2, 2 * HKV * PS * D * 2)
    assert _map_bytes(p, "k_tmap") == _expected(0x200000, dims, strides, (64, 16, 1, 1))


@pytest.mark.parametrize("kv_load,ship,want_tma", [(None, (), False), ("cpasync", ("ragged", "paged"), False),
                                                   (None, ("ragged",), True), ("tma", (), True)])
def test_table_entry_and_override_pick_the_load(monkeypatch, kv_load, ship, want_tma):
    env = _env(monkeypatch, kv_load, ship)
    w = ragged(env)
    # requests long enough for the twin (routing.TMA_MIN_TILES), so the table / override decides
    w.plan(i32(0, 5, 5, 17), i32(0, 3000, 6000, 6000), HQ, HKV, D)
    assert bool(w._engine.attn.meta.get("tma")) is want_tma
    plan_ragged(w)  # short requests: the twin only when forced
    assert bool(w._engine.attn.meta.get("tma")) is (kv_load == "tma")
    twin = [v for v in variants.variants() if isinstance(v, variants.HopperPrefillVariant) and v.tma]
    assert bool(twin) is bool(ship)  # shipped twins are built without TUNE=1


def test_shipped_paged_twin_is_routed_without_the_override(monkeypatch):
    env = _env(monkeypatch, None, ("paged",))
    w = paged(env)
    # short requests (under routing.TMA_MIN_TILES key tiles on average) keep the cp.async kernel
    w.plan(QO_LONG, KV_INDPTR, KV_INDICES, LAST, HQ, HKV, D, PS)
    assert not w._engine.attn.meta.get("tma")
    # long ones take the twin where pages make boxes of 32+ rows (routing.PAGED_TMA_MIN_BOX_ROWS):
    # requests of 100 and 120 pages and an empty one (a mean of 1173 / 2347 keys, over 8 tiles of 128)
    n = (100, 120)
    indptr = i32(0, n[0], n[0] + n[1], n[0] + n[1])
    w.plan(QO_LONG, indptr, i32(*range(sum(n))), i32(16, 16, 0), HQ, HKV, D, PS)
    assert not w._engine.attn.meta.get("tma")  # 16-row pages: the cp.async kernel
    w.plan(QO_LONG, indptr, i32(*range(sum(n))), i32(32, 32, 0), HQ, HKV, D, 32)
    assert "_paged" in w._engine.attn.name and w._engine.attn.name.endswith("_tma")
    w = ragged(env)
    plan_ragged(w)
    assert not w._engine.attn.meta.get("tma")


def test_override_names_an_unbuilt_twin(monkeypatch):
    rows = [v for v in variants.variants(tune=True) if not getattr(v, "tma", False)]
    monkeypatch.setattr(variants, "variants", lambda tune=False: rows)
    env = _env(monkeypatch, "tma")
    w = ragged(env)
    with pytest.raises(RuntimeError, match="TUNE=1"):
        plan_ragged(w)
    monkeypatch.setenv(routing.KV_LOAD_ENV, "fast")
    with pytest.raises(ValueError, match=routing.KV_LOAD_ENV):
        routing.kv_load_override()


def test_unaddressable_kv_runs_the_cp_async_twin(monkeypatch):
    env = _env(monkeypatch, "tma")
    w = ragged(env)
    plan_ragged(w)
    # one head broadcast over the kv heads (stride 0): the operand checks take it, TMA cannot
    k = kv_t(data=0x300000, strides=(D, 0, 1))
    w.run(q_t(), k, kv_t(data=0x380000), out=out_t())
    name, grid, _, p = last_attn(env)
    assert not name.endswith("_tma") and w._engine.kv_fallback
    assert (p.k, p.v, p.k_stride_h, p.k_stride_n) == (0x300000, 0x380000, 0, D)
    assert grid == w._engine.attn.grid
    # and back on TMA for addressable K/V
    w.run(q_t(), kv_t(data=0x300000), kv_t(data=0x380000), out=out_t())
    assert last_attn(env)[0].endswith("_tma") and not w._engine.kv_fallback


def test_fast_path_repoints_the_maps(monkeypatch):
    env = _env(monkeypatch, "tma")
    ft = FakeTorch(env)
    monkeypatch.setitem(sys.modules, "torch", ft.module)
    from pyflashattn._runtime import tensor as _tensor
    monkeypatch.setattr(_tensor, "_TORCH_STRIDED", {"torch.strided"})
    monkeypatch.setattr(_tensor, "_TORCH_BY_NAME", {})
    w = ragged(env)
    plan_ragged(w)
    q, o = ft.tensor((17, HQ, D), "float16"), ft.tensor((17, HQ, D), "float16")
    w.run(q, ft.tensor((TKV, HKV, D), "float16"), ft.tensor((TKV, HKV, D), "float16"), out=o)
    assert w._engine.fast_key is not None
    encoded = len(_maps(env))
    k2, v2 = ft.tensor((TKV, HKV, D), "float16"), ft.tensor((TKV, HKV, D), "float16")
    w.run(q, k2, v2, out=o)
    p = last_attn(env)[3]
    assert (p.k, p.v) == (k2._ptr, v2._ptr) and len(_maps(env)) == encoded
    dims, strides, box = (D, HKV, tma.ROW_EXTENT), (D * 2, HKV * D * 2), (64, 1, 128)
    assert _map_bytes(p, "k_tmap") == _expected(k2._ptr, dims, strides, box)
    assert _map_bytes(p, "v_tmap") == _expected(v2._ptr, dims, strides, box)


def test_maps_of_a_driver_that_hides_the_address_take_the_replace_call(monkeypatch):
    env = _env(monkeypatch, "tma")
    real_encode, real_replace = env.cu.cuTensorMapEncodeTiled, env.cu.cuTensorMapReplaceAddress

    def scramble(obj, ptr):  # a second copy of address bits elsewhere: no single field to patch
        ctypes.memmove(obj.getPtr() + 100, bytes([(ptr >> 8) & 0xFF]), 1)

    def encode(kind, rank, ptr, *rest):
        err, obj = real_encode(kind, rank, ptr, *rest)
        scramble(obj, ptr)
        return err, obj

    def replace(obj, ptr):
        real_replace(obj, ptr)
        scramble(obj, ptr)
        return (0,)

    monkeypatch.setattr(env.cu, "cuTensorMapEncodeTiled", encode)
    monkeypatch.setattr(env.cu, "cuTensorMapReplaceAddress", replace)
    w = ragged(env)
    plan_ragged(w)
    w.run(q_t(), kv_t(data=0x300000), kv_t(data=0x380000), out=out_t())
    assert tma._FIELD[3] is False
    n, start = len(_maps(env)), len(env.cu.log)
    w.run(q_t(), kv_t(data=0x600000), kv_t(data=0x680000), out=out_t())
    replaced = [x[1] for x in env.cu.log[start:] if x[0] == "tmap_address"]
    assert len(_maps(env)) == n and replaced == [0x600000, 0x680000]
    dims, strides, box = (D, HKV, tma.ROW_EXTENT), (D * 2, HKV * D * 2), (64, 1, 128)
    assert _map_bytes(last_attn(env)[3], "k_tmap") == _expected(0x600000, dims, strides, box)


def test_twins_share_the_tile_and_smem_layout():
    rows = {v.name: v for v in variants.variants(tune=True) if isinstance(v, variants.HopperPrefillVariant)}
    for name, v in rows.items():
        if v.tma:
            base = rows[name[:-len(routing.TMA_SUFFIX)]]
            assert dataclasses.replace(base, tma=True, tune=v.tune) == v
            # the TMA layout's tail mbarriers, one a stage (producer warps 1..3 zero each tail's V)
            assert v.smem_bytes == base.smem_bytes + 8 * v.stages
    assert {tuple(sorted(variants.HOPPER_KV_LOAD))} == {("paged", "ragged")}


def test_paged_box_rows_matches_the_kernel_rule():
    # ProducerSm90Tma::box_rows: ps >= 16, a multiple of 8, dividing block_n or divided by it
    assert [tma.paged_box_rows(ps, 128) for ps in (1, 8, 16, 24, 32, 64, 128, 256, 384)] == \
        [0, 0, 16, 0, 32, 64, 128, 128, 128]
    assert [tma.paged_box_rows(ps, 80) for ps in (16, 20, 32, 40, 64, 80, 160)] == [16, 0, 0, 40, 0, 80, 80]


def test_a_driver_refusing_the_probe_addresses_takes_the_replace_call(monkeypatch):
    env = _env(monkeypatch, "tma")
    real = env.cu.cuTensorMapEncodeTiled

    def picky(kind, rank, ptr, *rest):
        return (1, None) if ptr in tma._PROBES else real(kind, rank, ptr, *rest)

    monkeypatch.setattr(env.cu, "cuTensorMapEncodeTiled", picky)
    w = ragged(env)
    plan_ragged(w)
    w.run(q_t(), kv_t(data=0x300000), kv_t(data=0x380000), out=out_t())
    assert tma._FIELD[3] is False
    w.run(q_t(), kv_t(data=0x600000), kv_t(data=0x680000), out=out_t())
    dims, strides, box = (D, HKV, tma.ROW_EXTENT), (D * 2, HKV * D * 2), (64, 1, 128)
    assert _map_bytes(last_attn(env)[3], "v_tmap") == _expected(0x680000, dims, strides, box)


def test_skip_softmax_runs_the_cp_async_skip_twin_and_back(monkeypatch):
    """A TMA plan's skip-softmax calls run its cp.async row's "_skip" twin (the same tile); back
    without skip-softmax, the TMA kernel's maps follow the K/V given meanwhile."""
    env = _env(monkeypatch, "tma")
    w = ragged(env)
    plan_ragged(w)
    tma_name = w._engine.attn.name
    w.run(q_t(), kv_t(data=0x300000), kv_t(data=0x380000), out=out_t())
    w.run(q_t(), kv_t(data=0x600000), kv_t(data=0x680000), out=out_t(), skip_softmax_threshold_scale_factor=0.5)
    name, _, _, p = last_attn(env)
    assert name == tma_name[:-len("_tma")] + "_skip" and p.skip_softmax_factor == 0.5
    assert (p.k, p.v) == (0x600000, 0x680000)
    w.run(q_t(), kv_t(data=0x600000), kv_t(data=0x680000), out=out_t())
    name, _, _, p = last_attn(env)
    assert name == tma_name and p.skip_softmax_factor == 0.0
    dims, strides, box = (D, HKV, tma.ROW_EXTENT), (D * 2, HKV * D * 2), (64, 1, 128)
    assert _map_bytes(p, "k_tmap") == _expected(0x600000, dims, strides, box)
    assert _map_bytes(p, "v_tmap") == _expected(0x680000, dims, strides, box)


def test_tma_pays_paged_from_32_row_boxes_and_long_requests(monkeypatch):
    monkeypatch.delenv(routing.KV_LOAD_ENV, raising=False)
    long_, short = np.full(4, 4096), np.full(4, 32)
    assert not routing.tma_pays(True, 16, long_, 128, False)  # 16-row boxes: the cp.async copies
    assert not routing.tma_pays(True, 16, long_, 128, True)  # a frozen (graph) plan too
    assert routing.tma_pays(True, 32, long_, 128, False) and routing.tma_pays(True, 64, long_, 128, True)
    assert not routing.tma_pays(True, 64, short, 128, False)  # one-tile requests
    assert routing.tma_pays(True, 64, short, 128, True)  # unless the kernel is frozen
    assert routing.tma_pays(False, 0, long_, 128, False) and not routing.tma_pays(False, 0, short, 128, False)
    monkeypatch.setenv(routing.KV_LOAD_ENV, "tma")  # A/B runs and tests: the twin wherever it fits
    assert routing.tma_pays(True, 16, short, 128, False)


def test_persistent_rows_launch_at_most_a_cta_an_sm_over_the_logical_grid(monkeypatch):
    """The persistent sm90 rows (variants.HOPPER_PERSISTENT) launch min(blocks, SMs x CTAs an SM)
    CTAs, and the struct carries the logical grid they walk (sm90/cta.cuh); the batch plans' is
    (kv heads, 1, work items), as a one-CTA-a-block launch's."""
    env = _env(monkeypatch, "tma")
    w = ragged(env)
    # one long request: (row tiles of 128 packed rows) x KV chunks work items, over 132 SMs
    qo, kv = i32(0, 4096), i32(0, 4096)
    w.plan(qo, kv, HQ, HKV, D, causal=True)
    la = w._engine.attn
    assert la.meta["persistent"] and "_ps" in la.name
    p = la.params
    blocks = p.grid_x * p.grid_y * p.grid_z
    assert (p.grid_x, p.grid_y) == (HKV, 1) and p.grid_z == w._engine.schedule.grid
    assert la.grid == (min(blocks, 132 * la.meta["ctas_per_sm"]), 1, 1) and blocks > 132
    q, k, v = (T((4096, HQ, D), data=0x100000), T((4096, HKV, D), data=0x300000),
               T((4096, HKV, D), data=0x380000))
    w.run(q, k, v, out=T((4096, HQ, D), data=0x400000))
    name, grid, _, lp = last_attn(env)
    assert name == la.name and grid == la.grid and (lp.grid_x, lp.grid_y, lp.grid_z) == (p.grid_x, 1, p.grid_z)
    # few blocks: one CTA each
    plan_ragged(w)
    p = w._engine.attn.params
    assert w._engine.attn.grid == (p.grid_x * p.grid_y * p.grid_z, 1, 1)


def test_only_the_hd64_hd128_sm90_rows_are_persistent():
    rows = variants.variants(tune=True)
    for v in rows:
        if isinstance(v, (variants.HopperPrefillVariant, variants.HopperFp8PrefillVariant)):
            fp8_paged = isinstance(v, variants.HopperFp8PrefillVariant) and v.paged
            if isinstance(v, variants.HopperPrefillVariant):
                table = variants.HOPPER_PERSISTENT
            else:
                table = variants.HOPPER_FP8_PERSISTENT_PAGED if fp8_paged else variants.HOPPER_FP8_PERSISTENT
            # the paged fp8 rows: hd128 only (hd64's 32-register producer spills persistent)
            assert v.persistent is table[v.head_dim] is (v.head_dim == 128 if fp8_paged else v.head_dim != 256)
            assert ("_ps" in v.name) is v.persistent
            assert v.manifest()["persistent"] is v.persistent


def test_l2_section_keeps_a_sections_kv_within_its_share_of_l2(monkeypatch):
    monkeypatch.delenv(routing.L2_SECTION_ENV, raising=False)
    l2 = 48 << 20
    head = 2 * 4096 * 128 * 2  # K and V of one kv head over 4096 bf16 rows: 2 MiB
    fit = int(routing.L2_SECTION_SHARE * l2) // head  # 6 heads fit; 8 heads: two sections of 4, not 6 + 2
    assert fit == 6 and routing.l2_section(8, 4096, 128, 2, l2) == 4
    assert routing.l2_section(16, 4096, 128, 2, l2) == 6 and routing.l2_section(12, 4096, 128, 2, l2) == 6
    assert routing.l2_section(7, 4096, 128, 2, l2) == 4  # 4 + 3
    assert routing.l2_section(2, 4096, 128, 2, l2) == 2  # at most every head: one section
    assert routing.l2_section(8, 1 << 22, 128, 2, l2) == 1  # at least one head
    assert routing.l2_section(8, 0, 128, 2, l2) == 8 and routing.l2_section(8, 4096, 128, 2, 0) == 8
    monkeypatch.setenv(routing.L2_SECTION_ENV, "0")
    assert routing.l2_section(8, 4096, 128, 2, l2) == 8
    monkeypatch.setenv(routing.L2_SECTION_ENV, "1e-9")
    assert routing.l2_section(8, 4096, 128, 2, l2) == 1
    monkeypatch.setenv(routing.L2_SECTION_ENV, "half")
    with pytest.raises(ValueError, match=routing.L2_SECTION_ENV):
        routing.l2_section(8, 4096, 128, 2, l2)


def _logical_block(p, item):
    """work.cuh LogicalGrid::at, transcribed: (x, y, z) of block `item`."""
    zh, per_z = p["zh"], p["gx"] * p["gy"]
    if item >= zh * per_z:  # the tail
        r = item - zh * per_z
        z, xy = divmod(r, per_z)
        return xy % p["gx"], xy // p["gx"], zh + z
    per_x = p["gy"] * zh
    x0 = item // (p["s"] * per_x) * p["s"]
    xs = min(p["s"], p["gx"] - x0)
    within = item - x0 * per_x
    yz = within // xs
    return x0 + within - yz * xs, yz % p["gy"], yz // p["gy"]


@pytest.mark.parametrize("gx,gy,gz,s", [(8, 1, 37, 3), (8, 2, 5, 8), (5, 3, 4, 2), (1, 1, 9, 1), (7, 1, 3, 1)])
@pytest.mark.parametrize("tail", [0, 1, 3, "all"])
def test_logical_grid_sections_visit_every_block_once_a_section_at_a_time(gx, gy, gz, s, tail):
    zh = 0 if tail == "all" else max(0, gz - tail)
    p = dict(gx=gx, gy=gy, gz=gz, s=s, zh=zh)
    blocks = [_logical_block(p, b) for b in range(gx * gy * gz)]
    assert sorted(blocks) == sorted((x, y, z) for x in range(gx) for y in range(gy) for z in range(gz))
    head, rest = blocks[:gx * gy * zh], blocks[gx * gy * zh:]
    assert all(z < zh for _, _, z in head) and all(z >= zh for _, _, z in rest)
    sections = [x // s for x, _, _ in head]
    assert sections == sorted(sections)  # a section's blocks all before the next's
    for sec in set(sections):  # within a section: x fastest, then y, then z (heaviest first)
        own = [(z, y, x) for x, y, z in head if x // s == sec]
        assert own == sorted(own)
    assert rest == sorted(rest, key=lambda b: b[::-1])  # the tail: every x together, x fastest, then y, z
    if s == gx:  # one section: the order of a one-CTA-a-block launch, wherever the tail starts
        assert blocks == [(b % gx, b // gx % gy, b // (gx * gy)) for b in range(gx * gy * gz)]


def _finish_time(weights_by_item, ctas):
    """List scheduling (the tile scheduler: a free CTA takes the next block): the last finish."""
    import heapq
    free = [0] * ctas
    for w in weights_by_item:
        heapq.heappush(free, heapq.heappop(free) + w)
    return max(free)


def test_section_head_z_leaves_a_tail_that_evens_out_the_last_sections_heavy_blocks():
    ctas = 132
    # one causal request, 16 heads in sections of 3 (+1), row tiles heaviest first
    for rows in (16, 64, 128):
        tiles = np.arange(rows, 0, -1)
        zh = routing.section_head_z(tiles, 16, ctas)
        w = tiles + routing.BLOCK_OVERHEAD_TILES
        tail = 16 * int(w[zh:].sum())
        assert tail >= ctas * int(w.max())  # the tail holds a wave of the heaviest blocks
        assert zh == 0 or 16 * int(w[zh + 1:].sum()) < ctas * int(w.max())  # and no more than it needs
        p = dict(gx=16, gy=1, gz=rows, s=3, zh=zh)
        order = [w[_logical_block(p, b)[2]] for b in range(16 * rows)]
        no_tail = [w[_logical_block(dict(p, zh=rows), b)[2]] for b in range(16 * rows)]
        ideal = max(16 * int(w.sum()) / ctas, int(w.max()))
        assert _finish_time(order, ctas) <= 1.02 * ideal + 1
        if rows == 64:  # sections without the tail: the last section's heaviest blocks end late
            assert _finish_time(no_tail, ctas) > 1.1 * ideal
    assert routing.section_head_z(np.arange(8, 0, -1), 16, ctas) == 0  # under one wave: no sections
    assert routing.section_head_z(np.array([], np.int64), 16, ctas) == 0


def _small_l2(monkeypatch, l2_bytes):
    props = dict(_cuda.properties(0), l2_bytes=l2_bytes)
    monkeypatch.setattr(_cuda, "properties", lambda dev: props)
    monkeypatch.delenv(routing.L2_SECTION_ENV, raising=False)


def test_persistent_batch_plans_take_zeroed_scheduler_counters_and_l2_sections(monkeypatch):
    env = _env(monkeypatch, "tma")
    _small_l2(monkeypatch, 4 << 20)  # 1 MiB a section; one kv head's K/V over 4096 rows is 2 MiB
    w = ragged(env)
    w.plan(i32(0, 4096), i32(0, 4096), HQ, HKV, D, causal=True)
    la = w._engine.attn
    assert la.meta["persistent"]
    p = la.params
    assert p.sched and ctypes.string_at(p.sched, 8) == bytes(8)
    assert p.grid_section == 1 and p.grid_x == HKV
    props = _cuda.properties(0)
    plan = w._engine.schedule
    assert p.grid_section_z == routing.section_head_z(plan.item_tiles(1), HKV, props["sm_count"] *
                                                      routing.ctas_per_sm(la.meta, props))
    counters = p.sched
    assert ("memset", counters, 16) in env.cu.log
    w.plan(i32(0, 64), i32(0, 64), HQ, HKV, D, causal=True)  # small K/V: one section, the same counters
    p = w._engine.attn.params
    assert p.sched == counters and p.grid_section == HKV and p.grid_section_z == p.grid_z


def test_a_batch_plan_made_while_its_stream_captures_makes_no_counters(monkeypatch):
    env = _env(monkeypatch, "tma")
    _small_l2(monkeypatch, 4 << 20)
    w = ragged(env)
    env.cu.capturing.add(launch_stream := 5)
    w.plan(i32(0, 4096), i32(0, 4096), HQ, HKV, D, causal=True, stream=launch_stream)
    p = w._engine.attn.params
    assert p.sched == 0 and p.grid_section == HKV  # a fixed share of blocks, one section
    env.cu.capturing.discard(launch_stream)
    w.plan(i32(0, 4096), i32(0, 4096), HQ, HKV, D, causal=True, stream=launch_stream)
    p = w._engine.attn.params
    assert p.sched and p.grid_section == 1


def test_sm90_rows_a_cta_a_block_take_l2_sections_as_a_1d_launch(monkeypatch):
    env = _env(monkeypatch)
    _small_l2(monkeypatch, 8 << 20)  # 2 MiB a section; one hd256 kv head over 4096 rows is 4 MiB
    w = ragged(env)
    w.plan(i32(0, 4096), i32(0, 4096), HQ, HKV, 256, causal=True)
    la = w._engine.attn
    assert la.meta["impl"] == "sm90" and not la.meta["persistent"]
    p = la.params
    assert (p.grid_x, p.grid_y, p.grid_section, p.sched) == (HKV, 1, 1, 0)
    assert la.grid == (HKV * p.grid_z, 1, 1) and p.grid_z == w._engine.schedule.grid
    w.plan(i32(0, 64), i32(0, 64), HQ, HKV, 256, causal=True)  # small K/V: one section
    la = w._engine.attn
    assert la.params.grid_section == la.params.grid_x == HKV and la.grid == (HKV * w._engine.schedule.grid, 1, 1)


def test_persistent_single_prefill_takes_the_streams_counters_and_l2_sections(monkeypatch):
    env = _env(monkeypatch, "tma")
    _small_l2(monkeypatch, 4 << 20)  # 1 MiB a section; one kv head's K/V over 4096 rows is 2 MiB
    monkeypatch.setattr(_cuda.Workspace, "_spaces", {})
    monkeypatch.setattr(single._tls, "plans", {}, raising=False)
    q, k, v = T((4096, HQ, D), data=0x100000), T((4096, HKV, D), data=0x300000), T((4096, HKV, D), data=0x380000)
    pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=True, out=T((4096, HQ, D), data=0x400000))
    name, grid, _, p = last_attn(env)
    assert "_ps" in name and grid[1:] == (1, 1)
    assert p.sched and ctypes.string_at(p.sched, 8) == bytes(8) and p.grid_section == 1 and p.grid_x == HKV
    first = p.sched
    pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=True, out=T((4096, HQ, D), data=0x400000))
    assert last_attn(env)[3].sched == first  # the stream's counters, made once
    # a launch without counters (a capture that has none) runs one section, and the next with them
    # its sections again: the logical grid's divisors follow each time (the fake driver checks them)
    (plan,) = single._tls.plans.values()
    plan.run(0x100000, 0x300000, 0x380000, 0x400000, 0, 0, sched=0)
    p = last_attn(env)[3]
    assert p.sched == 0 and (p.grid_section, p.grid_section_z) == (p.grid_x, p.grid_z) == (HKV, p.grid_z)
    plan.run(0x100000, 0x300000, 0x380000, 0x400000, 0, 0)
    p = last_attn(env)[3]
    assert p.sched and p.grid_section == 1 and (p.div_x_mul, p.div_x_shift) == (1, 0)  # stream 0's counters


def test_rows_fastest_single_prefill_takes_no_sections(monkeypatch):
    # an equal-cost grid in (row tile, chunk, kv head) order already runs a head at a time: one
    # section, whatever the L2 (the fp8 rows honour rows_fastest and are persistent at hd128)
    from pyflashattn._runtime import dtypes as _dtypes
    env = _env(monkeypatch)
    _small_l2(monkeypatch, 1 << 20)
    monkeypatch.setattr(_cuda.Workspace, "_spaces", {})
    monkeypatch.setattr(single._tls, "plans", {}, raising=False)
    e4m3 = _dtypes.FLOAT8_E4M3
    q, k, v = (T((4096, h, D), e4m3, data=a) for h, a in ((HQ, 0x100000), (HKV, 0x300000), (HKV, 0x380000)))
    pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=False, o_dtype="bfloat16",
                                             out=T((4096, HQ, D), _dtypes.BFLOAT16, data=0x400000))
    name, _, _, p = last_attn(env)
    assert "_ps" in name and p.rows_fastest == 1
    assert (p.grid_section, p.grid_section_z) == (p.grid_x, p.grid_z)


def test_scheduler_counters_are_not_made_while_the_stream_captures(monkeypatch):
    env = _env(monkeypatch)
    monkeypatch.setattr(_cuda.Workspace, "_spaces", {})
    env.cu.capturing.add(7)
    assert _cuda.Workspace.counters(0, 7) == 0  # the launch keeps a fixed share and one section
    env.cu.capturing.discard(7)
    made = _cuda.Workspace.counters(0, 7)
    assert made and ctypes.string_at(made, 16) == bytes(16) and _cuda.Workspace.counters(0, 7) == made
    assert ("memset", made, 16) in env.cu.log


Q_DIMS, Q_STRIDES = (D, HQ, tma.ROW_EXTENT), (D * 2, HQ * D * 2)


@pytest.mark.parametrize("kv_load", ["tma", "cpasync"])
def test_q_map_of_a_16bit_tma_plan_follows_q(monkeypatch, kv_load):
    """The TMA rows take Q by TMA: the map's box is group heads x block_m / group tokens (the row
    tile's packed rows in order), q_tokens Q's rows; a new q is patched, not encoded. The
    cp.async rows copy Q (no map)."""
    env = _env(monkeypatch, kv_load)
    w = ragged(env)
    plan_ragged(w)
    w.run(q_t(), kv_t(data=0x300000), kv_t(data=0x380000), out=out_t())
    name, _, _, p = last_attn(env)
    if kv_load == "cpasync":
        assert "_sm90_" in name and not name.endswith("_tma") and p.q_tma == 0 and not _maps(env)
        return
    group, block_m = HQ // HKV, w._engine.attn.meta["block_m"]
    box = (64, group, block_m // group)
    assert name.endswith("_tma") and p.q_tma == 1 and p.q_tokens == TQ
    assert _map_bytes(p, "q_tmap") == _expected(p.q, Q_DIMS, Q_STRIDES, box)
    encoded = len(_maps(env))
    w.run(q_t(data=0x900000), kv_t(data=0x300000), kv_t(data=0x380000), out=out_t())
    p = last_attn(env)[3]
    assert len(_maps(env)) == encoded and p.q == 0x900000
    assert _map_bytes(p, "q_tmap") == _expected(0x900000, Q_DIMS, Q_STRIDES, box)


def test_q_map_needs_whole_tokens_per_row_tile():
    assert tma.q_geometry(12, 128, 12 * 128, 128, 2, 3, 128) is None  # 128 rows are not whole tokens of 3 heads
    assert tma.q_geometry(12, 128, 12 * 128, 128, 2, 3, 192) == ((128, 12, tma.ROW_EXTENT), (256, 12 * 256),
                                                                 (64, 3, 64))
    assert tma.q_geometry(512, 64, 512 * 64, 64, 2, 512, 512) is None  # a box dim past 256


def test_q_map_forget_rewrites_the_struct(monkeypatch):
    _env(monkeypatch)
    p = PrefillParams()
    m = tma.q_map("f16", p, {"impl": "sm90", "tma": True, "block_m": 128}, HQ, D, HQ // HKV, 2)
    assert tma.q_map("f16", p, {"impl": "sm90", "tma": False, "block_m": 128}, HQ, D, HQ // HKV, 2) is None
    m.configure(100, HQ * D, D)
    m.point(0x100000)
    assert (p.q_tma, p.q_tokens) == (1, 100)
    p.q_tma, p.q_tokens = 0, 0  # the struct overwritten (a sibling's struct copied back)
    m.forget()
    m.configure(100, HQ * D, D)
    m.point(0x100000)
    assert (p.q_tma, p.q_tokens) == (1, 100)
    assert _map_bytes(p, "q_tmap") == _expected(0x100000, Q_DIMS, Q_STRIDES, (64, HQ // HKV, 128 // (HQ // HKV)))
    m.configure(100, HQ * D + 4, D)  # a token stride TMA cannot take (not 16 bytes): the copies
    assert p.q_tma == 0


def test_q_map_of_an_e4m3_tma_row(monkeypatch):
    """The e4m3 TMA rows take Q by TMA too (QByTma): a box of 128 one-byte columns x group heads x
    block_m / group tokens, the map's data one byte wide."""
    _env(monkeypatch)
    p = PrefillParams()
    group = HQ // HKV
    m = tma.q_map("e4m3", p, {"impl": "sm90", "tma": True, "block_m": 128}, HQ, D, group, 1)
    m.configure(100, HQ * D, D)
    m.point(0x200000)
    assert (p.q_tma, p.q_tokens) == (1, 100)
    want = _cuda.tensor_map_bytes(_cuda.encode_tensor_map("e4m3", 0x200000, (D, HQ, tma.ROW_EXTENT), (D, HQ * D),
                                                          (128, group, 128 // group)))
    assert _map_bytes(p, "q_tmap") == want
    m.configure(100, HQ * D + 8, D)  # a token stride TMA cannot take (not 16 bytes): the copies
    assert p.q_tma == 0


def test_skip_softmax_sibling_copies_q(monkeypatch):
    """The skip-softmax sibling's struct is a copy; Q's map is pointed in the plan's own struct,
    so the sibling copies Q (q_tma 0) and the plan's struct takes Q's map again afterwards."""
    env = _env(monkeypatch, "tma")
    w = ragged(env)
    plan_ragged(w)
    w.run(q_t(), kv_t(data=0x300000), kv_t(data=0x380000), out=out_t(), skip_softmax_threshold_scale_factor=0.5)
    name, _, _, p = last_attn(env)
    assert name.endswith("_skip") and p.q_tma == 0
    w.run(q_t(data=0x900000), kv_t(data=0x300000), kv_t(data=0x380000), out=out_t())
    name, _, _, p = last_attn(env)
    assert name.endswith("_tma") and p.q_tma == 1 and p.q == 0x900000
    group = HQ // HKV
    assert _map_bytes(p, "q_tmap") == _expected(0x900000, Q_DIMS, Q_STRIDES, (64, group, 128 // group))
