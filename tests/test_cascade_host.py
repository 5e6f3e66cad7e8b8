"""CPU tests of pyflashattn.cascade (merge_state, merge_state_in_place, merge_states).

Three parts:
* the float64 reference merge (pyflashattn.testing.reference.merge_states_ref) against an
  independent computation: attention over a key set split into parts, whose per-part states
  must merge into attention over all keys (attention_ref on the full set), -inf parts included;
* validation: every bad input raises a TypeError / ValueError naming the argument before any
  launch (fake DLPack producers, the simulated driver records launches);
* the host's launches: fake torch tensors over simulated device memory, the kernel executed
  from its recorded params struct (pointers, strides, modes) by a numpy model of
  cascade.cuh, the results held to the reference. Numerics of the real kernel: tests/gpu.
"""
from __future__ import annotations

import ctypes
import math
import pathlib
import re
import sys

import numpy as np
import pytest

import pyflashattn
from pyflashattn import cascade
from pyflashattn._engine import cascade as _engine
from pyflashattn._runtime import dtypes as _dtypes
from pyflashattn._runtime.params_gen import CascadeMergeParams
from pyflashattn.testing import attention_ref
from pyflashattn.testing.fake_driver import FakeTorchTensor, _TorchDtype
from pyflashattn.testing.fake_tensors import FakeProducer, compact_strides
from pyflashattn.testing.reference import merge_state_ref, merge_states_ref

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "build_tools"))
import variants  # noqa: E402

F16, BF16, F32, U8, BOOL, I32 = (_dtypes.FLOAT16, _dtypes.BFLOAT16, _dtypes.FLOAT32, _dtypes.UINT8, _dtypes.BOOL,
                                 _dtypes.INT32)
LN2 = math.log(2.0)


# ---------------------------------------------------------------- the reference vs attention

def _attention_parts(seed, seq, heads, d, parts, lse_base="log2", empty=()):
    """(full attention (o, lse), per-part states) over a random key set split into `parts`
    random disjoint subsets (the parts in `empty` get no keys)."""
    rng = np.random.default_rng(seed)
    kv = 40
    q, k, v = (rng.standard_normal(shape) for shape in ((seq, heads, d), (kv, heads, d), (kv, heads, d)))
    q *= 2.0  # logits of a few units: weights that differ by orders of magnitude
    owner = rng.choice([p for p in range(parts) if p not in empty], size=kv)
    full = attention_ref(q, k, v, lse_base=lse_base)
    states = [attention_ref(q, k[owner == p], v[owner == p], lse_base=lse_base) for p in range(parts)]
    return full, states


@pytest.mark.parametrize("lse_base", ["log2", "ln"])
@pytest.mark.parametrize("seed", range(3))
def test_reference_pair_merge_is_attention_over_the_union(seed, lse_base):
    (o, lse), [(oa, sa), (ob, sb)] = _attention_parts(seed, 5, 3, 16, 2, lse_base)
    mo, ms = merge_state_ref(oa, sa, ob, sb, lse_base=lse_base)
    np.testing.assert_allclose(mo, o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ms, lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("lse_base", ["log2", "ln"])
@pytest.mark.parametrize("parts, empty", [(1, ()), (3, ()), (5, (1, 3)), (7, (0,))])
def test_reference_merge_states_is_attention_over_the_union(parts, empty, lse_base):
    (o, lse), states = _attention_parts(parts, 4, 2, 8, parts, lse_base, empty)
    v = np.stack([st[0] for st in states], axis=1)
    s = np.stack([st[1] for st in states], axis=1)
    for p in empty:  # an empty part: lse -inf (and o = 0) from the attention reference itself
        assert np.isneginf(s[:, p]).all()
        v[:, p] = np.nan  # ... and its v is never read
    mo, ms = merge_states_ref(v, s, lse_base=lse_base)
    np.testing.assert_allclose(mo, o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ms, lse, rtol=1e-12, atol=1e-12)


def test_reference_bases_differ_by_ln2():
    (_, _), [(oa, sa), (ob, sb)] = _attention_parts(7, 3, 2, 8, 2, "log2")
    mo2, ms2 = merge_state_ref(oa, sa, ob, sb)
    mo_e, ms_e = merge_state_ref(oa, sa * LN2, ob, sb * LN2, lse_base="ln")
    np.testing.assert_allclose(mo_e, mo2, rtol=1e-12)
    np.testing.assert_allclose(ms_e, ms2 * LN2, rtol=1e-12)
    # base-2 LSEs read as natural logs weigh the states differently: the option matters
    wrong, _ = merge_state_ref(oa, sa, ob, sb, lse_base="ln")
    assert np.abs(wrong - mo2).max() > 1e-3


def test_reference_empty_cases():
    rng = np.random.default_rng(0)
    v_a, v_b = rng.standard_normal((2, 2, 3, 4))
    ninf, s = np.full((2, 3), -np.inf), rng.standard_normal((2, 3))
    o, lse = merge_state_ref(v_a, ninf, np.full_like(v_b, np.nan), ninf)  # both empty
    assert (o == 0).all() and np.isneginf(lse).all()
    o, lse = merge_state_ref(v_a, s, np.full_like(v_b, np.nan), ninf)  # one side empty: the other, exactly
    np.testing.assert_array_equal(o, v_a)
    np.testing.assert_array_equal(lse, s)
    o, lse = merge_state_ref(np.full_like(v_a, np.nan), ninf, v_b, s)
    np.testing.assert_array_equal(o, v_b)
    np.testing.assert_array_equal(lse, s)
    o, lse = merge_states_ref(np.zeros((2, 0, 3, 4)), np.zeros((2, 0, 3)))  # no states at all
    assert o.shape == (2, 3, 4) and (o == 0).all() and np.isneginf(lse).all()
    # equal LSEs: the mean, and the LSE grows by exactly one bit (base 2) / ln 2 (base e)
    o, lse = merge_state_ref(v_a, s, v_b, s)
    np.testing.assert_allclose(o, (v_a + v_b) / 2, rtol=1e-15)
    np.testing.assert_allclose(lse, s + 1, rtol=1e-15)
    _, lse = merge_state_ref(v_a, s, v_b, s, lse_base="ln")
    np.testing.assert_allclose(lse, s + LN2, rtol=1e-15)


def test_reference_huge_lse_gap_does_not_overflow():
    v_a, v_b = np.ones((1, 1, 2)), np.full((1, 1, 2), 3.0)
    o, lse = merge_state_ref(v_a, np.array([[2000.0]]), v_b, np.array([[-2000.0]]))
    np.testing.assert_array_equal(o, v_a)
    assert lse[0, 0] == 2000.0


# ---------------------------------------------------------------- the kernel table

def test_variant_rows_and_host_tables_agree():
    rows = [v for v in variants.variants() if getattr(v, "family", None) == "cascade"]
    assert [v.name for v in rows] == ["pfa_cascade_f16", "pfa_cascade_bf16", "pfa_cascade_f32"]
    assert all(v.archs == variants.ARCHS_DEFAULT and v.impl == variants.PORTABLE for v in rows)
    assert {v.dtype for v in rows} == set(_engine.VALUE_DTYPES.values())
    for v in rows:
        m = v.manifest()
        assert m["family"] == "cascade" and m["threads"] == _engine.WARPS * 32 and m["smem_bytes"] == 0
        assert (ROOT / "kernel_src/generated" / f"{v.name}.cu").read_text().endswith(v.source())
    header = (ROOT / "kernel_src/include/pfa/misc/cascade.cuh").read_text()
    assert int(re.search(r"int WARPS = (\d+);", header).group(1)) == _engine.WARPS
    assert "f16" in variants.DTYPES and "f32" not in variants.DTYPES  # fp32 is the cascade rows' own


# ---------------------------------------------------------------- validation (nothing launches)

class FakeJaxArray(FakeProducer):
    """A producer whose framework reads as JAX (framework_of looks at the class's module)."""


FakeJaxArray.__module__ = "jaxlib.xla_extension"

SEQ, H, D = 5, 3, 16


def T(shape, dtype=F16, strides=None, device=(2, 0), cls=FakeProducer, data=0x100000):
    strides = compact_strides(shape) if strides is None else strides
    return cls(shape=tuple(shape), strides=tuple(strides), dtype=dtype, data=data, device=device)


def _pair(**over):
    args = dict(v_a=T((SEQ, H, D)), s_a=T((SEQ, H), F32), v_b=T((SEQ, H, D)), s_b=T((SEQ, H), F32))
    args.update(over)
    return args


PAIR_ERRORS = [
    (dict(v_a=T((SEQ, H * D))), ValueError, "v_a must be 3-D"),
    (dict(v_b=T((SEQ, H, D, 1))), ValueError, "v_b must be 3-D"),
    (dict(v_a=T((SEQ, H, D), I32)), TypeError, "v_a must be float16, bfloat16 or float32"),
    (dict(v_b=T((SEQ, H, D), BF16)), TypeError, "v_b has dtype bfloat16 but v_a has float16"),
    (dict(v_b=T((SEQ, H + 1, D))), ValueError, r"v_b must have v_a's shape \(5, 3, 16\)"),
    (dict(v_b=T((SEQ, H, D + 8))), ValueError, "v_b must have v_a's shape"),
    (dict(s_a=T((SEQ, H), F16)), TypeError, "s_a must be float32"),
    (dict(s_b=T((SEQ, H), _dtypes.FLOAT64)), TypeError, "s_b must be float32"),
    (dict(s_b=T((SEQ, H + 1), F32)), ValueError, r"s_b must have shape \(5, 3\)"),
    (dict(s_a=T((SEQ * H,), F32)), ValueError, "s_a must have shape"),
    (dict(v_a=T((SEQ, H, D), strides=(H * D * 2, D * 2, 2))), ValueError, "v_a must be contiguous in its last dim"),
    (dict(v_a=np.zeros((SEQ, H, D), np.float16)), ValueError, "v_a is on the CPU; pyflashattn needs CUDA tensors"),
    (dict(s_b=np.zeros((SEQ, H), np.float32)), ValueError, "s_b is on the CPU; pyflashattn needs CUDA tensors"),
    (dict(v_b=[[[0.0]]]), TypeError, "v_b must be a DLPack tensor"),
    (dict(s_b=T((SEQ, H), F32, device=(2, 1))), ValueError, "s_b is on cuda:1 but v_a is on cuda:0"),
    (dict(v_a=T((SEQ, H, D), device=(3, 0))), ValueError, "v_a is in pinned host memory"),
    (dict(v_b=T((SEQ, H, D), device=(4, 0))), ValueError, "v_b is on opencl:0; pyflashattn needs CUDA tensors"),
    (dict(v_a=T((SEQ, H, 0)), v_b=T((SEQ, H, 0))), ValueError, "head_dim .* must be >= 1"),
    (dict(), TypeError, "v_a: CUDA arrays of framework 'other' are not supported"),  # the fakes' framework
]


@pytest.mark.parametrize("over, exc, match", PAIR_ERRORS)
def test_merge_state_errors(fake, over, exc, match):
    with pytest.raises(exc, match=match):
        cascade.merge_state(**_pair(**over))
    assert fake.cu.launches == []


@pytest.mark.parametrize("bad", ["LOG2", "e", "natural", None, 2, ["ln"]])
def test_lse_base_is_validated(fake, bad):
    for call in (lambda: cascade.merge_state(**_pair(), lse_base=bad),
                 lambda: cascade.merge_state_in_place(*_pair().values(), lse_base=bad),
                 lambda: cascade.merge_states(T((SEQ, 2, H, D)), T((SEQ, 2, H), F32), lse_base=bad)):
        with pytest.raises(ValueError, match="lse_base must be 'log2' or 'ln'"):
            call()
    assert fake.cu.launches == []


def _in_place(**over):
    args = dict(v=T((SEQ, H, D)), s=T((SEQ, H), F32), v_other=T((SEQ, H, D)), s_other=T((SEQ, H), F32), mask=None)
    args.update(over)
    return args


IN_PLACE_ERRORS = [
    (dict(v=T((SEQ, H, D), cls=FakeJaxArray)), TypeError, "v is a JAX array, and JAX arrays are immutable"),
    (dict(s=T((SEQ, H), F32, cls=FakeJaxArray)), TypeError, "s is a JAX array, and JAX arrays are immutable"),
    (dict(s=T((SEQ, H), F16)), TypeError, "s must be float32, got float16.*loses the update"),
    (dict(s=T((SEQ, H), BF16)), TypeError, "s must be float32"),
    (dict(s_other=T((SEQ, H), F16)), TypeError, "s_other must be float32"),
    (dict(v_other=T((SEQ, H, D), F32)), TypeError, "v_other has dtype float32 but v has float16"),
    (dict(v_other=T((SEQ + 1, H, D))), ValueError, "v_other must have v's shape"),
    (dict(s_other=T((SEQ, 1), F32)), ValueError, "s_other must have shape"),
    (dict(mask=T((SEQ,), I32)), TypeError, "mask must be bool or uint8, got int32"),
    (dict(mask=T((SEQ, 1), BOOL)), ValueError, r"mask must have shape \(5,\)"),
    (dict(mask=T((SEQ + 1,), U8)), ValueError, r"mask must have shape \(5,\)"),
    (dict(mask=np.ones(SEQ, bool)), ValueError, "mask is on the CPU; pyflashattn needs CUDA tensors"),
    (dict(mask=T((SEQ,), BOOL, device=(2, 1))), ValueError, "mask is on cuda:1 but v is on cuda:0"),
    (dict(v=np.zeros((SEQ, H, D), np.float16)), ValueError, "v is on the CPU"),
    (dict(v=T((SEQ, H))), ValueError, "v must be 3-D"),
    (dict(s=T((SEQ, H), F32, strides=(1, 0))), ValueError, "s is written in place, so its elements must not overlap"),
    (dict(v=T((SEQ, H, D), strides=(0, D, 1))), ValueError, "v is written in place, so its elements must not overlap"),
]


@pytest.mark.parametrize("over, exc, match", IN_PLACE_ERRORS)
def test_merge_state_in_place_errors(fake, over, exc, match):
    with pytest.raises(exc, match=match):
        cascade.merge_state_in_place(**_in_place(**over))
    assert fake.cu.launches == []


STATES_ERRORS = [
    (dict(v=T((SEQ, H, D))), ValueError, "v must be 4-D"),
    (dict(v=T((SEQ, 2, H, D), _dtypes.FLOAT64)), TypeError, "v must be float16, bfloat16 or float32"),
    (dict(s=T((SEQ, 3, H), F32)), ValueError, r"s must have shape \(5, 2, 3\)"),
    (dict(s=T((SEQ, H), F32)), ValueError, "s must have shape"),
    (dict(s=T((SEQ, 2, H), F16)), TypeError, "s must be float32"),
    (dict(s=T((SEQ, 2, H), F32, device=(2, 3))), ValueError, "s is on cuda:3 but v is on cuda:0"),
    (dict(v=np.zeros((SEQ, 2, H, D), np.float32)), ValueError, "v is on the CPU"),
    (dict(v=T((SEQ, 2, H, D), strides=(2 * H * D, H * D, 1, H))), ValueError, "v must be contiguous in its last"),
    (dict(v=T((SEQ, 2, H, 0)), s=T((SEQ, 2, H), F32)), ValueError, "head_dim .* must be >= 1"),
]


@pytest.mark.parametrize("over, exc, match", STATES_ERRORS)
def test_merge_states_errors(fake, over, exc, match):
    args = dict(v=T((SEQ, 2, H, D)), s=T((SEQ, 2, H), F32))
    args.update(over)
    with pytest.raises(exc, match=match):
        cascade.merge_states(**args)
    assert fake.cu.launches == []


def test_top_level_names():
    assert pyflashattn.merge_state is cascade.merge_state
    assert pyflashattn.merge_state_in_place is cascade.merge_state_in_place
    assert pyflashattn.merge_states is cascade.merge_states
    assert pyflashattn.cascade is cascade


# ---------------------------------------------------------------- launches, through a kernel model

NP_DTYPES = {"float16": np.float16, "float32": np.float32, "uint8": np.uint8, "bool": np.uint8}
ITEM = {"float16": 2, "bfloat16": 2, "float32": 4, "uint8": 1, "bool": 1}


def _encode(a: np.ndarray, dtype: str) -> bytes:
    if dtype == "bfloat16":  # round to nearest even, as the data a bf16 tensor would hold
        b = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16).tobytes()
    return np.ascontiguousarray(a, NP_DTYPES[dtype]).tobytes()


def _decode(raw: bytes, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.frombuffer(raw, NP_DTYPES[dtype]).astype(np.float64)


def _as_stored(a, dtype: str) -> np.ndarray:
    """a rounded to dtype, as float64 (the inputs the kernel sees)."""
    a = np.asarray(a, np.float64)
    return _decode(_encode(a, dtype), dtype).reshape(a.shape)


def _simulate(p: CascadeMergeParams, dtype: str, grid) -> None:
    """cascade.cuh's math, executed from the params struct alone: every address and stride the
    host filled in is followed; the merge itself is the reference's."""
    assert grid[1:] == (1, 1) and grid[0] * _engine.WARPS >= p.seq * p.num_heads > (grid[0] - 1) * _engine.WARPS
    vb, d = ITEM[dtype], p.head_dim
    lse_base = "log2" if p.lse_log2_scale == 1.0 else "ln"
    assert np.float32(p.lse_log2_scale * p.lse_rcp_scale) == np.float32(1.0)
    for row in range(p.seq):
        if p.mask and ctypes.string_at(p.mask + row * p.mask_stride, 1) == b"\0":
            continue
        for h in range(p.num_heads):
            if p.v_b:  # pair mode
                assert p.num_states == 2
                v_at = [p.v_a + vb * (row * p.v_a_stride_n + h * p.v_a_stride_h),
                        p.v_b + vb * (row * p.v_b_stride_n + h * p.v_b_stride_h)]
                s_at = [p.s_a + 4 * (row * p.s_a_stride_n + h * p.s_a_stride_h),
                        p.s_b + 4 * (row * p.s_b_stride_n + h * p.s_b_stride_h)]
            else:
                v_at = [p.v_a + vb * (row * p.v_a_stride_n + st * p.v_a_stride_s + h * p.v_a_stride_h)
                        for st in range(p.num_states)]
                s_at = [p.s_a + 4 * (row * p.s_a_stride_n + st * p.s_a_stride_s + h * p.s_a_stride_h)
                        for st in range(p.num_states)]
            s = np.array([_decode(ctypes.string_at(a, 4), "float32")[0] for a in s_at])
            v = np.array([_decode(ctypes.string_at(a, vb * d), dtype) if sv != -np.inf else np.full(d, np.nan)
                          for a, sv in zip(v_at, s)]).reshape(len(s_at), d)
            o, lse = merge_states_ref(v[None, :, None, :], s[None, :, None], lse_base=lse_base)
            ctypes.memmove(p.v_out + vb * (row * p.v_out_stride_n + h * p.v_out_stride_h), _encode(o[0, 0], dtype),
                           vb * d)
            ctypes.memmove(p.s_out + 4 * (row * p.s_out_stride_n + h * p.s_out_stride_h),
                           _encode(lse[0, :1], "float32"), 4)


class Sim:
    """Fake torch CUDA tensors over simulated device memory, and the cascade kernel's model run
    at each launch (see the ``sim`` fixture)."""

    def __init__(self, env, ft):
        self.env, self.ft = env, ft
        self.launches = []

    def tensor(self, a, dtype="float16", strides=None, offset=0):
        """A fake torch tensor holding `a`, at element `strides` (compact unless given), `offset`
        elements past a 256-byte boundary; memory outside the view is NaN (0x5A for bytes)."""
        a = np.asarray(a)
        shape = a.shape
        strides = compact_strides(shape) if strides is None else tuple(strides)
        span = 1 + sum((n - 1) * st for n, st in zip(shape, strides)) if all(shape) else 1
        fill = np.full(span + offset, np.nan) if dtype not in ("uint8", "bool") else np.full(span + offset, 0x5A)
        if a.size:
            idx = offset + sum(np.indices(shape)[i] * st for i, st in enumerate(strides))
            fill[idx] = a
        raw = _encode(fill, dtype)
        base = self.env.cu._alloc(len(raw))
        ctypes.memmove(base, raw, len(raw))
        t = FakeTorchTensor(self.ft, tuple(shape), self.ft.dtypes.get(dtype) or _TorchDtype(dtype), base + offset * ITEM[dtype])
        t._strides = strides
        return t

    def read(self, t) -> np.ndarray:
        dtype = str(t.dtype).removeprefix("torch.")
        if not all(t.shape):
            return np.zeros(t.shape)
        span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t._strides))
        flat = _decode(ctypes.string_at(t.data_ptr(), span * ITEM[dtype]), dtype)
        return flat[sum(np.indices(t.shape)[i] * st for i, st in enumerate(t._strides))]


@pytest.fixture
def sim(fake, fake_torch, monkeypatch):
    s = Sim(fake, fake_torch)
    for n in ("uint8", "bool"):
        fake_torch.dtypes.setdefault(n, _TorchDtype(n))
        setattr(fake_torch.module, n, fake_torch.dtypes[n])
    # outputs over simulated memory (the fake torch's new_empty hands out an address with none)
    monkeypatch.setattr(FakeTorchTensor, "new_empty",
                        lambda self, shape, dtype=None: s.tensor(np.zeros(shape), str(dtype or self.dtype)[6:]))
    # the fake launches pfa_cascade_<dtype> (the variant table's row); its model runs at each launch

    def model(p, grid, name):
        dtype = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}[name.rpartition("_")[2]]
        s.launches.append(fake.cu.launches[-1])
        _simulate(p, dtype, grid)

    fake.cu.simulators[CascadeMergeParams] = model
    return s


def _rand_states(rng, shape, n_inf=0):
    """Random values and LSEs (a few units apart: no state dominates); n_inf random -inf LSEs."""
    v = rng.standard_normal(shape)
    s = rng.uniform(-4.0, 4.0, shape[:-1]).astype(np.float32).astype(np.float64)  # as stored
    flat = s.reshape(-1)
    flat[rng.choice(flat.size, size=n_inf, replace=False)] = -np.inf
    return v, s


TOL = {"float16": 1e-3, "bfloat16": 1e-2, "float32": 1e-6}


def _close(got, want, dtype, what):
    assert not np.isnan(got).any(), f"{what}: NaN"
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=what)
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=TOL[dtype], atol=TOL[dtype], err_msg=what)


@pytest.mark.parametrize("lse_base", ["log2", "ln"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_merge_state_launch(sim, dtype, lse_base):
    rng = np.random.default_rng(1)
    seq, heads, d = 7, 3, 24
    va, sa = _rand_states(rng, (seq, heads, d), n_inf=4)
    vb, sb = _rand_states(rng, (seq, heads, d), n_inf=4)
    sa[0, 0] = sb[0, 0] = -np.inf  # a row with no keys at all
    va, vb = _as_stored(va, dtype), _as_stored(vb, dtype)
    sim.ft.stream = 0x77
    v, s = cascade.merge_state(sim.tensor(va, dtype), sim.tensor(sa, "float32"), sim.tensor(vb, dtype),
                               sim.tensor(sb, "float32"), lse_base=lse_base)
    (name, grid, stream, p), = sim.launches
    assert name == f"pfa_cascade_{_engine.VALUE_DTYPES[_dtypes.normalize(dtype)]}" and stream == 0x77
    assert p.v_b and p.num_states == 2 and p.mask == 0 and p.vec16 == int(d % (16 // ITEM[dtype]) == 0)
    assert tuple(v.shape) == (seq, heads, d) and tuple(s.shape) == (seq, heads)
    ref_v, ref_s = merge_state_ref(va, sa, vb, sb, lse_base=lse_base)
    _close(sim.read(v), ref_v, dtype, "v")
    _close(sim.read(s), ref_s, "float32", "s")
    assert (sim.read(v)[0, 0] == 0).all() and sim.read(s)[0, 0] == -np.inf


def test_merge_state_strided_and_unaligned(sim):
    """Strides come from each tensor (a head-major v_b, a padded v_a); an unaligned pointer or an
    odd head_dim takes the one-element path."""
    rng = np.random.default_rng(2)
    seq, heads, d = 5, 4, 16
    va, sa = _rand_states(rng, (seq, heads, d))
    vb, sb = _rand_states(rng, (seq, heads, d))
    va, vb = _as_stored(va, "float16"), _as_stored(vb, "float16")
    ref_v, ref_s = merge_state_ref(va, sa, vb, sb)
    cases = [  # (v_a strides, v_b strides, v_b offset, vec16)
        ((heads * (d + 8), d + 8, 1), (d, seq * d, 1), 0, 1),
        ((heads * d, d, 1), (heads * d, d, 1), 1, 0),  # v_b 2 bytes off a 16-byte boundary
        ((heads * (d + 3), d + 3, 1), (heads * d, d, 1), 0, 0),  # rows at an odd stride
    ]
    for a_strides, b_strides, off, vec in cases:
        sim.launches.clear()
        v, s = cascade.merge_state(sim.tensor(va, strides=a_strides), sim.tensor(sa, "float32", strides=(1, seq)),
                                   sim.tensor(vb, strides=b_strides, offset=off), sim.tensor(sb, "float32"))
        assert sim.launches[-1][3].vec16 == vec
        _close(sim.read(v), ref_v, "float16", f"v {a_strides} {b_strides}")
        _close(sim.read(s), ref_s, "float32", "s")
    # head_dim 12 in rows padded to 16 (in place: no compact output): aligned rows, but a row is
    # not whole 16-byte chunks
    va12, vb12 = va[..., :12].copy(), vb[..., :12].copy()
    padded = (heads * 16, 16, 1)
    v = sim.tensor(va12, strides=padded)
    cascade.merge_state_in_place(v, sim.tensor(sa, "float32"), sim.tensor(vb12, strides=padded),
                                 sim.tensor(sb, "float32"))
    assert sim.launches[-1][3].vec16 == 0
    _close(sim.read(v), merge_state_ref(va12, sa, vb12, sb)[0], "float16", "v d=12")
    # odd head_dim: the one-element path
    va5, vb5 = va[..., :5].copy(), vb[..., :5].copy()
    v, _ = cascade.merge_state(sim.tensor(va5), sim.tensor(sa, "float32"), sim.tensor(vb5), sim.tensor(sb, "float32"))
    assert sim.launches[-1][3].vec16 == 0
    _close(sim.read(v), merge_state_ref(va5, sa, vb5, sb)[0], "float16", "v d=5")


@pytest.mark.parametrize("mask_dtype", [None, "bool", "uint8"])
def test_merge_state_in_place_launch(sim, mask_dtype):
    rng = np.random.default_rng(3)
    seq, heads, d = 6, 2, 32
    v0, s0 = _rand_states(rng, (seq, heads, d), n_inf=2)
    vo, so = _rand_states(rng, (seq, heads, d), n_inf=2)
    v0, vo = _as_stored(v0, "bfloat16"), _as_stored(vo, "bfloat16")
    keep = np.array([1, 0, 1, 1, 0, 1], np.uint8)
    v, s = sim.tensor(v0, "bfloat16"), sim.tensor(s0, "float32")
    mask = sim.tensor(keep * 3 if mask_dtype == "uint8" else keep, mask_dtype) if mask_dtype else None
    assert cascade.merge_state_in_place(v, s, sim.tensor(vo, "bfloat16"), sim.tensor(so, "float32"), mask) is None
    (_, _, _, p), = sim.launches
    assert p.v_out == p.v_a and p.s_out == p.s_a and bool(p.mask) == (mask is not None)
    ref_v, ref_s = merge_state_ref(v0, s0, vo, so)
    rows = keep.astype(bool) if mask_dtype else np.ones(seq, bool)
    got_v, got_s = sim.read(v), sim.read(s)
    _close(got_v[rows], ref_v[rows], "bfloat16", "merged rows v")
    _close(got_s[rows], ref_s[rows], "float32", "merged rows s")
    np.testing.assert_array_equal(got_v[~rows], v0[~rows])  # untouched, bit for bit
    np.testing.assert_array_equal(got_s[~rows], s0[~rows])


@pytest.mark.parametrize("n", [0, 1, 2, 5, 33])
def test_merge_states_launch(sim, n):
    rng = np.random.default_rng(4 + n)
    seq, heads, d = 3, 5, 8
    v, s = _rand_states(rng, (seq, n, heads, d), n_inf=min(n * seq * heads, 4))
    v = _as_stored(v, "float32")
    # s stored head-major: [seq, N, H] viewed from an [H, seq, N] buffer
    st = sim.tensor(s, "float32", strides=(n, 1, seq * n))
    out, lse = cascade.merge_states(sim.tensor(v, "float32"), st)
    (_, _, _, p), = sim.launches
    assert p.v_b == 0 and p.num_states == n and (p.s_a_stride_n, p.s_a_stride_s, p.s_a_stride_h) == (n, 1, seq * n)
    ref_v, ref_s = merge_states_ref(v, s)
    _close(sim.read(out), ref_v, "float32", "v")
    _close(sim.read(lse), ref_s, "float32", "s")
    if n == 1:  # one state: a copy
        fin = np.isfinite(s[:, 0])
        np.testing.assert_array_equal(sim.read(out)[fin], v[:, 0][fin])
        np.testing.assert_array_equal(sim.read(lse)[fin], s[:, 0][fin])
    if n == 0:
        assert (sim.read(out) == 0).all() and np.isneginf(sim.read(lse)).all()


def test_empty_rows_launch_nothing(sim):
    v, s = cascade.merge_state(sim.tensor(np.zeros((0, 3, 8))), sim.tensor(np.zeros((0, 3)), "float32"),
                               sim.tensor(np.zeros((0, 3, 8))), sim.tensor(np.zeros((0, 3)), "float32"))
    assert tuple(v.shape) == (0, 3, 8) and tuple(s.shape) == (0, 3)
    out, lse = cascade.merge_states(sim.tensor(np.zeros((4, 2, 0, 8))), sim.tensor(np.zeros((4, 2, 0)), "float32"))
    assert tuple(out.shape) == (4, 0, 8) and tuple(lse.shape) == (4, 0)
    assert sim.launches == []


def test_cached_launcher_forgets_the_last_call(sim):
    """A masked in-place merge, then a plain merge_state on the same (cached) launcher: no mask
    or stacked-mode field survives into the second launch."""
    rng = np.random.default_rng(5)
    v0, s0 = _rand_states(rng, (4, 2, 8))
    v1, s1 = _rand_states(rng, (4, 2, 8))
    v0, v1 = _as_stored(v0, "float16"), _as_stored(v1, "float16")
    cascade.merge_state_in_place(sim.tensor(v0), sim.tensor(s0, "float32"), sim.tensor(v1),
                                 sim.tensor(s1, "float32"), sim.tensor(np.zeros(4, np.uint8), "uint8"))
    v, s = cascade.merge_state(sim.tensor(v0), sim.tensor(s0, "float32"), sim.tensor(v1), sim.tensor(s1, "float32"))
    assert sim.launches[-1][3].mask == 0
    _close(sim.read(v), merge_state_ref(v0, s0, v1, s1)[0], "float16", "v")


def test_works_after_an_error(sim):
    rng = np.random.default_rng(6)
    va, sa = _rand_states(rng, (3, 2, 8))
    vb, sb = _rand_states(rng, (3, 2, 8))
    va, vb = _as_stored(va, "float16"), _as_stored(vb, "float16")
    with pytest.raises(TypeError, match="s_b must be float32"):
        cascade.merge_state(sim.tensor(va), sim.tensor(sa, "float32"), sim.tensor(vb), sim.tensor(sb, "float16"))
    assert sim.launches == []
    v, s = cascade.merge_state(sim.tensor(va), sim.tensor(sa, "float32"), sim.tensor(vb), sim.tensor(sb, "float32"))
    _close(sim.read(v), merge_state_ref(va, sa, vb, sb)[0], "float16", "v")
