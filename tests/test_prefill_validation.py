"""single_prefill input validation, on CPU: every bad input raises ValueError/TypeError naming the
argument before the driver is touched; valid input gets past validation (to a stubbed driver)."""
import pytest

import pyflashattn
from pyflashattn._runtime import cuda as _cuda, dtypes as _dtypes
from pyflashattn.testing.fake_tensors import fake_cuda_tensor

F16, BF16 = _dtypes.FLOAT16, _dtypes.BFLOAT16


class ReachedDriver(Exception):
    pass


@pytest.fixture(autouse=True)
def no_driver(monkeypatch):
    def stop(_dev):
        raise ReachedDriver

    monkeypatch.setattr(_cuda, "ensure_context", stop)


def T(shape, dtype=F16, strides=None, device=(2, 0), data=0x10000):
    return fake_cuda_tensor(shape, dtype, strides, device, data)


def qkv(qo=16, kv=32, hq=8, hkv=2, d=128, dtype=F16, layout="NHD"):
    kshape = (kv, hkv, d) if layout == "NHD" else (hkv, kv, d)
    return T((qo, hq, d), dtype), T(kshape, dtype, data=0x20000), T(kshape, dtype, data=0x30000)


def call(q, k, v, **kw):
    return pyflashattn.single_prefill_with_kv_cache(q, k, v, **kw)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_valid_input_reaches_the_driver(layout, d):
    with pytest.raises(ReachedDriver):
        call(*qkv(d=d, layout=layout), kv_layout=layout, causal=True)


@pytest.mark.parametrize("args, kw, exc, words", [
    (lambda: (T((16, 8)), *qkv()[1:]), {}, ValueError, "q must be 3-D"),
    (lambda: (*qkv()[:2], T((32, 2, 64))), {}, ValueError, "v must have k's shape"),
    (lambda: (T((16, 8, 96)), T((32, 2, 96)), T((32, 2, 96))), {}, ValueError, "head_dim 96"),
    (lambda: qkv(hq=6, hkv=4), {}, ValueError, "num_qo_heads (6) must be a multiple of num_kv_heads (4)"),
    (lambda: (qkv()[0], T((32, 2, 64)), T((32, 2, 64))), {}, ValueError, "k head_dim 64"),
    (lambda: (qkv()[0], T((32, 2, 128), BF16), T((32, 2, 128), BF16)), {}, TypeError, "k has dtype bfloat16"),
    (lambda: qkv(dtype=_dtypes.FLOAT32), {}, TypeError, "q must be float16, bfloat16 or float8_e4m3fn"),
    (lambda: (T((16, 8, 128), device=(1, 0)), *qkv()[1:]), {}, ValueError,
     "q is on the CPU; pyflashattn needs CUDA tensors"),
    (lambda: (qkv()[0], T((32, 2, 128), device=(1, 0)), qkv()[2]), {}, ValueError,
     "k is on the CPU; pyflashattn needs CUDA tensors"),
    (lambda: (qkv()[0], qkv()[1], T((32, 2, 128), device=(10, 0))), {}, ValueError,
     "v is on rocm:0; pyflashattn needs CUDA tensors"),
    (lambda: qkv(), {"out": T((16, 8, 128), device=(1, 0))}, ValueError, "out is on the CPU"),
    (lambda: qkv(), {"lse": T((16, 8), _dtypes.FLOAT32, device=(1, 0))}, ValueError, "lse is on the CPU"),
    (lambda: (qkv()[0], T((32, 2, 128), device=(2, 1)), qkv()[2]), {}, ValueError, "k is on cuda:1"),
    (lambda: (T((16, 8, 128), strides=(1024, 128, 2)), *qkv()[1:]), {}, ValueError, "contiguous in its last dim"),
    (lambda: (T((16, 8, 128), strides=(1028, 128, 1)), *qkv()[1:]), {}, ValueError, "16-byte aligned"),
    (lambda: (T((16, 8, 128), data=0x10002), *qkv()[1:]), {}, ValueError, "16-byte aligned"),
    (lambda: qkv(qo=64, kv=32), {"causal": True}, ValueError, "kv_len >= qo_len"),
    (lambda: qkv(), {"kv_layout": "NDH"}, ValueError, "kv_layout"),
    (lambda: qkv(), {"window_left": -2}, ValueError, "window_left"),
    (lambda: qkv(), {"window_left": 1.5}, TypeError, "window_left"),
    (lambda: qkv(), {"sm_scale": 0.0}, ValueError, "sm_scale"),
    (lambda: qkv(), {"sm_scale": float("nan")}, ValueError, "sm_scale"),
    (lambda: qkv(), {"pos_encoding_mode": "ROPE"}, ValueError, "pos_encoding_mode"),
    (lambda: qkv(), {"lse_base": "e"}, ValueError, "lse_base"),
    (lambda: qkv(), {"out": T((16, 8, 64))}, ValueError, "out must have shape"),
    (lambda: qkv(), {"out": T((16, 8, 128), BF16)}, TypeError, "out has dtype"),
    (lambda: qkv(), {"lse": T((16, 8), F16)}, ValueError, "lse must be a float32"),
    (lambda: qkv(), {"lse": T((16, 8), _dtypes.FLOAT32, strides=(1, 16))}, ValueError, "lse must be contiguous"),
    (lambda: ([1, 2], *qkv()[1:]), {}, TypeError, "q"),
])
def test_bad_input_names_the_argument(args, kw, exc, words):
    with pytest.raises(exc) as e:
        call(*args(), **kw)
    assert words in str(e.value)
    # the library keeps working after the error
    with pytest.raises(ReachedDriver):
        call(*qkv())


def test_fp16_qk_reduction_is_rejected_by_name():
    # The one documented rejection: QK^T is always reduced in fp32 (FlashInfer's fp16 reduction
    # does not compile in its JIT builds, issue #4297). The other options are implemented now.
    with pytest.raises(NotImplementedError, match="allow_fp16_qk_reduction"):
        call(*qkv(), allow_fp16_qk_reduction=True)
    with pytest.raises(ReachedDriver):  # False is the default and must be accepted
        call(*qkv(), allow_fp16_qk_reduction=False)


# ---------------------------------------------------------------------------------------
# Options (custom / packed mask, window, soft cap, ALiBi, RoPE, lse_base): bad values raise a
# ValueError/TypeError naming the argument before the driver is touched; good ones get past
# validation. q is [16, 8, 128], k/v [32, 2, 128]: a mask is [16, 32] (bool) or >= 64 bytes.
# ---------------------------------------------------------------------------------------
BOOL, U8 = _dtypes.BOOL, _dtypes.UINT8
QO, KV = 16, 32
NEED = -(-QO * KV // 8)  # 64 bytes


def M(shape=(QO, KV), dtype=BOOL, **kw):
    return T(shape, dtype, data=0x50000, **kw)


def P(nbytes=NEED, dtype=U8, **kw):
    return T((nbytes,), dtype, data=0x60000, **kw)


@pytest.mark.parametrize("kw", [
    pytest.param({"custom_mask": M()}, id="bool_mask"),
    pytest.param({"custom_mask": M(), "causal": True}, id="bool_mask_causal_ignored"),
    pytest.param({"packed_custom_mask": P()}, id="packed_exact"),
    pytest.param({"packed_custom_mask": P(NEED + 37)}, id="packed_longer"),
    pytest.param({"custom_mask": M(), "packed_custom_mask": P()}, id="both_masks"),
    pytest.param({"custom_mask": M(), "window_left": 3}, id="mask_and_window"),
    pytest.param({"window_left": 0}, id="window_0"),
    pytest.param({"window_left": 10**6, "causal": True}, id="window_huge"),
    pytest.param({"logits_soft_cap": 30.0}, id="soft_cap"),
    pytest.param({"logits_soft_cap": None}, id="soft_cap_none"),
    pytest.param({"pos_encoding_mode": "ALIBI", "causal": True}, id="alibi"),
    pytest.param({"pos_encoding_mode": "ROPE_LLAMA"}, id="rope_defaults"),
    pytest.param({"pos_encoding_mode": "ROPE_LLAMA", "rope_scale": 2.0, "rope_theta": 5e5}, id="rope_params"),
    pytest.param({"pos_encoding_mode": "ROPE_LLAMA", "rope_scale": 0.25, "rope_theta": 1.5}, id="rope_small"),
    pytest.param({"pos_encoding_mode": "NONE"}, id="pos_none"),
    pytest.param({"lse_base": "ln", "return_lse": True}, id="lse_ln"),
    pytest.param({"lse_base": "log2"}, id="lse_log2"),
    pytest.param({"allow_fp16_qk_reduction": False}, id="fp16_qk_reduction_false"),
    pytest.param({"custom_mask": M(), "logits_soft_cap": 5.0, "window_left": 7, "lse_base": "ln"},
                 id="mask_softcap_window_ln"),
])
def test_valid_options_reach_the_driver(kw):
    with pytest.raises(ReachedDriver):
        call(*qkv(), **kw)


def test_custom_mask_replaces_causal_even_when_kv_shorter_than_qo():
    # causal with kv_len < qo_len is an error only because of causal; with a custom mask causal
    # is ignored (FlashInfer), so the same call is valid.
    q, k, v = qkv(qo=64, kv=32)
    with pytest.raises(ReachedDriver):
        call(q, k, v, causal=True, custom_mask=T((64, 32), BOOL, data=0x50000))
    with pytest.raises(ReachedDriver):
        call(q, k, v, causal=True, packed_custom_mask=P(64 * 32 // 8))


@pytest.mark.parametrize("kw, exc, pattern", [
    # custom_mask: shape, device, dtype, not a tensor
    pytest.param({"custom_mask": M((QO, KV - 1))}, ValueError, r"custom_mask", id="mask_short_kv"),
    pytest.param({"custom_mask": M((QO + 1, KV))}, ValueError, r"custom_mask", id="mask_long_qo"),
    pytest.param({"custom_mask": M((KV, QO))}, ValueError, r"custom_mask", id="mask_transposed"),
    pytest.param({"custom_mask": M((QO * KV,))}, ValueError, r"custom_mask", id="mask_flat"),
    pytest.param({"custom_mask": M((1, QO, KV))}, ValueError, r"custom_mask", id="mask_3d"),
    pytest.param({"custom_mask": M(device=(1, 0))}, ValueError, r"custom_mask", id="mask_cpu"),
    pytest.param({"custom_mask": M(device=(2, 1))}, ValueError, r"custom_mask", id="mask_other_gpu"),
    pytest.param({"custom_mask": M(dtype=F16)}, TypeError, r"custom_mask", id="mask_f16"),
    pytest.param({"custom_mask": M(dtype=_dtypes.INT32)}, TypeError, r"custom_mask", id="mask_i32"),
    pytest.param({"custom_mask": M(dtype=_dtypes.FLOAT32)}, TypeError, r"custom_mask", id="mask_f32"),
    pytest.param({"custom_mask": object()}, TypeError, r"custom_mask", id="mask_not_a_tensor"),
    # packed_custom_mask: length, device, dtype
    pytest.param({"packed_custom_mask": P(NEED - 1)}, ValueError, r"packed_custom_mask", id="packed_short"),
    pytest.param({"packed_custom_mask": P(1)}, ValueError, r"packed_custom_mask", id="packed_1_byte"),
    pytest.param({"packed_custom_mask": P(0)}, ValueError, r"packed_custom_mask", id="packed_empty"),
    pytest.param({"custom_mask": M(), "packed_custom_mask": P(NEED - 1)}, ValueError, r"packed_custom_mask",
                 id="packed_short_wins_over_good_bool"),
    pytest.param({"packed_custom_mask": P(device=(1, 0))}, ValueError, r"packed_custom_mask", id="packed_cpu"),
    pytest.param({"packed_custom_mask": P(device=(2, 1))}, ValueError, r"packed_custom_mask",
                 id="packed_other_gpu"),
    pytest.param({"packed_custom_mask": P(dtype=F16)}, TypeError, r"packed_custom_mask", id="packed_f16"),
    pytest.param({"packed_custom_mask": P(dtype=_dtypes.INT32)}, TypeError, r"packed_custom_mask",
                 id="packed_i32"),
    pytest.param({"packed_custom_mask": object()}, TypeError, r"packed_custom_mask", id="packed_not_a_tensor"),
    # soft cap
    pytest.param({"logits_soft_cap": -1.0}, ValueError, r"logits_soft_cap", id="soft_cap_negative"),
    # An explicit cap <= 0 is an error (the contract; FlashInfer reads 0 as "off"): a
    # zero that slipped in from a config never silently disables capping. None means no cap.
    pytest.param({"logits_soft_cap": 0.0}, ValueError, r"logits_soft_cap", id="soft_cap_zero"),
    pytest.param({"logits_soft_cap": 0}, ValueError, r"logits_soft_cap", id="soft_cap_int_zero"),
    pytest.param({"logits_soft_cap": -1e-3}, ValueError, r"logits_soft_cap", id="soft_cap_tiny_negative"),
    pytest.param({"logits_soft_cap": float("nan")}, ValueError, r"logits_soft_cap", id="soft_cap_nan"),
    # ALiBi + soft cap is ambiguous in FlashInfer (sm_scale applied twice): rejected
    pytest.param({"pos_encoding_mode": "ALIBI", "logits_soft_cap": 30.0}, ValueError,
                 r"(?i)(alibi.*logits_soft_cap|logits_soft_cap.*alibi)", id="alibi_with_soft_cap"),
    pytest.param({"pos_encoding_mode": "ALIBI", "logits_soft_cap": 1.0, "causal": True}, ValueError,
                 r"(?i)(alibi.*logits_soft_cap|logits_soft_cap.*alibi)", id="alibi_with_soft_cap_causal"),
    # RoPE parameters
    pytest.param({"pos_encoding_mode": "ROPE_LLAMA", "rope_theta": -1e4}, ValueError, r"rope_theta",
                 id="rope_theta_negative"),
    pytest.param({"pos_encoding_mode": "ROPE_LLAMA", "rope_theta": 0.0}, ValueError, r"rope_theta",
                 id="rope_theta_zero"),
    pytest.param({"pos_encoding_mode": "ROPE_LLAMA", "rope_scale": 0.0}, ValueError, r"rope_scale",
                 id="rope_scale_zero"),
    pytest.param({"pos_encoding_mode": "ROPE_LLAMA", "rope_scale": -2.0}, ValueError, r"rope_scale",
                 id="rope_scale_negative"),
    pytest.param({"pos_encoding_mode": "ROPE_LLAMA", "rope_theta": float("nan")}, ValueError, r"rope_theta",
                 id="rope_theta_nan"),
    # unknown modes (the names are case-sensitive, as FlashInfer's PosEncodingMode keys)
    pytest.param({"pos_encoding_mode": "rope_llama"}, ValueError, r"pos_encoding_mode", id="mode_lowercase"),
    pytest.param({"pos_encoding_mode": "ROPE_NEOX"}, ValueError, r"pos_encoding_mode", id="mode_unknown"),
    pytest.param({"lse_base": "log10"}, ValueError, r"lse_base", id="lse_base_unknown"),
])
def test_bad_option_names_the_argument_before_the_driver(kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call(*qkv(), **kw)
    # nothing sticky: the next valid call with options gets to the driver
    with pytest.raises(ReachedDriver):
        call(*qkv(), custom_mask=M(), logits_soft_cap=30.0)


def test_return_lse_partial_is_the_same_function():
    with pytest.raises(ReachedDriver):
        pyflashattn.single_prefill_with_kv_cache_return_lse(*qkv())
    assert pyflashattn.prefill.single_prefill_with_kv_cache_return_lse.keywords == {"return_lse": True}


def test_numpy_arrays_are_refused_as_cpu_tensors():
    import numpy as np

    q = np.zeros((16, 8, 128), np.float16)
    with pytest.raises(ValueError) as e:
        call(q, *qkv()[1:])
    assert str(e.value) == "q is on the CPU; pyflashattn needs CUDA tensors"
    with pytest.raises(ValueError) as e:
        call(qkv()[0], np.zeros((32, 2, 128), np.float16), qkv()[2])
    assert str(e.value) == "k is on the CPU; pyflashattn needs CUDA tensors"
