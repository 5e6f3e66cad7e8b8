"""The kernels' division by launch constants (fastdiv.cuh's fast_div) against integer division,
with the host's multipliers (params.fast_divisor), over the dividends a kernel can give it."""
import numpy as np
import pytest

from pyflashattn._engine.params import fast_divisor, set_grid_order
from pyflashattn._runtime.params_gen import PrefillParams


def device_div(n: np.ndarray, mul: int, shift: int) -> np.ndarray:
    """fast_div as the kernel computes it: (umulhi(n, mul) + n) >> shift in 32-bit unsigned."""
    n = n.astype(np.uint64)
    hi = (n * np.uint64(mul)) >> np.uint64(32)
    s = hi + n
    assert int(s.max(initial=0)) < 1 << 32  # the sum stays inside 32 bits
    return (s >> np.uint64(shift)).astype(np.int64)


def dividends(d: int, rng) -> np.ndarray:
    top = (1 << 31) - 1
    edges = [0, 1, d - 1, d, d + 1, top, top - 1, top - d, top // d * d, top // d * d - 1]
    k = rng.integers(1, max(2, top // d), size=200, dtype=np.int64)
    near = np.concatenate([k * d - 1, k * d, k * d + 1])
    return np.unique(np.clip(np.concatenate([np.arange(0, 5000), rng.integers(0, top, 5000), near, edges]), 0, top))


DIVISORS = (list(range(1, 600)) + [2 ** e + o for e in range(10, 31) for o in (-1, 0, 1)] +
            [1009, 6553, 65535, 65537, 99991, 1_000_003, 123_456_789, (1 << 31) - 1])


@pytest.mark.parametrize("d", DIVISORS)
def test_fast_div_matches_integer_division(d):
    rng = np.random.default_rng(d)
    mul, shift = fast_divisor(d)
    assert 0 < mul < 1 << 32 and 0 <= shift <= 31
    n = dividends(d, rng)
    np.testing.assert_array_equal(device_div(n, mul, shift), n // d)


@pytest.mark.parametrize("d", [0, -3, 1 << 31])
def test_fast_divisor_refuses_what_it_cannot_divide_by(d):
    with pytest.raises(ValueError, match="divisor"):
        fast_divisor(d)


def logical_grid_at(p, item: int) -> tuple[int, int, int]:
    """work.cuh LogicalGrid::at, sectioned part by the multipliers and tail by division, in Python."""
    zh, per_z = p.grid_section_z, p.grid_x * p.grid_y
    if item >= zh * per_z:
        r = item - zh * per_z
        z, xy = r // per_z, r % per_z
        return xy % p.grid_x, xy // p.grid_x, zh + z
    per_x = p.grid_y * zh
    div = lambda n, name: int(device_div(np.array([n]), getattr(p, f"div_{name}_mul"), getattr(p, f"div_{name}_shift"))[0])
    x0 = div(item, "section") * p.grid_section
    last = x0 + p.grid_section > p.grid_x
    xs = p.grid_x - x0 if last else p.grid_section
    within = item - x0 * per_x
    yz = div(within, "last_x" if last else "x")
    z = div(yz, "y")
    return x0 + within - yz * xs, yz - z * p.grid_y, z


def logical_grid_by_division(p, item: int) -> tuple[int, int, int]:
    """The same order by plain integer division (LogicalGrid::at before the multipliers)."""
    zh, per_z = p.grid_section_z, p.grid_x * p.grid_y
    if item >= zh * per_z:
        r = item - zh * per_z
        return (r % per_z) % p.grid_x, (r % per_z) // p.grid_x, zh + r // per_z
    per_x = p.grid_y * zh
    x0 = item // (p.grid_section * per_x) * p.grid_section
    xs = min(p.grid_section, p.grid_x - x0)
    within = item - x0 * per_x
    yz = within // xs
    return x0 + within - yz * xs, yz % p.grid_y, yz // p.grid_y


@pytest.mark.parametrize("grid,section,section_z", [
    ((8, 1, 37), 8, 37), ((8, 1, 37), 3, 30), ((8, 3, 11), 3, 11), ((7, 2, 9), 2, 5), ((32, 1, 200), 5, 150),
    ((1, 1, 1), 1, 1), ((6, 4, 3), 4, 0)])
def test_logical_grid_visits_every_block_once_in_section_order(grid, section, section_z):
    p = PrefillParams()
    set_grid_order(p, grid, section, section_z)
    blocks = [logical_grid_at(p, i) for i in range(grid[0] * grid[1] * grid[2])]
    assert blocks == [logical_grid_by_division(p, i) for i in range(len(blocks))]
    assert sorted(blocks) == sorted((x, y, z) for x in range(grid[0]) for y in range(grid[1]) for z in range(grid[2]))
    sectioned = [b for b in blocks if b[2] < section_z]
    # the sectioned part: a section's x values all come before the next section's
    firsts = [b[0] // section for b in sectioned]
    assert firsts == sorted(firsts)
