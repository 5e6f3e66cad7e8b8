"""The committed wgmma wrappers are exactly build_tools/gen_wgmma.py's output."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "build_tools"))
import gen_wgmma  # noqa: E402


def test_wgmma_header_is_generated():
    assert gen_wgmma.HEADER.read_text() == gen_wgmma.render(), "run python build_tools/gen_wgmma.py"


def test_every_tile_width_the_sm90_rows_use_has_a_wrapper():
    import variants
    widths = set()
    for v in variants.variants(tune=True):
        if isinstance(v, variants.HopperPrefillVariant):
            widths |= {v.block_n, v.head_dim}
    assert widths <= set(gen_wgmma.NS)


def test_every_fp8_tile_width_has_an_e4m3_wrapper():
    import variants
    widths = set()
    for v in variants.variants(tune=True):
        if isinstance(v, variants.HopperFp8PrefillVariant):
            widths |= {v.block_n, v.head_dim}
    assert widths and widths <= set(gen_wgmma.FP8_NS)
