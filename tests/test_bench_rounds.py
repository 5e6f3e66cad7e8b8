"""The benchmark's interleaved timing rounds (CPU: the candidates are plain functions)."""
import pytest

from pyflashattn.bench import prefill as bench


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


def test_host_overhead_rounds_interleave_and_take_the_median(monkeypatch):
    from pyflashattn.testing import bench_util

    now = [0.0]  # a fake clock that only the candidates advance
    monkeypatch.setattr(bench_util.time, "perf_counter", lambda: now[0])
    log, syncs = [], []
    # pfa's per-call cost: 1 us in its warmup call, then 5, 100 (an outlier round), 7 us per round
    pfa_cost = iter([1e-6] + [5e-6] * 2 + [100e-6] * 2 + [7e-6] * 2)

    def cand(name, cost):
        def fn():
            log.append(name)
            now[0] += cost()
        return fn

    fns = {"sdpa": cand("sdpa", lambda: 20e-6), "pfa": cand("pfa", lambda: next(pfa_cost)),
           "pfa_out": cand("pfa_out", lambda: 3e-6)}
    us = bench_util.host_overhead_interleaved_us(fns, 2, warmup=1, rounds=3, sync=lambda: syncs.append(1))
    # warmup once each, then n=2 calls per candidate and round, the order rotated every round
    assert log[:3] == ["sdpa", "pfa", "pfa_out"]
    assert log[3::2] == ["sdpa", "pfa", "pfa_out", "pfa", "pfa_out", "sdpa", "pfa_out", "sdpa", "pfa"]
    assert len(syncs) == 1 + 9
    assert us["sdpa"] == pytest.approx(20.0) and us["pfa_out"] == pytest.approx(3.0)
    assert us["pfa"] == pytest.approx(7.0)  # the median of 5, 100, 7


def test_decode_benchmark_cases_run_on_the_decode_tile():
    # every case must fit the decode tile's routing at hd64 / hd128 (DECODE_MAX_ROWS), or the
    # benchmark measures the 128-row path; the quick cases fit one 16-row tile at every head_dim
    from pyflashattn.bench import decode as bd
    from pyflashattn._engine.routing import DECODE_MAX_ROWS
    for i, (name, B, qo, (lo, hi)) in enumerate(bd.CASES):
        rows = qo * (bd.HQ // bd.HKV)
        assert rows <= min(DECODE_MAX_ROWS[64], DECODE_MAX_ROWS[128]) and 0 < lo <= hi, name
        assert i >= 2 or rows <= 16, name


def test_decode_tables_print_measured_and_missing_values(capsys):
    from pyflashattn.bench import decode as bench_decode
    batch = {"case": "decode B=64", "head_dim": 128, "kernel": "pfa_prefill_sm80_bf16_hd128_m16n32w1s2_lr",
             "ragged_tbps": 2.5, "paged_tbps": 2.4, "fp8_paged_tbps": None, "ragged_over_copy": 0.8,
             "paged_over_copy": 0.75, "fp8_paged_over_copy": None, "paged_us": 10.0, "fp8_paged_us": None,
             "errors": ["pfa fp8_paged: boom"]}
    single = {"case": "single qo=1", "head_dim": 64, "pfa_tbps": 1.5, "sdpa_tbps": 1.0, "pfa_over_copy": 0.5,
              "pfa_us": 20.0, "sdpa_us": 30.0, "errors": []}
    bench_decode._print_tables([batch], [single], 3.0)
    out = capsys.readouterr().out.splitlines()
    row = next(line for line in out if line.startswith("decode B=64"))
    assert "2.50" in row and "0.80" in row and "   -" in row and "! pfa fp8_paged: boom" in row
    row = next(line for line in out if line.startswith("single qo=1"))
    assert "1.50" in row and "1.00" in row and row.rstrip().endswith("1.50")  # pfa/sdpa = 30 / 20


def test_bench_entry_dispatches_each_subcommand_to_its_module(monkeypatch):
    import importlib

    from pyflashattn.bench import __main__ as entry
    seen = []
    for name in ("prefill", "batch", "decode"):
        mod = importlib.import_module(f"pyflashattn.bench.{name}")
        monkeypatch.setattr(mod, "main", lambda argv, name=name: seen.append((name, argv)) or 0)
    assert entry.main(["prefill", "--quick", "--json", "a.json"]) == 0
    assert entry.main(["prefill-features", "--quick"]) == 0
    assert entry.main(["batch", "--quick", "--json", "b.json"]) == 0
    assert entry.main(["decode", "--quick"]) == 0
    # prefill's parser owns both of its subcommands; batch and decode take the flags alone
    assert seen == [("prefill", ["prefill", "--quick", "--json", "a.json"]),
                    ("prefill", ["prefill-features", "--quick"]),
                    ("batch", ["--quick", "--json", "b.json"]), ("decode", ["--quick"])]


def test_bench_entry_without_a_subcommand_prints_usage(capsys):
    from pyflashattn.bench import __main__ as entry
    assert entry.main([]) == 2
    out = capsys.readouterr().out
    for name in ("prefill", "prefill-features", "batch", "decode", "pyflashattn.bench.demo"):
        assert name in out
    assert entry.main(["bench_batch"]) == 2
    assert "unknown subcommand" in capsys.readouterr().err


def test_bench_subcommands_parse_the_old_flags(monkeypatch):
    # the flags the Makefile and the A/B script pass reach each module's run() unchanged
    from pyflashattn.bench import batch, decode, prefill
    from pyflashattn.testing import bench_util
    got = {}
    monkeypatch.setattr(bench_util, "run_if_cuda", lambda run, args: got.setdefault(run.__module__, args) and 0)
    # prefill's main hands its run functions to run_if_cuda too
    monkeypatch.setattr(prefill, "run_if_cuda",
                        lambda run, args: got.setdefault("prefill_run", run) and got.setdefault("prefill", args) and 0)
    for mod in (batch, decode):
        mod.main(["--quick", "--json", "x.json"])
    prefill.main(["prefill", "--quick", "--json", "x.json"])
    for key in ("pyflashattn.bench.batch", "pyflashattn.bench.decode", "prefill"):
        assert got[key].quick and got[key].json == "x.json", key
    assert got["prefill_run"] is prefill.run_prefill


def test_batch_table_adds_flashinfer_only_when_it_was_timed():
    from pyflashattn.bench import batch

    row = {"batch": "uniform16", "causal": True, "num_requests": 16, "total_tokens": 41202, "errors": [],
           "ragged_tflops": 600.0, "paged_tflops": 500.0, "fp8_paged_tflops": 400.0}
    assert "FlashInfer" not in batch._table([row])
    row.update(fi_ragged_tflops=560.0, fi_paged_tflops=460.0, fi_fp8_paged_tflops=None, fi_ragged_backend="fa3",
               fi_paged_backend="fa3", fi_fp8_paged_backend="fa2", ragged_over_fi=600 / 560, paged_over_fi=500 / 460,
               fp8_paged_over_fi=None)
    text = batch._table([row])
    assert "backends fa2/fa3" in text
    last = text.splitlines()[-1]
    assert "560.0" in last and "460.0" in last and "1.07" in last and "1.09" in last and last.count("-") == 2


def test_batch_flashinfer_failure_is_an_error_of_the_row_not_of_the_run():
    from pyflashattn.bench import batch

    class Torch:
        class cuda:
            @staticmethod
            def get_device_capability():
                return (9, 0)

    class Fi:
        def BatchPrefillWithRaggedKVCacheWrapper(self, *a, **k):
            raise RuntimeError("no JIT here")

    ctx = type("Ctx", (), {"torch": Torch, "fi": Fi(), "ws_fi": None})()
    row = {"errors": []}
    assert batch._flashinfer_timer(ctx, row, "ragged", None, (), [], None, (), True, None) is None
    assert row["fi_ragged_backend"] == "fa3" and "flashinfer ragged (fa3): " in row["errors"][0]


def test_benches_say_why_flashinfer_is_not_timed(monkeypatch):
    import sys
    import types

    from pyflashattn.testing import bench_util

    monkeypatch.setenv("PFA_BENCH_FLASHINFER", "0")
    assert bench_util.import_flashinfer() == (None, "PFA_BENCH_FLASHINFER=0")
    monkeypatch.delenv("PFA_BENCH_FLASHINFER")
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not installed: the import raises ImportError
    fi, why = bench_util.import_flashinfer()
    assert fi is None and "flashinfer" in why

    class Broken:  # an install whose import fails inside (a missing dependency, say)
        def find_spec(self, name, path=None, target=None):
            if name == "flashinfer":
                raise RuntimeError("tvm_ffi is missing")
            return None

    monkeypatch.delitem(sys.modules, "flashinfer")
    monkeypatch.setattr(sys, "meta_path", [Broken()] + sys.meta_path)
    fi, why = bench_util.import_flashinfer()
    assert fi is None and "tvm_ffi is missing" in why
    fake = types.ModuleType("flashinfer")
    monkeypatch.setattr(sys, "meta_path", sys.meta_path[1:])
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    assert bench_util.import_flashinfer() == (fake, None)


def test_prefill_table_adds_flashinfer_and_the_best_peer_only_when_it_was_timed():
    row = {"head_dim": 64, "seq": 4096, "causal": False, "heads": 32, "errors": [], "pfa_tflops": 520.0,
           "flash_tflops": 300.0, "cudnn_tflops": 480.0, "pfa_over_flash": 520 / 300, "pfa_over_cudnn": 520 / 480,
           "pfa_max_abs_diff": 1e-3, "fp8_tflops": None, "fp8_over_pfa": None}
    assert "fi" not in bench._table([row], False).splitlines()[1].split()
    row.update(fi_tflops=540.0, fi_backend="fa3", pfa_over_best=520 / 540)
    text = bench._table([row], False)
    assert "FlashInfer fa3" in text and "pfa/best" in text
    last = text.splitlines()[-1]
    assert "540.0" in last and "0.96" in last


def test_prefill_flashinfer_column_checks_then_times_and_a_failure_is_the_rows(monkeypatch):
    calls = []

    class Fi:
        def single_prefill_with_kv_cache(self, q, k, v, causal, backend):
            calls.append((causal, backend))
            return q

    ctx = type("Ctx", (), {"torch": None, "fi": Fi(), "fi_backend": "fa3",
                           "bench_samples_ms": staticmethod(lambda fn, warmup, rep: [fn() and 1.0])})()
    checked = []
    monkeypatch.setattr(bench, "_check",
                        lambda torch, o, ref: checked.append((o, ref)) or (0.5 if ref == "far" else 1e-3, 0.0))
    row, timers = {"errors": []}, {}
    bench._flashinfer_timer(ctx, row, "q", "k", "v", True, "ref", timers)
    assert row["fi_backend"] == "fa3" and row["fi_rel_err"] == 1e-3 and checked == [("q", "ref")]
    assert timers["fi"](1, 1) == [1.0] and calls == [(True, "fa3"), (True, "fa3")]
    row, timers = {"errors": []}, {}
    bench._flashinfer_timer(ctx, row, "q", "k", "v", False, "far", timers)  # past REL_TOL: not timed
    assert "fi" not in timers and "output mismatch" in row["errors"][0]
    monkeypatch.setattr(bench, "_check", lambda torch, o, ref: (float("nan"), 0.0))
    row, timers = {"errors": []}, {}
    bench._flashinfer_timer(ctx, row, "q", "k", "v", False, "ref", timers)  # NaN never passes
    assert "fi" not in timers and "output mismatch" in row["errors"][0]

    class Broken:
        def single_prefill_with_kv_cache(self, *a, **k):
            raise RuntimeError("no JIT here")

    ctx.fi = Broken()
    row, timers = {"errors": []}, {}
    bench._flashinfer_timer(ctx, row, "q", "k", "v", True, "ref", timers)
    assert not timers and row["errors"] == ["flashinfer (fa3): RuntimeError: no JIT here"]
    ctx.fi = None
    row = {"errors": []}
    bench._flashinfer_timer(ctx, row, "q", "k", "v", True, "ref", timers)
    assert row == {"errors": [], "fi_ms": None}
