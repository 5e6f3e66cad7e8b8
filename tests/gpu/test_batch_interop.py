"""The batch prefill wrappers with CuPy and JAX inputs: same answer as torch, caller's framework out.

q / K / V are generated once in torch and moved as raw bits, so every framework feeds the kernel
bit-identical inputs and must get bit-identical outputs (one plan, one kernel); each result is
also held to the float64 reference, so agreement on a wrong answer cannot pass. Index arrays go
in as numpy, CuPy and JAX arrays (a device index array is copied to the host by plan(), ordered
after its producer's writes). JAX has no current stream: the library launches on its own stream
and the DLPack handshake orders it after JAX's writes and JAX's reads after the kernel.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from pyflashattn.testing.gpu import require_cuda_torch

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()

import pyflashattn  # noqa: E402
from pyflashattn._runtime import dtypes as _dtypes, tensor as _tensor  # noqa: E402
from pyflashattn.testing import attention_ref, to_numpy_f64  # noqa: E402
from pyflashattn.testing.frameworks import bits, jax_gpu, to_cupy, to_jax  # noqa: E402
from pyflashattn.testing.checks import assert_close  # noqa: E402

DEV = "cuda"
TORCH_DT = {"fp16": torch.float16, "bf16": torch.bfloat16}
O_TOL = {"fp16": dict(atol=1e-3, rtol=1e-3), "bf16": dict(atol=1e-2, rtol=1e-2)}
LSE_TOL = {"fp16": dict(atol=2e-3, rtol=1e-4), "bf16": dict(atol=1e-2, rtol=1e-4)}
HQ, HKV, D, PS = 16, 4, 128, 16
QO = [37, 0, 5, 120, 1]
KV = [250, 40, 5, 700, 0]


def _seed(*key):
    return zlib.crc32(repr(key).encode())


def _indptr(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _problem(kind, dtype):
    """torch q, the KV argument(s) (ragged k, v or a paged 5-D cache) and the numpy plan arrays."""
    dt = TORCH_DT[dtype]
    g = torch.Generator(device=DEV).manual_seed(_seed(kind, dtype))
    qi, ki = _indptr(QO), _indptr(KV)
    q = torch.randn((int(qi[-1]), HQ, D), device=DEV, generator=g).to(dt)
    k = torch.randn((int(ki[-1]), HKV, D), device=DEV, generator=g).to(dt)
    v = torch.randn((int(ki[-1]), HKV, D), device=DEV, generator=g).to(dt)
    if kind == "ragged":
        return q, (k, v), (k, v), [qi, ki]
    pages = [-(-n // PS) for n in KV]
    pin = _indptr(pages)
    n_pages = int(pin[-1]) + 3
    perm = np.random.default_rng(_seed("perm", dtype)).permutation(n_pages).astype(np.int32)
    indices = perm[:int(pin[-1])]
    last = np.asarray([n - (p - 1) * PS if p else 0 for n, p in zip(KV, pages)], np.int32)
    cache = (torch.randn((n_pages, 2, PS, HKV, D), device=DEV, generator=g) * 4).to(dt)
    tok_page = np.concatenate([indices[pin[i] + np.arange(n) // PS] for i, n in enumerate(KV)]).astype(np.int64)
    tok_slot = np.concatenate([np.arange(n) % PS for n in KV]).astype(np.int64)
    tp, ts = torch.as_tensor(tok_page, device=DEV), torch.as_tensor(tok_slot, device=DEV)
    cache[:, 0][tp, ts] = k
    cache[:, 1][tp, ts] = v
    return q, (cache,), (k, v), [qi, pin, indices, last]


def _wrapper(kind):
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    if kind == "ragged":
        return pyflashattn.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    return pyflashattn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")


def _plan(w, kind, arrays, dtype, **kw):
    tail = (HQ, HKV, D) if kind == "ragged" else (HQ, HKV, D, PS)
    w.plan(*arrays, *tail, causal=True, q_data_type=TORCH_DT[dtype], **kw)


def _check_ref(o, lse, q, kv_tok, dtype, what):
    k, v = kv_tok
    qi, ki = _indptr(QO), _indptr(KV)
    o_np, lse_np = to_numpy_f64(o), to_numpy_f64(lse)
    for i in range(len(QO)):
        if QO[i] == 0:
            continue
        o_ref, lse_ref = attention_ref(q[qi[i]:qi[i + 1]], k[ki[i]:ki[i + 1]], v[ki[i]:ki[i + 1]], causal=True)
        assert_close(o_np[qi[i]:qi[i + 1]], o_ref, what=f"{what} req {i} o", **O_TOL[dtype])
        assert_close(lse_np[qi[i]:qi[i + 1]], lse_ref, what=f"{what} req {i} lse", **LSE_TOL[dtype])


def _torch_result(kind, dtype):
    q, kv_args, kv_tok, arrays = _problem(kind, dtype)
    w = _wrapper(kind)
    _plan(w, kind, arrays, dtype)
    o, lse = w.run(q, *kv_args, return_lse=True)
    torch.cuda.synchronize()
    return q, kv_args, kv_tok, arrays, o, lse




# ---------------------------------------------------------------------------------------
# CuPy
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("index_fw", ["numpy", "cupy"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_cupy_inputs(kind, dtype, index_fw):
    cupy = pytest.importorskip("cupy")
    q_t, kv_t, kv_tok, arrays, o_t, lse_t = _torch_result(kind, dtype)
    q = to_cupy(cupy, q_t, dtype)
    kv = [to_cupy(cupy, t, dtype) for t in kv_t]
    if index_fw == "cupy":
        arrays = [cupy.asarray(a) for a in arrays]
    w = _wrapper(kind)
    _plan(w, kind, arrays, dtype)
    o, lse = w.run(q, *kv, return_lse=True)
    cupy.cuda.get_current_stream().synchronize()
    assert isinstance(o, cupy.ndarray) and isinstance(lse, cupy.ndarray)
    assert o.dtype == q.dtype and o.shape == q.shape and lse.dtype == np.float32
    assert o.device.id == q.device.id
    assert np.array_equal(o.view(cupy.uint16).get(), bits(o_t)), "cupy and torch o differ"
    assert np.array_equal(lse.get(), lse_t.cpu().numpy()), "cupy and torch lse differ"
    _check_ref(o_t, lse.get(), q_t, kv_tok, dtype, "cupy (bitwise the torch o)")

    # out= / lse= as CuPy buffers, poisoned first: written in place and returned
    out = cupy.empty_like(q)
    out.view(cupy.uint16).fill(0x7E00 if dtype == "fp16" else 0x7FC0)  # quiet NaN bits
    lse_buf = cupy.full(lse.shape, np.nan, dtype=np.float32)
    r_o, r_lse = w.run(q, *kv, out=out, lse=lse_buf, return_lse=True)
    cupy.cuda.get_current_stream().synchronize()
    assert r_o is out and r_lse is lse_buf
    assert np.array_equal(out.view(cupy.uint16).get(), bits(o_t))
    assert np.array_equal(lse_buf.get(), lse_t.cpu().numpy())


def test_cupy_on_a_non_default_stream():
    # CuPy's current stream is where run() launches; inputs written on it are ordered before
    cupy = pytest.importorskip("cupy")
    q_t, kv_t, kv_tok, arrays, o_t, lse_t = _torch_result("ragged", "fp16")
    w = _wrapper("ragged")
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        q = to_cupy(cupy, q_t, "fp16")
        kv = [to_cupy(cupy, t, "fp16") for t in kv_t]
        _plan(w, "ragged", [cupy.asarray(a) for a in arrays], "fp16")
        o, lse = w.run(q, *kv, return_lse=True)
        s.synchronize()
    assert np.array_equal(o.view(cupy.uint16).get(), bits(o_t))
    assert np.array_equal(lse.get(), lse_t.cpu().numpy())


# ---------------------------------------------------------------------------------------
# JAX
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("index_fw", ["numpy", "jax"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_jax_inputs(kind, dtype, index_fw):
    jax, jnp, gpu = jax_gpu()
    jdt = jnp.float16 if dtype == "fp16" else jnp.bfloat16
    q_t, kv_t, kv_tok, arrays, o_t, lse_t = _torch_result(kind, dtype)
    q = to_jax(jax, jnp, gpu, q_t, jdt)
    kv = [to_jax(jax, jnp, gpu, t, jdt) for t in kv_t]
    if index_fw == "jax":
        arrays = [jax.device_put(jnp.asarray(a), gpu) for a in arrays]
    w = _wrapper(kind)
    _plan(w, kind, arrays, dtype)
    o, lse = w.run(q, *kv, return_lse=True)
    assert isinstance(o, jax.Array) and isinstance(lse, jax.Array)
    assert o.dtype == jdt and o.shape == q.shape and lse.dtype == jnp.float32
    assert gpu in o.devices() and gpu in lse.devices()
    o_bits = np.asarray(jax.lax.bitcast_convert_type(o, jnp.uint16))
    assert np.array_equal(o_bits, bits(o_t)), "jax and torch o differ"
    assert np.array_equal(np.asarray(lse), lse_t.cpu().numpy()), "jax and torch lse differ"
    _check_ref(o_t, np.asarray(lse), q_t, kv_tok, dtype, "jax")
    # a second run on the same plan (the output buffers are fresh JAX arrays each time)
    o2 = w.run(q, *kv)
    assert np.array_equal(np.asarray(jax.lax.bitcast_convert_type(o2, jnp.uint16)), bits(o_t))


def test_jax_inputs_computed_right_before_the_call():
    # Inputs produced by a JAX computation still in flight: the handshake must order the kernel
    # after it (a missing wait reads stale or partial data and gives another answer than torch).
    jax, jnp, gpu = jax_gpu()
    q_t, kv_t, kv_tok, arrays, o_t, lse_t = _torch_result("ragged", "bf16")
    q0 = to_jax(jax, jnp, gpu, q_t, jnp.bfloat16)
    k0, v0 = (to_jax(jax, jnp, gpu, t, jnp.bfloat16) for t in kv_t)
    big = jax.device_put(jnp.ones((4096, 4096), jnp.float32), gpu)
    w = _wrapper("ragged")
    _plan(w, "ragged", arrays, "bf16")
    for _ in range(3):
        # (x @ big)[0, 0] * 0 is 0 but takes a while: q/k/v are written after a long kernel
        z = (big @ big)[0, 0] * 0
        q = (q0.astype(jnp.float32) + z).astype(jnp.bfloat16)
        k = (k0.astype(jnp.float32) + z).astype(jnp.bfloat16)
        v = (v0.astype(jnp.float32) + z).astype(jnp.bfloat16)
        o = w.run(q, k, v)
        assert np.array_equal(np.asarray(jax.lax.bitcast_convert_type(o, jnp.uint16)), bits(o_t))


def test_jax_fp8_kv():
    jax, jnp, gpu = jax_gpu()
    if not hasattr(jnp, "float8_e4m3fn") or not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8_e4m3fn in this JAX / torch")
    q_t, kv_t, kv_tok, arrays = _problem("paged", "fp16")
    cache8 = (kv_t[0].float() / 4).to(torch.float8_e4m3fn)  # |x| < 448 after the scale
    w = _wrapper("paged")
    _plan(w, "paged", arrays, "fp16", kv_data_type="float8_e4m3fn")
    o_t, lse_t = w.run(q_t, cache8, k_scale=4.0, v_scale=4.0, return_lse=True)
    torch.cuda.synchronize()
    q = to_jax(jax, jnp, gpu, q_t, jnp.float16)
    c = jax.lax.bitcast_convert_type(jax.device_put(jnp.asarray(bits(cache8)), gpu), jnp.float8_e4m3fn)
    try:
        exported = _tensor.view(c, "probe").dtype
    except Exception as e:  # noqa: BLE001 - a JAX that cannot export fp8 through DLPack
        pytest.skip(f"this JAX cannot export float8_e4m3fn through DLPack: {type(e).__name__}: {e}")
    if exported is not _dtypes.FLOAT8_E4M3:
        pytest.skip(f"this JAX exports float8_e4m3fn through DLPack as {exported.name}")
    o, lse = w.run(q, c, k_scale=4.0, v_scale=4.0, return_lse=True)
    assert np.array_equal(np.asarray(jax.lax.bitcast_convert_type(o, jnp.uint16)), bits(o_t))
    assert np.array_equal(np.asarray(lse), lse_t.cpu().numpy())
    # and the torch result is right: the reference on the dequantised cache of the same bits
    pages = [-(-n // PS) for n in KV]
    pin = _indptr(pages)
    wide = cache8.float().cpu().double().numpy() * 4.0
    k_tok = np.concatenate([wide[arrays[2][pin[i] + np.arange(n) // PS], 0, np.arange(n) % PS]
                            for i, n in enumerate(KV)])
    v_tok = np.concatenate([wide[arrays[2][pin[i] + np.arange(n) // PS], 1, np.arange(n) % PS]
                            for i, n in enumerate(KV)])
    _check_ref(o_t, lse_t, q_t, (k_tok, v_tok), "fp16", "jax fp8")
