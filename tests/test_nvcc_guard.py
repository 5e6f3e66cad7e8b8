"""build_tools/nvcc_guard.sh refuses a cubin whose wgmma ptxas serialised (any of the
"wgmma.mma_async instructions are serialized" notes, not only C7520), except a skip-softmax twin's."""
from __future__ import annotations

import pathlib
import subprocess

GUARD = pathlib.Path(__file__).resolve().parent.parent / "build_tools" / "nvcc_guard.sh"


def _guarded(tmp_path, name: str, note: str):
    """Run the guard over a fake compiler that writes `name` and prints `note` on stderr."""
    out = tmp_path / name
    fake = f"touch '{out}'; printf '%s\\n' \"$0\" >&2"
    r = subprocess.run(["sh", str(GUARD), "sh", "-c", fake, note, "-o", str(out)], capture_output=True, text=True)
    return r.returncode, out.exists(), r.stderr


def test_every_serialisation_note_fails_the_cubin(tmp_path):
    for code in ("C7515", "C7512", "C7520"):
        note = f"ptxas info    : ({code}) Potential Performance Loss: wgmma.mma_async instructions are serialized due to x"
        rc, exists, err = _guarded(tmp_path, f"k_{code}.cubin", note)
        assert rc == 1 and not exists and "nvcc_guard" in err, code


def test_skip_twins_and_clean_builds_pass(tmp_path):
    note = "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due to y"
    assert _guarded(tmp_path, "k_skip.cubin", note)[:2] == (0, True)
    assert _guarded(tmp_path, "k.cubin", "ptxas info    : (C7519) warpgroup.arrive is injected")[:2] == (0, True)


BAD_COPY = "        /*20810*/    LDGSTS.E.BYPASS.128 [R0+UR0+0x8c00], desc[UR1][R2.64] ;"
GOOD_COPIES = ("        /*1ff70*/    LDGSTS.E.BYPASS.128 [R13+0x8000], desc[UR46][R4.64], !P5 ;\n"
               "        /*1e270*/    LDGSTS.E.BYPASS.128 [R30+UR0], desc[UR1][R4.64], !P2 ;")


def _check(tmp_path, cubins: dict, with_objdump: bool = True, nvdisasm: bool = False):
    """--check over cubins whose (fake) cuobjdump -sass, or (nvdisasm) nvdisasm -c, prints the given SASS."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "nvcc").write_text("#!/bin/sh\n")
    (bindir / "nvcc").chmod(0o755)
    if with_objdump:
        (bindir / "cuobjdump").write_text('#!/bin/sh\n[ "$1" = -sass ] && cat "$2.sass"\n')
        (bindir / "cuobjdump").chmod(0o755)
    if nvdisasm:
        (bindir / "nvdisasm").write_text('#!/bin/sh\n[ "$1" = -c ] && cat "$2.sass"\n')
        (bindir / "nvdisasm").chmod(0o755)
    paths = []
    for name, sass in cubins.items():
        p = tmp_path / name
        p.write_bytes(b"")
        (tmp_path / (name + ".sass")).write_text(sass + "\n")
        paths.append(str(p))
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "NVCC": str(bindir / "nvcc")}
    return subprocess.run(["sh", str(GUARD), "--check", *paths], capture_output=True, text=True, env=env)


def test_check_flags_the_odd_descriptor_copy_with_an_immediate(tmp_path):
    r = _check(tmp_path, {"a.cubin": GOOD_COPIES, "b.cubin": BAD_COPY})
    assert r.returncode == 1 and "b.cubin" in r.stderr and "a.cubin" not in r.stderr


def test_check_passes_the_shapes_that_run(tmp_path):
    r = _check(tmp_path, {"a.cubin": GOOD_COPIES})
    assert r.returncode == 0 and "1 cubins" in r.stdout


def test_check_says_when_it_cannot_run(tmp_path):
    r = _check(tmp_path, {"b.cubin": BAD_COPY}, with_objdump=False)
    assert r.returncode == 0 and "did not run" in r.stderr


def test_check_falls_back_on_nvdisasm(tmp_path):
    """Without cuobjdump (the pip toolchain) nvdisasm -c, if there, runs the same check."""
    r = _check(tmp_path, {"a.cubin": GOOD_COPIES, "b.cubin": BAD_COPY}, with_objdump=False, nvdisasm=True)
    assert r.returncode == 1 and "b.cubin" in r.stderr and "a.cubin" not in r.stderr
