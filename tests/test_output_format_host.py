"""Output dtypes other than q's on the simulated driver (no GPU): plan(o_data_type=) of the decode
and prefill wrappers and XQA's out= dtype become PrefillParams / MergeParams.o_format (0 = q's
dtype, 1 = the other 16-bit type, 2 = float8_e4m3fn); out= must have the planned dtype; an
allocated output has it (full path and torch fast path); a captured graph keeps its format.
Numerics (the conversion itself, saturation, rounding): tests/gpu/test_output_formats.py.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from pyflashattn import decode
from pyflashattn._engine import xqa
from pyflashattn._runtime import dtypes as _dtypes
from pyflashattn.testing.fake_driver import (
    BF16, D, E4M3, E5M2, F16, HKV, HQ, I32, KV_INDICES, KV_INDPTR, LAST, NPAGES, PS, T, TKV, TQ, WS, cache_t, i32, kv_t,
    last_attn, paged, plan_paged, plan_ragged, q_t, ragged)

Decode = decode.BatchDecodeWithPagedKVCacheWrapper
B = 3  # the fake batch: kv lens 19, 16, 0 (page_size 16)
E4M3_NAME = "float8_e4m3fn"


@pytest.fixture(autouse=True)
def fresh_xqa_engines(monkeypatch):
    monkeypatch.setattr(xqa, "_ENGINES", OrderedDict())


def _decode(fake, long=False, **plan):
    """A planned decode wrapper over the fake batch (long: kv lens 64, 16, 0, every page used)."""
    w = Decode(WS(fake), "NHD")
    if long:
        w.plan(i32(0, 4, 5, 5), i32(0, 1, 2, 3, 4), i32(16, 16, 0), HQ, HKV, D, PS, **plan)
    else:
        w.plan(KV_INDPTR, KV_INDICES, LAST, HQ, HKV, D, PS, **plan)
    return w


def _out(dtype, rows=B):
    return T((rows, HQ, D), dtype, data=0x400000)


def _merge_launches(fake):
    return [x for x in fake.cu.launches if x[0].startswith("merge")]


@pytest.mark.parametrize("q_dtype, o_data_type, o_dtype, fmt", [
    ("float16", None, F16, 0),
    ("float16", "float16", F16, 0),
    ("bfloat16", "float16", F16, 1),
    ("float16", "bfloat16", BF16, 1),
    ("float16", E4M3_NAME, E4M3, 2),
    ("bfloat16", E4M3_NAME, E4M3, 2),
    ("bfloat16", E4M3, E4M3, 2),  # a DType (what torch / numpy dtypes normalise to) as well as a name
])
def test_o_data_type_is_the_format_the_kernel_and_the_merge_write(fake, q_dtype, o_data_type, o_dtype, fmt):
    # split KV (32-key chunks): the 64-key request is merged, the others written by the kernel
    w = _decode(fake, True, q_data_type=q_dtype, o_data_type=o_data_type, fixed_split_size=32)
    assert w._engine.merge is not None
    assert (w._engine.cfg.o_dtype, w._engine.cfg.o_format) == (o_dtype, fmt)
    qdt = _dtypes.normalize(q_dtype)
    out = _out(o_dtype)
    assert w.run(T((B, HQ, D), qdt, data=0x100000), cache_t(qdt), out=out) is out
    p = last_attn(fake)[3]
    assert p.o_format == fmt and p.o == 0x400000 and (p.o_stride_n, p.o_stride_h) == (HQ * D, D)
    (merge,) = _merge_launches(fake)
    assert merge[3].o_format == fmt and merge[3].o == 0x400000


def test_out_must_have_the_planned_output_dtype(fake):
    w = _decode(fake, o_data_type=E4M3_NAME)
    for bad in (F16, BF16, E5M2):
        with pytest.raises(TypeError, match=rf"out has dtype {bad.name} but plan\(\) was told o_data_type="
                                            rf"{E4M3_NAME}"):
            w.run(T((B, HQ, D), F16, data=0x100000), cache_t(F16), out=_out(bad))
    w = _decode(fake)  # no o_data_type: out in q's dtype
    with pytest.raises(TypeError, match=rf"out has dtype {E4M3_NAME} but q has float16"):
        w.run(T((B, HQ, D), F16, data=0x100000), cache_t(F16), out=_out(E4M3))
    with pytest.raises(ValueError, match=r"out must have 16-byte aligned rows"):  # e4m3 rows: 16 elements a chunk
        _decode(fake, o_data_type=E4M3_NAME).run(T((B, HQ, D), F16, data=0x100000), cache_t(F16),
                                                 out=T((B, HQ, D), E4M3, strides=(HQ * D + 8, D, 1), data=0x400000))
    assert not fake.attn_launches()


@pytest.mark.parametrize("bad, exc, pattern", [
    ("float8_e5m2", NotImplementedError, r"o_data_type: a float8_e5m2 output is not implemented"),
    ("float32", TypeError, r"o_data_type: the output dtype must be float16, bfloat16 or float8_e4m3fn, got float32"),
    ("int8", TypeError, r"o_data_type: the output dtype must be"),
    ("no_such_dtype", TypeError, r"o_data_type: unsupported dtype"),
])
@pytest.mark.parametrize("wrapper", ["decode", "paged", "ragged"])
def test_unsupported_output_dtypes_are_refused_at_plan(fake, wrapper, bad, exc, pattern):
    with pytest.raises(exc, match=pattern):
        if wrapper == "decode":
            _decode(fake, o_data_type=bad)
        elif wrapper == "paged":
            plan_paged(paged(fake), o_data_type=bad)
        else:
            plan_ragged(ragged(fake), o_data_type=bad)
    assert not fake.cu.launches


@pytest.mark.parametrize("wrapper", ["paged", "ragged"])
def test_prefill_wrappers_pass_o_data_type_through(fake, wrapper):
    w = paged(fake) if wrapper == "paged" else ragged(fake)
    plan = plan_paged if wrapper == "paged" else plan_ragged
    kv = (cache_t(),) if wrapper == "paged" else (kv_t(), kv_t(data=0x300000 + TKV * HKV * D * 2))
    plan(w, causal=True, o_data_type=E4M3_NAME)
    out = T((TQ, HQ, D), E4M3, data=0x400000)
    assert w.run(q_t(), *kv, out=out) is out
    assert last_attn(fake)[3].o_format == 2
    plan(w, causal=True)  # re-planned without it: the struct is rewritten (the options' cache knows the dtype)
    w.run(q_t(), *kv, out=T((TQ, HQ, D), F16, data=0x400000))
    assert last_attn(fake)[3].o_format == 0


def test_a_captured_graph_keeps_its_output_dtype(fake):
    bufs = (T((B + 1,), I32, data=0x600000), T((16,), I32, data=0x610000), T((B,), I32, data=0x620000))
    w = Decode(WS(fake), "NHD", True, False, *bufs)
    w.plan(KV_INDPTR, KV_INDICES, LAST, HQ, HKV, D, PS, o_data_type=E4M3_NAME)
    fake.cu.capturing.add(0x5100)
    try:
        w.run(T((B, HQ, D), F16, data=0x100000), cache_t(F16), out=_out(E4M3), stream=0x5100)
    finally:
        fake.cu.capturing.discard(0x5100)
    with pytest.raises(ValueError, match=r"o_data_type: run\(\) was captured in a CUDA graph with o_data_type = "
                                         r"'float8_e4m3fn'"):
        w.plan(KV_INDPTR, KV_INDICES, LAST, HQ, HKV, D, PS)
    w.plan(KV_INDPTR, KV_INDICES, LAST, HQ, HKV, D, PS, o_data_type=E4M3_NAME)  # the same dtype: fine


def test_outputs_are_allocated_in_the_planned_dtype(fake, fake_torch):
    ft = fake_torch
    w = _decode(fake, o_data_type=E4M3_NAME)
    q, kv = ft.tensor((B, HQ, D), "float16"), ft.tensor((NPAGES, 2, PS, HKV, D), "float16")
    o = w.run(q, kv)  # the full path (validates, remembers the signature)
    assert o.dtype is ft.dtypes[E4M3_NAME] and o.shape == (B, HQ, D)
    assert w._engine.fast_key is not None
    ft.allocs.clear()
    o2 = w.run(q, kv)  # the torch fast path
    assert ft.allocs == [("empty", (B, HQ, D), ft.dtypes[E4M3_NAME])]
    assert last_attn(fake)[3].o == o2.data_ptr() and o2.dtype is ft.dtypes[E4M3_NAME]
    w = _decode(fake)  # q's dtype: empty_like, as before
    w.run(q, kv)
    ft.allocs.clear()
    w.run(q, kv)
    assert ft.allocs == [("empty_like", (B, HQ, D), ft.dtypes["float16"])]


def _xqa_args(fake, **kw):
    table = np.zeros((B, 4), np.int32)
    table[:2, :2] = [[4, 1], [0, 2]]
    args = dict(query=T((B, HQ, D), data=0x100000), kv_cache=cache_t(), workspace_buffer=WS(fake),
                block_tables=fake.dev(table, I32, shape=table.shape), seq_lens=fake.dev(i32(19, 16, 0), I32),
                max_seq_len=32)
    args.update(kw)
    return args


def test_xqa_writes_outs_dtype(fake):
    out = _out(E4M3)
    assert decode.xqa_batch_decode_with_kv_cache(**_xqa_args(fake, out=out, o_scale=0.25, bmm2_scale=4.0)) is out
    p = last_attn(fake)[3]
    # bmm2_scale = v_scale / o_scale already holds 1 / o_scale: the kernel scales by it alone
    assert p.o_format == 2 and p.v_scale == 4.0
    decode.xqa_batch_decode_with_kv_cache(**_xqa_args(fake, out=_out(BF16)))
    assert last_attn(fake)[3].o_format == 1
    decode.xqa_batch_decode_with_kv_cache(**_xqa_args(fake, out=_out(F16)))
    assert last_attn(fake)[3].o_format == 0
    # one engine per output dtype (its struct holds the format)
    assert sorted(key[13] for key in xqa._ENGINES) == ["bfloat16", "float16", E4M3_NAME]
    assert sorted(e.cfg.o_format for e in xqa._ENGINES.values()) == [0, 1, 2]
