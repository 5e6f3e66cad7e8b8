"""The opt-in checked mode for device-resident metadata (page tables, batch indices, positions).

Index arrays that live on the device cannot be checked without a sync, so kernels that read
them are written never to touch memory outside their buffers (they skip out-of-range entries)
and the host trusts them. Setting the environment variable ``PYFLASHATTN_CHECK_METADATA=1``
makes the APIs that support it copy those arrays to the host (a device sync per call: for
debugging, not for serving) and raise ValueError naming the argument and the first bad entry.
The variable is read at every call, so it can be switched on around one suspect call.
"""
from __future__ import annotations

import os

import numpy as np

ENV = "PYFLASHATTN_CHECK_METADATA"


def metadata_checks_enabled() -> bool:
    """True when ``PYFLASHATTN_CHECK_METADATA=1`` is set in the environment (read per call)."""
    return os.environ.get(ENV) == "1"


def check_range(values: np.ndarray, lo, hi, name: str, what: str, offset: int = 0) -> None:
    """ValueError naming ``name`` and its first entry outside [lo, hi) (``lo`` / ``hi`` scalars
    or arrays of values' shape); ``what`` says what the bound is, ``offset`` is added to the
    reported index (for a slice of a larger array)."""
    bad = (values < lo) | (values >= hi)
    if bad.any():
        i = int(np.argmax(bad))
        lo_i = lo[i] if np.ndim(lo) else lo
        hi_i = hi[i] if np.ndim(hi) else hi
        raise ValueError(f"{name}[{i + offset}] = {int(values[i])} is outside [{int(lo_i)}, {int(hi_i)}) "
                         f"({what}; {ENV}=1)")
