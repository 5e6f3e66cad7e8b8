"""build_tools/ab_compare.py: best of rounds, the flags and the tables on synthetic JSONs in the
benchmarks' own formats, and one end-to-end A/B over two fake checkouts (CPU, subprocesses)."""
import importlib.util
import json
import pathlib
import re
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("ab_compare", ROOT / "build_tools" / "ab_compare.py")
ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab)


# --- synthetic JSONs, the schemas of pyflashattn/bench/{prefill,batch,decode}.py's writers ----------

def prefill_json(pfa, host=(12.0, 10.0), peer=1.0, errors=None):
    """pfa: {(head_dim, seq, causal): TFLOP/s or None}; host: (pfa_us, pfa_out_us)."""
    rows = []
    for (hd, seq, causal), tf in pfa.items():
        flops = 4.0 * seq * seq * (2048 // hd) * hd / (2 if causal else 1)
        ms = None if tf is None else flops / tf / 1e9
        flash, cudnn = 400.0 * peer, 500.0 * peer
        rows.append({"head_dim": hd, "seq": seq, "causal": causal, "heads": 2048 // hd, "flops": flops,
                     "batch": None, "errors": list((errors or {}).get((hd, seq, causal), [])),
                     "flash_ms": flops / flash / 1e9, "cudnn_ms": flops / cudnn / 1e9, "cudnn_vs_ref_rel": 1e-3,
                     "pfa_ms": ms, "pfa_rel_err": 2e-3, "pfa_max_abs_diff": 1e-2,
                     "pfa_tflops": tf, "flash_tflops": flash, "cudnn_tflops": cudnn,
                     "pfa_over_flash": None if tf is None else tf / flash,
                     "pfa_over_cudnn": None if tf is None else tf / cudnn})
    meta = {"device": "NVIDIA H100 80GB HBM3", "sm_count": 132, "torch": "2.11.0", "cudnn": 91000, "dtype": "bf16",
            "tokens": 16384, "hidden": 2048, "warmup": 3, "rep": 20, "rounds": 3, "l2_flush": True,
            "rel_tol": 0.02, "time": "2025-01-01T00:00:00+0000", "pyflashattn": "0.1.0"}
    return {"meta": meta, "rows": rows,
            "host_overhead": {"shape": "qo=kv=16, 8 heads, head_dim 128", "calls": 1000, "torch_sdpa_us": 30.0 / peer,
                              "pfa_us": host[0], "pfa_out_us": host[1]}}


def batch_json(tflops, plan_us=((64, 100.0, 120.0), (1024, 900.0, 1000.0)), run_us=(40.0, 45.0)):
    """tflops: {(batch name, causal): (ragged, paged, fp8_paged, single)}."""
    rows = []
    for (name, causal), (rg, pg, f8, sg) in tflops.items():
        r = {"batch": name, "causal": causal, "num_requests": 16, "total_tokens": 36000, "lengths": [2250] * 16,
             "flops": 1e13, "errors": [], "sdpa_loop_ms": 50.0, "single_flops": 2e13}
        for kind, tf in (("ragged", rg), ("paged", pg), ("fp8_paged", f8)):
            r[f"{kind}_ms"] = None if tf is None else 1e13 / tf / 1e9
            r[f"{kind}_workspace_bytes"] = 1 << 20
            r[f"{kind}_rel_err"] = 3e-3
            r[f"{kind}_tflops"] = tf
        r.update({"single_ms": None if sg is None else 2e13 / sg / 1e9, "single_rel_err": 2e-3,
                  "single_tflops": sg, "sdpa_loop_tflops": 200.0, "ragged_over_single": None,
                  "paged_over_ragged": None, "fp8_over_bf16_paged": None, "ragged_over_sdpa_loop": None})
        rows.append(r)
    meta = {"device": "NVIDIA H100 80GB HBM3", "sm_count": 132, "torch": "2.11.0", "dtype": "bf16", "num_qo_heads": 32,
            "num_kv_heads": 8, "head_dim": 128, "page_size": 16, "warmup": 2, "rep": 5, "l2_flush": True,
            "rel_tol": 0.02, "quick": True, "flops": "per request", "time": "t", "pyflashattn": "0.1.0"}
    host_plan = [{"batch": b, "total_q": 128 * b, "pages": 130 * b, "reps": 50, "ragged_us": rg, "paged_us": pg}
                 for b, rg, pg in plan_us]
    host_run = {"shape": "4 requests x 16 tokens, 32/8 heads, head_dim 128", "calls": 200,
                "ragged_us": run_us[0], "paged_us": run_us[1]}
    return {"meta": meta, "rows": rows, "host_plan": host_plan, "host_run": host_run}


def decode_json(tbps, single=2.0, copy=3.0, errors=()):
    """tbps: {(case, head_dim): (ragged, paged, fp8_paged)}."""
    rows = []
    for (case, hd), vals in tbps.items():
        r = {"case": case, "head_dim": hd, "batch": 64, "qo_len": 1, "kv_tokens": 160000, "kv_bytes": 655360000,
             "errors": list(errors), "kernel": "pfa_prefill_sm90a_bf16_hd128_m16n64w1s2_lr"}
        for kind, t in zip(("ragged", "paged", "fp8_paged"), vals):
            r[f"{kind}_us"] = None if t is None else 655.36 / t
            r[f"{kind}_tbps"] = t
            r[f"{kind}_over_copy"] = None if t is None else t / copy
        rows.append(r)
    singles = [{"case": "single qo=1 kv 32K", "head_dim": 128, "batch": 1, "qo_len": 1, "kv_tokens": 32768,
                "kv_bytes": 134217728, "errors": [], "kernel": "k", "pfa_us": 134.2 / single, "pfa_tbps": single,
                "sdpa_us": 134.2, "sdpa_tbps": 1.0, "pfa_over_copy": single / copy}]
    meta = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "copy_tbps": copy, "page_size": 16,
            "num_qo_heads": 32, "num_kv_heads": 8, "warmup": 2, "rep": 6, "quick": True, "time": "t"}
    return {"meta": meta, "rows": rows, "single": singles}


ROW = (128, 2048, True)
ROW2 = (64, 8192, False)


def _prefill_rounds(values, hosts, row2=(300.0, 300.0, 300.0), peer=1.0):
    return [ab.extract("prefill", prefill_json({ROW: v, ROW2: w}, host=h, peer=peer))
            for v, w, h in zip(values, row2, hosts)]


def _by_metric(comps):
    return {(c["row"], c["metric"]): c for c in comps}


# --- best of rounds -------------------------------------------------------------------------------

def test_best_of_rounds_is_max_throughput_and_min_host_time():
    m = ab.merge_rounds(_prefill_rounds([300.0, 310.0, 305.0], [(20.0, 11.0), (18.0, 12.0), (19.0, 10.0)]))
    tp = m["hd128 seq2048 causal | pfa TFLOP/s"]
    assert (tp["best"], tp["n"], tp["values"]) == (310.0, 3, [300.0, 310.0, 305.0])
    assert tp["spread"] == pytest.approx(10 / 310)
    assert m["single prefill host (qo=kv=16) | pfa us/call"]["best"] == 18.0
    assert m["single prefill host (qo=kv=16) | pfa out= us/call"]["best"] == 10.0
    assert m["hd128 seq2048 causal | torch flash TFLOP/s"]["role"] == "peer"


def test_a_failed_round_leaves_the_best_of_the_others():
    rounds = _prefill_rounds([300.0, None, 305.0], [(20.0, 11.0)] * 3)
    rounds[1] = None  # that run wrote no JSON at all
    m = ab.merge_rounds(rounds)
    tp = m["hd128 seq2048 causal | pfa TFLOP/s"]
    assert (tp["best"], tp["n"], tp["values"]) == (305.0, 2, [300.0, None, 305.0])


# --- flags ----------------------------------------------------------------------------------------

def _prefill_ab():
    before = ab.merge_rounds(_prefill_rounds([300.0, 310.0, 305.0], [(20.0, 11.0), (18.0, 12.0), (19.0, 10.0)]))
    # ROW: best 303 vs 310 (-2.3 %: flagged); ROW2: best 294.5 vs 300 (-1.8 %: not flagged)
    # host: pfa 18 -> 18.8 (+4.4 %: not flagged), out= 10 -> 10.6 (+6 %: flagged); peers 10 % slower
    after = ab.merge_rounds(_prefill_rounds([303.0, 290.0, 301.0], [(18.8, 10.6), (25.0, 10.9), (19.9, 11.5)],
                                            row2=(294.5, 280.0, 290.0), peer=0.9))
    return ab.compare(before, after)


def test_flags_throughput_beyond_2_percent_and_host_time_beyond_5_percent():
    c = _by_metric(_prefill_ab())
    slow = c[("hd128 seq2048 causal", "pfa TFLOP/s")]
    assert (slow["before"], slow["after"], slow["flag"]) == (310.0, 303.0, "slower")
    assert slow["ratio"] == pytest.approx(303 / 310)
    assert c[("hd64 seq8192 non-causal", "pfa TFLOP/s")]["flag"] == ""
    assert c[("single prefill host (qo=kv=16)", "pfa us/call")]["flag"] == ""
    grew = c[("single prefill host (qo=kv=16)", "pfa out= us/call")]
    assert (grew["before"], grew["after"], grew["flag"]) == (10.0, 10.6, "host+")
    # other systems are never flagged, however far they moved
    assert c[("hd128 seq2048 causal", "torch cudnn TFLOP/s")]["ratio"] == pytest.approx(0.9)
    assert all(x["flag"] == "" for x in c.values() if x["role"] == "peer")
    cnt = ab.counts(list(c.values()))
    assert (cnt["compared"], cnt["slower"], cnt["host_grew"], cnt["missing"]) == (4, 1, 1, 0)
    assert cnt["peer_ratio_geomean"] == pytest.approx(0.9)  # speed: the SDPA host time went up by 1/0.9


def test_faster_and_equal_pass():
    before = ab.merge_rounds(_prefill_rounds([300.0] * 3, [(20.0, 10.0)] * 3))
    after = ab.merge_rounds(_prefill_rounds([320.0] * 3, [(15.0, 10.0)] * 3))
    comps = ab.compare(before, after)
    assert not any(c["flag"] for c in comps)
    line = ab.summary_line({"prefill": ab.counts(comps)}, 0)
    assert line.startswith("A/B PASS") and "4 pyflashattn numbers" in line


def test_custom_tolerances():
    before = ab.merge_rounds(_prefill_rounds([300.0] * 3, [(20.0, 10.0)] * 3))
    after = ab.merge_rounds(_prefill_rounds([297.0] * 3, [(20.0, 10.0)] * 3))
    assert not any(c["flag"] for c in ab.compare(before, after))
    assert [c["flag"] for c in ab.compare(before, after, tput_tol=0.005) if c["flag"]] == ["slower"]


def test_batch_rows_plan_and_run_host_times():
    def rounds(scale, plan1024_paged):
        return [ab.extract("batch", batch_json(
            {("uniform16", True): (350.0 * scale, 340.0, 300.0, 380.0),
             ("skewed", False): (250.0, 240.0, 200.0, 390.0)},
            plan_us=((64, 100.0, 120.0), (1024, 900.0, plan1024_paged)))) for _ in range(3)]
    comps = ab.compare(ab.merge_rounds(rounds(1.0, 1000.0)), ab.merge_rounds(rounds(0.95, 1060.0)))
    c = _by_metric(comps)
    assert c[("uniform16 causal", "ragged TFLOP/s")]["flag"] == "slower"
    assert c[("uniform16 causal", "paged TFLOP/s")]["flag"] == ""
    assert c[("skewed non-causal", "single TFLOP/s")]["before"] == 390.0
    assert c[("plan() B=1024", "paged us")]["flag"] == "host+"
    assert c[("plan() B=64", "ragged us")]["flag"] == ""
    assert c[("run() 4x16 tokens", "paged us/call")]["after"] == 45.0
    assert c[("uniform16 causal", "torch sdpa loop TFLOP/s")]["role"] == "peer"
    cnt = ab.counts(comps)
    # 2 rows x 4 throughput columns + plan() 2 x 2 + run() 2
    assert (cnt["compared"], cnt["slower"], cnt["host_grew"], cnt["missing"]) == (14, 1, 1, 0)


def test_a_row_that_posts_no_time_or_a_failed_run_is_missing_with_its_error():
    case = ("decode B=64 kv 1K-4K", 128)
    before = ab.merge_rounds([ab.extract("decode", decode_json({case: (2.5, 2.4, 3.0)}))] * 3)
    after = ab.merge_rounds([ab.extract("decode", decode_json(
        {case: (2.5, 2.4, None)}, errors=["pfa fp8_paged: mismatch vs bf16 paged on the widened cache, rel 0.5"]))] * 3)
    c = _by_metric(ab.compare(before, after))
    miss = c[("decode B=64 kv 1K-4K hd128", "fp8_paged TB/s")]
    assert miss["flag"] == "missing" and miss["after"] is None
    assert any("mismatch" in e for e in miss["errors"])
    assert c[("decode B=64 kv 1K-4K hd128", "ragged TB/s")]["flag"] == ""
    assert c[("single qo=1 kv 32K hd128", "pfa TB/s")]["flag"] == ""
    assert c[("device copy", "torch copy_ TB/s")]["role"] == "peer"
    # every after run failed: all of pyflashattn's numbers are missing
    gone = ab.compare(before, ab.merge_rounds([None, None, None]))
    assert {x["flag"] for x in gone if x["role"] == "pfa"} == {"missing"}
    assert "| 2.5 | - | - | 3/3 0/3 |" in ab.render_table("decode", gone)
    assert ab.counts(gone)["missing"] == 4


# --- rendering ------------------------------------------------------------------------------------

def test_table_marks_the_flagged_rows():
    comps = _prefill_ab()
    md = ab.render_table("prefill", comps)
    lines = md.splitlines()
    assert lines[0].startswith("### prefill") and lines[2].startswith("| row | metric | before | after")
    slow = next(ln for ln in lines if ln.startswith("| hd128 seq2048 causal | pfa TFLOP/s"))
    assert "| 310 | 303 | 0.977 |" in slow and "**SLOWER**" in slow and "3/3 3/3" in slow
    ok = next(ln for ln in lines if ln.startswith("| hd64 seq8192 non-causal | pfa TFLOP/s"))
    assert "| 300 | 294.5 | 0.982 |" in ok and "**" not in ok
    host = next(ln for ln in lines if "pfa out= us/call" in ln)
    assert "| 10 | 10.6 | 1.060 |" in host and "**HOST+**" in host
    assert "torch" not in md  # peers go to their own table
    peers = ab.render_table("prefill", comps, role="peer")
    assert "torch flash TFLOP/s" in peers and "**" not in peers
    line = ab.summary_line({"prefill": ab.counts(comps)}, 1)
    assert line.startswith("A/B FLAGGED") and "1 throughput rows > 2 % slower" in line
    assert "1 host times > 5 % up" in line and "0 missing" in line and "1 failed runs" in line


def test_value_format():
    assert [ab.fmt_value(v) for v in (None, 2.5123, 312.44, 18.8, 1234.6)] == ["-", "2.512", "312.4", "18.8", "1235"]


def test_the_fp8_column_is_compared_as_pyflashattn_throughput():
    before = prefill_json({(128, 2048, False): 500.0})
    after = prefill_json({(128, 2048, False): 500.0})
    before["rows"][0]["fp8_tflops"], after["rows"][0]["fp8_tflops"] = 600.0, 550.0
    b, a = ab.extract("prefill", before), ab.extract("prefill", after)
    key = "hd128 seq2048 non-causal | pfa fp8 TFLOP/s"
    assert b[key]["role"] == "pfa" and b[key]["kind"] == "tput"
    assert (b[key]["value"], a[key]["value"]) == (600.0, 550.0)
    # a run without the column (a GPU without fp8 kernels) adds no row
    assert not any("fp8" in k for k in ab.extract("prefill", prefill_json({(128, 2048, False): 500.0})))


def test_the_bench_writers_still_use_the_keys_the_merge_reads():
    # a renamed JSON key in a bench module would silently turn its rows 'missing'
    keys = {"prefill": ["pfa_tflops", "fp8_tflops", "flash_tflops", "cudnn_tflops", "host_overhead", "pfa_us",
                        "pfa_out_us", "torch_sdpa_us", "head_dim", "seq", "causal", "errors"],
            "batch": ['"host_plan"', '"host_run"', "_tflops", "sdpa_loop", "fp8_paged", "single", '"batch"',
                      "_us"],
            "decode": ['"single"', "copy_tbps", "_tbps", '"case"', '"head_dim"']}
    for bench, words in keys.items():
        src = (ROOT / "pyflashattn" / "bench" / f"{bench}.py").read_text()
        for w in words:
            assert w in src, (bench, w)


# --- commands and order ---------------------------------------------------------------------------

def test_schedule_alternates_the_first_version_each_round():
    plan = ab.schedule(3, ("prefill", "batch"))
    assert plan[:4] == [(1, "prefill", "before"), (1, "prefill", "after"), (1, "batch", "before"),
                        (1, "batch", "after")]
    assert plan[4:6] == [(2, "prefill", "after"), (2, "prefill", "before")]
    assert [v for r, b, v in plan if b == "batch"] == ["before", "after", "after", "before", "before", "after"]
    assert ab.schedule(1, ("decode",), first_round=4) == [(4, "decode", "after"), (4, "decode", "before")]


def test_module_names_by_layout(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    (old / "pyflashattn").mkdir(parents=True)
    (new / "pyflashattn" / "bench").mkdir(parents=True)
    (new / "pyflashattn" / "bench" / "__main__.py").write_text("")
    assert ab.bench_command("py", str(old), "batch", "f.json") == ["py", "-m", "pyflashattn.bench_batch", "--quick",
                                                                   "--json", "f.json"]
    assert ab.bench_module_args(str(old), "decode") == ["-m", "pyflashattn.bench_decode"]
    assert ab.bench_module_args(str(old), "prefill") == ["-m", "pyflashattn.bench", "prefill"]
    for b in ab.BENCHES:
        assert ab.bench_module_args(str(new), b) == ["-m", "pyflashattn.bench", b]
    env = ab.bench_env(str(old), {"PYTHONPATH": "/tmp/site", "X": "1"})
    assert env["PYTHONPATH"] == f"{old}:/tmp/site" and env["PFA_CUBIN_DIR"] == f"{old}/cubins"
    assert env["PYTHONUNBUFFERED"] == "1" and env["X"] == "1"


# --- end to end over two fake checkouts ----------------------------------------------------------

_FAKE = textwrap.dedent('''
    import json, os, sys, time
    def emit(bench, argv):
        assert argv[0] == "--quick" and argv[1] == "--json", argv
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        with open(os.environ["FAKE_LOG"], "a") as f:
            f.write(json.dumps({"root": root, "bench": bench, "argv": sys.argv, "cwd": os.getcwd(),
                                "cubins": os.environ.get("PFA_CUBIN_DIR")}) + "\\n")
        with open(os.path.join(root, "payload.json")) as f:
            payload = json.load(f)
        time.sleep(payload.get("sleep", 0))
        data = payload.get(bench)
        if data is None:
            sys.stderr.write("Traceback (most recent call last):\\nRuntimeError: boom\\n")
            sys.exit(3)
        with open(argv[2], "w") as f:
            json.dump(data, f)
''')


def _fake_tree(path: pathlib.Path, new: bool, payload: dict):
    pkg = path / "pyflashattn"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_fake.py").write_text(_FAKE)
    (path / "cubins").mkdir()
    (path / "cubins" / "manifest.json").write_text("{}")
    (path / "payload.json").write_text(json.dumps(payload))
    if new:
        (pkg / "bench").mkdir()
        (pkg / "bench" / "__init__.py").write_text("")
        (pkg / "bench" / "__main__.py").write_text("import sys\nfrom pyflashattn._fake import emit\n"
                                                   "emit(sys.argv[1], sys.argv[2:])\n")
    else:
        (pkg / "bench.py").write_text("import sys\nfrom pyflashattn._fake import emit\n"
                                      "assert sys.argv[1] == 'prefill'\nemit('prefill', sys.argv[2:])\n")
        for b in ("batch", "decode"):
            (pkg / f"bench_{b}.py").write_text(f"import sys\nfrom pyflashattn._fake import emit\n"
                                               f"emit({b!r}, sys.argv[1:])\n")


def test_end_to_end_runs_both_layouts_interleaved_and_survives_a_failing_run(tmp_path, monkeypatch, capsys):
    pre = {ROW: 300.0, ROW2: 200.0}
    before = {"prefill": prefill_json(pre), "batch": batch_json({("uniform16", True): (350.0, 340.0, 300.0, 380.0)}),
              "decode": decode_json({("decode B=64 kv 1K-4K", 128): (2.5, 2.4, 3.0)})}
    after = {"prefill": prefill_json({ROW: 300.0, ROW2: 190.0}),  # -5 %: flagged
             "batch": batch_json({("uniform16", True): (350.0, 340.0, 300.0, 380.0)}),
             "decode": None}  # every decode run of the after tree fails
    _fake_tree(tmp_path / "A", False, before)
    _fake_tree(tmp_path / "B", True, after)
    log = tmp_path / "launches.jsonl"
    monkeypatch.setenv("FAKE_LOG", str(log))
    out = tmp_path / "ab"
    rc = ab.main(["--before", str(tmp_path / "A"), "--after", str(tmp_path / "B"), "--rounds", "2",
                  "--out", str(out), "--python", sys.executable])
    text = capsys.readouterr().out
    assert rc == 1
    launches = [json.loads(ln) for ln in log.read_text().splitlines()]
    who = [(pathlib.Path(x["root"]).name, x["bench"]) for x in launches]
    assert who == [("A", "prefill"), ("B", "prefill"), ("A", "batch"), ("B", "batch"), ("A", "decode"),
                   ("B", "decode"), ("B", "prefill"), ("A", "prefill"), ("B", "batch"), ("A", "batch"),
                   ("B", "decode"), ("A", "decode")]
    for x in launches:  # each tree from its own root with its own cubins
        assert x["cwd"] == x["root"] and x["cubins"] == str(pathlib.Path(x["root"]) / "cubins")
    assert [x["argv"][0].endswith(("bench.py", "__main__.py")) for x in launches if x["bench"] == "prefill"]
    assert sorted(p.name for p in out.glob("*_r*.json")) == sorted(
        f"{v}_{b}_r{r}.json" for r in (1, 2) for b in ab.BENCHES for v in ab.VERSIONS if (v, b) != ("after", "decode"))
    # one progress line per run, the failure with its stderr tail
    assert len(re.findall(r"^\[\d+/12\] round \d", text, re.M)) == 12
    assert "rc 3, no JSON" in text and "RuntimeError: boom" in text
    assert "A/B FLAGGED" in text
    summary = json.loads((out / "ab_summary.json").read_text())
    assert summary["counts"]["prefill"]["slower"] == 1
    assert summary["counts"]["decode"]["missing"] == 4 and summary["counts"]["batch"]["missing"] == 0
    assert len(summary["failed_runs"]) == 2
    md = (out / "ab_table.md").read_text()
    assert "**SLOWER**" in md and "**MISSING**" in md and "torch flash TFLOP/s" in md
    # the merge alone reads the same directory back to the same verdict
    rc2 = ab.main(["--before", str(tmp_path / "A"), "--after", str(tmp_path / "B"), "--out", str(out),
                   "--merge-only"])
    assert rc2 == 1 and json.loads((out / "ab_summary.json").read_text())["counts"] == summary["counts"]
    # an OUTDIR of another pair of trees is refused
    assert ab.main(["--before", str(tmp_path / "B"), "--after", str(tmp_path / "A"), "--out", str(out),
                    "--rounds", "1", "--only", "decode"]) == 2


def test_preflight_refuses_a_tree_without_cubins(tmp_path):
    _fake_tree(tmp_path / "A", True, {})
    assert ab.preflight(sys.executable, str(tmp_path / "A")) is None
    (tmp_path / "A" / "cubins" / "manifest.json").unlink()
    assert "manifest" in ab.preflight(sys.executable, str(tmp_path / "A"))


def test_a_hung_run_is_killed_and_the_time_limit_skips_runs_but_still_merges(tmp_path, monkeypatch, capsys):
    payload = {"sleep": 30, "decode": decode_json({("decode B=64 kv 1K-4K", 128): (2.5, 2.4, 3.0)})}
    _fake_tree(tmp_path / "A", False, payload)
    _fake_tree(tmp_path / "B", True, payload)
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "launches.jsonl"))
    args = ["--before", str(tmp_path / "A"), "--after", str(tmp_path / "B"), "--only", "decode"]
    assert ab.main(args + ["--rounds", "1", "--out", str(tmp_path / "ab1"), "--run-timeout", "0.5"]) == 1
    text = capsys.readouterr().out
    assert len(re.findall(r"^\[\d/2\] round 1 decode .* killed after 0.5 s in", text, re.M)) == 2
    assert "2 failed runs" in text
    assert not list((tmp_path / "ab1").glob("*_r1.json"))

    payload["sleep"] = 0.2
    (tmp_path / "A" / "payload.json").write_text(json.dumps(payload))
    (tmp_path / "B" / "payload.json").write_text(json.dumps(payload))
    # 5 s is the least a run is started with: after a run or two the rest are skipped
    ab.main(args + ["--rounds", "5", "--out", str(tmp_path / "ab2"), "--time-limit", "5.5"])
    text = capsys.readouterr().out
    done = len(list((tmp_path / "ab2").glob("*_decode_r*.json")))
    assert 1 <= done < 10 and "# time limit:" in text and "A/B " in text
    assert (tmp_path / "ab2" / "ab_summary.json").exists()
