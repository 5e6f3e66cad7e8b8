"""The environment switches of A/B runs and tests that take one of a fixed set of values
(PFA_SM90_KV_LOAD, PFA_SM90_DENSE_KV, PFA_SM90_SPAN_KV, PFA_STREAM_K, PYFLASHATTN_MERGE_CTA_PER_ROW), read where a
plan resolves its route. One reader, so that a value the switch does not know is a ValueError
naming the variable before any launch, never read as its default."""
from __future__ import annotations

import os

__all__ = ["choice"]


def choice(name: str, choices: tuple[str, ...], *, lower: bool = False) -> str:
    """Environment variable `name`, stripped (and lowered), as one of `choices`; "" where it is
    unset or empty."""
    want = os.environ.get(name, "").strip()
    if lower:
        want = want.lower()
    if want and want not in choices:
        raise ValueError(f"{name}={want!r}: expected one of {choices} (or unset)")
    return want
