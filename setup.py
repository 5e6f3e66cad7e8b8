"""Packaging hook: build the cubins with make and ship them inside the package as pyflashattn/_cubins.

Cubins are build output, not committed. `pip install .`, `pip wheel .` and `make wheel` run
`make manifest` in the source tree (archs: $PFA_ARCHS, else the Makefile's default; $PFA_TUNE=1
adds the tuning alternatives; nvcc: $NVCC, else PATH, else the pinned toolchain make fetches into
.toolchain/), then copy exactly the cubins cubins/manifest.json lists, plus the manifest. If the
kernels cannot be built the build fails: a package without kernels is never made. An editable
install (`pip install -e .`) builds nothing: the runtime then finds the source tree's cubins/.
setuptools' build/ folder goes to a temporary directory, not into the source tree.
"""
import atexit
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent
BUILD_BASE = tempfile.mkdtemp(prefix="pyflashattn-build-")
atexit.register(shutil.rmtree, BUILD_BASE, ignore_errors=True)


def fail(msg):
    raise SystemExit(f"\npyflashattn: {msg}\n")


def build_cubins():
    """`make manifest` in the source tree; returns the cubins/ folder."""
    if shutil.which("make") is None:
        fail("building the kernels needs GNU make (and nvcc, or network to fetch the pinned CUDA toolchain)")
    cmd = ["make", "-C", str(ROOT), "manifest", f"PYTHON={sys.executable}"]
    if os.environ.get("PFA_ARCHS", "").strip():
        cmd.append(f"ARCHS={os.environ['PFA_ARCHS'].strip()}")
    if os.environ.get("PFA_TUNE", "").strip():
        cmd.append(f"TUNE={os.environ['PFA_TUNE'].strip()}")
    # A fresh top-level make (its own -j from the core count): not a sub-make of whoever ran pip,
    # whose job-server pipes do not reach us; and none of pip's build-env python overlay.
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "PYTHONPATH", "PYTHONNOUSERSITE")}
    print("pyflashattn: building the kernels: " + " ".join(cmd), flush=True)
    rc = subprocess.call(cmd, env=env)
    if rc != 0:
        fail(f"building the kernels failed (`{' '.join(cmd)}` exited {rc}; see its output above). "
             "It needs nvcc (on PATH or $NVCC) or network access to fetch the pinned CUDA 13.0 "
             "toolchain into .toolchain/; PFA_ARCHS picks the archs (default: sm_80 sm_89 sm_90a).")
    return ROOT / "cubins"


class BuildPyWithCubins(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # the runtime finds the source tree's cubins/
        src = build_cubins()
        try:
            manifest = json.loads((src / "manifest.json").read_text())
            files = [k["file"] for k in manifest["kernels"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            fail(f"cubins/manifest.json unreadable after make ({e})")
        if not files:
            fail("cubins/manifest.json lists no kernels: refusing to make a package without kernels")
        missing = [f for f in files if not (src / f).is_file()]
        if missing:
            fail(f"cubins/manifest.json lists cubins that are missing: {', '.join(missing[:5])}")
        # Exactly what the manifest lists: stale cubins of variants no longer built do not ship.
        dst = pathlib.Path(self.build_lib) / "pyflashattn" / "_cubins"
        shutil.rmtree(dst, ignore_errors=True)
        for f in files:
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / f, dst / f)
        shutil.copy2(src / "manifest.json", dst / "manifest.json")
        print(f"pyflashattn: packaged {len(files)} cubins for {' '.join(manifest.get('archs', []))}", flush=True)


setup(cmdclass={"build_py": BuildPyWithCubins},
      options={"build": {"build_base": BUILD_BASE}})
