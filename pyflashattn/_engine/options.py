"""Attention options shared by every prefill entry point: normalised once, validated by name.

FlashInfer's conventions (semantics notes section 1): the soft cap acts on the scaled logit,
ALiBi uses FlashInfer's slopes and the unshifted query row, ROPE_LLAMA is rotate-half with
inv_freq_j = rope_theta^(-2j/D) / rope_scale. Combinations FlashInfer gets wrong or leaves
ambiguous are rejected here with a ValueError rather than computed some arbitrary way.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

POS_ENCODINGS = ("NONE", "ROPE_LLAMA", "ALIBI")
LSE_BASES = {"log2": 1.0, "ln": math.log(2.0)}  # multiplier from base-2 LSE


class Options(NamedTuple):
    soft_cap: float      # 0 = off
    pos: str             # one of POS_ENCODINGS
    rope_scale: float
    rope_theta: float
    lse_scale: float     # LSE_BASES[lse_base]

    @property
    def general(self) -> bool:
        """True when the general kernel (soft cap / ALiBi / RoPE / custom mask code) is needed."""
        return self.soft_cap > 0 or self.pos != "NONE"


def _positive(name, value, default):
    if value is None:
        return default
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {value!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return v


def resolve(pos_encoding_mode="NONE", allow_fp16_qk_reduction=False, logits_soft_cap=None, rope_scale=None,
            rope_theta=None, lse_base="log2") -> Options:
    if (pos_encoding_mode == "NONE" and not allow_fp16_qk_reduction and logits_soft_cap is None
            and rope_scale is None and rope_theta is None and lse_base == "log2"):
        return PLAIN  # the common call (no option given): nothing to validate
    if pos_encoding_mode not in POS_ENCODINGS:
        raise ValueError(f"pos_encoding_mode must be one of {POS_ENCODINGS}, got {pos_encoding_mode!r}")
    if allow_fp16_qk_reduction:
        # Rejected on purpose: QK^T is always reduced in fp32 here. FlashInfer's fp16 reduction
        # does not even compile in its JIT builds and mis-decodes halves (its issue #4297).
        raise NotImplementedError("allow_fp16_qk_reduction=True is not supported: pyflashattn always reduces "
                                  "QK^T in fp32 (FlashInfer's fp16 reduction is broken); pass False")
    soft_cap = _positive("logits_soft_cap", logits_soft_cap, 0.0)
    if soft_cap > 0 and pos_encoding_mode == "ALIBI":
        raise ValueError("logits_soft_cap together with pos_encoding_mode='ALIBI' is ambiguous in FlashInfer "
                         "(its kernel applies sm_scale twice) and is not supported")
    if lse_base not in LSE_BASES:
        raise ValueError(f"lse_base must be 'log2' or 'ln', got {lse_base!r}")
    return Options(soft_cap, pos_encoding_mode, _positive("rope_scale", rope_scale, 1.0),
                   _positive("rope_theta", rope_theta, 1e4), LSE_BASES[lse_base])


PLAIN = Options(0.0, "NONE", 1.0, 1e4, LSE_BASES["log2"])  # what resolve() gives with no option


def window(window_left) -> int:
    """window_left as an int >= -1 (-1 = no window); TypeError/ValueError naming it otherwise."""
    if type(window_left) is int and window_left >= -1:
        return window_left  # the common call, cheaply (plan() runs every serving step)
    import operator
    try:
        w = operator.index(window_left)
    except TypeError:
        raise TypeError(f"window_left must be an int, got {window_left!r}") from None
    if w < -1:
        raise ValueError(f"window_left must be >= -1 (-1 = no window), got {w}")
    return w


SKIP_SOFTMAX_ARG = "skip_softmax_threshold_scale_factor"


def skip_softmax_factor(factor) -> float:
    """skip_softmax_threshold_scale_factor (TRT-LLM's skip-softmax sparsity, semantics 1.12) as a
    float >= 0: None and 0 = off. TypeError / ValueError naming it otherwise."""
    if factor is None:
        return 0.0
    if isinstance(factor, (bool, str)) or not isinstance(factor, (int, float, np.integer, np.floating)):
        raise TypeError(f"{SKIP_SOFTMAX_ARG} must be a number (or None), got {type(factor).__name__}")
    v = float(factor)
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"{SKIP_SOFTMAX_ARG} must be a finite number >= 0 (0 or None = off), got {factor!r}")
    return v


def softmax_scale(sm_scale, head_dim: int) -> float:
    """sm_scale, defaulting to 1/sqrt(head_dim); must be finite and > 0."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    try:
        v = float(sm_scale)  # numpy scalars of any float width are fine
    except (TypeError, ValueError):
        raise ValueError(f"sm_scale must be a finite positive number, got {sm_scale!r}") from None
    if isinstance(sm_scale, (bool, str)) or not (math.isfinite(v) and v > 0):
        raise ValueError(f"sm_scale must be a finite positive number, got {sm_scale!r}")
    return v


def alibi_slopes(num_heads: int) -> np.ndarray:
    """FlashInfer's (Press et al.) ALiBi slopes, float32 [num_heads]: for n = 2^floor(log2 H),
    2^(-8(i+1)/n) for i < n, then (2^(-4/n))^k for k = 1, 3, 5, ... for the remaining heads."""
    n = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    extra = 2.0 ** (-4.0 / n)
    slopes += [extra ** k for k in range(1, 2 * (num_heads - n), 2)]
    return np.asarray(slopes[:num_heads], dtype=np.float32)
