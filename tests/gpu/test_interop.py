"""The same prefill problem through torch, CuPy and JAX: same answer, caller's framework out.

All three frameworks get bit-identical 16-bit inputs (rounded once in torch, then moved as raw
bits), so the library must return bit-identical outputs: one kernel, one input. Each is also
held to the float64 reference, so agreement on a wrong answer cannot pass.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from pyflashattn.testing.gpu import require_cuda_torch

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()

import pyflashattn  # noqa: E402
from pyflashattn.testing import attention_ref, to_numpy_f64  # noqa: E402
from pyflashattn.testing.checks import assert_close  # noqa: E402
from pyflashattn.testing.frameworks import bits, jax_gpu, to_cupy, to_jax  # noqa: E402

O_TOL = {"fp16": dict(atol=1e-3, rtol=1e-3), "bf16": dict(atol=1e-2, rtol=1e-2)}
LSE_TOL = {"fp16": dict(atol=2e-3, rtol=1e-4), "bf16": dict(atol=1e-2, rtol=1e-4)}
TORCH_DT = {"fp16": torch.float16, "bf16": torch.bfloat16}

CASES = [  # qo_len, kv_len, hq, hkv, d, causal, layout
    (37, 250, 16, 4, 128, True, "NHD"),
    (128, 128, 8, 8, 64, False, "HND"),
    (5, 3000, 8, 1, 256, False, "NHD"),
]


def _problem(case, dtype):
    qo_len, kv_len, hq, hkv, d, causal, layout = case
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((case, dtype)).encode()))
    kshape = (kv_len, hkv, d) if layout == "NHD" else (hkv, kv_len, d)
    return [torch.randn(s, device="cuda", generator=g).to(TORCH_DT[dtype])
            for s in ((qo_len, hq, d), kshape, kshape)]




def _check(o, lse, ref, dtype, what):
    o_ref, lse_ref = ref
    for name, got, want, tol in (("o", o, o_ref, O_TOL[dtype]), ("lse", lse, lse_ref, LSE_TOL[dtype])):
        a = to_numpy_f64(got)
        assert a.shape == want.shape, f"{what} {name}: shape {a.shape} != {want.shape}"
        assert not np.isnan(a).any(), f"{what} {name}: NaN in output"
        np.testing.assert_allclose(a, want, err_msg=f"{what} {name}", **tol)


def _ref(q, k, v, case):
    return attention_ref(q, k, v, causal=case[5], kv_layout=case[6])


def _torch_result(q, k, v, case):
    o, lse = pyflashattn.single_prefill_with_kv_cache_return_lse(
        q, k, v, causal=case[5], kv_layout=case[6])
    torch.cuda.synchronize()
    return o, lse


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "q{}-kv{}-h{}_{}-d{}-{}-{}".format(*c))
def test_torch(case, dtype):
    q, k, v = _problem(case, dtype)
    o, lse = _torch_result(q, k, v, case)
    assert isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert o.is_cuda and o.dtype == q.dtype and lse.dtype == torch.float32
    _check(o, lse, _ref(q, k, v, case), dtype, "torch")




@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "q{}-kv{}-h{}_{}-d{}-{}-{}".format(*c))
def test_cupy(case, dtype):
    cupy = pytest.importorskip("cupy")
    qt, kt, vt = _problem(case, dtype)
    q, k, v = (to_cupy(cupy, t, dtype) for t in (qt, kt, vt))
    o, lse = pyflashattn.single_prefill_with_kv_cache_return_lse(
        q, k, v, causal=case[5], kv_layout=case[6])
    cupy.cuda.get_current_stream().synchronize()
    assert isinstance(o, cupy.ndarray) and isinstance(lse, cupy.ndarray)
    assert o.dtype == q.dtype and lse.dtype == np.float32 and o.shape == q.shape
    ref = _ref(qt, kt, vt, case)
    _check(o, lse, ref, dtype, "cupy")
    o_t, lse_t = _torch_result(qt, kt, vt, case)
    assert np.array_equal(o.view(cupy.uint16).get(), bits(o_t)), "cupy and torch o differ"
    assert np.array_equal(lse.get(), lse_t.cpu().numpy()), "cupy and torch lse differ"

    # out=/lse= with CuPy buffers, poisoned first
    out = cupy.empty_like(q)
    out.view(cupy.uint16).fill(0x7E00 if dtype == "fp16" else 0x7FC0)  # quiet NaN bits
    lse_buf = cupy.full(lse.shape, np.nan, dtype=np.float32)
    r_o, r_lse = pyflashattn.single_prefill_with_kv_cache(
        q, k, v, causal=case[5], kv_layout=case[6], out=out, lse=lse_buf, return_lse=True)
    cupy.cuda.get_current_stream().synchronize()
    assert r_o is out and r_lse is lse_buf
    assert np.array_equal(out.view(cupy.uint16).get(), bits(o_t))
    assert np.array_equal(lse_buf.get(), lse_t.cpu().numpy())


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "q{}-kv{}-h{}_{}-d{}-{}-{}".format(*c))
def test_jax(case, dtype):
    jax, jnp, gpu = jax_gpu()
    qt, kt, vt = _problem(case, dtype)
    jdt = jnp.float16 if dtype == "fp16" else jnp.bfloat16

    q, k, v = (to_jax(jax, jnp, gpu, t, jdt) for t in (qt, kt, vt))
    o, lse = pyflashattn.single_prefill_with_kv_cache_return_lse(
        q, k, v, causal=case[5], kv_layout=case[6])
    assert isinstance(o, jax.Array) and isinstance(lse, jax.Array)
    assert o.dtype == jdt and lse.dtype == jnp.float32 and o.shape == q.shape
    assert gpu in o.devices()
    ref = _ref(qt, kt, vt, case)
    _check(o, lse, ref, dtype, "jax")
    o_t, lse_t = _torch_result(qt, kt, vt, case)
    o_bits = np.asarray(jax.lax.bitcast_convert_type(o, jnp.uint16))
    assert np.array_equal(o_bits, bits(o_t)), "jax and torch o differ"
    assert np.array_equal(np.asarray(lse), lse_t.cpu().numpy()), "jax and torch lse differ"


def test_failed_launch_raises_and_the_library_keeps_working():
    """A launch the driver refuses raises CudaError naming the kernel, its grid and the driver's
    error; later calls work (the refused launch left no state behind)."""
    from pyflashattn._runtime import cuda as _cuda, registry as _registry

    q = torch.randn(33, 8, 128, dtype=torch.float16, device="cuda")
    o = pyflashattn.single_prefill_with_kv_cache(q, q, q)
    la = _registry.launcher("merge", torch.cuda.current_device(), dtype="f16")
    with pytest.raises(_cuda.CudaError, match=r"launch of .*merge.*grid=\(0, 1, 1\).*CUDA_ERROR_INVALID_VALUE"):
        la.launch((0, 1, 1), torch.cuda.current_stream().cuda_stream)  # an empty grid: refused by the driver
    o2 = pyflashattn.single_prefill_with_kv_cache(q, q, q)
    torch.cuda.synchronize()
    assert torch.equal(o, o2)


# ---- TRT-LLM's packed layouts: Q / K / V are views into one caller tensor --------------------------
def _packed_problem(layout):
    """(qkv in torch, cum lens, seq lens, the float64 reference): two requests
    of 70 and 129 tokens, 8 heads (PACKED_QKV) or 8 / 2 (CONTIGUOUS_Q_KV), hd128, bf16, causal."""
    from pyflashattn.testing.reference import trtllm_request_ref

    lens, hkv = [70, 129], (8 if layout == "PACKED_QKV" else 2)
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(layout.encode()))
    n = sum(lens)
    q = torch.randn(n, 8, 128, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(n, hkv, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    qkv = torch.stack([q, k, v], 1) if layout == "PACKED_QKV" else (q, torch.stack([k, v], 1))
    cum = torch.tensor([0, lens[0], n], dtype=torch.int32, device="cuda")
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ref = np.concatenate([trtllm_request_ref(*(to_numpy_f64(x[a:b]) for x in (q, k, v)), 1 / np.sqrt(128), 1.0,
                                             True, -1, 0, None, None, None)[0]
                          for a, b in ((0, lens[0]), (lens[0], n))])
    return qkv, cum, sl, ref


def _fmha_packed(qkv, layout, cum, sl, ws, out=None):
    return pyflashattn.prefill.trtllm_fmha_v2_prefill(qkv, layout, ws, sl, 129, 129, 1 / np.sqrt(128), 1.0, 2, cum,
                                                      cum, out=out)


@pytest.mark.parametrize("layout", ["PACKED_QKV", "CONTIGUOUS_Q_KV"])
@pytest.mark.parametrize("fw", ["cupy", "jax"])
def test_trtllm_packed_layouts_in_cupy_and_jax(layout, fw):
    """The packed tensor's K / V halves are views of the caller's tensor (a JAX slice would copy
    them: pyflashattn views it once): the same bits as torch's result, and the reference."""
    qkv_t, cum_t, sl_t, ref = _packed_problem(layout)
    ws_t = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    q_t = qkv_t[:, 0] if layout == "PACKED_QKV" else qkv_t[0]
    o_t = _fmha_packed(qkv_t, layout, cum_t, sl_t, ws_t, out=torch.full_like(q_t, float("nan")))
    assert_close(to_numpy_f64(o_t), ref, atol=1e-2, rtol=1e-2, what=f"torch {layout}")
    want = bits(o_t)
    torch.cuda.synchronize()
    parts = [qkv_t] if layout == "PACKED_QKV" else list(qkv_t)
    if fw == "cupy":
        cupy = pytest.importorskip("cupy")
        conv = [to_cupy(cupy, t, "bf16") for t in parts]
        meta = [cupy.asarray(x.cpu().numpy()) for x in (cum_t, sl_t)]
        ws = cupy.zeros(128 << 20, dtype=cupy.uint8)
        o = _fmha_packed(conv[0] if layout == "PACKED_QKV" else tuple(conv), layout, meta[0], meta[1], ws)
        cupy.cuda.get_current_stream().synchronize()
        assert isinstance(o, cupy.ndarray)
        got = o.view(cupy.uint16).get()
    else:
        jax, jnp, gpu = jax_gpu()
        conv = [to_jax(jax, jnp, gpu, t, jnp.bfloat16) for t in parts]
        meta = [jax.device_put(jnp.asarray(x.cpu().numpy()), gpu) for x in (cum_t, sl_t)]
        ws = jax.device_put(jnp.zeros(128 << 20, jnp.uint8), gpu)
        o = _fmha_packed(conv[0] if layout == "PACKED_QKV" else tuple(conv), layout, meta[0], meta[1], ws)
        assert isinstance(o, jax.Array)
        got = np.asarray(jax.lax.bitcast_convert_type(o, jnp.uint16))
    assert np.array_equal(got, want), f"{fw} and torch differ ({layout})"
    a = to_numpy_f64(torch.from_numpy(got.view(np.int16).copy()).view(torch.bfloat16))
    assert_close(a, ref, atol=1e-2, rtol=1e-2, what=f"{fw} {layout}")
