"""Batch engine on the simulated driver: the staged metadata is the scheduler's plan, and plan()
never waits for the GPU. ``PYTHONPATH=. python tests/test_batch_staging.py`` prints plan() / run()
host times on the fake (the Python-side work; the real driver calls cost extra)."""
from __future__ import annotations

import ctypes
import math
import pathlib
import sys
import time

import numpy as np
import pytest

import pyflashattn
from pyflashattn._engine import routing
from pyflashattn._runtime import cuda as _cuda, dtypes as _dtypes, registry as _registry, tensor as _tensor
from pyflashattn.testing.fake_tensors import FakeProducer, fake_cuda_tensor
from pyflashattn.testing.fake_driver import (  # noqa: F401 - the shared fixtures' vocabulary
    Paged, Ragged, f32, BF16, BOOL, D, E4M3, E5M2, F16, FakeDriver, FakeEnv, FakeTorch, FakeTorchTensor, HKV,
    HQ, I32, KV_INDICES, KV_INDPTR, LAST, LOG2E, MASK_BITS, NPAGES, PS, QO, RAGGED_KV, T, TKV, TQ, U8, WS,
    _META, _TorchDtype, _decode_variant, _simulate_packbits, cache_t, i32, kv_t, last_attn, lse_t, out_t,
    paged, plan_paged, plan_ragged, q_t, ragged)


# ---------------------------------------------------------------------------------------------
# metadata staging: what the kernels read through the params pointers is plan_prefill()'s plan
# ---------------------------------------------------------------------------------------------
def _staging_batches(rng, max_batch, max_q):
    """Random batches within a capacity: split and unsplit, requests without queries or pages."""
    for step in range(10):
        B = int(rng.integers(1, max_batch + 1))
        qo = rng.multinomial(max_q, np.ones(B) / B) if step == 0 else rng.integers(0, max_q // B + 1, B)
        # few tiles and long KV: split; KV shorter than a minimum chunk: not split
        kv = qo + rng.integers(0, 20000, B) if step % 3 else rng.integers(0, 250, B)
        if step % 4 == 3:
            kv[rng.integers(0, B)] = 0
        yield qo.astype(np.int64), kv.astype(np.int64)


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_staged_metadata_is_the_plan(fake, kind, graph):
    from pyflashattn._engine.schedule import plan_prefill

    max_batch, max_q, max_pages = 12, 600, 30000
    bufs = {}
    if graph and kind == "paged":
        bufs = dict(qo_indptr_buf=T((max_batch + 1,), I32), paged_kv_indptr_buf=T((max_batch + 1,), I32),
                    paged_kv_indices_buf=T((max_pages,), I32), paged_kv_last_page_len_buf=T((max_batch,), I32))
    elif graph:
        bufs = dict(qo_indptr_buf=T((max_batch + 1,), I32), kv_indptr_buf=T((max_batch + 1,), I32))
    w = (paged if kind == "paged" else ragged)(fake, use_cuda_graph=graph, **bufs)
    ind = lambda x: np.concatenate([[0], np.cumsum(x)]).astype(np.int32)  # noqa: E731
    rng = np.random.default_rng(11)
    for qo, kv in _staging_batches(rng, max_batch, max_q):
        qi = ind(qo)
        if kind == "paged":
            pages = -(-kv // PS)
            last = np.where(pages > 0, kv - (pages - 1) * PS, rng.integers(0, PS + 5, kv.size)).astype(np.int32)
            idx = rng.permutation(int(pages.sum()) + 3).astype(np.int32)  # longer than used
            plan = w.plan(qi, ind(pages), idx, last, HQ, HKV, D, PS, causal=True)
        else:
            plan = w.plan(qi, ind(kv), HQ, HKV, D, causal=True)
        meta = w._engine.attn.meta
        want = plan_prefill(qi, kv, group_size=HQ // HKV, num_kv_heads=HKV, block_m=meta["block_m"],
                            block_n=meta["block_n"], num_sms=132, ctas_per_sm=meta["ctas_per_sm"],
                            causal=True, graph_capacity=w._engine.graph.capacity if graph else None,
                            cost_head_dim=None if meta["decode"] else D)
        for name, a in want.int_arrays().items():
            np.testing.assert_array_equal(getattr(plan, name), a, err_msg=name)
        assert (plan.grid, plan.kv_chunk_size, plan.split) == (want.grid, want.kv_chunk_size, want.split)

        p, B, G = w._engine.attn.params, qo.size, plan.grid
        dev = {"work_request": (p.work_request, G), "work_qtile": (p.work_qtile, G),
               "work_chunk": (p.work_chunk, G), "num_chunks": (p.num_chunks, B), "qo_indptr": (p.qo_indptr, B + 1),
               "kv_indptr": (p.kv_indptr, B + 1)}
        host = dict(plan.int_arrays(), qo_indptr=qi, kv_indptr=ind(pages) if kind == "paged" else ind(kv))
        assert p.kv_chunk_size == plan.kv_chunk_size
        if graph:  # a replay reads the chunk size of the latest plan from the device
            dev["kv_chunk_size_dev"] = (p.kv_chunk_size_dev, 1)
            host["kv_chunk_size_dev"] = [plan.kv_chunk_size]
        else:  # the kernel takes the by-value field
            assert p.kv_chunk_size_dev == 0
        if kind == "paged":
            dev.update(kv_page_indices=(p.kv_page_indices, idx.size - 3), kv_last_page_len=(p.kv_last_page_len, B))
            host.update(kv_page_indices=idx[:-3], kv_last_page_len=last)
        merged = w._engine.merge is not None
        assert merged == (plan.split or graph)
        if merged:
            rows = w._engine.graph.capacity["max_total_q"] if graph else plan.total_q
            mi = plan.merge_indptr
            dev.update(o_indptr=(p.o_indptr, B + 1), merge_indptr=(w._engine.merge.params.merge_indptr, rows + 1))
            host["merge_indptr"] = np.concatenate([mi, np.full(rows + 1 - mi.size, mi[-1], np.int32)])
        else:
            assert p.o_indptr == 0
        for name, (addr, n) in dev.items():
            np.testing.assert_array_equal(fake.read(addr, n, np.int32), host[name], err_msg=name)
# ---------------------------------------------------------------------------------------------
# metadata staging: plan() never waits for the GPU to drain its stream
# ---------------------------------------------------------------------------------------------
def test_plan_does_not_wait_while_the_gpu_lags_and_reuses_finished_buffers(fake):
    w = ragged(fake)
    plan_ragged(w)
    st = w._engine.staging
    assert len(st.pinned) == 1
    fake.cu.lagging = True  # no copy has run yet: every plan takes a fresh pinned buffer ...
    for n in range(2, st.MAX_PINNED + 1):
        fake.cu.log.clear()
        plan_ragged(w)
        assert len(st.pinned) == n
        assert not [e for e in fake.cu.log if e[0] in ("sync", "event_sync")], "plan() blocked on the GPU"
    hosts = {e[0] for e in st.pinned}
    assert len(hosts) == st.MAX_PINNED  # distinct buffers: no copy's bytes were overwritten
    fake.cu.log.clear()
    plan_ragged(w)  # ... up to MAX_PINNED, then it waits for the oldest copy instead of growing
    assert len(st.pinned) == st.MAX_PINNED and ("event_sync",) in fake.cu.log
    fake.cu.lagging = False  # copies done: buffers are reused, none added
    for _ in range(3):
        plan_ragged(w)
    assert len(st.pinned) == st.MAX_PINNED and {e[0] for e in st.pinned} == hosts


# ---------------------------------------------------------------------------------------------
# host time (not a test): PYTHONPATH=. python tests/test_batch_prefill_host.py
# ---------------------------------------------------------------------------------------------
def _bench():  # pragma: no cover - prints timings, asserts nothing
    mp = pytest.MonkeyPatch()
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "build_tools"))
    import variants  # noqa: PLC0415

    env = FakeEnv(mp, variants.variants())
    ft = FakeTorch(env)
    mp.setitem(sys.modules, "torch", ft.module)
    mp.setattr(_tensor, "_TORCH_STRIDED", {"torch.strided"})

    def per_call(fn, n):
        for _ in range(3):
            fn()
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best.append((time.perf_counter() - t0) / n * 1e6)
        return min(best)

    ws = env.dev(512 << 20)
    for B in (64, 1024):
        rng = np.random.default_rng(B)
        qo = rng.integers(1, 257, B)
        kv = qo + rng.integers(0, 4097 - 256, B)
        ind = lambda x: np.concatenate([[0], np.cumsum(x)]).astype(np.int32)  # noqa: E731
        pages = -(-kv // 16)
        idx = rng.permutation(int(pages.sum())).astype(np.int32)
        last = (kv - (pages - 1) * 16).astype(np.int32)
        wp, wr = Paged(ws), Ragged(ws)
        n = 200 if B == 64 else 50
        qi, pi, ki = ind(qo), ind(pages), ind(kv)
        tp = per_call(lambda: wp.plan(qi, pi, idx, last, 32, 8, 128, 16, causal=True, q_data_type="bfloat16"), n)
        tr = per_call(lambda: wr.plan(qi, ki, 32, 8, 128, causal=True, q_data_type="bfloat16"), n)
        env.cu.launches.clear()
        env.cu.log.clear()
        print(f"plan() B={B}: paged {tp:.1f} us, ragged {tr:.1f} us (scheduler included, fake driver)")
    w = Ragged(ws)
    w.plan(ind([16] * 4), ind([16] * 4), 32, 8, 128, causal=True)
    q, o = ft.tensor((64, 32, 128), "float16"), ft.tensor((64, 32, 128), "float16")
    k = ft.tensor((64, 8, 128), "float16")
    la = w._engine.attn
    t_launch = per_call(lambda: la(0), 5000)
    t_run = per_call(lambda: w.run(q, k, k, out=o), 5000)
    env.cu.launches.clear()
    print(f"run() torch fast path, out=: {t_run:.2f} us, of which the fake launch {t_launch:.2f} us "
          f"-> Python side {t_run - t_launch:.2f} us")


if __name__ == "__main__":  # pragma: no cover
    _bench()
