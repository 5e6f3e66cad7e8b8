"""Stream-K single prefill on the persistent sm_90a rows (sm90/stream_k.cuh) against the float64
reference: the last round's blocks shared out as ranges of KV tiles, an item split between two
CTAs whose consumers hand its later keys' partial state over through global memory.

Each case plans with PFA_STREAM_K=1 (wherever the shape allows) and asserts the plan split items
(blocks not a multiple of the CTAs: odd lengths, partial last tiles, qo_len != kv_len, GQA packing),
poisons the outputs, and checks o and the LSE; the same call with PFA_STREAM_K=0 must agree with
it to the 16-bit rounding of one online-softmax step. Launches are repeated so that a flag a
reader failed to lower would hand stale state to the next launch.
"""

from __future__ import annotations

import numpy as np
import pytest

from pyflashattn.testing.gpu import cuda_generator, cuda_randn, require_cuda_torch

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()

import pyflashattn  # noqa: E402
from pyflashattn._engine import schedule, single as single_engine  # noqa: E402
from pyflashattn._runtime import registry  # noqa: E402
from pyflashattn.testing import attention_ref, to_numpy_f64  # noqa: E402
from pyflashattn.testing.checks import assert_close  # noqa: E402

F16, BF16 = torch.float16, torch.bfloat16
O_TOL = {F16: dict(atol=1e-3, rtol=1e-3), BF16: dict(atol=1e-2, rtol=1e-2)}
LSE_TOL = {F16: dict(atol=2e-3, rtol=1e-4), BF16: dict(atol=1e-2, rtol=1e-4)}


def _sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("stream-K runs on the persistent sm_90a rows")
    if not any(r.get("stream_k") for r in registry.manifest()["kernels"]):
        pytest.skip("no persistent sm_90a row is built")


def _plan_of():
    plans = [pl for pl in single_engine._tls.plans.values() if pl.attn is not None]
    return plans[-1]


def _run(q, k, v, mode, monkeypatch, reps=2, **kw):
    monkeypatch.setenv(schedule.STREAM_K_ENV, mode)
    registry.force("prefill", None)  # (drops the cached plans)
    out = lse = None
    for _ in range(reps):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((q.shape[0], q.shape[1]), float("nan"), dtype=torch.float32, device="cuda")
        pyflashattn.single_prefill_with_kv_cache(q, k, v, out=out, lse=lse, return_lse=True, **kw)
    torch.cuda.synchronize()
    return out, lse, _plan_of()


CASES = [
    # qo, kv, hq, hkv, d, dtype, layout
    (4096, 4096, 16, 16, 128, BF16, "NHD"),  # 512 blocks on 132 CTAs
    (3001, 5003, 16, 4, 128, F16, "NHD"),  # GQA 4, partial tiles at both ends
    (2049, 4097, 32, 8, 64, BF16, "HND"),  # hd64, a key tile of one key
    (1000, 7000, 32, 4, 128, F16, "NHD"),  # GQA 8, qo_len < kv_len: 252 blocks
    (2500, 2500, 32, 32, 64, F16, "NHD"),
    (700, 9000, 32, 4, 128, BF16, "HND"),
]


@pytest.mark.parametrize("qo_len,kv_len,hq,hkv,d,dtype,layout", CASES)
def test_stream_k_single(qo_len, kv_len, hq, hkv, d, dtype, layout, monkeypatch):
    _sm90()
    g = cuda_generator("stream-k", qo_len, kv_len, hq, hkv, d, str(dtype), layout)
    q = cuda_randn((qo_len, hq, d), g, dtype)
    kshape = (kv_len, hkv, d) if layout == "NHD" else (hkv, kv_len, d)
    k, v = cuda_randn(kshape, g, dtype), cuda_randn(kshape, g, dtype)
    o, lse, plan = _run(q, k, v, "1", monkeypatch, kv_layout=layout)
    assert plan.stream_k is not None, f"{plan.attn.name}: no stream-K plan for this shape"
    tiles, first, ctas = plan.stream_k
    blocks = plan.attn.params.grid_x * plan.attn.params.grid_y * plan.attn.params.grid_z
    assert blocks % ctas != 0 and first == (blocks // ctas - 1) * ctas
    heads = np.unique(np.array([0, hq // 2, hq - 1]))
    o_ref, lse_ref = attention_ref(q, k, v, causal=False, kv_layout=layout, heads=heads)
    assert_close(to_numpy_f64(o)[:, heads], o_ref, what="stream-K o", **O_TOL[dtype])
    assert_close(to_numpy_f64(lse)[:, heads], lse_ref, what="stream-K lse", **LSE_TOL[dtype])
    o0, lse0, plan0 = _run(q, k, v, "0", monkeypatch, reps=1, kv_layout=layout)
    assert plan0.stream_k is None
    assert_close(o, o0, what="stream-K against none", **O_TOL[dtype])
    assert_close(lse, lse0, what="stream-K lse against none", atol=1e-4, rtol=1e-5)


def test_stream_k_peaked_rows_and_scales(monkeypatch):
    # A large logit scale makes the two parts' row maxes differ by far more than the 16-bit range,
    # so a hand-off that rescaled the wrong part shows; k_scale / v_scale apply once, on the
    # merged row (the logit scale in both parts, the output scale in the epilogue).
    _sm90()
    qo_len, kv_len, hq, hkv, d = 2048, 4100, 16, 16, 128
    g = cuda_generator("stream-k-peaked")
    q = cuda_randn((qo_len, hq, d), g, BF16)
    k, v = cuda_randn((kv_len, hkv, d), g, BF16), cuda_randn((kv_len, hkv, d), g, BF16)
    for sm_scale, k_scale, v_scale in ((0.088, 1.0, 1.0), (1.5, 2.0, 0.25)):
        o, lse, plan = _run(q, k, v, "1", monkeypatch, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale)
        assert plan.stream_k is not None
        heads = np.array([0, 5, hq - 1])
        o_ref, lse_ref = attention_ref(q, k, v, causal=False, sm_scale=sm_scale * k_scale, heads=heads)
        what = f"sm_scale={sm_scale} k_scale={k_scale} v_scale={v_scale}"
        assert_close(to_numpy_f64(o)[:, heads], o_ref * v_scale, what=f"{what} o", **O_TOL[BF16])
        assert_close(to_numpy_f64(lse)[:, heads], lse_ref, what=f"{what} lse", **LSE_TOL[BF16])


def test_stream_k_graph_replay(monkeypatch):
    # Captured once, replayed with new inputs: each replay's readers lower the flags their
    # writers raised, so the next replay hands off its own state, not the last one's.
    _sm90()
    qo_len, kv_len, hq, d = 4096, 4096, 16, 128
    g = cuda_generator("stream-k-graph")
    q = cuda_randn((qo_len, hq, d), g, F16)
    k, v = cuda_randn((kv_len, hq, d), g, F16), cuda_randn((kv_len, hq, d), g, F16)
    o, lse, plan = _run(q, k, v, "1", monkeypatch, reps=1)  # plan, flags and workspace made here
    assert plan.stream_k is not None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        pyflashattn.single_prefill_with_kv_cache(q, k, v, out=o, lse=lse, return_lse=True)
    s.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        pyflashattn.single_prefill_with_kv_cache(q, k, v, out=o, lse=lse, return_lse=True)
    # the captured launch shares blocks out (stream s made its flags before the capture): else the
    # replays below would check a launch without a hand-off
    assert _plan_of() is plan and plan.attn.params.sk_tiles == plan.stream_k[0]
    for i in range(3):
        g2 = cuda_generator("stream-k-graph", i)
        q.copy_(cuda_randn(q.shape, g2, F16))
        k.copy_(cuda_randn(k.shape, g2, F16))
        o.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        heads = np.array([0, hq - 1])
        o_ref, lse_ref = attention_ref(q, k, v, causal=False, heads=heads)
        assert_close(to_numpy_f64(o)[:, heads], o_ref, what=f"replay {i} o", **O_TOL[F16])
        assert_close(to_numpy_f64(lse)[:, heads], lse_ref, what=f"replay {i} lse", **LSE_TOL[F16])
