"""pyflashattn.page on a CUDA GPU: append_paged_kv_cache, get_batch_indices_positions, get_seq_lens.

Caches are random (never zeros) with a guard page on either side; appends are random. After an
append the whole store (guards included) must equal a torch model of the append bit for bit:
every written slot holds the appended bits and every other byte is untouched. Then attention
(BatchPrefillWithPagedKVCacheWrapper) over the appended cache must match the float64 reference
on the dense K/V, so what the append wrote is what attention reads back. The device helpers are
held to their numpy paths; metadata pointing outside the cache must never write outside it
(unchecked) and must raise (PYFLASHATTN_CHECK_METADATA=1).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from pyflashattn.testing.gpu import require_cuda_torch

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()

import pyflashattn  # noqa: E402  (after the GPU probe: the CPU box must skip, not error)
from pyflashattn.testing import attention_ref  # noqa: E402
from pyflashattn.testing.checks import assert_close  # noqa: E402
from pyflashattn.testing.frameworks import capture_torch_graph, jax_gpu  # noqa: E402
from pyflashattn.testing.paged import append_batch  # noqa: E402

DEV = "cuda"
ENV = "PYFLASHATTN_CHECK_METADATA"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.update(e4m3=torch.float8_e4m3fn, e5m2=torch.float8_e5m2)
RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
O_TOL = {torch.float16: dict(atol=1e-3, rtol=1e-3), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def _raw(t):
    """The same bytes as integers (index_put and equality without fp8 / NaN concerns)."""
    return t.view(RAW[t.element_size()])


def _random(shape, dtype, gen):
    """Random values, none zero: normals pushed away from 0 (fp8 rounds small ones to zero)."""
    x = torch.randn(shape, device=DEV, generator=gen)
    return (x + torch.sign(x) * 0.25).to(dtype)


def _i32(a):
    return torch.as_tensor(np.asarray(a, dtype=np.int32), device=DEV)


def _batch_plan(seed, B, ps, spare):
    """A batch that already holds old tokens per request and appends app more (short batches may
    append nothing to some requests)."""
    return append_batch(seed, B, ps, spare, min_app=1 if B >= 6 else 0)


def _scenario(seed, B, ps, H, D, dtype, layout="NHD", form="5d", spare=3):
    """_batch_plan's batch, a random cache with guard pages 0 and P+1 around the P real ones, and
    random keys and values to append."""
    s = _batch_plan(seed, B, ps, spare)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    P = s.P
    page = (ps, H, D) if layout == "NHD" else (H, ps, D)
    if form == "5d":
        store = _random((P + 2, 2) + page, dtype, gen)
        cache = store[1:P + 1]
        k_c, v_c = cache[:, 0], cache[:, 1]
    else:  # (k_cache, v_cache): two tensors with their own page strides
        store = _random((2, P + 2) + page, dtype, gen)
        k_c, v_c = store[0, 1:P + 1], store[1, 1:P + 1]
        cache = (k_c, v_c)
    s.k = _random((s.nnz, H, D), dtype, gen)
    s.v = _random((s.nnz, H, D), dtype, gen)
    s.__dict__.update(H=H, D=D, dtype=dtype, layout=layout, store=store, cache=cache, k_c=k_c, v_c=v_c)
    return s


def _nhd(t, layout):
    return t if layout == "NHD" else t.transpose(1, 2)  # [P, ps, H, D] view of a page tensor


def _model(s, bi, pos, kv_indices=None, base=None):
    """The store's bytes after the append (from base's, default the store's), by torch indexing
    on integer views, skipping what the kernel skips."""
    kv_indices = s.kv_indices if kv_indices is None else kv_indices
    want = (_raw(s.store) if base is None else base).clone()
    k = want.as_strided(s.k_c.shape, s.k_c.stride(), s.k_c.storage_offset() - s.store.storage_offset())
    v = want.as_strided(s.v_c.shape, s.v_c.stride(), s.v_c.storage_offset() - s.store.storage_offset())
    t_ok, t_page, t_slot = [], [], []
    for t, (b, p) in enumerate(zip(np.asarray(bi).tolist(), np.asarray(pos).tolist())):
        if not 0 <= b < s.B or p < 0 or p // s.ps >= s.kv_indptr[b + 1] - s.kv_indptr[b]:
            continue
        pg = int(kv_indices[s.kv_indptr[b] + p // s.ps])
        if 0 <= pg < s.P:
            t_ok.append(t), t_page.append(pg), t_slot.append(p % s.ps)
    if t_ok:
        ti, tp, ts = (torch.as_tensor(x, device=DEV) for x in (t_ok, t_page, t_slot))
        _nhd(k, s.layout)[tp, ts] = _raw(s.k)[ti]
        _nhd(v, s.layout)[tp, ts] = _raw(s.v)[ti]
    return want


def _metadata(s):
    """seq_lens and (batch_indices, positions) on the device, checked against the numpy paths."""
    seq = pyflashattn.get_seq_lens(_i32(s.kv_indptr), _i32(s.last), s.ps)
    np.testing.assert_array_equal(seq.cpu().numpy(), pyflashattn.get_seq_lens(s.kv_indptr, s.last, s.ps))
    np.testing.assert_array_equal(seq.cpu().numpy(), s.new)
    bi, pos = pyflashattn.get_batch_indices_positions(_i32(s.app_indptr), seq, s.nnz)
    bi_h, pos_h = pyflashattn.get_batch_indices_positions(s.app_indptr, s.new.astype(np.int32), s.nnz)
    np.testing.assert_array_equal(bi.cpu().numpy(), bi_h)
    np.testing.assert_array_equal(pos.cpu().numpy(), pos_h)
    return bi, pos


def _append(s, bi, pos, kv_indices=None, kv_indptr=None):
    pyflashattn.append_paged_kv_cache(s.k, s.v, bi, pos, s.cache, _i32(s.kv_indices if kv_indices is None
                                                                       else kv_indices),
                                      _i32(s.kv_indptr if kv_indptr is None else kv_indptr), _i32(s.last),
                                      kv_layout=s.layout)


# ---------------------------------------------------------------- the append, bit for bit

@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("form", ["5d", "tuple"])
def test_append_writes_exactly_the_appended_slots(dtype, ps, layout, form):
    s = _scenario(_seed(dtype, ps, layout, form), 5, ps, 2, 64, DTYPES[dtype], layout, form)
    bi, pos = _metadata(s)
    before = _raw(s.store).clone()
    _append(s, bi, pos)
    torch.cuda.synchronize()
    assert not torch.equal(_raw(s.store), before), "nothing was written"
    assert torch.equal(_raw(s.store), _model(s, bi.cpu(), pos.cpu(), base=before)), "the cache differs from the model"


@pytest.mark.parametrize("hd,H", [(128, 4), (40, 3), (8, 1)])
def test_append_strided_and_odd_rows(hd, H):
    """append_key / append_value as views into wider rows (narrower copies), odd head dims."""
    s = _scenario(_seed("strided", hd), 4, 16, H, hd, torch.float16)
    gen = torch.Generator(device=DEV).manual_seed(7)
    wide_k, wide_v = (_random((s.nnz, H, hd + 3), torch.float16, gen) for _ in range(2))
    s.k, s.v = wide_k[..., 1:1 + hd], wide_v[..., 3:3 + hd]
    bi, pos = _metadata(s)
    before = _raw(s.store).clone()
    _append(s, bi, pos)
    torch.cuda.synchronize()
    assert torch.equal(_raw(s.store), _model(s, bi.cpu(), pos.cpu(), base=before))


# ---------------------------------------------------------------- what the append wrote, attention reads

@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("layout,form,ps", [("NHD", "5d", 16), ("HND", "tuple", 16), ("NHD", "tuple", 1),
                                            ("HND", "5d", 64)])
def test_append_then_attention(dtype, layout, form, ps):
    dt = DTYPES[dtype]
    hkv, hq, d = 2, 4, 128
    s = _scenario(_seed("attn", dtype, layout, form, ps), 4, ps, hkv, d, dt, layout, form)
    # the old tokens: written by torch into the pages, the new ones appended by the kernel
    gen = torch.Generator(device=DEV).manual_seed(_seed("dense", dtype, ps))
    dense_k = [_random((int(n), hkv, d), dt, gen) for n in s.new]
    dense_v = [_random((int(n), hkv, d), dt, gen) for n in s.new]
    for b in range(s.B):
        t = np.arange(int(s.old[b]))
        tp = torch.as_tensor(s.kv_indices[s.kv_indptr[b] + t // ps].astype(np.int64), device=DEV)
        ts = torch.as_tensor(t % ps, device=DEV)
        _nhd(s.k_c, layout)[tp, ts] = dense_k[b][:len(t)]
        _nhd(s.v_c, layout)[tp, ts] = dense_v[b][:len(t)]
    s.k = torch.cat([dense_k[b][int(s.old[b]):] for b in range(s.B)])
    s.v = torch.cat([dense_v[b][int(s.old[b]):] for b in range(s.B)])
    bi, pos = _metadata(s)
    _append(s, bi, pos)
    q = _random((s.nnz, hq, d), dt, gen)
    w = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=DEV),
                                                        layout)
    w.plan(s.app_indptr, s.kv_indptr, s.kv_indices, s.last, hq, hkv, d, ps, causal=True, q_data_type=dt)
    o, lse = w.run(q, s.cache, return_lse=True)
    torch.cuda.synchronize()
    for b in range(s.B):
        a0, a1 = int(s.app_indptr[b]), int(s.app_indptr[b + 1])
        o_ref, _ = attention_ref(q[a0:a1], dense_k[b], dense_v[b], causal=True)
        assert_close(o[a0:a1], o_ref, what=f"request {b} o", **O_TOL[dt])


# ---------------------------------------------------------------- the device helpers

def test_device_helpers_match_numpy_with_padding():
    ip = np.array([0, 3, 3, 10, 11], np.int32)
    sl = np.array([3, 5, 7, 1], np.int32)
    for nnz in (0, 11, 14, 700):  # > ip[-1]: padding tokens get -1; 700: several blocks
        bi, pos = pyflashattn.get_batch_indices_positions(_i32(ip), _i32(sl), nnz)
        assert bi.dtype == torch.int32 and bi.shape == (nnz,) and bi.device.type == "cuda"
        want_bi, want_pos = pyflashattn.get_batch_indices_positions(ip, sl, max(nnz, 11))
        np.testing.assert_array_equal(bi.cpu().numpy(), want_bi[:nnz])
        np.testing.assert_array_equal(pos.cpu().numpy(), want_pos[:nnz])
    ind = np.array([0, 2, 2, 7, 8], np.int32)
    last = np.array([5, 0, 16, 1], np.int32)
    got = pyflashattn.get_seq_lens(_i32(ind), _i32(last), 16)
    np.testing.assert_array_equal(got.cpu().numpy(), [21, 0, 80, 1])


def test_cupy_cache_and_helpers():
    cupy = pytest.importorskip("cupy")
    s = _scenario(_seed("cupy"), 4, 16, 2, 64, torch.float16, "HND", "5d")
    bi, pos = _metadata(s)
    want = _model(s, bi.cpu(), pos.cpu())  # the torch store is not written here: the model of the CuPy copy
    c = lambda t: cupy.asarray(_raw(t).cpu().numpy().view(np.float16))  # noqa: E731
    ci = lambda a: cupy.asarray(np.asarray(a, np.int32))  # noqa: E731
    store, k, v = c(s.store), c(s.k), c(s.v)
    seq = pyflashattn.get_seq_lens(ci(s.kv_indptr), ci(s.last), s.ps)
    cbi, cpos = pyflashattn.get_batch_indices_positions(ci(s.app_indptr), seq, s.nnz)
    assert isinstance(cbi, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(cbi), bi.cpu().numpy())
    pyflashattn.append_paged_kv_cache(k, v, cbi, cpos, store[1:s.P + 1], ci(s.kv_indices), ci(s.kv_indptr),
                                      ci(s.last), kv_layout="HND")
    np.testing.assert_array_equal(cupy.asnumpy(store).view(np.int16), want.cpu().numpy())


def test_jax_cache_is_a_type_error_and_jax_helpers_work():
    jax, jnp, gpu = jax_gpu()
    s = _scenario(_seed("jax"), 3, 16, 2, 64, torch.float16)
    j = lambda a: jax.device_put(jnp.asarray(np.asarray(a, np.int32)), gpu)  # noqa: E731
    cache = jax.device_put(jnp.zeros((s.P, 2, 16, 2, 64), jnp.float16), gpu)
    bi, pos = _metadata(s)
    with pytest.raises(TypeError, match="JAX arrays are immutable"):
        pyflashattn.append_paged_kv_cache(s.k, s.v, bi, pos, cache, _i32(s.kv_indices), _i32(s.kv_indptr),
                                          _i32(s.last))
    seq = pyflashattn.get_seq_lens(j(s.kv_indptr), j(s.last), s.ps)
    jbi, jpos = pyflashattn.get_batch_indices_positions(j(s.app_indptr), seq, s.nnz)
    np.testing.assert_array_equal(np.asarray(seq), s.new)
    np.testing.assert_array_equal(np.asarray(jpos), pos.cpu().numpy())


# ---------------------------------------------------------------- bad metadata

def _corrupted(s, bi, pos):
    """Host copies of the metadata with bad entries: batch indices B and -1, a position one past
    its request's pages and a negative one, page ids P, -1 and INT32_MAX (three distinct entries)."""
    bi, pos, idx = np.asarray(bi.cpu()).copy(), np.asarray(pos.cpu()).copy(), s.kv_indices.copy()
    entry = s.kv_indptr[bi] + pos // s.ps
    picks = [t for t in range(4, s.nnz) if entry[t] not in entry[4:t]][:3]
    assert len(picks) == 3, "the batch is too small to corrupt"
    bi[0], bi[1] = s.B, -1
    pos[2] = (s.kv_indptr[bi[2] + 1] - s.kv_indptr[bi[2]]) * s.ps
    pos[3] = -5
    for t, bad in zip(picks, (s.P, -1, 2**31 - 1)):
        idx[entry[t]] = bad
    return bi, pos, idx


@pytest.mark.parametrize("layout,form", [("NHD", "5d"), ("HND", "tuple")])
def test_out_of_range_metadata_never_writes_outside(layout, form):
    s = _scenario(_seed("oob", layout, form), 6, 4, 2, 64, torch.bfloat16, layout, form, spare=0)
    bi, pos, idx = _corrupted(s, *_metadata(s))
    before = _raw(s.store).clone()
    _append(s, _i32(bi), _i32(pos), kv_indices=idx)
    torch.cuda.synchronize()
    assert torch.equal(_raw(s.store), _model(s, bi, pos, idx, base=before))
    guards = [0, -1] if form == "5d" else [(0, 0), (0, -1), (1, 0), (1, -1)]
    for g in guards:
        assert torch.equal(_raw(s.store)[g], before[g]), f"guard page {g} written"


def test_checked_mode_raises_and_the_library_keeps_working(monkeypatch):
    s = _scenario(_seed("checked"), 6, 4, 2, 64, torch.float16, spare=0)
    good_bi, good_pos = _metadata(s)
    bi, pos, idx = _corrupted(s, good_bi, good_pos)
    before = _raw(s.store).clone()
    monkeypatch.setenv(ENV, "1")
    for args, name in (((_i32(bi), good_pos), "batch_indices"), ((good_bi, _i32(pos)), "positions"),
                       ((good_bi, good_pos, idx), "kv_indices")):
        with pytest.raises(ValueError, match=name):
            _append(s, *args)
    with pytest.raises(TypeError, match="must be int32"):
        _append(s, good_bi.long(), good_pos)
    torch.cuda.synchronize()
    assert torch.equal(_raw(s.store), before), "an append that raised wrote"
    _append(s, good_bi, good_pos)  # checked and valid
    monkeypatch.delenv(ENV)
    torch.cuda.synchronize()
    assert torch.equal(_raw(s.store), _model(s, good_bi.cpu(), good_pos.cpu(), base=before))


def test_graph_capture_and_replay():
    """seq_lens -> batch indices / positions -> append, captured once, replayed on new data."""
    s = _scenario(_seed("graph"), 4, 16, 2, 64, torch.float16)
    ind, last, app_ip = _i32(s.kv_indptr), _i32(s.last), _i32(s.app_indptr)
    idx = _i32(s.kv_indices)
    k, v = s.k.clone(), s.v.clone()

    def step():
        seq = pyflashattn.get_seq_lens(ind, last, s.ps)
        bi, pos = pyflashattn.get_batch_indices_positions(app_ip, seq, s.nnz)
        pyflashattn.append_paged_kv_cache(k, v, bi, pos, s.cache, idx, ind, last)

    g = capture_torch_graph(step)
    gen = torch.Generator(device=DEV).manual_seed(3)
    s.k, s.v = _random(k.shape, k.dtype, gen), _random(v.shape, v.dtype, gen)
    k.copy_(s.k), v.copy_(s.v)
    torch.cuda.synchronize()
    before = _raw(s.store).clone()
    g.replay()
    torch.cuda.synchronize()
    bi, pos = pyflashattn.get_batch_indices_positions(s.app_indptr, s.new.astype(np.int32), s.nnz)
    assert not torch.equal(_raw(s.store), before), "the replay wrote nothing"
    assert torch.equal(_raw(s.store), _model(s, bi, pos, base=before))
