"""Batch engine on the simulated driver: run()'s torch fast path, PDL, decode-tile routing, streams
and JAX-style producers."""
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
from pyflashattn.testing.fake_tensors import compact_strides as _compact
from pyflashattn.testing.fake_driver import (  # noqa: F401 - the shared fixtures' vocabulary
    Paged, Ragged, f32, BF16, BOOL, D, E4M3, E5M2, F16, FakeDriver, FakeEnv, FakeTorch, FakeTorchTensor, HKV,
    HQ, I32, KV_INDICES, KV_INDPTR, LAST, LOG2E, MASK_BITS, NPAGES, PS, QO, RAGGED_KV, T, TKV, TQ, U8, WS,
    _META, _TorchDtype, _decode_variant, _simulate_packbits, cache_t, i32, kv_t, last_attn, lse_t, out_t,
    paged, plan_paged, plan_ragged, q_t, ragged)


def test_torch_fast_path_allocates_contiguous_outputs(fake, fake_torch):
    """run() without out= on the fast path: o like q (contiguous), lse float32 [total_q, Hq], and
    the kernel writes where they are."""
    w = ragged(fake)
    plan_ragged(w)
    ft = fake_torch
    q, k, v = ft.tensor((TQ, HQ, D), "float16"), ft.tensor((TKV, HKV, D), "float16"), ft.tensor((TKV, HKV, D), "float16")
    w.run(q, k, v, return_lse=True)  # the full path validates and remembers the signature
    assert w._engine.fast_key is not None
    ft.allocs.clear()
    o, lse = w.run(q, k, v, return_lse=True)
    assert ft.allocs == [("empty_like", (TQ, HQ, D), ft.dtypes["float16"]),
                         ("empty", (TQ, HQ), ft.dtypes["float32"])]
    assert o.stride() == _compact((TQ, HQ, D)) and lse.shape == (TQ, HQ)
    p = last_attn(fake)[3]
    assert (p.o, p.lse) == (o._ptr, lse._ptr)
    assert (p.o_stride_n, p.o_stride_h) == (HQ * D, D)


@pytest.mark.parametrize("kvdt", ["float16", "float8_e4m3fn"])
def test_torch_fast_path_applies_scales_and_rereads_pointers(fake, fake_torch, kvdt):
    w = ragged(fake)
    plan_ragged(w, kv_data_type=kvdt, sm_scale=0.25)
    ft = fake_torch
    q, o = ft.tensor((TQ, HQ, D), "float16"), ft.tensor((TQ, HQ, D), "float16")
    k, v = ft.tensor((TKV, HKV, D), kvdt), ft.tensor((TKV, HKV, D), kvdt)
    w.run(q, k, v, out=o)
    key = w._engine.fast_key
    assert key is not None
    for ks, vs in [(0.5, 2.0), (None, None), (2, 0.125)]:
        q2, k2, v2, o2 = (ft.tensor(t.shape, t.dtype) for t in (q, k, v, o))
        r = w.run(q2, k2, v2, out=o2, k_scale=ks, v_scale=vs)
        assert r is o2 and w._engine.fast_key == key
        p = last_attn(fake)[3]
        assert (p.q, p.k, p.v, p.o) == (q2._ptr, k2._ptr, v2._ptr, o2._ptr)
        assert p.sm_scale_log2 == pytest.approx(f32(0.25 * LOG2E * (ks or 1.0)))
        assert p.v_scale == (vs or 1.0)
    # another dtype: the fast path misses and the full checks name the argument
    with pytest.raises(TypeError, match=r"\bk\b"):
        w.run(q, ft.tensor((TKV, HKV, D), "bfloat16"), v, out=o)


def test_paged_fast_path_keeps_the_cache_form_checks(fake, fake_torch):
    w = paged(fake)
    plan_paged(w, kv_data_type="float8_e5m2")
    ft = fake_torch
    q, o = ft.tensor((TQ, HQ, D), "float16"), ft.tensor((TQ, HQ, D), "float16")
    c = ft.tensor((NPAGES, 2, PS, HKV, D), "float8_e5m2")
    w.run(q, c, out=o)
    w.run(q, c, out=o)  # fast path
    p = last_attn(fake)[3]
    assert p.v - p.k == PS * HKV * D  # the V half of the 5-D cache, one byte per element
    n = len(fake.attn_launches())
    with pytest.raises(ValueError, match="tuple"):
        w.run(q, (c,), out=o)  # a 1-tuple is refused even though it holds the remembered cache
    kc, vc = ft.tensor((NPAGES, PS, HKV, D), "float8_e5m2"), ft.tensor((NPAGES, PS, HKV, D), "float8_e5m2")
    w.run(q, (kc, vc), out=o)
    w.run(q, (kc, vc), out=o)
    assert len(fake.attn_launches()) == n + 2
    p = last_attn(fake)[3]
    assert (p.k, p.v) == (kc._ptr, vc._ptr)


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_enable_pdl_launches_the_attention_programmatically(fake, fake_torch, kind):
    """enable_pdl=True: the attention kernel goes through cuLaunchKernelEx with programmatic
    stream serialization, over the plan's own params struct and grid (full and fast paths,
    across a re-plan that changes the grid); None / False: the plain launch."""
    w = paged(fake) if kind == "paged" else ragged(fake)
    plan = plan_paged if kind == "paged" else plan_ragged
    plan(w)
    ft = fake_torch
    q, o = ft.tensor((TQ, HQ, D), "float16"), ft.tensor((TQ, HQ, D), "float16")
    kv = ((ft.tensor((NPAGES, 2, PS, HKV, D), "float16"),) if kind == "paged"
          else (ft.tensor((TKV, HKV, D), "float16"), ft.tensor((TKV, HKV, D), "float16")))

    def attn_log():
        return [e[0] for e in fake.cu.log if e[0].startswith("launch") and "prefill" in e[1]]

    for pdl in (True, True, None, False, True):  # full path, then the fast path
        fake.cu.log.clear()
        w.run(q, *kv, out=o, enable_pdl=pdl)
        assert attn_log() == ["launch_pdl" if pdl else "launch"]
        name, grid, stream, p = last_attn(fake)
        assert grid == w._engine.attn.grid and (p.q, p.o) == (q._ptr, o._ptr)
    before = w._engine.attn.grid
    if kind == "paged":  # the same tokens as one request: one work item, another grid
        w.plan(i32(0, TQ), i32(0, 3), KV_INDICES, i32(3), HQ, HKV, D, PS)
    else:
        w.plan(i32(0, TQ), i32(0, TKV), HQ, HKV, D)
    assert w._engine.attn.grid != before
    fake.cu.log.clear()
    w.run(q, *kv, out=o, enable_pdl=True)
    assert attn_log() == ["launch_pdl"] and last_attn(fake)[1] == w._engine.attn.grid


def test_decode_tile_only_when_every_request_fits_decode_max_rows(fake):
    """The decode tiles (routing.built_decode_tiles) for batches whose longest request fits one: 16 rows,
    and over fp8 or paged K/V also the 32- and 64-row tiles; over ragged 16-bit K/V up to
    DECODE_MAX_ROWS[head_dim] packed rows as two 16-row tiles. Each with a plan on its tile and its
    CTAs per SM; the 128-row kernel otherwise and with options only the general kernels carry. In
    CUDA-graph mode the first plan picks for good."""
    assert pyflashattn._engine.routing.DECODE_MAX_ROWS == {64: 32, 128: 32, 256: 16}
    w = ragged(fake)  # 8 / 2 heads: group 4
    w.plan(i32(0, 4, 5, 5, 7), i32(0, 900, 1700, 1800, 3000), HQ, HKV, D, causal=True)
    la = w._engine.attn
    assert la.meta["decode"] and la.meta["block_m"] == 16 and la.threads == 32
    assert w._engine.schedule.block_m == 16
    assert last_cfg_ctas(w) == 233472 // (36992 + 1024)  # 6 on an H100's 228 KB (hd128, 32-key tiles)
    # 8 x 4 = 32 rows: two row tiles of the 16-row tile (contiguous 16-bit K/V: decode_tiles)
    w.plan(i32(0, 8, 9), i32(0, 900, 1700), HQ, HKV, D, causal=True)
    assert w._engine.attn is la and w._engine.schedule.block_m == 16
    p = w._engine.schedule
    assert set(zip(p.work_request[:p.num_work].tolist(), p.work_qtile[:p.num_work].tolist())) == {
        (0, 0), (0, 1), (1, 0)}  # (request, row tile) of every work item, KV chunks aside
    # ... and the 32-row tile (two warps sharing each K/V tile) over fp8 K/V or a page table
    w.plan(i32(0, 8, 9), i32(0, 900, 1700), HQ, HKV, D, causal=True, kv_data_type="float8_e4m3fn")
    la32 = w._engine.attn
    assert la32.meta["decode"] and la32.meta["block_m"] == 32 and la32.threads == 64 and w._engine.schedule.block_m == 32
    p = w._engine.schedule
    assert set(zip(p.work_request[:p.num_work].tolist(), p.work_qtile[:p.num_work].tolist())) == {(0, 0), (1, 0)}
    w.plan(i32(0, 5, 6), i32(0, 900, 1700), HQ, HKV, D, causal=True, kv_data_type="float8_e4m3fn")  # 20 rows
    assert w._engine.attn is la32
    w.plan(i32(0, 4, 5), i32(0, 900, 1700), HQ, HKV, D, causal=True, kv_data_type="float8_e4m3fn")  # 16 rows
    assert w._engine.attn.meta["block_m"] == 16
    w.plan(i32(0, 16, 17), i32(0, 900, 1700), HQ, HKV, D, causal=True, kv_data_type="float8_e4m3fn")  # 64 rows
    assert w._engine.attn.meta["block_m"] == 64 and w._engine.attn.threads == 128 and w._engine.attn.meta["decode"]
    w.plan(i32(0, 17, 18), i32(0, 900, 1700), HQ, HKV, D, causal=True, kv_data_type="float8_e4m3fn")  # 68 rows
    assert not w._engine.attn.meta["decode"] and w._engine.schedule.block_m == 128
    w.plan(i32(0, 16, 17), i32(0, 900, 1700), HQ, HKV, D, causal=True)  # 64 rows of 16-bit ragged K/V
    assert not w._engine.attn.meta["decode"], "contiguous 16-bit K/V: several 16-row tiles up to DECODE_MAX_ROWS only"
    wp = paged(fake)
    wp.plan(i32(0, 8, 9), i32(0, 3, 5), i32(0, 1, 2, 3, 4), i32(5, 7), HQ, HKV, D, PS, causal=True)
    assert wp._engine.attn.meta["block_m"] == 32 and wp._engine.attn.meta["paged"] and last_cfg_ctas(wp, 32) >= 2
    wp.plan(i32(0, 12, 13), i32(0, 3, 5), i32(0, 1, 2, 3, 4), i32(5, 7), HQ, HKV, D, PS, causal=True)  # 48 rows
    assert wp._engine.attn.meta["block_m"] == 64 and last_cfg_ctas(wp, 64) >= 2
    w.plan(i32(0, 9, 10), i32(0, 900, 1700), HQ, HKV, D, causal=True)  # 9 x 4 = 36 rows
    assert not w._engine.attn.meta["decode"] and w._engine.schedule.block_m == 128
    w.plan(i32(0, 4, 5), i32(0, 900, 1700), HQ, HKV, D, causal=True, logits_soft_cap=3.0)
    assert not w._engine.attn.meta["decode"], "soft cap lives in the general kernels"
    def graph_wrapper():
        return Ragged(WS(fake), "NHD", use_cuda_graph=True, qo_indptr_buf=T((9,), _dtypes.INT32, data=0x700000),
                      kv_indptr_buf=T((9,), _dtypes.INT32, data=0x710000))

    g = graph_wrapper()  # a decode graph: the decode tile, kept for a later plan that does not fit
    g.plan(i32(0, 4, 5, 9), i32(0, 900, 1700, 1800), HQ, HKV, D, causal=True)
    assert g._engine.attn.meta["decode"]
    grid = g._engine.attn.grid
    g.plan(i32(0, 9), i32(0, 900), HQ, HKV, D, causal=True)  # 9 x 4 = 36 rows: three 16-row tiles
    assert g._engine.attn.meta["decode"] and g._engine.attn.grid == grid and g._engine.schedule.block_m == 16
    assert set(g._engine.schedule.work_qtile[:g._engine.schedule.num_work].tolist()) == {0, 1, 2}
    g = graph_wrapper()  # a 32-row decode graph (fp8 K/V) keeps its tile for 8-row and 36-row plans
    fp8 = dict(causal=True, kv_data_type="float8_e4m3fn")
    g.plan(i32(0, 8, 9), i32(0, 900, 1700), HQ, HKV, D, **fp8)
    assert g._engine.attn.meta["block_m"] == 32
    g.plan(i32(0, 1, 2), i32(0, 900, 1700), HQ, HKV, D, **fp8)
    assert g._engine.attn.meta["block_m"] == 32 and g._engine.schedule.block_m == 32
    g.plan(i32(0, 9), i32(0, 900), HQ, HKV, D, **fp8)  # 36 rows: two 32-row tiles
    assert g._engine.attn.meta["block_m"] == 32 and set(g._engine.schedule.work_qtile[:g._engine.schedule.num_work].tolist()) == {0, 1}
    g = graph_wrapper()  # a prefill graph: the 128-row tile, also for a later decode plan
    g.plan(i32(0, 12), i32(0, 900), HQ, HKV, D, causal=True)
    assert not g._engine.attn.meta["decode"]
    g.plan(i32(0, 4, 5), i32(0, 900, 1700), HQ, HKV, D, causal=True)
    assert not g._engine.attn.meta["decode"]


def last_cfg_ctas(w, rows=16):
    """CTAs per SM the cached config plans the `rows`-row decode tile with."""
    return next(iter(w._engine.configs.values())).route.decode[rows][2]


def test_enable_pdl_before_sm90_is_the_plain_launch(fake, monkeypatch):
    monkeypatch.setattr(_cuda, "properties", lambda dev: {"sm_count": 108, "cc": (8, 0), "smem_per_sm": 167936})
    w = ragged(fake)
    plan_ragged(w)
    w.run(q_t(), kv_t(), kv_t(data=0x380000), out=out_t(), enable_pdl=True)
    assert [e[0] for e in fake.cu.log if e[0].startswith("launch")] == ["launch"]


# ---------------------------------------------------------------------------------------------
# streams, state and JAX-style producers
# ---------------------------------------------------------------------------------------------
def test_first_run_on_another_stream_waits_for_the_plan_copy_once(fake):
    w = ragged(fake)
    plan_ragged(w, stream=0x11)
    assert [op for op in fake.cu.log if op[0] == "htod"][-1][-1] == 0x11, "metadata copy not on the plan stream"
    assert not any(op[0] == "sync" for op in fake.cu.log), "plan() must not synchronise"
    fake.cu.log.clear()
    w.run(q_t(), kv_t(), kv_t(data=0x380000), out=out_t(), stream=0x22)
    ops = [op for op in fake.cu.log if op[0] in ("record", "wait", "launch")]
    assert ops[:3] == [("record", 0x11), ("wait", 0x22), ("launch", ops[2][1], 0x22)]
    fake.cu.log.clear()
    w.run(q_t(), kv_t(), kv_t(data=0x380000), out=out_t(), stream=0x22)
    assert [op[0] for op in fake.cu.log] == ["launch"], "later runs need no wait"


def test_device_index_arrays_are_copied_on_a_stream_then_synced(fake):
    w = ragged(fake)
    qo = fake.dev(QO, I32)
    plan_ragged(w) if False else w.plan(qo, RAGGED_KV, HQ, HKV, D)
    dtoh = [op for op in fake.cu.log if op[0] == "dtoh"]
    assert dtoh and dtoh[0][1] == qo.args[3]
    syncs = [op for op in fake.cu.log if op[0] == "sync"]
    assert syncs and syncs[0][1] == dtoh[0][3]
    assert qo.calls[-1]["stream"] == dtoh[0][3], "the producer was not asked to order its writes first"


class _JaxLike(FakeProducer):
    pass


_JaxLike.__module__ = "jax._src.array"


def test_jax_inputs_get_the_launch_stream_handshake(fake):
    w = paged(fake)
    plan_paged(w)
    q = _JaxLike(shape=(TQ, HQ, D), strides=_compact((TQ, HQ, D)), dtype=F16, data=0x100000)
    c = _JaxLike(shape=(NPAGES, 2, PS, HKV, D), strides=_compact((NPAGES, 2, PS, HKV, D)), dtype=F16, data=0x200000)
    w.run(q, c, out=out_t())
    s = last_attn(fake)[2]
    assert s == 0x5100  # JAX has no current stream: the library stream
    assert q.calls[-1]["stream"] == s and c.calls[-1]["stream"] == s


def test_refused_plan_keeps_the_previous_paged_state(fake):
    w = Paged(fake.dev(1 << 20), "NHD")  # a small workspace
    plan_paged(w)
    # a plan with another page size and a long, split request that needs more workspace
    with pytest.raises(ValueError, match="float_workspace_buffer"):
        w.plan(i32(0, 16), i32(0, 60000), np.arange(60000, dtype=np.int32), i32(1), HQ, HKV, D, 1,
               fixed_split_size=256)
    assert (w._engine.src.page_size, w._engine.src.max_page) == (PS, 4)
    w.run(q_t(), cache_t(), out=out_t())  # the old plan still runs against its own cache shape
    assert last_attn(fake)[3].page_size == PS


def test_plan_over_the_grid_limit_is_refused_before_anything_changes(fake):
    """Work items run along gridDim.z (at most 65535): a plan with more is a ValueError naming the
    limit at plan(), not a launch error, and the previous plan stays usable."""
    w = ragged(fake)
    plan_ragged(w, causal=True)
    before = w._engine.schedule
    B = 600  # 600 requests x 128 q tiles of 128 rows = 76800 work items
    qo = np.arange(0, (B + 1) * 16384, 16384, dtype=np.int32)
    with pytest.raises(ValueError, match="65535"):
        w.plan(qo, qo, HQ, HKV, D, causal=True, disable_split_kv=True)
    assert w._engine.schedule is before
