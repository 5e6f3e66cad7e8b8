"""packbits / segment_packbits on device arrays (the packbits kernel) against numpy.packbits, the
outputs in the caller's framework; the engine's flat launch (the single-prefill mask packer) writes
exactly ceil(n / 8) bytes."""

from __future__ import annotations

import numpy as np
import pytest

from pyflashattn.testing.gpu import require_cupy as _cupy, require_cuda_torch

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()

from pyflashattn._runtime import tensor as _tensor  # noqa: E402
from pyflashattn._engine import packbits as _packbits  # noqa: E402
from pyflashattn.quantization import packbits, segment_packbits  # noqa: E402

SIZES = [0, 1, 7, 8, 9, 1000, 12345]
ORDERS = ("big", "little")
TORCH_DT = {"bool": torch.bool, "uint8": torch.uint8}


def _rand(n, seed, dtype="bool"):
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool)
    return (rng.integers(0, 4, n) * rng.integers(0, 2, n)).astype(np.uint8)  # 0..3: nonzero is 1


def _ref_segments(x, indptr, bitorder):
    x = np.asarray(x) != 0
    parts = [np.packbits(x[a:b], bitorder=bitorder) for a, b in zip(indptr[:-1], indptr[1:])]
    y = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    return y.astype(np.uint8), np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int32)


def _random_indptr(n, seed, max_len=40):
    rng = np.random.default_rng(seed)
    lens = []
    while sum(lens) < n:
        lens.append(int(min(rng.integers(0, max_len), n - sum(lens))) if rng.random() > 0.15 else 0)
    lens += [0, 0]  # trailing empty segments
    lens.insert(0, 0)  # and a leading one
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


# ---------------------------------------------------------------- torch

@pytest.mark.parametrize("bitorder", ORDERS)
@pytest.mark.parametrize("dtype", ["bool", "uint8"])
@pytest.mark.parametrize("n", SIZES)
def test_packbits_torch(n, dtype, bitorder):
    xh = _rand(n, n, dtype)
    x = torch.from_numpy(xh).to("cuda")
    y = packbits(x, bitorder)
    assert isinstance(y, torch.Tensor) and y.is_cuda and y.dtype == torch.uint8
    assert y.device == x.device and tuple(y.shape) == (-(-n // 8),)
    np.testing.assert_array_equal(y.cpu().numpy(), np.packbits(xh != 0, bitorder=bitorder))


def test_packbits_torch_2d_flattens_row_major():
    xh = _rand(37 * 11, 3).reshape(37, 11)
    y = packbits(torch.from_numpy(xh).cuda(), "little")
    np.testing.assert_array_equal(y.cpu().numpy(), np.packbits(xh.reshape(-1), bitorder="little"))


@pytest.mark.parametrize("bitorder", ORDERS)
@pytest.mark.parametrize("dtype", ["bool", "uint8"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("indptr_on", ["numpy", "cuda"])
def test_segment_packbits_torch(n, dtype, bitorder, indptr_on):
    xh = _rand(n, n + 1, dtype)
    indptr = _random_indptr(n, n)
    x = torch.from_numpy(xh).cuda()
    ip = indptr if indptr_on == "numpy" else torch.from_numpy(indptr).cuda()
    y, new = segment_packbits(x, ip, bitorder)
    y_ref, new_ref = _ref_segments(xh, indptr, bitorder)
    assert isinstance(y, torch.Tensor) and y.is_cuda and y.dtype == torch.uint8
    assert isinstance(new, torch.Tensor) and new.is_cuda and new.dtype == torch.int32
    np.testing.assert_array_equal(new.cpu().numpy(), new_ref)
    np.testing.assert_array_equal(y.cpu().numpy(), y_ref)


@pytest.mark.parametrize("bitorder", ORDERS)
def test_segment_packbits_long_and_many_segments(bitorder):
    # A few long segments (several blocks of 256 bytes in x), then > 65535 segments (chunked grid.y).
    lens = [5000, 0, 70001, 3] + [1, 9, 0, 17] * 20000
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    xh = _rand(int(indptr[-1]), 11)
    y, new = segment_packbits(torch.from_numpy(xh).cuda(), indptr, bitorder)
    y_ref, new_ref = _ref_segments(xh, indptr, bitorder)
    np.testing.assert_array_equal(new.cpu().numpy(), new_ref)
    np.testing.assert_array_equal(y.cpu().numpy(), y_ref)


def test_segment_packbits_on_side_stream():
    xh = _rand(999, 5)
    indptr = _random_indptr(999, 5)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.from_numpy(xh).cuda()
        y, new = segment_packbits(x, indptr, "little")
        yp = packbits(x, "little")
    s.synchronize()
    np.testing.assert_array_equal(y.cpu().numpy(), _ref_segments(xh, indptr, "little")[0])
    np.testing.assert_array_equal(yp.cpu().numpy(), np.packbits(xh, bitorder="little"))


def test_torch_bad_inputs():
    x = torch.ones(16, dtype=torch.bool, device="cuda")
    with pytest.raises(TypeError, match="x must be bool or uint8"):
        packbits(x.int())
    with pytest.raises(ValueError, match="x must be contiguous"):
        packbits(torch.ones(8, 8, dtype=torch.bool, device="cuda").t())
    with pytest.raises(ValueError, match="x must be contiguous"):
        segment_packbits(torch.ones(32, dtype=torch.bool, device="cuda")[::2], np.array([0, 16]))
    with pytest.raises(ValueError, match="indptr is on cuda:0 but x is a host array"):
        segment_packbits(np.ones(16, bool), torch.tensor([0, 16], device="cuda"))
    with pytest.raises(ValueError, match="indptr\\[-1\\]"):
        segment_packbits(x, torch.tensor([0, 15], device="cuda"))
    with pytest.raises(ValueError, match="indptr must be non-decreasing"):
        segment_packbits(x, np.array([0, 9, 8, 16]))
    with pytest.raises(ValueError, match="bitorder"):
        packbits(x, "LITTLE")


def test_torch_cpu_tensor_packs_on_host():
    xh = _rand(21, 9)
    y = packbits(torch.from_numpy(xh), "little")
    assert isinstance(y, torch.Tensor) and not y.is_cuda
    np.testing.assert_array_equal(y.numpy(), np.packbits(xh, bitorder="little"))


# ---------------------------------------------------------------- CuPy / JAX (when importable)

@pytest.mark.parametrize("bitorder", ORDERS)
@pytest.mark.parametrize("n", SIZES)
def test_cupy(n, bitorder):
    cupy = _cupy()
    for dtype in ("bool", "uint8"):
        xh = _rand(n, n + 2, dtype)
        x = cupy.asarray(xh)
        y = packbits(x, bitorder)
        assert isinstance(y, cupy.ndarray) and y.dtype == np.uint8
        np.testing.assert_array_equal(cupy.asnumpy(y), np.packbits(xh != 0, bitorder=bitorder))
        indptr = _random_indptr(n, n + 2)
        for ip in (indptr, cupy.asarray(indptr)):
            y, new = segment_packbits(x, ip, bitorder)
            assert isinstance(y, cupy.ndarray) and isinstance(new, cupy.ndarray) and new.dtype == np.int32
            y_ref, new_ref = _ref_segments(xh, indptr, bitorder)
            np.testing.assert_array_equal(cupy.asnumpy(new), new_ref)
            np.testing.assert_array_equal(cupy.asnumpy(y), y_ref)


@pytest.mark.parametrize("bitorder", ORDERS)
def test_jax(bitorder):
    jax = pytest.importorskip("jax")
    try:
        gpu = jax.devices("gpu")[0]
    except Exception:
        pytest.skip("JAX has no GPU backend")
    for n in SIZES:
        xh = _rand(n, n + 3)
        x = jax.device_put(xh, gpu)
        y = packbits(x, bitorder)
        assert isinstance(y, jax.Array)
        np.testing.assert_array_equal(np.asarray(y), np.packbits(xh, bitorder=bitorder))
        indptr = _random_indptr(n, n + 3)
        y, new = segment_packbits(x, indptr, bitorder)
        assert isinstance(y, jax.Array) and isinstance(new, jax.Array)
        y_ref, new_ref = _ref_segments(xh, indptr, bitorder)
        np.testing.assert_array_equal(np.asarray(new), new_ref)
        np.testing.assert_array_equal(np.asarray(y), y_ref)


# ---------------------------------------------------------------- the flat launch (mask packer)

@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 2049, 12345])
@pytest.mark.parametrize("dtype", ["bool", "uint8"])
def test_flat_pack_writes_exactly_ceil_n_over_8(n, dtype):
    extra = 37  # the mask holds more than n elements: only the first n are packed
    mh = _rand(n + extra, n + 4, dtype)
    mask = torch.from_numpy(mh).cuda()
    nbytes = -(-n // 8)
    buf = torch.full((nbytes + 64,), 0xAB, dtype=torch.uint8, device="cuda")
    dev = mask.get_device()
    from pyflashattn._runtime import cuda as _cuda

    _cuda.ensure_context(dev)
    s = _tensor.current_stream("torch", dev)
    _packbits.launch_flat(dev, _tensor.view(mask, "mask").ptr, buf.data_ptr() + 16, n, 1, s)  # at an offset too
    torch.cuda.synchronize()
    got = buf.cpu().numpy()
    assert (got[:16] == 0xAB).all(), "bytes before out_ptr were written"
    np.testing.assert_array_equal(got[16:16 + nbytes], np.packbits(mh[:n] != 0, bitorder="little"))
    assert (got[16 + nbytes:] == 0xAB).all(), "bytes past ceil(n/8) were written"


def test_flat_pack_of_zero_elements_is_a_no_op():
    mask = torch.ones(8, dtype=torch.bool, device="cuda")
    buf = torch.full((8,), 0xAB, dtype=torch.uint8, device="cuda")
    _packbits.launch_flat(mask.get_device(), _tensor.view(mask, "mask").ptr, buf.data_ptr(), 0, 1, 0)
    torch.cuda.synchronize()
    assert (buf.cpu().numpy() == 0xAB).all()
