"""Shared numeric assertions for the GPU tests (numpy only; frameworks converted on the way in)."""
from __future__ import annotations

import numpy as np

from .reference import to_numpy_f64


def batch_heads_to_check(qo_lens, kv_lens, hq: int, seed: int, budget: int) -> list:
    """Per request of a batch: None (compare every q head) or the sorted q heads to compare, so
    that the float64 reference computes at most ~budget logits per request (the first and last
    head always, GQA group edges included, plus seeded random ones)."""
    logits = sum(qo * kv for qo, kv in zip(qo_lens, kv_lens))
    n = budget // max(1, logits)
    if n >= hq:
        return [None] * len(qo_lens)
    n = max(2, int(n))
    rng = np.random.default_rng(seed)
    out = []
    for _ in qo_lens:
        extra = rng.choice(np.arange(1, hq - 1), size=min(hq - 2, n - 2), replace=False)
        out.append(np.unique(np.concatenate([[0, hq - 1], extra])).astype(np.int64))
    return out


# The fp8 prefill kernels round P (the softmax weights, in [0, 1]) to e4m3 before P V, as
# FlashAttention-3 does: each weight moves by up to half an e4m3 ULP, 2^-4 of itself, so an output
# element by up to 2^-4 * sum_j p_j |v_j|, which is the attention of |V| (the weights are positive).
# A row of two or three keys can exceed FlashInfer's flat fp8 atol by that alone; a misplaced key,
# scale or tile stays far outside the bound.
E4M3_P_ROUNDING = 2.0 ** -4


def fp8_output_atol(atol: float, o_of_abs_v) -> np.ndarray:
    """Elementwise atol of an fp8 prefill output: atol plus the P-rounding bound above, from
    o_of_abs_v, the reference attention's output for |V| (same q, k, scales and mask)."""
    return atol + E4M3_P_ROUNDING * np.abs(to_numpy_f64(o_of_abs_v))


def assert_close(actual, ref, *, atol, rtol, what):
    """Elementwise |a - ref| <= atol + rtol*|ref| (atol a number or an array like ref); NaN never
    passes; -inf must match -inf."""
    a = to_numpy_f64(actual)
    ref = to_numpy_f64(ref)
    assert a.shape == ref.shape, f"{what}: shape {a.shape} != {ref.shape}"
    n_nan = int(np.isnan(a).sum())
    assert n_nan == 0, f"{what}: {n_nan} NaN of {a.size} (unwritten or poisoned elements)"
    ninf_ref = np.isneginf(ref)
    bad_inf = np.isneginf(a) != ninf_ref
    assert not bad_inf.any(), f"{what}: -inf pattern differs at {np.argwhere(bad_inf)[:5].tolist()}"
    fin = ~ninf_ref
    assert np.isfinite(a[fin]).all(), f"{what}: non-finite values where the reference is finite"
    err = np.where(fin, np.abs(a - np.where(fin, ref, 0.0)), 0.0)
    bound = atol + rtol * np.abs(np.where(fin, ref, 0.0))
    over = err > bound
    if over.any():
        idx = np.unravel_index(np.argmax(err - bound), err.shape)
        rel = np.linalg.norm((a - ref)[fin]) / max(np.linalg.norm(ref[fin]), 1e-300)
        raise AssertionError(
            f"{what}: {int(over.sum())}/{a.size} elements out of tolerance "
            f"(atol={atol if np.isscalar(atol) else 'elementwise'}, rtol={rtol}); worst at "
            f"{tuple(int(i) for i in idx)}: "
            f"got {a[idx]!r}, want {ref[idx]!r}; max err {err.max():.3e}, rel fro {rel:.3e}")
