r"""Merging attention states with FlashInfer's API (``flashinfer.cascade``'s merge functions).

    v, s = merge_state(v_a, s_a, v_b, s_b)          # two states -> one
    merge_state_in_place(v, s, v_other, s_other)    # (v, s) <- merge((v, s), (v_other, s_other))
    v, s = merge_states(v_stacked, s_stacked)       # N states -> one

An attention *state* over a set of keys is the pair ``(v, s)``: ``v`` the attention output
(softmax-weighted values) and ``s`` the log-sum-exp (LSE) of the scaled logits. States over
disjoint key sets merge into the state over their union (cascade / shared-prefix attention,
split-KV, context parallelism). With every LSE **base 2** (FlashInfer's convention, and what
pyflashattn's attention kernels return by default):

.. math::

    m = \max_i s_i, \quad w_i = 2^{s_i - m}, \quad
    v = \frac{\sum_i w_i v_i}{\sum_i w_i}, \quad s = m + \log_2 \sum_i w_i

A state with ``s = -inf`` (no keys) contributes nothing, and its ``v`` is never read; when every
state of a row is empty the row merges to ``v = 0``, ``s = -inf`` (never NaN).

**LSE base.** FlashInfer's merge kernels assume base-2 LSEs; feeding them natural-log LSEs (from
another library, or pyflashattn's ``lse_base="ln"``) silently gives wrong weights. Every function
here takes ``lse_base="log2"`` (default, FlashInfer's) or ``"ln"``: with ``"ln"`` the input LSEs
**and** the merged LSE are natural logs (``w_i = e^{s_i - m}``, ``s = m + ln sum w_i``). Both
states of a merge must use the same base.

Tensors are CUDA arrays of torch, CuPy or JAX (any mix on one device): values ``float16``,
``bfloat16`` or ``float32`` (one dtype per call), LSEs ``float32``. Values may be strided as long
as their last dimension is contiguous. Results come back in the framework of the first value
tensor, launched on that framework's current stream (JAX: the library stream, ordered with
JAX by the DLPack handshake). Nothing synchronises with the host: ``merge_state_in_place``
allocates nothing and is meant for CUDA-graph capture (the ``mask`` picks the rows per replay).
"""
from __future__ import annotations

from ._engine import cascade as _cascade

__all__ = ["merge_state", "merge_state_in_place", "merge_states"]


def merge_state(v_a, s_a, v_b, s_b, *, lse_base: str = "log2"):
    r"""Merge the attention state of key set ``A`` with that of key set ``B``.

    Parameters
    ----------
    v_a : CUDA array, ``[seq_len, num_heads, head_dim]``, float16 / bfloat16 / float32
        The attention output over ``A``.
    s_a : CUDA array, ``[seq_len, num_heads]``, float32
        The LSE over ``A`` (base 2 unless ``lse_base="ln"``).
    v_b : CUDA array, ``[seq_len, num_heads, head_dim]``, ``v_a``'s dtype
        The attention output over ``B``.
    s_b : CUDA array, ``[seq_len, num_heads]``, float32
        The LSE over ``B``.
    lse_base : str
        ``"log2"`` (default, FlashInfer's): ``s_a``, ``s_b`` and the returned ``S`` are base-2
        LSEs. ``"ln"``: all three are natural-log LSEs.

    Returns
    -------
    V : ``[seq_len, num_heads, head_dim]``, ``v_a``'s dtype
        The attention output over ``A ∪ B``.
    S : ``[seq_len, num_heads]``, float32
        The LSE over ``A ∪ B``, in ``lse_base``.
    """
    return _cascade.merge_pair(v_a, s_a, v_b, s_b, lse_base)


def merge_state_in_place(v, s, v_other, s_other, mask=None, *, lse_base: str = "log2") -> None:
    r"""Merge the state ``(v_other, s_other)`` into ``(v, s)``, writing ``v`` and ``s`` in place.

    Parameters
    ----------
    v : CUDA array, ``[seq_len, num_heads, head_dim]``, float16 / bfloat16 / float32
        The attention output to update (torch or CuPy: JAX arrays are immutable, a TypeError).
    s : CUDA array, ``[seq_len, num_heads]``, float32
        The LSE to update. It must be float32: FlashInfer converts a non-float32 ``s`` to a
        float32 copy and merges into that, silently losing the update; here it is a TypeError.
    v_other : CUDA array, ``[seq_len, num_heads, head_dim]``, ``v``'s dtype
        The other attention output (must not overlap ``v``).
    s_other : CUDA array, ``[seq_len, num_heads]``, float32
        The other LSE.
    mask : optional CUDA array, ``[seq_len]``, bool or uint8
        Rows whose entry is nonzero are merged; the others are left untouched (``v`` and ``s``
        both), so one captured CUDA graph can serve any subset of rows.
    lse_base : str
        ``"log2"`` (default, FlashInfer's) or ``"ln"``: the base of ``s``, ``s_other`` and of the
        LSE written into ``s``.
    """
    _cascade.merge_pair_in_place(v, s, v_other, s_other, mask, lse_base)


def merge_states(v, s, *, lse_base: str = "log2"):
    r"""Merge ``num_states`` attention states per row and head.

    Parameters
    ----------
    v : CUDA array, ``[seq_len, num_states, num_heads, head_dim]``, float16 / bfloat16 / float32
        The attention outputs of the states.
    s : CUDA array, ``[seq_len, num_states, num_heads]``, float32
        Their LSEs.
    lse_base : str
        ``"log2"`` (default, FlashInfer's) or ``"ln"``: the base of ``s`` and of the returned ``S``.

    Returns
    -------
    V : ``[seq_len, num_heads, head_dim]``, ``v``'s dtype
        The merged attention output (``num_states = 1``: a copy of the state; ``0``: zeros).
    S : ``[seq_len, num_heads]``, float32
        The merged LSE (``-inf`` where every state is empty).
    """
    return _cascade.merge_stacked(v, s, lse_base)
