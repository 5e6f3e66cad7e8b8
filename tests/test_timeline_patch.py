"""build_tools/timeline_patch.py on the CPU: every anchor it edits (the 16-bit and the fp8 sm_90a
consumers, the TMA producer, the CTA walk) is still in this tree's kernel headers. The patch asserts
each anchor itself; without this test a kernel change that moved one left the tool broken until the
next GPU session tried it (session 41 found two stale anchors)."""
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_timeline_patch_applies_to_this_tree(tmp_path):
    shutil.copytree(ROOT / "kernel_src" / "include", tmp_path / "kernel_src" / "include")
    r = subprocess.run([sys.executable, str(ROOT / "build_tools" / "timeline_patch.py"), str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    attention = tmp_path / "kernel_src" / "include" / "pfa" / "attention"
    patched = {p.name: p.read_text() for p in (attention / "sm90").glob("*.cuh")}
    patched["prefill_sm90.cuh"] = (attention / "prefill_sm90.cuh").read_text()
    patched["prefill_sm90_fp8.cuh"] = (attention / "prefill_sm90_fp8.cuh").read_text()
    # the CTA's end stamp in both persistent consumer walks (plain and decode-ahead)
    assert patched["cta.cuh"].count("::pfa_tl_cta[blockIdx.x * 4 + 3] = clock64()") == 2
    # stamps in both consumers' block code and the fp8 overlapped loop, both TMA producers' Q events
    for name, events in {"prefill_sm90.cuh": ("wg * 16 + 0", "wg * 16 + 6"),
                         "prefill_sm90_fp8.cuh": ("wg * 16 + 0", "wg * 16 + 5", "wg * 16 + 6", "wg * 16 + 15"),
                         "fp8_consumer.cuh": ("wg * 16 + 1", "wg * 16 + 2", "wg * 16 + 3", "wg * 16 + 4"),
                         "consumer.cuh": ("wg * 16 + 1", "wg * 16 + 4", "PFA_TLW(1"),
                         "producer_tma.cuh": ("PFA_TL(walk.q_round, 34)", "PFA_TL(walk.q_round, 36)"),
                         "fp8_producer.cuh": ("PFA_TL(walk.q_round, 34)", "PFA_TL(walk.q_round, 36)",
                                              "PFA_TL(walk.q_round, 37)")}.items():
        for e in events:
            assert e in patched[name], (name, e)
