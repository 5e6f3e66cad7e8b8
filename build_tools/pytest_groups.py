#!/usr/bin/env python3
"""Run a pytest suite as N concurrent pytest processes, each over a group of whole test files.

`make gpu-check` uses it so that the whole suite (GPU files and CPU files, ~3700 tests) fits one
command of a few minutes on a 16-core GPU machine: a single pytest process there is bound by its
one Python thread (the float64 references and the launches' host work), not by the GPU, which
five processes share without contention worth measuring.

Files are grouped by their collected test counts (a GPU test weighs GPU_WEIGHT CPU tests),
heaviest first into the lightest group (longest-processing-time first). Each group writes its own
log (`<log-dir>/tests_g<i>.log`); the summary line of every group and the total are printed at the
end, and the exit status is the first non-zero status of any group (0 when all passed).
"""
import argparse
import collections
import os
import pathlib
import re
import subprocess
import sys
import time

GPU_WEIGHT = 4  # a GPU test's rough cost in CPU tests (its float64 reference, its launches)


def collect(python: str, paths: list, env: dict) -> collections.Counter:
    """Test items per file, from pytest's own collection. A file that fails to collect (an import
    error) lists no items, so it would fall out of every group and the run would pass without it:
    any collection error ends the run here, with pytest's report and its status."""
    out = subprocess.run([python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths],
                         capture_output=True, text=True, env=env)
    if out.returncode not in (0, 5):  # 5: nothing collected (reported below)
        sys.stderr.write(out.stdout[-8000:] + out.stderr[-4000:])
        raise SystemExit(f"pytest_groups: collection failed under {' '.join(paths)} (status {out.returncode})")
    counts = collections.Counter()
    for line in out.stdout.splitlines():
        if "::" in line:
            counts[line.split("::", 1)[0]] += 1
    if not counts:
        sys.stderr.write(out.stdout[-4000:] + out.stderr[-4000:])
        raise SystemExit(f"pytest_groups: nothing collected under {' '.join(paths)} (status {out.returncode})")
    return counts


def group_files(counts: collections.Counter, jobs: int) -> list:
    """Whole files into `jobs` groups of about equal weight (LPT)."""
    weight = {f: n * (GPU_WEIGHT if "/gpu/" in f else 1) for f, n in counts.items()}
    groups = [[0, []] for _ in range(max(1, min(jobs, len(weight))))]
    for f in sorted(weight, key=lambda f: (-weight[f], f)):
        g = min(groups, key=lambda g: g[0])
        g[0] += weight[f]
        g[1].append(f)
    return [sorted(files) for _, files in groups]


# pytest's closing line: "= 3 passed, 1 skipped in 2.0s =", or without the rule under -q (which
# lines a process writes to stderr at exit, JAX's say, may follow).
SUMMARY = re.compile(r"^=*\s*(\S.*\b(?:passed|failed|errors?|skipped|deselected|xfailed|xpassed|no tests ran)\b"
                     r".* in [0-9.]+s(?: \([0-9:]+\))?)\s*=*$")


def summary_line(log: pathlib.Path) -> str:
    lines = log.read_text(errors="replace").splitlines()
    for line in reversed(lines):
        m = SUMMARY.match(line.strip())
        if m:
            return m.group(1)
    return lines[-1] if lines else "(empty log)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", default=["tests"])
    ap.add_argument("--jobs", type=int, default=5)
    ap.add_argument("--log-dir", default="bench_out")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--threads", type=int, default=0,
                    help="OMP_NUM_THREADS of each process (default: the cores / jobs, at least 1)")
    args = ap.parse_args(argv)
    log_dir = pathlib.Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", str(args.threads or max(1, (os.cpu_count() or 1) // max(1, args.jobs))))
    groups = group_files(collect(args.python, args.paths, env), args.jobs)
    t0 = time.monotonic()
    procs = []
    for i, files in enumerate(groups):
        log = log_dir / f"tests_g{i}.log"
        print(f"group {i}: {len(files)} files -> {log}", flush=True)
        with open(log, "w") as fh:
            procs.append((log, subprocess.Popen([args.python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                                                 *files], stdout=fh, stderr=subprocess.STDOUT, env=env)))
    status = 0
    for i, (log, proc) in enumerate(procs):
        rc = proc.wait()
        status = status or rc
        print(f"group {i} (status {rc}): {summary_line(log)}", flush=True)
    totals = collections.Counter()
    for log, _ in procs:
        for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)", summary_line(log)):
            totals[word.rstrip("s") if word.startswith("error") else word] += int(n)
    print(f"total: {', '.join(f'{n} {w}' for w, n in sorted(totals.items()))} in {time.monotonic() - t0:.0f} s "
          f"({len(groups)} groups); status {status}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
