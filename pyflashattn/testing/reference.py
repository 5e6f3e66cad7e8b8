"""Float64 numpy reference for single-request attention with FlashInfer semantics.

This is the oracle the GPU tests compare against, so it is written for clarity of the
definitions first and speed second (vectorised per kv head, chunked over query rows).
Conventions (see the project's FlashInfer semantics notes, section 1):

* logit ``s = sm_scale * q.k``; soft cap ``cap * tanh(s / cap)`` acts on the scaled logit;
  ALiBi adds ``slope[h] * (kv_idx - q_idx)`` with ``q_idx`` the 0-based row (no bottom-right
  shift), so the *output* equals textbook ALiBi but the LSE does not.
* causal is bottom-right: row ``i`` sits at ``p = i + kv_len - qo_len`` and keeps ``kv_idx <= p``;
  ``window_left >= 0`` keeps ``kv_idx >= p - window_left`` (inclusive, with or without causal);
  a custom mask replaces causal and is ANDed with the window.
* LSE is over the scaled logits, base 2 by default (``ln-LSE * log2(e)``).
* fully masked rows give ``o = 0`` and ``lse = -inf``.

Nothing here imports a GPU framework at module import time.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["attention_ref", "alibi_slopes", "merge_state_ref", "merge_states_ref", "to_numpy", "to_numpy_f64",
           "trtllm_request_ref"]

LOG2E = 1.0 / math.log(2.0)

# Bound on the float64 logit block held at once (elements): 2**24 * 8 B = 128 MiB, plus
# one temporary of the same size during the exp.
_BLOCK_ELEMS = 1 << 24


def _framework(x) -> str:
    mod = type(x).__module__ or ""
    return mod.split(".", 1)[0]


def to_numpy(x) -> np.ndarray:
    """Host numpy copy of a numpy/torch/cupy/jax array, dtype kept where numpy has it.

    torch bf16 has no numpy dtype, so it becomes float32 (exact).
    """
    fw = _framework(x)
    if isinstance(x, np.ndarray):
        return x
    if fw == "torch":
        t = x.detach()
        if t.dtype.is_floating_point and t.element_size() < 4:
            t = t.float()
        return t.cpu().numpy()
    if fw == "cupy":
        return x.get()
    # jax, ml_dtypes scalars, lists, anything exposing __array__.
    return np.asarray(x)


def to_numpy_f64(x) -> np.ndarray:
    """float64 numpy copy of a numpy/torch/cupy/jax array (bf16 via ml_dtypes is fine)."""
    fw = _framework(x)
    if fw == "torch":
        # .double() rather than .float() so float64 inputs are not truncated.
        return x.detach().cpu().double().numpy()
    return np.asarray(to_numpy(x), dtype=np.float64)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi slopes, FlashInfer/Press et al.: float64 ``[num_heads]``.

    ``n = 2**floor(log2 H)``; slopes ``2**(-8 (i+1) / n)`` for ``i < n``; the extra heads take
    ``(2**(-4/n))**k`` for ``k = 1, 3, 5, ...``. FlashInfer stores them as float32; the
    difference (< 1e-7 relative) is far below any attention tolerance.
    """
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    n = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    extra_base = 2.0 ** (-4.0 / n)
    slopes += [extra_base**k for k in range(1, 2 * (num_heads - n), 2)]
    return np.asarray(slopes, dtype=np.float64)


def _rope_llama(x: np.ndarray, pos: np.ndarray, rope_scale: float, rope_theta: float) -> np.ndarray:
    """Rotate-half RoPE on ``x [n, H, D]`` at positions ``pos [n]``, in float64."""
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"ROPE_LLAMA needs an even head_dim, got {d}")
    half = d // 2
    freq = rope_theta ** (-2.0 * np.arange(half, dtype=np.float64) / d) / rope_scale
    ang = pos.astype(np.float64)[:, None] * freq[None, :]  # [n, half]
    cos = np.cos(ang)[:, None, :]
    sin = np.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _row_keep(q_rows: np.ndarray, kv_len: int, qo_len: int, causal: bool, window_left: int,
              custom_mask: np.ndarray | None) -> np.ndarray | None:
    """Keep-mask ``[len(q_rows), kv_len]`` for the given query rows, or None if all kept."""
    kv_idx = np.arange(kv_len)[None, :]
    pos = (q_rows + (kv_len - qo_len))[:, None]
    keep = None
    if custom_mask is not None:
        keep = custom_mask[q_rows]
    elif causal:
        keep = kv_idx <= pos
    if window_left >= 0:
        win = kv_idx >= pos - window_left
        keep = win if keep is None else keep & win
    return keep


def attention_ref(
    q,
    k,
    v,
    *,
    causal: bool = False,
    kv_layout: str = "NHD",
    sm_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float | None = 0.0,
    custom_mask=None,
    pos_encoding_mode: str = "NONE",
    rope_scale: float | None = 1.0,
    rope_theta: float | None = 1e4,
    lse_base: str = "log2",
    heads=None,
):
    """Single-request attention in float64.

    Parameters
    ----------
    q : ``[qo_len, Hq, D]`` array (numpy/torch/cupy/jax, any float dtype; upcast as given).
    k, v : ``[kv_len, Hkv, D]`` (NHD) or ``[Hkv, kv_len, D]`` (HND). ``v`` may have its own D.
    causal, window_left, custom_mask : see the module docstring. ``custom_mask`` is bool
        ``[qo_len, kv_len]``, True = keep; it replaces ``causal``.
    sm_scale : default ``1/sqrt(D_qk)``.
    logits_soft_cap : ``None`` or ``0`` means off.
    pos_encoding_mode : ``"NONE"``, ``"ROPE_LLAMA"`` or ``"ALIBI"`` (slopes from
        :func:`alibi_slopes` over all ``Hq`` heads). ALiBi with a soft cap raises ValueError.
    rope_scale, rope_theta : ROPE_LLAMA parameters (None -> 1.0 / 1e4).
    lse_base : ``"log2"`` (FlashInfer) or ``"ln"``.
    heads : optional sequence of query-head indices; only those are computed (same order),
        which keeps references for long sequences cheap. ALiBi slopes still follow the
        absolute head index.

    Returns
    -------
    o : float64 ``[qo_len, len(heads) or Hq, D_v]``
    lse : float64 ``[qo_len, len(heads) or Hq]``; ``-inf`` for fully masked rows.
    """
    q = to_numpy_f64(q)
    k = to_numpy_f64(k)
    v = to_numpy_f64(v)
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"q, k, v must be 3-D, got {q.shape}, {k.shape}, {v.shape}")
    if kv_layout == "HND":
        k = k.transpose(1, 0, 2)
        v = v.transpose(1, 0, 2)
    elif kv_layout != "NHD":
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    qo_len, hq, d = q.shape
    kv_len, hkv, dk = k.shape
    if dk != d:
        raise ValueError(f"q head_dim {d} != k head_dim {dk}")
    if v.shape[:2] != (kv_len, hkv):
        raise ValueError(f"v shape {v.shape} does not match k shape {k.shape}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"num_qo_heads {hq} must be a multiple of num_kv_heads {hkv}")
    if lse_base not in ("log2", "ln"):
        raise ValueError(f"lse_base must be 'log2' or 'ln', got {lse_base!r}")
    if pos_encoding_mode not in ("NONE", "ROPE_LLAMA", "ALIBI"):
        raise ValueError(f"unknown pos_encoding_mode {pos_encoding_mode!r}")
    cap = float(logits_soft_cap or 0.0)
    if cap < 0:
        raise ValueError(f"logits_soft_cap must be >= 0, got {cap}")
    if pos_encoding_mode == "ALIBI" and cap > 0:
        # FlashInfer's FA2 variant applies sm_scale twice in this combination; no sane
        # definition to match, so the reference refuses it like the library must.
        raise ValueError("ALIBI together with logits_soft_cap is not supported")
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    window_left = -1 if window_left is None else int(window_left)
    if custom_mask is not None:
        custom_mask = np.asarray(to_numpy(custom_mask)).astype(bool)
        if custom_mask.shape != (qo_len, kv_len):
            raise ValueError(f"custom_mask shape {custom_mask.shape} != {(qo_len, kv_len)}")
    heads = np.arange(hq) if heads is None else np.asarray(heads, dtype=np.int64).reshape(-1)
    if heads.size and (heads.min() < 0 or heads.max() >= hq):
        raise ValueError(f"heads must lie in [0, {hq})")

    group = hq // hkv
    if pos_encoding_mode == "ROPE_LLAMA":
        rs = 1.0 if rope_scale is None else float(rope_scale)
        rt = 1e4 if rope_theta is None else float(rope_theta)
        q = _rope_llama(q, np.arange(qo_len) + (kv_len - qo_len), rs, rt)
        k = _rope_llama(k, np.arange(kv_len), rs, rt)
    slopes = alibi_slopes(hq) if pos_encoding_mode == "ALIBI" else None

    o = np.zeros((qo_len, heads.size, v.shape[-1]), dtype=np.float64)
    lse = np.full((qo_len, heads.size), -np.inf, dtype=np.float64)
    if qo_len == 0 or kv_len == 0 or heads.size == 0:
        return o, lse

    for kvh, cols, rows, ob, lse_nat in _blocks(q, k, v, heads, group, sm_scale, cap, slopes, causal, window_left,
                                                custom_mask):
        o[rows[0]:rows[-1] + 1, cols, :] = ob.transpose(1, 0, 2)
        lse[rows[0]:rows[-1] + 1, cols] = lse_nat.T
    if lse_base == "log2":
        lse *= LOG2E
    return o, lse


def _blocks(q, k, v, heads, group, sm_scale, cap, slopes, causal, window_left, custom_mask):
    """Per kv head and block of query rows: (kv head, output columns, rows, o [g, r, Dv], natural
    lse [g, r]), with the scores of a block bounded by _BLOCK_ELEMS elements."""
    qo_len, _, d = q.shape
    kv_len = k.shape[0]
    kv_of = heads // group
    for kvh in np.unique(kv_of):
        cols = np.nonzero(kv_of == kvh)[0]  # output columns served by this kv head
        hs = heads[cols]
        kt = k[:, kvh, :].T  # [D, kv]
        vh = v[:, kvh, :]  # [kv, Dv]
        g = hs.size
        rows_per_block = max(1, _BLOCK_ELEMS // (g * kv_len))
        for r0 in range(0, qo_len, rows_per_block):
            rows = np.arange(r0, min(qo_len, r0 + rows_per_block))
            qb = q[rows[0]:rows[-1] + 1][:, hs, :].transpose(1, 0, 2)  # [g, r, D]
            s = (qb.reshape(g * rows.size, d) @ kt).reshape(g, rows.size, kv_len)
            s *= sm_scale
            if cap > 0:
                s /= cap
                np.tanh(s, out=s)
                s *= cap
            if slopes is not None:
                rel = (np.arange(kv_len)[None, :] - rows[:, None]).astype(np.float64)
                s += slopes[hs][:, None, None] * rel[None]
            keep = _row_keep(rows, kv_len, qo_len, causal, window_left, custom_mask)
            if keep is not None:
                np.copyto(s, -np.inf, where=~keep[None])
            m = s.max(axis=-1, keepdims=True)  # -inf on fully masked rows
            live = np.isfinite(m)
            # Shift by 0 on dead rows so exp(-inf - 0) = 0 rather than exp(nan).
            s -= np.where(live, m, 0.0)
            np.exp(s, out=s)
            l = s.sum(axis=-1)  # [g, r]
            ob = (s.reshape(g * rows.size, kv_len) @ vh).reshape(g, rows.size, -1)
            alive = l > 0
            safe_l = np.where(alive, l, 1.0)
            ob /= safe_l[..., None]
            ob[~alive] = 0.0
            yield kvh, cols, rows, ob, np.where(alive, m[..., 0] + np.log(safe_l), -np.inf)


def merge_states_ref(v, s, *, lse_base: str = "log2"):
    """Float64 merge of attention states (FlashInfer's ``merge_states``).

    ``v`` ``[seq, N, H, D]`` and ``s`` ``[seq, N, H]`` (any framework or dtype; upcast as given);
    ``lse_base``: ``"log2"`` (FlashInfer) or ``"ln"``, the base of ``s`` and of the merged LSE.
    A state of LSE ``-inf`` is empty: it contributes nothing and its ``v`` is not read (NaN
    included). Returns float64 ``(v [seq, H, D], s [seq, H])``; rows with no non-empty state
    give ``v = 0`` and ``s = -inf``. NaN LSEs propagate.
    """
    v = to_numpy_f64(v)
    s = to_numpy_f64(s)
    if v.ndim != 4 or s.shape != v.shape[:3]:
        raise ValueError(f"v must be [seq, N, H, D] and s [seq, N, H], got {v.shape} and {s.shape}")
    if lse_base not in ("log2", "ln"):
        raise ValueError(f"lse_base must be 'log2' or 'ln', got {lse_base!r}")
    seq, n, h, d = v.shape
    nat = s / LOG2E if lse_base == "log2" else s  # natural-log LSEs
    m = nat.max(axis=1) if n else np.full((seq, h), -np.inf)
    shift = np.where(m == -np.inf, 0.0, m)  # every state empty: exp(-inf - 0) = 0, not NaN
    w = np.exp(nat - shift[:, None, :])  # [seq, N, H]
    total = w.sum(axis=1)
    vw = np.where(w[..., None] != 0.0, v, 0.0) * w[..., None]  # empty states' v never read
    empty = total == 0.0
    o = vw.sum(axis=1) / np.where(empty, 1.0, total)[..., None]
    o[empty] = 0.0
    lse = np.where(empty, -np.inf, shift + np.log(np.where(empty, 1.0, total)))
    return o, (lse * LOG2E if lse_base == "log2" else lse)


def merge_state_ref(v_a, s_a, v_b, s_b, *, lse_base: str = "log2"):
    """Float64 merge of two attention states (FlashInfer's ``merge_state``): ``v`` ``[seq, H, D]``,
    ``s`` ``[seq, H]``; see :func:`merge_states_ref`."""
    v = np.stack([to_numpy_f64(v_a), to_numpy_f64(v_b)], axis=1)
    s = np.stack([to_numpy_f64(s_a), to_numpy_f64(s_b)], axis=1)
    return merge_states_ref(v, s, lse_base=lse_base)


def trtllm_request_ref(q, k, v, scale1, scale2, causal, wl, chunk, cap, slopes, sink):
    """float64 attention of one request as the TRT-LLM entry points define it: q [Lq, Hq, D], k / v
    [Lk, Hkv, D] (numpy), logits times scale1, optional soft cap / ALiBi slopes / chunked mask, a
    per-head sink [Hq] joining each row's sum, output times scale2. Returns (o [Lq, Hq, D], row max
    [Lq, Hq], row sum [Lq, Hq]) in natural units (FMHAv2's softmax stats)."""
    Lq, Hq, D = q.shape
    Lk, Hkv = k.shape[0], k.shape[1]
    g = Hq // Hkv
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = np.einsum("qhd,khd->hqk", q, kk) * scale1
    if cap:
        s = cap * np.tanh(s / cap)
    qi, ki = np.arange(Lq)[:, None], np.arange(Lk)[None, :]
    if slopes is not None:
        s = s + slopes[:, None, None] * (ki - qi)[None]
    p = qi + Lk - Lq
    keep = np.ones((Lq, Lk), bool)
    if causal:
        keep &= ki <= p
    if wl >= 0:
        keep &= ki >= p - wl
    if chunk:
        keep &= ki >= (p // chunk) * chunk
    s = np.where(keep[None], s, -np.inf)
    mx = s.max(-1, initial=-np.inf)
    m_use = np.where(np.isfinite(mx), mx, 0.0)
    e = np.exp(s - m_use[..., None])
    tot = e.sum(-1)
    if sink is not None:
        tot = tot + np.exp(sink[:, None] - m_use)
    o = np.einsum("hqk,khd->qhd", e / np.where(tot > 0, tot, 1)[..., None], vv) * scale2
    return o, mx.T, tot.T
