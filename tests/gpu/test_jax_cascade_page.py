"""pyflashattn.jax's merge_state / merge_states and paged-cache helpers inside jax.jit, on fresh
seeded random inputs.

Merges against the float64 reference merge (merge_state_ref / merge_states_ref): fp16 / bf16 /
fp32 values, both LSE bases, empty states (LSE -inf, values NaN that must never be read), a row
empty on both sides merging to v = 0, s = -inf; vmap (one launch over the batch); jit equal to the
eager merge on the same arrays bit for bit. The append against a numpy model of the cache's bytes:
5-D NHD / HND caches and (k_cache, v_cache) tuples, page sizes 1 and 16, every appended row bit
exact and every other slot unchanged; the input cache intact without donation, updated in place
(same buffer) with donate_argnums; a decode loop inside one jitted fori_loop; out-of-range metadata
skipped. Trace-time errors carry the eager messages naming the argument.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import pyflashattn  # noqa: E402
from pyflashattn.testing.checks import assert_close  # noqa: E402
from pyflashattn.testing.frameworks import jax_gpu  # noqa: E402
from pyflashattn.testing.paged import append_batch  # noqa: E402
from pyflashattn.testing.reference import merge_state_ref, merge_states_ref  # noqa: E402

pytestmark = pytest.mark.gpu

V_TOL = {"float16": dict(atol=1e-3, rtol=1e-3), "bfloat16": dict(atol=1e-2, rtol=1e-2),
         "float32": dict(atol=1e-5, rtol=1e-5)}
S_TOL = dict(atol=1e-5, rtol=1e-5)  # LSEs are float32 in and out
RAW = {1: np.uint8, 2: np.uint16, 4: np.uint32}


@pytest.fixture(scope="module")
def pfj():
    """pyflashattn.jax (skips without JAX's GPU)."""
    jax_gpu()
    import pyflashattn.jax as pfj

    return pfj


def _gpu():
    return jax_gpu()[2]


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def _put(x, dtype):
    return jax.device_put(jnp.asarray(x, dtype=dtype), _gpu())


def _states(rng, shape, dtype, empty_frac=0.15):
    """Values [..., D] (NaN where empty) and float32 LSEs [...] a few units apart, -inf where empty;
    float64 host copies of both (the values as stored, rounded to dtype)."""
    v = rng.standard_normal(shape)
    s = rng.uniform(-6.0, 6.0, shape[:-1]).astype(np.float32)
    empty = rng.random(shape[:-1]) < empty_frac
    s[empty] = -np.inf
    v[empty] = np.nan
    jv, js = _put(v, dtype), _put(s, jnp.float32)
    return jv, js, np.asarray(jv.astype(jnp.float32), np.float64), s.astype(np.float64)


def _check(v, s, ref, dtype, what):
    assert_close(np.asarray(v.astype(jnp.float32)), ref[0], **V_TOL[dtype], what=f"{what} v")
    assert_close(np.asarray(s), ref[1], **S_TOL, what=f"{what} s")


# ---------------------------------------------------------------- merge_state / merge_states

@pytest.mark.parametrize("lse_base", ["log2", "ln"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("shape", [(33, 5, 128), (11, 3, 37)], ids=lambda s: "x".join(map(str, s)))
def test_merge_state_jit(pfj, shape, dtype, lse_base):
    rng = np.random.default_rng(_seed("pair", shape, dtype, lse_base))
    va, sa, ha, hsa = _states(rng, shape, dtype)
    vb, sb, hb, hsb = _states(rng, shape, dtype)
    sa, sb = sa.at[0, 0].set(-jnp.inf), sb.at[0, 0].set(-jnp.inf)  # a (row, head) with no keys at all
    hsa[0, 0] = hsb[0, 0] = -np.inf
    v, s = jax.jit(lambda *a: pfj.merge_state(*a, lse_base=lse_base))(va, sa, vb, sb)
    assert v.shape == shape and v.dtype == jnp.dtype(dtype) and s.shape == shape[:2] and s.dtype == jnp.float32
    _check(v, s, merge_state_ref(ha, hsa, hb, hsb, lse_base=lse_base), dtype, "merge_state")
    assert np.all(np.asarray(v[0, 0].astype(jnp.float32)) == 0.0) and np.isneginf(np.asarray(s[0, 0]))


def test_merge_state_jit_equals_eager(pfj):
    rng = np.random.default_rng(_seed("eager"))
    va, sa, _, _ = _states(rng, (40, 4, 128), "bfloat16")
    vb, sb, _, _ = _states(rng, (40, 4, 128), "bfloat16")
    v, s = jax.jit(pfj.merge_state)(va, sa, vb, sb)
    ev, es = pyflashattn.merge_state(va, sa, vb, sb)
    assert np.asarray(v).view(np.uint16).tobytes() == np.asarray(ev).view(np.uint16).tobytes(), "jit v != eager v"
    assert np.asarray(s).tobytes() == np.asarray(es).tobytes(), "jit s != eager s"


@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_merge_states_jit(pfj, n, dtype):
    rng = np.random.default_rng(_seed("states", n, dtype))
    v_in, s_in, hv, hs = _states(rng, (17, n, 3, 64), dtype)
    s_in, hs = s_in.at[0, :, 0].set(-jnp.inf), hs.copy()
    hs[0, :, 0] = -np.inf  # every state of (0, 0) empty
    v, s = jax.jit(pfj.merge_states)(v_in, s_in)
    assert v.shape == (17, 3, 64) and v.dtype == jnp.dtype(dtype) and s.shape == (17, 3)
    _check(v, s, merge_states_ref(hv, hs), dtype, f"merge_states n={n}")
    assert np.all(np.asarray(v[0, 0].astype(jnp.float32)) == 0.0) and np.isneginf(np.asarray(s[0, 0]))


def test_merge_states_ln_base(pfj):
    rng = np.random.default_rng(_seed("states ln"))
    v_in, s_in, hv, hs = _states(rng, (9, 4, 2, 128), "float32")
    v, s = jax.jit(lambda v, s: pfj.merge_states(v, s, lse_base="ln"))(v_in, s_in)
    _check(v, s, merge_states_ref(hv, hs, lse_base="ln"), "float32", "merge_states ln")


def test_merge_state_vmap(pfj):
    """A batch of states [B, seq, H, D] (b's shared across the batch: broadcast) is one launch."""
    rng = np.random.default_rng(_seed("vmap"))
    va, sa, ha, hsa = _states(rng, (3, 13, 4, 64), "float16")
    vb, sb, hb, hsb = _states(rng, (13, 4, 64), "float16")
    f = jax.jit(jax.vmap(pfj.merge_state, in_axes=(0, 0, None, None)))
    v, s = f(va, sa, vb, sb)
    assert v.shape == (3, 13, 4, 64) and s.shape == (3, 13, 4)
    for b in range(3):
        _check(v[b], s[b], merge_state_ref(ha[b], hsa[b], hb, hsb), "float16", f"vmap [{b}]")
    vs, ss, hv, hs = _states(rng, (2, 3, 7, 5, 2, 64), "bfloat16")  # two vmapped axes, merge_states
    v, s = jax.jit(jax.vmap(jax.vmap(pfj.merge_states)))(vs, ss)
    for i in range(2):
        for j in range(3):
            _check(v[i, j], s[i, j], merge_states_ref(hv[i, j], hs[i, j]), "bfloat16", f"vmap states [{i}, {j}]")


def test_merge_state_in_place_refuses(pfj):
    rng = np.random.default_rng(0)
    v, s, _, _ = _states(rng, (4, 2, 64), "float16")
    with pytest.raises(TypeError, match="JAX arrays are immutable.*use merge_state"):
        pfj.merge_state_in_place(v, s, v, s)


def test_merge_trace_time_errors(pfj):
    S = jax.ShapeDtypeStruct
    v, s = S((7, 3, 64), jnp.float16), S((7, 3), jnp.float32)
    pair = lambda **kw: (lambda *a: pfj.merge_state(*a, **kw))  # noqa: E731
    cases = [
        (pair(), (v, S((7, 3), jnp.float16), v, s), TypeError, "s_a must be float32"),
        (pair(), (v, s, S((7, 4, 64), jnp.float16), s), ValueError, r"v_b must have v_a's shape \(7, 3, 64\)"),
        (pair(), (v, s, S((7, 3, 64), jnp.bfloat16), s), TypeError, "v_b has dtype bfloat16 but v_a has float16"),
        (pair(), (S((7, 3, 64), jnp.int32), s, v, s), TypeError, "v_a must be float16, bfloat16 or float32"),
        (pair(), (v, s, v, S((7, 4), jnp.float32)), ValueError, r"s_b must have shape \(7, 3\)"),
        (pair(), (S((7, 192), jnp.float16), s, v, s), ValueError, "v_a must be 3-D"),
        (pair(lse_base="e"), (v, s, v, s), ValueError, "lse_base must be 'log2' or 'ln'"),
        (pfj.merge_states, (S((7, 5, 3, 64), jnp.float16), S((7, 4, 3), jnp.float32)), ValueError,
         r"s must have shape \(7, 5, 3\)"),
        (pfj.merge_states, (v, s), ValueError, "v must be 4-D"),
    ]
    for fn, args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            jax.eval_shape(fn, *args)


# ---------------------------------------------------------------- append_paged_kv_cache

def _batch(seed, B, ps, spare=3):
    """Requests holding old tokens that append more (pyflashattn.testing.paged), as a dict."""
    return vars(append_batch(seed, B, ps, spare))


def _random(rng, shape, dtype):
    """Random values, none zero (fp8 rounds small ones to zero), as a device array."""
    x = rng.standard_normal(shape)
    return _put(x + np.sign(x) * 0.25, dtype)


def _raw(x) -> np.ndarray:
    a = np.asarray(x)
    return a.view(RAW[a.dtype.itemsize])


def _cache(b, H, D, dtype, layout, form):
    page = (b["ps"], H, D) if layout == "NHD" else (H, b["ps"], D)
    if form == "5d":
        return _random(b["rng"], (b["P"], 2) + page, dtype)
    return _random(b["rng"], (b["P"],) + page, dtype), _random(b["rng"], (b["P"],) + page, dtype)


def _raw_parts(cache) -> list:
    """Host copies of a cache's raw bits: [the 5-D array] or [k_cache, v_cache]."""
    return [_raw(c).copy() for c in (cache if isinstance(cache, tuple) else (cache,))]


def _model(b, parts, k, v, bi, pos, layout, kv_indices=None) -> list:
    """The raw bits (_raw_parts) after the append, skipping what the kernel skips."""
    idx = b["kv_indices"] if kv_indices is None else kv_indices
    parts = [x.copy() for x in parts]
    kc, vc = (parts[0][:, 0], parts[0][:, 1]) if len(parts) == 1 else parts
    if layout == "HND":
        kc, vc = kc.swapaxes(1, 2), vc.swapaxes(1, 2)
    rk, rv = _raw(k), _raw(v)
    ind, ps = b["kv_indptr"], b["ps"]
    for t, (r, p) in enumerate(zip(np.asarray(bi).tolist(), np.asarray(pos).tolist())):
        if not 0 <= r < b["B"] or p < 0 or p // ps >= ind[r + 1] - ind[r]:
            continue
        pg = int(idx[ind[r] + p // ps])
        if 0 <= pg < b["P"]:
            kc[pg, p % ps], vc[pg, p % ps] = rk[t], rv[t]
    return parts


def _assert_cache(got, want, what):
    got = [got] if not isinstance(got, tuple) else list(got)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert np.array_equal(_raw(g), w), f"{what}: the cache differs from the model"


def _i32(a):
    return _put(np.asarray(a, np.int32), jnp.int32)


def _metadata(pfj, b):
    """seq_lens, batch_indices, positions from the jitted device helpers, held to the numpy ones."""
    seq = jax.jit(lambda i, l: pfj.get_seq_lens(i, l, b["ps"]))(_i32(b["kv_indptr"]), _i32(b["last"]))
    np.testing.assert_array_equal(np.asarray(seq), b["new"])
    bi, pos = jax.jit(lambda i, s: pfj.get_batch_indices_positions(i, s, b["nnz"]))(_i32(b["app_indptr"]), seq)
    hbi, hpos = pyflashattn.get_batch_indices_positions(b["app_indptr"], b["new"], b["nnz"])
    np.testing.assert_array_equal(np.asarray(bi), hbi)
    np.testing.assert_array_equal(np.asarray(pos), hpos)
    return bi, pos


def _append_fn(pfj, layout, donate=False):
    def f(k, v, bi, pos, cache, idx, ind, last):
        return pfj.append_paged_kv_cache(k, v, bi, pos, cache, idx, ind, last, kv_layout=layout)

    return jax.jit(f, donate_argnums=(4,) if donate else ())


CASES = [(layout, form, ps, "float16") for layout in ("NHD", "HND") for form in ("5d", "tuple") for ps in (1, 16)]
CASES += [("NHD", "5d", 16, "bfloat16"), ("HND", "tuple", 16, "float32"), ("NHD", "tuple", 16, "float8_e4m3fn")]


@pytest.mark.parametrize("layout,form,ps,dtype", CASES, ids=lambda x: str(x))
def test_append_writes_exactly_the_appended_slots(pfj, layout, form, ps, dtype):
    b = _batch(_seed("append", layout, form, ps, dtype), 4, ps)
    H, D = 2, 64
    cache = _cache(b, H, D, dtype, layout, form)
    k, v = _random(b["rng"], (b["nnz"], H, D), dtype), _random(b["rng"], (b["nnz"], H, D), dtype)
    bi, pos = _metadata(pfj, b)
    before = _raw_parts(cache)
    out = _append_fn(pfj, layout)(k, v, bi, pos, cache, _i32(b["kv_indices"]), _i32(b["kv_indptr"]),
                                  _i32(b["last"]))
    assert isinstance(out, tuple) == (form == "tuple")
    want = _model(b, before, k, v, bi, pos, layout)
    _assert_cache(out, want, "append")
    assert not all(np.array_equal(w, x) for w, x in zip(want, before)), "the model wrote nothing"
    _assert_cache(cache, before, "the input cache (not donated)")


@pytest.mark.parametrize("form", ["5d", "tuple"])
def test_append_with_donation_is_in_place(pfj, form):
    b = _batch(_seed("donate", form), 3, 16)
    cache = _cache(b, 2, 128, "bfloat16", "NHD", form)
    k, v = _random(b["rng"], (b["nnz"], 2, 128), "bfloat16"), _random(b["rng"], (b["nnz"], 2, 128), "bfloat16")
    bi, pos = _metadata(pfj, b)
    leaves = cache if form == "tuple" else (cache,)
    want = _model(b, _raw_parts(cache), k, v, bi, pos, "NHD")
    ptrs = [c.unsafe_buffer_pointer() for c in leaves]
    out = _append_fn(pfj, "NHD", donate=True)(k, v, bi, pos, cache, _i32(b["kv_indices"]), _i32(b["kv_indptr"]),
                                              _i32(b["last"]))
    _assert_cache(out, want, "donated append")
    out_leaves = out if form == "tuple" else (out,)
    assert all(c.is_deleted() for c in leaves), "the donated cache was not consumed"
    assert [c.unsafe_buffer_pointer() for c in out_leaves] == ptrs, "XLA copied the donated cache"


def test_append_in_a_jitted_decode_loop(pfj):
    """steps tokens per request appended one step at a time inside one jitted fori_loop (positions
    computed on the device), the cache carried through the loop."""
    B, ps, steps, H, D = 3, 16, 5, 2, 64
    rng = np.random.default_rng(_seed("loop"))
    old = np.array([0, 15, 33], np.int32)
    pages = -(-(old + steps) // ps)
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    P = int(kv_indptr[-1]) + 2
    kv_indices = rng.permutation(P)[:kv_indptr[-1]].astype(np.int32)
    last = ((old + steps - 1) % ps + 1).astype(np.int32)
    b = dict(B=B, ps=ps, P=P, kv_indptr=kv_indptr, kv_indices=kv_indices, rng=rng)
    cache = _cache(b, H, D, "float16", "NHD", "5d")
    keys, vals = _random(rng, (steps, B, H, D), "float16"), _random(rng, (steps, B, H, D), "float16")

    @jax.jit
    def decode(cache, keys, vals, pos0, idx, ind, last):
        bi = jnp.arange(B, dtype=jnp.int32)

        def step(i, c):
            return pfj.append_paged_kv_cache(keys[i], vals[i], bi, pos0 + i, c, idx, ind, last)

        return jax.lax.fori_loop(0, steps, step, cache)

    out = decode(cache, keys, vals, _i32(old), _i32(kv_indices), _i32(kv_indptr), _i32(last))
    want = _raw_parts(cache)
    for i in range(steps):
        want = _model(b, want, keys[i], vals[i], np.arange(B), old + i, "NHD")
    _assert_cache(out, want, "decode loop")


def test_out_of_range_metadata_is_skipped(pfj):
    b = _batch(_seed("oob"), 6, 4, spare=0)
    cache = _cache(b, 2, 64, "bfloat16", "HND", "tuple")
    k, v = _random(b["rng"], (b["nnz"], 2, 64), "bfloat16"), _random(b["rng"], (b["nnz"], 2, 64), "bfloat16")
    bi, pos = (np.asarray(x).copy() for x in _metadata(pfj, b))
    idx = b["kv_indices"].copy()
    entry = b["kv_indptr"][bi] + pos // b["ps"]
    picks = [t for t in range(4, b["nnz"]) if entry[t] not in entry[4:t]][:3]
    assert len(picks) == 3, "the batch is too small to corrupt"
    bi[0], bi[1] = b["B"], -1
    pos[2] = (b["kv_indptr"][bi[2] + 1] - b["kv_indptr"][bi[2]]) * b["ps"]
    pos[3] = -5
    for t, bad in zip(picks, (b["P"], -1, 2**31 - 1)):
        idx[entry[t]] = bad
    out = _append_fn(pfj, "HND")(k, v, _i32(bi), _i32(pos), cache, _i32(idx), _i32(b["kv_indptr"]), _i32(b["last"]))
    _assert_cache(out, _model(b, _raw_parts(cache), k, v, bi, pos, "HND", kv_indices=idx), "out-of-range metadata")


def test_device_helpers_with_padding(pfj):
    """get_seq_lens / get_batch_indices_positions under jit; tokens past append_indptr[-1] get -1."""
    b = _batch(_seed("helpers"), 5, 16)
    seq = jax.jit(lambda i, l: pfj.get_seq_lens(i, l, 16))(_i32(b["kv_indptr"]), _i32(b["last"]))
    np.testing.assert_array_equal(np.asarray(seq), pyflashattn.get_seq_lens(b["kv_indptr"], b["last"], 16))
    nnz = b["nnz"] + 7
    bi, pos = jax.jit(lambda i, s: pfj.get_batch_indices_positions(i, s, nnz))(_i32(b["app_indptr"]), seq)
    hbi, hpos = pyflashattn.get_batch_indices_positions(b["app_indptr"], b["new"], nnz)
    np.testing.assert_array_equal(np.asarray(bi), hbi)
    np.testing.assert_array_equal(np.asarray(pos), hpos)
    assert (hbi[-7:] == -1).all()


def test_append_trace_time_errors(pfj):
    S = jax.ShapeDtypeStruct
    P, ps, H, D, nnz, B = 10, 16, 2, 64, 9, 3
    i32 = lambda n: S((n,), jnp.int32)  # noqa: E731
    k, c5 = S((nnz, H, D), jnp.float16), S((P, 2, ps, H, D), jnp.float16)
    good = dict(k=k, v=k, bi=i32(nnz), pos=i32(nnz), cache=c5, idx=i32(P), ind=i32(B + 1), last=i32(B))

    def fn(layout="NHD"):
        return lambda k, v, bi, pos, cache, idx, ind, last: pfj.append_paged_kv_cache(k, v, bi, pos, cache, idx, ind,
                                                                                      last, kv_layout=layout)

    cases = [
        (dict(k=S((nnz, H, D), jnp.bfloat16)), TypeError, "append_key has dtype bfloat16 but paged_kv_cache holds"),
        (dict(v=S((nnz, H + 1, D), jnp.float16)), ValueError, r"append_value has shape \(9, 3, 64\)"),
        (dict(bi=S((nnz,), jnp.float32)), TypeError, "batch_indices must be int32"),
        (dict(pos=i32(nnz - 1)), ValueError, "positions has 8 entries but append_key has nnz = 9"),
        (dict(cache=S((P, 3, ps, H, D), jnp.float16)), ValueError, "paged_kv_cache must have shape"),
        (dict(cache=S((P, 2, ps, H, D), jnp.int8)), TypeError, "paged_kv_cache has dtype int8"),
        (dict(cache=(S((P, ps, H, D), jnp.float16), S((P, ps, H, D), jnp.bfloat16))), TypeError,
         "v_cache has dtype bfloat16 but k_cache has float16"),
        (dict(last=i32(B + 1)), ValueError, "kv_last_page_len has 4 entries but kv_indptr describes batch_size = 3"),
        (dict(idx=S((P, 1), jnp.int32)), ValueError, "kv_indices must be 1-D"),
    ]
    for change, exc, msg in cases:
        args = dict(good, **change)
        with pytest.raises(exc, match=msg):
            jax.eval_shape(fn(), *args.values())
    with pytest.raises(ValueError, match="kv_layout must be 'NHD' or 'HND'"):
        jax.eval_shape(fn("NDH"), *good.values())
    batched = [S((2,) + x.shape, x.dtype) for x in good.values()]
    with pytest.raises(NotImplementedError, match="does not support vmap"):
        jax.eval_shape(jax.vmap(fn()), *batched)
