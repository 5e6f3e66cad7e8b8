"""Capturing run() of a wrapper built without use_cuda_graph is refused (simulated driver, no GPU).

FlashInfer replays such a graph with silently wrong output once plan() moves the metadata
(flashinfer#3904). Here every run() of the decode and prefill wrappers asks the driver whether its
stream is capturing (cuStreamIsCapturing) and raises RuntimeError naming use_cuda_graph before
anything is allocated, waited on or launched; the wrapper keeps working afterwards. Graph-mode
wrappers and XQA (one engine per shape, never re-planned) may be captured.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from pyflashattn import decode
from pyflashattn._engine import xqa
from pyflashattn.testing.fake_driver import (
    D, HKV, HQ, I32, KV_INDICES, KV_INDPTR, LAST, PS, T, TKV, TQ, WS, cache_t, i32, kv_t, out_t, paged,
    plan_paged, plan_ragged, q_t, ragged)

B = 3  # the fake batch's requests
STREAM = 0x5100
NO_GRAPH = r"being captured into a CUDA graph, but this wrapper was built without use_cuda_graph=True"


def _wrapper(fake, kind):
    """(a planned wrapper without graph mode, its run() operands)."""
    if kind == "decode":
        w = decode.BatchDecodeWithPagedKVCacheWrapper(WS(fake), "NHD")
        w.plan(KV_INDPTR, KV_INDICES, LAST, HQ, HKV, D, PS)
        return w, (T((B, HQ, D), data=0x100000), cache_t()), T((B, HQ, D), data=0x400000)
    if kind == "paged":
        w = paged(fake)
        plan_paged(w, causal=True)
        return w, (q_t(), cache_t()), out_t()
    w = ragged(fake)
    plan_ragged(w, causal=True)
    return w, (q_t(), kv_t(), kv_t(data=0x300000 + TKV * HKV * D * 2)), out_t()


def _driver_ops(fake):
    return [op[0] for op in fake.cu.log if op[0] in ("launch", "launch_pdl", "wait", "alloc", "htod")]


@pytest.mark.parametrize("kind", ["decode", "paged", "ragged"])
def test_run_under_capture_is_refused_before_anything_is_enqueued(fake, kind):
    w, args, out = _wrapper(fake, kind)
    fake.cu.log.clear()
    fake.cu.capturing.add(STREAM)
    for _ in range(2):  # the first run after plan() (its copy still pending) and any later one
        with pytest.raises(RuntimeError, match=NO_GRAPH):
            w.run(*args, out=out, stream=STREAM)
    assert _driver_ops(fake) == []
    fake.cu.capturing.discard(STREAM)
    assert w.run(*args, out=out, stream=STREAM) is out  # the wrapper still works outside the capture
    assert _driver_ops(fake)[-1].startswith("launch")
    fake.cu.capturing.add(0x7700)  # another stream capturing is none of this run's business
    w.run(*args, out=out, stream=STREAM)


def test_the_torch_fast_path_refuses_a_capture_too(fake, fake_torch):
    ft = fake_torch
    w = ragged(fake)
    plan_ragged(w)
    q, k, v = ft.tensor((TQ, HQ, D), "float16"), ft.tensor((TKV, HKV, D), "float16"), ft.tensor((TKV, HKV, D), "float16")
    w.run(q, k, v)
    w.run(q, k, v)  # the fast path from here on
    assert w._engine.fast_key is not None
    ft.stream = STREAM  # torch's current stream is the one being captured
    fake.cu.capturing.add(STREAM)
    ft.allocs.clear()
    launches = len(fake.cu.launches)
    with pytest.raises(RuntimeError, match=NO_GRAPH):
        w.run(q, k, v)
    assert ft.allocs == [] and len(fake.cu.launches) == launches
    fake.cu.capturing.clear()
    w.run(q, k, v)
    assert len(fake.cu.launches) == launches + 1


def test_graph_mode_wrappers_are_captured(fake):
    bufs = (T((B + 1,), I32, data=0x600000), T((16,), I32, data=0x610000), T((B,), I32, data=0x620000))
    w = decode.BatchDecodeWithPagedKVCacheWrapper(WS(fake), "NHD", True, False, *bufs)
    w.plan(KV_INDPTR, KV_INDICES, LAST, HQ, HKV, D, PS)
    fake.cu.capturing.add(STREAM)
    w.run(T((B, HQ, D), data=0x100000), cache_t(), out=T((B, HQ, D), data=0x400000), stream=STREAM)
    assert w._engine.graph.captured is not None


def test_xqa_may_be_captured_after_its_warm_up_call(fake, monkeypatch):
    monkeypatch.setattr(xqa, "_ENGINES", OrderedDict())
    table = np.zeros((B, 4), np.int32)
    table[:2, :2] = [[4, 1], [0, 2]]
    args = dict(query=T((B, HQ, D), data=0x100000), kv_cache=cache_t(), workspace_buffer=WS(fake),
                block_tables=fake.dev(table, I32, shape=table.shape), seq_lens=fake.dev(i32(19, 16, 0), I32),
                max_seq_len=32, out=T((B, HQ, D), data=0x400000))
    decode.xqa_batch_decode_with_kv_cache(**args)  # plans (allocates): outside the capture
    (e,) = xqa._ENGINES.values()
    assert not e.watch_capture
    launches = len(fake.cu.launches)
    fake.cu.capturing.add(0x5100)  # the fake's current stream
    decode.xqa_batch_decode_with_kv_cache(**args)
    assert len(fake.cu.launches) == launches + 1 and fake.cu.launches[-1][2] == 0x5100  # on the capturing stream


def test_a_library_output_freed_during_another_streams_capture_frees_in_relaxed_mode(fake):
    """A JAX output dropped (garbage collection included) while torch captures in global mode:
    its stream-ordered free runs under the relaxed capture mode, which a global capture does not
    refuse, and the thread's own mode comes back (the standalone test_page graph failure)."""
    from pyflashattn._runtime import cuda as _cuda

    cu = fake.cu
    cu.capturing.add(STREAM)  # another stream captures
    ptr = _cuda.mem_alloc_async(256, 0x5200)
    _cuda.mem_free_async(ptr, 0x5200)
    relaxed = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    assert ("free_async", ptr, 0x5200, relaxed) in cu.log
    assert cu.capture_mode == cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
