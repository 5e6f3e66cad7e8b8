"""Decode APIs on the simulated driver (no GPU): BatchDecodeWithPagedKVCacheWrapper (plan forms,
q_len_per_req, run()'s scales, sinks and refusals), single_decode_with_kv_cache's q check, the
block-table helpers and xqa_batch_decode_with_kv_cache (validation before any launch, what it
writes into the params struct, its engine cache, PYFLASHATTN_CHECK_METADATA).

Not covered here (the fake DLPack producers cannot express them): a valid
single_decode_with_kv_cache call (it indexes q[None]) and plan(block_tables=<device tensor>) (it
calls block_tables.reshape). Numerics are the GPU tests' job.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import pytest

from pyflashattn import decode
from pyflashattn._engine import indices, params, routing, xqa
from pyflashattn._engine.xqa import planned_pages
from pyflashattn._runtime import dtypes as _dtypes
from pyflashattn.testing.fake_driver import (
    BF16, D, E4M3, F16, HKV, HQ, I32, KV_INDICES, KV_INDPTR, LAST, LOG2E, NPAGES, PS, T, WS, f32, i32)
from pyflashattn.testing.fake_tensors import FakeProducer

Decode = decode.BatchDecodeWithPagedKVCacheWrapper
F32, I64, U16, U32 = _dtypes.FLOAT32, _dtypes.INT64, _dtypes.UINT16, _dtypes.UINT32
CPU = (1, 0)  # DLPack kDLCPU
B = 3  # KV_INDPTR / KV_INDICES / LAST: kv lens 19, 16, 0 over pages [4, 1], [0], [] (page_size 16)
SEQ = (19, 16, 0)
TABLE = [[4, 1, 7], [0, 7, 7], [7, 7, 7]]  # the same batch as block tables (7: never read)


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """Each test gets its own XQA engine cache (engines hold the previous fake driver's memory)
    and runs without the metadata check unless it sets it."""
    monkeypatch.setattr(xqa, "_ENGINES", OrderedDict())
    monkeypatch.delenv("PYFLASHATTN_CHECK_METADATA", raising=False)


class Reshapable(FakeProducer):
    """A fake CUDA tensor with reshape() (what torch / CuPy / JAX arrays have), for contiguous data."""

    def reshape(self, *shape):
        old, _, dtype, data, offset, device = self.args
        n = math.prod(old)
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape = tuple(n // known if s == -1 else s for s in shape)
        strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return Reshapable(shape, strides, dtype, data, offset, device)


def dev(fake, a, dtype=I32, shape=None):
    """A fake CUDA tensor holding the numpy array a (real simulated memory, readable by the host)."""
    a = np.ascontiguousarray(a)
    return Reshapable(*fake.dev(a, dtype, shape=a.shape if shape is None else shape).args)


def attn_launch(fake):
    launches = fake.attn_launches()
    assert launches, "nothing was launched"
    return launches[-1]


def staged(fake, addr, n):
    return fake.read(addr, n, np.int32).tolist()


# ---------------------------------------------------------------------------------------------
# planned_pages, block_table_arrays
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_planned_pages_covers_with_at_most_an_eighth_more(page_size):
    prev = 0
    for msl in range(1, 5000 * page_size + 1, max(1, page_size // 3)):
        need = -(-msl // page_size)
        got = planned_pages(msl, page_size, 1 << 20)
        assert need <= got <= max(need * 1.125, need + 1), (msl, need, got)
        assert got >= prev, f"not monotone at max_seq_len={msl}"
        prev = got
        if need < 16:
            assert got == need  # exact for short tables
    # coarse: 8 plans per octave of pages (and its top rounds to the next's first), so a growing
    # batch re-plans rarely
    for k in range(4, 12):
        vals = {planned_pages(n * page_size, page_size, 1 << 20) for n in range(1 << k, 1 << (k + 1))}
        assert len(vals - {1 << (k + 1)}) == 8, (k, sorted(vals))


def test_planned_pages_is_capped_at_the_table_width():
    for width in (1, 3, 17, 18, 100):
        for need in range(1, width + 1):
            got = planned_pages(need * 16, 16, width)
            assert need <= got <= width
            assert got == min(planned_pages(need * 16, 16, 1 << 20), width)
    assert planned_pages(17 * 16, 16, 17) == 17 and planned_pages(17 * 16, 16, 40) == 18


def ref_block_table_arrays(table, lens, ps):
    indptr, idx, last = [0], [], []
    for row, n in zip(table, lens):
        pages = (n + ps - 1) // ps
        idx += list(row[:pages])
        indptr.append(indptr[-1] + pages)
        last.append(n - (pages - 1) * ps if pages else 0)
    return indptr, idx, last


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", range(4))
def test_block_table_arrays_match_a_python_loop(page_size, seed):
    rng = np.random.default_rng(seed)
    batch, width = int(rng.integers(1, 9)), int(rng.integers(1, 12))
    table = rng.integers(0, 1000, size=(batch, width)).astype(np.int32)
    lens = rng.integers(0, width * page_size + 1, size=batch)
    lens[0] = 0  # an empty request
    lens[-1] = width * page_size  # a full row
    if batch > 2:
        lens[1] = 1
    for seq in (lens.astype(np.int32), lens.astype(np.int64), lens.tolist()):
        indptr, idx, last = indices.block_table_arrays(table, seq, page_size)
        want = ref_block_table_arrays(table.tolist(), lens.tolist(), page_size)
        assert (indptr.tolist(), idx.tolist(), last.tolist()) == want
        assert indptr.dtype == idx.dtype == last.dtype == np.int32


def test_block_table_arrays_of_device_seq_lens(fake):
    sl = dev(fake, i32(*SEQ))
    indptr, idx, last = indices.block_table_arrays(np.asarray(TABLE, np.int32), sl, PS)
    assert (indptr.tolist(), idx.tolist(), last.tolist()) == (KV_INDPTR.tolist(), KV_INDICES.tolist(), LAST.tolist())
    assert any(op[0] == "dtoh" and op[1] == sl.args[3] for op in fake.cu.log)


@pytest.mark.parametrize("table, lens, exc, pattern", [
    pytest.param(np.zeros((2, 3), np.int32), [16 * 3 + 1, 0], ValueError, r"seq_lens.*block_tables rows hold 3",
                 id="longer_than_a_row"),
    pytest.param(np.zeros((2, 3), np.int32), [1, 2, 3], ValueError, r"seq_lens has 3 entries.*2 rows", id="rows"),
    pytest.param(np.zeros((2, 3), np.int32), [5, -1], ValueError, r"seq_lens must be >= 0", id="negative"),
    pytest.param(np.zeros(6, np.int32), [5, 1], ValueError, r"block_tables must be 2-D", id="1d"),
    pytest.param(np.zeros((2, 3, 1), np.int32), [5, 1], ValueError, r"block_tables must be 2-D", id="3d"),
    pytest.param(np.zeros((2, 3), np.float32), [5, 1], TypeError, r"block_tables must hold integers", id="float"),
    pytest.param(None, [5, 1], ValueError, r"block_tables and seq_lens", id="none"),
    pytest.param(np.zeros((2, 3), np.int32), np.zeros((2, 1), np.int32), ValueError, r"seq_lens must be 1-D",
                 id="2d_lens"),
])
def test_block_table_arrays_refuses(table, lens, exc, pattern):
    with pytest.raises(exc, match=pattern):
        indices.block_table_arrays(table, lens, 16)


def test_block_table_arrays_refuses_page_ids_outside_int32():
    table = np.array([[2**32 + 3, 1]], np.int64)
    with pytest.raises(ValueError, match="block_tables"):
        indices.block_table_arrays(table, [17], 16)


# ---------------------------------------------------------------------------------------------
# BatchDecodeWithPagedKVCacheWrapper
# ---------------------------------------------------------------------------------------------
def dec(fake, **kw):
    return Decode(WS(fake), kw.pop("layout", "NHD"), **kw)


def plan_dec(w, q_len=1, **kw):
    return w.plan(KV_INDPTR, KV_INDICES, LAST, HQ, HKV, D, PS, q_len_per_req=q_len, **kw)


def q_dec(q_len=1, dtype=F16):
    return T((B * q_len, HQ, D), dtype, data=0x100000)


def o_dec(q_len=1):
    return T((B * q_len, HQ, D), F16, data=0x400000)


def cache(dtype=F16, layout="NHD", data=0x200000):
    return T((NPAGES, 2, PS, HKV, D) if layout == "NHD" else (NPAGES, 2, HKV, PS, D), dtype, data=data)


@pytest.mark.parametrize("q_len", [1, 4])
def test_decode_plan_rows_and_causal_follow_q_len_per_req(fake, q_len):
    w = dec(fake)
    plan_dec(w, q_len)
    e = w._engine
    want = (np.arange(B + 1) * q_len).tolist()
    assert e.src.qo.tolist() == want and e.src.qo_lens.tolist() == [q_len] * B
    assert e.src.kv_lens.tolist() == list(SEQ)
    assert e.shape == (B * q_len, HQ, HKV, D)
    w.run(q_dec(q_len), cache(), out=o_dec(q_len))
    _, grid, _, p = attn_launch(fake)
    assert p.causal == int(q_len > 1)
    assert staged(fake, p.qo_indptr, B + 1) == want  # what the kernel reads
    assert grid == (HKV, 1, e.schedule.grid)
    with pytest.raises(ValueError, match=r"\bq\b"):  # q is [B * q_len_per_req, Hq, D]
        w.run(q_dec(q_len + 1), cache(), out=o_dec(q_len + 1))


def test_decode_block_tables_form_plans_like_the_indptr_form(fake):
    a, b = dec(fake), dec(fake)
    plan_dec(a)
    b.plan(None, None, None, HQ, HKV, D, PS, block_tables=np.asarray(TABLE, np.int32), seq_lens=i32(*SEQ))
    ea, eb = a._engine, b._engine
    assert ea.src.kind == eb.src.kind == "paged"
    for x, y in zip(ea.src.arrays, eb.src.arrays):
        assert x.tolist() == y.tolist()
    assert eb.src.qo.tolist() == ea.src.qo.tolist() and eb.src.kv_lens.tolist() == ea.src.kv_lens.tolist()
    assert np.array_equal(ea.schedule.buffer, eb.schedule.buffer)
    assert ea.attn.name == eb.attn.name and ea.attn.grid == eb.attn.grid
    # plan() with neither form
    with pytest.raises(ValueError, match="block_tables and seq_lens"):
        b.plan(None, None, None, HQ, HKV, D, PS)


def test_decode_data_type_alias_and_output_dtype(fake):
    w = dec(fake)
    plan_dec(w, data_type="bfloat16")
    assert w._engine.cfg.q_dtype is BF16 and w._engine.cfg.kv_dtype is BF16
    plan_dec(w, data_type="bfloat16", q_data_type="float16", kv_data_type="float8_e4m3fn")  # the alias wins
    assert w._engine.cfg.q_dtype is BF16 and w._engine.cfg.kv_dtype is BF16
    plan_dec(w, kv_data_type="float8_e4m3fn")
    assert w._engine.cfg.q_dtype is F16 and w._engine.cfg.kv_dtype is E4M3
    plan_dec(w, data_type="bfloat16")
    with pytest.raises(TypeError, match=r"\bq\b"):
        w.run(q_dec(), cache(BF16), out=o_dec())  # q in float16 against a bfloat16 plan
    plan_dec(w, q_data_type="bfloat16", o_data_type="bfloat16")  # q's dtype: fine
    assert w._engine.cfg.o_dtype is BF16 and w._engine.cfg.o_format == 0
    plan_dec(w, data_type="float16", o_data_type="bfloat16")  # the other 16-bit type
    assert w._engine.cfg.o_dtype is BF16 and w._engine.cfg.o_format == 1
    with pytest.raises(TypeError, match="o_data_type"):
        plan_dec(w, q_data_type="float16", o_data_type="float32")
    with pytest.raises(NotImplementedError, match="o_data_type: a float8_e5m2 output"):
        plan_dec(w, data_type="float16", o_data_type="float8_e5m2")
    with pytest.raises(ValueError, match="q_len_per_req"):
        plan_dec(w, q_len=0)


def test_decode_run_refuses_a_window_or_q_len_other_than_the_plans(fake):
    w = dec(fake)
    plan_dec(w, q_len=2, window_left=64)
    for kw, name in ((dict(window_left=-1), "window_left"), (dict(window_left=63), "window_left"),
                     (dict(q_len_per_req=1), "q_len_per_req"), (dict(q_len_per_req=3), "q_len_per_req")):
        with pytest.raises(ValueError, match=name):
            w.run(q_dec(2), cache(), out=o_dec(2), **kw)
    with pytest.raises(ValueError, match="skip_softmax_threshold_scale_factor"):
        w.run(q_dec(2), cache(), out=o_dec(2), skip_softmax_threshold_scale_factor=-0.5)
    with pytest.raises(TypeError, match="kv_cache_sf"):  # block scales for a float16 plan
        w.run(q_dec(2), cache(), out=o_dec(2), kv_cache_sf=T((NPAGES, 2, PS, HKV, D // 16), E4M3))
    assert not fake.attn_launches()
    w.run(q_dec(2), cache(), out=o_dec(2), window_left=64, q_len_per_req=2)  # the plan's: fine
    assert attn_launch(fake)[3].window_left == 64


def test_decode_run_folds_q_scale_and_k_scale_into_the_logit_scale(fake):
    w = dec(fake)
    plan_dec(w, sm_scale=0.25)
    for kw, factor, vs in ((dict(q_scale=0.5, k_scale=3.0), 1.5, 1.0), (dict(q_scale=2.0), 2.0, 1.0),
                           (dict(k_scale=0.125, v_scale=4.0), 0.125, 4.0), ({}, 1.0, 1.0),
                           (dict(q_scale=np.float32(0.5), k_scale=2, v_scale=0.5), 1.0, 0.5)):
        w.run(q_dec(), cache(), out=o_dec(), **kw)
        p = attn_launch(fake)[3]
        assert p.sm_scale_log2 == pytest.approx(f32(0.25 * LOG2E * factor), rel=1e-6), kw
        assert p.v_scale == vs, kw
    for bad, exc in ((0.0, ValueError), ("2", TypeError), (float("nan"), ValueError)):
        with pytest.raises(exc, match="q_scale"):
            w.run(q_dec(), cache(), out=o_dec(), q_scale=bad)


def test_decode_run_return_lse(fake, fake_torch):
    w = dec(fake)
    plan_dec(w)
    ft = fake_torch
    q, c = ft.tensor((B, HQ, D), "float16"), ft.tensor((NPAGES, 2, PS, HKV, D), "float16")
    res = w.run_return_lse(q, c)
    assert isinstance(res, tuple) and len(res) == 2
    o, lse = res
    assert o.shape == (B, HQ, D) and lse.shape == (B, HQ) and lse.dtype is ft.dtypes["float32"]
    p = attn_launch(fake)[3]
    assert (p.o, p.lse) == (o._ptr, lse._ptr)
    o2 = w.run(q, c)
    assert not isinstance(o2, tuple) and attn_launch(fake)[3].lse == 0
    assert w.forward_return_lse.__func__ is Decode.run_return_lse and Decode.begin_forward is Decode.plan


@pytest.mark.parametrize("make, exc, pattern", [
    pytest.param(lambda f: dev(f, np.zeros(HQ + 1, np.float32), F32), ValueError, r"sinks must have shape",
                 id="shape"),
    pytest.param(lambda f: dev(f, np.zeros((HQ, 1), np.float32), F32), ValueError, r"sinks must have shape",
                 id="shape_2d"),
    pytest.param(lambda f: dev(f, np.zeros(HQ, np.float16), F16), TypeError, r"sinks must be float32", id="dtype"),
    pytest.param(lambda f: FakeProducer((HQ,), (1,), F32, 0x600000, 0, CPU), ValueError, r"sinks is on the CPU",
                 id="cpu"),
    pytest.param(lambda f: T((HQ,), F32, strides=(2,), data=0x600000), ValueError, r"sinks must be contiguous",
                 id="strided"),
])
def test_decode_run_refuses_bad_sinks(fake, make, exc, pattern):
    w = dec(fake)
    plan_dec(w)
    with pytest.raises(exc, match=pattern):
        w.run(q_dec(), cache(), out=o_dec(), sinks=make(fake))
    assert not fake.attn_launches()


def split_plan(w):
    """One request of 1024 keys in chunks of 256: a split plan, so a merge runs after the attention."""
    n = 64
    w.plan(i32(0, n), np.arange(n, dtype=np.int32) % NPAGES, i32(16), HQ, HKV, D, PS, fixed_split_size=256)
    assert w._engine.merge is not None, "the plan was meant to split"


def merge_launch(fake):
    launches = [x for x in fake.cu.launches if x[0].startswith("merge")]
    assert launches, "no merge was launched"
    return launches[-1]


@pytest.mark.parametrize("env, cta", [(None, True), ("0", False), ("1", True)])
def test_split_merge_of_one_request_runs_a_cta_per_row(fake, monkeypatch, env, cta):
    """One request's HQ rows over 4 chunks leave SMs idle with a warp per (row, head): the merge
    runs a CTA per (row, head) (grid HQ), unless PYFLASHATTN_MERGE_CTA_PER_ROW forces a form."""
    if env is None:
        monkeypatch.delenv(params.MERGE_CTA_ENV, raising=False)
    else:
        monkeypatch.setenv(params.MERGE_CTA_ENV, env)
    w = dec(fake)
    split_plan(w)
    w.run(T((1, HQ, D)), cache(), out=T((1, HQ, D), data=0x400000))
    name, grid, _, mp = merge_launch(fake)
    assert ("cta_per_row=True" in name) == cta
    assert grid == ((HQ, 1, 1) if cta else (-(-HQ // params.MERGE_ROWS_PER_BLOCK), 1, 1))
    assert mp.rows == 1 and mp.num_heads == HQ


def test_decode_split_waves_switch(fake, monkeypatch):
    """PYFLASHATTN_DECODE_SPLIT_WAVES scales the decode tiles' split budget (read when the route is
    resolved); unset: one wave, two over a widened (fp8 / NVFP4) cache; not a positive number: refused."""
    monkeypatch.delenv(routing.DECODE_WAVES_ENV, raising=False)
    assert routing.decode_waves(False) == 1 and routing.decode_waves(True) == routing.FP8_DECODE_WAVES
    for waves in (None, "0.5", "3"):
        if waves is not None:
            monkeypatch.setenv(routing.DECODE_WAVES_ENV, waves)
        w = dec(fake)
        plan_dec(w)
        ld, budget, cps = w._engine.cfg.route.decode[16]
        assert budget == int(132 * cps * (1 if waves is None else float(waves)))
    for bad in ("0", "-1", "x"):
        monkeypatch.setenv(routing.DECODE_WAVES_ENV, bad)
        with pytest.raises(ValueError, match=routing.DECODE_WAVES_ENV):
            routing.decode_waves(False)


def test_fp8_decode_tiles_widen_in_registers_and_plan_one_wave(fake, monkeypatch):
    """Every fp8 decode tile (16 rows, and the 32- / 64-row ones) widens K/V fragments in registers
    (the manifest's reg_widen): one wave of split budget, as 16-bit K/V, not the two of the
    tiles that widen into shared memory."""
    monkeypatch.delenv(routing.DECODE_WAVES_ENV, raising=False)
    w = dec(fake)
    plan_dec(w, kv_data_type="float8_e4m3fn")
    r = w._engine.cfg.route
    assert set(r.decode) >= {16, 32}
    for rows, (ld, budget, cps) in r.decode.items():
        assert ld.meta["reg_widen"] and budget == 132 * cps, rows  # the fake driver's 132 SMs


def test_split_merge_of_many_rows_keeps_a_warp_per_row(fake, monkeypatch):
    """Enough (row, head) pairs for a CTA of four warps on every SM: the one-warp merge."""
    monkeypatch.delenv(params.MERGE_CTA_ENV, raising=False)
    assert params.merge_cta_per_row(0, 1, HQ)
    sms = 132  # the fake GPU's
    rows = -(-sms * params.MERGE_ROWS_PER_BLOCK // HQ)
    assert not params.merge_cta_per_row(0, rows, HQ)
    assert params.merge_cta_per_row(0, rows - 1, HQ) == ((rows - 1) * HQ < sms * params.MERGE_ROWS_PER_BLOCK)


def test_decode_sinks_reach_attention_and_merge_and_a_later_run_clears_them(fake):
    w = dec(fake)
    split_plan(w)
    q, o = T((1, HQ, D)), T((1, HQ, D), data=0x400000)
    s1 = dev(fake, np.linspace(-1, 1, HQ).astype(np.float32), F32)
    s2 = dev(fake, np.zeros((HKV, HQ // HKV), np.float32), F32)  # XQA's [Hkv, group] form
    for s in (s1, s2):
        w.run(q, cache(), out=o, sinks=s)
        assert attn_launch(fake)[3].sinks == s.args[3]
        assert merge_launch(fake)[3].sinks == s.args[3]
    w.run(q, cache(), out=o)
    assert attn_launch(fake)[3].sinks == 0 and merge_launch(fake)[3].sinks == 0
    w.run(q, cache(), out=o, sinks=s1)
    plan_dec(w)  # a new plan starts without sinks too
    w.run(q_dec(), cache(), out=o_dec())
    assert attn_launch(fake)[3].sinks == 0


_GRAPH_BUFS = ("paged_kv_indptr_buffer", "paged_kv_indices_buffer", "paged_kv_last_page_len_buffer")


@pytest.mark.parametrize("missing", _GRAPH_BUFS)
def test_cuda_graph_decode_needs_the_three_buffers(fake, missing):
    bufs = dict(zip(_GRAPH_BUFS, (T((9,), I32, data=0x700000), T((64,), I32, data=0x710000),
                                  T((8,), I32, data=0x720000))))
    assert dec(fake, use_cuda_graph=True, **bufs).is_cuda_graph_enabled
    bufs[missing] = None
    with pytest.raises(ValueError, match=missing):
        dec(fake, use_cuda_graph=True, **bufs)
    assert not dec(fake).is_cuda_graph_enabled


def test_cuda_graph_decode_freezes_q_len_per_req(fake):
    w = dec(fake, use_cuda_graph=True, paged_kv_indptr_buffer=T((9,), I32), paged_kv_indices_buffer=T((64,), I32),
            paged_kv_last_page_len_buffer=T((8,), I32))
    plan_dec(w, q_len=2)
    with pytest.raises(ValueError, match="q_len_per_req"):
        plan_dec(w, q_len=1)
    plan_dec(w, q_len=2)


def test_decode_constructor_refusals(fake):
    with pytest.raises(ValueError, match="backend"):
        dec(fake, backend="trtllm-gen")
    with pytest.raises(NotImplementedError, match="jit_args"):
        dec(fake, jit_args=[])
    with pytest.raises(ValueError, match="kv_layout"):
        dec(fake, layout="NDH")


@pytest.mark.parametrize("shape", [(B, HQ, D), (D,), (1, 1, HQ, D)])
def test_single_decode_needs_a_2d_q(shape):
    k = T((19, HKV, D), data=0x200000)
    with pytest.raises(ValueError, match=r"q must be 2-D"):
        decode.single_decode_with_kv_cache(T(shape), k, k)


# ---------------------------------------------------------------------------------------------
# xqa_batch_decode_with_kv_cache
# ---------------------------------------------------------------------------------------------
WIDTH, MSL = 40, 17 * 16  # 17 pages needed, 18 planned (the 1/8 grid), 40 a row


def table40():
    t = np.zeros((B, WIDTH), np.int32)
    t[:, :3] = TABLE
    return t


def xqa_args(fake, q_len=1, seq=SEQ, table=None, **kw):
    """A valid XQA call's arguments (kw override them)."""
    table = table40() if table is None else table
    args = dict(query=T((B * q_len, HQ, D), data=0x100000), kv_cache=cache(), workspace_buffer=WS(fake),
                block_tables=dev(fake, np.asarray(table, np.int32)), seq_lens=dev(fake, i32(*seq)), max_seq_len=MSL,
                q_len_per_req=q_len, out=T((B * q_len, HQ, D), data=0x400000))
    args.update(kw)
    return args


def call_xqa(args):
    return decode.xqa_batch_decode_with_kv_cache(**args)


_BAD = [  # (overrides given fake, exception, pattern)
    ("query_2d", lambda f: dict(query=T((B, HQ * D))), ValueError, r"query must be \[batch"),
    ("query_rows", lambda f: dict(q_len_per_req=2), ValueError, r"query must be .*q_len_per_req=2"),
    ("q_len_0", lambda f: dict(q_len_per_req=0), ValueError, r"q_len_per_req"),
    ("query_cpu", lambda f: dict(query=FakeProducer((B, HQ, D), (HQ * D, D, 1), F16, 0x100000, 0, CPU)),
     ValueError, r"query is on the CPU"),
    ("bt_float", lambda f: dict(block_tables=T((B, WIDTH), F32, data=0x800000)), TypeError,
     r"block_tables must be int32"),
    ("bt_batch", lambda f: dict(block_tables=T((B + 1, WIDTH), I32, data=0x800000)), ValueError,
     r"block_tables must be \["),
    ("bt_1d", lambda f: dict(block_tables=T((B * WIDTH,), I32, data=0x800000)), ValueError, r"block_tables must be \["),
    ("bt_cols", lambda f: dict(block_tables=T((B, WIDTH), I32, strides=(1, B), data=0x800000)), ValueError,
     r"block_tables.*contiguous rows"),
    ("bt_cpu", lambda f: dict(block_tables=FakeProducer((B, WIDTH), (WIDTH, 1), I32, 0x800000, 0, CPU)), ValueError,
     r"block_tables is on the CPU"),
    ("sl_int64", lambda f: dict(seq_lens=T((B,), I64, data=0x810000)), TypeError, r"seq_lens must be int32"),
    ("sl_len", lambda f: dict(seq_lens=T((B + 1,), I32, data=0x810000)), ValueError, r"seq_lens must have shape \(3,\)"),
    ("sl_strided", lambda f: dict(seq_lens=T((B,), I32, strides=(2,), data=0x810000)), ValueError,
     r"seq_lens must be contiguous"),
    ("sl_cpu", lambda f: dict(seq_lens=FakeProducer((B,), (1,), I32, 0x810000, 0, CPU)), ValueError,
     r"seq_lens is on the CPU"),
    ("msl_beyond", lambda f: dict(max_seq_len=WIDTH * PS + 1), ValueError, r"max_seq_len=.*exceeds"),
    ("msl_zero", lambda f: dict(max_seq_len=0), ValueError, r"max_seq_len"),
    ("head_dim", lambda f: dict(kv_cache=T((NPAGES, 2, PS, HKV, 64), data=0x200000)), ValueError, r"head_dim"),
    ("groups", lambda f: dict(kv_cache=T((NPAGES, 2, PS, 3, D), data=0x200000)), ValueError,
     r"multiple of kv_cache heads \(3\)"),
    ("cache_4d", lambda f: dict(kv_cache=T((NPAGES, PS, HKV, D), data=0x200000)), ValueError, r"kv_cache must be 5-D"),
    ("cache_3", lambda f: dict(kv_cache=T((NPAGES, 3, PS, HKV, D), data=0x200000)), ValueError,
     r"kv_cache must be 5-D"),
    ("tuple_shapes", lambda f: dict(kv_cache=(T((NPAGES, PS, HKV, D)), T((NPAGES, PS, HKV, 64)))), ValueError,
     r"kv_cache pages"),
    ("tuple_len", lambda f: dict(kv_cache=(T((NPAGES, PS, HKV, D)),)), ValueError, r"kv_cache tuple"),
    ("mask_shape", lambda f: dict(mask=T((B, 1, 4), U16, data=0x820000)), ValueError, r"mask must have shape"),
    ("mask_dtype", lambda f: dict(mask=T((B, 1, 2), I32, data=0x820000)), TypeError, r"mask must be uint16"),
    ("mask_cpu", lambda f: dict(mask=FakeProducer((B, 1, 2), (2, 2, 1), U16, 0x820000, 0, CPU)), ValueError,
     r"mask is on the CPU"),
    ("layout", lambda f: dict(kv_layout="NDH"), ValueError, r"kv_layout"),
    ("bmm1_dtype", lambda f: dict(bmm1_scale=T((1,), F16, data=0x830000)), TypeError, r"bmm1_scale .*float32"),
    ("bmm1_size", lambda f: dict(bmm1_scale=T((2,), F32, data=0x830000)), ValueError, r"bmm1_scale .*one value"),
    ("bmm1_neg", lambda f: dict(bmm1_scale=-0.5), ValueError, r"bmm1_scale"),
    ("bmm2_dtype", lambda f: dict(bmm2_scale=T((1,), I32, data=0x830000)), TypeError, r"bmm2_scale .*float32"),
    ("o_scale", lambda f: dict(o_scale=0.0), ValueError, r"o_scale"),
    ("kv_cache_sf", lambda f: dict(kv_cache_sf=T((NPAGES, 2), U16)), TypeError, r"kv_cache_sf"),
    ("out_e5m2", lambda f: dict(out=T((B, HQ, D), _dtypes.FLOAT8_E5M2, data=0x400000)), NotImplementedError,
     r"out: a float8_e5m2 output"),
    ("out_f32", lambda f: dict(out=T((B, HQ, D), F32, data=0x400000)), TypeError,
     r"out: the output dtype"),
]


@pytest.mark.parametrize("case, over, exc, pattern", [pytest.param(*c, id=c[0]) for c in _BAD])
def test_xqa_refuses_bad_arguments_before_anything_runs(fake, case, over, exc, pattern):
    args = xqa_args(fake)
    args.update(over(fake))
    fake.assert_refused_before_anything_runs(lambda: call_xqa(args), exc, pattern)
    assert not xqa._ENGINES


def test_xqa_params_of_a_call(fake):
    assert decode.xqa_batch_decode_with_kv_cache is xqa.xqa_batch_decode
    args = xqa_args(fake, bmm1_scale=0.5, bmm2_scale=0.25, window_left=100)
    r = call_xqa(args)
    assert r is args["out"]
    name, grid, _, p = attn_launch(fake)
    (e,) = xqa._ENGINES.values()
    pages = planned_pages(MSL, PS, WIDTH)
    assert pages == 18
    assert p.kv_page_indices == args["block_tables"].args[3] and p.kv_seq_lens == args["seq_lens"].args[3]
    assert (p.num_pages, p.kv_max_len, p.page_size) == (NPAGES, pages * PS, PS)
    assert p.sm_scale_log2 == pytest.approx(f32(0.5 * LOG2E), rel=1e-6) and p.v_scale == 0.25
    assert p.scale_dev == 0 and p.v_scale_dev == 0 and p.custom_mask == 0 and p.sinks == 0
    assert p.causal == 0 and (p.q, p.o) == (0x100000, 0x400000) and p.window_left == 100
    # every request is planned at the planned pages' keys; the kernel reads its real length
    assert e.src.kind == "block_table" and e.src.kv_lens.tolist() == [pages * PS] * B
    assert staged(fake, p.kv_indptr, B + 1) == [b * WIDTH for b in range(B + 1)]  # row b of the table
    assert grid == (HKV, 1, e.schedule.grid)
    assert p.v - p.k == PS * HKV * D * 2  # the V half of the 5-D cache


def test_xqa_shared_kv_cache_reads_k_and_v_from_its_pages(fake):
    """A [P, 1, ...] cache (K and V share the pages): its half is a view of the cache (no slice of
    the caller's tensor), read as both K and V."""
    shared = T((NPAGES, 1, PS, HKV, D), F16, data=0x200000)
    call_xqa(xqa_args(fake, kv_cache=shared))
    p = attn_launch(fake)[3]
    assert p.k == p.v == 0x200000 and p.k_stride_page == p.v_stride_page == PS * HKV * D


def test_xqa_strided_block_table_rows(fake):
    """Rows of a block table may be strided (a view of a wider table): row b starts at b * stride."""
    table = fake.dev(np.zeros((B, 64), np.int32), I32, shape=(B, WIDTH), strides=(64, 1))
    call_xqa(xqa_args(fake, block_tables=table))
    p = attn_launch(fake)[3]
    assert staged(fake, p.kv_indptr, B + 1) == [0, 64, 128, 192]


def test_xqa_device_scales(fake):
    s1 = dev(fake, np.float32([0.7]), F32)
    s2 = dev(fake, np.float32([[2.0]]), F32, shape=(1, 1))
    call_xqa(xqa_args(fake, bmm1_scale=s1, bmm2_scale=s2))
    name, _, _, p = attn_launch(fake)
    assert p.scale_dev == s1.args[3] and p.v_scale_dev == s2.args[3]
    assert p.sm_scale_log2 == pytest.approx(f32(LOG2E), rel=1e-6) and p.v_scale == 1.0
    (e,) = xqa._ENGINES.values()
    # a kernel that reads scale_dev (variants.py's device_scale: general, or a decode tile)
    assert e.attn.meta.get("device_scale") or e.attn.meta["general"] or e.attn.meta["decode"]
    call_xqa(xqa_args(fake, bmm1_scale=0.5))  # a float scale again: another engine, no device scale
    p = attn_launch(fake)[3]
    assert p.scale_dev == 0 and p.v_scale_dev == 0 and len(xqa._ENGINES) == 2


@pytest.mark.parametrize("q_len", [2, 16, 33])
def test_xqa_spec_mask(fake, monkeypatch, q_len):
    monkeypatch.delenv(xqa.SPEC_GENERAL_ENV, raising=False)
    words = -(-q_len // 32)
    mask = dev(fake, np.zeros((B, q_len, 2 * words), np.uint16), U16)
    call_xqa(xqa_args(fake, q_len=q_len, mask=mask))
    p = attn_launch(fake)[3]
    assert p.custom_mask == mask.args[3] and p.spec_mask_words == words == math.ceil(q_len / 32)
    assert p.causal == 0  # the mask replaces causal
    assert staged(fake, p.mask_indptr, B + 1) == [b * q_len * words * 4 for b in range(B + 1)]
    assert staged(fake, p.qo_indptr, B + 1) == [b * q_len for b in range(B + 1)]
    (e,) = xqa._ENGINES.values()
    # q_len * group packed rows: a lean paged decode tile holds up to 64 (it honours the mask),
    # more take the general kernel
    rows = q_len * HQ // HKV
    assert e.attn.meta.get("spec_mask") or e.attn.meta["general"]
    assert (e.attn.meta["decode"], e.attn.meta["general"]) == ((True, False) if rows <= 64 else (False, True))
    assert e.attn.meta["block_m"] == (min(t for t in (16, 32, 64) if t >= rows) if rows <= 64 else 128)


def test_xqa_spec_mask_general_switch(fake, monkeypatch):
    """PYFLASHATTN_XQA_SPEC_GENERAL=1 (an A/B switch): spec masks on the general kernels."""
    monkeypatch.setenv(xqa.SPEC_GENERAL_ENV, "1")
    mask = dev(fake, np.zeros((B, 2, 2), np.uint16), U16)
    call_xqa(xqa_args(fake, q_len=2, mask=mask))
    (e,) = xqa._ENGINES.values()
    assert e.attn.meta["general"] and attn_launch(fake)[3].spec_mask_words == 1


def test_xqa_drafts_without_a_mask_are_causal(fake):
    call_xqa(xqa_args(fake, q_len=4))
    p = attn_launch(fake)[3]
    assert p.causal == 1 and p.custom_mask == 0 and p.spec_mask_words == 0
    assert staged(fake, p.qo_indptr, B + 1) == [0, 4, 8, 12]


def test_xqa_reuses_the_engine_for_the_same_shapes(fake):
    fake.cu.log.clear()
    call_xqa(xqa_args(fake, bmm1_scale=0.5))
    first = [op[1] for op in fake.cu.log if op[0] == "launch"]  # the attention (and a merge if split)
    assert any(op[0] == "htod" for op in fake.cu.log)  # the first call plans
    (e,) = xqa._ENGINES.values()
    args = xqa_args(fake, seq=(5, 200, 1), bmm1_scale=0.25, max_seq_len=MSL - 1)  # still 18 planned pages
    fake.cu.log.clear()
    call_xqa(args)
    assert list(xqa._ENGINES.values()) == [e]
    assert [op[0] for op in fake.cu.log] == ["launch"] * len(first), "a cached shape must only launch"
    assert [op[1] for op in fake.cu.log] == first
    p = attn_launch(fake)[3]
    assert p.kv_page_indices == args["block_tables"].args[3] and p.kv_seq_lens == args["seq_lens"].args[3]
    assert p.sm_scale_log2 == pytest.approx(f32(0.25 * LOG2E), rel=1e-6)
    # more planned pages: a new plan (its metadata copied)
    fake.cu.log.clear()
    call_xqa(xqa_args(fake, max_seq_len=WIDTH * PS))
    assert len(xqa._ENGINES) == 2 and any(op[0] == "htod" for op in fake.cu.log)
    assert attn_launch(fake)[3].kv_max_len == WIDTH * PS


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_xqa_cache_as_one_tensor_or_a_pair(fake, layout):
    call_xqa(xqa_args(fake, kv_cache=cache(layout=layout), kv_layout=layout))
    p5 = attn_launch(fake)[3]
    shape = (NPAGES, PS, HKV, D) if layout == "NHD" else (NPAGES, HKV, PS, D)
    k, v = T(shape, data=0x900000), T(shape, data=0xA00000)
    call_xqa(xqa_args(fake, kv_cache=(k, v), kv_layout=layout))
    p = attn_launch(fake)[3]
    assert (p.k, p.v) == (0x900000, 0xA00000)
    assert len(xqa._ENGINES) == 1  # the same plan for both forms
    assert p5.k == 0x200000 and p5.v == 0x200000 + PS * HKV * D * 2
    want = (PS * HKV * D, HKV * D, D) if layout == "NHD" else (PS * HKV * D, D, PS * D)
    assert (p.k_stride_page, p.k_stride_n, p.k_stride_h) == want and p.page_size == PS
    assert (p5.k_stride_page, p5.k_stride_n, p5.k_stride_h) == (2 * want[0],) + want[1:]


def test_xqa_sinks_set_and_cleared(fake):
    s = dev(fake, np.zeros((HKV, HQ // HKV), np.float32), F32)
    call_xqa(xqa_args(fake, sinks=s))
    assert attn_launch(fake)[3].sinks == s.args[3]
    call_xqa(xqa_args(fake))
    assert attn_launch(fake)[3].sinks == 0
    with pytest.raises(TypeError, match="sinks"):
        call_xqa(xqa_args(fake, sinks=dev(fake, np.zeros(HQ, np.float16), F16)))


def test_xqa_torch_tensors_take_the_fast_path_with_this_calls_metadata(fake, fake_torch):
    ft = fake_torch
    c = ft.tensor((NPAGES, 2, PS, HKV, D), "float16")
    for i in range(3):  # the first call validates and remembers the signature, then the fast path
        q = ft.tensor((B, HQ, D), "float16")
        args = xqa_args(fake, query=q, kv_cache=c, out=None)
        o = call_xqa(args)
        assert o.shape == (B, HQ, D) and o.dtype is ft.dtypes["float16"]
        p = attn_launch(fake)[3]
        assert (p.q, p.k, p.v, p.o) == (q._ptr, c._ptr, c._ptr + PS * HKV * D * 2, o._ptr)
        assert p.kv_page_indices == args["block_tables"].args[3] and p.kv_seq_lens == args["seq_lens"].args[3]
    assert len(xqa._ENGINES) == 1 and next(iter(xqa._ENGINES.values())).fast_key is not None


@pytest.mark.parametrize("over, name", [
    pytest.param(lambda f: dict(query=T((B, HQ, D), F32)), "query", id="query_f32"),
    pytest.param(lambda f: dict(kv_cache=cache(BF16)), "kv_cache", id="cache_bf16"),
    pytest.param(lambda f: dict(workspace_buffer=f.dev(1024)), "workspace_buffer", id="small_workspace"),
])
def test_xqa_dtype_and_workspace_errors_name_xqas_arguments(fake, over, name):
    with pytest.raises((TypeError, ValueError), match=rf"^{name}\b"):
        call_xqa(xqa_args(fake, **over(fake)))


# ---- PYFLASHATTN_CHECK_METADATA=1 ------------------------------------------------------------
def test_xqa_metadata_check_off_by_default(fake):
    t = table40()
    t[0, 1] = NPAGES  # used by request 0 (19 keys: two pages), outside the cache
    call_xqa(xqa_args(fake, table=t, seq=(19, 16, MSL + 5)))  # unchecked: the kernel clamps
    assert fake.attn_launches()


@pytest.mark.parametrize("what", ["page", "negative_page", "seq_len", "seq_len_past_plan"])
def test_xqa_metadata_check_names_the_argument(fake, monkeypatch, what):
    monkeypatch.setenv("PYFLASHATTN_CHECK_METADATA", "1")
    t, seq, msl = table40(), list(SEQ), MSL
    if what == "page":
        t[0, 1] = NPAGES
    elif what == "negative_page":
        t[1, 0] = -1
    elif what == "seq_len":
        seq[2] = MSL + 1
    else:  # a seq_len within the table but past max_seq_len (= past the planned keys)
        msl, seq[1] = 20, 21
    with pytest.raises(ValueError, match="block_tables" if "page" in what else "seq_lens"):
        call_xqa(xqa_args(fake, table=t, seq=seq, max_seq_len=msl))
    assert not fake.attn_launches()


def test_xqa_metadata_check_passes_good_metadata(fake, monkeypatch):
    monkeypatch.setenv("PYFLASHATTN_CHECK_METADATA", "1")
    t = table40()
    t[0, 2] = 10**6  # past request 0's pages: never read, not checked
    call_xqa(xqa_args(fake, table=t, seq=(19, 16, 0)))
    assert fake.attn_launches()
    assert any(op[0] == "dtoh" for op in fake.cu.log)  # it did copy the metadata to the host


def test_xqa_metadata_check_of_uint32_seq_lens(fake, monkeypatch):
    args = xqa_args(fake)
    args["seq_lens"] = dev(fake, np.asarray(SEQ, np.uint32), U32)
    call_xqa(args)  # accepted without the check
    monkeypatch.setenv("PYFLASHATTN_CHECK_METADATA", "1")
    call_xqa(args)
