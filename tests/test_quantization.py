"""CPU tests of pyflashattn.quantization: packbits / segment_packbits on host arrays against
numpy.packbits per segment, and input validation (device inputs impersonated by fake DLPack
producers, which only reach validation: every error is raised before the driver is touched).
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyflashattn._runtime import dtypes as _dtypes
from pyflashattn.quantization import packbits, segment_packbits
from pyflashattn.testing.fake_tensors import FakeProducer

ORDERS = ("big", "little")


def _ref_segments(x, indptr, bitorder):
    x = np.asarray(x).reshape(-1) != 0
    parts = [np.packbits(x[a:b], bitorder=bitorder) for a, b in zip(indptr[:-1], indptr[1:])]
    lens = [len(p) for p in parts]
    y = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    return y.astype(np.uint8), np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _check_segments(x, indptr, bitorder):
    y, new = segment_packbits(x, indptr, bitorder)
    y_ref, new_ref = _ref_segments(x, indptr, bitorder)
    assert isinstance(y, np.ndarray) and y.dtype == np.uint8 and y.ndim == 1
    assert isinstance(new, np.ndarray) and new.dtype == np.int32
    np.testing.assert_array_equal(new, new_ref)
    np.testing.assert_array_equal(y, y_ref)


# ---------------------------------------------------------------- packbits

@pytest.mark.parametrize("bitorder", ORDERS)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 1000, 12345])
def test_packbits_matches_numpy(n, bitorder):
    x = np.random.default_rng(n).integers(0, 2, n).astype(bool)
    y = packbits(x, bitorder)
    assert y.dtype == np.uint8 and y.shape == (-(-n // 8),)
    np.testing.assert_array_equal(y, np.packbits(x, bitorder=bitorder))


def test_packbits_default_is_big_and_orders_differ():
    x = np.array([1, 0, 0, 0, 0, 0, 0, 0, 1], dtype=bool)
    np.testing.assert_array_equal(packbits(x), [0x80, 0x80])
    np.testing.assert_array_equal(packbits(x, "little"), [0x01, 0x01])


@pytest.mark.parametrize("dtype", [np.bool_, np.uint8, np.int32, np.int64, np.float32, np.float64])
def test_packbits_any_dtype_nonzero_is_one(dtype):
    rng = np.random.default_rng(1)
    vals = rng.integers(-3, 4, (5, 7)).astype(dtype)  # includes negatives (for signed) and zeros
    for bitorder in ORDERS:
        np.testing.assert_array_equal(packbits(vals, bitorder),
                                      np.packbits((vals != 0).reshape(-1), bitorder=bitorder))


def test_packbits_flattens_row_major_and_accepts_lists():
    x = np.array([[1, 1, 0], [0, 0, 1], [1, 0, 1]], dtype=np.uint8)
    np.testing.assert_array_equal(packbits(x, "little"), np.packbits(x.reshape(-1), bitorder="little"))
    np.testing.assert_array_equal(packbits(x.T, "big"), np.packbits(x.T.reshape(-1)))  # non-contiguous
    np.testing.assert_array_equal(packbits([[1, 0], [1, 1]], "big"), [0b10110000])
    np.testing.assert_array_equal(packbits([0.5, 0.0, np.nan], "little"), [0b101])


@settings(max_examples=60, deadline=None)
@given(bits=st.lists(st.booleans(), max_size=100), bitorder=st.sampled_from(ORDERS))
def test_packbits_property(bits, bitorder):
    x = np.array(bits, dtype=bool)
    np.testing.assert_array_equal(packbits(x, bitorder), np.packbits(x, bitorder=bitorder))


# ---------------------------------------------------------------- segment_packbits

@pytest.mark.parametrize("bitorder", ORDERS)
def test_segments_with_empties_and_odd_lengths(bitorder):
    lens = [0, 3, 0, 0, 8, 9, 1, 0, 16, 17, 7, 0]
    indptr = np.concatenate([[0], np.cumsum(lens)])
    x = np.random.default_rng(2).integers(0, 2, indptr[-1]).astype(bool)
    _check_segments(x, indptr, bitorder)


@pytest.mark.parametrize("bitorder", ORDERS)
@pytest.mark.parametrize("seed", range(8))
def test_segments_random(seed, bitorder):
    rng = np.random.default_rng(seed)
    nseg = int(rng.integers(0, 300))
    lens = rng.integers(0, 3 if seed % 2 else 100, nseg)  # many tiny segments, or fewer long ones
    lens[rng.random(nseg) < 0.2] = 0
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64 if seed % 3 else np.int32)
    x = rng.integers(0, 3, int(indptr[-1])).astype(np.uint8)  # values 0..2: nonzero is 1
    _check_segments(x, indptr, bitorder)


@pytest.mark.parametrize("bitorder", ORDERS)
def test_segments_all_whole_bytes(bitorder):
    indptr = np.array([0, 8, 8, 32, 40])
    x = np.random.default_rng(3).integers(0, 2, 40).astype(bool)
    _check_segments(x, indptr, bitorder)


def test_segments_zero_segments_and_one_segment():
    y, new = segment_packbits(np.zeros(0, bool), np.array([0]))
    assert y.shape == (0,) and y.dtype == np.uint8
    np.testing.assert_array_equal(new, [0])
    assert new.dtype == np.int32
    x = np.random.default_rng(4).integers(0, 2, 29).astype(bool)
    for bitorder in ORDERS:
        y, new = segment_packbits(x, [0, 29], bitorder)
        np.testing.assert_array_equal(y, packbits(x, bitorder))
        np.testing.assert_array_equal(new, [0, 4])


def test_segments_nonzero_start_skips_the_prefix():
    x = np.random.default_rng(5).integers(0, 2, 30).astype(bool)
    indptr = np.array([5, 12, 30])
    _check_segments(x, indptr, "little")
    y, new = segment_packbits(x, indptr, "little")
    np.testing.assert_array_equal(new, [0, 1, 4])


def test_segment_is_what_attention_masks_need():
    """FlashInfer's mask lookup: keep = (byte[idx >> 3] >> (idx & 7)) & 1 within a request."""
    rng = np.random.default_rng(6)
    shapes = [(3, 5), (4, 4), (1, 9)]
    masks = [rng.integers(0, 2, s).astype(bool) for s in shapes]
    indptr = np.concatenate([[0], np.cumsum([m.size for m in masks])])
    y, new = segment_packbits(np.concatenate([m.reshape(-1) for m in masks]), indptr, "little")
    for r, m in enumerate(masks):
        seg = y[new[r]:new[r + 1]]
        kv_len = m.shape[1]
        for qi in range(m.shape[0]):
            for ki in range(kv_len):
                idx = qi * kv_len + ki
                assert bool((seg[idx >> 3] >> (idx & 7)) & 1) == m[qi, ki]


@settings(max_examples=80, deadline=None)
@given(lens=st.lists(st.integers(0, 40), max_size=30), bitorder=st.sampled_from(ORDERS),
       seed=st.integers(0, 2**32 - 1))
def test_segments_property(lens, bitorder, seed):
    indptr = np.concatenate([[0], np.cumsum(lens, dtype=np.int64)])
    x = np.random.default_rng(seed).integers(0, 2, int(indptr[-1])).astype(bool)
    _check_segments(x, indptr, bitorder)


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("bad", ["BIG", "Little", None, 0, "msb"])
def test_bad_bitorder(bad):
    with pytest.raises(ValueError, match="bitorder"):
        packbits(np.ones(3, bool), bad)
    with pytest.raises(ValueError, match="bitorder"):
        segment_packbits(np.ones(3, bool), [0, 3], bad)


@pytest.mark.parametrize("indptr, exc, what", [
    (np.array([[0, 3]]), ValueError, "1-D"),
    (np.array([], dtype=np.int64), ValueError, "entries"),
    (np.array([0, 2, 1, 3]), ValueError, "non-decreasing"),
    (np.array([0, 2]), ValueError, "x.size"),
    (np.array([0, 4]), ValueError, "x.size"),
    (np.array([-1, 3]), ValueError, "indptr\\[0\\]"),
    (np.array([0.0, 3.0]), TypeError, "integer"),
    (np.array([False, True]), TypeError, "integer"),
])
def test_bad_indptr(indptr, exc, what):
    with pytest.raises(exc, match="indptr") as e:
        segment_packbits(np.ones(3, bool), indptr)
    assert e.match(what)


def test_segment_x_must_be_1d():
    with pytest.raises(ValueError, match="x must be 1-D"):
        segment_packbits(np.ones((2, 3), bool), [0, 6])


# Fake CUDA producers: validation must reject them before any driver call.
def _fake(shape=(16,), strides=None, dtype=_dtypes.BOOL, device=(2, 0)):
    if strides is None:
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    return FakeProducer(shape=shape, strides=strides, dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [_dtypes.INT32, _dtypes.FLOAT16, _dtypes.INT8])
def test_device_dtype_must_be_bool_or_uint8(dtype):
    with pytest.raises(TypeError, match="x must be bool or uint8"):
        packbits(_fake(dtype=dtype))
    with pytest.raises(TypeError, match="x must be bool or uint8"):
        segment_packbits(_fake(dtype=dtype), np.array([0, 16]))


def test_device_input_must_be_contiguous():
    with pytest.raises(ValueError, match="x must be contiguous"):
        packbits(_fake(shape=(4, 4), strides=(1, 4)))
    with pytest.raises(ValueError, match="x must be contiguous"):
        segment_packbits(_fake(shape=(16,), strides=(2,)), np.array([0, 16]))


def test_device_input_other_framework_rejected():
    with pytest.raises(TypeError, match="x: CUDA arrays of framework 'other'"):
        packbits(_fake())


def test_device_segment_validation_before_driver():
    with pytest.raises(ValueError, match="x must be 1-D"):
        segment_packbits(_fake(shape=(4, 4)), np.array([0, 16]))
    with pytest.raises(ValueError, match="indptr\\[-1\\]"):
        segment_packbits(_fake(), np.array([0, 15]))
    with pytest.raises(ValueError, match="indptr must be non-decreasing"):
        segment_packbits(_fake(), np.array([0, 9, 8, 16]))


def test_host_device_mismatch():
    # host x with a CUDA indptr
    with pytest.raises(ValueError, match="indptr is on cuda:0 but x is a host array"):
        segment_packbits(np.ones(16, bool), _fake(dtype=_dtypes.INT32))
    # CUDA x with indptr on another CUDA device
    with pytest.raises(ValueError, match="indptr is on cuda:1"):
        segment_packbits(_fake(), _fake(dtype=_dtypes.INT32, device=(2, 1)))
    # a device that is neither host nor CUDA
    with pytest.raises(ValueError, match="x must be a host array or a CUDA tensor"):
        packbits(_fake(device=(10, 0)))
