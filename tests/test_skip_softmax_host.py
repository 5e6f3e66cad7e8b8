"""skip_softmax_threshold_scale_factor on the host (fake driver): validation names the argument
before any launch; the factor reaches the launched struct; a plan on a kernel without skip-softmax
(the 128-row lean sm80 kernels) runs skip-softmax calls on the general kernel of its tile, with the
same grid and the run's other fields, and goes back when the factor returns to 0 / None."""
from __future__ import annotations

import numpy as np
import pytest

from pyflashattn._engine import options
from pyflashattn.testing.fake_driver import (  # noqa: F401 - the shared fixtures' vocabulary
    D, F16, HKV, HQ, KV_INDICES, KV_INDPTR, LAST, NPAGES, PS, T, WS, f32, i32, last_attn, paged)

ARG = "skip_softmax_threshold_scale_factor"


@pytest.mark.parametrize("value, want", [(None, 0.0), (0, 0.0), (0.0, 0.0), (500, 500.0), (np.float32(2.5), 2.5)])
def test_factor_values(value, want):
    assert options.skip_softmax_factor(value) == want


@pytest.mark.parametrize("value, exc", [(-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                                        (True, TypeError), ("1", TypeError), ([1.0], TypeError)])
def test_bad_factor_names_the_argument(value, exc):
    with pytest.raises(exc, match=ARG):
        options.skip_softmax_factor(value)


QO_LONG = i32(0, 20, 25, 25)  # 20 x 4 packed rows: the 128-row kernel, not a decode tile


def _plan(w):
    w.plan(QO_LONG, KV_INDPTR, KV_INDICES, LAST, HQ, HKV, D, PS)


def _run(w, **kw):
    return w.run(T((25, HQ, D), F16, data=0x100000), T((NPAGES, 2, PS, HKV, D), F16, data=0x200000),
                 out=T((25, HQ, D), F16, data=0x400000), **kw)


def test_paged_prefill_runs_skip_softmax_on_the_general_sibling(fake):
    w = paged(fake)
    _plan(w)
    _run(w)
    name0, grid0, _, p0 = last_attn(fake)
    assert "general=False" in name0 and p0.skip_softmax_factor == 0.0
    _run(w, k_scale=0.5, **{ARG: 500.0})
    name1, grid1, _, p1 = last_attn(fake)
    assert "general=True" in name1 and grid1 == grid0
    assert p1.skip_softmax_factor == f32(500.0)
    assert p1.sm_scale_log2 == pytest.approx(p0.sm_scale_log2 * 0.5)
    # everything the plan wrote came along: metadata pointers, heads, mask fields
    for field in ("work_request", "qo_indptr", "kv_indptr", "kv_page_indices", "num_qo_heads", "causal",
                  "kv_chunk_size", "page_size", "o_partial"):
        assert getattr(p1, field) == getattr(p0, field), field
    _run(w, k_scale=0.5)  # off again: the plan's own kernel, with the run's scale
    name2, grid2, _, p2 = last_attn(fake)
    assert name2 == name0 and grid2 == grid0 and p2.skip_softmax_factor == 0.0
    assert p2.sm_scale_log2 == p1.sm_scale_log2


def test_bad_factor_refused_before_launch(fake):
    w = paged(fake)
    _plan(w)
    n = len(fake.attn_launches())
    with pytest.raises(ValueError, match=ARG):
        _run(w, **{ARG: -2.0})
    assert len(fake.attn_launches()) == n


def test_replan_resets_the_factor(fake):
    w = paged(fake)
    _plan(w)
    _run(w, **{ARG: 10.0})
    _plan(w)
    _run(w)
    name, _, _, p = last_attn(fake)
    assert "general=False" in name and p.skip_softmax_factor == 0.0


def test_decode_tile_takes_the_factor_itself(fake):
    from pyflashattn.decode import BatchDecodeWithPagedKVCacheWrapper as Decode
    w = Decode(WS(fake), "NHD")
    w.plan(KV_INDPTR, KV_INDICES, LAST, HQ, HKV, D, PS)
    b = len(KV_INDPTR) - 1
    q, o = T((b, HQ, D), F16, data=0x100000), T((b, HQ, D), F16, data=0x400000)
    c = T((NPAGES, 2, PS, HKV, D), F16, data=0x200000)
    w.run(q, c, out=o, **{ARG: 0.5})
    name, _, _, p = last_attn(fake)
    assert "decode=True" in name and p.skip_softmax_factor == 0.5
    w.run(q, c, out=o)
    name2, _, _, p = last_attn(fake)
    assert name2 == name and p.skip_softmax_factor == 0.0
