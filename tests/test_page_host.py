"""CPU tests of pyflashattn.page: argument checks (fake DLPack producers: every error before any
launch), the numpy paths of get_batch_indices_positions / get_seq_lens against plain loops, the
checked mode (PYFLASHATTN_CHECK_METADATA=1), and the launches the fake driver records.

The page kernel is simulated here from the params struct it is launched with (pointers and
strides, the skip rules of page.cuh, every copy checked for vec_bytes alignment), over caches in
the fake driver's memory: an append must then equal a numpy model of it, byte for byte, with
the guard pages around the cache untouched. That checks the host's side of the contract (which
half is K, NHD / HND strides, tuples, strided inputs, the copy width); the kernel's own side is
tests/gpu/test_page.py's.
"""
import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

import pyflashattn
from pyflashattn._engine import metadata_check, page as _page
from pyflashattn._runtime import dtypes as _dtypes
from pyflashattn._runtime.params_gen import PageParams
from pyflashattn.page import append_paged_kv_cache, get_batch_indices_positions, get_seq_lens
from pyflashattn.testing.fake_driver import FakeTorchTensor, _TorchDtype
from pyflashattn.testing.fake_tensors import FakeProducer, fake_cuda_tensor

F16, BF16, E4M3 = _dtypes.FLOAT16, _dtypes.BFLOAT16, _dtypes.FLOAT8_E4M3
I32, I64 = _dtypes.INT32, _dtypes.INT64
RAW = {"float16": np.uint16, "bfloat16": np.uint16, "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8,
       "float32": np.uint32, "int32": np.int32}
ENV = metadata_check.ENV


# ---------------------------------------------------------------- the simulated page kernel

def _i32(addr, n):
    return np.frombuffer(ctypes.string_at(addr, 4 * n), np.int32) if n else np.zeros(0, np.int32)


def _simulate_page(p, grid):
    """page.cuh from its params: what the kernel would write (and where it would skip)."""
    if p.mode == 0:
        tpb, vec, eb = p.tokens_per_block, p.vec_bytes, p.elem_bytes
        assert 1 <= tpb <= _page.MAX_TOKENS and grid[0] * tpb >= p.nnz > (grid[0] - 1) * tpb
        assert vec in (1, 2, 4, 8, 16) and (p.head_dim * eb) % vec == 0
        assert tpb * 2 * p.num_heads * (p.head_dim * eb // vec) < 2**31
        bi, pos = _i32(p.batch_indices, p.nnz), _i32(p.positions, p.nnz)
        indptr, idx = _i32(p.kv_indptr, p.batch_size + 1), _i32(p.kv_indices, p.num_indices)
        assert p.kv_last_page_len == 0  # the append does not read it
        for t in range(p.nnz):
            b, q = int(bi[t]), int(pos[t])
            if not 0 <= b < p.batch_size or q < 0:
                continue
            pidx = q // p.page_size
            first, owned = int(indptr[b]), int(indptr[b + 1]) - int(indptr[b])
            if pidx >= owned or not 0 <= first + pidx < p.num_indices:
                continue
            page = int(idx[first + pidx])
            if not 0 <= page < p.num_pages:
                continue
            slot = q % p.page_size
            for h in range(p.num_heads):
                for src, sn, sh, dst, sp, dn, dh in (
                        (p.append_k, p.append_k_stride_n, p.append_k_stride_h, p.k_cache, p.k_stride_page,
                         p.k_stride_n, p.k_stride_h),
                        (p.append_v, p.append_v_stride_n, p.append_v_stride_h, p.v_cache, p.v_stride_page,
                         p.v_stride_n, p.v_stride_h)):
                    s = src + (t * sn + h * sh) * eb
                    d = dst + (page * sp + slot * dn + h * dh) * eb
                    assert s % vec == 0 and d % vec == 0, "a copy the kernel would make misaligned"
                    ctypes.memmove(d, s, p.head_dim * eb)
    elif p.mode == 1:
        assert grid[0] * _page.THREADS >= p.nnz
        ip, sl = _i32(p.append_indptr, p.batch_size + 1), _i32(p.seq_lens, p.batch_size)
        out_b, out_p = np.full(p.nnz, -1, np.int32), np.full(p.nnz, -1, np.int32)
        for i in range(p.nnz):
            b = int(np.searchsorted(ip, i, side="right")) - 1
            if 0 <= b < p.batch_size and ip[b] <= i < ip[b + 1]:
                out_b[i], out_p[i] = b, sl[b] - (ip[b + 1] - ip[b]) + (i - ip[b])
        ctypes.memmove(p.batch_indices, out_b.tobytes(), 4 * p.nnz)
        ctypes.memmove(p.positions, out_p.tobytes(), 4 * p.nnz)
    else:
        assert p.mode == 2 and grid[0] * _page.THREADS >= p.batch_size
        ind, last = _i32(p.kv_indptr, p.batch_size + 1), _i32(p.kv_last_page_len, p.batch_size)
        pages = np.diff(ind)
        out = np.where(pages > 0, (pages - 1) * p.page_size + last, 0).astype(np.int32)
        ctypes.memmove(p.seq_lens, out.tobytes(), 4 * p.batch_size)


@pytest.fixture
def env(fake, fake_torch, monkeypatch):
    """The fake driver and torch with int32 tensors, outputs backed by memory and the simulated
    page kernel."""
    ft = fake_torch
    ft.dtypes["int32"] = _TorchDtype("int32")
    ft.module.int32 = ft.dtypes["int32"]
    monkeypatch.setattr(FakeTorchTensor, "new_empty", lambda self, shape, dtype=None: ft.tensor(tuple(shape),
                                                                                                 dtype or self.dtype))
    # real torch tensors have __dlpack__ (what tells a device array from host data); read by attributes
    monkeypatch.setattr(FakeTorchTensor, "__dlpack__", lambda self, **kw: pytest.fail("read torch by attributes"),
                        raising=False)
    # the fake launches pfa_page (the variant table's row, PAGE_THREADS); its model runs at each launch
    fake.cu.simulators[PageParams] = lambda p, grid, name: _simulate_page(p, grid)
    monkeypatch.delenv(ENV, raising=False)
    return SimpleNamespace(fake=fake, ft=ft)


class Mem:
    """A numpy array of raw bits mirrored into fake device memory; tensors are views into it."""

    def __init__(self, env, store):
        self.env, self.store = env, np.ascontiguousarray(store)
        self.addr = env.fake.cu._alloc(self.store.nbytes)
        ctypes.memmove(self.addr, self.store.ctypes.data, self.store.nbytes)

    def tensor(self, view, dtype_name):
        off = view.__array_interface__["data"][0] - self.store.__array_interface__["data"][0]
        t = FakeTorchTensor(self.env.ft, tuple(view.shape), self.env.ft.dtypes[dtype_name], self.addr + off)
        t._strides = tuple(s // view.itemsize for s in view.strides)
        return t

    def read(self):
        raw = ctypes.string_at(self.addr, self.store.nbytes)
        return np.frombuffer(raw, self.store.dtype).reshape(self.store.shape)


def _i32_tensor(env, a):
    m = Mem(env, np.asarray(a, np.int32).reshape(-1))
    return m.tensor(m.store, "int32")


def _batch(rng, B, ps):
    """A random batch after growing its pages: (kv_indptr, kv_indices, last_page_len, append_indptr)
    with every request's appended tokens inside the pages it owns."""
    pages = rng.integers(0, 4, B)
    pages[0] = max(pages[0], 1)
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    kv_len = np.array([rng.integers((n - 1) * ps + 1, n * ps + 1) if n else 0 for n in pages])
    last = np.where(pages > 0, kv_len - (pages - 1) * ps, 0).astype(np.int32)
    app = np.array([rng.integers(0, k + 1) if k else 0 for k in kv_len])
    app[0] = max(app[0], 1)
    return kv_indptr, last, np.concatenate([[0], np.cumsum(app)]).astype(np.int32)


def _append_case(env, seed, layout="NHD", form="5d", ps=16, dtype="float16", H=2, D=16, B=4, P=12):
    """A random cache (with a guard page on either side), a random append and the call's arguments."""
    rng = np.random.default_rng(seed)
    raw = RAW[dtype]
    kv_indptr, last, app_indptr = _batch(rng, B, ps)
    n_pages = int(kv_indptr[-1])
    P = max(P, n_pages)
    kv_indices = rng.permutation(P)[:n_pages].astype(np.int32)
    seq = get_seq_lens(kv_indptr, last, ps)
    nnz = int(app_indptr[-1])
    bi, pos = get_batch_indices_positions(app_indptr, seq, nnz)
    page_dims = ((ps, H, D) if layout == "NHD" else (H, ps, D)) if ps > 1 or form in ("5d", "tuple") else (H, D)
    hi = np.iinfo(raw).max
    if form in ("5d", "4d"):
        store = rng.integers(1, hi, (P + 2, 2) + page_dims, dtype=raw, endpoint=True)
        cache = store[1:P + 1]
        k_np, v_np = cache[:, 0], cache[:, 1]
    else:  # "tuple" / "tuple3": K and V in one store, apart
        store = rng.integers(1, hi, (2, P + 2) + page_dims, dtype=raw, endpoint=True)
        k_np, v_np = store[0, 1:P + 1], store[1, 1:P + 1]
    mem = Mem(env, store)
    ak = Mem(env, rng.integers(1, hi, (nnz, H, D), dtype=raw, endpoint=True))
    av = Mem(env, rng.integers(1, hi, (nnz, H, D), dtype=raw, endpoint=True))
    kv_cache = (mem.tensor(cache, dtype) if form in ("5d", "4d")
                else (mem.tensor(k_np, dtype), mem.tensor(v_np, dtype)))
    args = [ak.tensor(ak.store, dtype), av.tensor(av.store, dtype), _i32_tensor(env, bi), _i32_tensor(env, pos),
            kv_cache, _i32_tensor(env, kv_indices), _i32_tensor(env, kv_indptr), _i32_tensor(env, last)]
    return SimpleNamespace(args=args, mem=mem, store=store, k_np=k_np, v_np=v_np, ak=ak.store, av=av.store, bi=bi,
                           pos=pos, kv_indices=kv_indices, kv_indptr=kv_indptr, last=last, ps=ps, layout=layout, P=P,
                           B=B, nnz=nnz, H=H, D=D, form=form)


def _model(c, bi=None, pos=None, kv_indices=None):
    """The whole store after the append, in numpy (skipping what page.cuh skips)."""
    bi = c.bi if bi is None else bi
    pos = c.pos if pos is None else pos
    kv_indices = c.kv_indices if kv_indices is None else kv_indices
    want = c.store.copy()
    # the same views of the copy as k_np / v_np of the store
    off_k = c.k_np.__array_interface__["data"][0] - c.store.__array_interface__["data"][0]
    off_v = c.v_np.__array_interface__["data"][0] - c.store.__array_interface__["data"][0]
    k = np.lib.stride_tricks.as_strided(want.reshape(-1)[off_k // want.itemsize:], c.k_np.shape, c.k_np.strides)
    v = np.lib.stride_tricks.as_strided(want.reshape(-1)[off_v // want.itemsize:], c.v_np.shape, c.v_np.strides)
    if k.ndim == 3:  # page_size 1: [P, H, D]
        k, v = k[:, None], v[:, None]
    elif c.layout == "HND":
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    for t in range(len(bi)):
        b, q = int(bi[t]), int(pos[t])
        if not 0 <= b < c.B or q < 0 or q // c.ps >= c.kv_indptr[b + 1] - c.kv_indptr[b]:
            continue
        page = int(kv_indices[c.kv_indptr[b] + q // c.ps])
        if 0 <= page < c.P:
            k[page, q % c.ps] = c.ak[t]
            v[page, q % c.ps] = c.av[t]
    return want


def _launches(env):
    return [x for x in env.fake.cu.launches if isinstance(x[3], PageParams)]


# ---------------------------------------------------------------- append: results and launch arguments

@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("form", ["5d", "tuple"])
@pytest.mark.parametrize("ps,dtype", [(1, "float16"), (16, "float16"), (16, "bfloat16"), (64, "float8_e4m3fn"),
                                      (5, "float8_e5m2"), (16, "float32")])
def test_append_matches_the_model(env, layout, form, ps, dtype):
    c = _append_case(env, hash((layout, form, ps, dtype)) & 0xFFFF, layout, form, ps, dtype)
    env.ft.stream = 0x77
    assert append_paged_kv_cache(*c.args, kv_layout=layout) is None
    got = c.mem.read()
    assert not np.array_equal(got, c.store), "nothing was written"
    np.testing.assert_array_equal(got, _model(c))
    (_, grid, stream, p), = _launches(env)
    item = np.dtype(RAW[dtype]).itemsize
    assert stream == 0x77 and p.mode == _page.APPEND and p.nnz == c.nnz and p.batch_size == c.B
    assert (p.num_heads, p.head_dim, p.page_size, p.num_pages) == (c.H, c.D, ps, c.P)
    assert p.num_indices == len(c.kv_indices) and p.elem_bytes == item
    assert p.vec_bytes == 16 and p.kv_last_page_len == 0  # contiguous: 16-byte copies; last_page_len unused
    assert p.k_cache == c.args[4][0].data_ptr() if form == "tuple" else p.k_cache == c.args[4].data_ptr()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("form", ["4d", "tuple3"])
def test_one_dim_less_is_page_size_one(env, layout, form):
    c = _append_case(env, 5, layout, form, 1)
    assert c.k_np.ndim == 3
    append_paged_kv_cache(*c.args, kv_layout=layout)
    np.testing.assert_array_equal(c.mem.read(), _model(c))
    assert _launches(env)[-1][3].page_size == 1


def test_strided_inputs_narrow_the_copy(env):
    """append_key a view of wider rows at an odd element offset: 2-byte copies, same result."""
    c = _append_case(env, 11, "NHD", "5d", 16, "float16", D=24)
    wide = Mem(env, np.random.default_rng(1).integers(1, 60000, (c.nnz, c.H, c.D + 3), dtype=np.uint16))
    view = wide.store[:, :, 1:1 + c.D]
    c.ak = view
    c.args[0] = wide.tensor(view, "float16")
    append_paged_kv_cache(*c.args)
    np.testing.assert_array_equal(c.mem.read(), _model(c))
    p = _launches(env)[-1][3]
    assert p.vec_bytes == 2 and (p.append_k_stride_n, p.append_k_stride_h) == (c.H * (c.D + 3), c.D + 3)
    # 48-byte rows and 16-byte aligned everything else: 16 bytes
    c2 = _append_case(env, 12, "HND", "tuple", 16, "float16", D=24)
    append_paged_kv_cache(*c2.args, kv_layout="HND")
    assert _launches(env)[-1][3].vec_bytes == 16


def test_tokens_per_block_follows_the_row_size(env):
    c = _append_case(env, 3, "NHD", "5d", 16, "float16", H=1, D=8)  # 16-byte rows: 2 copies a token
    append_paged_kv_cache(*c.args)
    assert _launches(env)[-1][3].tokens_per_block == _page.MAX_TOKENS
    c = _append_case(env, 3, "NHD", "5d", 16, "float32", H=16, D=128)  # K + V: 16 KiB a token
    append_paged_kv_cache(*c.args)
    p = _launches(env)[-1][3]
    assert p.tokens_per_block == 1 and _launches(env)[-1][1] == (c.nnz, 1, 1)


def test_out_of_range_metadata_is_skipped(env):
    """Unchecked: bad batch indices, positions and page ids are skipped; nothing outside the
    cache's valid pages changes (the guard pages included)."""
    c = _append_case(env, 21, "NHD", "5d", 4, "float16", B=5, P=16)
    assert c.nnz >= 6
    bi, pos, idx = c.bi.copy(), c.pos.copy(), c.kv_indices.copy()
    bi[0], bi[1] = c.B, -1
    pos[2] = (c.kv_indptr[bi[2] + 1] - c.kv_indptr[bi[2]]) * c.ps  # one past the request's pages
    pos[3] = -3
    idx[c.kv_indptr[bi[4]] + pos[4] // c.ps] = c.P  # page id == num_pages
    idx[c.kv_indptr[bi[5]] + pos[5] // c.ps] = -1
    args = list(c.args)
    args[2], args[3], args[5] = _i32_tensor(env, bi), _i32_tensor(env, pos), _i32_tensor(env, idx)
    append_paged_kv_cache(*args)
    got = c.mem.read()
    np.testing.assert_array_equal(got, _model(c, bi, pos, idx))
    np.testing.assert_array_equal(got[0], c.store[0])
    np.testing.assert_array_equal(got[-1], c.store[-1])


def test_nothing_to_append_launches_nothing(env):
    c = _append_case(env, 2)
    ak = Mem(env, np.zeros((0, c.H, c.D), np.uint16))
    e = _i32_tensor(env, [])
    append_paged_kv_cache(ak.tensor(ak.store, "float16"), ak.tensor(ak.store, "float16"), e, e, *c.args[4:])
    assert not _launches(env)


# ---------------------------------------------------------------- append: the checked mode

def test_metadata_checks_enabled_reads_the_environment(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert not metadata_check.metadata_checks_enabled()
    for val, on in (("1", True), ("0", False), ("", False), ("yes", False)):
        monkeypatch.setenv(ENV, val)
        assert metadata_check.metadata_checks_enabled() is on


def _corrupt(c, what):
    bi, pos, idx, ind = c.bi.copy(), c.pos.copy(), c.kv_indices.copy(), c.kv_indptr.copy()
    if what == "page_high":
        idx[0] = c.P
    elif what == "page_negative":
        idx[-1] = -2
    elif what == "batch_high":
        bi[1] = c.B
    elif what == "batch_negative":
        bi[0] = -1
    elif what == "position_beyond":
        pos[0] = (c.kv_indptr[bi[0] + 1] - c.kv_indptr[bi[0]]) * c.ps
    elif what == "position_negative":
        pos[0] = -1
    elif what == "indptr_decreasing":
        ind[1], ind[2] = ind[2] + 1, ind[2]
    elif what == "indptr_past_indices":
        ind[-1] = len(idx) + 1
    return bi, pos, idx, ind


@pytest.mark.parametrize("what,name", [
    ("page_high", r"kv_indices\[0\] = 12 is outside \[0, 12\)"), ("page_negative", r"kv_indices\[\d+\] = -2"),
    ("batch_high", r"batch_indices\[1\] = 4 is outside \[0, 4\)"), ("batch_negative", r"batch_indices\[0\] = -1"),
    ("position_beyond", r"positions\[0\] = \d+ is outside \[0, \d+\)"), ("position_negative", r"positions\[0\] = -1"),
    ("indptr_decreasing", "kv_indptr must be >= 0 and non-decreasing"),
    ("indptr_past_indices", r"kv_indptr\[-1\] = \d+ exceeds len\(kv_indices\)")])
def test_checked_mode_raises_naming_the_argument(env, monkeypatch, what, name):
    c = _append_case(env, 31, P=12, B=4)
    assert len(c.kv_indices) >= 2 and c.nnz >= 2 and c.kv_indptr[2] <= c.kv_indptr[-1]
    bi, pos, idx, ind = _corrupt(c, what)
    args = list(c.args)
    args[2], args[3], args[5], args[6] = (_i32_tensor(env, a) for a in (bi, pos, idx, ind))
    append_paged_kv_cache(*args)  # unchecked: launched, the bad tokens skipped
    assert len(_launches(env)) == 1
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(ValueError, match=name):
        append_paged_kv_cache(*args)
    assert len(_launches(env)) == 1
    assert ENV in str(pytest.raises(ValueError, append_paged_kv_cache, *args).value)


def test_checked_mode_copies_good_metadata_then_launches(env, monkeypatch):
    c = _append_case(env, 32)
    monkeypatch.setenv(ENV, "1")
    append_paged_kv_cache(*c.args)
    np.testing.assert_array_equal(c.mem.read(), _model(c))
    log = [x[0] for x in env.fake.cu.log]
    assert log.count("dtoh") == 4 and "sync" in log and log[-1] == "launch"
    monkeypatch.setenv(ENV, "0")
    n = len(env.fake.cu.log)
    append_paged_kv_cache(*c.args)
    assert [x[0] for x in env.fake.cu.log[n:]] == ["launch"]  # unchecked: no copy, no sync


# ---------------------------------------------------------------- append: argument checks

def _fakes(layout="NHD", P=6, ps=4, H=2, D=8, nnz=5, B=3, dtype=F16):
    cache_shape = (P, 2, ps, H, D) if layout == "NHD" else (P, 2, H, ps, D)
    return dict(append_key=fake_cuda_tensor((nnz, H, D), dtype), append_value=fake_cuda_tensor((nnz, H, D), dtype),
                batch_indices=fake_cuda_tensor((nnz,), I32), positions=fake_cuda_tensor((nnz,), I32),
                paged_kv_cache=fake_cuda_tensor(cache_shape, dtype), kv_indices=fake_cuda_tensor((P,), I32),
                kv_indptr=fake_cuda_tensor((B + 1,), I32), kv_last_page_len=fake_cuda_tensor((B,), I32))


class _FakeJax(FakeProducer):
    pass


_FakeJax.__module__ = "jax._src.array"


def _cpu(shape, dtype):
    return FakeProducer(shape=shape, strides=tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape))),
                        dtype=dtype, device=(1, 0))


BAD_APPEND = [
    ("layout", dict(kv_layout="NDH"), ValueError, "kv_layout must be 'NHD' or 'HND'"),
    ("jax_cache", dict(paged_kv_cache=_FakeJax(shape=(6, 2, 4, 2, 8), strides=(128, 64, 16, 8, 1))), TypeError,
     "paged_kv_cache is a JAX array: JAX arrays are immutable"),
    ("jax_tuple", dict(paged_kv_cache=(fake_cuda_tensor((6, 4, 2, 8), F16),
                                       _FakeJax(shape=(6, 4, 2, 8), strides=(64, 16, 8, 1)))), TypeError,
     "v_cache is a JAX array"),
    ("cache_cpu", dict(paged_kv_cache=_cpu((6, 2, 4, 2, 8), F16)), ValueError,
     "paged_kv_cache is on the CPU; pyflashattn needs CUDA tensors"),
    ("key_cpu", dict(append_key=_cpu((5, 2, 8), F16)), ValueError,
     "append_key is on the CPU; pyflashattn needs CUDA tensors"),
    ("indices_numpy", dict(batch_indices=np.zeros(5, np.int32)), ValueError,
     "batch_indices is on the CPU; pyflashattn needs CUDA tensors"),
    ("indptr_cpu", dict(kv_indptr=_cpu((4,), I32)), ValueError, "kv_indptr is on the CPU"),
    ("other_device", dict(append_value=fake_cuda_tensor((5, 2, 8), F16, device=(2, 1))), ValueError,
     "append_value is on cuda:1 but paged_kv_cache is on cuda:0"),
    ("positions_other_device", dict(positions=fake_cuda_tensor((5,), I32, device=(2, 1))), ValueError,
     "positions is on cuda:1"),
    ("key_dtype", dict(append_key=fake_cuda_tensor((5, 2, 8), BF16)), TypeError,
     "append_key has dtype bfloat16 but paged_kv_cache holds float16"),
    ("value_dtype", dict(append_value=fake_cuda_tensor((5, 2, 8), E4M3)), TypeError,
     "append_value has dtype float8_e4m3fn"),
    ("cache_dtype", dict(paged_kv_cache=fake_cuda_tensor((6, 2, 4, 2, 8), _dtypes.INT8)), TypeError,
     "paged_kv_cache has dtype int8"),
    ("cache_rank", dict(paged_kv_cache=fake_cuda_tensor((6, 8, 2, 8), F16)), ValueError,
     "paged_kv_cache must have shape"),
    ("cache_not_kv", dict(paged_kv_cache=fake_cuda_tensor((6, 3, 4, 2, 8), F16)), ValueError,
     r"got \(6, 3, 4, 2, 8\)"),
    ("cache_last_dim", dict(paged_kv_cache=fake_cuda_tensor((6, 2, 4, 2, 8), F16, strides=(256, 128, 32, 16, 2))),
     ValueError, "paged_kv_cache must be contiguous in its last dim"),
    ("page_size_zero", dict(paged_kv_cache=fake_cuda_tensor((6, 2, 0, 2, 8), F16)), ValueError, "page_size 0"),
    ("tuple_len", dict(paged_kv_cache=(fake_cuda_tensor((6, 4, 2, 8), F16),)), ValueError,
     "tuple must be \\(k_cache, v_cache\\)"),
    ("tuple_shapes", dict(paged_kv_cache=(fake_cuda_tensor((6, 4, 2, 8), F16), fake_cuda_tensor((6, 4, 2, 4), F16))),
     ValueError, "k_cache and v_cache must have one shape"),
    ("tuple_dtypes", dict(paged_kv_cache=(fake_cuda_tensor((6, 4, 2, 8), F16), fake_cuda_tensor((6, 4, 2, 8), BF16))),
     TypeError, "v_cache has dtype bfloat16 but k_cache has float16"),
    ("tuple_rank", dict(paged_kv_cache=(fake_cuda_tensor((6, 2, 4, 2, 8), F16),) * 2), ValueError,
     "k_cache and v_cache must have one shape"),
    ("tuple_devices", dict(paged_kv_cache=(fake_cuda_tensor((6, 4, 2, 8), F16),
                                           fake_cuda_tensor((6, 4, 2, 8), F16, device=(2, 1)))), ValueError,
     "v_cache is on cuda:1 but k_cache is on cuda:0"),
    ("key_rank", dict(append_key=fake_cuda_tensor((5, 16), F16)), ValueError, "append_key must be 3-D"),
    ("key_heads", dict(append_key=fake_cuda_tensor((5, 4, 8), F16)), ValueError,
     r"append_key has shape \(5, 4, 8\) but paged_kv_cache has num_kv_heads = 2"),
    ("value_head_dim", dict(append_value=fake_cuda_tensor((5, 2, 16), F16)), ValueError,
     "append_value has shape .* head_dim = 8"),
    ("kv_rows", dict(append_value=fake_cuda_tensor((4, 2, 8), F16)), ValueError,
     "append_key and append_value must have the same shape"),
    ("key_last_dim", dict(append_key=fake_cuda_tensor((5, 2, 8), F16, strides=(32, 16, 2))), ValueError,
     "append_key must be contiguous in its last dim"),
    ("batch_int64", dict(batch_indices=fake_cuda_tensor((5,), I64)), TypeError,
     "batch_indices must be int32, got int64"),
    ("positions_int64", dict(positions=fake_cuda_tensor((5,), I64)), TypeError, "positions must be int32"),
    ("indices_int64", dict(kv_indices=fake_cuda_tensor((6,), I64)), TypeError, "kv_indices must be int32"),
    ("indptr_uint32", dict(kv_indptr=fake_cuda_tensor((4,), _dtypes.UINT32)), TypeError, "kv_indptr must be int32"),
    ("last_int64", dict(kv_last_page_len=fake_cuda_tensor((3,), I64)), TypeError, "kv_last_page_len must be int32"),
    ("batch_len", dict(batch_indices=fake_cuda_tensor((4,), I32)), ValueError,
     "batch_indices has 4 entries but append_key has nnz = 5"),
    ("positions_len", dict(positions=fake_cuda_tensor((6,), I32)), ValueError, "positions has 6 entries"),
    ("last_len", dict(kv_last_page_len=fake_cuda_tensor((4,), I32)), ValueError,
     "kv_last_page_len has 4 entries but kv_indptr describes batch_size = 3"),
    ("indptr_empty", dict(kv_indptr=fake_cuda_tensor((0,), I32)), ValueError, "kv_indptr must have batch_size \\+ 1"),
    ("indices_2d", dict(kv_indices=fake_cuda_tensor((3, 2), I32)), ValueError, "kv_indices must be 1-D"),
    ("positions_strided", dict(positions=fake_cuda_tensor((5,), I32, strides=(2,))), ValueError,
     "positions must be contiguous"),
    ("not_dlpack", dict(kv_indices=[0, 1, 2]), TypeError, "kv_indices must be a DLPack tensor"),
    # everything else valid: the last check, before the driver, refuses a cache it cannot write
    ("cache_framework", dict(), TypeError, "paged_kv_cache: a cache of framework 'other' cannot be written"),
]


@pytest.mark.parametrize("case,change,exc,msg", BAD_APPEND, ids=[b[0] for b in BAD_APPEND])
def test_append_rejects_bad_arguments_before_any_launch(fake, case, change, exc, msg):
    kw = _fakes()
    kw.update(change)
    with pytest.raises(exc, match=msg):
        append_paged_kv_cache(**kw)
    assert not fake.cu.launches and not [x for x in fake.cu.log if x[0] in ("dtoh", "sync")]


def test_hnd_and_tuple_shapes_are_read_by_layout(fake):
    kw = _fakes("HND")
    with pytest.raises(TypeError, match="framework 'other'"):  # valid up to the framework check
        append_paged_kv_cache(**kw, kv_layout="HND")
    with pytest.raises(ValueError, match="num_kv_heads = 4"):  # [6, 2, 2, 4, 8] read as NHD: 4 heads
        append_paged_kv_cache(**kw)
    kw["paged_kv_cache"] = (fake_cuda_tensor((6, 2, 4, 8), F16), fake_cuda_tensor((6, 2, 4, 8), F16))
    with pytest.raises(TypeError, match="k_cache: a cache of framework"):
        append_paged_kv_cache(**kw, kv_layout="HND")


def test_library_keeps_working_after_errors(env, monkeypatch):
    c = _append_case(env, 41)
    with pytest.raises(ValueError, match="kv_layout"):
        append_paged_kv_cache(*c.args, kv_layout="nhd")
    with pytest.raises(ValueError, match="kv_last_page_len has 1 entries"):
        append_paged_kv_cache(*c.args[:7], _i32_tensor(env, [1]))
    monkeypatch.setenv(ENV, "1")
    bad = _i32_tensor(env, np.full(c.nnz, c.B, np.int32))
    with pytest.raises(ValueError, match="batch_indices"):
        append_paged_kv_cache(c.args[0], c.args[1], bad, *c.args[3:])
    assert not _launches(env)
    append_paged_kv_cache(*c.args)
    np.testing.assert_array_equal(c.mem.read(), _model(c))


# ---------------------------------------------------------------- get_batch_indices_positions

def _loop_batch_positions(ip, sl, nnz):
    bi, pos = [-1] * nnz, [-1] * nnz
    for b in range(len(ip) - 1):
        for j, i in enumerate(range(ip[b], ip[b + 1])):
            bi[i], pos[i] = b, sl[b] - (ip[b + 1] - ip[b]) + j
    return np.array(bi, np.int32), np.array(pos, np.int32)


def test_batch_indices_positions_flashinfer_example():
    bi, pos = get_batch_indices_positions(np.array([0, 1, 3, 6, 10], np.int32), np.full(4, 5, np.int32), 10)
    assert bi.dtype == np.int32 and pos.dtype == np.int32
    np.testing.assert_array_equal(bi, [0, 1, 1, 2, 2, 2, 3, 3, 3, 3])
    np.testing.assert_array_equal(pos, [4, 3, 4, 2, 3, 4, 1, 2, 3, 4])


@pytest.mark.parametrize("seed", range(8))
def test_batch_indices_positions_match_a_loop(seed):
    rng = np.random.default_rng(seed)
    B = int(rng.integers(0, 9))
    lens = rng.integers(0, 6, B) * (rng.random(B) > 0.2)
    ip = np.concatenate([[int(rng.integers(0, 3))], lens]).cumsum().astype(np.int32)
    sl = (lens + rng.integers(0, 40, B)).astype(np.int32)
    nnz = int(ip[-1]) + int(rng.integers(0, 4))  # padding tokens: -1
    bi, pos = get_batch_indices_positions(ip, sl, nnz)
    want_bi, want_pos = _loop_batch_positions(ip, sl, nnz)
    np.testing.assert_array_equal(bi, want_bi)
    np.testing.assert_array_equal(pos, want_pos)
    bi2, pos2 = get_batch_indices_positions(ip.tolist(), sl.astype(np.int64), nnz)  # lists, int64 on the host
    np.testing.assert_array_equal(bi2, want_bi)
    np.testing.assert_array_equal(pos2, want_pos)


@pytest.mark.parametrize("args,exc,msg", [
    (([0, 2, 1], [2, 2], 3), ValueError, "append_indptr must be >= 0 and non-decreasing"),
    (([-1, 2], [2], 3), ValueError, "append_indptr must be >= 0"),
    (([0, 2, 5], [2, 3], 4), ValueError, r"append_indptr\[-1\] = 5 exceeds nnz = 4"),
    (([0, 2, 5], [2], 5), ValueError, "seq_lens has 1 entries but append_indptr describes batch_size = 2"),
    (([], [], 0), ValueError, "append_indptr must have batch_size \\+ 1 >= 1"),
    (([0, 1], [1], -1), ValueError, "nnz must be an int >= 0"),
    (([0, 1], [1], 1.0), ValueError, "nnz must be an int >= 0"),
    (([0, 1], [1], True), ValueError, "nnz must be an int >= 0"),
    (([0, 1], [[1]], 1), ValueError, "seq_lens must be 1-D"),
    (([0, 1], [1.5], 1), TypeError, "seq_lens must hold integers"),
])
def test_batch_indices_positions_host_errors(args, exc, msg):
    with pytest.raises(exc, match=msg):
        get_batch_indices_positions(*args)


def test_batch_indices_positions_on_the_device(env):
    ip = np.array([0, 3, 3, 7], np.int32)
    sl = np.array([10, 0, 4], np.int32)
    env.ft.stream = 0x99
    bi, pos = get_batch_indices_positions(_i32_tensor(env, ip), _i32_tensor(env, sl), 9)
    assert isinstance(bi, FakeTorchTensor) and bi.shape == (9,) and str(bi.dtype) == "torch.int32"
    want_bi, want_pos = _loop_batch_positions(ip, sl, 9)
    np.testing.assert_array_equal(_i32(bi.data_ptr(), 9), want_bi)
    np.testing.assert_array_equal(_i32(pos.data_ptr(), 9), want_pos)
    (_, grid, stream, p), = _launches(env)
    assert (p.mode, p.nnz, p.batch_size, grid, stream) == (_page.BATCH_POSITIONS, 9, 3, (1, 1, 1), 0x99)
    assert (p.batch_indices, p.positions) == (bi.data_ptr(), pos.data_ptr())
    assert not [x for x in env.fake.cu.log if x[0] in ("dtoh", "sync")]  # graph-safe: no sync
    bi, pos = get_batch_indices_positions(_i32_tensor(env, ip), _i32_tensor(env, sl), 600)  # 3 blocks
    assert _launches(env)[-1][1] == (3, 1, 1)
    np.testing.assert_array_equal(_i32(bi.data_ptr(), 600), _loop_batch_positions(ip, sl, 600)[0])
    e = get_batch_indices_positions(_i32_tensor(env, ip), _i32_tensor(env, sl), 0)
    assert e[0].shape == (0,) and len(_launches(env)) == 2


def test_batch_indices_positions_device_errors(env):
    ip, sl = _i32_tensor(env, [0, 2]), _i32_tensor(env, [2])
    with pytest.raises(ValueError, match="seq_lens is on the CPU; pyflashattn needs CUDA tensors: append_indptr is "
                                         "on cuda:0"):
        get_batch_indices_positions(ip, np.array([2], np.int32), 2)
    with pytest.raises(ValueError, match="append_indptr is on the CPU"):
        get_batch_indices_positions([0, 2], sl, 2)
    with pytest.raises(TypeError, match="seq_lens must be int32, got int64"):
        get_batch_indices_positions(ip, fake_cuda_tensor((1,), I64), 2)
    with pytest.raises(ValueError, match="seq_lens has 2 entries"):
        get_batch_indices_positions(ip, _i32_tensor(env, [2, 2]), 2)
    with pytest.raises(ValueError, match="seq_lens is on cuda:1 but append_indptr is on cuda:0"):
        get_batch_indices_positions(ip, fake_cuda_tensor((1,), I32, device=(2, 1)), 2)
    with pytest.raises(TypeError, match="append_indptr: CUDA arrays of framework 'other'"):
        get_batch_indices_positions(fake_cuda_tensor((2,), I32), fake_cuda_tensor((1,), I32), 2)
    assert not _launches(env)


# ---------------------------------------------------------------- get_seq_lens

def _loop_seq_lens(ind, last, ps):
    return np.array([(ind[b + 1] - ind[b] - 1) * ps + last[b] if ind[b + 1] > ind[b] else 0
                     for b in range(len(ind) - 1)], np.int32)


@pytest.mark.parametrize("seed", range(6))
def test_seq_lens_match_a_loop(seed):
    rng = np.random.default_rng(seed)
    B, ps = int(rng.integers(0, 10)), int(rng.choice([1, 3, 16]))
    pages = rng.integers(0, 5, B)
    ind = np.concatenate([[0], pages]).cumsum().astype(np.int32)
    last = np.where(pages > 0, rng.integers(1, ps + 1, B), rng.integers(0, 2, B)).astype(np.int32)
    out = get_seq_lens(ind, last, ps)
    assert out.dtype == np.int32 and out.shape == (B,)
    np.testing.assert_array_equal(out, _loop_seq_lens(ind, last, ps))
    np.testing.assert_array_equal(get_seq_lens(ind.tolist(), last.tolist(), np.int64(ps)), out)


def test_seq_lens_zero_without_pages():
    # FlashInfer's get_length: 0 for a request without pages, whatever its last_page_len
    np.testing.assert_array_equal(get_seq_lens(np.array([0, 0, 2, 2]), np.array([0, 7, 3]), 16), [0, 23, 0])


@pytest.mark.parametrize("args,exc,msg", [
    (([0, 1], [1], 0), ValueError, "page_size must be a positive int"),
    (([0, 1], [1], 2.0), ValueError, "page_size must be a positive int"),
    (([0, 1], [1], 2**31), ValueError, "page_size = 2147483648 exceeds"),
    (([0, 1, 2], [1], 4), ValueError, "kv_last_page_len has 1 entries but kv_indptr describes batch_size = 2"),
    (([], [], 4), ValueError, "kv_indptr must have batch_size \\+ 1 >= 1"),
    (([0, 1], ["a"], 4), TypeError, "kv_last_page_len must hold integers"),
])
def test_seq_lens_host_errors(args, exc, msg):
    with pytest.raises(exc, match=msg):
        get_seq_lens(*args)


def test_seq_lens_on_the_device(env):
    ind, last = np.array([0, 2, 2, 5], np.int32), np.array([3, 9, 16], np.int32)
    out = get_seq_lens(_i32_tensor(env, ind), _i32_tensor(env, last), 16)
    np.testing.assert_array_equal(_i32(out.data_ptr(), 3), [19, 0, 48])
    (_, grid, _, p), = _launches(env)
    assert (p.mode, p.batch_size, p.page_size, grid) == (_page.SEQ_LENS, 3, 16, (1, 1, 1))
    assert (p.kv_indptr, p.seq_lens) == (_launches(env)[0][3].kv_indptr, out.data_ptr())
    with pytest.raises(TypeError, match="kv_last_page_len must be int32"):
        get_seq_lens(_i32_tensor(env, ind), fake_cuda_tensor((3,), I64), 16)
    with pytest.raises(ValueError, match="kv_last_page_len is on the CPU"):
        get_seq_lens(_i32_tensor(env, ind), last, 16)
    assert get_seq_lens(_i32_tensor(env, [0]), _i32_tensor(env, []), 16).shape == (0,)
    assert len(_launches(env)) == 1


def test_top_level_exports():
    assert pyflashattn.append_paged_kv_cache is append_paged_kv_cache
    assert pyflashattn.get_batch_indices_positions is get_batch_indices_positions
    assert pyflashattn.get_seq_lens is get_seq_lens and pyflashattn.page.get_seq_lens is get_seq_lens
