"""Custom masks together with CUDA graphs (use_cuda_graph=True), GPU.

plan() writes each plan's packed mask into a fixed-address buffer (custom_mask_buf, or one the
wrapper allocates at its first plan with a mask) and the per-request byte offsets into a fixed
place (qk_indptr_buf, or the wrapper's staging area), so a run() captured once replays correctly
after later plans with other lengths and other masks. Each replay writes into NaN-poisoned
buffers and every request is checked against the float64 reference with its own mask; a replay
that read a stale mask, stale offsets or another request's segment fails.

A captured graph keeps the kernel it recorded: a later plan that would drop (or add) the mask
raises ValueError, and a refused plan leaves the metadata the graph reads untouched.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from pyflashattn.testing.gpu import require_cuda_torch

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()

import pyflashattn  # noqa: E402
from pyflashattn.quantization import segment_packbits  # noqa: E402
from pyflashattn.testing import attention_ref, to_numpy_f64  # noqa: E402
from pyflashattn.testing.frameworks import capture_torch_graph as _capture  # noqa: E402
from pyflashattn.testing.checks import assert_close  # noqa: E402

DEV = "cuda"
NAN = float("nan")
O_TOL = {torch.float16: dict(atol=1e-3, rtol=1e-3), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
LSE_TOL = {torch.float16: dict(atol=2e-3, rtol=1e-4), torch.bfloat16: dict(atol=1e-2, rtol=1e-4)}
HQ, HKV, D, PS = 16, 4, 128, 16
MAX_BATCH, MAX_PAGES, POOL = 6, 1024, 1200

# (qo_lens, kv_lens, mask density) per plan; the first fixes the token capacity (300 tokens).
ROUNDS = [
    ([40, 1, 100, 0, 9, 150], [300, 2000, 100, 50, 9, 700], 0.5),
    ([3, 200, 1], [4000, 250, 3000], 0.1),  # fewer requests, longer KV (split-KV under the graph)
    ([100, 100, 50, 50], [30, 90, 200, 1], 0.8),  # kv < qo rows
    ([300], [512], 0.3),  # one request using the whole token capacity
    ([1, 2, 3, 4, 5, 6], [7, 600, 5, 1, 64, 1500], 0.02),  # nearly empty masks: fully masked rows
]


def _seed(*key):
    return zlib.crc32(repr(key).encode())


def _indptr(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _randn(shape, seed, dt, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(shape, device=DEV, generator=g) * scale).to(dt)


def _masks(qo, kv, density, seed):
    rng = np.random.default_rng(seed)
    ms = [rng.random((a, b)) < density for a, b in zip(qo, kv)]
    for m in ms:
        if m.shape[0] > 2:
            m[1] = False  # a fully masked row in every request with > 2 rows
    return ms


def _mask_kwargs(masks, packed):
    flat = np.concatenate([m.reshape(-1) for m in masks]) if masks else np.zeros(0, bool)
    flat_t = torch.as_tensor(flat, device=DEV)
    if not packed:
        return dict(custom_mask=flat_t)
    seg = _indptr([m.size for m in masks])
    return dict(packed_custom_mask=segment_packbits(flat_t, seg, bitorder="little")[0])


def _check(q, k, v, qo, kv, masks, out, lse, dt, what):
    qi, ki = _indptr(qo), _indptr(kv)
    o_np, lse_np = to_numpy_f64(out), to_numpy_f64(lse)
    Q, K, V = to_numpy_f64(q), to_numpy_f64(k), to_numpy_f64(v)
    for i in range(len(qo)):
        if qo[i] == 0:
            continue
        o_ref, lse_ref = attention_ref(Q[qi[i]:qi[i + 1]], K[ki[i]:ki[i + 1]], V[ki[i]:ki[i + 1]],
                                       custom_mask=masks[i])
        assert_close(o_np[qi[i]:qi[i + 1]], o_ref, what=f"{what} req {i} o", **O_TOL[dt])
        assert_close(lse_np[qi[i]:qi[i + 1]], lse_ref, what=f"{what} req {i} lse", **LSE_TOL[dt])




class _Paged:
    """A graph-mode paged wrapper over one page pool; set(round) writes a batch into it."""

    def __init__(self, dt, user_bufs, ws):
        self.dt = dt
        self.store = _randn((POOL, 2, PS, HKV, D), _seed("pool"), dt, 4.0)
        bufs = dict(qo_indptr_buf=torch.empty(MAX_BATCH + 1, dtype=torch.int32, device=DEV),
                    paged_kv_indptr_buf=torch.empty(MAX_BATCH + 1, dtype=torch.int32, device=DEV),
                    paged_kv_indices_buf=torch.empty(MAX_PAGES, dtype=torch.int32, device=DEV),
                    paged_kv_last_page_len_buf=torch.empty(MAX_BATCH, dtype=torch.int32, device=DEV))
        bufs.update(user_bufs)
        self.w = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, **bufs)

    def plan(self, j, qo, kv, k, v, **kw):
        pages = [-(-n // PS) for n in kv]
        pin = _indptr(pages)
        indices = np.random.default_rng(_seed("perm", j)).permutation(POOL)[:int(pin[-1])].astype(np.int32)
        last = np.asarray([n - (p - 1) * PS if p else 0 for n, p in zip(kv, pages)], np.int32)
        if k is not None and int(pin[-1]):
            tok_page = np.concatenate([indices[pin[i] + np.arange(n) // PS] for i, n in enumerate(kv)])
            tok_slot = np.concatenate([np.arange(n) % PS for n in kv])
            tp = torch.as_tensor(tok_page.astype(np.int64), device=DEV)
            ts = torch.as_tensor(tok_slot.astype(np.int64), device=DEV)
            self.store[:, 0][tp, ts] = k
            self.store[:, 1][tp, ts] = v
        self.w.plan(_indptr(qo), pin, indices, last, HQ, HKV, D, PS, q_data_type=self.dt, **kw)

    def kv_args(self, k_static, v_static):
        return (self.store,)


class _Ragged:
    def __init__(self, dt, user_bufs, ws):
        self.dt = dt
        self.w = pyflashattn.BatchPrefillWithRaggedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, qo_indptr_buf=torch.empty(MAX_BATCH + 1, dtype=torch.int32, device=DEV),
            kv_indptr_buf=torch.empty(MAX_BATCH + 1, dtype=torch.int32, device=DEV), **user_bufs)

    def plan(self, j, qo, kv, k, v, **kw):
        self.w.plan(_indptr(qo), _indptr(kv), HQ, HKV, D, q_data_type=self.dt, **kw)

    def kv_args(self, k_static, v_static):
        return (k_static, v_static)


@pytest.mark.parametrize("kind", ["paged", "ragged"])
@pytest.mark.parametrize("user_bufs", [False, True], ids=["library_buffers", "custom_mask_buf"])
def test_masked_graph_replays_after_replans(kind, user_bufs):
    dt = torch.float16 if kind == "paged" else torch.bfloat16
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    bufs = {}
    if user_bufs:
        need = max(sum(-(-a * b // 8) for a, b in zip(qo, kv)) for qo, kv, _ in ROUNDS)
        bufs = dict(custom_mask_buf=torch.empty(need, dtype=torch.uint8, device=DEV),
                    qk_indptr_buf=torch.empty(MAX_BATCH + 1, dtype=torch.int32, device=DEV))
    # Without user buffers the mask buffer is sized at the first masked plan (twice its mask,
    # at least 64 KiB): every round's mask fits in that here.
    wr = (_Paged if kind == "paged" else _Ragged)(dt, bufs, ws)
    T = sum(ROUNDS[0][0])  # the first plan fixes the token capacity: the widest batch
    K = max(sum(kv) for _, kv, _ in ROUNDS)
    q_static = torch.zeros((T, HQ, D), dtype=dt, device=DEV)
    k_static = torch.zeros((K, HKV, D), dtype=dt, device=DEV)
    v_static = torch.zeros((K, HKV, D), dtype=dt, device=DEV)
    out = torch.full((T, HQ, D), NAN, dtype=dt, device=DEV)
    lse = torch.full((T, HQ), NAN, dtype=torch.float32, device=DEV)
    g = None
    for j, (qo, kv, density) in enumerate(ROUNDS):
        q = _randn((sum(qo), HQ, D), _seed("q", j), dt)
        k = _randn((sum(kv), HKV, D), _seed("k", j), dt)
        v = _randn((sum(kv), HKV, D), _seed("v", j), dt)
        n, m = q.shape[0], k.shape[0]
        q_static[:n].copy_(q)
        k_static[:m].copy_(k)
        v_static[:m].copy_(v)
        masks = _masks(qo, kv, density, _seed("mask", j))
        wr.plan(j, qo, kv, k, v, **_mask_kwargs(masks, packed=bool(j % 2)))
        if g is None:
            # ragged run() checks k/v against this plan's kv_indptr[-1]: views of the static
            # buffers with that many rows (same addresses, so later plans read further rows)
            kv_args = wr.kv_args(k_static[:m], v_static[:m])
            g = _capture(lambda: wr.w.run(q_static, *kv_args, out=out, lse=lse, return_lse=True))
        out.fill_(NAN)
        lse.fill_(NAN)
        g.replay()
        torch.cuda.synchronize()
        _check(q, k, v, qo, kv, masks, out[:n], lse[:n], dt, f"{kind} replay after plan {j}")
        assert torch.isnan(out[n:]).all(), "the replay wrote rows past this plan's tokens"


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_graph_mask_misuse_raises_and_keeps_the_captured_plan(kind):
    dt = torch.float16
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    wr = (_Paged if kind == "paged" else _Ragged)(dt, {}, ws)
    qo, kv, density = ROUNDS[2]
    T, K = sum(qo), sum(kv)
    q = _randn((T, HQ, D), _seed("mq"), dt)
    k = _randn((K, HKV, D), _seed("mk"), dt)
    v = _randn((K, HKV, D), _seed("mv"), dt)
    masks = _masks(qo, kv, density, _seed("mm"))
    wr.plan(0, qo, kv, k, v, **_mask_kwargs(masks, packed=True))  # a 64 KiB mask buffer
    out = torch.full((T, HQ, D), NAN, dtype=dt, device=DEV)
    lse = torch.full((T, HQ), NAN, dtype=torch.float32, device=DEV)
    g = _capture(lambda: wr.w.run(q, *wr.kv_args(k, v), out=out, lse=lse, return_lse=True))

    # (the refused plans below write no K/V: k = v = None)
    # a plan without the mask would be replayed with the captured masked kernel: refused
    with pytest.raises(ValueError, match=r"custom_mask"):
        wr.plan(1, qo, kv, None, None)
    # a mask beyond the buffer sized at the first masked plan: refused, naming the bytes needed
    big_qo, big_kv = [T], [2000]
    need = -(-T * 2000 // 8)
    assert need > 64 << 10
    with pytest.raises(ValueError, match=rf"{need}.*custom_mask_buf"):
        wr.plan(2, big_qo, big_kv, None, None, **_mask_kwargs([np.ones((T, 2000), bool)], packed=False))
    # other options than the captured ones: refused
    with pytest.raises(ValueError, match=r"window_left"):
        wr.plan(3, qo, kv, None, None, window_left=5, **_mask_kwargs(masks, packed=False))
    # the refused plans changed nothing the graph reads: the replay gives the captured plan's answer
    out.fill_(NAN)
    lse.fill_(NAN)
    g.replay()
    torch.cuda.synchronize()
    _check(q, k, v, qo, kv, masks, out, lse, dt, f"{kind} replay after refused plans")
