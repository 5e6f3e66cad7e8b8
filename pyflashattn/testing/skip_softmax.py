"""Float64 reference of skip-softmax sparsity (TRT-LLM's ``skip_softmax_threshold_scale_factor``,
semantics 1.12), at the granularity pyflashattn's kernels apply it (ARCHITECTURE.md):

* ``T = factor / kv_len`` with kv_len the request's key count; ``factor`` 0 or None = off.
* Rows vote in groups: ``group_rows`` consecutive packed rows of one kv head (packed row
  ``r = q_idx * group + head_in_group``, groups from r = 0): the manifest's ``skip_softmax_rows``
  (sm80 family: one warp's rows, 32 in the 128-row kernels and 16 in the decode tiles; sm90
  family: one consumer warpgroup's 64).
* Keys run in tiles of ``block_n`` on the absolute key grid, grouped into KV splits of ``split``
  keys (a multiple of block_n; None = one split): the running max starts at -inf in each split.
* For each tile, each row's tile max over its visible keys (-inf if none) is compared with its
  running max m over the tiles kept before it in the split: when ``exp(tile_max - m) < T`` for
  every row of the group (rows without a visible key in the tile count as negligible), the tile
  is dropped for the whole group; otherwise ``m = max(m, tile_max)``.
* The output is exact softmax attention over the keys left (a dropped tile adds nothing to the
  sum or the output; the splits merge exactly).

Logits are ``sm_scale * q.k`` (soft-capped when asked), in natural units; causal is bottom-right,
window_left inclusive, as in reference.py.
"""
from __future__ import annotations

import math

import numpy as np

from .reference import LOG2E, _row_keep, to_numpy_f64

__all__ = ["skip_softmax_keep", "skip_softmax_attention_ref"]


def skip_softmax_keep(logits: np.ndarray, visible: np.ndarray, *, threshold: float, group_rows: int, block_n: int,
                      split: int | None = None) -> np.ndarray:
    """The keys each row keeps: ``visible`` minus the tiles its group skips.

    logits, visible: ``[rows, kv_len]`` (float64 natural-unit logits and bool) of one kv head's
    packed rows in order; threshold: T (<= 0: nothing skipped)."""
    rows, kv_len = logits.shape
    keep = visible.copy()
    if threshold <= 0 or rows == 0 or kv_len == 0:
        return keep
    if group_rows < 1 or block_n < 1:
        raise ValueError("group_rows and block_n must be >= 1")
    split = kv_len if split is None else int(split)
    if split % block_n and split < kv_len:
        raise ValueError(f"split {split} must be a multiple of block_n {block_n}")
    log_t = math.log(threshold)
    masked = np.where(visible, logits, -np.inf)
    for g0 in range(0, rows, group_rows):
        g = slice(g0, min(g0 + group_rows, rows))
        for c0 in range(0, kv_len, split):
            m = np.full(g.stop - g.start, -np.inf)
            for t0 in range(c0, min(c0 + split, kv_len), block_n):
                t1 = min(t0 + block_n, kv_len, c0 + split)
                tmax = masked[g, t0:t1].max(axis=1)
                with np.errstate(invalid="ignore"):  # -inf - -inf: a row with no key yet
                    negligible = (tmax == -np.inf) | (tmax - m < log_t)
                if negligible.all():
                    keep[g, t0:t1] = False
                else:
                    m = np.maximum(m, tmax)
    return keep


def skip_softmax_attention_ref(q, k, v, *, factor, group_rows: int, block_n: int, split: int | None = None,
                               causal: bool = False, window_left: int = -1, sm_scale: float | None = None,
                               logits_soft_cap: float | None = 0.0, kv_layout: str = "NHD", lse_base: str = "log2",
                               return_keep: bool = False):
    """Single-request attention with skip-softmax in float64 (see the module docstring).

    q ``[qo_len, Hq, D]``, k / v ``[kv_len, Hkv, D]`` (NHD) or ``[Hkv, kv_len, D]`` (HND), any
    framework. Returns ``(o [qo_len, Hq, Dv], lse [qo_len, Hq])`` (lse base 2 unless
    lse_base="ln"; fully masked rows o = 0, lse = -inf), and with return_keep the kept-key mask
    ``[Hq, qo_len, kv_len]`` too."""
    q, k, v = to_numpy_f64(q), to_numpy_f64(k), to_numpy_f64(v)
    if kv_layout == "HND":
        k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
    elif kv_layout != "NHD":
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    if lse_base not in ("log2", "ln"):
        raise ValueError(f"lse_base must be 'log2' or 'ln', got {lse_base!r}")
    qo_len, hq, d = q.shape
    kv_len, hkv, _ = k.shape
    if hq % hkv:
        raise ValueError(f"num_qo_heads {hq} must be a multiple of num_kv_heads {hkv}")
    factor = 0.0 if factor is None else float(factor)
    if not (math.isfinite(factor) and factor >= 0):
        raise ValueError(f"factor must be finite and >= 0, got {factor}")
    threshold = factor / kv_len if kv_len else 0.0
    g = hq // hkv
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    cap = float(logits_soft_cap or 0.0)
    vis_q = _row_keep(np.arange(qo_len), kv_len, qo_len, causal, -1 if window_left is None else int(window_left),
                      None)
    vis_q = np.ones((qo_len, kv_len), bool) if vis_q is None else vis_q
    o = np.zeros((qo_len, hq, v.shape[-1]))
    lse = np.full((qo_len, hq), -np.inf)
    keep_all = np.zeros((hq, qo_len, kv_len), bool)
    for kvh in range(hkv):
        heads = kvh * g + np.arange(g)
        # packed rows r = q_idx * g + head_in_group
        s = np.einsum("qhd,kd->qhk", q[:, heads, :], k[:, kvh, :]) * sm_scale
        if cap > 0:
            s = cap * np.tanh(s / cap)
        s = s.reshape(qo_len * g, kv_len)
        vis = np.repeat(vis_q, g, axis=0)
        keep = skip_softmax_keep(s, vis, threshold=threshold, group_rows=group_rows, block_n=block_n, split=split)
        s = np.where(keep, s, -np.inf)
        m = s.max(axis=1, keepdims=True) if kv_len else np.full((qo_len * g, 1), -np.inf)
        p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
        den = p.sum(axis=1)
        live = den > 0
        ob = (p @ v[:, kvh, :]) / np.where(live, den, 1.0)[:, None]
        ob[~live] = 0.0
        lb = np.where(live, m[:, 0] + np.log(np.where(live, den, 1.0)), -np.inf)
        o[:, heads, :] = ob.reshape(qo_len, g, -1)
        lse[:, heads] = lb.reshape(qo_len, g)
        keep_all[heads] = keep.reshape(qo_len, g, kv_len).transpose(1, 0, 2)
    if lse_base == "log2":
        lse = lse * LOG2E
    return (o, lse, keep_all) if return_keep else (o, lse)
