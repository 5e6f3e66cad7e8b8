"""trtllm_fmha_v2_prefill and trtllm_batch_context_with_kv_cache with float8_e4m3fn q, k and v (the
sm_90a fp8 prefill; its paged rows for a paged cache), GPU, against the float64 reference on the
DEQUANTISED inputs (the fp8 values as float64).

bmm1_scale (the logit scale, semantics 1.13: sm_scale * q_scale * k_scale) is 1.3 / sqrt(D) and
bmm2_scale (the output multiplier) 1.7, never 1, as numbers and as one-element device tensors,
so a dropped or misplaced scale fails. Layouts PACKED_QKV (MHA), CONTIGUOUS_Q_KV and
SEPARATE_Q_K_V (GQA 4); masks causal, padding, sliding_window, chunked; requests of 1, 63, 129 and
1000 queries in one batch (the non-packed layouts with more keys than queries: bottom-right);
host (numpy) and device metadata; outputs e4m3 (FlashInfer's default for an e4m3 query: q's
dtype), bfloat16 and float16. Paged: Q_PAGED_KV_NHD / HND over a 5-D cache, and the (k, v) tuple
with [B, 2, M] offsets from K's base (V's pages in their own random order); page sizes 1, 16, 32,
64, 128; the context API over an e4m3 cache (5-D or (k, v) tuple, shared or separate page ids,
HND or NHD, causal or not), with its LSE checked (base 2 of the bmm1-scaled logits). Pages are
handed out in a random order among garbage pages (finite, 4x larger, never read).

Tolerances are FlashInfer's fp8 tests' (semantics 1.14): 16-bit output atol 4e-2, rtol 8e-2; e4m3
output 1e-1. V is drawn at std 0.5: the kernel rounds P to e4m3 before P V (tests/gpu/
test_fp8_prefill.py has the arithmetic: at std 1 and an output scale near 2 the P rounding
alone reaches the atol; at 0.5 it stays well under). fmha_v2 returns no LSE: save_softmax_stats
is refused for fp8 (the host tests check that); the context API's LSE gets 1e-2 / 1e-3. Outputs are poisoned out= buffers (NaN; e4m3 0x7f, e4m3fn's
NaN); NaN never passes. On a GPU other than sm_90 the NotImplementedError is checked instead.

    python -m pytest -q tests/gpu/test_trtllm_fp8.py
"""
from __future__ import annotations

import math
import os
from collections import OrderedDict

import numpy as np
import pytest

from pyflashattn.testing.gpu import cuda_generator, page_spans, require_cuda_torch, scratch_workspace

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this torch has no float8 dtypes", allow_module_level=True)

import pyflashattn  # noqa: E402
from pyflashattn._engine import trtllm as _trtllm, trtllm_device as _trtllm_device  # noqa: E402
from pyflashattn.testing import to_numpy_f64  # noqa: E402
from pyflashattn.testing.checks import assert_close, fp8_output_atol  # noqa: E402
from pyflashattn.testing.frameworks import capture_torch_graph  # noqa: E402
from pyflashattn.testing.reference import attention_ref  # noqa: E402

DEV = "cuda"
E4M3, BF16, F16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16
SM90 = torch.cuda.get_device_capability() == (9, 0)
O_TOL = {BF16: dict(atol=4e-2, rtol=8e-2), F16: dict(atol=4e-2, rtol=8e-2), E4M3: dict(atol=1e-1, rtol=1e-1)}
LSE_TOL = dict(atol=1e-2, rtol=1e-3)
V_STD = 0.5
QL = (1, 63, 129, 1000)
KL_MORE = (1, 100, 129, 1030)  # keys beyond the queries (the non-packed layouts)
BMM1, BMM2 = 1.3, 1.7  # bmm1 = BMM1 / sqrt(D)
fmha = pyflashattn.prefill.trtllm_fmha_v2_prefill
context = pyflashattn.prefill.trtllm_batch_context_with_kv_cache
needs_sm90 = pytest.mark.skipif(not SM90, reason="the fp8 prefill kernels are sm_90a only")


@pytest.fixture(autouse=True)
def fresh_engines(monkeypatch):
    monkeypatch.setattr(_trtllm, "_ENGINES", OrderedDict())
    monkeypatch.setattr(_trtllm_device, "_ENGINES", OrderedDict())


def cum(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def poisoned(shape, dtype):
    if dtype == E4M3:
        return torch.full(shape, 0x7F, dtype=torch.uint8, device=DEV).view(E4M3)
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def fp8_rows(shape, g, v_axis):
    """fp32 normal rows, the V slice (index 2 or 1 of axis 1, per v_axis) at std V_STD, as e4m3."""
    x = torch.randn(shape, generator=g, device=DEV, dtype=torch.float32)
    if v_axis is not None:
        x[:, v_axis] *= V_STD
    return x.to(E4M3)


def make_qkv(layout, ql, kl, hq, hkv, d, g):
    """(qkv argument, q, k, v as e4m3 views of it)."""
    if layout == "PACKED_QKV":
        t = fp8_rows((sum(ql), 3, hq, d), g, 2)
        return t, t[:, 0], t[:, 1], t[:, 2]
    q = fp8_rows((sum(ql), hq, d), g, None)
    if layout == "CONTIGUOUS_Q_KV":
        kv = fp8_rows((sum(kl), 2, hkv, d), g, 1)
        return (q, kv), q, kv[:, 0], kv[:, 1]
    kv = fp8_rows((sum(kl), 2, hkv, d), g, 1)
    k, v = kv[:, 0].contiguous(), kv[:, 1].contiguous()
    return (q, k, v), q, k, v


def chunk_mask(lq, lk, chunk):
    qi, ki = np.arange(lq)[:, None], np.arange(lk)[None, :]
    p = qi + lk - lq
    return (ki <= p) & (ki >= (p // chunk) * chunk)


def _o_tol(out_dtype, o_of_abs_v):
    """FlashInfer's fp8 tolerance for this output dtype, its atol widened by P's e4m3 rounding
    (checks.fp8_output_atol; o_of_abs_v: the reference output for |V|)."""
    tol = O_TOL[out_dtype]
    return dict(atol=fp8_output_atol(tol["atol"], o_of_abs_v), rtol=tol["rtol"])


def reference(q, k, v, ql, kl, d, causal, wl, chunk):
    """(output, LSE: base 2 of the bmm1-scaled logits) of the batch in float64."""
    q, k, v = (to_numpy_f64(t.float()) for t in (q, k, v))
    cq, ck = cum(ql), cum(kl)
    outs, lses = [], []
    for b in range(len(ql)):
        qb, kb, vb = q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
        mask = chunk_mask(ql[b], kl[b], chunk) if chunk else None
        o, lse = attention_ref(qb, kb, vb, causal=causal and not chunk, sm_scale=BMM1 / math.sqrt(d), window_left=wl,
                               custom_mask=mask)
        outs.append(o * BMM2)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


def fp8_pages(rows, kl, ps, perm, g, nan_pages=False):
    """e4m3 rows [tokens, Hkv, D] of requests of kl keys on pages of ps rows, handed out in the
    order perm among garbage pages (nan_pages: NaN, e4m3's 0x7F, in every slot no key holds):
    (uint8 pages [len(perm), ps, Hkv, D], int32 table [B, M])."""
    table, spans = page_spans(kl, ps, perm, len(perm) - 1)
    shape = (len(perm), ps) + tuple(rows.shape[1:])
    if nan_pages:
        pages = torch.full(shape, 0x7F, dtype=torch.uint8, device=DEV).view(E4M3)
    else:
        pages = (torch.randn(shape, generator=g, device=DEV) * 4).to(E4M3)
    pages, src = pages.view(torch.uint8), rows.view(torch.uint8)
    for pid, lo, hi in spans:
        pages[pid, :hi - lo] = src[lo:hi]
    return pages, table


def paged_kv(k, v, kl, ps, layout, g, separate, nan_pages=False):
    """K and V pages (uint8 [P, ps, Hkv, D], HND: [P, Hkv, ps, D]) and their block tables [B, M]:
    V's pages in their own random order when separate, else at K's ids."""
    rng = np.random.default_rng(ps)
    total = sum(-(-n // ps) for n in kl) + 3
    k_perm = rng.permutation(total)
    kp, kt = fp8_pages(k, kl, ps, k_perm, g, nan_pages)
    vp, vt = fp8_pages(v, kl, ps, rng.permutation(total) if separate else k_perm, g, nan_pages)
    if layout == "HND":
        kp, vp = (t.transpose(1, 2).contiguous() for t in (kp, vp))
    return kp, vp, kt, vt


def paged_qkv(q, k, v, kl, ps, layout, g, tuple_form, nan_pages=False):
    """fmha's paged qkv and block tables: a 5-D cache [P, 2, ...] with [B, M] tables, or
    (tuple_form) (k, v) views of one allocation with [B, 2, M] offsets from K's base."""
    kp, vp, kt, vt = paged_kv(k, v, kl, ps, layout, g, tuple_form, nan_pages)
    if not tuple_form:
        return (q, torch.stack([kp, vp], 1).view(E4M3)), kt
    buf = torch.cat([kp, vp]).view(E4M3)
    n = kp.shape[0]
    return (q, (buf[:n], buf[n:])), np.stack([kt, vt + n], 1).astype(np.int32)


def device_or_host(arrays, device_meta):
    return tuple(torch.from_numpy(a).to(DEV) for a in arrays) if device_meta else arrays


def run_case(layout, mode, out_dtype, device_meta, d=128, hq=8, hkv=2, tensor_scales=False, wl=-1, chunk=0, ps=16,
             tuple_form=False, nan_pages=False):
    if layout == "PACKED_QKV":
        hkv = hq
    ql = QL
    kl = QL if layout == "PACKED_QKV" else KL_MORE
    g = cuda_generator("trtllm-fp8", layout, mode, str(out_dtype), device_meta, d, hq, hkv, tensor_scales, wl, chunk,
                       ps, tuple_form)
    qkv, q, k, v = make_qkv(layout, ql, kl, hq, hkv, d, g)
    tables = None
    if layout.startswith("Q_PAGED"):
        qkv, tables = paged_qkv(q, k, v, kl, ps, layout[-3:], g, tuple_form, nan_pages)
        tables, = device_or_host((tables,), device_meta)
    meta = device_or_host((np.asarray(kl, np.int32), cum(ql), cum(kl)), device_meta)
    if layout == "PACKED_QKV":
        meta = meta[:2] + (meta[1],)
    s1, s2 = BMM1 / math.sqrt(d), BMM2
    if tensor_scales:
        s1, s2 = (torch.tensor([x], dtype=torch.float32, device=DEV) for x in (s1, s2))
    out = poisoned((sum(ql), hq, d), out_dtype)
    res = fmha(qkv, layout, scratch_workspace(), meta[0], max(ql), max(kl), s1, s2, len(ql), meta[1], meta[2],
               block_tables=tables, out=out, out_dtype=None if out_dtype == E4M3 else out_dtype, mask_mode=mode,
               window_left=wl, chunked_attention_size=chunk)
    assert res is out
    torch.cuda.synchronize()
    ref, _ = reference(q, k, v, ql, kl, d, mode != "padding", wl, chunk)
    assert_close(out.float(), ref, **_o_tol(out_dtype, reference(q, k, v.float().abs(), ql, kl, d, mode != "padding",
                                                                   wl, chunk)[0]),
                 what=f"{layout} {mode} out={out_dtype} device_meta={device_meta} d={d} Hq={hq} Hkv={hkv} "
                      f"tensor_scales={tensor_scales} wl={wl} chunk={chunk} ps={ps} tuple_form={tuple_form}")


@needs_sm90
@pytest.mark.parametrize("device_meta", [False, True], ids=["host_meta", "device_meta"])
@pytest.mark.parametrize("out_dtype", [E4M3, BF16, F16], ids=["e4m3", "bf16", "f16"])
@pytest.mark.parametrize("mode", ["causal", "padding"])
@pytest.mark.parametrize("layout", ["PACKED_QKV", "CONTIGUOUS_Q_KV", "SEPARATE_Q_K_V"])
def test_fmha_fp8_layouts(layout, mode, out_dtype, device_meta):
    run_case(layout, mode, out_dtype, device_meta)


@needs_sm90
@pytest.mark.parametrize("device_meta", [False, True], ids=["host_meta", "device_meta"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fmha_fp8_head_dims_and_device_scales(d, device_meta):
    run_case("SEPARATE_Q_K_V", "causal", BF16, device_meta, d=d, tensor_scales=True)


@needs_sm90
@pytest.mark.parametrize("device_meta", [False, True], ids=["host_meta", "device_meta"])
@pytest.mark.parametrize("mode, wl, chunk", [("sliding_window", 100, 0), ("causal", 31, 0), ("chunked", -1, 64)])
@pytest.mark.parametrize("hq, hkv", [(8, 1), (4, 4)])
def test_fmha_fp8_window_chunk_gqa(mode, wl, chunk, hq, hkv, device_meta):
    run_case("CONTIGUOUS_Q_KV", mode, E4M3, device_meta, hq=hq, hkv=hkv, wl=wl, chunk=chunk)


@needs_sm90
@pytest.mark.parametrize("device_meta", [False, True], ids=["host_meta", "device_meta"])
@pytest.mark.parametrize("layout, mode, ps, tuple_form", [
    ("SEPARATE_Q_K_V", "padding", 0, False), ("SEPARATE_Q_K_V", "causal", 0, False),
    ("Q_PAGED_KV_HND", "padding", 32, False), ("Q_PAGED_KV_NHD", "padding", 16, True),
    ("Q_PAGED_KV_HND", "causal", 64, True), ("Q_PAGED_KV_HND", "causal", 16, False)])
def test_fmha_fp8_long_keys_run_the_long_kv_or_tma_twin(layout, mode, ps, tuple_form, device_meta):
    """Long requests route to their row's long-KV twin (256-key serial steps; the paged row's
    copies its tiles in 128-key halves) on both metadata paths without any switch: TRT-LLM's
    no-split plans are not batch-invariant ones. Paged caches whose pages make TMA boxes of 32+
    rows take the long twin's TMA twin without a mask, the row's TMA twin causal
    (batch.BatchEngine._twin). Paged: separate V page ids (tuple form) and NHD slots included.
    Causal needs 16k keys (routing.LONG_MIN_KV_CAUSAL): a short query over them."""
    from pyflashattn._engine import routing
    hq, hkv, d = 8, 2, 128
    paged = layout.startswith("Q_PAGED")
    ql, kl = ((300, 77), (4500, 4096)) if mode == "padding" else ((1, 130), (16390, 16384))
    g = cuda_generator("trtllm-fp8-long", layout, mode, ps, tuple_form, device_meta)
    qkv, q, k, v = make_qkv(layout, ql, kl, hq, hkv, d, g)
    tables = None
    if paged:
        qkv, tables = paged_qkv(q, k, v, kl, ps, layout[-3:], g, tuple_form)
        tables, = device_or_host((tables,), device_meta)
    meta = device_or_host((np.asarray(kl, np.int32), cum(ql), cum(kl)), device_meta)
    out = poisoned((sum(ql), hq, d), BF16)
    fmha(qkv, layout, scratch_workspace(), meta[0], max(ql), max(kl), BMM1 / math.sqrt(d), BMM2, len(ql),
         meta[1], meta[2], block_tables=tables, out=out, out_dtype=BF16, mask_mode=mode)
    (e,) = (_trtllm_device if device_meta else _trtllm)._ENGINES.values()
    tma = paged and ps >= routing.PAGED_TMA_MIN_BOX_ROWS
    long = not (tma and mode == "causal")  # paged causal: the row's TMA twin
    assert bool(e.attn.meta.get("long_kv")) is long and e.attn.meta["block_n"] == (256 if long else 128), e.attn.name
    assert bool(e.attn.meta.get("tma")) is tma, e.attn.name
    assert bool(e.attn.meta["paged"]) is paged, e.attn.name
    assert routing.LONG_ENV not in os.environ and routing.KV_LOAD_ENV not in os.environ
    torch.cuda.synchronize()
    ref, _ = reference(q, k, v, ql, kl, d, mode == "causal", -1, 0)
    o_abs, _ = reference(q, k, v.float().abs(), ql, kl, d, mode == "causal", -1, 0)
    assert_close(out.float(), ref, **_o_tol(BF16, o_abs),
                 what=f"long twin {layout} {mode} ps={ps} tuple_form={tuple_form} device_meta={device_meta}")


@needs_sm90
@pytest.mark.parametrize("long_twin", [False, True], ids=["default_row", "long_twin"])
def test_fmha_fp8_device_metadata_graph_replays_new_lengths(monkeypatch, long_twin):
    """One eager call plans the shape key; the captured call (out given, device metadata and bmm
    scales) replays over new lengths and new fp8 rows written into the same buffers. The long-KV
    twin (forced: these keys are short) replays the same way."""
    from pyflashattn._engine import routing
    monkeypatch.setenv(routing.LONG_ENV, "1" if long_twin else "0")
    hq, hkv, d, cap_q, cap_kv = 8, 2, 128, 2048, 2304
    q = torch.zeros(cap_q, hq, d, dtype=torch.uint8, device=DEV).view(E4M3)
    k = torch.zeros(cap_kv, hkv, d, dtype=torch.uint8, device=DEV).view(E4M3)
    v = torch.zeros(cap_kv, hkv, d, dtype=torch.uint8, device=DEV).view(E4M3)
    out = poisoned((cap_q, hq, d), BF16)
    cq, ck = (torch.zeros(5, dtype=torch.int32, device=DEV) for _ in range(2))
    sl = torch.zeros(4, dtype=torch.int32, device=DEV)
    s1 = torch.tensor([BMM1 / math.sqrt(d)], dtype=torch.float32, device=DEV)
    s2 = torch.tensor([BMM2], dtype=torch.float32, device=DEV)

    def load(seed, ql, kl):
        g = cuda_generator("trtllm-fp8-graph", seed)
        _, qn, kn, vn = make_qkv("SEPARATE_Q_K_V", ql, kl, hq, hkv, d, g)
        q[:sum(ql)].copy_(qn)
        k[:sum(kl)].copy_(kn)
        v[:sum(kl)].copy_(vn)
        cq.copy_(torch.from_numpy(cum(ql)))
        ck.copy_(torch.from_numpy(cum(kl)))
        sl.copy_(torch.from_numpy(np.asarray(kl, np.int32)))
        out.fill_(float("nan"))
        return qn, kn, vn

    def call():
        fmha((q, k, v), "SEPARATE_Q_K_V", scratch_workspace(), sl, 1000, 1030, s1, s2, 4, cq, ck, out=out,
             out_dtype=BF16, mask_mode="causal")

    def check(qn, kn, vn, ql, kl, what):
        torch.cuda.synchronize()
        ref, _ = reference(qn, kn, vn, ql, kl, d, True, -1, 0)
        o_abs, _ = reference(qn, kn, vn.float().abs(), ql, kl, d, True, -1, 0)
        assert_close(out[:sum(ql)].float(), ref, **_o_tol(BF16, o_abs), what=what)

    batches = [(QL, KL_MORE), ((1000, 5, 63, 1), (1030, 64, 63, 2)), ((17, 900, 1, 129), (17, 901, 700, 129))]
    qkv = load(0, *batches[0])
    call()
    check(*qkv, *batches[0], "eager")
    (e,) = _trtllm_device._ENGINES.values()
    assert bool(e.attn.meta.get("long_kv")) is long_twin, e.attn.name
    graph = capture_torch_graph(call)
    for i, (ql, kl) in enumerate(batches):
        qkv = load(i + 1, ql, kl)
        graph.replay()
        check(*qkv, ql, kl, f"replay {i}")


@needs_sm90
@pytest.mark.parametrize("device_meta", [False, True], ids=["host_meta", "device_meta"])
@pytest.mark.parametrize("out_dtype", [E4M3, BF16], ids=["e4m3", "bf16"])
@pytest.mark.parametrize("mode", ["causal", "padding"])
@pytest.mark.parametrize("layout", ["Q_PAGED_KV_NHD", "Q_PAGED_KV_HND"])
def test_fmha_fp8_paged_layouts(layout, mode, out_dtype, device_meta):
    run_case(layout, mode, out_dtype, device_meta)


@needs_sm90
@pytest.mark.parametrize("device_meta", [False, True], ids=["host_meta", "device_meta"])
@pytest.mark.parametrize("layout, ps, dense", [("Q_PAGED_KV_HND", 32, True), ("Q_PAGED_KV_HND", 64, True),
                                               ("Q_PAGED_KV_HND", 16, False), ("Q_PAGED_KV_NHD", 32, False)])
def test_fmha_fp8_paged_dense_twin(monkeypatch, layout, ps, dense, device_meta):
    """hd128 HND caches with pages of 32+ slots run the paged row's dense twin (routing.dense_pays),
    the others the row itself; both checked against the reference (run_case). The K/V copies
    forced (PFA_SM90_KV_LOAD=cpasync): the device-metadata plans, planned at the max length, would
    take the paged TMA twin (test_fmha_fp8_paged_tma_twin)."""
    from pyflashattn._engine import routing
    monkeypatch.setenv(routing.KV_LOAD_ENV, "cpasync")
    run_case(layout, "causal", BF16, device_meta, ps=ps)
    (e,) = (_trtllm_device if device_meta else _trtllm)._ENGINES.values()
    assert e.attn.meta["paged"] and bool(e.attn.meta.get("dense_kv")) is dense, e.attn.name


@needs_sm90
@pytest.mark.parametrize("device_meta", [False, True], ids=["host_meta", "device_meta"])
@pytest.mark.parametrize("mode", ["causal", "padding", "sliding_window"])
@pytest.mark.parametrize("ps", [1, 16, 128])
def test_fmha_fp8_paged_long_twin_odd_lengths(monkeypatch, mode, ps, device_meta):
    """The paged long twin forced (PFA_SM90_LONG_KV=1) over run_case's odd lengths (1 .. 1030 keys:
    partial halves and tiles, requests shorter than one half) and page sizes 1 / 16 / 128, with
    separate V page ids at page 16; the window's masked tiles too. The K/V copies forced: at page
    128 the device-metadata plans would take the paged TMA twin."""
    from pyflashattn._engine import routing
    monkeypatch.setenv(routing.LONG_ENV, "1")
    monkeypatch.setenv(routing.KV_LOAD_ENV, "cpasync")
    run_case("Q_PAGED_KV_HND", mode, BF16, device_meta, ps=ps, tuple_form=ps == 16,
             wl=100 if mode == "sliding_window" else -1)
    (e,) = (_trtllm_device if device_meta else _trtllm)._ENGINES.values()
    assert e.attn.meta.get("long_kv") and e.attn.meta["paged"], e.attn.name


@needs_sm90
@pytest.mark.parametrize("form, out_dtype", [("5d_separate", BF16), ("tuple", E4M3)])
def test_context_fp8_on_the_paged_long_twin(monkeypatch, form, out_dtype):
    """The context API (LSE checked too) on the paged long twin, forced over its odd lengths (and
    the K/V copies: the device-metadata plans would take the paged TMA twin)."""
    from pyflashattn._engine import routing
    monkeypatch.setenv(routing.LONG_ENV, "1")
    monkeypatch.setenv(routing.KV_LOAD_ENV, "cpasync")
    run_context(form, out_dtype, True, form == "tuple", ps=32)
    (e,) = (_trtllm_device if form == "tuple" else _trtllm)._ENGINES.values()
    assert e.attn.meta.get("long_kv") and e.attn.meta["paged"], e.attn.name


@needs_sm90
@pytest.mark.parametrize("device_meta", [False, True], ids=["host_meta", "device_meta"])
@pytest.mark.parametrize("mode", ["causal", "padding", "sliding_window"])
@pytest.mark.parametrize("layout, ps, d, tuple_form", [
    ("Q_PAGED_KV_HND", 16, 128, True), ("Q_PAGED_KV_HND", 32, 128, False), ("Q_PAGED_KV_NHD", 64, 128, False),
    ("Q_PAGED_KV_HND", 128, 128, True), ("Q_PAGED_KV_HND", 32, 256, False), ("Q_PAGED_KV_HND", 8, 128, False)])
def test_fmha_fp8_paged_tma_twin(monkeypatch, layout, ps, d, tuple_form, mode, device_meta):
    """The e4m3 paged TMA twins (warp 0 issues a box a page, warps 1..3 transpose V), forced by
    PFA_SM90_KV_LOAD=tma (run_case's requests are
    shorter than routing.tma_pays asks) over run_case's odd lengths (every request's last
    tile partial: its live boxes only, raw V zeroed past kv_len), on pages whose free slots hold
    NaN; separate V page ids in the tuple form. Pages of 8 slots make no boxes: the copies run."""
    from pyflashattn._engine import routing
    from pyflashattn._runtime import registry
    if not any(r.get("tma") and r.get("paged") and r.get("dtype") == "e4m3" and r.get("head_dim") == d
               for r in registry.manifest()["kernels"]):
        pytest.skip(f"no e4m3 paged TMA twin at head_dim {d} is built (a tune row: `make TUNE=1`)")
    monkeypatch.setenv(routing.KV_LOAD_ENV, "tma")
    monkeypatch.setenv(routing.LONG_ENV, "0")
    run_case(layout, mode, BF16, device_meta, d=d, ps=ps, tuple_form=tuple_form, nan_pages=True,
             wl=100 if mode == "sliding_window" else -1)
    (e,) = (_trtllm_device if device_meta else _trtllm)._ENGINES.values()
    assert e.attn.meta["paged"] and bool(e.attn.meta.get("tma")) is (ps >= 16), e.attn.name


@needs_sm90
@pytest.mark.parametrize("device_meta", [False, True], ids=["host_meta", "device_meta"])
@pytest.mark.parametrize("layout, ps, tuple_form", [("Q_PAGED_KV_HND", 32, True), ("Q_PAGED_KV_NHD", 64, False),
                                                    ("Q_PAGED_KV_HND", 128, False), ("Q_PAGED_KV_HND", 256, True)])
def test_fmha_fp8_paged_long_tma_twin_odd_lengths(monkeypatch, layout, ps, tuple_form, device_meta):
    """The paged long twin's TMA twin (256-key tiles as boxes of a page) forced (PFA_SM90_LONG_KV=1,
    PFA_SM90_KV_LOAD=tma) over run_case's odd lengths (partial tiles: live boxes, raw V zeroed past
    kv_len; requests shorter than one box) on pages whose free slots hold NaN, separate V ids in
    the tuple form. Without a mask, where BatchEngine._twin takes it (causal plans take the row's
    TMA twin)."""
    from pyflashattn._engine import routing
    monkeypatch.setenv(routing.LONG_ENV, "1")
    monkeypatch.setenv(routing.KV_LOAD_ENV, "tma")
    run_case(layout, "padding", BF16, device_meta, ps=ps, tuple_form=tuple_form, nan_pages=True)
    (e,) = (_trtllm_device if device_meta else _trtllm)._ENGINES.values()
    meta = e.attn.meta
    assert meta.get("long_kv") and meta.get("tma") and meta["paged"] and meta["block_n"] == 256, e.attn.name


@needs_sm90
@pytest.mark.parametrize("device_meta", [False, True], ids=["host_meta", "device_meta"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("ps", [1, 16, 32, 64, 128])
def test_fmha_fp8_paged_tuple_form_page_sizes_device_scales(ps, d, device_meta):
    run_case("Q_PAGED_KV_HND", "causal", BF16, device_meta, d=d, tensor_scales=True, ps=ps, tuple_form=True)


@needs_sm90
@pytest.mark.parametrize("mode, wl, chunk", [("sliding_window", 100, 0), ("chunked", -1, 64)])
@pytest.mark.parametrize("hq, hkv", [(8, 1), (4, 4)])
def test_fmha_fp8_paged_window_chunk_gqa(mode, wl, chunk, hq, hkv):
    run_case("Q_PAGED_KV_NHD", mode, E4M3, True, hq=hq, hkv=hkv, wl=wl, chunk=chunk, ps=32)


def run_context(form, out_dtype, tensor_scales, device_meta, layout="HND", d=128, hq=8, hkv=2, causal=True, wl=-1,
                ps=16):
    """The context API over an e4m3 cache: form "5d" ([P, 2, ...]) or "tuple" ((k, v) page tensors),
    with "_separate" [B, 2, M] tables (V's pages in their own order); output and LSE checked."""
    ql, kl = QL, KL_MORE
    g = cuda_generator("trtllm-fp8-context", form, str(out_dtype), tensor_scales, device_meta, layout, d, hq, hkv,
                       causal, wl, ps)
    _, q, k, v = make_qkv("SEPARATE_Q_K_V", ql, kl, hq, hkv, d, g)
    separate = form.endswith("_separate")
    kp, vp, kt, vt = paged_kv(k, v, kl, ps, layout, g, separate)
    cache = (kp.view(E4M3), vp.view(E4M3)) if form.startswith("tuple") else torch.stack([kp, vp], 1).view(E4M3)
    table, sl, cq, ck = device_or_host((np.stack([kt, vt], 1).astype(np.int32) if separate else kt, np.asarray(kl, np.int32), cum(ql),
                                        cum(kl)), device_meta)
    s1, s2 = BMM1 / math.sqrt(d), BMM2
    if tensor_scales:
        s1, s2 = (torch.tensor([x], dtype=torch.float32, device=DEV) for x in (s1, s2))
    out = poisoned((sum(ql), hq, d), out_dtype)
    lse = poisoned((sum(ql), hq), torch.float32)
    res = context(q, cache, scratch_workspace(), table, sl, max(ql), max(kl), s1, s2, len(ql), cq, ck, window_left=wl,
                  out=out, out_dtype=out_dtype, kv_layout=layout, lse=lse, uses_shared_paged_kv_idx=not separate,
                  causal=causal)
    assert res is out
    torch.cuda.synchronize()
    ref, lse_ref = reference(q, k, v, ql, kl, d, causal, wl, 0)
    what = (f"context {form} {layout} out={out_dtype} tensor_scales={tensor_scales} device_meta={device_meta} d={d} "
            f"Hq={hq} Hkv={hkv} causal={causal} wl={wl} ps={ps}")
    assert_close(out.float(), ref, **_o_tol(out_dtype, reference(q, k, v.float().abs(), ql, kl, d, causal, wl, 0)[0]),
                 what=what)
    assert_close(lse, lse_ref, **LSE_TOL, what=f"lse {what}")


@needs_sm90
@pytest.mark.parametrize("device_meta", [False, True], ids=["host_meta", "device_meta"])
@pytest.mark.parametrize("tensor_scales", [False, True], ids=["float_scales", "tensor_scales"])
@pytest.mark.parametrize("out_dtype", [BF16, E4M3], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("form", ["5d", "5d_separate", "tuple", "tuple_separate"])
def test_context_fp8(form, out_dtype, tensor_scales, device_meta):
    run_context(form, out_dtype, tensor_scales, device_meta)


@needs_sm90
@pytest.mark.parametrize("causal, wl", [(True, -1), (True, 100), (False, -1)])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_context_fp8_geometry(layout, d, causal, wl):
    run_context("5d_separate", BF16, False, True, layout=layout, d=d, causal=causal, wl=wl, ps=32)
    run_context("tuple", E4M3, True, False, layout=layout, d=d, hq=8, hkv=1, causal=causal, wl=wl, ps=64)


@pytest.mark.skipif(SM90, reason="checks the refusal off sm_90")
def test_fmha_fp8_off_sm90_is_not_implemented():
    g = cuda_generator("trtllm-fp8-off-sm90")
    qkv, *_ = make_qkv("SEPARATE_Q_K_V", (5,), (5,), 4, 4, 128, g)
    meta = (np.array([5], np.int32), cum((5,)), cum((5,)))
    with pytest.raises(NotImplementedError, match=r"no fp8 Q K\^T path"):
        fmha(qkv, "SEPARATE_Q_K_V", scratch_workspace(), meta[0], 5, 5, 0.1, 1.0, 1, meta[1], meta[2],
             out=poisoned((5, 4, 128), BF16))
