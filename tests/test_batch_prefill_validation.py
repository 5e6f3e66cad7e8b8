"""Batch prefill wrappers, validation on CPU: constructor and plan() arguments that are wrong raise
a ValueError/TypeError naming the argument before the driver is touched (the driver is stubbed
to raise a sentinel); valid arguments get past validation, to the stubbed driver. The workspace
is a fake CUDA DLPack tensor, index arrays are numpy (a CUDA index tensor is copied to the host
with the driver: that path must also validate its dtype first).
"""
import inspect

import numpy as np
import pytest

import pyflashattn
from pyflashattn._runtime import cuda as _cuda, dtypes as _dtypes
from pyflashattn.testing.fake_tensors import fake_cuda_tensor

Paged = pyflashattn.BatchPrefillWithPagedKVCacheWrapper
Ragged = pyflashattn.BatchPrefillWithRaggedKVCacheWrapper
F16, U8, I32 = _dtypes.FLOAT16, _dtypes.UINT8, _dtypes.INT32


class ReachedDriver(Exception):
    pass


@pytest.fixture(autouse=True)
def no_driver(monkeypatch):
    def stop(*a, **_k):
        raise ReachedDriver(*a)  # ensure_context(device_id): the device it was asked for

    monkeypatch.setattr(_cuda, "ensure_context", stop)
    monkeypatch.setattr(_cuda, "driver", stop)  # any direct driver use counts as reaching it
    monkeypatch.setattr(_cuda, "properties", lambda _dev: {"sm_count": 132, "cc": (9, 0)})


def T(shape, dtype=F16, strides=None, device=(2, 0), data=0x100000):
    return fake_cuda_tensor(shape, dtype, strides, device, data)


def WS(nbytes=128 << 20, **kw):
    return T((nbytes,), U8, **kw)


def i32(*xs):
    return np.asarray(xs, dtype=np.int32)


# A valid paged batch: 3 requests (qo 5, 0, 12; kv 19, 16, 0 with page_size 16), 3 pages used.
QO = i32(0, 5, 5, 17)
KV_INDPTR = i32(0, 2, 3, 3)
KV_INDICES = i32(4, 1, 0)
LAST = i32(3, 16, 0)
HEADS = (8, 2, 128)


def paged_args(qo=QO, indptr=KV_INDPTR, indices=KV_INDICES, last=LAST, hq=8, hkv=2, d=128, page_size=16):
    return (qo, indptr, indices, last, hq, hkv, d, page_size)


def ragged_args(qo=QO, kv=i32(0, 19, 35, 35), hq=8, hkv=2, d=128):
    return (qo, kv, hq, hkv, d)


def plan(kind, args=None, **kw):
    if kind == "paged":
        return Paged(WS()).plan(*(args or paged_args()), **kw)
    return Ragged(WS()).plan(*(args or ragged_args()), **kw)


def test_exported():
    assert pyflashattn.prefill.BatchPrefillWithPagedKVCacheWrapper is Paged
    assert pyflashattn.prefill.BatchPrefillWithRaggedKVCacheWrapper is Ragged
    assert {"BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper"} <= set(pyflashattn.__all__)
    assert Paged.begin_forward is Paged.plan and Ragged.begin_forward is Ragged.plan


def test_positional_order_matches_flashinfer():
    # FlashInfer's positional orders differ between the two wrappers (semantics notes 1.19):
    # ragged has window_left, logits_soft_cap, sm_scale; paged sm_scale, window_left, logits_soft_cap.
    paged = ["qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "num_qo_heads",
             "num_kv_heads", "head_dim", "page_size", "custom_mask", "packed_custom_mask", "causal",
             "pos_encoding_mode", "allow_fp16_qk_reduction", "sm_scale", "window_left", "logits_soft_cap",
             "rope_scale", "rope_theta", "q_data_type", "kv_data_type"]
    ragged = ["qo_indptr", "kv_indptr", "num_qo_heads", "num_kv_heads", "head_dim", "custom_mask",
              "packed_custom_mask", "causal", "pos_encoding_mode", "allow_fp16_qk_reduction", "window_left",
              "logits_soft_cap", "sm_scale", "rope_scale", "rope_theta", "q_data_type", "kv_data_type"]
    for cls, want in ((Paged, paged), (Ragged, ragged)):
        params = [p for p in inspect.signature(cls.plan).parameters.values() if p.name != "self"]
        positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
        assert positional[:len(want)] == want, cls.__name__
    init = [p.name for p in inspect.signature(Paged.__init__).parameters.values()][1:7]
    assert init == ["float_workspace_buffer", "kv_layout", "use_cuda_graph", "qo_indptr_buf",
                    "paged_kv_indptr_buf", "paged_kv_indices_buf"]
    init = [p.name for p in inspect.signature(Ragged.__init__).parameters.values()][1:6]
    assert init == ["float_workspace_buffer", "kv_layout", "use_cuda_graph", "qo_indptr_buf", "kv_indptr_buf"]


# ---------------------------------------------------------------------------------------
# Constructor: never touches the driver; bad arguments raise
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [Paged, Ragged])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_constructor_does_not_touch_the_driver(cls, layout):
    cls(WS(), layout)
    cls(WS(), kv_layout=layout, use_cuda_graph=False)


@pytest.mark.parametrize("cls", [Paged, Ragged])
@pytest.mark.parametrize("ws, exc, pattern", [
    pytest.param(lambda: WS(device=(1, 0)), ValueError, r"float_workspace_buffer.*CUDA", id="cpu"),
    pytest.param(lambda: T((1024, 1024), U8), ValueError, r"float_workspace_buffer.*1-D", id="2d"),
    pytest.param(lambda: T((1 << 20,), U8, strides=(2,)), ValueError, r"float_workspace_buffer.*contiguous",
                 id="strided"),
    pytest.param(lambda: WS(data=0x100008), ValueError, r"float_workspace_buffer.*16-byte", id="misaligned"),
    pytest.param(lambda: bytearray(1024), TypeError, r"float_workspace_buffer", id="not_a_tensor"),
    pytest.param(lambda: None, TypeError, r"float_workspace_buffer", id="none"),
])
def test_bad_workspace(cls, ws, exc, pattern):
    with pytest.raises(exc, match=pattern):
        cls(ws())


@pytest.mark.parametrize("cls", [Paged, Ragged])
@pytest.mark.parametrize("layout", ["NDH", "nhd", "", None])
def test_bad_kv_layout(cls, layout):
    with pytest.raises(ValueError, match="kv_layout"):
        cls(WS(), layout)


def _paged_bufs():
    return dict(qo_indptr_buf=T((9,), I32), paged_kv_indptr_buf=T((9,), I32), paged_kv_indices_buf=T((64,), I32),
                paged_kv_last_page_len_buf=T((8,), I32))


@pytest.mark.parametrize("missing", ["qo_indptr_buf", "paged_kv_indptr_buf", "paged_kv_indices_buf",
                                     "paged_kv_last_page_len_buf"])
def test_paged_cuda_graph_needs_every_buffer(missing):
    bufs = _paged_bufs()
    del bufs[missing]
    with pytest.raises(ValueError, match=missing):
        Paged(WS(), "NHD", use_cuda_graph=True, **bufs)


@pytest.mark.parametrize("cls", [Paged, Ragged])
def test_cuda_graph_without_any_buffer(cls):
    with pytest.raises(ValueError, match="qo_indptr_buf"):
        cls(WS(), "NHD", True)


@pytest.mark.parametrize("missing", ["qo_indptr_buf", "kv_indptr_buf"])
def test_ragged_cuda_graph_needs_every_buffer(missing):
    bufs = dict(qo_indptr_buf=T((9,), I32), kv_indptr_buf=T((9,), I32))
    del bufs[missing]
    with pytest.raises(ValueError, match=missing):
        Ragged(WS(), "NHD", use_cuda_graph=True, **bufs)


def test_cuda_graph_constructor_with_buffers_and_valid_plan():
    Paged(WS(), "HND", use_cuda_graph=True, **_paged_bufs())
    w = Ragged(WS(), "NHD", use_cuda_graph=True, qo_indptr_buf=T((9,), I32), kv_indptr_buf=T((9,), I32))
    with pytest.raises(ReachedDriver):
        w.plan(*ragged_args(), causal=True)


def test_plan_uses_the_workspace_device():
    with pytest.raises(ReachedDriver) as e:
        Paged(WS(device=(2, 3))).plan(*paged_args())
    assert e.value.args == (3,)


@pytest.mark.parametrize("cls", [Paged, Ragged])
@pytest.mark.parametrize("ws, pattern", [
    pytest.param(lambda: WS(device=(1, 0)), r"float_workspace_buffer.*CUDA", id="cpu"),
    pytest.param(lambda: T((8, 8), U8), r"float_workspace_buffer.*1-D", id="2d"),
    pytest.param(lambda: WS(device=(2, 1)), r"float_workspace_buffer.*device", id="other_gpu"),
])
def test_refused_reset_workspace_buffer_changes_nothing(cls, ws, pattern):
    w = cls(WS())
    with pytest.raises(ValueError, match=pattern):
        w.reset_workspace_buffer(ws(), WS(8 << 20))
    # the wrapper still works on its own device (plan() makes cuda:0 current)
    with pytest.raises(ReachedDriver) as e:
        w.plan(*(paged_args() if cls is Paged else ragged_args()))
    assert e.value.args == (0,), "a refused reset_workspace_buffer moved the wrapper to another device"


@pytest.mark.parametrize("cls", [Paged, Ragged])
def test_run_and_workspace_size_before_plan(cls):
    w = cls(WS())
    q = T((17, 8, 128))
    with pytest.raises(RuntimeError, match="plan"):
        w.run(q, *((T((4, 2, 16, 2, 128)),) if cls is Paged else (T((35, 2, 128)), T((35, 2, 128)))))
    with pytest.raises(RuntimeError, match="plan"):
        w.workspace_size()


@pytest.mark.parametrize("cls", [Paged, Ragged])
@pytest.mark.parametrize("scales", [dict(k_scale=0.5), dict(v_scale="x"), dict(k_scale=float("nan"))])
def test_run_before_plan_is_a_runtime_error_whatever_the_scales(cls, scales):
    # k_scale / v_scale are run() arguments of every KV dtype now; before plan() the missing plan
    # is the error (the scale checks themselves: tests/test_batch_prefill_host.py)
    w = cls(WS())
    kv = (T((4, 2, 16, 2, 128)),) if cls is Paged else (T((35, 2, 128)), T((35, 2, 128)))
    with pytest.raises(RuntimeError, match="plan"):
        w.run(T((17, 8, 128)), *kv, **scales)


# ---------------------------------------------------------------------------------------
# plan(): valid arguments reach the driver
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["paged", "ragged"])
@pytest.mark.parametrize("kw", [
    pytest.param({}, id="defaults"),
    pytest.param({"causal": True}, id="causal"),
    pytest.param({"q_data_type": "bfloat16"}, id="bf16"),
    pytest.param({"q_data_type": "float16", "kv_data_type": "float16"}, id="explicit_kv_dtype"),
    pytest.param({"window_left": 0}, id="window_0"),
    pytest.param({"window_left": 10**6, "causal": True}, id="window_huge"),
    pytest.param({"logits_soft_cap": 30.0}, id="soft_cap"),
    pytest.param({"logits_soft_cap": None, "sm_scale": None}, id="explicit_none"),
    pytest.param({"pos_encoding_mode": "ALIBI", "causal": True}, id="alibi"),
    pytest.param({"pos_encoding_mode": "ROPE_LLAMA", "rope_scale": 2.0, "rope_theta": 5e5}, id="rope"),
    pytest.param({"lse_base": "ln"}, id="lse_ln"),
    pytest.param({"sm_scale": 0.1}, id="sm_scale"),
    pytest.param({"fixed_split_size": 512}, id="fixed_split"),
    pytest.param({"disable_split_kv": True}, id="no_split"),
    pytest.param({"allow_fp16_qk_reduction": False}, id="fp16_qk_reduction_false"),
    # fp8 KV with 16-bit queries, every spelling _dtypes.normalize takes
    pytest.param({"kv_data_type": "float8_e4m3fn"}, id="fp8_e4m3"),
    pytest.param({"q_data_type": "bfloat16", "kv_data_type": "float8_e5m2"}, id="fp8_e5m2_bf16"),
    pytest.param({"kv_data_type": "fp8_e4m3"}, id="fp8_alias"),
    pytest.param({"kv_data_type": "e5m2"}, id="fp8_short"),
    pytest.param({"kv_data_type": _dtypes.FLOAT8_E4M3}, id="fp8_dtype_object"),
    pytest.param({"kv_data_type": "float8_e4m3fn", "pos_encoding_mode": "ROPE_LLAMA"}, id="fp8_rope"),
    pytest.param({"kv_data_type": "float8_e5m2", "logits_soft_cap": 20.0, "window_left": 7, "causal": True},
                 id="fp8_softcap_window"),
])
def test_valid_plan_reaches_the_driver(kind, kw):
    with pytest.raises(ReachedDriver):
        plan(kind, **kw)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("heads", [(32, 32), (32, 8), (32, 4), (7, 1)])
def test_valid_shapes_reach_the_driver(d, heads):
    with pytest.raises(ReachedDriver):
        plan("paged", paged_args(hq=heads[0], hkv=heads[1], d=d))
    with pytest.raises(ReachedDriver):
        plan("ragged", ragged_args(hq=heads[0], hkv=heads[1], d=d))


@pytest.mark.parametrize("args", [
    pytest.param(paged_args(qo=i32(0, 0, 0, 0)), id="no_query_tokens"),
    pytest.param(paged_args(indptr=i32(0, 0, 0, 0), indices=i32(), last=i32(0, 0, 0)), id="no_pages"),
    pytest.param(paged_args(indices=i32(4, 1, 0, 7, 7)), id="indices_longer_than_used"),
    pytest.param(paged_args(last=i32(3, 16, 5)), id="last_len_ignored_without_pages"),
    pytest.param(paged_args(page_size=1, last=i32(1, 1, 0)), id="page_size_1"),
    pytest.param(paged_args(page_size=24, last=i32(24, 1, 0)), id="page_size_24"),
    pytest.param(paged_args(qo=i32(0, 40, 40, 41)), id="causal_kv_shorter_than_qo"),
    pytest.param((QO.astype(np.int64), KV_INDPTR.astype(np.int64), KV_INDICES.astype(np.int64),
                  LAST.astype(np.int64)) + HEADS + (16,), id="int64_arrays"),
    pytest.param((list(QO), list(KV_INDPTR), list(KV_INDICES), list(LAST)) + HEADS + (16,), id="lists"),
])
def test_valid_paged_edge_cases_reach_the_driver(args):
    with pytest.raises(ReachedDriver):
        Paged(WS()).plan(*args, causal=True)


def test_cuda_index_tensor_goes_to_the_driver_for_its_copy():
    # a device index array is copied to the host through the driver (after its dtype check)
    with pytest.raises(ReachedDriver):
        plan("paged", paged_args(qo=T((4,), I32)))
    with pytest.raises(ReachedDriver):
        plan("ragged", ragged_args(kv=T((4,), I32)))


# ---------------------------------------------------------------------------------------
# plan(): bad arguments raise before the driver, naming the argument
# ---------------------------------------------------------------------------------------
PAGED_BAD = [
    # indptr shape / order
    ("qo_not_monotonic", dict(qo=i32(0, 5, 3, 17)), ValueError, r"qo_indptr"),
    ("qo_not_from_0", dict(qo=i32(1, 5, 5, 17)), ValueError, r"qo_indptr"),
    ("qo_empty", dict(qo=i32()), ValueError, r"qo_indptr"),
    ("qo_2d", dict(qo=np.zeros((2, 4), np.int32)), ValueError, r"qo_indptr"),
    ("qo_float", dict(qo=np.asarray([0.0, 5, 5, 17])), TypeError, r"qo_indptr"),
    ("qo_out_of_int32", dict(qo=np.asarray([0, 5, 5, 2**40])), ValueError, r"qo_indptr"),
    ("qo_cuda_float", dict(qo=T((4,), _dtypes.FLOAT32)), TypeError, r"qo_indptr"),
    ("qo_not_an_array", dict(qo=object()), TypeError, r"qo_indptr"),
    ("qo_none", dict(qo=None), (ValueError, TypeError), r"qo_indptr"),
    ("kv_not_monotonic", dict(indptr=i32(0, 2, 1, 3)), ValueError, r"paged_kv_indptr"),
    ("kv_not_from_0", dict(indptr=i32(1, 2, 3, 3)), ValueError, r"paged_kv_indptr"),
    # lengths
    ("kv_indptr_short", dict(indptr=i32(0, 2, 3)), ValueError, r"paged_kv_indptr"),
    ("kv_indptr_long", dict(indptr=i32(0, 2, 3, 3, 3)), ValueError, r"paged_kv_indptr"),
    ("last_short", dict(last=i32(3, 16)), ValueError, r"paged_kv_last_page_len"),
    ("last_long", dict(last=i32(3, 16, 1, 1)), ValueError, r"paged_kv_last_page_len"),
    ("indices_short", dict(indices=i32(4, 1)), ValueError, r"paged_kv_indices"),
    ("indices_negative", dict(indices=i32(4, -1, 0)), ValueError, r"paged_kv_indices"),
    # last_page_len in [1, page_size] for requests with pages
    ("last_zero", dict(last=i32(0, 16, 0)), ValueError, r"paged_kv_last_page_len"),
    ("last_over_page", dict(last=i32(3, 17, 0)), ValueError, r"paged_kv_last_page_len"),
    ("last_negative", dict(last=i32(-3, 16, 0)), ValueError, r"paged_kv_last_page_len"),
    ("last_over_page_size_1", dict(page_size=1, last=i32(1, 2, 0)), ValueError, r"paged_kv_last_page_len"),
    # page_size
    ("page_size_0", dict(page_size=0), ValueError, r"page_size"),
    ("page_size_negative", dict(page_size=-16), ValueError, r"page_size"),
    ("page_size_float", dict(page_size=16.0), (ValueError, TypeError), r"page_size"),
    # heads / head_dim
    ("heads_not_divisible", dict(hq=6, hkv=4), ValueError, r"num_qo_heads.*num_kv_heads"),
    ("kv_heads_more_than_q", dict(hq=2, hkv=8), ValueError, r"num_qo_heads.*num_kv_heads"),
    ("kv_heads_0", dict(hkv=0), ValueError, r"num_kv_heads"),
    ("q_heads_0", dict(hq=0), ValueError, r"num_qo_heads"),
    ("head_dim_96", dict(d=96), ValueError, r"head_dim"),
    ("head_dim_512", dict(d=512), ValueError, r"head_dim"),
    ("head_dim_0", dict(d=0), ValueError, r"head_dim"),
]


@pytest.mark.parametrize("name,over,exc,pattern", [pytest.param(*c, id=c[0]) for c in PAGED_BAD])
def test_bad_paged_plan_arguments(name, over, exc, pattern):
    w = Paged(WS())
    with pytest.raises(exc, match=pattern):
        w.plan(*paged_args(**over))
    # nothing sticky: the same wrapper takes a valid plan right after
    with pytest.raises(ReachedDriver):
        w.plan(*paged_args(), causal=True)


RAGGED_BAD = [
    ("qo_not_monotonic", dict(qo=i32(0, 5, 3, 17)), ValueError, r"qo_indptr"),
    ("qo_not_from_0", dict(qo=i32(2, 5, 5, 17)), ValueError, r"qo_indptr"),
    ("kv_not_monotonic", dict(kv=i32(0, 19, 10, 35)), ValueError, r"kv_indptr"),
    ("kv_not_from_0", dict(kv=i32(3, 19, 35, 35)), ValueError, r"kv_indptr"),
    ("kv_short", dict(kv=i32(0, 19, 35)), ValueError, r"kv_indptr"),
    ("kv_long", dict(kv=i32(0, 19, 35, 35, 40)), ValueError, r"kv_indptr"),
    ("qo_empty", dict(qo=i32(), kv=i32()), ValueError, r"qo_indptr"),
    ("kv_float", dict(kv=np.asarray([0.0, 19, 35, 35])), TypeError, r"kv_indptr"),
    ("kv_cuda_float", dict(kv=T((4,), _dtypes.FLOAT32)), TypeError, r"kv_indptr"),
    ("heads_not_divisible", dict(hq=6, hkv=4), ValueError, r"num_qo_heads.*num_kv_heads"),
    ("kv_heads_0", dict(hkv=0), ValueError, r"num_kv_heads"),
    ("head_dim_96", dict(d=96), ValueError, r"head_dim"),
    ("head_dim_32", dict(d=32), ValueError, r"head_dim"),
]


@pytest.mark.parametrize("name,over,exc,pattern", [pytest.param(*c, id=c[0]) for c in RAGGED_BAD])
def test_bad_ragged_plan_arguments(name, over, exc, pattern):
    w = Ragged(WS())
    with pytest.raises(exc, match=pattern):
        w.plan(*ragged_args(**over))
    with pytest.raises(ReachedDriver):
        w.plan(*ragged_args(), causal=True)


OPTION_BAD = [
    ("soft_cap_zero", {"logits_soft_cap": 0.0}, ValueError, r"logits_soft_cap"),
    ("soft_cap_int_zero", {"logits_soft_cap": 0}, ValueError, r"logits_soft_cap"),
    ("soft_cap_negative", {"logits_soft_cap": -1.0}, ValueError, r"logits_soft_cap"),
    ("soft_cap_nan", {"logits_soft_cap": float("nan")}, ValueError, r"logits_soft_cap"),
    ("alibi_with_soft_cap", {"pos_encoding_mode": "ALIBI", "logits_soft_cap": 30.0}, ValueError,
     r"(?i)(alibi.*logits_soft_cap|logits_soft_cap.*alibi)"),
    ("pos_mode_unknown", {"pos_encoding_mode": "ROPE"}, ValueError, r"pos_encoding_mode"),
    ("pos_mode_lowercase", {"pos_encoding_mode": "alibi"}, ValueError, r"pos_encoding_mode"),
    ("rope_theta_zero", {"pos_encoding_mode": "ROPE_LLAMA", "rope_theta": 0.0}, ValueError, r"rope_theta"),
    ("rope_scale_negative", {"pos_encoding_mode": "ROPE_LLAMA", "rope_scale": -2.0}, ValueError, r"rope_scale"),
    ("lse_base_unknown", {"lse_base": "e"}, ValueError, r"lse_base"),
    ("window_below_minus_1", {"window_left": -2}, ValueError, r"window_left"),
    ("window_not_a_number", {"window_left": object()}, TypeError, r"window_left"),
    ("sm_scale_zero", {"sm_scale": 0.0}, ValueError, r"sm_scale"),
    ("sm_scale_negative", {"sm_scale": -0.1}, ValueError, r"sm_scale"),
    ("sm_scale_nan", {"sm_scale": float("nan")}, ValueError, r"sm_scale"),
    ("sm_scale_inf", {"sm_scale": float("inf")}, ValueError, r"sm_scale"),
    ("q_dtype_fp32", {"q_data_type": "float32"}, TypeError, r"q_data_type"),
    ("q_dtype_unknown", {"q_data_type": "float17"}, TypeError, r"float17"),
    ("fp16_qk_reduction", {"allow_fp16_qk_reduction": True}, NotImplementedError, r"allow_fp16_qk_reduction"),
    # K/V in q's dtype or fp8; anything else is a TypeError naming the argument
    ("kv_dtype_mismatch", {"q_data_type": "float16", "kv_data_type": "bfloat16"}, TypeError, r"kv_data_type"),
    ("kv_dtype_fp32", {"kv_data_type": "float32"}, TypeError, r"kv_data_type"),
    ("kv_dtype_int8", {"kv_data_type": "int8"}, TypeError, r"kv_data_type"),
    ("kv_dtype_e8m0", {"kv_data_type": "float8_e8m0fnu"}, TypeError, r"kv_data_type"),
    ("kv_dtype_fnuz", {"kv_data_type": "float8_e4m3fnuz"}, TypeError, r"kv_data_type"),
    ("kv_dtype_unknown", {"kv_data_type": "float9"}, TypeError, r"kv_data_type.*float9"),
    # (an e4m3 q is the fp8 prefill: tests/test_fp8_prefill_host.py)
    ("q_dtype_fp8_kv_default", {"q_data_type": "float8_e5m2"}, TypeError, r"q_data_type"),
    # masks are implemented; they must live on the wrapper's GPU (host arrays are rejected by name)
    ("custom_mask", {"custom_mask": np.ones(5 * 19 + 12 * 0, dtype=bool)}, ValueError, r"custom_mask.*CUDA"),
    ("packed_custom_mask", {"packed_custom_mask": np.ones(16, dtype=np.uint8)}, ValueError,
     r"packed_custom_mask.*CUDA"),
]


@pytest.mark.parametrize("kind", ["paged", "ragged"])
@pytest.mark.parametrize("name,kw,exc,pattern", [pytest.param(*c, id=c[0]) for c in OPTION_BAD])
def test_bad_plan_options(kind, name, kw, exc, pattern):
    w = Paged(WS()) if kind == "paged" else Ragged(WS())
    args = paged_args() if kind == "paged" else ragged_args()
    with pytest.raises(exc, match=pattern):
        w.plan(*args, **kw)
    with pytest.raises(ReachedDriver):
        w.plan(*args, causal=True, logits_soft_cap=30.0)


@pytest.mark.parametrize("kind", ["paged", "ragged"])
@pytest.mark.parametrize("value", [1.5, 2.0, "17"])
def test_non_int_window_left_is_a_type_error(kind, value):
    w = Paged(WS()) if kind == "paged" else Ragged(WS())
    args = paged_args() if kind == "paged" else ragged_args()
    with pytest.raises(TypeError, match="window_left"):
        w.plan(*args, window_left=value)


@pytest.mark.parametrize("cls", [Paged, Ragged])
def test_mask_buffers_are_accepted(cls):
    # the constructor takes FlashInfer's custom_mask_buf / qk_indptr_buf of any capacity ...
    cls(WS(), custom_mask_buf=T((1 << 16,), U8), qk_indptr_buf=T((9,), I32))
    cls(WS(), custom_mask_buf=T((16,), U8))
    cls(WS(), qk_indptr_buf=T((1,), I32))


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_mask_buffers_are_honoured(fake, kind):
    # ... and plan() writes the packed mask and its byte offsets there (the kernel reads them from
    # there). The simulated driver (the `fake` fixture) holds the device memory; for the graph
    # mode and both mask forms see test_batch_masks_host.py::test_user_mask_buffers_receive_the_mask.
    from pyflashattn.testing import fake_driver as fd

    mbuf, qk = fake.dev(64), fake.dev(4 * 4, I32)
    w = (fd.paged if kind == "paged" else fd.ragged)(fake, custom_mask_buf=mbuf, qk_indptr_buf=qk)
    rng = np.random.default_rng(0)
    masks = [rng.random(n) < 0.5 for n in fd.MASK_BITS]
    (fd.plan_paged if kind == "paged" else fd.plan_ragged)(w, custom_mask=fake.dev(np.concatenate(masks), _dtypes.BOOL))
    p = w._engine.attn.params
    assert p.custom_mask == mbuf.args[3] and p.mask_indptr == qk.args[3]
    want = b"".join(np.packbits(m, bitorder="little").tobytes() for m in masks)
    assert fake.read(mbuf.args[3], len(want)).tobytes() == want
    nbytes = [-(-m.size // 8) for m in masks]
    assert list(fake.read(qk.args[3], len(masks) + 1, np.int32)) == [0, *np.cumsum(nbytes)]


@pytest.mark.parametrize("cls", [Paged, Ragged])
@pytest.mark.parametrize("kw, exc, pattern", [
    pytest.param(dict(custom_mask_buf=T((64,), I32)), TypeError, r"custom_mask_buf.*uint8", id="mask_int32"),
    pytest.param(dict(custom_mask_buf=T((64,), _dtypes.BOOL)), TypeError, r"custom_mask_buf", id="mask_bool"),
    pytest.param(dict(custom_mask_buf=T((64,), U8, device=(1, 0))), ValueError, r"custom_mask_buf.*CUDA",
                 id="mask_cpu"),
    pytest.param(dict(custom_mask_buf=T((64,), U8, device=(2, 1))), ValueError, r"custom_mask_buf.*cuda:0",
                 id="mask_other_gpu"),
    pytest.param(dict(custom_mask_buf=T((8, 8), U8)), ValueError, r"custom_mask_buf.*1-D", id="mask_2d"),
    pytest.param(dict(custom_mask_buf=T((64,), U8, strides=(2,))), ValueError, r"custom_mask_buf.*contiguous",
                 id="mask_strided"),
    pytest.param(dict(custom_mask_buf=bytearray(64)), TypeError, r"custom_mask_buf", id="mask_not_a_tensor"),
    pytest.param(dict(qk_indptr_buf=T((16,), U8)), TypeError, r"qk_indptr_buf.*int32", id="qk_uint8"),
    pytest.param(dict(qk_indptr_buf=T((16,), _dtypes.INT64)), TypeError, r"qk_indptr_buf.*int32", id="qk_int64"),
    pytest.param(dict(qk_indptr_buf=T((16,), I32, device=(1, 0))), ValueError, r"qk_indptr_buf.*CUDA",
                 id="qk_cpu"),
    pytest.param(dict(qk_indptr_buf=T((4, 4), I32)), ValueError, r"qk_indptr_buf.*1-D", id="qk_2d"),
])
def test_bad_mask_buffers(cls, kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        cls(WS(), **kw)


# The valid batch has masks of 5*19 + 0*16 + 12*0 = 95 bits (paged) / 5*19 + 0 + 0 (ragged): 12 bytes
MASK_BYTES = 12


@pytest.mark.parametrize("kind", ["paged", "ragged"])
@pytest.mark.parametrize("graph", [False, True])
def test_mask_larger_than_custom_mask_buf_names_it(kind, graph):
    bufs = dict(custom_mask_buf=T((MASK_BYTES - 1,), U8))
    if graph:
        bufs.update(_paged_bufs() if kind == "paged" else dict(qo_indptr_buf=T((9,), I32), kv_indptr_buf=T((9,), I32)))
    w = (Paged if kind == "paged" else Ragged)(WS(), "NHD", graph, **bufs)
    args = paged_args() if kind == "paged" else ragged_args()
    packed = T((64,), U8)
    with pytest.raises(ValueError, match=rf"custom_mask_buf.*{MASK_BYTES - 1}|{MASK_BYTES}.*custom_mask_buf"):
        w.plan(*args, packed_custom_mask=packed)
    with pytest.raises(ValueError, match=r"custom_mask_buf"):
        w.plan(*args, custom_mask=T((95,), _dtypes.BOOL))
    # a mask that fits, and no mask at all, get past validation
    w2 = (Paged if kind == "paged" else Ragged)(WS(), "NHD", graph, **dict(bufs, custom_mask_buf=T((MASK_BYTES,), U8)))
    with pytest.raises(ReachedDriver):
        w2.plan(*args, packed_custom_mask=packed)
    with pytest.raises(ReachedDriver):
        w.plan(*args)


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_qk_indptr_buf_shorter_than_the_batch_names_it(kind):
    w = (Paged if kind == "paged" else Ragged)(WS(), qk_indptr_buf=T((3,), I32))  # batch 3 needs 4
    args = paged_args() if kind == "paged" else ragged_args()
    with pytest.raises(ValueError, match=r"qk_indptr_buf"):
        w.plan(*args, packed_custom_mask=T((64,), U8))
    with pytest.raises(ReachedDriver):  # without a mask the buffer is not used
        w.plan(*args)


@pytest.mark.parametrize("kind", ["paged", "ragged"])
@pytest.mark.parametrize("mask, exc, pattern", [
    pytest.param(lambda: T((95,), I32), TypeError, r"custom_mask.*bool", id="bool_mask_int32"),
    pytest.param(lambda: T((96,), _dtypes.BOOL), ValueError, r"custom_mask.*95", id="bool_mask_length"),
    pytest.param(lambda: T((95,), _dtypes.BOOL, strides=(2,)), ValueError, r"custom_mask.*contiguous",
                 id="bool_mask_strided"),
    pytest.param(lambda: T((95,), _dtypes.BOOL, device=(2, 1)), ValueError, r"custom_mask.*cuda:0",
                 id="bool_mask_other_gpu"),
])
def test_bad_custom_mask(kind, mask, exc, pattern):
    w = Paged(WS()) if kind == "paged" else Ragged(WS())
    args = paged_args() if kind == "paged" else ragged_args()
    with pytest.raises(exc, match=pattern):
        w.plan(*args, custom_mask=mask())
    with pytest.raises(ReachedDriver):
        w.plan(*args, custom_mask=T((95,), _dtypes.BOOL))


@pytest.mark.parametrize("kind", ["paged", "ragged"])
@pytest.mark.parametrize("mask, exc, pattern", [
    pytest.param(lambda: T((64,), _dtypes.BOOL), TypeError, r"packed_custom_mask.*uint8", id="packed_bool"),
    pytest.param(lambda: T((11,), U8), ValueError, r"packed_custom_mask.*11.*12", id="packed_short"),
    pytest.param(lambda: T((8, 8), U8), ValueError, r"packed_custom_mask.*1-D", id="packed_2d"),
])
def test_bad_packed_custom_mask(kind, mask, exc, pattern):
    w = Paged(WS()) if kind == "paged" else Ragged(WS())
    args = paged_args() if kind == "paged" else ragged_args()
    with pytest.raises(exc, match=pattern):
        w.plan(*args, packed_custom_mask=mask())
    with pytest.raises(ReachedDriver):
        w.plan(*args, packed_custom_mask=T((12,), U8))


@pytest.mark.parametrize("cls", [Paged, Ragged])
def test_run_before_plan_raises_whatever_enable_pdl_says(cls):
    w = cls(WS())
    kv = (T((4, 2, 16, 2, 128)),) if cls is Paged else (T((10, 2, 128)), T((10, 2, 128)))
    for pdl in (None, True):
        with pytest.raises(RuntimeError, match="plan"):
            w.run(T((8, 8, 128)), *kv, enable_pdl=pdl)