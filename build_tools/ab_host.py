"""Host-time A/B of two pyflashattn checkouts, interleaved many times (GPU machine).

    python3 build_tools/ab_host.py --before DIR_A --after DIR_B --rounds 8 [--out FILE]

The host numbers of the quick benchmarks (single-prefill call overhead with and without out=,
plan() at batch 64 and 1024, run() on the torch fast path) swing by 10-40 % between runs on a
shared VM, so three rounds of the whole benchmark (build_tools/ab_compare.py) cannot resolve a
5 % change. This script runs only those host measurements, in short fresh processes that
alternate between the two trees (the order flips every round), and reports the best (minimum)
of each number per tree: the benchmarks' own functions measure, so the numbers mean the same.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

METRICS = (("single", "pfa_us"), ("single", "pfa_out_us"), ("plan64", "ragged_us"), ("plan64", "paged_us"),
           ("plan1024", "ragged_us"), ("plan1024", "paged_us"), ("run", "ragged_us"), ("run", "paged_us"))
HOST_TOL = 0.05


def _worker(plan_reps: int, calls: int) -> None:
    """In a tree's own process: its benchmarks' host measurements, as one JSON line."""
    import importlib

    try:
        bb, bp = importlib.import_module("pyflashattn.bench.batch"), importlib.import_module("pyflashattn.bench.prefill")
    except ImportError:  # a tree from before the bench subpackage
        bb, bp = importlib.import_module("pyflashattn.bench_batch"), importlib.import_module("pyflashattn.bench")
    ctx = bb._Ctx()
    res = {"plan64": bb._host_plan_us(ctx, 64, plan_reps), "plan1024": bb._host_plan_us(ctx, 1024, plan_reps),
           "run": bb._host_run_us(ctx, calls)}
    pctx = bp._Ctx()
    res["single"] = bp._host_overhead(pctx, pctx.torch.bfloat16, calls)
    print("AB_HOST " + json.dumps(res))


def _run(root: pathlib.Path, plan_reps: int, calls: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root), PFA_CUBIN_DIR=str(root / "cubins"), PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", "--plan-reps",
                        str(plan_reps), "--calls", str(calls)], cwd=root, env=env, capture_output=True, text=True,
                       timeout=300)
    for line in p.stdout.splitlines():
        if line.startswith("AB_HOST "):
            return json.loads(line[8:])
    raise RuntimeError(f"{root}: no result (rc {p.returncode}): {p.stderr[-2000:]}")


def best(results: list) -> dict:
    """The minimum of each metric over rounds (None where no round has it)."""
    out = {}
    for group, key in METRICS:
        vals = [r[group][key] for r in results if r.get(group, {}).get(key) is not None]
        out[f"{group}.{key}"] = min(vals) if vals else None
    return out


def table(before: dict, after: dict, rounds: int) -> str:
    lines = [f"host times, best of {rounds} interleaved rounds (us; lower is better)", "",
             "| metric | before | after | after/before | flag |", "|---|---:|---:|---:|---|"]
    for name in before:
        b, a = before[name], after[name]
        ratio = a / b if a is not None and b else None
        flag = "**HOST+**" if ratio is not None and ratio > 1 + HOST_TOL else ""
        lines.append(f"| {name} | {b if b is None else round(b, 2)} | {a if a is None else round(a, 2)} | "
                     f"{'' if ratio is None else f'{ratio:.3f}'} | {flag} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before")
    ap.add_argument("--after")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--plan-reps", type=int, default=30)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--time-limit", type=float, default=540.0, help="start no round after this many seconds")
    ap.add_argument("--out", help="write the rounds and the table as JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.plan_reps, args.calls)
        return 0
    roots = {"before": pathlib.Path(args.before).resolve(), "after": pathlib.Path(args.after).resolve()}
    runs = {"before": [], "after": []}
    t0 = time.monotonic()
    for r in range(args.rounds):
        for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
            if time.monotonic() - t0 > args.time_limit:
                break
            t = time.monotonic()
            runs[name].append(_run(roots[name], args.plan_reps, args.calls))
            print(f"round {r + 1} {name}: {time.monotonic() - t:.1f} s", flush=True)
    b, a = best(runs["before"]), best(runs["after"])
    text = table(b, a, min(len(runs["before"]), len(runs["after"])))
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"runs": runs, "before": b, "after": a, "table": text}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
