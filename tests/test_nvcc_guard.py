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
