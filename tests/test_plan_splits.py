"""Split-KV planning for single prefill: splits only when the grid under-fills the GPU, and the
chunks tile the KV exactly (whole BLOCK_N tiles, no empty split, nothing uncovered)."""
from hypothesis import given, settings
from hypothesis import strategies as st

from pyflashattn import _cuda, prefill


def plan(row_tiles, heads, kv_len, block_n, sms=132, min_blocks=1):
    _cuda._props[0] = {"sm_count": sms}
    try:
        return prefill._plan_splits(row_tiles, heads, kv_len, block_n, 0, min_blocks)
    finally:
        _cuda._props.pop(0, None)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64), st.integers(1, 64), st.integers(0, 1 << 20), st.sampled_from([32, 64, 128]),
       st.integers(1, 2))
def test_chunks_tile_the_kv(row_tiles, heads, kv_len, block_n, min_blocks):
    splits, chunk = plan(row_tiles, heads, kv_len, block_n, min_blocks=min_blocks)
    assert splits >= 1 and chunk % block_n == 0 and chunk > 0
    assert splits * chunk >= kv_len  # everything covered
    assert (splits - 1) * chunk < max(kv_len, 1)  # no split starts past the end
    if splits > 1:
        assert row_tiles * heads < 132 * min_blocks  # only an under-filled grid splits
        assert chunk >= 4 * block_n  # each split amortises its epilogue and the merge


def test_decode_like_problem_splits_and_big_problem_does_not():
    assert plan(1, 8, 32768, 64)[0] > 8
    assert plan(64, 32, 32768, 64) == (1, 32768)
    assert plan(1, 1, 100, 64)[0] == 1  # too short to be worth splitting
