"""NVFP4 KV cache on the CPU: the numpy reference encoding (pyflashattn.testing.nvfp4), the
device's e2m1 decode emulated bit for bit from its constants (dtypes.cuh widen_fp4x8), and on the
simulated driver the decode wrapper / prefill paged wrapper / XQA with kv_cache_sf: kv_cache_sf
validation (errors name it, nothing launches), the kernels routed to (the NVFP4 paged decode
tiles, several row tiles for long requests, split-KV with its merge) and the params they launch
with (codes and scale addresses, strides in bytes). Numerics are the GPU tests' job
(tests/gpu/test_decode_nvfp4.py)."""
from __future__ import annotations

import pathlib
import re
from collections import OrderedDict

import numpy as np
import pytest

from pyflashattn import decode
from pyflashattn._engine import routing, xqa
from pyflashattn._runtime import dtypes as _dtypes
from pyflashattn.testing import nvfp4
from pyflashattn.testing.fake_driver import (
    BF16, D, E4M3, F16, HKV, HQ, I32, KV_INDICES, KV_INDPTR, LAST, NPAGES, PS, QO, T, U8, WS, i32, last_attn, paged,
    plan_paged, ragged, plan_ragged)
from pyflashattn.testing.fake_tensors import FakeProducer

ROOT = pathlib.Path(__file__).resolve().parent.parent
CPU = (1, 0)  # DLPack kDLCPU
B = 3  # KV_INDPTR / KV_INDICES / LAST: kv lens 19, 16, 0 over pages [4, 1], [0], [] (page_size 16)
E2M1X2 = _dtypes.FLOAT4_E2M1_X2


@pytest.fixture(autouse=True)
def fresh_xqa(monkeypatch):
    monkeypatch.setattr(xqa, "_ENGINES", OrderedDict())
    monkeypatch.setattr(xqa, "_FAST", {})
    monkeypatch.delenv("PYFLASHATTN_CHECK_METADATA", raising=False)


# ---------------------------------------------------------------------------------------------
# the reference encoding
# ---------------------------------------------------------------------------------------------
def test_code_table_sign_and_nibble_order():
    one = nvfp4.encode_e4m3(1.0)
    assert int(one) == 0x38
    # byte 0x9A: element 0 = low nibble 0xA (-1.0), element 1 = high nibble 0x9 (-0.5)
    codes = np.zeros(8, np.uint8)
    codes[0] = 0x9A
    codes[1] = 0x87  # element 2 = 0x7 (6.0), element 3 = 0x8 (-0)
    vals = nvfp4.dequantize(codes, np.full(1, one))
    assert vals[:4].tolist() == [-1.0, -0.5, 6.0, 0.0] and np.signbit(vals[3])
    every = nvfp4.pack_codes(np.arange(16, dtype=np.uint8))
    assert nvfp4.unpack_codes(every).tolist() == list(range(16))
    want = [v for v in nvfp4.E2M1_VALUES] + [-v for v in nvfp4.E2M1_VALUES]
    got = nvfp4.dequantize(every, np.full(1, one))
    assert got.tolist() == want and np.signbit(got[8]) and not np.signbit(got[0])


def test_e4m3_table_and_encoding():
    vals = nvfp4.e4m3_values()
    assert vals[0x38] == 1.0 and vals[0x7E] == 448.0 and vals[0x01] == 2.0**-9 and vals[0x08] == 2.0**-6
    assert vals[0xB8] == -1.0 and np.isnan(vals[0x7F]) and np.isnan(vals[0xFF])
    finite = np.flatnonzero(~np.isnan(vals))
    assert (nvfp4.encode_e4m3(vals[finite]) == finite).all()  # every finite value round-trips (-0 too)
    assert nvfp4.encode_e4m3(1e9) == 0x7E and nvfp4.encode_e4m3(-1e9) == 0xFE  # saturates
    assert nvfp4.encode_e4m3(1.0625) == 0x38  # a tie between 1.0 (even) and 1.125: the even mantissa
    assert nvfp4.encode_e2m1(2.5).item() == 4 and nvfp4.encode_e2m1(-5.0).item() == 0xE  # ties to even


@pytest.mark.parametrize("seed", range(3))
def test_quantize_error_is_bounded_by_the_block_scale(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((5, 3, 128)) * np.exp(rng.uniform(-4, 4, (5, 3, 1)))  # rows of very different size
    x[0, 0, :16] = 0.0  # an all-zero block: scale 0, codes 0
    codes, sf, gs = nvfp4.quantize(x)
    assert codes.shape == (5, 3, 64) and sf.shape == (5, 3, 8) and codes.dtype == sf.dtype == np.uint8
    y = nvfp4.dequantize(codes, sf) * gs
    amax = np.abs(x.reshape(5, 3, 8, 16)).max(-1, keepdims=True)
    err = np.abs((x - y).reshape(5, 3, 8, 16))
    assert (err <= amax / 6 * (1 + 1 / 16) * (1 + 1e-12)).all()  # half the widest e2m1 step, scale rounded
    assert (y[0, 0, :16] == 0).all()
    assert (np.sign(y) * np.sign(x) >= 0).all()  # no sign flips


def test_quantize_is_exact_on_representable_values_negative_codes_included():
    rng = np.random.default_rng(7)
    packed = nvfp4.random_codes(rng, (4, 2, 64))
    c = nvfp4.unpack_codes(packed)
    c[..., ::16] = np.where(rng.random(c[..., ::16].shape) < 0.5, 7, 15)  # each block reaches +-6
    packed = nvfp4.pack_codes(c)
    sf = nvfp4.random_scales(rng, (4, 2, 8))
    x = nvfp4.dequantize(packed, sf)
    assert (x < 0).any() and (x > 0).any()
    codes2, sf2, gs = nvfp4.quantize(x, global_scale=1.0)
    assert gs == 1.0 and (sf2 == sf).all()
    # the same values (a -0 code may come back as +0: equal values)
    assert np.array_equal(nvfp4.dequantize(codes2, sf2), x)


# ---------------------------------------------------------------------------------------------
# the device decode, emulated from dtypes.cuh
# ---------------------------------------------------------------------------------------------
def _byte_perm(a, b, sel, sign_mode):
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for n in range(4):
        nib = (sel >> (4 * n)) & 0xF
        byte = src[nib & 7]
        if sign_mode and nib & 8:  # prmt.b32's sign replication (ptx::prmt); __byte_perm has none
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * n)
    return out


def _device_body(kind):
    """widen_fp4x8<kind>'s source, after (fp16) the helper that holds its table and sign selectors."""
    src = (ROOT / "kernel_src/include/pfa/common/dtypes.cuh").read_text()

    def body(head):
        start = src.index(head)
        return src[start:src.index("\n}\n", start)]
    own = body(f"uint4 widen_fp4x8<{kind}>(uint32_t x, uint32_t scale) {{")
    return (body("void fp4x8_f16_high_bytes(uint32_t x, uint32_t& a, uint32_t& b) {") + own) if kind == "half" else own


def _emulate_widen_fp4x8(kind, x):
    """widen_fp4x8<kind> before its multiply by the scale: the eight 16-bit lanes, from the
    function's own table and selector constants."""
    body = _device_body(kind)
    consts = {m.group(1): int(m.group(2), 16) for m in re.finditer(r"(HI_0_3|HI_4_7|LO_0_3|LO_4_7) = 0x([0-9A-F]+)u",
                                                                  body)}
    sign_sels = [int(s, 16) for s in re.findall(r"ptx::prmt\(x, y, 0x([0-9A-F]+)\)", body)]
    spread = [int(s, 16) for s in re.findall(r"__byte_perm\(\w+, \w+, 0x([0-9A-F]{4})\)", body)]
    mag, y = x & 0x77777777, (x << 4) & 0xFFFFFFFF
    hi = [_byte_perm(consts["HI_0_3"], consts["HI_4_7"], m, False) | (_byte_perm(x, y, s, True) & 0x80808080)
          for m, s in zip((mag, mag >> 16), sign_sels)]
    if kind == "half":
        words = [_byte_perm(h, 0, s, False) for h in hi for s in spread[:2]]
        to_float = lambda bits: float(np.array([bits], np.uint16).view(np.float16)[0])  # noqa: E731
    else:
        lo = [_byte_perm(consts["LO_0_3"], consts["LO_4_7"], m, False) for m in (mag, mag >> 16)]
        words = [_byte_perm(l, h, s, False) for l, h in zip(lo, hi) for s in spread[:2]]
        to_float = lambda bits: float(np.array([bits << 16], np.uint32).view(np.float32)[0])  # noqa: E731
    return [to_float((w >> sh) & 0xFFFF) for w in words for sh in (0, 16)]


@pytest.mark.parametrize("kind", ["half", "__nv_bfloat16"])
def test_device_e2m1_decode_matches_the_reference(kind):
    """Every code at every nibble position, and random words: the device's lanes hold e2m1(code)
    exactly, sign (and -0) included, element i from nibble i."""
    words = [c << (4 * k) for k in range(8) for c in range(16)]
    words += np.random.default_rng(0).integers(0, 2**32, 2000).tolist()
    for x in words:
        got = _emulate_widen_fp4x8(kind, x)
        packed = np.zeros(8, np.uint8)  # one 16-element block, the word's 8 codes first
        packed[:4] = [(x >> (8 * i)) & 0xFF for i in range(4)]
        want = nvfp4.dequantize(packed, np.full(1, nvfp4.encode_e4m3(1.0)))[:8]
        assert got == want.tolist() and np.array_equal(np.signbit(got), np.signbit(want)), hex(x)


# ---------------------------------------------------------------------------------------------
# the batch wrappers: routing, params, validation
# ---------------------------------------------------------------------------------------------
def codes(layout="NHD", data=0x200000, d=D):
    return T((NPAGES, 2, PS, HKV, d // 2) if layout == "NHD" else (NPAGES, 2, HKV, PS, d // 2), U8, data=data)


def scales(layout="NHD", data=0x280000, d=D, dtype=E4M3, strides=None):
    shape = (NPAGES, 2, PS, HKV, d // 16) if layout == "NHD" else (NPAGES, 2, HKV, PS, d // 16)
    return T(shape, dtype, strides=strides, data=data)


def dec(fake, layout="NHD"):
    return decode.BatchDecodeWithPagedKVCacheWrapper(WS(fake), layout)


def plan_dec(w, q_len=1, **kw):
    kw.setdefault("kv_data_type", "uint8")
    return w.plan(KV_INDPTR, KV_INDICES, LAST, HQ, HKV, D, PS, q_data_type="bfloat16", q_len_per_req=q_len, **kw)


def q_dec(q_len=1):
    return T((B * q_len, HQ, D), BF16, data=0x100000)


def o_dec(q_len=1):
    return T((B * q_len, HQ, D), BF16, data=0x400000)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_decode_wrapper_launches_the_nvfp4_tile_with_scale_addresses(fake, layout):
    w = dec(fake, layout)
    plan_dec(w)
    la = w._engine.attn
    assert la.meta["kv_dtype"] == "nvfp4" and la.meta["decode"] and la.meta["paged"] and la.meta["block_m"] == 16
    assert w._engine.cfg.kv_nvfp4 and la.params.kv_fp8 == 0
    w.run(q_dec(), codes(layout), kv_cache_sf=scales(layout), out=o_dec())
    name, grid, _, p = last_attn(fake)
    assert name == la.name
    row = PS * HKV * D // 2  # code bytes of one page of K (or V)
    srow = PS * HKV * D // 16
    assert (p.k, p.v) == (0x200000, 0x200000 + row)
    assert (p.k_sf, p.v_sf) == (0x280000, 0x280000 + srow)
    if layout == "NHD":
        assert (p.k_stride_page, p.k_stride_n, p.k_stride_h) == (2 * row, HKV * D // 2, D // 2)
        assert (p.k_sf_stride_page, p.k_sf_stride_n, p.k_sf_stride_h) == (2 * srow, HKV * D // 16, D // 16)
    else:
        assert (p.k_stride_page, p.k_stride_n, p.k_stride_h) == (2 * row, D // 2, PS * D // 2)
        assert (p.k_sf_stride_page, p.k_sf_stride_n, p.k_sf_stride_h) == (2 * srow, D // 16, PS * D // 16)
    assert (p.v_sf_stride_page, p.v_sf_stride_n, p.v_sf_stride_h) == (
        p.k_sf_stride_page, p.k_sf_stride_n, p.k_sf_stride_h)
    assert grid == (HKV, 1, w._engine.schedule.grid)


def test_tuple_cache_takes_a_tuple_of_scales_and_float4_x2_codes(fake):
    w = dec(fake)
    plan_dec(w, kv_data_type="float4_e2m1fn_x2")  # torch's packed fp4 dtype: the same bytes as uint8
    kc = T((NPAGES, PS, HKV, D // 2), E2M1X2, data=0x600000)
    vc = T((NPAGES, PS, HKV, D // 2), E2M1X2, data=0x700000)
    ks = T((NPAGES, PS, HKV, D // 16), E4M3, data=0x680000)
    vs = T((NPAGES, PS, HKV, D // 16), E4M3, data=0x780000)
    w.run(q_dec(), (kc, vc), kv_cache_sf=(ks, vs), out=o_dec())
    p = last_attn(fake)[3]
    assert (p.k, p.v, p.k_sf, p.v_sf) == (0x600000, 0x700000, 0x680000, 0x780000)
    assert (p.k_sf_stride_page, p.k_sf_stride_n, p.k_sf_stride_h) == (PS * HKV * D // 16, HKV * D // 16, D // 16)
    assert w._engine.attn.meta["kv_dtype"] == "nvfp4" and w._engine.cfg.kv_dtype is E2M1X2


_BAD_RUN = [  # (id, run() keyword overrides, exception, pattern)
    ("no_scales", dict(kv_cache_sf=None), TypeError, r"kv_cache_sf is required"),
    ("scales_uint8", dict(kv_cache_sf=scales(dtype=U8)), TypeError, r"kv_cache_sf must be float8_e4m3fn"),
    ("scales_f16", dict(kv_cache_sf=scales(dtype=F16)), TypeError, r"kv_cache_sf must be float8_e4m3fn"),
    ("scales_shape", dict(kv_cache_sf=T((NPAGES, 2, PS, HKV, D // 8), E4M3, data=0x280000)), ValueError,
     r"kv_cache_sf must have shape"),
    ("scales_heads", dict(kv_cache_sf=T((NPAGES, 2, PS, HKV + 1, D // 16), E4M3, data=0x280000)), ValueError,
     r"kv_cache_sf must have shape"),
    ("scales_tuple", dict(kv_cache_sf=(scales(), scales())), ValueError, r"kv_cache_sf must be one tensor"),
    ("scales_cpu", dict(kv_cache_sf=FakeProducer((NPAGES, 2, PS, HKV, D // 16), (2 * PS * HKV * 8, PS * HKV * 8,
                                                                                   HKV * 8, 8, 1), E4M3, 0x280000, 0,
                                                 CPU)), ValueError, r"kv_cache_sf is on the CPU"),
    ("scales_misaligned", dict(kv_cache_sf=scales(data=0x280004)), ValueError, r"kv_cache_sf must have 8-byte"),
    ("scales_strided_last", dict(kv_cache_sf=scales(strides=(2 * PS * HKV * 16, PS * HKV * 16, HKV * 16, 16, 2))),
     ValueError, r"kv_cache_sf must be contiguous"),
    ("codes_f16", dict(paged_kv_cache=T((NPAGES, 2, PS, HKV, D // 2), F16, data=0x200000)), TypeError,
     r"paged_kv_cache has dtype float16"),
    ("codes_full_width", dict(paged_kv_cache=codes(d=2 * D)), ValueError, r"paged_kv_cache must have shape"),
]


@pytest.mark.parametrize("case, over, exc, pattern", [pytest.param(*c, id=c[0]) for c in _BAD_RUN])
def test_decode_run_refuses_bad_nvfp4_operands(fake, case, over, exc, pattern):
    w = dec(fake)
    plan_dec(w)
    args = dict(paged_kv_cache=codes(), kv_cache_sf=scales())
    args.update(over)
    with pytest.raises(exc, match=pattern):
        w.run(q_dec(), args["paged_kv_cache"], kv_cache_sf=args["kv_cache_sf"], out=o_dec())
    assert not fake.attn_launches()


def test_scales_for_a_tuple_cache_must_be_a_tuple(fake):
    w = dec(fake)
    plan_dec(w)
    kc, vc = (T((NPAGES, PS, HKV, D // 2), U8, data=a) for a in (0x600000, 0x700000))
    with pytest.raises(ValueError, match=r"kv_cache_sf must be a \(k_sf, v_sf\) tuple"):
        w.run(q_dec(), (kc, vc), kv_cache_sf=scales(), out=o_dec())
    assert not fake.attn_launches()


def test_scales_given_to_another_plan_are_refused(fake):
    w = dec(fake)
    plan_dec(w, kv_data_type="bfloat16")
    with pytest.raises(TypeError, match=r"kv_cache_sf: block scales belong to an NVFP4 cache"):
        w.run(q_dec(), T((NPAGES, 2, PS, HKV, D), BF16, data=0x200000), kv_cache_sf=scales(), out=o_dec())
    assert not fake.attn_launches()


@pytest.mark.parametrize("kw, pattern", [
    (dict(logits_soft_cap=30.0), "NVFP4"), (dict(pos_encoding_mode="ALIBI"), "NVFP4"),
    (dict(pos_encoding_mode="ROPE_LLAMA"), "NVFP4")])
def test_plan_refuses_options_the_nvfp4_kernels_lack(fake, kw, pattern):
    with pytest.raises(NotImplementedError, match=pattern):
        plan_dec(dec(fake), **kw)


def test_ragged_and_masked_prefill_refuse_nvfp4(fake):
    with pytest.raises(NotImplementedError, match="paged caches only"):
        plan_ragged(ragged(fake), q_data_type="float16", kv_data_type="uint8")
    w = paged(fake)
    with pytest.raises(NotImplementedError, match="custom mask"):
        plan_paged(w, q_data_type="float16", kv_data_type="uint8",
                   custom_mask=fake.dev(np.ones(5 * 19, np.uint8), _dtypes.BOOL))  # (requests 2, 3: no keys)


def test_split_kv_runs_with_its_merge(fake):
    """FlashInfer disables split-KV for NVFP4 (a workaround); here a long request splits and merges."""
    w = dec(fake)
    n = 64
    w.plan(i32(0, n), np.arange(n, dtype=np.int32) % NPAGES, i32(16), HQ, HKV, D, PS, q_data_type="bfloat16",
           kv_data_type="uint8", fixed_split_size=256)
    e = w._engine
    assert e.merge is not None and e.schedule.split
    w.run(T((1, HQ, D), BF16), codes(), kv_cache_sf=scales(), out=T((1, HQ, D), BF16, data=0x400000))
    p = last_attn(fake)[3]
    assert p.kv_chunk_size == 256 and p.o_partial != 0 and p.k_sf == 0x280000
    assert [x for x in fake.cu.launches if x[0].startswith("merge")], "no merge was launched"


def test_prefill_paged_wrapper_runs_long_requests_as_several_row_tiles(fake):
    """No 128-row NVFP4 kernel: 12 query rows x group 4 = 48 packed rows take the 64-row tile, and a
    longer request several of them (routing.DECODE_ONLY_KV)."""
    w = paged(fake)
    plan_paged(w, q_data_type="float16", kv_data_type="uint8", causal=True)
    e = w._engine
    assert e.attn.meta["kv_dtype"] == "nvfp4" and e.attn.meta["decode"] and e.attn.meta["block_m"] == 64
    assert e.cfg.route.attn is None and e.cfg.route.decode_only
    w.run(T((17, HQ, D), F16), codes(), kv_cache_sf=scales(), out=T((17, HQ, D), F16, data=0x400000))
    assert last_attn(fake)[3].causal == 1
    qo = i32(0, 40)  # 40 tokens x 4 = 160 rows: three 64-row tiles
    w.plan(qo, i32(0, 3), i32(4, 1, 0), i32(16), HQ, HKV, D, PS, q_data_type="float16", kv_data_type="uint8",
           causal=True)
    assert e.attn.meta["block_m"] == 64 and e.schedule.grid >= 3
    assert routing.decode_tile_rows(128, 1000, (16, 32, 64), True) == 64
    assert routing.decode_tile_rows(128, 1000, (16, 32, 64)) == 0


# ---------------------------------------------------------------------------------------------
# XQA
# ---------------------------------------------------------------------------------------------
WIDTH, MSL = 40, 17 * 16
TABLE = [[4, 1, 7], [0, 7, 7], [7, 7, 7]]


def xqa_args(fake, **kw):
    table = np.zeros((B, WIDTH), np.int32)
    table[:, :3] = TABLE
    bt = fake.dev(table, I32, shape=table.shape)
    sl = fake.dev(i32(19, 16, 0), I32)
    args = dict(query=T((B, HQ, D), BF16, data=0x100000), kv_cache=codes(), workspace_buffer=WS(fake),
                block_tables=bt, seq_lens=sl, max_seq_len=MSL, out=T((B, HQ, D), BF16, data=0x400000),
                kv_cache_sf=scales())
    args.update(kw)
    return args


def test_xqa_nvfp4_params(fake):
    args = xqa_args(fake, bmm1_scale=0.3, bmm2_scale=0.7)
    decode.xqa_batch_decode_with_kv_cache(**args)
    name, _, _, p = last_attn(fake)
    (e,) = xqa._ENGINES.values()
    assert e.attn.meta["kv_dtype"] == "nvfp4" and e.attn.meta["decode"]
    assert (p.k_sf, p.v_sf) == (0x280000, 0x280000 + PS * HKV * D // 16)
    assert (p.k, p.v) == (0x200000, 0x200000 + PS * HKV * D // 2)
    assert p.v_scale == pytest.approx(0.7) and p.kv_seq_lens == args["seq_lens"].args[3]
    # a second call re-validates and re-points the scales (no fast path for NVFP4)
    decode.xqa_batch_decode_with_kv_cache(**xqa_args(fake, kv_cache_sf=scales(data=0x290000)))
    assert last_attn(fake)[3].k_sf == 0x290000 and len(xqa._ENGINES) == 1 and not xqa._FAST


def test_xqa_nvfp4_tuple_cache(fake):
    kc, vc = (T((NPAGES, PS, HKV, D // 2), U8, data=a) for a in (0x600000, 0x700000))
    ks, vs = (T((NPAGES, PS, HKV, D // 16), E4M3, data=a) for a in (0x680000, 0x780000))
    decode.xqa_batch_decode_with_kv_cache(**xqa_args(fake, kv_cache=(kc, vc), kv_cache_sf=(ks, vs)))
    p = last_attn(fake)[3]
    assert (p.k, p.v, p.k_sf, p.v_sf) == (0x600000, 0x700000, 0x680000, 0x780000)


_BAD_XQA = [
    ("uint8_without_scales", lambda f: dict(kv_cache_sf=None), TypeError, r"kv_cache_sf"),
    ("scales_with_bf16_cache", lambda f: dict(kv_cache=T((NPAGES, 2, PS, HKV, D), BF16, data=0x200000)), TypeError,
     r"kv_cache_sf is given, so kv_cache must be uint8"),
    ("scales_dtype", lambda f: dict(kv_cache_sf=scales(dtype=U8)), TypeError, r"kv_cache_sf must be float8_e4m3fn"),
    ("scales_shape", lambda f: dict(kv_cache_sf=scales(d=2 * D)), ValueError, r"kv_cache_sf must have shape"),
    ("scales_form", lambda f: dict(kv_cache_sf=(scales(), scales())), ValueError, r"kv_cache_sf must be one tensor"),
    ("codes_width", lambda f: dict(kv_cache=codes(d=2 * D), kv_cache_sf=scales(d=2 * D)), ValueError,
     r"kv_cache head_dim 256 differs"),
    ("spec_mask", lambda f: dict(mask=T((B, 1, 2), _dtypes.UINT16, data=0x820000)), NotImplementedError, r"mask"),
]


@pytest.mark.parametrize("case, over, exc, pattern", [pytest.param(*c, id=c[0]) for c in _BAD_XQA])
def test_xqa_refuses_bad_nvfp4_arguments_before_anything_runs(fake, case, over, exc, pattern):
    args = xqa_args(fake)
    args.update(over(fake))
    fake.assert_refused_before_anything_runs(lambda: decode.xqa_batch_decode_with_kv_cache(**args), exc, pattern)
    assert not xqa._ENGINES


def test_nvfp4_decode_tiles_split_budget_by_where_they_widen(fake, monkeypatch):
    """The 16-row NVFP4 tile widens fragments in registers (the manifest's reg_widen): one wave of
    split budget, as 16-bit K/V; the wide tiles widen each tile in shared memory: two waves."""
    monkeypatch.delenv(routing.DECODE_WAVES_ENV, raising=False)
    w = dec(fake)
    plan_dec(w)
    r = w._engine.cfg.route
    ld, budget, cps = r.decode[16]
    assert ld.meta["reg_widen"] and budget == 132 * cps  # the fake driver's 132 SMs
    wide = [rows for rows in r.decode if rows > 16]
    assert wide
    for rows in wide:
        ld, budget, cps = r.decode[rows]
        assert not ld.meta["reg_widen"] and budget == 132 * cps * routing.FP8_DECODE_WAVES
