"""build_tools/ab_host.py: the best-of-rounds merge and the 5 % host-time flag."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "build_tools"))
import ab_host  # noqa: E402


def _round(single, plan_r):
    return {"single": {"pfa_us": single, "pfa_out_us": single - 3}, "plan64": {"ragged_us": plan_r, "paged_us": 90},
            "plan1024": {"ragged_us": 200, "paged_us": None}, "run": {"ragged_us": 13, "paged_us": 14}}


def test_best_takes_the_minimum_over_rounds_and_skips_missing():
    b = ab_host.best([_round(20, 80), _round(18, 85), {"single": {}}])
    assert b["single.pfa_us"] == 18 and b["plan64.ragged_us"] == 80 and b["plan1024.paged_us"] is None


def test_table_flags_host_times_more_than_five_percent_up():
    before, after = ab_host.best([_round(20, 80)]), ab_host.best([_round(21.2, 83)])
    text = ab_host.table(before, after, 1)
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "HOST+" in rows["single.pfa_us"]  # 1.06
    assert "HOST+" not in rows["plan64.ragged_us"]  # 1.0375
    assert "HOST+" not in rows["plan1024.paged_us"]  # no numbers: no verdict
