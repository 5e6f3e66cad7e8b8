"""The generated C header and its ctypes mirror agree on every size and offset.

The header is compiled by the host C++ compiler into a tiny program that prints
sizeof/offsetof for each field; the numbers must equal what ctypes computes.
"""
import ctypes
import pathlib
import shutil
import subprocess
import sys

import pytest

from pyflashattn._runtime import params_gen as _params_gen

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "build_tools"))
import params_schema  # noqa: E402


def test_generated_files_are_fresh():
    r = subprocess.run([sys.executable, str(ROOT / "build_tools/gen_params.py"), "--check"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("family", sorted(params_schema.FAMILIES))
def test_ctypes_matches_schema(family):
    struct_name, _, fields = params_schema.FAMILIES[family]
    cls = _params_gen.FAMILIES[family]
    assert cls.__name__ == struct_name
    assert [f[0] for f in cls._fields_ if not f[0].startswith("_pad")] == [f[0] for f in fields]
    for name, ty, _ in fields:
        assert ctypes.sizeof(dict(cls._fields_)[name]) == params_schema.SIZES[ty], name
        assert getattr(cls, name).offset == cls.OFFSETS[name], name
    assert ctypes.sizeof(cls) == cls.SIZE


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler")
def test_c_header_matches_ctypes(tmp_path):
    lines = ['#include <cstdio>', '#include "pfa/attention/params.h"', "int main() {"]
    for struct_name, _, fields in params_schema.FAMILIES.values():
        lines.append(f'  printf("{struct_name} sizeof %zu\\n", sizeof(pfa::{struct_name}));')
        for name, _, _ in fields:
            lines.append(f'  printf("{struct_name} {name} %zu\\n", offsetof(pfa::{struct_name}, {name}));')
    lines += ["  return 0;", "}"]
    src = tmp_path / "layout.cpp"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run(["g++", "-std=c++17", f"-I{ROOT / 'kernel_src/include'}", str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split("\n")
    seen = 0
    for line in filter(None, out):
        struct_name, field, value = line.split()
        cls = getattr(_params_gen, struct_name)
        want = ctypes.sizeof(cls) if field == "sizeof" else getattr(cls, field).offset
        assert int(value) == want, f"{struct_name}.{field}: C says {value}, ctypes says {want}"
        seen += 1
    assert seen == sum(len(f) + 1 for _, _, f in params_schema.FAMILIES.values())
