"""single_prefill input validation, on CPU: every bad input raises ValueError/TypeError naming the
argument before the driver is touched; valid input gets past validation (to a stubbed driver)."""
import pytest

import pyflashattn
from pyflashattn import _cuda, _dtypes
from pyflashattn.testing.fake_tensors import FakeProducer

F16, BF16 = _dtypes.FLOAT16, _dtypes.BFLOAT16


class ReachedDriver(Exception):
    pass


@pytest.fixture(autouse=True)
def no_driver(monkeypatch):
    def stop(_dev):
        raise ReachedDriver

    monkeypatch.setattr(_cuda, "ensure_context", stop)


def T(shape, dtype=F16, strides=None, device=(2, 0), data=0x10000):
    if strides is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    return FakeProducer(shape=tuple(shape), strides=tuple(strides), dtype=dtype, data=data, device=device)


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
    (lambda: qkv(dtype=_dtypes.FLOAT32), {}, TypeError, "q must be float16 or bfloat16"),
    (lambda: (T((16, 8, 128), device=(1, 0)), *qkv()[1:]), {}, ValueError, "q must be a CUDA tensor"),
    (lambda: (qkv()[0], T((32, 2, 128), device=(1, 0)), qkv()[2]), {}, ValueError, "k must be a CUDA tensor"),
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


@pytest.mark.parametrize("kw, option", [
    ({"custom_mask": object()}, "custom_mask"),
    ({"packed_custom_mask": object()}, "custom_mask"),
    ({"pos_encoding_mode": "ALIBI"}, "ALIBI"),
    ({"pos_encoding_mode": "ROPE_LLAMA"}, "ROPE_LLAMA"),
    ({"allow_fp16_qk_reduction": True}, "allow_fp16_qk_reduction"),
    ({"logits_soft_cap": 30.0}, "logits_soft_cap"),
    ({"lse_base": "ln"}, "lse_base"),
])
def test_unimplemented_options_are_rejected_by_name(kw, option):
    with pytest.raises(NotImplementedError, match=option):
        call(*qkv(), **kw)


def test_return_lse_partial_is_the_same_function():
    with pytest.raises(ReachedDriver):
        pyflashattn.single_prefill_with_kv_cache_return_lse(*qkv())
    assert pyflashattn.prefill.single_prefill_with_kv_cache_return_lse.keywords == {"return_lse": True}
