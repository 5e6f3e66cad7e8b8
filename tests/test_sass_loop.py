"""build_tools/sass_loop.py on synthetic nvdisasm text: the hot loop is the smallest loop holding the
wgmma count, predicates are dropped from opcodes, and the in-order share sees a moved schedule."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "build_tools"))
import sass_loop  # noqa: E402


def _sass(body_ops, outer_extra=("IADD3",)):
    """An outer loop around an inner one; the inner holds body_ops and two wgmmas."""
    lines, addr = [], 0

    def ins(text):
        nonlocal addr
        lines.append(f"        /*{addr:04x}*/                   {text} ;")
        addr += 16

    lines.append(".L_x_1:")
    for op in outer_extra:
        ins(f"{op} R0, R0, 0x1, RZ")
    lines.append(".L_x_2:")
    ins("QGMMA.64x128x32.F32.E4M3.E4M3 R24, R164, gdesc[UR8], RZ, !UPT")
    for op in body_ops:
        ins(f"@!P0 {op} R1, R2, R3")
    ins("QGMMA.64x128x32.F32.E4M3.E4M3 R88, R168, gdesc[UR8], R88, gsb0")
    ins("@!P1 BRA `(.L_x_2)")
    ins("UIADD3 UR4, UR4, 0x1, URZ")
    ins("QGMMA.64x128x32.F32.E4M3.E4M3 R24, R164, gdesc[UR8], RZ, !UPT")
    ins("@P2 BRA `(.L_x_1)")
    return "\n".join(lines)


def test_hot_loop_is_the_smallest_with_the_wgmma_count():
    ops = sass_loop.hot_loop(_sass(["FMUL", "MUFU.EX2", "F2FP.BF16.F32.PACK_AB"]), gmma=2)
    assert ops == ["QGMMA.64x128x32.F32.E4M3.E4M3", "FMUL", "MUFU.EX2", "F2FP.BF16.F32.PACK_AB",
                   "QGMMA.64x128x32.F32.E4M3.E4M3", "BRA"]
    outer = sass_loop.hot_loop(_sass(["FMUL"]), gmma=3)  # the outer loop: the inner one and a third wgmma
    assert outer[0] == "IADD3" and outer[-1] == "BRA" and sum("GMMA" in o for o in outer) == 3


def test_compare_sees_a_moved_schedule():
    same = sass_loop.hot_loop(_sass(["FMUL", "MUFU.EX2", "FFMA", "F2FP.BF16.F32.PACK_AB"]), gmma=2)
    moved = sass_loop.hot_loop(_sass(["F2FP.BF16.F32.PACK_AB", "FMUL", "FFMA", "MUFU.EX2"]), gmma=2)
    assert sass_loop.compare(same, same)["in_order"] == 1.0
    r = sass_loop.compare(same, moved)
    assert r["in_order"] < 1.0 and r["before"] == r["after"]
    assert r["before_marks"]["MUFU.EX2"] == [2] and r["after_marks"]["MUFU.EX2"] == [4]
