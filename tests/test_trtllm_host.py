"""TRT-LLM prefill entry points on the simulated driver (no GPU): layout parsing, block-table
translation, validation before any launch, and the params struct each call writes (chunked
mask, scales, stats, window); host metadata (numpy: checked and planned on the host) and device
metadata (trtllm_device: a plan per shape key, no sync, capturable; the checked mode).
Numerics are tests/gpu/test_trtllm.py's and test_trtllm_graph.py's job.

PACKED_QKV / CONTIGUOUS_Q_KV: a packed tensor of a framework other than torch / CuPy (the fake
producers here, JAX) is viewed once and its Q / K / V are strided views of it, not slices."""
from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import pytest

from pyflashattn import prefill
from pyflashattn._engine import metadata_check, operands, trtllm, trtllm_device, trtllm_fmha
from pyflashattn._runtime import dtypes as _dtypes
from pyflashattn.testing.fake_driver import BF16, E4M3, LOG2E, WS, T
from pyflashattn.testing.fake_tensors import FakeProducer

fmha = prefill.trtllm_fmha_v2_prefill
context = prefill.trtllm_batch_context_with_kv_cache
F32, U32 = _dtypes.FLOAT32, _dtypes.UINT32
HQ, HKV, D, PS, NPAGES = 8, 2, 128, 16, 6
QL, KL = (5, 0, 12), (19, 16, 0)  # q shorter than kv in request 0; an empty request
TQ, TKV = sum(QL), sum(KL)
TABLE = np.array([[4, 1, 5], [0, 5, 5], [5, 5, 5]], np.int32)  # pages of KL (5: never read)


@pytest.fixture(autouse=True)
def fresh_engines(monkeypatch):
    monkeypatch.setattr(trtllm, "_ENGINES", OrderedDict())
    monkeypatch.setattr(trtllm_device, "_ENGINES", OrderedDict())
    monkeypatch.delenv(metadata_check.ENV, raising=False)


class Reshapable(FakeProducer):
    """A contiguous fake CUDA tensor with reshape(-1) (block tables are copied to the host flat)."""

    def reshape(self, *shape):
        old, _, dtype, data, offset, device = self.args
        n = math.prod(old)
        return Reshapable((n,), (1,), dtype, data, offset, device)


def table_arg(fake, table, device=False):
    return Reshapable(*fake.dev(table, _dtypes.INT32, shape=table.shape).args) if device else table


def cum(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def lengths(fake, ql=QL, kl=KL, device=False):
    """seq_lens, cum_seq_lens_q, cum_seq_lens_kv: numpy (the host path) or device tensors."""
    arrays = np.asarray(kl, np.int32), cum(ql), cum(kl)
    return tuple(fake.dev(a, _dtypes.INT32) for a in arrays) if device else arrays


def separate_call(fake, device=False, **kw):
    sl, cq, ck = lengths(fake, device=device)
    q, k, v = T((TQ, HQ, D)), T((TKV, HKV, D)), T((TKV, HKV, D))
    args = dict(qkv=(q, k, v), input_layout="SEPARATE_Q_K_V", workspace_buffer=WS(fake), seq_lens=sl, max_q_len=12,
                max_kv_len=19, bmm1_scale=0.1, bmm2_scale=1.0, batch_size=3, cum_seq_lens_q=cq, cum_seq_lens_kv=ck)
    args.update(kw)
    args.setdefault("out", out_for(args.get("out_dtype")))
    return fmha(**args)


def out_for(out_dtype):
    """An out tensor (fake producers cannot allocate outputs) of out_dtype (None: fp16)."""
    return T((TQ, HQ, D), _dtypes.normalize(out_dtype) if out_dtype else _dtypes.FLOAT16)


def paged_call(fake, layout="Q_PAGED_KV_HND", table=TABLE, cache=None, device=False, **kw):
    sl, cq, ck = lengths(fake, device=device)
    shape = (NPAGES, 2, HKV, PS, D) if layout.endswith("HND") else (NPAGES, 2, PS, HKV, D)
    args = dict(qkv=(T((TQ, HQ, D)), T(shape) if cache is None else cache), input_layout=layout,
                workspace_buffer=WS(fake), seq_lens=sl, max_q_len=12, max_kv_len=19, bmm1_scale=0.1, bmm2_scale=1.0,
                batch_size=3, cum_seq_lens_q=cq, cum_seq_lens_kv=ck, block_tables=table_arg(fake, table, device))
    args.update(kw)
    args.setdefault("out", out_for(args.get("out_dtype")))
    return fmha(**args)


def context_call(fake, table=TABLE, device=False, **kw):
    sl, cq, ck = lengths(fake, device=device)
    args = dict(query=T((TQ, HQ, D)), kv_cache=T((NPAGES, 2, HKV, PS, D)), workspace_buffer=WS(fake),
                block_tables=table_arg(fake, table, device), seq_lens=sl, max_q_len=12,
                max_kv_len=19, bmm1_scale=0.1, bmm2_scale=1.0, batch_size=3, cum_seq_lens_q=cq, cum_seq_lens_kv=ck)
    args.update(kw)
    if args.get("out_dtype") != "nvfp4":
        args.setdefault("out", out_for(args.get("out_dtype")))
    return context(**args)


def last_params(fake):
    launches = fake.attn_launches()
    assert launches, "nothing was launched"
    return launches[-1][0], launches[-1][3]


# ---- layouts and block tables -------------------------------------------------------------------
def test_parse_layout_forms():
    q, k, v = T((4, 2, 64)), T((4, 2, 64)), T((4, 2, 64))
    assert trtllm_fmha.parse_layout((q, k, v), "SEPARATE_Q_K_V") == (q, (k, v), "NHD", True)
    c = T((3, 2, 2, 16, 64))
    assert trtllm_fmha.parse_layout((q, c), "Q_PAGED_KV_HND") == (q, c, "HND", False)
    assert trtllm_fmha.parse_layout((q, (k, v)), "Q_PAGED_KV_NHD") == (q, (k, v), "NHD", False)
    assert trtllm_fmha.parse_layout((q, k, v), "Q_PAGED_KV_NHD") == (q, (k, v), "NHD", False)
    with pytest.raises(ValueError, match="tuple of 3"):
        trtllm_fmha.parse_layout((q, k), "SEPARATE_Q_K_V")
    with pytest.raises(ValueError, match=r"qkv must be \[num_tokens, 3"):
        trtllm_fmha.parse_layout(T((4, 2, 2, 64)), "PACKED_QKV")
    with pytest.raises(ValueError, match=r"KV must be \[num_tokens, 2"):
        trtllm_fmha.parse_layout((q, T((4, 3, 2, 64))), "CONTIGUOUS_Q_KV")


class NoSlicing(FakeProducer):
    """A packed tensor whose slicing is refused: JAX's would copy (an XLA computation a slice)."""

    def __getitem__(self, key):
        raise AssertionError("the packed tensor was sliced")


@pytest.mark.parametrize("layout", ["PACKED_QKV", "CONTIGUOUS_Q_KV"])
def test_packed_layouts_view_the_halves_without_slicing(fake, layout):
    packed = 3 if layout == "PACKED_QKV" else 2
    shape = (7, packed, 2, 64)
    t = NoSlicing(shape, (packed * 128, 128, 64, 1), _dtypes.BFLOAT16, data=0x200000)
    q = T((7, 4, 64), _dtypes.BFLOAT16)
    got_q, (k, v), kv_layout, ragged = trtllm_fmha.parse_layout(t if packed == 3 else (q, t), layout)
    # exported once more with the launch stream (the views' DLPack handshake), never sliced
    assert (kv_layout, ragged) == ("NHD", True) and len(t.calls) == 2 and t.calls[1]["stream"] is not None
    first = 1 if packed == 3 else 0
    for part, i in ((k, first), (v, first + 1)):
        assert part.ptr == 0x200000 + i * 128 * 2 and part.shape == (7, 2, 64) and part.strides == (packed * 128, 64, 1)
    if packed == 3:
        assert (got_q.ptr, got_q.shape) == (0x200000, (7, 2, 64))
    else:
        assert got_q is q


def test_contiguous_q_kv_call_points_k_and_v_into_the_packed_tensor(fake):
    sl, cq, ck = lengths(fake)
    kv = NoSlicing((TKV, 2, HKV, D), (2 * HKV * D, HKV * D, D, 1), _dtypes.FLOAT16, data=0x300000)
    fmha(qkv=(T((TQ, HQ, D)), kv), input_layout="CONTIGUOUS_Q_KV", workspace_buffer=WS(fake), seq_lens=sl,
         max_q_len=12, max_kv_len=19, bmm1_scale=0.1, bmm2_scale=1.0, batch_size=3, cum_seq_lens_q=cq,
         cum_seq_lens_kv=ck, out=out_for(None))
    _, p = last_params(fake)
    assert p.k == 0x300000 and p.v == 0x300000 + HKV * D * 2
    assert p.k_stride_n == p.v_stride_n == 2 * HKV * D and p.k_stride_h == D


@pytest.mark.parametrize("seed", range(6))
def test_block_table_rows_match_a_python_loop(seed):
    rng = np.random.default_rng(seed)
    B, M, ps = int(rng.integers(1, 6)), int(rng.integers(1, 8)), int(rng.choice([1, 16, 32]))
    table = rng.integers(0, 50, (B, 2, M)).astype(np.int32)
    lens = rng.integers(0, M * ps + 1, B)
    k_ids, v_ids = operands.block_table_rows(table, B, ps, lens, 50, True)
    want_k = [int(x) for b in range(B) for x in table[b, 0, :-(-lens[b] // ps)]]
    want_v = [int(x) for b in range(B) for x in table[b, 1, :-(-lens[b] // ps)]]
    assert k_ids.tolist() == want_k and v_ids.tolist() == want_v
    k2, none = operands.block_table_rows(table[:, 0], B, ps, lens, 50, False)
    assert k2.tolist() == want_k and none is None


def test_block_table_rows_refuse_bad_tables():
    lens = np.array([19, 16, 0])
    with pytest.raises(ValueError, match="batch_size=3"):
        operands.block_table_rows(TABLE[:2], 3, PS, lens, NPAGES, False)
    with pytest.raises(ValueError, match="page id 9 outside"):
        operands.block_table_rows(np.where(TABLE == 4, 9, TABLE), 3, PS, lens, NPAGES, False)
    with pytest.raises(ValueError, match="hold 1 pages"):
        operands.block_table_rows(TABLE[:, :1], 3, PS, lens, NPAGES, False)


# ---- validation before any launch ---------------------------------------------------------------
@pytest.mark.parametrize("kw, exc, pattern", [
    (dict(input_layout="QKV"), ValueError, "input_layout"),
    (dict(mask_mode="full"), ValueError, "mask_mode"),
    (dict(mask_mode="padding", window_left=8), ValueError, "window_left=8.*padding"),
    (dict(mask_mode="chunked", chunked_attention_size=48), ValueError, "chunked_attention_size"),
    (dict(mask_mode="chunked", chunked_attention_size=0), ValueError, "chunked_attention_size"),
    (dict(mask_mode="chunked", chunked_attention_size=64, window_left=8), ValueError, "excludes a sliding window"),
    (dict(mask_mode="causal", chunked_attention_size=64), ValueError, "needs mask_mode='chunked'"),
    (dict(mask_mode="sliding_window", window_left=-1), ValueError, "needs window_left >= 0"),
    (dict(out_dtype="float32"), TypeError, "out_dtype"),
    (dict(batch_size=2), ValueError, "seq_lens must have shape"),
    (dict(max_q_len=11), ValueError, "max_q_len=11"),
    (dict(max_kv_len=18), ValueError, "max_kv_len=18"),
    (dict(skip_softmax_threshold_scale_factor=-1.0), ValueError, "skip_softmax_threshold_scale_factor"),
    (dict(skip_softmax_threshold_scale_factor=float("nan")), ValueError, "skip_softmax_threshold_scale_factor"),
    (dict(skip_softmax_threshold_scale_factor=float("inf")), ValueError, "skip_softmax_threshold_scale_factor"),
    (dict(skip_softmax_threshold_scale_factor="500"), TypeError, "skip_softmax_threshold_scale_factor"),
    (dict(pos_encoding_mode="rope"), ValueError, "pos_encoding_mode"),
    (dict(mask_mode="custom"), NotImplementedError, "custom"),
])
def test_fmha_refuses_before_launch(fake, kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        separate_call(fake, **kw)
    assert not fake.attn_launches()


def test_fmha_refuses_inconsistent_lengths_and_devices(fake):
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 20 disagrees"):
        separate_call(fake, seq_lens=fake.dev(np.array([20, 16, 0], np.int32), _dtypes.INT32))
    cpu = T((TQ, HQ, D))
    cpu.args = cpu.args[:5] + ((1, 0),)
    with pytest.raises(ValueError, match="CUDA|cuda|device"):
        separate_call(fake, qkv=(cpu, T((TKV, HKV, D)), T((TKV, HKV, D))))
    with pytest.raises(NotImplementedError, match="float8_e5m2 queries"):
        separate_call(fake, qkv=fp8_qkv(_dtypes.FLOAT8_E5M2))
    assert not fake.attn_launches()


def test_paged_refusals(fake):
    with pytest.raises(ValueError, match="block_tables is required"):
        paged_call(fake, block_tables=None)
    with pytest.raises(ValueError, match="batch_size=3"):
        paged_call(fake, table=TABLE[:2])
    with pytest.raises(ValueError, match="outside the cache"):
        paged_call(fake, table=np.where(TABLE == 4, NPAGES, TABLE))
    assert not fake.attn_launches()


# ---- what a call writes ---------------------------------------------------------------------------
def test_fmha_separate_causal_params(fake):
    separate_call(fake, bmm1_scale=0.25, bmm2_scale=0.5)
    _, p = last_params(fake)
    assert p.causal == 1 and p.window_left == -1 and p.chunk_shift == 0 and p.softmax_stats == 0
    assert math.isclose(p.sm_scale_log2, 0.25 * LOG2E, rel_tol=1e-6) and math.isclose(p.v_scale, 0.5)


@pytest.mark.parametrize("mode, wl, chunk, want", [
    ("padding", -1, 0, (0, -1, 0)), ("causal", 31, 0, (1, 31, 0)), ("sliding_window", 7, 0, (1, 7, 0)),
    ("chunked", -1, 64, (1, -1, 6)), ("chunked", -1, 256, (1, -1, 8))])
def test_fmha_mask_modes(fake, mode, wl, chunk, want):
    separate_call(fake, mask_mode=mode, window_left=wl, chunked_attention_size=chunk)
    _, p = last_params(fake)
    assert (p.causal, p.window_left, p.chunk_shift) == want


def test_fmha_stats_run_unsplit_on_the_general_kernels(fake, monkeypatch):
    made = []

    def empty(ref, shape, dtype, stream):
        t = fake.dev(int(np.prod(shape)) * 4, dtype, shape=shape)
        made.append(t)
        return t, trtllm_fmha._tensor.view(t, "stats")
    monkeypatch.setattr(trtllm_fmha._tensor, "empty", empty)
    o, stats = separate_call(fake, save_softmax_stats=True)
    name, p = last_params(fake)
    assert "_gen" in name and p.softmax_stats != 0 and p.num_kv_chunks in (0, 1)
    assert stats.args[0] == (TQ, HQ, 2) and stats.args[2] is F32
    separate_call(fake)
    assert last_params(fake)[1].softmax_stats == 0


def test_fmha_alibi_softcap_sinks_out_dtype(fake, monkeypatch):
    from pyflashattn._engine import params
    monkeypatch.setattr(params, "alibi_buffer", lambda dev, n: 0xA11B1)  # the fake driver has no sync upload
    s = fake.dev(np.zeros(HQ, np.float32), F32)
    o = separate_call(fake, pos_encoding_mode="alibi", sinks=[s], out_dtype="bfloat16")
    assert p_sinks(fake) == s.args[3]
    name, p = last_params(fake)
    assert p.alibi_slopes == 0xA11B1 and p.o_format == operands.OUT_OTHER16
    assert o.args[2] is BF16
    separate_call(fake, logits_soft_cap_scale=30.0)
    assert math.isclose(last_params(fake)[1].logits_soft_cap, 30.0)
    o8 = separate_call(fake, out_dtype="float8_e4m3fn", bmm2_scale=2.0)
    assert last_params(fake)[1].o_format == operands.OUT_E4M3 and o8.args[2] is E4M3


def p_sinks(fake):
    return last_params(fake)[1].sinks


def test_fmha_bmm1_zero_means_rsqrt_d(fake):
    separate_call(fake, bmm1_scale=0.0)
    assert math.isclose(last_params(fake)[1].sm_scale_log2, LOG2E / math.sqrt(D), rel_tol=1e-6)


@pytest.mark.parametrize("layout", ["Q_PAGED_KV_HND", "Q_PAGED_KV_NHD"])
def test_fmha_paged_params(fake, layout):
    paged_call(fake, layout)
    name, p = last_params(fake)
    assert "paged" in name and p.page_size == PS and p.kv_page_indices != 0
    idx = fake.read(p.kv_page_indices, 3, np.int32).tolist()
    assert idx == [4, 1, 0]  # pages the requests use, in order


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_fmha_paged_tuple_with_k_v_offsets(fake, device):
    """(k, v) tuple of one allocation, V 6 pages after K; [B, 2, M] offsets from K's base, V's
    independent of K's: V is read from K's base through its own ids, clamped to V's last page."""
    page = HKV * PS * D * 2
    k = T((NPAGES, HKV, PS, D), data=0x100000)
    v = T((NPAGES, HKV, PS, D), data=0x100000 + NPAGES * page)
    v_ids = np.array([[9, 6, 11], [7, 6, 6], [6, 6, 6]], np.int32)
    paged_call(fake, cache=(k, v), table=np.stack([TABLE, v_ids], axis=1), device=device)
    _, p = last_params(fake)
    assert p.k == 0x100000 and p.v == 0x100000 and p.v_stride_page == p.k_stride_page
    if device:
        assert p.num_pages == 2 * NPAGES and p.v_page_indices == p.kv_page_indices + 4 * 3
    else:
        assert fake.read(p.v_page_indices, 3, np.int32).tolist() == [9, 6, 7]
    with pytest.raises(ValueError, match="tuple form of one allocation"):
        paged_call(fake, table=np.stack([TABLE, v_ids], axis=1), device=device)  # a 5-D cache


# ---- fp8 e4m3 inputs (the sm_90a fp8 prefill, fp8.py) ----------------------------------------------
def fp8_qkv(dtype=E4M3, kv_dtype=None):
    kv = kv_dtype or dtype
    return T((TQ, HQ, D), dtype), T((TKV, HKV, D), kv), T((TKV, HKV, D), kv)


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("out_dtype, fmt", [(None, operands.OUT_E4M3), ("bfloat16", operands.OUT_ELEM),
                                            ("float16", operands.OUT_OTHER16)])
def test_fmha_fp8_plans_the_e4m3_kernel(fake, device, out_dtype, fmt):
    """e4m3 q, k, v plan the fp8 prefill row (lean: not a general kernel); bmm1 is the logit scale,
    bmm2 the output multiplier, no per-head scale tensors; the output q's dtype unless asked."""
    o = separate_call(fake, device=device, qkv=fp8_qkv(), out_dtype=out_dtype, out=out_for(out_dtype or "e4m3"),
                      bmm1_scale=0.25, bmm2_scale=0.5, mask_mode="padding")
    name, p = last_params(fake)
    assert "dtype=e4m3" in name and "kv_dtype=e4m3" in name and "general=False" in name and "paged=False" in name
    assert p.o_format == fmt and o.args[2] is _dtypes.normalize(out_dtype or "float8_e4m3fn")
    assert math.isclose(p.sm_scale_log2, 0.25 * LOG2E, rel_tol=1e-6) and math.isclose(p.v_scale, 0.5)
    assert (p.q_scale_heads, p.k_scale_heads, p.v_scale_heads) == (0, 0, 0) and p.scale_dev == p.v_scale_dev == 0
    assert p.causal == 0 and p.kv_fp8 == 0
    if device:
        assert p.qo_max_len == 12 and p.kv_max_len == 19 and len(trtllm_device._ENGINES) == 1
    else:
        assert p.qo_max_len == 0 and len(trtllm._ENGINES) == 1


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_fmha_fp8_masks_sinks_and_device_scales(fake, device):
    """The mask rules and sinks are the fp8 kernels' too; tensor bmm scales are read on the device
    by the fp8 row itself (its manifest's device_scale), not moved to a general kernel."""
    s1 = fake.dev(np.array([0.1], np.float32), F32)
    s2 = fake.dev(np.array([2.0], np.float32), F32)
    sinks = fake.dev(np.zeros(HQ, np.float32), F32)
    for mode, wl, chunk, want in (("causal", -1, 0, (1, -1, 0)), ("sliding_window", 7, 0, (1, 7, 0)),
                                  ("chunked", -1, 64, (1, -1, 6))):
        separate_call(fake, device=device, qkv=fp8_qkv(), out=out_for("e4m3"), mask_mode=mode, window_left=wl,
                      chunked_attention_size=chunk, bmm1_scale=s1, bmm2_scale=s2, sinks=[sinks])
        name, p = last_params(fake)
        assert "dtype=e4m3" in name and "general=False" in name
        assert (p.causal, p.window_left, p.chunk_shift) == want
        assert p.scale_dev == s1.args[3] and p.v_scale_dev == s2.args[3] and p.sinks == sinks.args[3]
        assert math.isclose(p.sm_scale_log2, LOG2E, rel_tol=1e-6) and p.v_scale == 1.0


@pytest.mark.parametrize("kw, exc, pattern", [
    (dict(pos_encoding_mode="alibi"), NotImplementedError, "pos_encoding_mode='alibi' with fp8"),
    (dict(logits_soft_cap_scale=30.0), NotImplementedError, "logits_soft_cap_scale with fp8"),
    (dict(save_softmax_stats=True), NotImplementedError, "save_softmax_stats with fp8"),
    (dict(skip_softmax_threshold_scale_factor=1.0), NotImplementedError, "skip_softmax_threshold_scale_factor"),
    (dict(qkv=fp8_qkv(E4M3, BF16)), TypeError, "K/V must have the query's dtype"),
    (dict(out_dtype="float32"), TypeError, "out_dtype"),
])
def test_fmha_fp8_refuses_before_launch(fake, kw, exc, pattern):
    kw.setdefault("qkv", fp8_qkv())
    kw.setdefault("out", out_for("e4m3"))
    with pytest.raises(exc, match=pattern):
        separate_call(fake, **kw)
    assert not fake.attn_launches()


def fp8_cache(layout="HND"):
    return T((NPAGES, 2, HKV, PS, D) if layout.endswith("HND") else (NPAGES, 2, PS, HKV, D), E4M3, data=0x200000)


def assert_paged_fp8(fake, fmt):
    """The last launch ran the paged sm90 fp8 row (lean), in output format fmt."""
    name, p = last_params(fake)
    assert "dtype=e4m3" in name and "kv_dtype=e4m3" in name and "paged=True" in name and "general=False" in name
    assert p.o_format == fmt and p.kv_fp8 == 0 and (p.q_scale_heads, p.k_scale_heads, p.v_scale_heads) == (0, 0, 0)
    return p


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("layout", ["Q_PAGED_KV_HND", "Q_PAGED_KV_NHD"])
@pytest.mark.parametrize("out_dtype, fmt", [(None, operands.OUT_E4M3), ("bfloat16", operands.OUT_ELEM)])
def test_fmha_fp8_paged_layouts_plan_the_paged_e4m3_kernel(fake, device, layout, out_dtype, fmt):
    """e4m3 q over an e4m3 paged cache (5-D, either layout) plans the paged fp8 row; bmm1 / bmm2
    numbers are the logit scale / the output multiplier."""
    paged_call(fake, layout, device=device, qkv=(T((TQ, HQ, D), E4M3), fp8_cache(layout)), out_dtype=out_dtype,
               out=out_for(out_dtype or "e4m3"), bmm1_scale=0.25, bmm2_scale=0.5)
    p = assert_paged_fp8(fake, fmt)
    assert math.isclose(p.sm_scale_log2, 0.25 * LOG2E, rel_tol=1e-6) and math.isclose(p.v_scale, 0.5)
    assert p.scale_dev == p.v_scale_dev == 0 and p.page_size == PS and p.causal == 1 and p.v_page_indices == 0
    assert p.k == 0x200000 and p.k_stride_page == 2 * HKV * PS * D


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_fmha_fp8_tuple_form_with_separate_ids(fake, device):
    """The (k, v) tuple with [B, 2, M] offsets from K's base: V read from K's base by V's own ids,
    on the fp8 kernel too; tensor bmm scales read on the device by the fp8 row itself."""
    k = T((NPAGES, HKV, PS, D), E4M3, data=0x100000)
    v = T((NPAGES, HKV, PS, D), E4M3, data=0x100000 + NPAGES * HKV * PS * D)
    v_ids = np.array([[9, 6, 7], [10, 11, 11], [11, 11, 11]], np.int32)  # V's pages: K's base + 6 ..
    s1 = fake.dev(np.array([0.1], np.float32), F32)
    s2 = fake.dev(np.array([2.0], np.float32), F32)
    paged_call(fake, table=np.stack([TABLE, v_ids], axis=1), device=device, qkv=(T((TQ, HQ, D), E4M3), (k, v)),
               out=out_for("bfloat16"), out_dtype="bfloat16", bmm1_scale=s1, bmm2_scale=s2)
    p = assert_paged_fp8(fake, operands.OUT_ELEM)
    assert p.k == p.v == 0x100000 and p.scale_dev == s1.args[3] and p.v_scale_dev == s2.args[3]
    if device:
        assert p.num_pages == 2 * NPAGES and p.v_page_indices == p.kv_page_indices + 4 * 3
    else:
        assert fake.read(p.v_page_indices, 3, np.int32).tolist() == [9, 6, 10]


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("shared", [True, False])
def test_context_fp8_query_plans_the_paged_e4m3_kernel(fake, device, shared):
    """The context API with an e4m3 query and cache: the paged fp8 row, bf16 or e4m3 out, float or
    tensor bmm scales, shared or separate ([B, 2, M]) page ids."""
    v_ids = np.array([[2, 3, 0], [1, 5, 5], [5, 5, 5]], np.int32)
    table = TABLE if shared else np.stack([TABLE, v_ids], axis=1)
    context_call(fake, table=table, device=device, uses_shared_paged_kv_idx=shared, query=T((TQ, HQ, D), E4M3),
                 kv_cache=fp8_cache(), out_dtype="bfloat16", bmm1_scale=0.5, bmm2_scale=0.25)
    p = assert_paged_fp8(fake, operands.OUT_ELEM)
    assert math.isclose(p.sm_scale_log2, 0.5 * LOG2E, rel_tol=1e-6) and math.isclose(p.v_scale, 0.25)
    assert (p.v_page_indices != 0) == (not shared)
    if not shared and not device:
        assert fake.read(p.v_page_indices, 3, np.int32).tolist() == [2, 3, 1]
    s1 = fake.dev(np.array([0.1], np.float32), F32)
    s2 = fake.dev(np.array([2.0], np.float32), F32)
    context_call(fake, table=table, device=device, uses_shared_paged_kv_idx=shared, query=T((TQ, HQ, D), E4M3),
                 kv_cache=fp8_cache(), out=out_for("e4m3"), bmm1_scale=s1, bmm2_scale=s2)
    p = assert_paged_fp8(fake, operands.OUT_E4M3)
    assert p.scale_dev == s1.args[3] and p.v_scale_dev == s2.args[3]


@pytest.mark.parametrize("kw, exc, pattern", [
    (dict(kv_cache=T((NPAGES, 2, HKV, PS, D), BF16)), TypeError, "K/V must have the query's dtype"),
    (dict(kv_cache=T((NPAGES, 2, HKV, PS, D), _dtypes.FLOAT8_E5M2)), TypeError, "float8_e5m2 with an fp8 query"),
    (dict(skip_softmax_threshold_scale_factor=1.0), NotImplementedError, "skip_softmax_threshold_scale_factor"),
    (dict(query=T((TQ, HQ, D), _dtypes.FLOAT8_E5M2)), NotImplementedError, "query: float8_e5m2 queries"),
])
def test_context_fp8_refuses_before_launch(fake, kw, exc, pattern):
    kw.setdefault("query", T((TQ, HQ, D), E4M3))
    kw.setdefault("kv_cache", fp8_cache())
    if kw.get("out_dtype") != "nvfp4":
        kw.setdefault("out", out_for("e4m3"))
    with pytest.raises(exc, match=pattern):
        context_call(fake, **kw)
    assert not fake.attn_launches()


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_context_fp8_off_sm90_says_so(fake, monkeypatch, device):
    from pyflashattn._runtime import cuda as _cuda
    monkeypatch.setattr(_cuda, "properties", lambda dev: {"sm_count": 108, "cc": (8, 0), "smem_per_sm": 167936})
    with pytest.raises(NotImplementedError, match=r"compute capability 8\.0\) has no fp8 Q K\^T path"):
        context_call(fake, device=device, query=T((TQ, HQ, D), E4M3), kv_cache=fp8_cache(), out=out_for("e4m3"))
    assert not fake.attn_launches()


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_fmha_fp8_off_sm90_says_so(fake, monkeypatch, device):
    from pyflashattn._runtime import cuda as _cuda
    monkeypatch.setattr(_cuda, "properties", lambda dev: {"sm_count": 108, "cc": (8, 0), "smem_per_sm": 167936})
    with pytest.raises(NotImplementedError, match=r"compute capability 8\.0\) has no fp8 Q K\^T path"):
        separate_call(fake, device=device, qkv=fp8_qkv(), out=out_for("e4m3"))
    assert not fake.attn_launches()


# ---- trtllm_batch_context_with_kv_cache -------------------------------------------------------------
def test_context_params_and_scales(fake):
    context_call(fake, window_left=8)
    name, p = last_params(fake)
    assert "paged" in name and p.causal == 1 and p.window_left == 8 and p.scale_dev == 0
    s1 = fake.dev(np.array([0.1], np.float32), F32)
    s2 = fake.dev(np.array([2.0], np.float32), F32)
    context_call(fake, bmm1_scale=s1, bmm2_scale=s2, causal=False)
    name, p = last_params(fake)
    assert "_gen" in name and p.scale_dev == s1.args[3] and p.v_scale_dev == s2.args[3] and p.causal == 0


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_context_separate_ids(fake, device):
    v_ids = np.array([[2, 3, 0], [1, 5, 5], [5, 5, 5]], np.int32)
    table = np.stack([TABLE, v_ids], axis=1)
    context_call(fake, table=table, uses_shared_paged_kv_idx=False, device=device)
    _, p = last_params(fake)
    if device:
        assert p.v_page_indices == p.kv_page_indices + 4 * 3 and p.num_pages == NPAGES
    else:
        assert fake.read(p.v_page_indices, 3, np.int32).tolist() == [2, 3, 1]
    context_call(fake, device=device)  # shared ids again: V reads K's
    assert last_params(fake)[1].v_page_indices == 0
    with pytest.raises(ValueError, match=r"\[batch_size, 2, max_pages\]"):
        context_call(fake, uses_shared_paged_kv_idx=False, device=device)


@pytest.mark.parametrize("kw, exc, pattern", [
    (dict(kv_layout="XYZ"), ValueError, "kv_layout|layout"),
    (dict(out_dtype="nvfp4"), ValueError, "o_sf_scale"),
    (dict(o_sf_scale=1.0), ValueError, "o_sf_scale"),
    (dict(o_sf_vec_size=16), ValueError, "o_sf_vec_size"),
    (dict(kv_block_scales=T((NPAGES, 2, HKV, PS, D // 16), E4M3)), TypeError, "kv_block_scales"),
    (dict(kv_cache_sf=T((NPAGES, 2, HKV, PS, D // 16), E4M3)), TypeError, "kv_cache_sf"),
    (dict(skip_softmax_threshold_scale_factor=-0.5), ValueError, "skip_softmax_threshold_scale_factor"),
    (dict(causal=False, window_left=4), NotImplementedError, "window_left"),
    (dict(out_dtype="float32"), TypeError, "out_dtype"),
    (dict(max_kv_len=10), ValueError, "max_kv_len"),
])
def test_context_refuses_before_launch(fake, kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        context_call(fake, **kw)
    assert not fake.attn_launches()


def test_context_uint32_seq_lens_and_lse(fake):
    sl = fake.dev(np.asarray(KL, np.uint32), U32)
    lse = T((TQ, HQ), F32, data=0x900000)
    o, got = context_call(fake, seq_lens=sl, lse=lse, return_lse=True)
    assert got is lse and last_params(fake)[1].lse == 0x900000
    assert not isinstance(context_call(fake, lse=lse), tuple)  # filled, not returned


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_skip_softmax_reaches_the_kernel(fake, device):
    """skip_softmax_threshold_scale_factor goes into the launched struct (a lean 128-row plan runs
    it on the general kernel of its tile, which has it); a call without it launches with 0."""
    separate_call(fake, device=device, skip_softmax_threshold_scale_factor=500.0)
    name, p = last_params(fake)
    assert p.skip_softmax_factor == 500.0 and "general=True" in name
    separate_call(fake, device=device)
    name, p = last_params(fake)
    assert p.skip_softmax_factor == 0.0 and "general=False" in name
    context_call(fake, device=device, skip_softmax_threshold_scale_factor=2)
    assert last_params(fake)[1].skip_softmax_factor == 2.0
    paged_call(fake, device=device, skip_softmax_threshold_scale_factor=0.25)
    assert last_params(fake)[1].skip_softmax_factor == 0.25


# ---- device metadata: a plan per shape key, no sync, capturable ---------------------------------------
class Everything(set):
    def __contains__(self, item):
        return True


_HOST_WORK = ("alloc", "htod", "dtoh", "dtod", "sync", "event_sync")


@pytest.mark.parametrize("api", ["separate", "paged", "context"])
def test_device_metadata_capture_does_no_host_work(fake, api):
    """After one call of a shape key, a call under capture with other lengths (same shapes) only
    points the struct at the caller's arrays and launches: no copy, sync, allocation or plan."""
    call = {"separate": separate_call, "paged": paged_call, "context": context_call}[api]
    call(fake, device=True)
    fake.cu.log.clear()
    fake.cu.capturing = Everything()
    ql, kl = (7, 3, 2), (9, 3, 30)
    sl, cq, ck = lengths(fake, ql, kl, device=True)
    table = table_arg(fake, np.array([[2, 0, 1], [3, 5, 5], [4, 1, 0]], np.int32), device=True)
    fake.cu.log.clear()
    kw = dict(seq_lens=sl, cum_seq_lens_q=cq, cum_seq_lens_kv=ck)
    if api != "separate":
        kw["block_tables"] = table
    q = T((sum(ql), HQ, D))
    out = T((sum(ql), HQ, D), data=0x700000)
    if api == "context":
        call(fake, device=True, query=q, out=out, **kw)
    else:
        extra = {} if api == "paged" else dict(qkv=(q, T((sum(kl), HKV, D)), T((sum(kl), HKV, D))))
        if api == "paged":
            extra["qkv"] = (q, T((NPAGES, 2, HKV, PS, D)))
        call(fake, device=True, out=out, **extra, **kw)
    assert not [op for op in fake.cu.log if op[0] in _HOST_WORK], fake.cu.log
    assert [op[0] for op in fake.cu.log] == ["launch"]
    _, p = last_params(fake)
    assert p.qo_indptr == cq.args[3] and p.qo_max_len == 12 and p.q_tokens == sum(ql) and p.o == 0x700000
    if api == "separate":
        assert p.kv_indptr == ck.args[3] and p.kv_max_len == 19 and p.kv_tokens == sum(kl)
    else:
        assert p.kv_seq_lens == sl.args[3] and p.kv_page_indices == table.args[3] and p.num_pages == NPAGES
        assert p.kv_max_len == 19 and p.v_page_indices == 0


def test_device_plan_is_one_per_shape_key(fake):
    """The grid covers batch_size x ceil(max_q_len * group / BLOCK_M) row tiles, unsplit; a new
    max_q_len within the plan's rounding keeps the plan (only the struct's clamp changes)."""
    separate_call(fake, device=True, max_q_len=290, max_kv_len=400)
    (e,) = trtllm_device._ENGINES.values()
    assert trtllm_device.coarse(290) == trtllm_device.coarse(300) == 320
    assert e.device_lengths and not e.schedule.split and e.schedule.num_work == 3 * -(-320 * 4 // e.schedule.block_m)
    qt = e.schedule.work_qtile[:e.schedule.num_work]
    assert (qt[:3] == qt.max()).all() and (qt[-3:] == 0).all()  # causal: the bottom (longest) row tiles first
    separate_call(fake, device=True, max_q_len=300, max_kv_len=400)
    assert len(trtllm_device._ENGINES) == 1 and last_params(fake)[1].qo_max_len == 300
    separate_call(fake, device=True, max_q_len=400, max_kv_len=400)
    assert len(trtllm_device._ENGINES) == 2


@pytest.mark.parametrize("api, kw, pattern", [
    ("separate", dict(max_q_len=11), "max_q_len=11"),
    ("separate", dict(max_kv_len=18), "max_kv_len=18"),
    ("separate", dict(seq_lens=np.array([20, 16, 0], np.int32)), r"seq_lens\[0\] = 20 disagrees"),
    ("paged", dict(table=np.where(TABLE == 4, NPAGES, TABLE)), "outside the cache"),
    ("context", dict(table=np.where(TABLE == 1, -1, TABLE)), "outside the cache"),
    ("context", dict(max_kv_len=18), "max_kv_len=18"),
])
def test_device_metadata_checked_mode(fake, monkeypatch, api, kw, pattern):
    """PYFLASHATTN_CHECK_METADATA=1: device metadata copied to the host and refused like host
    metadata, naming the argument, before any launch; without it the call launches (the kernel
    clamps)."""
    call = {"separate": separate_call, "paged": paged_call, "context": context_call}[api]
    if "seq_lens" in kw:
        kw["seq_lens"] = fake.dev(kw["seq_lens"], _dtypes.INT32)
    monkeypatch.setenv(metadata_check.ENV, "1")
    with pytest.raises(ValueError, match=pattern):
        call(fake, device=True, **kw)
    assert not fake.attn_launches()
    monkeypatch.delenv(metadata_check.ENV)
    if "max_kv_len" not in kw or api == "separate":
        call(fake, device=True, **kw)
        assert fake.attn_launches()


def test_device_metadata_refusals_without_a_sync(fake):
    """What the device path checks from shapes alone (no copy): table batch and width, dtypes."""
    with pytest.raises(ValueError, match="batch_size=3"):
        context_call(fake, table=TABLE[:2], device=True)
    with pytest.raises(ValueError, match="max_kv_len needs 3 pages but block_tables rows hold 2"):
        context_call(fake, table=TABLE[:, :2], device=True, max_kv_len=40)
    with pytest.raises(TypeError, match="cum_seq_lens_q must be int32"):
        separate_call(fake, device=True, cum_seq_lens_q=fake.dev(cum(QL).astype(np.int64), _dtypes.INT64))
    assert not [op for op in fake.cu.log if op[0] in ("dtoh", "sync")] and not fake.attn_launches()
