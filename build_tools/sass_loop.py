"""Compare the hot tile loop of two builds of one kernel, offline (no GPU): a consumer-side change
moved ptxas's schedule of the unchanged sm90 step loop again and again (NOTES.md, session 42), and a
moved schedule cost up to 2.5% a tile. Read the loop before spending device time on the change.

    python3 build_tools/sass_loop.py BEFORE.cubin AFTER.cubin [--kernel NAME] [--gmma 8]

The hot loop is the smallest loop (a backward branch and its target) holding `--gmma` wgmma
instructions (8: the overlapped consumers' S and P V of a turn). Printed: each loop's length,
uniform-datapath and spill instructions, the share of the before loop's opcodes that the after loop
keeps in the same order (1.000: the same schedule), and where the exponentials, packs, wgmmas and
barriers sit. nvdisasm comes from $NVDISASM, PATH, or the nvidia-cuda-nvdisasm wheel
(pip download nvidia-cuda-nvdisasm; its nvidia/cu13/bin/nvdisasm)."""
from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys

_ADDR = re.compile(r"/\*[0-9a-f]+\*/")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA\s+`\((\.L_x_\d+)\)")
_PRED = re.compile(r"^@!?U?P[T0-9]\s+")
MARKS = ("MUFU.EX2", "F2FP", "GMMA", "BAR.SYNC", "BAR.ARV", "WARPGROUP.DEPBAR")


def opcode(line: str) -> str:
    """The opcode of one nvdisasm instruction line (predicate dropped), '' for other lines."""
    if not _ADDR.search(line):
        return ""
    text = _PRED.sub("", re.sub(r".*\*/\s*", "", line, count=1).strip())
    return text.split()[0] if text else ""


def hot_loop(sass: str, gmma: int = 8, kernel: str | None = None) -> list[str]:
    """The opcodes of the smallest loop holding `gmma` wgmma instructions (in `kernel`'s section
    where given), in program order."""
    lines = sass.split("\n")
    if kernel:
        start = next((i for i, line in enumerate(lines) if kernel in line and "Function" in line), None)
        if start is None:
            raise SystemExit(f"no function {kernel} in the disassembly")
        end = next((i for i in range(start + 1, len(lines)) if "Function" in lines[i]), len(lines))
        lines = lines[start:end]
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    best = None
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if not m or labels.get(m.group(1), i) >= i:
            continue
        ops = [o for o in (opcode(x) for x in lines[labels[m.group(1)]:i + 1]) if o]
        if sum("GMMA" in o for o in ops) == gmma and (best is None or len(ops) < len(best)):
            best = ops
    if best is None:
        raise SystemExit(f"no loop with {gmma} wgmma instructions")
    return best


def compare(before: list[str], after: list[str]) -> dict:
    sm = difflib.SequenceMatcher(None, before, after, autojunk=False)
    kept = sum(i2 - i1 for tag, i1, i2, _, _ in sm.get_opcodes() if tag == "equal")
    out = {"before": len(before), "after": len(after), "in_order": kept / max(1, len(before))}
    for name, ops in (("before", before), ("after", after)):
        out[f"{name}_uniform"] = sum(o.startswith("U") for o in ops)
        out[f"{name}_spills"] = sum(o.startswith(("STL", "LDL")) for o in ops)
        out[f"{name}_marks"] = {m: [i for i, o in enumerate(ops) if o.startswith(m) or m in o] for m in MARKS}
    return out


def nvdisasm() -> str:
    found = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia  # the nvidia-cuda-nvdisasm wheel's namespace package
        for root in nvidia.__path__:
            for sub in ("cu13/bin/nvdisasm", "cuda_nvdisasm/bin/nvdisasm"):
                if os.path.exists(os.path.join(root, sub)):
                    return os.path.join(root, sub)
    except ImportError:
        pass
    raise SystemExit("no nvdisasm: set NVDISASM, or pip install nvidia-cuda-nvdisasm")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--kernel", help="the function to read (default: the cubin's only kernel)")
    ap.add_argument("--gmma", type=int, default=8, help="wgmma instructions in the hot loop (default 8)")
    a = ap.parse_args(argv)
    tool = nvdisasm()
    loops = [hot_loop(subprocess.run([tool, "-c", c], check=True, capture_output=True, text=True).stdout,
                      a.gmma, a.kernel) for c in (a.before, a.after)]
    r = compare(*loops)
    print(f"hot loop: {r['before']} -> {r['after']} instructions; uniform {r['before_uniform']} -> "
          f"{r['after_uniform']}; spills {r['before_spills']} -> {r['after_spills']}; "
          f"in order {r['in_order']:.3f} (1.000: the same schedule)")
    for m in MARKS:
        b, f = r["before_marks"][m], r["after_marks"][m]
        span = lambda x: f"{len(x):3d} at {x[0]}..{x[-1]}" if x else "  0"  # noqa: E731
        print(f"  {m:18s} {span(b):18s} -> {span(f)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
