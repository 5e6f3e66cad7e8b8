"""Batch engine on the simulated driver: custom masks (where the packed bits go, bit for bit, with
and without CUDA graphs) and what a captured run() freezes."""
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
# custom masks: where the packed bits go (non-graph and graph), bit for bit
# ---------------------------------------------------------------------------------------------
def _masks(seed, bits=MASK_BITS):
    rng = np.random.default_rng(seed)
    return [rng.random(n) < 0.5 for n in bits]


def _packed_segments(masks):
    return b"".join(np.packbits(m, bitorder="little").tobytes() for m in masks)


def _read_mask(env, p, nbytes):
    return env.read(p.custom_mask, nbytes).tobytes()


def _mask_indptr(env, p, n):
    return env.read(p.mask_indptr, n, np.int32)


def _check_mask_params(env, w, masks):
    want = _packed_segments(masks)
    p = w._engine.attn.params
    assert p.custom_mask != 0 and w._engine.attn.meta["general"] is True and p.causal == 0
    assert _read_mask(env, p, len(want)) == want
    nbytes = [-(-m.size // 8) for m in masks]
    assert list(_mask_indptr(env, p, len(masks) + 1)) == list(np.concatenate([[0], np.cumsum(nbytes)]))


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_bool_mask_is_packed_on_the_plan_stream(fake, kind):
    w = paged(fake) if kind == "paged" else ragged(fake)
    masks = _masks(1)
    flat = fake.dev(np.concatenate(masks), BOOL)
    (plan_paged if kind == "paged" else plan_ragged)(w, custom_mask=flat, causal=True, stream=0x77)
    _check_mask_params(fake, w, masks)
    packs = [x for x in fake.cu.launches if x[0].startswith("packbits")]
    assert packs and all(x[2] == 0x77 for x in packs), "packing must run on the plan stream"
    assert not any(op[0] == "sync" for op in fake.cu.log), "plan() must not synchronise"


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_packed_mask_is_used_in_place_without_buffers(fake, kind):
    w = paged(fake) if kind == "paged" else ragged(fake)
    masks = _masks(2)
    packed = fake.dev(np.frombuffer(_packed_segments(masks) + b"\0" * 5, np.uint8))
    (plan_paged if kind == "paged" else plan_ragged)(w, packed_custom_mask=packed)
    assert w._engine.attn.params.custom_mask == packed.args[3]
    _check_mask_params(fake, w, masks)
    assert not any(op[0] == "dtod" for op in fake.cu.log)


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_user_mask_buffers_receive_the_mask(fake, graph, packed):
    mbuf = fake.dev(64)
    qk = fake.dev(8 * 4, I32)
    bufs = dict(custom_mask_buf=mbuf, qk_indptr_buf=qk)
    if graph:
        bufs.update(qo_indptr_buf=T((5,), I32), kv_indptr_buf=T((5,), I32))
    w = ragged(fake, use_cuda_graph=graph, **bufs)
    masks = _masks(3)
    if packed:
        kw = dict(packed_custom_mask=fake.dev(np.frombuffer(_packed_segments(masks), np.uint8)))
    else:
        kw = dict(custom_mask=fake.dev(np.concatenate(masks), BOOL))
    plan_ragged(w, **kw, stream=0x99)
    p = w._engine.attn.params
    assert p.custom_mask == mbuf.args[3] and p.mask_indptr == qk.args[3]
    _check_mask_params(fake, w, masks)
    assert all(op[-1] == 0x99 for op in fake.cu.log if op[0] in ("dtod", "htod"))


def _graph_ragged(env, max_batch=4, **kw):
    return ragged(env, use_cuda_graph=True, qo_indptr_buf=T((max_batch + 1,), I32),
                  kv_indptr_buf=T((max_batch + 1,), I32), **kw)


def _mask_batch(seed, B=None):
    """(qo_indptr, kv_indptr, masks) of a random batch within the graph capacity (<= 17 tokens)."""
    rng = np.random.default_rng(seed)
    B = B or int(rng.integers(1, 5))
    qo = rng.multinomial(17, np.ones(B) / B) if seed % 2 else rng.integers(0, 17 // B + 1, B)
    kv = rng.integers(0, 300, B)
    masks = [rng.random(int(a) * int(b)) < 0.3 for a, b in zip(qo, kv)]
    ind = lambda x: np.concatenate([[0], np.cumsum(x)]).astype(np.int32)  # noqa: E731
    return ind(qo), ind(kv), masks


def test_graph_mode_mask_buffer_is_fixed_and_rewritten_per_plan(fake):
    w = _graph_ragged(fake)
    qi, ki, masks = _mask_batch(1, B=4)
    flat = fake.dev(np.concatenate(masks), BOOL)
    w.plan(qi, ki, HQ, HKV, D, custom_mask=flat)
    p = w._engine.attn.params
    addr, indptr_addr = p.custom_mask, p.mask_indptr
    need = sum(-(-m.size // 8) for m in masks)
    assert w._engine.masks.cap == max(2 * need, 64 << 10)
    fixed = {f: getattr(p, f) for f in ("work_request", "qo_indptr", "kv_indptr", "kv_chunk_size_dev")}
    for seed in range(2, 12):
        qi, ki, masks = _mask_batch(seed)
        packed = seed % 3 == 0
        kw = (dict(packed_custom_mask=fake.dev(np.frombuffer(_packed_segments(masks) + b"\0", np.uint8)))
              if packed else dict(custom_mask=fake.dev(np.concatenate(masks) if masks else np.zeros(0, bool), BOOL)))
        w.plan(qi, ki, HQ, HKV, D, **kw)
        p = w._engine.attn.params
        assert (p.custom_mask, p.mask_indptr) == (addr, indptr_addr), "graph-mode mask addresses moved"
        assert {f: getattr(p, f) for f in fixed} == fixed, "graph-mode metadata addresses moved"
        _check_mask_params(fake, w, masks)
    assert not any(op[0] == "sync" for op in fake.cu.log)


def test_graph_mode_mask_over_capacity_names_the_buffer_and_keeps_the_plan(fake):
    w = _graph_ragged(fake, max_batch=2)
    qi, ki = i32(0, 1, 2), i32(0, 8, 16)  # 2 x 8 bits: the owned buffer gets 64 KiB
    w.plan(qi, ki, HQ, HKV, D, custom_mask=fake.dev(np.ones(16, bool), BOOL))
    cap = w._engine.masks.cap
    big_qo = i32(0, 1, 2)
    big_kv = i32(0, cap * 8, cap * 8 + 8)  # 1 x (cap * 8) bits + 1 byte: one byte too many
    with pytest.raises(ValueError, match=rf"{cap + 1} bytes.*{cap}.*custom_mask_buf"):
        w.plan(big_qo, big_kv, HQ, HKV, D, packed_custom_mask=fake.dev(cap + 1))
    # the previous plan is intact and runs
    w.run(T((2, HQ, D)), T((16, HKV, D)), T((16, HKV, D), data=0x900000), out=T((2, HQ, D)))
    assert last_attn(fake)[3].custom_mask == w._engine.masks.dev_ptr


def _capture_run(fake, w, q, *kv, out):
    fake.cu.capturing.add(0x5100)
    try:
        w.run(q, *kv, out=out, stream=0x5100)
    finally:
        fake.cu.capturing.discard(0x5100)


def test_capture_freezes_mask_presence_and_options(fake):
    w = _graph_ragged(fake)
    qi, ki, masks = _mask_batch(5, B=3)
    kv_total = int(ki[-1])
    args = (T((int(qi[-1]), HQ, D)), T((kv_total, HKV, D)), T((kv_total, HKV, D), data=0x900000))
    # before any capture, plans may change anything (here: a mask, then none, then causal)
    w.plan(qi, ki, HQ, HKV, D, custom_mask=fake.dev(np.concatenate(masks), BOOL))
    w.plan(qi, ki, HQ, HKV, D, causal=True)
    w.plan(qi, ki, HQ, HKV, D)
    w.run(*args, out=T((int(qi[-1]), HQ, D)))  # an eager run does not freeze anything
    assert w._engine.graph.captured is None
    _capture_run(fake, w, *args, out=T((int(qi[-1]), HQ, D)))
    assert w._engine.graph.captured is not None
    sig = dict(w._engine.graph.captured)
    # same options, other lengths: fine
    qi2, ki2, masks2 = _mask_batch(6, B=2)
    w.plan(qi2, ki2, HQ, HKV, D)
    for kw, pattern in [
        (dict(custom_mask=fake.dev(np.concatenate(masks2), BOOL)), r"custom_mask.*without a custom mask"),
        (dict(causal=True), r"causal"),
        (dict(window_left=3), r"window_left"),
        (dict(sm_scale=0.3), r"sm_scale"),
        (dict(logits_soft_cap=5.0), r"logits_soft_cap"),
        (dict(kv_data_type="float8_e4m3fn"), r"kv_data_type"),
        (dict(q_data_type="bfloat16"), r"q_data_type"),
        (dict(pos_encoding_mode="ALIBI"), r"pos_encoding_mode"),
        (dict(disable_split_kv=True), r"workspace|kernel"),
    ]:
        before = bytes(w._engine.attn.params)
        with pytest.raises(ValueError, match=pattern):
            w.plan(qi2, ki2, HQ, HKV, D, **kw)
        assert bytes(w._engine.attn.params) == before, "a refused plan changed the kernel params"
    assert w._engine.graph.captured == sig
    with pytest.raises(ValueError, match="float_workspace_buffer"):
        w.reset_workspace_buffer(WS(fake))
    w.reset_workspace_buffer(w._engine.ws_buf)  # the same buffer is fine


def test_capture_with_mask_refuses_a_plan_without_one(fake):
    w = _graph_ragged(fake)
    qi, ki, masks = _mask_batch(7, B=3)
    kv_total = int(ki[-1])
    w.plan(qi, ki, HQ, HKV, D, custom_mask=fake.dev(np.concatenate(masks), BOOL))
    _capture_run(fake, w, T((int(qi[-1]), HQ, D)), T((kv_total, HKV, D)), T((kv_total, HKV, D), data=0x900000),
                 out=T((int(qi[-1]), HQ, D)))
    with pytest.raises(ValueError, match=r"custom_mask.*with a custom mask.*all-True"):
        w.plan(qi, ki, HQ, HKV, D)
    qi2, ki2, masks2 = _mask_batch(8, B=4)
    w.plan(qi2, ki2, HQ, HKV, D, custom_mask=fake.dev(np.concatenate(masks2), BOOL))  # with a mask: fine
    _check_mask_params(fake, w, masks2)


def test_fast_path_capture_is_noticed(fake, fake_torch):
    w = _graph_ragged(fake)
    qi, ki, _ = _mask_batch(9, B=2)
    q, k, v, o = (fake_torch.tensor(s, "float16") for s in ((int(qi[-1]), HQ, D), (int(ki[-1]), HKV, D),
                                                            (int(ki[-1]), HKV, D), (int(qi[-1]), HQ, D)))
    w.plan(qi, ki, HQ, HKV, D)
    w.run(q, k, v, out=o)
    w.run(q, k, v, out=o)  # the fast path from here on
    assert w._engine.fast_key is not None and w._engine.graph.captured is None
    fake_torch.stream = 0x5100
    fake.cu.capturing.add(0x5100)
    w.run(q, k, v, out=o)
    fake.cu.capturing.clear()
    assert w._engine.graph.captured is not None
    with pytest.raises(ValueError, match="causal"):
        w.plan(qi, ki, HQ, HKV, D, causal=True)
