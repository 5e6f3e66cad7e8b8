"""CPU tests of the float64 reference attention (pyflashattn.testing.reference).

The GPU tests trust this reference, so it is checked two independent ways: against a naive
per-element Python loop written straight from the definitions, and against closed forms
(one key, uniform logits, one-hot values) where the right answer is known without any loop.
Each option also gets a check that it changes the result, so a comparison that ignores an
option cannot pass by accident.
"""

from __future__ import annotations

import math
import warnings
import zlib

import numpy as np
import pytest

from pyflashattn.testing import reference as refmod
from pyflashattn.testing import alibi_slopes, attention_ref, to_numpy_f64

LOG2E = 1.0 / math.log(2.0)


# --------------------------------------------------------------------------------------
# Naive oracle: one logit at a time, plain Python floats, nothing shared with the module.
# --------------------------------------------------------------------------------------
def _rope_vec(x, pos, rope_scale, rope_theta):
    d = len(x)
    h = d // 2
    out = [0.0] * d
    for t in range(h):
        ang = pos * (rope_theta ** (-2.0 * t / d)) / rope_scale
        c, s = math.cos(ang), math.sin(ang)
        out[t] = x[t] * c - x[t + h] * s
        out[t + h] = x[t + h] * c + x[t] * s
    return out


def naive_attention(q, k, v, *, causal=False, kv_layout="NHD", sm_scale=None, window_left=-1,
                    logits_soft_cap=0.0, custom_mask=None, pos_encoding_mode="NONE",
                    rope_scale=1.0, rope_theta=1e4, lse_base="log2", slopes=None,
                    top_left_causal=False):
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    qo_len, hq, d = q.shape
    if kv_layout == "HND":
        hkv, kv_len, _ = k.shape
        kget = lambda j, h: list(k[h, j])  # noqa: E731
        vget = lambda j, h: list(v[h, j])  # noqa: E731
    else:
        kv_len, hkv, _ = k.shape
        kget = lambda j, h: list(k[j, h])  # noqa: E731
        vget = lambda j, h: list(v[j, h])  # noqa: E731
    dv = v.shape[-1]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    g = hq // hkv
    o = np.zeros((qo_len, hq, dv))
    lse = np.zeros((qo_len, hq))
    for h in range(hq):
        kh = h // g
        for i in range(qo_len):
            p = i + kv_len - qo_len
            qi = list(q[i, h])
            if pos_encoding_mode == "ROPE_LLAMA":
                qi = _rope_vec(qi, p, rope_scale, rope_theta)
            logits = []
            for j in range(kv_len):
                if custom_mask is not None:
                    ok = bool(custom_mask[i][j])
                elif causal:
                    ok = j <= (i if top_left_causal else p)
                else:
                    ok = True
                if window_left >= 0 and j < p - window_left:
                    ok = False
                if not ok:
                    continue
                kj = kget(j, kh)
                if pos_encoding_mode == "ROPE_LLAMA":
                    kj = _rope_vec(kj, j, rope_scale, rope_theta)
                s = scale * sum(a * b for a, b in zip(qi, kj))
                if logits_soft_cap:
                    s = logits_soft_cap * math.tanh(s / logits_soft_cap)
                if pos_encoding_mode == "ALIBI":
                    s += slopes[h] * (j - i)
                logits.append((j, s))
            if not logits:
                o[i, h] = 0.0
                lse[i, h] = -math.inf
                continue
            mx = max(s for _, s in logits)
            den = sum(math.exp(s - mx) for _, s in logits)
            acc = [0.0] * dv
            for j, s in logits:
                w = math.exp(s - mx)
                vj = vget(j, kh)
                for t in range(dv):
                    acc[t] += w * vj[t]
            o[i, h] = [a / den for a in acc]
            nat = mx + math.log(den)
            lse[i, h] = nat * LOG2E if lse_base == "log2" else nat
    return o, lse


# Hand-written ALiBi slopes for the head counts the naive comparisons use.
HAND_SLOPES = {
    4: [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8],
    6: [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3],
}


def _rand(rng, shape, dtype=np.float16):
    # Rounded to a 16-bit type first, as the GPU tests hand the reference rounded inputs.
    return rng.standard_normal(shape).astype(dtype)


def _problem(rng, qo_len, kv_len, hq, hkv, d, layout="NHD", dv=None):
    q = _rand(rng, (qo_len, hq, d))
    kshape = (kv_len, hkv, d) if layout == "NHD" else (hkv, kv_len, d)
    vshape = kshape[:2] + (dv or d,)
    return q, _rand(rng, kshape), _rand(rng, vshape)


def _assert_same(o, lse, o_ref, lse_ref):
    assert o.shape == o_ref.shape and lse.shape == lse_ref.shape
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], rtol=1e-12, atol=1e-12)


OPTION_CASES = {
    "plain": {},
    "causal": {"causal": True},
    "sm_scale": {"sm_scale": 0.7},
    "window": {"window_left": 2},
    "window0_causal": {"window_left": 0, "causal": True},
    "window_causal": {"window_left": 1, "causal": True},
    "softcap": {"logits_soft_cap": 1.5, "sm_scale": 2.0},
    "alibi": {"pos_encoding_mode": "ALIBI"},
    "alibi_causal": {"pos_encoding_mode": "ALIBI", "causal": True},
    "rope": {"pos_encoding_mode": "ROPE_LLAMA"},
    "rope_scaled": {"pos_encoding_mode": "ROPE_LLAMA", "rope_scale": 2.5, "rope_theta": 50.0},
    "rope_causal_window": {"pos_encoding_mode": "ROPE_LLAMA", "causal": True, "window_left": 3},
    "custom_mask": {"custom_mask": "random"},
    "custom_mask_ignores_causal": {"custom_mask": "random", "causal": True},
    "custom_mask_window": {"custom_mask": "random", "window_left": 1},
    "hnd": {"kv_layout": "HND", "causal": True},
    "ln": {"lse_base": "ln", "causal": True},
}
SHAPES = [  # qo_len, kv_len, hq, hkv, d
    (1, 1, 4, 4, 4),
    (3, 7, 4, 2, 8),
    (5, 5, 6, 3, 6),
    (6, 4, 4, 1, 4),  # qo > kv: bottom-right causal leaves the first rows empty
    (4, 9, 6, 2, 8),
]


def _materialise(opts, rng, qo_len, kv_len, hq):
    opts = dict(opts)
    if isinstance(opts.get("custom_mask"), str):
        m = rng.random((qo_len, kv_len)) < 0.6
        m[0, :] = False  # always one fully masked row
        opts["custom_mask"] = m
    return opts


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(OPTION_CASES))
def test_matches_naive_loop(name, shape):
    qo_len, kv_len, hq, hkv, d = shape
    rng = np.random.default_rng(zlib.crc32(repr((name, shape)).encode()))
    opts = _materialise(OPTION_CASES[name], rng, qo_len, kv_len, hq)
    q, k, v = _problem(rng, qo_len, kv_len, hq, hkv, d, layout=opts.get("kv_layout", "NHD"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(all="raise"):
            o, lse = attention_ref(q, k, v, **opts)
    o_n, lse_n = naive_attention(q, k, v, slopes=HAND_SLOPES.get(hq), **opts)
    _assert_same(o, lse, o_n, lse_n)


# (case, key) pairs whose removal must leave the answer unchanged: causal is documented to
# be ignored when a custom mask is given. kv_layout is covered by its own test.
_INERT = {("custom_mask_ignores_causal", "causal")}


@pytest.mark.parametrize("name", [n for n in OPTION_CASES if n != "plain"])
def test_each_option_changes_result(name):
    # Guards the naive comparison: an option that both the reference and the oracle ignored
    # would still "match", so every option must visibly move the result on these inputs.
    rng = np.random.default_rng(7)
    opts = _materialise(OPTION_CASES[name], rng, 4, 9, 6)
    q, k, v = _problem(rng, 4, 9, 6, 2, 8, layout=opts.get("kv_layout", "NHD"))
    o, lse = attention_ref(q, k, v, **opts)
    for key in opts:
        if key == "kv_layout":
            continue
        o0, lse0 = attention_ref(q, k, v, **{k_: v_ for k_, v_ in opts.items() if k_ != key})
        same_inf = np.array_equal(np.isneginf(lse), np.isneginf(lse0))
        same = same_inf and np.allclose(o, o0) and np.allclose(
            lse[np.isfinite(lse)], lse0[np.isfinite(lse0)])
        if (name, key) in _INERT:
            assert same, f"{name}: dropping {key} changed the result"
        else:
            assert not same, f"{name}: option {key} had no effect on the reference"


def test_kv_layout_only_changes_how_arrays_are_read():
    rng = np.random.default_rng(17)
    q, k, v = _problem(rng, 4, 9, 6, 2, 8)
    o, lse = attention_ref(q, k, v, causal=True)
    o_h, lse_h = attention_ref(q, k.transpose(1, 0, 2).copy(), v.transpose(1, 0, 2).copy(),
                               causal=True, kv_layout="HND")
    _assert_same(o_h, lse_h, o, lse)


def test_bottom_right_is_not_top_left():
    rng = np.random.default_rng(1)
    q, k, v = _problem(rng, 3, 8, 2, 2, 4)
    o, _ = attention_ref(q, k, v, causal=True)
    o_tl, _ = naive_attention(q, k, v, causal=True, top_left_causal=True)
    o_br, _ = naive_attention(q, k, v, causal=True)
    assert not np.allclose(o, o_tl)
    np.testing.assert_allclose(o, o_br, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------
# Closed forms
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("sm_scale", [None, 0.3, 3.0])
def test_single_key_lse_is_scaled_logit_times_log2e(sm_scale):
    rng = np.random.default_rng(2)
    q, k, v = _problem(rng, 1, 1, 4, 2, 16)
    o, lse = attention_ref(q, k, v, sm_scale=sm_scale)
    _, lse_ln = attention_ref(q, k, v, sm_scale=sm_scale, lse_base="ln")
    scale = 1 / 4.0 if sm_scale is None else sm_scale
    qf, kf, vf = (x.astype(np.float64) for x in (q, k, v))
    for h in range(4):
        s = scale * float(qf[0, h] @ kf[0, h // 2])
        assert lse[0, h] == pytest.approx(s * LOG2E, rel=1e-13, abs=1e-13)
        assert lse_ln[0, h] == pytest.approx(s, rel=1e-13, abs=1e-13)
        np.testing.assert_allclose(o[0, h], vf[0, h // 2], rtol=1e-14)


def test_uniform_logits_lse_is_log2_count():
    # q = 0 makes every logit 0, so lse = log2(#keys) exactly and o = mean(v).
    rng = np.random.default_rng(3)
    _, k, v = _problem(rng, 1, 10, 2, 2, 8)
    q = np.zeros((4, 2, 8))
    o, lse = attention_ref(q, k, v)
    np.testing.assert_allclose(lse, np.log2(10.0), rtol=1e-14)
    np.testing.assert_allclose(o, np.broadcast_to(v.astype(np.float64).mean(0), o.shape), rtol=1e-12)


def _visible_counts(qo_len, kv_len, **opts):
    q = np.zeros((qo_len, 1, 4))
    k = np.ones((kv_len, 1, 4))
    v = np.ones((kv_len, 1, 4))
    _, lse = attention_ref(q, k, v, **opts)
    return np.where(np.isneginf(lse[:, 0]), 0, np.rint(2.0 ** lse[:, 0])).astype(int)


def test_causal_bottom_right_counts():
    # row i sees i + kv_len - qo_len + 1 keys
    np.testing.assert_array_equal(_visible_counts(3, 8, causal=True), [6, 7, 8])
    np.testing.assert_array_equal(_visible_counts(4, 4, causal=True), [1, 2, 3, 4])


@pytest.mark.parametrize("w", [0, 1, 3])
def test_window_inclusive_causal(w):
    counts = _visible_counts(5, 12, causal=True, window_left=w)
    np.testing.assert_array_equal(counts, [w + 1] * 5)


def test_window_zero_causal_sees_exactly_own_position():
    rng = np.random.default_rng(4)
    q, k, v = _problem(rng, 3, 6, 2, 1, 8)
    o, lse = attention_ref(q, k, v, causal=True, window_left=0)
    qf, kf, vf = (x.astype(np.float64) for x in (q, k, v))
    for i in range(3):
        p = i + 3
        for h in range(2):
            np.testing.assert_allclose(o[i, h], vf[p, 0], rtol=1e-14)
            s = float(qf[i, h] @ kf[p, 0]) / math.sqrt(8)
            assert lse[i, h] == pytest.approx(s * LOG2E, rel=1e-13, abs=1e-13)


def test_window_non_causal_has_no_right_bound():
    # p = i + 2; keeps kv_idx >= p - 1 up to the end of the KV
    np.testing.assert_array_equal(_visible_counts(4, 6, window_left=1), [5, 4, 3, 2])


def test_fully_masked_rows_are_zero_and_neg_inf_without_warnings():
    rng = np.random.default_rng(5)
    q, k, v = _problem(rng, 6, 3, 2, 2, 4)
    mask = np.ones((6, 3), dtype=bool)
    mask[2] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(all="raise"):
            o, lse = attention_ref(q, k, v, causal=True)
            o_m, lse_m = attention_ref(q, k, v, custom_mask=mask)
    # causal with qo 6 > kv 3: rows 0..2 sit at positions -3..-1 and see nothing
    assert np.isneginf(lse[:3]).all() and np.isfinite(lse[3:]).all()
    assert (o[:3] == 0).all() and np.abs(o[3:]).sum() > 0
    assert np.isneginf(lse_m[2]).all() and (o_m[2] == 0).all()
    assert np.isfinite(np.delete(lse_m, 2, axis=0)).all()


def test_custom_mask_replaces_causal():
    rng = np.random.default_rng(6)
    q, k, v = _problem(rng, 4, 4, 2, 2, 4)
    full = np.ones((4, 4), dtype=bool)
    o_m, lse_m = attention_ref(q, k, v, custom_mask=full, causal=True)
    o_f, lse_f = attention_ref(q, k, v)
    _assert_same(o_m, lse_m, o_f, lse_f)


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 4), (8, 2), (8, 1)])
def test_gqa_mapping(hq, hkv):
    # v of kv head j is the constant j, so o[:, h] must be exactly h // (hq // hkv).
    rng = np.random.default_rng(hq * 10 + hkv)
    q, k, _ = _problem(rng, 5, 7, hq, hkv, 8)
    v = np.broadcast_to(np.arange(hkv, dtype=np.float64)[None, :, None], (7, hkv, 8))
    o, _ = attention_ref(q, k, v, causal=True)
    want = (np.arange(hq) // (hq // hkv)).astype(np.float64)
    np.testing.assert_allclose(o, np.broadcast_to(want[None, :, None], o.shape), atol=1e-12)
    # and GQA equals MHA on explicitly repeated kv heads
    _, k2, v2 = _problem(rng, 5, 7, hq, hkv, 8)
    o_g, lse_g = attention_ref(q, k2, v2)
    rep = hq // hkv
    o_r, lse_r = attention_ref(q, np.repeat(k2, rep, axis=1), np.repeat(v2, rep, axis=1))
    _assert_same(o_g, lse_g, o_r, lse_r)


def test_alibi_slopes_hand_values():
    np.testing.assert_allclose(alibi_slopes(8), [2.0**-i for i in range(1, 9)], rtol=1e-15)
    want12 = [2.0**-i for i in range(1, 9)] + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5]
    np.testing.assert_allclose(alibi_slopes(12), want12, rtol=1e-15)
    np.testing.assert_allclose(alibi_slopes(1), [2.0**-8], rtol=1e-15)
    np.testing.assert_allclose(alibi_slopes(6), HAND_SLOPES[6], rtol=1e-15)


def test_alibi_lse_uses_unshifted_row_index():
    # Output is shift-invariant, LSE is not: with qo < kv the bias of row i at key j is
    # slope*(j - i), not slope*(j - (i + kv_len - qo_len)).
    q = np.zeros((2, 1, 4))
    k = np.zeros((5, 1, 4))
    v = np.zeros((5, 1, 4))
    _, lse = attention_ref(q, k, v, pos_encoding_mode="ALIBI", lse_base="ln")
    slope = 2.0**-8
    for i in range(2):
        want = math.log(sum(math.exp(slope * (j - i)) for j in range(5)))
        assert lse[i, 0] == pytest.approx(want, rel=1e-13)


def test_alibi_with_softcap_rejected():
    q = np.zeros((1, 1, 4))
    with pytest.raises(ValueError, match="(?i)alibi"):
        attention_ref(q, q, q, pos_encoding_mode="ALIBI", logits_soft_cap=30.0)


def test_rope_positions_against_rotation_matrix():
    # One query at position kv_len-1, one key per position: the logit must depend only on
    # the position difference (RoPE's defining property), checked on equal q/k content.
    rng = np.random.default_rng(8)
    d = 8
    x = rng.standard_normal(d)
    q = x[None, None, :]
    k = np.broadcast_to(x, (6, 1, d)).copy()
    qr = refmod._rope_llama(q, np.array([5]), 1.0, 100.0)
    kr = refmod._rope_llama(k, np.arange(6), 1.0, 100.0)
    qr2 = refmod._rope_llama(q, np.array([9]), 1.0, 100.0)
    kr2 = refmod._rope_llama(k, np.arange(4, 10), 1.0, 100.0)
    np.testing.assert_allclose(kr[:, 0] @ qr[0, 0], kr2[:, 0] @ qr2[0, 0], rtol=1e-12)
    # Rotation preserves norms; a rope_scale of 2 halves every angle.
    np.testing.assert_allclose(np.linalg.norm(kr, axis=-1), np.linalg.norm(x), rtol=1e-13)
    np.testing.assert_allclose(refmod._rope_llama(q, np.array([6]), 2.0, 100.0),
                               refmod._rope_llama(q, np.array([3]), 1.0, 100.0), rtol=1e-13)


def test_heads_subset_matches_full():
    rng = np.random.default_rng(9)
    q, k, v = _problem(rng, 5, 9, 8, 2, 8)
    for opts in ({"causal": True}, {"pos_encoding_mode": "ALIBI"}):
        o, lse = attention_ref(q, k, v, **opts)
        sel = [7, 0, 3]
        o_s, lse_s = attention_ref(q, k, v, heads=sel, **opts)
        _assert_same(o_s, lse_s, o[:, sel], lse[:, sel])


def test_row_blocking_does_not_change_result(monkeypatch):
    rng = np.random.default_rng(10)
    q, k, v = _problem(rng, 13, 17, 4, 2, 8)
    mask = rng.random((13, 17)) < 0.5
    for opts in ({"causal": True, "window_left": 4}, {"custom_mask": mask},
                 {"pos_encoding_mode": "ALIBI", "causal": True}):
        o, lse = attention_ref(q, k, v, **opts)
        monkeypatch.setattr(refmod, "_BLOCK_ELEMS", 40)  # 1 row of 2 heads x 17 keys per block
        o_b, lse_b = attention_ref(q, k, v, **opts)
        monkeypatch.undo()
        _assert_same(o_b, lse_b, o, lse)


def test_different_v_head_dim():
    rng = np.random.default_rng(11)
    q, k, v = _problem(rng, 3, 5, 2, 1, 8, dv=4)
    o, lse = attention_ref(q, k, v, causal=True)
    o_n, lse_n = naive_attention(q, k, v, causal=True)
    assert o.shape == (3, 2, 4)
    _assert_same(o, lse, o_n, lse_n)


def test_inputs_upcast_as_given():
    # bf16-rounded inputs are used as rounded: the reference must not see extra precision.
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal((3, 2, 8)).astype(ml_dtypes.bfloat16) for _ in range(3))
    o, lse = attention_ref(q, k, v)
    o2, lse2 = attention_ref(*(x.astype(np.float64) for x in (q, k, v)))
    _assert_same(o, lse, o2, lse2)
    assert to_numpy_f64(q).dtype == np.float64


@pytest.mark.parametrize("bad", [
    dict(q=(3, 4, 8), k=(5, 3, 8)),  # heads not divisible
    dict(q=(3, 4, 8), k=(5, 2, 6)),  # head_dim mismatch
    dict(q=(3, 4), k=(5, 2, 8)),  # rank
])
def test_bad_shapes_raise(bad):
    q = np.zeros(bad["q"])
    k = np.zeros(bad["k"])
    with pytest.raises(ValueError):
        attention_ref(q, k, k)


def test_bad_options_raise():
    q = np.zeros((2, 2, 4))
    with pytest.raises(ValueError):
        attention_ref(q, q, q, kv_layout="NDH")
    with pytest.raises(ValueError):
        attention_ref(q, q, q, lse_base="log10")
    with pytest.raises(ValueError):
        attention_ref(q, q, q, pos_encoding_mode="ROPE")
    with pytest.raises(ValueError):
        attention_ref(q, q, q, custom_mask=np.ones((2, 3), dtype=bool))


try:
    from hypothesis import given, settings, strategies as st
except ImportError:  # pragma: no cover - hypothesis is a dev dependency
    given = None

if given is not None:

    @settings(max_examples=60, deadline=None)
    @given(
        qo_len=st.integers(1, 5), kv_len=st.integers(1, 7), hkv=st.sampled_from([1, 2]),
        group=st.sampled_from([1, 2, 3]), d=st.sampled_from([2, 4, 6]),
        causal=st.booleans(), window_left=st.integers(-1, 4),
        mode=st.sampled_from(["NONE", "ALIBI", "ROPE_LLAMA", "SOFTCAP"]),
        layout=st.sampled_from(["NHD", "HND"]), use_mask=st.booleans(),
        seed=st.integers(0, 2**32 - 1),
    )
    def test_random_combinations_match_naive(qo_len, kv_len, hkv, group, d, causal, window_left,
                                             mode, layout, use_mask, seed):
        rng = np.random.default_rng(seed)
        hq = hkv * group
        q, k, v = _problem(rng, qo_len, kv_len, hq, hkv, d, layout=layout)
        opts = dict(causal=causal, window_left=window_left, kv_layout=layout)
        if mode == "SOFTCAP":
            opts["logits_soft_cap"] = 0.8
        else:
            opts["pos_encoding_mode"] = mode
        if use_mask:
            opts["custom_mask"] = rng.random((qo_len, kv_len)) < 0.5
        # alibi_slopes itself is pinned to hand values in test_alibi_slopes_hand_values.
        slopes = list(alibi_slopes(hq))
        o, lse = attention_ref(q, k, v, **opts)
        o_n, lse_n = naive_attention(q, k, v, slopes=slopes, **opts)
        _assert_same(o, lse, o_n, lse_n)


def test_page_spans_lays_requests_out_in_perm_order():
    """pyflashattn.testing.gpu.page_spans (the GPU tests' paged-cache layout): every key row lands
    once, on the pages perm hands out in order, the table padded with the filler id."""
    from pyflashattn.testing.gpu import page_spans

    kl, ps = [33, 0, 16, 17], 16
    perm = np.random.default_rng(0).permutation(10)
    table, spans = page_spans(kl, ps, perm, 9)
    assert table.dtype == np.int32 and table.shape == (4, 3)
    assert [pid for pid, _, _ in spans] == perm[:6].tolist()
    assert table[0].tolist() == perm[:3].tolist() and table[1].tolist() == [9, 9, 9]
    rows = np.concatenate([np.arange(lo, hi) for _, lo, hi in spans])
    assert rows.tolist() == list(range(sum(kl)))
    assert all(hi - lo <= ps for _, lo, hi in spans)
