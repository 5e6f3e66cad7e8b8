"""numpy helpers for the planner's small arrays: few numpy calls, cached constants, in-place ops.

At serving batch sizes the planner's cost is mostly numpy's fixed cost per call (0.5-1 us on a
slow host) times a few dozen calls, so every helper here exists to cut that count or that cost.
"""
from __future__ import annotations

import numpy as np

# At batch sizes up to a few thousand, numpy's fixed cost per call (0.5-1 us on a slow host) is
# most of the planner's time: the code below keeps the number of numpy calls small, calls
# ufuncs and ndarray methods directly (np.cumsum, np.clip, np.ones, a.sum() and a.max() are
# Python wrappers or slow reductions; argmax has no ufunc machinery), updates in place, and
# passes its per-configuration constants as cached 0-d arrays (consts).
accumulate = np.add.accumulate
_U64 = np.dtype(np.uint64)  # descriptors: numpy takes them faster than the scalar types
_I8, _I16 = np.dtype(np.int8), np.dtype(np.int16)


class _Consts(dict):
    """consts[v]: v as a cached 0-d int64 array, for operands of int64 arrays: numpy resolves a
    Python int operand (a "weak" scalar) at about the cost of a whole small-array operation, a 0-d
    array of the same dtype gives the same result cheaply; a subscript (not a function call) keeps
    the lookup itself at dict speed. Only for values set by the configuration (block sizes,
    window), so the cache stays small (it is bounded anyway)."""

    def __missing__(self, v: int) -> np.ndarray:
        if len(self) >= 256:
            self.clear()
        a = self[v] = np.array(v, np.int64)
        a.flags.writeable = False
        return a


consts = _Consts()  # consts[v]: see _Consts


_SHARED = {"zeros": np.zeros(0, np.int32), "iota": np.arange(0, dtype=np.intp)}


def shared(name: str, n: int) -> np.ndarray:
    """A read-only view of n int32 zeros ("zeros") or of 0..n-1 as intp ("iota": index arrays
    of intp take numpy's fast gather path, int32 ones a slower one), sliced from a cached array
    that grows by doubling: no allocation (and no fresh pages to fault in) per plan."""
    a = _SHARED[name]
    if a.size < n:
        size = max(n, 2 * a.size, 1024)
        a = np.zeros(size, np.int32) if name == "zeros" else np.arange(size, dtype=np.intp)
        a.flags.writeable = False
        _SHARED[name] = a
    return a[:n]


def div(x: np.ndarray, d: int) -> np.ndarray:
    """x //= d in place, x int64, d a block size (floor division, also of negatives); a shift when
    d is a power of 2."""
    if d & (d - 1) == 0:
        x >>= consts[d.bit_length() - 1]
    else:
        x //= consts[d]
    return x


def unsigned_max(a: np.ndarray) -> int:
    """The largest entry of an int64 array read as uint64, 0 when empty: a negative entry reads as
    >= 2**63, so one pass both finds the maximum and checks the signs (argmax + one index are
    cheaper than a max reduction)."""
    if not a.size:
        return 0
    u = a.view(_U64)
    return u.item(u.argmax())


def lpt_order(neg: np.ndarray, mx: int) -> np.ndarray:
    """Longest first: the stable argsort of neg = -(KV tiles of each item), values in [-mx, 0].
    numpy's stable sort is a radix sort for keys of at most 16 bits (one pass per key byte, a
    pass skipped where every key has the same byte), which beats its merge sort beyond ~64 items
    for 8-bit keys and ~160 for 16-bit ones. The key is neg itself as int8 / int16 where that
    holds it (a plain astype: ~0.2 us, an add with an output dtype and unsafe casting ~1.5);
    for mx in (128, 256) mx + neg wrapped in uint8 (one pass, where int16 takes two), and for
    mx in (32768, 65536) in uint16. Any stable sort of equal-ordered keys gives the same
    permutation, so the key type never changes the result."""
    n = neg.size
    if mx <= 128:
        if n > 64:
            neg = neg.astype(_I8)
    elif n > 160 and mx < 65536:
        if mx < 256:
            neg = np.add(neg, mx, dtype=np.uint8, casting="unsafe")
        elif mx <= 32768:
            neg = neg.astype(_I16)
        else:
            neg = np.add(neg, mx, dtype=np.uint16, casting="unsafe")
    return neg.argsort(kind="stable")


