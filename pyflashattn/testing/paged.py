"""Paged-cache batches for the page tests (numpy only; the eager and the pyflashattn.jax tests share them)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np


def append_batch(seed: int, B: int, ps: int, spare: int = 3, min_app: int = 1) -> SimpleNamespace:
    """A batch whose requests hold `old` tokens and append `app` more (at least min_app each, the
    first at least one), with their pages grown first (as FlashInfer requires), in a random page
    order with `spare` pages no request owns: page table, last page lengths, append indptr, and the
    generator for the test's own draws."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 3 * ps + 2, B)
    app = rng.integers(min_app, 2 * ps + 3, B)
    app[0] = max(app[0], 1)
    new = old + app
    pages = -(-new // ps)
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    P = int(kv_indptr[-1]) + spare
    kv_indices = rng.permutation(P)[:kv_indptr[-1]].astype(np.int32)
    last = np.where(pages > 0, new - (pages - 1) * ps, 0).astype(np.int32)
    app_indptr = np.concatenate([[0], np.cumsum(app)]).astype(np.int32)
    return SimpleNamespace(B=B, ps=ps, P=P, old=old, app=app, new=new, kv_indptr=kv_indptr, kv_indices=kv_indices,
                           last=last, app_indptr=app_indptr, nnz=int(app_indptr[-1]), rng=rng)
