"""Packaging hook: copy the built cubins (cubins/) into the package as pyflashattn/_cubins.

Cubins are build output, not committed; `make` builds them, and `pip install .` / `make wheel`
then ship them inside the package so the runtime finds them next to its own code.
"""
import pathlib
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent


class BuildPyWithCubins(build_py):
    def run(self):
        super().run()
        src = ROOT / "cubins"
        if not (src / "manifest.json").exists():
            self.warn("cubins/manifest.json not found: run `make` first; the package will have no kernels")
            return
        dst = pathlib.Path(self.build_lib) / "pyflashattn" / "_cubins"
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.tmp"))


setup(cmdclass={"build_py": BuildPyWithCubins})
