"""switches.choice, the one reader of the fixed-value environment switches: a value it does not
know is a ValueError naming the variable, not the switch's default."""
import pytest

from pyflashattn._engine import params, routing, schedule, switches


def test_choice_reads_strips_and_refuses(monkeypatch):
    monkeypatch.delenv("PFA_TEST_SWITCH", raising=False)
    assert switches.choice("PFA_TEST_SWITCH", ("0", "1")) == ""
    monkeypatch.setenv("PFA_TEST_SWITCH", " 1 ")
    assert switches.choice("PFA_TEST_SWITCH", ("0", "1")) == "1"
    monkeypatch.setenv("PFA_TEST_SWITCH", "TMA")
    assert switches.choice("PFA_TEST_SWITCH", ("tma", "cpasync"), lower=True) == "tma"
    with pytest.raises(ValueError, match="PFA_TEST_SWITCH"):
        switches.choice("PFA_TEST_SWITCH", ("tma", "cpasync"))  # (not lowered: "TMA" is unknown)


@pytest.mark.parametrize("name,read", [
    (params.MERGE_CTA_ENV, lambda: params.merge_cta_per_row(0, 1, 1)),
    (schedule.STREAM_K_ENV, schedule.stream_k_mode),
    (routing.KV_LOAD_ENV, routing.kv_load_override),
])
def test_every_switch_refuses_an_unknown_value(monkeypatch, name, read):
    """(PYFLASHATTN_MERGE_CTA_PER_ROW read "yes" as its default before this reader.)"""
    monkeypatch.setenv(name, "yes")
    with pytest.raises(ValueError, match=name):
        read()
