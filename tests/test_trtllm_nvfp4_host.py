"""NVFP4 in the TRT-LLM context API without a GPU: the FP4 packing and 128x4 scale-swizzle helpers
(numpy), FP4Tensor's checks, the NVFP4 output's and the NVFP4 cache's argument validation before any
launch, and the params each call writes (o_format 3, the scale tensor, its start row, strides in
e2m1 elements; the cache's block scales). Numerics are tests/gpu/test_trtllm_nvfp4.py's job."""
from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest

from pyflashattn import FP4Tensor, fp4, prefill, utils
from pyflashattn._engine import operands, trtllm, trtllm_device
from pyflashattn._runtime import dtypes as _dtypes
from pyflashattn.testing import nvfp4
from pyflashattn.testing.fake_driver import BF16, E4M3, WS, T
from pyflashattn.testing.fake_tensors import FakeProducer

U8 = _dtypes.UINT8
context = prefill.trtllm_batch_context_with_kv_cache
HQ, HKV, D, PS, NPAGES = 8, 2, 128, 16, 6
QL, KL = (5, 0, 12), (19, 16, 0)
TQ = sum(QL)
TABLE = np.array([[4, 1, 5], [0, 5, 5], [5, 5, 5]], np.int32)
COLS = HQ * D // 16  # scale columns (a multiple of 4 already)


@pytest.fixture(autouse=True)
def fresh_engines(monkeypatch):
    monkeypatch.setattr(trtllm, "_ENGINES", OrderedDict())
    monkeypatch.setattr(trtllm_device, "_ENGINES", OrderedDict())


# ---- numpy helpers ---------------------------------------------------------------------------------
def test_scale_offset_by_hand():
    # row 33 = atom row 0, row group 1, row 1 in the group; column 5 = column atom 1, column 1
    assert fp4.scale_offset(33, 5, 8) == (0 * 2 + 1) * 512 + 1 * 16 + 1 * 4 + 1
    assert fp4.scale_offset(128, 0, 8) == 2 * 512  # the second row atom starts after C / 4 atoms
    assert fp4.scale_shape(200, 8 * 64) == (256, 32) and fp4.scale_shape(1, 64) == (128, 4)


@pytest.mark.parametrize("rows, cols", [(1, 4), (77, 8), (128, 12), (300, 32)])
def test_swizzle_round_trip(rows, cols):
    """swizzle_scales (fp4.scale_offset) and unswizzle_scales (atom reshape) read one layout; every
    byte of the swizzled tensor is some (row, column)'s."""
    rng = np.random.default_rng(rows * cols)
    lin = rng.integers(0, 256, size=(rows, cols), dtype=np.uint8)
    sw = nvfp4.swizzle_scales(lin)
    assert sw.shape == fp4.scale_shape(rows, cols * 16)
    back = nvfp4.unswizzle_scales(sw)
    np.testing.assert_array_equal(back[:rows], lin)
    R = sw.shape[0]
    r, c = np.meshgrid(np.arange(R), np.arange(cols), indexing="ij")
    assert np.unique(fp4.scale_offset(r, c, cols)).size == R * cols  # a permutation


def test_pack_low_nibble_first_and_dequantize_output():
    codes = np.array([[1, 15, 8, 7] * 4], np.uint8).reshape(1, 1, 16)  # .5, -6, -0, 6
    packed = nvfp4.pack_codes(codes)
    assert packed[0, 0, 0] == 0xF1 and packed[0, 0, 1] == 0x78
    sf = nvfp4.encode_e4m3(np.array([[2.0]]))  # one block, scale 2
    deq = nvfp4.dequantize_output(packed, nvfp4.swizzle_scales(sf), 0, 4.0)
    np.testing.assert_array_equal(deq[0, 0, :4], np.array([0.5, -6.0, -0.0, 6.0]) * 2 / 4)
    assert np.signbit(deq[0, 0, 2])


def test_output_error_bound_is_half_an_e2m1_step():
    g, sf = 2.0, 1.0  # one e2m1 unit = sf / g = 0.5
    scale = nvfp4.swizzle_scales(nvfp4.encode_e4m3(np.full((1, 1), sf)))
    ref = np.array([0.1, 1.1, 2.2, 2.9, 3.5, -4.0] + [0.0] * 10).reshape(1, 1, 16)  # y = .2, 2.2, 4.4, 5.8, 7, 8
    bound = nvfp4.output_error_bound(ref, scale, 0, g)
    # half steps .25 / .5 / 1, plus what saturation at 6 cuts off (7 -> 6, 8 -> 6), in units of .5
    np.testing.assert_allclose(bound[0, 0, :6], np.array([.25, .5, 1, 1, 1 + 1, 1 + 2]) * 0.5)


# ---- FP4Tensor -------------------------------------------------------------------------------------
def fp4_out(tokens=TQ, rows=128, start=0, cols=COLS, data_dtype=U8, scale_dtype=E4M3, shape=None, strides=None):
    data = T(shape or (tokens, HQ, D // 2), data_dtype, strides=strides, data=0xA00000)
    scale = T((rows, cols), scale_dtype, data=0xB00000)
    return FP4Tensor(data, scale, start)


def test_fp4tensor_checks_like_flashinfer():
    t = fp4_out(start=100, rows=256)
    assert (t.scale_start_index, t.dtype, t.original_shape) == (100, "nvfp4", None)
    assert utils.FP4Tensor is FP4Tensor
    with pytest.raises(ValueError, match="data must be a uint8"):
        fp4_out(data_dtype=BF16)
    with pytest.raises(ValueError, match="scale must be a float8_e4m3fn"):
        fp4_out(scale_dtype=BF16)
    with pytest.raises(ValueError, match="multiple of 128"):
        fp4_out(rows=100)
    with pytest.raises(ValueError, match="scale_start_index"):
        fp4_out(start=128)
    with pytest.raises(ValueError, match="exceeds"):
        fp4_out(start=120)
    with pytest.raises(ValueError, match="original_shape"):
        FP4Tensor(T((TQ, HQ, D // 2), U8), T((128, COLS), E4M3), 0, (TQ, HQ, D + 2))
    assert FP4Tensor(T((TQ, HQ, D // 2), U8), T((128, COLS), U8), 0, (TQ, HQ, D)).original_shape == (TQ, HQ, D)


# ---- the context API --------------------------------------------------------------------------------
class Reshapable(FakeProducer):
    def reshape(self, *shape):
        old, _, dtype, data, offset, device = self.args
        return Reshapable((int(np.prod(old)),), (1,), dtype, data, offset, device)


def call(fake, cache=None, **kw):
    cum = lambda x: fake.dev(np.concatenate([[0], np.cumsum(x)]).astype(np.int32), _dtypes.INT32)  # noqa: E731
    table = Reshapable(*fake.dev(TABLE, _dtypes.INT32, shape=TABLE.shape).args)
    args = dict(query=T((TQ, HQ, D)), kv_cache=T((NPAGES, 2, HKV, PS, D)) if cache is None else cache,
                workspace_buffer=WS(fake), block_tables=table, seq_lens=fake.dev(np.asarray(KL, np.int32),
                                                                                 _dtypes.INT32),
                max_q_len=12, max_kv_len=19, bmm1_scale=0.1, bmm2_scale=1.5, batch_size=3, cum_seq_lens_q=cum(QL),
                cum_seq_lens_kv=cum(KL))
    args.update(kw)
    return context(**args)


def structs(fake):
    """The params of the last attention launch and of the merges after it."""
    launches = fake.cu.launches
    i = max(j for j, x in enumerate(launches) if x[0].startswith("prefill"))
    return launches[i][0], launches[i][3], [x[3] for x in launches[i + 1:] if x[0].startswith("merge")]


def test_nvfp4_output_in_place_params(fake):
    out = fp4_out(rows=256, start=37)
    res = call(fake, out=out, out_dtype="nvfp4", o_sf_scale=300.0, o_sf_vec_size=16)
    assert isinstance(res, FP4Tensor) and res.data is out.data and res.scale is out.scale
    assert res.scale_start_index == 37 and res.original_shape == (TQ, HQ, D)
    name, p, merges = structs(fake)
    assert "paged" in name
    assert (p.o_format, p.o, p.o_sf, p.o_sf_row0) == (operands.OUT_NVFP4, 0xA00000, 0xB00000, 37)
    assert p.o_sf_scale == pytest.approx(300.0) and p.v_scale == pytest.approx(1.5)
    assert (p.o_stride_n, p.o_stride_h) == (HQ * D, D)  # e2m1 elements: twice the byte strides
    for m in merges:
        assert (m.o_format, m.o_sf, m.o_sf_row0, m.o_stride_n) == (3, 0xB00000, 37, HQ * D)
    # out_dtype may be left out when out is an FP4Tensor (FlashInfer's rule); lse comes back beside it
    lse = T((TQ, HQ), _dtypes.FLOAT32, data=0x900000)
    res, got = call(fake, out=fp4_out(), o_sf_scale=2.0, lse=lse, return_lse=True)
    assert isinstance(res, FP4Tensor) and got is lse and structs(fake)[1].o_sf_row0 == 0


def test_nvfp4_output_split_kv_merges_in_nvfp4(fake):
    """A long request splits over KV chunks (host metadata: the exact plan): the merge writes the
    NVFP4 rows (o_format 3, the scales from row 5)."""
    kl = 4000
    pages = -(-kl // PS)
    out = FP4Tensor(T((3, HQ, D // 2), U8, data=0xA00000), T((128, COLS), E4M3, data=0xB00000), 5)
    context(T((3, HQ, D)), T((pages, 2, HKV, PS, D)), WS(fake), np.arange(pages, dtype=np.int32)[None],
            np.array([kl], np.int32), 3, kl, 0.1, 1.0, 1, np.array([0, 3], np.int32), np.array([0, kl], np.int32),
            out=out, out_dtype="nvfp4", o_sf_scale=1.0)
    _, p, merges = structs(fake)
    assert p.o_format == 3 and merges and all((m.o_format, m.o_sf, m.o_sf_row0) == (3, 0xB00000, 5) for m in merges)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_nvfp4_output_from_an_fp8_query(fake, d):
    """FlashInfer's form: an e4m3 query over an e4m3 cache runs the paged fp8 row, which writes the
    NVFP4 output (o_format 3, as from a 16-bit query); split rows merge (bf16) into NVFP4 too."""
    out = FP4Tensor(T((TQ, HQ, d // 2), U8, data=0xA00000), T((128, HQ * d // 16), E4M3, data=0xB00000), 3)
    res = call(fake, query=T((TQ, HQ, d), E4M3), cache=T((NPAGES, 2, HKV, PS, d), E4M3), out=out,
               o_sf_scale=300.0)
    assert isinstance(res, FP4Tensor) and res.data is out.data
    name, p, _ = structs(fake)
    assert "dtype=e4m3" in name and "paged=True" in name and "nvfp4_out=True" in name
    assert (p.o_format, p.o, p.o_sf, p.o_sf_row0) == (operands.OUT_NVFP4, 0xA00000, 0xB00000, 3)
    assert p.o_sf_scale == pytest.approx(300.0) and (p.o_stride_n, p.o_stride_h) == (HQ * d, d)
    kl = 4000
    pages = -(-kl // PS)
    out = FP4Tensor(T((3, HQ, d // 2), U8, data=0xA00000), T((128, HQ * d // 16), E4M3, data=0xB00000), 5)
    context(T((3, HQ, d), E4M3), T((pages, 2, HKV, PS, d), E4M3), WS(fake), np.arange(pages, dtype=np.int32)[None],
            np.array([kl], np.int32), 3, kl, 0.1, 1.0, 1, np.array([0, 3], np.int32), np.array([0, kl], np.int32),
            out=out, out_dtype="nvfp4", o_sf_scale=1.0)
    name, p, merges = structs(fake)
    assert "dtype=e4m3" in name and p.o_format == 3 and merges
    assert all((m.o_format, m.o_sf, m.o_sf_row0) == (3, 0xB00000, 5) for m in merges)
    assert all(x[0].startswith("merge") and "dtype=bf16" in x[0] for x in fake.cu.launches[-len(merges):])


@pytest.mark.parametrize("kw, exc, pattern", [
    (dict(out_dtype="nvfp4", o_sf_scale=1.0, o_sf_vec_size=32), ValueError, "o_sf_vec_size"),
    (dict(out_dtype="nvfp4"), ValueError, "o_sf_scale"),
    (dict(out_dtype="nvfp4", o_sf_scale=-1.0), ValueError, "o_sf_scale"),
    (dict(out_dtype="nvfp4", o_sf_scale=1.0, out=T((TQ, HQ, D), BF16)), ValueError, "out"),
    (dict(out_dtype=BF16, o_sf_scale=1.0, out=fp4_out()), ValueError, "out_dtype"),
    (dict(out=T((TQ, HQ, D), BF16), o_sf_scale=1.0), ValueError, "o_sf_scale"),
    (dict(o_sf_scale=1.0, out=fp4_out(shape=(TQ, HQ, D))), ValueError, "out"),
    (dict(o_sf_scale=1.0, out=fp4_out(cols=COLS + 4)), ValueError, "out.scale"),
    # FlashInfer's FP4Tensor (or any object with its fields) is taken too, and checked here
    (dict(o_sf_scale=1.0, out=SimpleNamespace(data=T((TQ, HQ, D // 2), U8), scale=T((128, COLS), E4M3),
                                              scale_start_index=120)), ValueError, "scale_start_index"),
    (dict(o_sf_scale=1.0, out=SimpleNamespace(data=T((TQ, HQ, D // 2), U8), scale=T((128, COLS), E4M3),
                                              scale_start_index=-1)), ValueError, "scale_start_index"),
    (dict(o_sf_scale=1.0, out=SimpleNamespace(data=T((TQ, HQ, D // 2), U8), scale=T((128, COLS), E4M3,
                                                                                    strides=(1, 128)),
                                              scale_start_index=0)), ValueError, "contiguous"),
])
def test_nvfp4_output_refusals(fake, kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call(fake, **kw)
    assert not fake.attn_launches()


def test_fmha_v2_has_no_nvfp4_output(fake):
    with pytest.raises(NotImplementedError, match="nvfp4"):
        trtllm.out_dtype_arg("nvfp4", None, BF16)


def test_wrappers_do_not_take_nvfp4_as_o_data_type():
    """Only the context API plans the NVFP4 output (it points the scales): a string never does."""
    with pytest.raises(TypeError, match="o_data_type"):
        operands.output_dtype("nvfp4", BF16)
    assert operands.output_dtype(operands.NVFP4_OUTPUT, BF16) == (U8, operands.OUT_NVFP4)


# ---- NVFP4 cache ------------------------------------------------------------------------------------
def nvfp4_cache(layout="HND"):
    shape = (NPAGES, 2, HKV, PS, D // 2) if layout == "HND" else (NPAGES, 2, PS, HKV, D // 2)
    return T(shape, U8, data=0x200000)


def block_scales(layout="HND", strides=None, data=0x300000):
    shape = (NPAGES, 2, HKV, PS, D // 16) if layout == "HND" else (NPAGES, 2, PS, HKV, D // 16)
    return T(shape, E4M3, strides=strides, data=data)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("alias", [False, True])
def test_nvfp4_cache_runs_the_nvfp4_decode_tiles(fake, layout, alias):
    sf = block_scales(layout)
    kw = dict(kv_cache_sf=sf) if alias else dict(kv_block_scales=sf)
    call(fake, cache=nvfp4_cache(layout), kv_layout=layout, out=T((TQ, HQ, D), BF16), **kw)
    name, p, _ = structs(fake)
    assert "kv_dtype=nvfp4" in name and "decode=True" in name
    page = 2 * HKV * PS * D // 16
    assert (p.k_sf, p.v_sf, p.k_sf_stride_page) == (0x300000, 0x300000 + page // 2, page)
    # tensor scales read on the device by the decode tiles (no general kernel over an NVFP4 cache)
    s1 = fake.dev(np.array([0.1], np.float32), _dtypes.FLOAT32)
    call(fake, cache=nvfp4_cache(layout), kv_layout=layout, out=T((TQ, HQ, D), BF16), bmm1_scale=s1, **kw)
    assert structs(fake)[1].scale_dev == s1.args[3]


def test_nvfp4_cache_tuple_and_output(fake):
    k, v = T((NPAGES, HKV, PS, D // 2), U8, data=0x200000), T((NPAGES, HKV, PS, D // 2), U8, data=0x280000)
    ks, vs = T((NPAGES, HKV, PS, D // 16), E4M3, data=0x300000), T((NPAGES, HKV, PS, D // 16), E4M3, data=0x380000)
    res = call(fake, cache=(k, v), kv_block_scales=(ks, vs), out=fp4_out(), o_sf_scale=6.0)
    name, p, _ = structs(fake)
    assert isinstance(res, FP4Tensor) and "kv_dtype=nvfp4" in name
    assert (p.k_sf, p.v_sf, p.o_format, p.o_sf) == (0x300000, 0x380000, 3, 0xB00000)


@pytest.mark.parametrize("kw, exc, pattern", [
    (dict(cache=nvfp4_cache()), TypeError, "kv_block_scales"),
    (dict(kv_block_scales=block_scales()), TypeError, "kv_block_scales"),
    (dict(cache=nvfp4_cache(), kv_block_scales=block_scales(), kv_cache_sf=block_scales()), ValueError,
     "kv_cache_sf"),
    # the seed's rule: (page_size, head_dim // 16) contiguous in HND (here each row 16 bytes apart)
    (dict(cache=nvfp4_cache(), kv_block_scales=block_scales(strides=(2 * HKV * PS * 16, HKV * PS * 16, PS * 16,
                                                                    16, 1))), ValueError, "contiguous"),
    (dict(cache=nvfp4_cache(), kv_block_scales=T((NPAGES + 1, 2, HKV, PS, D // 16), E4M3)), ValueError,
     "kv_cache_sf must have shape"),
    (dict(cache=nvfp4_cache(), kv_block_scales=T((NPAGES, 2, HKV, PS, D // 16), U8)), TypeError, "float8_e4m3fn"),
    (dict(cache=T((NPAGES, 2, HKV, PS, D // 4), U8), kv_block_scales=block_scales()), ValueError, "head_dim"),
])
def test_nvfp4_cache_refusals(fake, kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call(fake, out=T((TQ, HQ, D), BF16), **kw)
    assert not fake.attn_launches()


# ---- the kernels' rounding (nvfp4_out.cuh), transliterated ----------------------------------------
def _e4m3_bits_like_the_kernel(x):
    """Nvfp4Out::e4m3_bits in numpy float32 / uint32 arithmetic."""
    x = np.asarray(x, np.float32)
    b = np.minimum(x, np.float32(448)).view(np.uint32)
    b = (b + np.uint32(0x7FFFF) + ((b >> 20) & 1)) & np.uint32(0xFFF00000)
    normal = (((b >> 23) - 120) << 3) | ((b >> 20) & 7)
    sub = np.rint(np.minimum(x, np.float32(1)) * np.float32(512)).astype(np.uint32)  # (used below 2^-6 only)
    return np.where(x >= np.float32(2.0**-6), normal, sub).astype(np.uint8)


def _e2m1_code_like_the_kernel(y):
    """Nvfp4Out::e2m1_code in numpy."""
    y = np.asarray(y, np.float32)
    a = np.abs(y)
    mag = ((a > .25).astype(int) + (a >= .75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5))
    return (mag | np.where(y < 0, 8, 0)).astype(np.uint8)


def test_kernel_rounding_is_round_to_nearest_even():
    """The kernels' e4m3 scale and e2m1 code rounding (their integer / threshold forms) equal
    round-to-nearest-even on the grids (testing.nvfp4's encoders), exact midpoints and saturation
    included: FlashInfer's reference quantiser and cvt.rn.satfinite.{e4m3x2, e2m1x2}."""
    grid = nvfp4.e4m3_values()[:0x7F]
    mids = (grid[1:] + grid[:-1]) / 2
    rng = np.random.default_rng(7)
    x = np.concatenate([grid, mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9), [448.5, 460, 500, 1e30],
                        rng.uniform(0, 460, 4000), 2.0 ** rng.uniform(-14, -5, 2000)]).astype(np.float32)
    np.testing.assert_array_equal(_e4m3_bits_like_the_kernel(x), nvfp4.encode_e4m3(x.astype(np.float64)))
    e2 = nvfp4.E2M1_VALUES
    mids = (e2[1:] + e2[:-1]) / 2
    y = np.concatenate([e2, mids, -mids, np.nextafter(mids, 0), np.nextafter(mids, 9), [6.5, 100, -7],
                        rng.uniform(-7, 7, 4000)]).astype(np.float32)
    want = nvfp4.encode_e2m1(y.astype(np.float64))
    want = np.where(y == 0, 0, want)  # +-0 itself: code 0 (the kernel signs only y < 0)
    np.testing.assert_array_equal(_e2m1_code_like_the_kernel(y), want)


# ---- routing: only kernels that write NVFP4 (the manifest's nvfp4_out) ------------------------------
def call_hd(fake, d, **kw):
    return call(fake, query=T((TQ, HQ, d)), cache=T((NPAGES, 2, HKV, PS, d)),
                out=FP4Tensor(T((TQ, HQ, d // 2), U8), T((128, HQ * d // 16), E4M3)), o_sf_scale=1.0, **kw)


def long_call(fake, **kw):
    """20 queries x GQA 4 = 80 packed rows over 20 keys: the 128-row lean kernel (no decode tile),
    into an FP4Tensor from scale row 9."""
    cum = lambda x: fake.dev(np.array([0, x], np.int32), _dtypes.INT32)  # noqa: E731
    table = Reshapable(*fake.dev(np.array([[0, 1]], np.int32), _dtypes.INT32, shape=(1, 2)).args)
    out = FP4Tensor(T((20, HQ, D // 2), U8, data=0xA00000), T((128, COLS), E4M3, data=0xB00000), 9)
    args = dict(bmm1_scale=0.1, skip_softmax_threshold_scale_factor=None)
    args.update(kw)
    return context(T((20, HQ, D)), T((NPAGES, 2, HKV, PS, D)), WS(fake), table,
                   fake.dev(np.array([20], np.int32), _dtypes.INT32), 20, 20, args["bmm1_scale"], 1.0, 1, cum(20),
                   cum(20), out=out, o_sf_scale=2.0,
                   skip_softmax_threshold_scale_factor=args["skip_softmax_threshold_scale_factor"])


def test_nvfp4_output_routes_to_kernels_that_write_it(fake):
    long_call(fake)
    name, p, _ = structs(fake)
    assert "general=False" in name and "decode=False" in name and "nvfp4_out=True" in name
    # tensor scales: the lean kernel does not read scale_dev, so the general one (with NVFP4) runs
    long_call(fake, bmm1_scale=fake.dev(np.array([0.1], np.float32), _dtypes.FLOAT32))
    name, p, _ = structs(fake)
    assert "general=True" in name and "nvfp4_out=True" in name and p.o_format == 3
    # skip-softmax: the lean plan's sibling (the general kernel of its tile) writes NVFP4 too, its
    # struct a copy of the plan's, scales included
    long_call(fake, skip_softmax_threshold_scale_factor=100.0)
    name, p, _ = structs(fake)
    assert "general=True" in name and "decode=False" in name
    assert (p.o_format, p.o_sf, p.o_sf_row0, p.skip_softmax_factor) == (3, 0xB00000, 9, 100.0)
    call_hd(fake, 256)  # a decode-sized hd256 call: lean kernels have it
    assert "nvfp4_out=True" in structs(fake)[0]


@pytest.mark.parametrize("kw, pattern", [
    (dict(bmm1_scale="tensor"), "out_dtype='nvfp4'"),
    (dict(skip_softmax_threshold_scale_factor=100.0), "skip_softmax_threshold_scale_factor"),
])
def test_nvfp4_output_refused_where_no_kernel_writes_it(fake, kw, pattern):
    """The hd256 general kernels lack it (their registers cannot spare it): tensor scales on the
    128-row hd256 kernel (which does not read them: the general one would), and skip-softmax on a
    lean hd256 plan (which runs on the general kernel), raise before launching."""
    if kw.get("bmm1_scale") == "tensor":
        kw = dict(bmm1_scale=fake.dev(np.array([0.1], np.float32), _dtypes.FLOAT32))
    cum = lambda x: np.array([0, x], np.int32)  # noqa: E731
    d = 256
    out = FP4Tensor(T((20, HQ, d // 2), U8), T((128, HQ * d // 16), E4M3))
    args = dict(bmm1_scale=0.1, skip_softmax_threshold_scale_factor=None)
    args.update(kw)
    n = len(fake.attn_launches())
    with pytest.raises(NotImplementedError, match=pattern):
        context(T((20, HQ, d)), T((NPAGES, 2, HKV, PS, d)), WS(fake), np.array([[0, 1]], np.int32),
                np.array([20], np.int32), 20, 20, args["bmm1_scale"], 1.0, 1, cum(20), cum(20), out=out,
                o_sf_scale=2.0, skip_softmax_threshold_scale_factor=args["skip_softmax_threshold_scale_factor"])
    assert len(fake.attn_launches()) == n
