"""Same-run A/B of two pyflashattn checkouts over the quick benchmarks (stdlib only).

    python3 build_tools/ab_compare.py --before DIR_A --after DIR_B --rounds 3 --out OUTDIR \\
        [--only prefill,batch,decode] [--time-limit 560]

DIR_A / DIR_B are checkout roots, each with its own ``pyflashattn/`` and ``cubins/manifest.json``.
Every run is a fresh process with ``PYTHONPATH=<root>`` (prepended), ``PFA_CUBIN_DIR=<root>/cubins``,
``PYTHONUNBUFFERED=1`` and the root as working directory (``python -m`` puts the working directory
first on sys.path, so running from the other tree would import the wrong package; a preflight
check asserts each root imports its own ``pyflashattn``). A root with ``pyflashattn/bench/__main__.py``
runs ``-m pyflashattn.bench prefill|batch|decode --quick --json F``; an older one
``-m pyflashattn.bench prefill``, ``-m pyflashattn.bench_batch`` and ``-m pyflashattn.bench_decode``.

Order: for round r, for each bench, both versions back to back, the first one alternating with r
(before first in odd rounds), so slow drifts of clocks and host speed hit both alike. JSON goes
to OUTDIR/<version>_<bench>_r<r>.json, the bench's stdout / stderr beside it (.log / .err).

Merge: rows are matched by their parameters (prefill: head_dim, seq, causal; batch: batch,
causal; plan(): batch size; decode: case, head_dim). Only pyflashattn's own numbers are compared,
each the best over rounds: max for throughput (TFLOP/s, TB/s), min for host times (single prefill
host overhead with and without out=, plan() at B=64 and B=1024, run() per call). Flags: throughput
more than 2 % lower after (``--tput-tol``), host time more than 5 % higher (``--host-tol``), and
a pyflashattn number missing on either side (failed run or a row that posted no time). torch
SDPA / cuDNN / copy numbers of the same runs are other systems: they are listed in the .md file
and summed up in one line, never flagged (their speed after / before, as a geomean, says whether
the machine drifted between the two versions' runs). Everything in OUTDIR is merged, so an A/B
split across calls with ``--only`` ends with one summary: OUTDIR/ab_table.md, OUTDIR/ab_summary.json.
Exit status: 0 nothing flagged, 1 something flagged, missing or a failed run, 2 bad arguments.

Run time (estimated from the code, not measured): each ``--quick`` run is dominated by process
start (torch import, CUDA context, cuDNN init: ~5-10 s) and a 1 s GPU warmup. prefill --quick:
12 rows x 3 backends x 3 rounds x (3 warmup + 7 reps) of <= 2 ms kernels plus ~15k tiny calls for
host overhead, and cuDNN builds a plan per new shape: ~20-45 s. batch --quick: 4 batches x 5 columns x 12 calls (the single-request
column of up to ~36k tokens is the longest, <= 60 ms a call), plan() 2 x 2 x 55, run() 2k calls,
~15-35 s. decode --quick: 2 cases + 1 single request at hd128, ~10-25 s. So 3 rounds x 3 benches
x 2 versions = 18 runs, ~6-10 min: at the device's 10-minute command limit. Split it, e.g.
``--only prefill,decode`` in one call and ``--only batch`` in the next with the same --out (keep
OUTDIR on the machine, e.g. an ignored bench_out/ab, rather than under $OUT: 8 files come back
at most; copy ab_table.md / ab_summary.json there), and pass ``--time-limit`` a little under the
command's limit: no run is started that would not end in time (from the longest run of that bench
so far), a run is killed at the limit, and the merge and tables are still written. The printed
per-run times tell the real figures. ``--first-round N`` adds rounds to an existing OUTDIR.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time

BENCHES = ("prefill", "batch", "decode")
VERSIONS = ("before", "after")
TPUT_TOL = 0.02
HOST_TOL = 0.05
RESULT_RE = re.compile(r"^(before|after)_(prefill|batch|decode)_r(\d+)\.json$")
CONFIG_NAME = "ab_config.json"
RUNS_NAME = "ab_runs.jsonl"

# ---------------------------------------------------------------------------------------------
# command lines
# ---------------------------------------------------------------------------------------------


def new_layout(root: str) -> bool:
    """Whether ``root`` has the ``pyflashattn.bench`` package (else the old top-level modules)."""
    return os.path.isfile(os.path.join(root, "pyflashattn", "bench", "__main__.py"))


def bench_module_args(root: str, bench: str) -> list[str]:
    """``-m`` arguments running one quick bench of the checkout at ``root``."""
    if new_layout(root):
        return ["-m", "pyflashattn.bench", bench]
    return {"prefill": ["-m", "pyflashattn.bench", "prefill"],
            "batch": ["-m", "pyflashattn.bench_batch"],
            "decode": ["-m", "pyflashattn.bench_decode"]}[bench]


def bench_command(python: str, root: str, bench: str, json_path: str) -> list[str]:
    return [python] + bench_module_args(root, bench) + ["--quick", "--json", json_path]


def bench_env(root: str, base: dict | None = None) -> dict:
    """The environment of a run: this root first on PYTHONPATH (other entries kept after it, such as
    a wheel target directory), its cubins, unbuffered output."""
    env = dict(os.environ if base is None else base)
    rest = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = root + (os.pathsep + rest if rest else "")
    env["PFA_CUBIN_DIR"] = os.path.join(root, "cubins")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def schedule(rounds: int, benches, first_round: int = 1) -> list[tuple[int, str, str]]:
    """(round, bench, version) in run order: per round each bench with both versions back to back,
    'before' first in odd rounds and 'after' first in even ones."""
    out = []
    for r in range(first_round, first_round + rounds):
        order = VERSIONS if r % 2 == 1 else VERSIONS[::-1]
        for b in benches:
            for v in order:
                out.append((r, b, v))
    return out


def result_name(version: str, bench: str, rnd: int) -> str:
    return f"{version}_{bench}_r{rnd}.json"


# ---------------------------------------------------------------------------------------------
# the numbers of one bench JSON
# ---------------------------------------------------------------------------------------------


def _num(x):
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _causal(c) -> str:
    return "causal" if c else "non-causal"


class _Rows:
    """Collects metrics: key -> {row, metric, kind ('tput' | 'host'), role ('pfa' | 'peer'), value,
    errors}."""

    def __init__(self):
        self.out = {}

    def add(self, row, metric, kind, role, value, errors=()):
        key = f"{row} | {metric}"
        self.out[key] = {"row": row, "metric": metric, "kind": kind, "role": role, "value": _num(value),
                         "errors": [str(e) for e in errors if e]}


def extract(bench: str, data: dict) -> dict:
    """The comparable numbers of one run's JSON (the formats written by pyflashattn.bench prefill,
    batch and decode), keyed by row parameters and metric."""
    m = _Rows()
    data = data if isinstance(data, dict) else {}
    if bench == "prefill":
        for r in data.get("rows") or []:
            row = f"hd{r.get('head_dim')} seq{r.get('seq')} {_causal(r.get('causal'))}"
            errs = r.get("errors") or []
            m.add(row, "pfa TFLOP/s", "tput", "pfa", r.get("pfa_tflops"), errs)
            if "fp8_tflops" in r:  # the e4m3 q / k / v column (sm_90 GPUs)
                m.add(row, "pfa fp8 TFLOP/s", "tput", "pfa", r.get("fp8_tflops"), errs)
            if "pfa_b_tflops" in r:  # batch columns (full runs only)
                m.add(row, "pfa x b TFLOP/s", "tput", "pfa", r.get("pfa_b_tflops"), errs)
            for peer in ("flash", "cudnn"):
                m.add(row, f"torch {peer} TFLOP/s", "tput", "peer", r.get(f"{peer}_tflops"))
                if f"{peer}_b_tflops" in r:
                    m.add(row, f"torch {peer} x b TFLOP/s", "tput", "peer", r.get(f"{peer}_b_tflops"))
        h = data.get("host_overhead")
        if isinstance(h, dict):
            row = "single prefill host (qo=kv=16)"
            errs = [h.get("error")]
            m.add(row, "pfa us/call", "host", "pfa", h.get("pfa_us"), errs)
            m.add(row, "pfa out= us/call", "host", "pfa", h.get("pfa_out_us"), errs)
            m.add(row, "torch SDPA us/call", "host", "peer", h.get("torch_sdpa_us"))
    elif bench == "batch":
        for r in data.get("rows") or []:
            row = f"{r.get('batch')} {_causal(r.get('causal'))}"
            errs = r.get("errors") or []
            for kind in ("ragged", "paged", "fp8_paged", "single"):
                m.add(row, f"{kind} TFLOP/s", "tput", "pfa", r.get(f"{kind}_tflops"), errs)
            m.add(row, "torch sdpa loop TFLOP/s", "tput", "peer", r.get("sdpa_loop_tflops"))
        for h in data.get("host_plan") or []:
            row = f"plan() B={h.get('batch')}"
            for kind in ("ragged", "paged"):
                m.add(row, f"{kind} us", "host", "pfa", h.get(f"{kind}_us"), [h.get(f"{kind}_error")])
        h = data.get("host_run")
        if isinstance(h, dict):
            for kind in ("ragged", "paged"):
                m.add("run() 4x16 tokens", f"{kind} us/call", "host", "pfa", h.get(f"{kind}_us"), [h.get("error")])
    elif bench == "decode":
        for r in data.get("rows") or []:
            row = f"{r.get('case')} hd{r.get('head_dim')}"
            for kind in ("ragged", "paged", "fp8_paged"):
                m.add(row, f"{kind} TB/s", "tput", "pfa", r.get(f"{kind}_tbps"), r.get("errors") or [])
        for r in data.get("single") or []:
            row = f"{r.get('case')} hd{r.get('head_dim')}"
            m.add(row, "pfa TB/s", "tput", "pfa", r.get("pfa_tbps"), r.get("errors") or [])
            m.add(row, "torch SDPA TB/s", "tput", "peer", r.get("sdpa_tbps"))
        meta = data.get("meta")
        if isinstance(meta, dict) and "copy_tbps" in meta:
            m.add("device copy", "torch copy_ TB/s", "tput", "peer", meta.get("copy_tbps"))
    else:
        raise ValueError(bench)
    return m.out


# ---------------------------------------------------------------------------------------------
# merging rounds and comparing
# ---------------------------------------------------------------------------------------------


def best(kind: str, values):
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return max(vals) if kind == "tput" else min(vals)


def merge_rounds(rounds) -> dict:
    """``rounds``: one extract() result per round (None for a run that gave no JSON). Returns key ->
    the metric's fields with ``values`` (one per round, None where missing), ``best`` (max for
    throughput, min for host times), ``n`` (rounds with a value), ``spread`` ((max - min) / best)
    and the rows' distinct errors."""
    merged = {}
    for i, ex in enumerate(rounds):
        for key, m in (ex or {}).items():
            e = merged.setdefault(key, {k: m[k] for k in ("row", "metric", "kind", "role")}
                                  | {"values": [None] * len(rounds), "errors": []})
            e["values"][i] = m["value"]
            for err in m.get("errors", []):
                if err not in e["errors"]:
                    e["errors"].append(err)
    for e in merged.values():
        vals = [v for v in e["values"] if v is not None]
        e["best"] = best(e["kind"], vals)
        e["n"] = len(vals)
        e["spread"] = (max(vals) - min(vals)) / e["best"] if vals and e["best"] else None
    return merged


def compare(before: dict, after: dict, tput_tol: float = TPUT_TOL, host_tol: float = HOST_TOL) -> list:
    """One entry per metric (before's order, then after-only ones): best before / after, the ratio
    after / before and a flag for pyflashattn's numbers: 'slower' (throughput ratio below
    1 - tput_tol), 'host+' (host-time ratio above 1 + host_tol), 'missing' (no value on a side)."""
    out = []
    for key in list(before) + [k for k in after if k not in before]:
        b, a = before.get(key), after.get(key)
        ref = b or a
        bv = b["best"] if b else None
        av = a["best"] if a else None
        ratio = av / bv if (av is not None and bv) else None
        flag = ""
        if ref["role"] == "pfa":
            if bv is None or av is None:
                flag = "missing"
            elif ref["kind"] == "tput" and ratio < 1.0 - tput_tol:
                flag = "slower"
            elif ref["kind"] == "host" and ratio > 1.0 + host_tol:
                flag = "host+"
        errors = []
        for side, e in (("before", b), ("after", a)):
            errors += [f"{side}: {x}" for x in (e["errors"] if e else [])]
        out.append({"key": key, "row": ref["row"], "metric": ref["metric"], "kind": ref["kind"],
                    "role": ref["role"], "before": bv, "after": av, "ratio": ratio, "flag": flag,
                    "n_before": b["n"] if b else 0, "n_after": a["n"] if a else 0,
                    "rounds_before": len((b or a)["values"]), "rounds_after": len((a or b)["values"]),
                    "spread_before": b["spread"] if b else None, "spread_after": a["spread"] if a else None,
                    "values_before": b["values"] if b else [], "values_after": a["values"] if a else [],
                    "errors": errors})
    return out


def counts(comps: list) -> dict:
    pfa = [c for c in comps if c["role"] == "pfa"]
    # the peers' speed after / before (a host time's inverse ratio): < 1 means the machine was slower
    peers = [c["ratio"] if c["kind"] == "tput" else 1.0 / c["ratio"]
             for c in comps if c["role"] == "peer" and c["ratio"]]
    return {"compared": len(pfa),
            "slower": sum(c["flag"] == "slower" for c in pfa),
            "host_grew": sum(c["flag"] == "host+" for c in pfa),
            "missing": sum(c["flag"] == "missing" for c in pfa),
            "peer_numbers": len(peers),
            "peer_ratio_geomean": math.exp(sum(math.log(r) for r in peers) / len(peers)) if peers else None,
            "peer_ratio_min": min(peers) if peers else None,
            "peer_ratio_max": max(peers) if peers else None}


# ---------------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------------


def fmt_value(v) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def render_table(bench: str, comps: list, role: str = "pfa") -> str:
    """Markdown table of one bench's comparisons of one role ('pfa' or 'peer')."""
    rows = [c for c in comps if c["role"] == role]
    title = (f"### {bench}: pyflashattn before vs after (best of rounds: max throughput, min host time)"
             if role == "pfa" else f"### {bench}: other systems in the same runs (context, not compared)")
    lines = [title, "", "| row | metric | before | after | after/before | rounds b/a | spread b/a | flag |",
             "|---|---|---:|---:|---:|---|---|---|"]
    for c in rows:
        flag = {"slower": "**SLOWER**", "host+": "**HOST+**", "missing": "**MISSING**"}.get(c["flag"], "")
        if c["flag"] == "missing" and c["errors"]:
            flag += " " + c["errors"][0][:100].replace("|", "/")
        lines.append(f"| {c['row']} | {c['metric']} | {fmt_value(c['before'])} | {fmt_value(c['after'])} | "
                     f"{'-' if c['ratio'] is None else format(c['ratio'], '.3f')} | "
                     f"{c['n_before']}/{c['rounds_before']} {c['n_after']}/{c['rounds_after']} | "
                     f"{_pct(c['spread_before'])}/{_pct(c['spread_after'])} | {flag} |")
    if not rows:
        lines.append("| (no numbers) | | | | | | | |")
    return "\n".join(lines)


def peer_line(bench: str, cnt: dict) -> str:
    if not cnt["peer_numbers"]:
        return f"{bench}: no peer numbers to compare"
    return (f"{bench} context: other systems' speed after/before over {cnt['peer_numbers']} numbers: geomean "
            f"{cnt['peer_ratio_geomean']:.3f}, range {cnt['peer_ratio_min']:.3f}..{cnt['peer_ratio_max']:.3f}")


def summary_line(per_bench: dict, failed_runs: int, tput_tol: float = TPUT_TOL, host_tol: float = HOST_TOL) -> str:
    tot = {k: sum(c[k] for c in per_bench.values()) for k in ("compared", "slower", "host_grew", "missing")}
    ok = not (tot["slower"] or tot["host_grew"] or tot["missing"])
    return (f"A/B {'PASS' if ok else 'FLAGGED'}: {tot['compared']} pyflashattn numbers compared over "
            f"{', '.join(per_bench) or 'no bench'}; {tot['slower']} throughput rows > {100 * tput_tol:g} % slower, "
            f"{tot['host_grew']} host times > {100 * host_tol:g} % up, {tot['missing']} missing; "
            f"{failed_runs} failed runs")


# ---------------------------------------------------------------------------------------------
# reading OUTDIR
# ---------------------------------------------------------------------------------------------


def discover(outdir: str) -> dict:
    """{bench: {version: {round: path}}} of the result JSONs in outdir."""
    found = {}
    for name in sorted(os.listdir(outdir)) if os.path.isdir(outdir) else []:
        mt = RESULT_RE.match(name)
        if mt:
            v, b, r = mt.group(1), mt.group(2), int(mt.group(3))
            found.setdefault(b, {}).setdefault(v, {})[r] = os.path.join(outdir, name)
    return found


def load_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def merge_outdir(outdir: str, tput_tol: float = TPUT_TOL, host_tol: float = HOST_TOL) -> dict:
    """Compare every bench with results in outdir: {bench: {'rounds': [...], 'comparisons': [...],
    'counts': {...}, 'devices': [...]}}, benches in BENCHES order."""
    found = discover(outdir)
    res = {}
    for bench in BENCHES:
        if bench not in found:
            continue
        rounds = sorted({r for v in found[bench].values() for r in v})
        merged, devices, unreadable = {}, set(), []
        for version in VERSIONS:
            per_round = []
            for r in rounds:
                path = found[bench].get(version, {}).get(r)
                data = load_json(path) if path else None
                if path and data is None:
                    unreadable.append(os.path.basename(path))
                if isinstance(data, dict) and isinstance(data.get("meta"), dict):
                    devices.add(str(data["meta"].get("device")))
                per_round.append(extract(bench, data) if isinstance(data, dict) else None)
            merged[version] = merge_rounds(per_round)
        comps = compare(merged["before"], merged["after"], tput_tol, host_tol)
        res[bench] = {"rounds": rounds, "comparisons": comps, "counts": counts(comps),
                      "devices": sorted(devices), "unreadable": unreadable}
    return res


def render_report(merged: dict, failed: list, tput_tol: float, host_tol: float, peers: bool) -> str:
    parts = []
    for bench, m in merged.items():
        parts.append(f"{bench}: rounds {', '.join(map(str, m['rounds']))} merged")
        parts.append(render_table(bench, m["comparisons"], "pfa"))
        parts.append(peer_line(bench, m["counts"]))
        if len(m["devices"]) > 1:
            parts.append(f"WARNING {bench}: runs on different devices: {', '.join(m['devices'])}")
        if m["unreadable"]:
            parts.append(f"WARNING {bench}: unreadable JSON: {', '.join(m['unreadable'])}")
        if peers:
            parts.append(render_table(bench, m["comparisons"], "peer"))
    for f in failed:
        parts.append(f"failed run: {f['version']} {f['bench']} round {f['round']}: {f['status']}")
    parts.append(summary_line({b: m["counts"] for b, m in merged.items()}, len(failed), tput_tol, host_tol))
    return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------


def _tail(path: str, n: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:]).rstrip()
    except OSError:
        return ""


def _bang_lines(path: str, n: int = 10) -> list[str]:
    """The benches print a row's errors as lines starting with '!'."""
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip() for line in f if line.startswith("!")][:n]
    except OSError:
        return []


def preflight(python: str, root: str) -> str | None:
    """None when the root looks runnable and imports its own pyflashattn (found, not executed);
    else why not."""
    if not os.path.isfile(os.path.join(root, "pyflashattn", "__init__.py")):
        return f"{root}: no pyflashattn/__init__.py"
    if not os.path.isfile(os.path.join(root, "cubins", "manifest.json")):
        return f"{root}: no cubins/manifest.json (build the cubins of this tree first)"
    code = "import importlib.util as u; print(u.find_spec('pyflashattn').origin)"
    try:
        p = subprocess.run([python, "-c", code], cwd=root, env=bench_env(root), capture_output=True, text=True,
                           timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{root}: {python} failed to start: {e}"
    origin = p.stdout.strip()
    want = os.path.realpath(os.path.join(root, "pyflashattn"))
    if p.returncode != 0 or not os.path.realpath(origin).startswith(want + os.sep):
        return f"{root}: pyflashattn resolves to {origin or p.stderr.strip()[-300:]!r}, not this tree"
    return None


def run_one(python: str, root: str, bench: str, json_path: str, timeout: float | None) -> dict:
    """One bench run as a fresh process; never raises. Returns rc, seconds, ok (a JSON was written
    and parses) and a status line."""
    base = json_path[:-len(".json")]
    try:
        os.remove(json_path)  # a stale file must not pass for this run's result
    except FileNotFoundError:
        pass
    cmd = bench_command(python, root, bench, json_path)
    t0 = time.monotonic()
    rc, status = None, ""
    try:
        with open(base + ".log", "w") as out, open(base + ".err", "w") as err:
            # same session and process group as this script: whatever stops this script (the device's
            # command limit) stops the bench too, rather than leave it running beside later timings
            proc = subprocess.Popen(cmd, cwd=root, env=bench_env(root), stdout=out, stderr=err,
                                    stdin=subprocess.DEVNULL)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                status = f"killed after {timeout:.1f} s"
            except BaseException:  # Ctrl-C: no orphan bench
                proc.kill()
                raise
    except OSError as e:
        status = f"could not start: {e}"
    secs = time.monotonic() - t0
    ok = isinstance(load_json(json_path), dict)
    if not status:
        status = "ok" if ok and rc == 0 else (f"rc {rc}, JSON written (rows with errors)" if ok
                                              else f"rc {rc}, no JSON")
    return {"rc": rc, "seconds": round(secs, 1), "ok": ok, "status": status, "cmd": cmd,
            "stderr_tail": "" if ok and rc == 0 else _tail(base + ".err"),
            "row_errors": _bang_lines(base + ".log") if rc else []}


def _check_config(outdir: str, before: str, after: str) -> str | None:
    path = os.path.join(outdir, CONFIG_NAME)
    cfg = {"before": before, "after": after}
    old = load_json(path) if os.path.exists(path) else None
    if old is not None and (old.get("before"), old.get("after")) != (before, after):
        return (f"{outdir} holds an A/B of other trees ({old.get('before')} vs {old.get('after')}); "
                f"pick another --out")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return None


def _git_head(root: str):
    try:
        p = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return (p.stdout.strip() or None) if p.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _benches(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in BENCHES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--only takes a comma list of {','.join(BENCHES)}; got {text!r}")
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 build_tools/ab_compare.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="checkout root of the baseline")
    p.add_argument("--after", required=True, help="checkout root of the candidate")
    p.add_argument("--out", required=True, help="directory for the runs' JSON, logs and the summary")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--first-round", type=int, default=1, help="number of the first round (to add rounds)")
    p.add_argument("--only", type=_benches, default=BENCHES, metavar="LIST", help="prefill,batch,decode (default all)")
    p.add_argument("--python", default=sys.executable, help="interpreter of the bench runs")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="start no run that would end after S seconds from now; kill one that runs past it")
    p.add_argument("--run-timeout", type=float, default=300.0, metavar="S", help="kill one run after S seconds")
    p.add_argument("--tput-tol", type=float, default=TPUT_TOL)
    p.add_argument("--host-tol", type=float, default=HOST_TOL)
    p.add_argument("--merge-only", action="store_true", help="run nothing; merge what OUTDIR holds")
    p.add_argument("--dry-run", action="store_true", help="print the runs' commands and stop")
    args = p.parse_args(argv)
    t_start = time.monotonic()
    before, after, outdir = (os.path.abspath(x) for x in (args.before, args.after, args.out))
    roots = {"before": before, "after": after}
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    plan = schedule(args.rounds, args.only, args.first_round)
    if args.dry_run:
        for r, b, v in plan:
            print(f"r{r} {b} {v}: cd {roots[v]} && PYTHONPATH={roots[v]} PFA_CUBIN_DIR={roots[v]}/cubins "
                  + " ".join(bench_command(args.python, roots[v], b, os.path.join(outdir, result_name(v, b, r)))))
        return 0
    os.makedirs(outdir, exist_ok=True)
    if not args.merge_only:
        for v, root in roots.items():
            why = preflight(args.python, root)
            if why:
                print(f"preflight {v}: {why}", file=sys.stderr)
                return 2
        why = _check_config(outdir, before, after)
        if why:
            print(why, file=sys.stderr)
            return 2
        layout = {v: "pyflashattn.bench <sub>" if new_layout(r) else "old modules" for v, r in roots.items()}
        print(f"# A/B: before {before} ({layout['before']}), after {after} ({layout['after']}); "
              f"{len(plan)} runs, rounds {args.first_round}..{args.first_round + args.rounds - 1}, "
              f"benches {','.join(args.only)}", flush=True)
        longest = {}
        for i, (r, b, v) in enumerate(plan, 1):
            elapsed = time.monotonic() - t_start
            timeout = args.run_timeout
            if args.time_limit is not None:
                left = args.time_limit - elapsed
                if left < 1.2 * longest.get(b, 0.0) or left < 5:
                    print(f"# time limit: {left:.0f} s left, skipping the {len(plan) - i + 1} remaining runs "
                          f"(resume with --first-round {r} and --only)", flush=True)
                    break
                timeout = min(timeout, left)
            print(f"[{i}/{len(plan)}] round {r} {b:<7} {v:<6} ...", end=" ", flush=True)
            path = os.path.join(outdir, result_name(v, b, r))
            rec = run_one(args.python, roots[v], b, path, timeout)
            longest[b] = max(longest.get(b, 0.0), rec["seconds"])
            rec.update({"round": r, "bench": b, "version": v, "root": roots[v], "json": path,
                        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
            print(f"{rec['status']} in {rec['seconds']:.1f} s (total {time.monotonic() - t_start:.0f} s)", flush=True)
            for line in rec["row_errors"]:
                print(f"    {line}", flush=True)
            if rec["stderr_tail"]:
                print("    " + rec["stderr_tail"].replace("\n", "\n    "), flush=True)
            with open(os.path.join(outdir, RUNS_NAME), "a") as f:
                f.write(json.dumps(rec) + "\n")

    runs = []
    try:
        with open(os.path.join(outdir, RUNS_NAME)) as f:
            runs = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        pass
    # a run counts as failed while its result file is still unusable (a later rerun may have fixed it)
    latest = {}
    for rec in runs:
        latest[(rec["version"], rec["bench"], rec["round"])] = rec
    failed = [rec for rec in latest.values() if not rec.get("ok")]
    merged = merge_outdir(outdir, args.tput_tol, args.host_tol)
    text = render_report(merged, failed, args.tput_tol, args.host_tol, peers=False)
    print()
    print(text, end="")
    with open(os.path.join(outdir, "ab_table.md"), "w") as f:
        f.write(render_report(merged, failed, args.tput_tol, args.host_tol, peers=True))
    per_bench = {b: m["counts"] for b, m in merged.items()}
    summary = {"before": before, "after": after, "before_head": _git_head(before), "after_head": _git_head(after),
               "tput_tol": args.tput_tol, "host_tol": args.host_tol,
               "summary": summary_line(per_bench, len(failed), args.tput_tol, args.host_tol),
               "counts": per_bench, "benches": merged, "failed_runs": failed, "runs": runs}
    with open(os.path.join(outdir, "ab_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    flagged = any(c["slower"] or c["host_grew"] or c["missing"] for c in per_bench.values())
    return 1 if (flagged or failed or not merged) else 0


if __name__ == "__main__":
    sys.exit(main())
