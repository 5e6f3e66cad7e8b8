"""Single prefill on the simulated driver: grid order and the decode tile (split like a one-request
ragged batch)."""
from __future__ import annotations

import ctypes
import math
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
# single prefill: launch order (heads fastest, or a head's row tiles together for L2 reuse)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("supports, causal, window, rows_fastest", [
    (True, False, -1, True),     # equal-cost tiles in a kernel that reads the flag
    (True, True, -1, False),     # causal: longest-first order across heads
    (True, False, 300, False),   # window: tile costs differ too
    (False, False, -1, False),   # a kernel that ignores the flag never gets the other grid
])
def test_single_prefill_grid_order(fake, monkeypatch, supports, causal, window, rows_fastest):
    meta = dict(_META[256], rows_fastest=True) if supports else dict(_META[256])
    monkeypatch.setitem(_META, 256, meta)
    monkeypatch.setattr(pyflashattn._engine.single._tls, "plans", {}, raising=False)  # no plan from another fake
    n, h = 4096, 8  # 32 row tiles x 8 heads: a full wave, no KV split
    q, k, v, out = (T((n, h, 256), data=a) for a in (0x100000, 0x200000, 0x300000, 0x400000))
    pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=causal, window_left=window, out=out)
    (name, grid, _, p), = fake.attn_launches()
    assert p.num_kv_chunks == 1
    if rows_fastest:
        assert grid == (32, 1, h) and p.rows_fastest == 1
    else:
        assert grid == (h, 1, 32) and p.rows_fastest == 0


# ---------------------------------------------------------------------------------------------
# single prefill: requests within DECODE_MAX_ROWS packed rows run on the 16-row decode tile
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qo, hq, hkv, D, kw, decode", [
    (1, 32, 8, 128, {}, True),                          # decode, GQA 4: 4 packed rows
    (4, 32, 8, 128, {"causal": True}, True),            # speculative decode: exactly 16 rows
    (8, 32, 8, 128, {"causal": True}, True),            # 32 rows: two row tiles of the decode tile
    (9, 32, 8, 128, {"causal": True}, False),           # 36 rows: the 128-row kernel
    (7, 8, 8, 64, {"window_left": 300}, True),          # MHA append with a window
    (32, 8, 8, 64, {"causal": True}, True),             # MHA, 32 rows at hd64
    (2, 64, 8, 256, {"causal": True}, True),            # GQA 8, hd256: 16 rows
    (5, 32, 8, 256, {"causal": True}, False),           # hd256 stays at 16 rows: 20 rows take the 128-row kernel
    (1, 32, 8, 128, {"logits_soft_cap": 30.0}, False),  # general options: the 128-row general kernel
])
def test_single_prefill_decode_tile(fake, monkeypatch, qo, hq, hkv, D, kw, decode):
    monkeypatch.setattr(pyflashattn._engine.single._tls, "plans", {}, raising=False)
    kv_len = 20000
    q, k, v = T((qo, hq, D), data=0x100000), T((kv_len, hkv, D), data=0x200000), T((kv_len, hkv, D), data=0x300000)
    pyflashattn.single_prefill_with_kv_cache(q, k, v, out=T((qo, hq, D), data=0x400000), **kw)
    (name, grid, _, p), = fake.attn_launches()
    assert ("decode=True" in name) == decode and (("general=True" in name) == ("logits_soft_cap" in kw))
    merges = [x for x in fake.cu.launches if x[0].startswith("merge")]
    assert len(merges) == (p.num_kv_chunks > 1)
    if not decode:
        return
    # grid (kv heads, splits, 16-row tiles: single prefill has contiguous 16-bit K/V, so 17-32 rows
    # take two of them, decode_tiles), split exactly like a one-request ragged batch plan
    assert grid == (hkv, p.num_kv_chunks, -(-qo * (hq // hkv) // 16)) and p.rows_fastest == 0
    assert "block_m=16" in name
    assert p.num_kv_chunks > 1 and p.kv_chunk_size * p.num_kv_chunks >= kv_len > p.kv_chunk_size * (p.num_kv_chunks - 1)
    w = ragged(fake)
    w.plan(i32(0, qo), i32(0, kv_len), hq, hkv, D, causal=kw.get("causal", False),
           window_left=kw.get("window_left", -1))
    bp = w._engine.attn.params
    assert w._engine.attn.name == name and bp.kv_chunk_size == p.kv_chunk_size
    assert fake.read(bp.num_chunks, 1, np.int32)[0] == p.num_kv_chunks


# ---------------------------------------------------------------------------------------------
# single prefill: the torch fast path (a repeated signature skips the views and the validator)
# ---------------------------------------------------------------------------------------------
def test_single_prefill_torch_fast_path_is_taken_and_keyed_by_signature(fake, fake_torch, monkeypatch):
    monkeypatch.setattr(pyflashattn._engine.single._tls, "plans", {}, raising=False)
    q, k, v = (fake_torch.tensor(s, "float16") for s in ((64, 8, 128), (256, 2, 128), (256, 2, 128)))
    out = fake_torch.tensor((64, 8, 128), "float16")
    pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=True, out=out)  # validates, plans, keys
    views = []
    real_view = _tensor.view
    monkeypatch.setattr(_tensor, "view", lambda *a, **kw: views.append(a[1]) or real_view(*a, **kw))
    q2 = fake_torch.tensor((64, 8, 128), "float16")  # same signature, other pointers
    pyflashattn.single_prefill_with_kv_cache(q2, k, v, causal=True, out=out)
    assert views == [], "a repeated torch signature must take the fast path"
    assert last_attn(fake)[3].q == q2.data_ptr()
    pyflashattn.single_prefill_with_kv_cache(q2, k, v, causal=False, out=out)  # another option: full path
    assert "q" in views
