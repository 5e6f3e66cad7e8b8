"""The benchmark's interleaved timing rounds (CPU: the candidates are plain functions)."""
from pyflashattn import bench


def _timer(name, value, calls):
    def run(warmup, rep):
        calls.append((name, warmup, rep))
        return [value] * rep
    return run


def test_rounds_rotate_the_order_and_pool_every_repetition():
    calls = []
    timers = {n: _timer(n, v, calls) for n, v in (("flash", 2.0), ("cudnn", 1.0), ("pfa", 3.0))}
    ms = bench._interleaved_ms(timers, 3, 20, errors := [])
    assert ms == {"flash": 2.0, "cudnn": 1.0, "pfa": 3.0} and not errors
    # each candidate runs first, in the middle and last once; ceil(20 / 3) repetitions a round
    assert [c[0] for c in calls] == ["flash", "cudnn", "pfa", "cudnn", "pfa", "flash", "pfa", "flash", "cudnn"]
    assert {(w, r) for _, w, r in calls} == {(3, 7)}


def test_median_spans_rounds():
    seq = iter([[1.0, 1.0], [5.0, 5.0], [9.0, 9.0]])
    ms = bench._interleaved_ms({"pfa": lambda w, r: next(seq)}, 1, 6, [])
    assert ms == {"pfa": 5.0}


def test_a_failing_candidate_is_dropped_with_its_error_and_the_rest_go_on():
    calls = []

    def boom(warmup, rep):
        raise RuntimeError("out of memory")

    errors = []
    ms = bench._interleaved_ms({"flash": boom, "pfa": _timer("pfa", 1.5, calls)}, 1, 4, errors)
    assert ms == {"pfa": 1.5}
    assert len(errors) == 1 and errors[0].startswith("flash:") and "out of memory" in errors[0]
    assert len(calls) == bench.ROUNDS  # pfa still ran every round
