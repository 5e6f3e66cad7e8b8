"""The float64 skip-softmax reference (pyflashattn.testing.skip_softmax) against hand-built cases:
off equals plain attention, the threshold test is strict and in natural units, one row that is not
negligible keeps the tile for its whole group, a KV split starts its running max afresh, masked
keys and padding do not vote."""
import math

import numpy as np
import pytest

from pyflashattn.testing import attention_ref
from pyflashattn.testing.skip_softmax import skip_softmax_attention_ref, skip_softmax_keep


def _qkv(rng, qo, kv, hq, hkv, d):
    return rng.standard_normal((qo, hq, d)), rng.standard_normal((kv, hkv, d)), rng.standard_normal((kv, hkv, d))


@pytest.mark.parametrize("factor", [0, None])
@pytest.mark.parametrize("causal", [False, True])
def test_off_is_plain_attention(factor, causal):
    q, k, v = _qkv(np.random.default_rng(0), 7, 50, 4, 2, 16)
    o, lse = skip_softmax_attention_ref(q, k, v, factor=factor, group_rows=4, block_n=8, causal=causal)
    o_ref, lse_ref = attention_ref(q, k, v, causal=causal)
    np.testing.assert_allclose(o, o_ref, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, atol=1e-12)


def test_huge_factor_keeps_only_each_splits_first_tile():
    """T > 1 with finite logits: every tile after a split's first is negligible."""
    q, k, v = _qkv(np.random.default_rng(1), 3, 40, 2, 1, 8)
    o, lse, keep = skip_softmax_attention_ref(q, k, v, factor=1e9, group_rows=2, block_n=8, split=16,
                                              return_keep=True)
    want = np.zeros(40, bool)
    want[0:8] = want[16:24] = want[32:40] = True
    assert (keep == want).all()
    mask = np.broadcast_to(want, (3, 40))
    o_ref, lse_ref = attention_ref(q, k, v, custom_mask=mask)
    np.testing.assert_allclose(o, o_ref, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, atol=1e-12)


def test_threshold_is_strict_and_natural():
    """exp(tile_max - m) < T skips; == T (up to rounding on the safe side) does not."""
    t = 0.01
    for delta, skipped in ((math.log(t) - 1e-9, True), (math.log(t) + 1e-9, False)):
        logits = np.array([[5.0, 0, 0, 0, 5.0 + delta, 0, 0, 0]])
        keep = skip_softmax_keep(logits, np.ones_like(logits, bool), threshold=t, group_rows=1, block_n=4)
        assert keep[0, 4:].any() != skipped, delta
        assert keep[0, :4].all()


def test_group_votes_together_and_running_max_moves():
    """Row 1's second tile is not negligible: the group of rows 0-1 keeps it; the group of rows 2-3
    skips it. A kept tile moves the running max, so a later tile is judged against the new one."""
    lg = np.zeros((4, 12))
    lg[:, 0] = 10.0               # dominant first keys: everyone's first max is 10
    lg[1, 4] = 12.0               # row 1's tile 1 raises its max to 12
    lg[0:2, 8] = 10.0 - 3.0       # tile 2: exp(-3) ~ 0.05 vs m = 10 (row 0) and exp(-5) vs m = 12 (row 1)
    lg[2:4, 8] = 10.0 - 3.0
    vis = np.ones_like(lg, bool)
    keep = skip_softmax_keep(lg, vis, threshold=0.04, group_rows=2, block_n=4)
    assert keep[0:2, 4:8].all() and not keep[2:4, 4:8].any()
    assert keep[0:2, 8:].all() and keep[2:4, 8:].all()  # exp(-3) = 0.0498 >= 0.04 for rows 0 and 2
    keep = skip_softmax_keep(lg, vis, threshold=0.06, group_rows=2, block_n=4)
    assert not keep[:, 8:].any()                         # both groups: every row below 0.06


def test_masked_rows_and_keys_do_not_vote():
    """A row with no visible key in a tile (masked, causal) is negligible; a split's first tile is
    never skipped while it has a visible key."""
    lg = np.zeros((2, 8))
    lg[:, 0] = 20.0
    vis = np.ones_like(lg, bool)
    vis[1, 4:] = False  # row 1 sees only the first tile
    keep = skip_softmax_keep(lg, vis, threshold=1e-3, group_rows=2, block_n=4)
    assert keep[:, :4].all() and not keep[:, 4:].any()
    vis[0, :4] = False  # row 0 sees nothing in tile 0: its max stays -inf, tile 1 is kept for it
    keep = skip_softmax_keep(lg, vis, threshold=1e-3, group_rows=2, block_n=4)
    assert keep[0, 4:].all()


def test_gqa_packs_rows_by_token_then_head():
    """Groups are over packed rows r = q * g + h: with g = 2 and groups of 2 rows, token 0's two heads vote
    together, apart from token 1's."""
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 2, 16, 2, 1, 8)
    k[0] = 0
    k[0, 0, 0] = 100.0
    q[..., 0] = np.array([[1.0, 1.0], [1.0, -1.0]])  # token 1 head 1 is not dominated by key 0
    _, _, keep = skip_softmax_attention_ref(q, k, v, factor=1.0, group_rows=2, block_n=8, sm_scale=1.0,
                                            return_keep=True)
    assert not keep[:, 0, 8:].any()   # token 0, both heads: tile 1 skipped
    assert keep[:, 1, 8:].all()       # token 1: head 1 keeps the tile for head 0 too
