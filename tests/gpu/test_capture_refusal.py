"""Capturing run() of a wrapper built without use_cuda_graph raises, on a CUDA GPU (torch).

FlashInfer replays such a graph with silently wrong output once plan() moves the metadata
(flashinfer#3904). Here run() inside torch.cuda.graph raises RuntimeError naming use_cuda_graph
before launching anything, for the decode wrapper and both prefill wrappers, on the full path
and on the torch fast path; afterwards the same wrappers, a graph-mode wrapper and XQA still
work (outside a capture, and captured where that is allowed), against the float64 reference.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from pyflashattn.testing.gpu import require_cuda_torch, scratch_workspace as _ws

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()

import pyflashattn  # noqa: E402
from pyflashattn import decode  # noqa: E402
from pyflashattn.testing import attention_ref, to_numpy_f64  # noqa: E402
from pyflashattn.testing.checks import assert_close  # noqa: E402

DEV = "cuda"
F16 = torch.float16
TOL = dict(atol=2e-3, rtol=2e-3)
NO_GRAPH = r"being captured into a CUDA graph, but this wrapper was built without use_cuda_graph=True"
HQ, HKV, D, PS = 8, 2, 128, 16
KV_LENS = [300, 17, 1000]


def _batch(seed):
    """q [B, HQ, D] (one token a request), a contiguous paged cache (request b's pages in order)
    and the paged arrays, plus the float64 reference."""
    g = torch.Generator(device=DEV).manual_seed(zlib.crc32(f"capture-{seed}".encode()))
    pages = [-(-n // PS) for n in KV_LENS]
    cache = torch.randn((sum(pages), 2, PS, HKV, D), generator=g, device=DEV).to(F16)
    q = torch.randn((len(KV_LENS), HQ, D), generator=g, device=DEV).to(F16)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    last = np.array([n - (p - 1) * PS for n, p in zip(KV_LENS, pages)], np.int32)
    ref = []
    for b, n in enumerate(KV_LENS):
        kv = cache[indptr[b]:indptr[b + 1]]
        k, v = kv[:, 0].reshape(-1, HKV, D)[:n], kv[:, 1].reshape(-1, HKV, D)[:n]
        ref.append(attention_ref(q[b:b + 1], k, v)[0])
    return q, cache, (indptr, np.arange(indptr[-1], dtype=np.int32), last), np.concatenate(ref)


def _refused(run):
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=NO_GRAPH):
        with torch.cuda.graph(graph):
            run()


@pytest.mark.parametrize("kind", ["decode", "paged_prefill"])
def test_capture_of_a_non_graph_wrapper_is_refused(kind):
    q, cache, arrays, ref = _batch(kind)
    if kind == "decode":
        w = decode.BatchDecodeWithPagedKVCacheWrapper(_ws(), "NHD")
        w.plan(*arrays, HQ, HKV, D, PS, q_data_type=F16)
    else:
        w = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(_ws(), "NHD")
        w.plan(np.arange(len(KV_LENS) + 1, dtype=np.int32), *arrays, HQ, HKV, D, PS, q_data_type=F16)
    out = torch.empty_like(q)
    _refused(lambda: w.run(q, cache, out=out))  # the first run after plan(): the full path
    w.run(q, cache, out=out)
    w.run(q, cache, out=out)  # now the torch fast path
    _refused(lambda: w.run(q, cache, out=out))
    _refused(lambda: w.run(q, cache))  # without out= (the full path again)
    out.fill_(float("nan"))
    w.run(q, cache, out=out)  # the wrapper still works
    torch.cuda.synchronize()
    assert_close(to_numpy_f64(out), ref, what=f"{kind} after refused captures", **TOL)


def test_ragged_wrapper_refuses_and_the_library_keeps_working():
    q, cache, (indptr, _, last), ref = _batch("ragged")
    k = torch.cat([cache[indptr[b]:indptr[b + 1], 0].reshape(-1, HKV, D)[:n] for b, n in enumerate(KV_LENS)])
    v = torch.cat([cache[indptr[b]:indptr[b + 1], 1].reshape(-1, HKV, D)[:n] for b, n in enumerate(KV_LENS)])
    w = pyflashattn.BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD")
    kv_indptr = np.concatenate([[0], np.cumsum(KV_LENS)]).astype(np.int32)
    w.plan(np.arange(len(KV_LENS) + 1, dtype=np.int32), kv_indptr, HQ, HKV, D, q_data_type=F16)
    _refused(lambda: w.run(q, k, v))
    assert_close(to_numpy_f64(w.run(q, k, v)), ref, what="ragged after a refused capture", **TOL)
    # a graph-mode wrapper is captured and replayed as before
    i32 = lambda n: torch.zeros(n, dtype=torch.int32, device=DEV)  # noqa: E731
    gw = pyflashattn.BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD", True, i32(8), i32(8))
    gw.plan(np.arange(len(KV_LENS) + 1, dtype=np.int32), kv_indptr, HQ, HKV, D, q_data_type=F16)
    out = torch.empty_like(q)
    gw.run(q, k, v, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gw.run(q, k, v, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(to_numpy_f64(out), ref, what="graph-mode replay", **TOL)


def test_xqa_is_still_capturable():
    q, cache, (indptr, _, _), ref = _batch("xqa")
    table = torch.zeros(len(KV_LENS), int(np.diff(indptr).max()), dtype=torch.int32)
    for b in range(len(KV_LENS)):
        table[b, :indptr[b + 1] - indptr[b]] = torch.arange(int(indptr[b]), int(indptr[b + 1]), dtype=torch.int32)
    table, seq = table.to(DEV), torch.tensor(KV_LENS, dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)
    call = lambda: decode.xqa_batch_decode_with_kv_cache(q, cache, _ws(), table, seq, max(KV_LENS),  # noqa: E731
                                                          bmm1_scale=D ** -0.5, out=out)
    call()  # plans (allocates): outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(to_numpy_f64(out), ref, what="xqa replay", **TOL)
