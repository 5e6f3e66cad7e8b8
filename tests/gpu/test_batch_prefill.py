"""Batch prefill wrappers (paged and ragged KV) on a CUDA GPU (torch inputs) against the float64
reference, request by request.

Every case draws fresh seeded random inputs. Paged caches are built with a random page
permutation, and every slot that belongs to no request (unused pages and the tail of each
last page) holds random values, never zeros or NaN, so a kernel that reads a wrong page or a
slot past last_page_len gets a wrong answer rather than a lucky one. Outputs are checked in
NaN-poisoned out=/lse= buffers (and on the allocated path), o and the base-2 LSE, against
pyflashattn.testing.attention_ref on each request's own slices (a subset of q heads for the
long ones, always the first and last).

Beyond the reference: batch vs single_prefill per request; batch invariance (bitwise) under
fixed_split_size and disable_split_kv; split-KV batches; CUDA-graph capture and replay after
re-planning with other lengths, and the capacity errors; device vs host index arrays; run()
rejecting mismatched inputs before any launch; the workspace size contract.

Semantics (FlashInfer, semantics notes 1.1, 1.4, 1.5): kv_len of a paged request is
(pages - 1) * page_size + last_page_len, 0 without pages; causal is bottom-right per request and,
unlike single prefill, allowed with kv_len < qo_len: rows with no visible key give o = 0 and
lse = -inf. ALiBi uses the request-local query row; RoPE puts q at i + kv_len - qo_len.
"""

from __future__ import annotations

import math
import re
import zlib
from types import SimpleNamespace

import numpy as np
import pytest

from pyflashattn.testing.gpu import require_cuda_torch, select_kv_load, tma_built, twin_built

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()

import pyflashattn  # noqa: E402  (after the GPU probe: the CPU box must skip, not error)
from pyflashattn._engine.routing import (  # noqa: E402
    DECODE_MAX_ROWS, built_decode_tiles, decode_tile_rows, tma_fits)
from pyflashattn._engine.routing import dense_pays, span_pays  # noqa: E402
from pyflashattn._runtime import registry as _registry  # noqa: E402
from pyflashattn.testing import attention_ref, to_numpy_f64  # noqa: E402
from pyflashattn.testing.frameworks import capture_torch_graph as _capture  # noqa: E402
from pyflashattn.testing.checks import assert_close, batch_heads_to_check  # noqa: E402

DEV = "cuda"
F16, BF16 = torch.float16, torch.bfloat16
DTYPES = {"fp16": F16, "bf16": BF16}
NAN = float("nan")

# Same tolerances as tests/gpu/test_prefill.py and test_prefill_options.py (FlashInfer's): the
# reference sees the same rounded q/k/v, so what is left is fp32 accumulation, P rounded to 16
# bits before P@V, a split-KV merge and the output rounding.
O_TOL = {F16: dict(atol=1e-3, rtol=1e-3), BF16: dict(atol=1e-2, rtol=1e-2)}
LSE_TOL = {F16: dict(atol=2e-3, rtol=1e-4), BF16: dict(atol=1e-2, rtol=1e-4)}
# ROPE_LLAMA, fp16 o: q/k are rotated in fp32 and rounded back to 16 bits before the MMA (see
# the derivation in test_prefill_options.py); bf16 needs nothing extra.
ROPE_O_TOL = {F16: dict(atol=2e-3, rtol=1e-3), BF16: O_TOL[BF16]}

# Float64 reference cost (~30-50 ns per logit, mostly one core): above this many logits per
# batch, every request compares the same number n >= 2 of q heads (first, last, random others,
# drawn per request so that across the batch most heads and every kv group are seen).
REF_LOGIT_BUDGET = 1 << 24

# Values in slots that belong to no request: random, larger than real K/V, finite.
GARBAGE_SCALE = 4.0

# One big float workspace shared by every wrapper in this module (tests run one after the
# other on one stream, so sharing is safe); never zeroed, so stale partial results from the
# previous test sit in it, as they do in a serving process.
WS_BYTES = 1 << 30
_WS = []


def _workspace():
    if not _WS:
        _WS.append(torch.empty(WS_BYTES, dtype=torch.uint8, device=DEV))
    return _WS[0]


# The sm90 family's K/V load (routing.kv_load_pair): "default" runs what the variant table ships,
# "tma" the TMA twins (PFA_SM90_KV_LOAD=tma; tune rows until shipped: `make TUNE=1`), so the tests
# taking the kv_load fixture run on both producers.
@pytest.fixture(params=["default", "tma"])
def kv_load(request, monkeypatch):
    select_kv_load(request.param, monkeypatch)
    yield request.param
    _registry.force("prefill", None)


def _assert_kv_load(w, kv_load, paged, page_size):
    """Under "tma", an sm90 row-tile plan runs the TMA twin exactly where its pages make boxes."""
    meta = w._engine.attn.meta
    if kv_load == "tma" and meta.get("impl") == "sm90":
        want = tma_fits(paged, page_size, meta["block_n"], 0) and tma_built(paged)
        assert bool(meta.get("tma")) is want, meta["name"]


# ---------------------------------------------------------------------------------------
# helpers (kept local: test modules are imported with importlib, not as a package)
# ---------------------------------------------------------------------------------------
def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def _randn(shape, dtype, seed, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(shape, device=DEV, dtype=torch.float32, generator=g) * scale).to(dtype)




def _draw_lens(rng, n, hi, zero_p=0.0):
    """n lengths, log-uniform in [1, hi] (most of them short), a fraction zero_p set to 0."""
    if hi <= 0:
        return np.zeros(n, dtype=np.int64)
    x = np.floor(np.exp(rng.uniform(0.0, math.log(hi + 1), n))).astype(np.int64).clip(1, hi)
    x[rng.random(n) < zero_p] = 0
    return x


def _lens(seed, batch, qo_max, kv_max, mode, pin=()):
    """(qo_lens, kv_lens) of a random batch. mode: 'append' (kv >= qo: a prefix plus the new
    tokens), 'mixed' (independent, so kv < qo and zeros occur) or 'decode' (qo in 1..8).
    pin: (qo, kv) pairs placed at random positions (the big requests of a case)."""
    rng = np.random.default_rng(seed)
    n = batch - len(pin)
    if mode == "append":
        qo = _draw_lens(rng, n, qo_max, 0.05)
        kv = np.minimum(kv_max, qo + _draw_lens(rng, n, kv_max, 0.2))
    elif mode == "mixed":
        qo = _draw_lens(rng, n, qo_max, 0.1)
        kv = _draw_lens(rng, n, kv_max, 0.1)
    elif mode == "decode":
        qo = rng.integers(1, 9, n)
        kv = _draw_lens(rng, n, kv_max, 0.05)
    else:
        raise ValueError(mode)
    qo, kv = list(qo), list(kv)
    for a, b in pin:
        i = int(rng.integers(0, len(qo) + 1))
        qo.insert(i, a)
        kv.insert(i, b)
    return [int(x) for x in qo], [int(x) for x in kv]


def _indptr(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _batch_from(reqs, hq, hkv, d, dt):
    """A batch from per-request (q [qo, Hq, D], k [kv, Hkv, D], v) NHD tensors."""
    qo_lens = [int(r[0].shape[0]) for r in reqs]
    kv_lens = [int(r[1].shape[0]) for r in reqs]
    return SimpleNamespace(
        qo_lens=qo_lens, kv_lens=kv_lens, qo_indptr=_indptr(qo_lens), kv_tok_indptr=_indptr(kv_lens),
        q=torch.cat([r[0] for r in reqs]), k=torch.cat([r[1] for r in reqs]), v=torch.cat([r[2] for r in reqs]),
        hq=hq, hkv=hkv, d=d, dt=dt)


def _make_batch(qo_lens, kv_lens, hq, hkv, d, dt, seed, q_scale=1.0):
    qi, ki = _indptr(qo_lens), _indptr(kv_lens)
    q = _randn((int(qi[-1]), hq, d), dt, seed, q_scale)
    k = _randn((int(ki[-1]), hkv, d), dt, seed + 1)
    v = _randn((int(ki[-1]), hkv, d), dt, seed + 2)
    return SimpleNamespace(qo_lens=list(qo_lens), kv_lens=list(kv_lens), qo_indptr=qi, kv_tok_indptr=ki,
                           q=q, k=k, v=v, hq=hq, hkv=hkv, d=d, dt=dt)


def _req(b, i):
    """(q, k, v) NHD slices of request i."""
    q0, q1 = int(b.qo_indptr[i]), int(b.qo_indptr[i + 1])
    k0, k1 = int(b.kv_tok_indptr[i]), int(b.kv_tok_indptr[i + 1])
    return b.q[q0:q1], b.k[k0:k1], b.v[k0:k1]


def _page_table(kv_lens, page_size, page_ids):
    """kv_indptr, kv_indices (the first pages of page_ids, in order) and last_page_len."""
    pages = np.asarray([-(-kv // page_size) for kv in kv_lens], dtype=np.int64)
    kv_indptr = _indptr(pages)
    n_used = int(kv_indptr[-1])
    assert n_used <= len(page_ids), "not enough pages"
    indices = np.asarray(page_ids[:n_used], dtype=np.int32)
    kv = np.asarray(kv_lens, dtype=np.int64)
    last = np.where(pages > 0, kv - (pages - 1) * page_size, 0).astype(np.int32)
    return kv_indptr, indices, last


def _write_pages(nhd_view, b, page_size, kv_indptr, indices):
    """Scatter every request's K/V into its pages. nhd_view: [P, 2, page_size, Hkv, D] (for an
    HND cache, its storage permuted to that order: writes land in the real storage)."""
    tok_page, tok_slot = [], []
    for i, kv in enumerate(b.kv_lens):
        t = np.arange(kv)
        tok_page.append(indices[kv_indptr[i] + t // page_size])
        tok_slot.append(t % page_size)
    if not tok_page or sum(b.kv_lens) == 0:
        return
    tp = torch.as_tensor(np.concatenate(tok_page).astype(np.int64), device=DEV)
    ts = torch.as_tensor(np.concatenate(tok_slot).astype(np.int64), device=DEV)
    nhd_view[:, 0][tp, ts] = b.k
    nhd_view[:, 1][tp, ts] = b.v


def _paginate(b, page_size, layout, form, seed, extra_pages=None):
    """A paged cache holding batch b: pages in random order among unused garbage pages.
    form: '5d' (one tensor), 'tuple' (separate k/v tensors), 'tuple_views' (the two halves of
    one 5-D tensor: non-contiguous, page stride 2x) or 'padded' (a 5-D view of a cache whose rows
    hold 8 elements more: page slots D + 8 apart, which an HND plan's dense twin cannot take).
    Returns a namespace with the run() argument and the plan() index arrays (numpy int32)."""
    rng = np.random.default_rng(seed)
    n_used = sum(-(-kv // page_size) for kv in b.kv_lens)
    extra = max(3, n_used // 4) if extra_pages is None else extra_pages
    num_pages = n_used + extra
    kv_indptr, indices, last = _page_table(b.kv_lens, page_size, rng.permutation(num_pages))
    shape = (num_pages, 2, page_size, b.hkv, b.d) if layout == "NHD" else (num_pages, 2, b.hkv, page_size, b.d)
    pad = 8 if form == "padded" else 0
    store = _randn(shape[:-1] + (b.d + pad,), b.dt, seed + 17, GARBAGE_SCALE)[..., :b.d]
    _write_pages(store if layout == "NHD" else store.permute(0, 1, 3, 2, 4), b, page_size, kv_indptr, indices)
    if form in ("5d", "padded"):
        cache = store
    elif form == "tuple":
        cache = (store[:, 0].contiguous(), store[:, 1].contiguous())
    elif form == "tuple_views":
        cache = (store[:, 0], store[:, 1])
    else:
        raise ValueError(form)
    return SimpleNamespace(cache=cache, store=store, kv_indptr=kv_indptr, indices=indices, last=last,
                           page_size=page_size, layout=layout, num_pages=num_pages)


def _paged_wrapper(layout="NHD", **kw):
    return pyflashattn.BatchPrefillWithPagedKVCacheWrapper(_workspace(), layout, **kw)


def _ragged_wrapper(layout="NHD", **kw):
    return pyflashattn.BatchPrefillWithRaggedKVCacheWrapper(_workspace(), layout, **kw)


def _plan_paged(w, b, pg, causal, **opts):
    return w.plan(b.qo_indptr, pg.kv_indptr, pg.indices, pg.last, b.hq, b.hkv, b.d, pg.page_size,
                  causal=causal, q_data_type=b.dt, **opts)


def _plan_ragged(w, b, causal, **opts):
    return w.plan(b.qo_indptr, b.kv_tok_indptr, b.hq, b.hkv, b.d, causal=causal, q_data_type=b.dt, **opts)


def _ragged_kv(b, layout):
    if layout == "NHD":
        return b.k, b.v
    return b.k.transpose(0, 1).contiguous(), b.v.transpose(0, 1).contiguous()


# NaN rows after the end of every out=/lse= buffer: a kernel (or the merge) that writes past the
# last planned row, e.g. a whole q tile, shows up as a changed guard row.
GUARD_ROWS = 256


def _poisoned(b):
    """NaN out/lse views [T, ...] at the start of buffers with GUARD_ROWS more rows."""
    T = b.q.shape[0]
    ob = torch.full((T + GUARD_ROWS, b.hq, b.d), NAN, dtype=b.dt, device=DEV)
    lb = torch.full((T + GUARD_ROWS, b.hq), NAN, dtype=torch.float32, device=DEV)
    return ob[:T], lb[:T]


def _assert_guards(out, lse, what=""):
    T = out.shape[0]
    ob, lb = out._base, lse._base
    assert ob is not None and lb is not None
    assert torch.isnan(ob[T:]).all(), f"{what}: out written past its last row"
    assert torch.isnan(lb[T:]).all(), f"{what}: lse written past its last row"


def _run_into(w, b, kv_args):
    """run() into NaN-poisoned out=/lse= buffers; checks they are the objects returned and that
    nothing was written past their end."""
    out, lse = _poisoned(b)
    r = w.run(b.q, *kv_args, out=out, lse=lse, return_lse=True)
    torch.cuda.synchronize()
    assert isinstance(r, tuple) and r[0] is out and r[1] is lse, "out=/lse= buffers not returned"
    _assert_guards(out, lse, "run")
    return out, lse


def _tensors(kv_args):
    """The tensors among run()'s KV arguments (a paged cache may be a (k, v) tuple)."""
    flat = []
    for x in kv_args:
        flat.extend(x if isinstance(x, tuple) else (x,))
    return flat


_REF_KEYS = ("sm_scale", "window_left", "logits_soft_cap", "pos_encoding_mode", "rope_scale", "rope_theta",
             "lse_base")


def _ref_kw(causal, opts):
    return dict({k: opts[k] for k in _REF_KEYS if k in opts}, causal=causal)


def _otol(dt, opts):
    return (ROPE_O_TOL if opts.get("pos_encoding_mode") == "ROPE_LLAMA" else O_TOL)[dt]


def _check_batch(b, o, lse, causal, opts, seed, what, budget=REF_LOGIT_BUDGET):
    """Every request's rows of o (and lse) against the float64 reference on its own slices.
    Returns the per-request references {i: (o_ref, lse_ref, heads)}."""
    heads = batch_heads_to_check(b.qo_lens, b.kv_lens, b.hq, seed, budget)
    o_np = to_numpy_f64(o)
    lse_np = to_numpy_f64(lse) if lse is not None else None
    refs = {}
    for i in range(len(b.qo_lens)):
        if b.qo_lens[i] == 0:
            continue
        q, k, v = _req(b, i)
        o_ref, lse_ref = attention_ref(q, k, v, heads=heads[i], **_ref_kw(causal, opts))
        refs[i] = (o_ref, lse_ref, heads[i])
        r0, r1 = int(b.qo_indptr[i]), int(b.qo_indptr[i + 1])
        h = slice(None) if heads[i] is None else heads[i]
        tag = f"{what} req {i} (qo {b.qo_lens[i]}, kv {b.kv_lens[i]})"
        assert_close(o_np[r0:r1][:, h], o_ref, what=f"{tag} o", **_otol(b.dt, opts))
        if lse_np is not None:
            assert_close(lse_np[r0:r1][:, h], lse_ref, what=f"{tag} lse", **LSE_TOL[b.dt])
    return refs


def _assert_visible(b, refs, causal, opts, override, dt, what, factor=3.0):
    """The option must move the float64 answer of the largest request by > factor x the o
    tolerance, else a kernel that ignored it would pass."""
    i = max(refs, key=lambda j: b.qo_lens[j] * b.kv_lens[j])
    o_ref, _, heads = refs[i]
    q, k, v = _req(b, i)
    o_alt, _ = attention_ref(q, k, v, heads=heads, **_ref_kw(causal, dict(opts, **override)))
    tol = O_TOL[dt]
    excess = np.abs(o_ref - o_alt) - factor * (tol["atol"] + tol["rtol"] * np.abs(o_alt))
    assert excess.max() > 0, f"{what}: the option barely changes the reference; this case cannot see it"


# ---------------------------------------------------------------------------------------
# Main grid: random batches against the reference.
# (id, kind, batch, qo_max, kv_max, mode, pin, page_size, hq, hkv, d, dtype, layout, causal, form)
# kind 'paged' uses page_size/form; 'ragged' ignores them. GQA groups 1 (32/32), 4 (32/8), 8 (32/4).
# ---------------------------------------------------------------------------------------
GRID = [
    ("p-one-big", "paged", 1, 2048, 8192, "append", [(2048, 8192)], 16, 32, 8, 128, "bf16", "NHD", True, "5d"),
    ("p-4-big", "paged", 4, 2048, 8192, "append", [(1500, 6000)], 64, 32, 4, 128, "fp16", "HND", True, "tuple"),
    ("p-64-small-mixed", "paged", 64, 64, 1024, "mixed", [], 16, 32, 8, 128, "bf16", "NHD", True, "5d"),
    ("p-64-ps1", "paged", 64, 128, 2048, "append", [], 1, 32, 32, 64, "fp16", "NHD", False, "tuple"),
    ("p-16-d256", "paged", 16, 512, 4096, "mixed", [], 64, 32, 8, 256, "bf16", "HND", False, "5d"),
    ("p-33-views", "paged", 33, 300, 3000, "append", [], 16, 32, 4, 64, "bf16", "HND", True, "tuple_views"),
    ("p-8-ps1-causal-short-kv", "paged", 8, 1000, 8192, "mixed", [(900, 300)], 1, 32, 8, 128, "fp16", "HND", True,
     "5d"),
    ("p-12-d256-causal", "paged", 12, 256, 2048, "append", [], 64, 32, 32, 256, "fp16", "NHD", True, "tuple_views"),
    ("p-5-noncausal", "paged", 5, 2048, 2048, "mixed", [(2048, 1)], 16, 32, 32, 64, "fp16", "NHD", False, "5d"),
    ("p-40-decode", "paged", 40, 8, 8192, "decode", [], 16, 32, 8, 128, "bf16", "NHD", True, "5d"),
    ("p-9-ps24", "paged", 9, 200, 1500, "mixed", [], 24, 32, 8, 128, "bf16", "NHD", True, "tuple"),
    ("p-3-hnd-ps16", "paged", 3, 777, 5000, "append", [], 16, 32, 4, 256, "bf16", "HND", False, "tuple"),
    # page slots D + 8 apart: the dense twin's plan falls back to its row (BatchEngine.kv_fallback)
    ("p-9-hnd-padded", "paged", 9, 500, 3000, "append", [], 32, 32, 8, 128, "bf16", "HND", True, "padded"),
    ("p-5-nhd1-padded-d64", "paged", 5, 300, 2000, "mixed", [], 32, 8, 1, 64, "fp16", "NHD", False, "padded"),
    # the sm90 copies in warp spans (hd64 rows; the hd128 page-16 twin, here over padded page slots):
    # page runs of a non-power-of-two page (one row each), of 8, and capped inside pages of 256
    ("p-7-d64-ps24", "paged", 7, 300, 2000, "mixed", [], 24, 16, 4, 64, "bf16", "NHD", True, "5d"),
    ("p-5-d64-ps8", "paged", 5, 300, 1500, "mixed", [(300, 1500)], 8, 16, 4, 64, "bf16", "NHD", True, "tuple_views"),
    ("p-6-d64-ps256-hnd", "paged", 6, 400, 3000, "append", [], 256, 16, 2, 64, "fp16", "HND", False, "tuple"),
    ("p-7-hnd-ps16-padded", "paged", 7, 400, 2500, "append", [], 16, 32, 8, 128, "fp16", "HND", True, "padded"),
    ("r-64-small", "ragged", 64, 128, 1024, "append", [], 0, 32, 8, 128, "bf16", "NHD", True, None),
    ("r-16-big", "ragged", 16, 2048, 8192, "mixed", [(2048, 4096)], 0, 32, 4, 64, "fp16", "NHD", True, None),
    ("r-7-d256", "ragged", 7, 700, 3000, "mixed", [], 0, 32, 32, 256, "bf16", "NHD", False, None),
    ("r-20-hnd", "ragged", 20, 400, 2000, "append", [], 0, 32, 8, 128, "fp16", "HND", True, None),
    ("r-1-tiny", "ragged", 1, 1, 1, "append", [(1, 1)], 0, 32, 8, 64, "fp16", "NHD", True, None),
    ("r-30-decode", "ragged", 30, 8, 6000, "decode", [], 0, 32, 4, 128, "fp16", "NHD", False, None),
    # every request within 16 packed rows (qo_len * group <= 16): the one-warp decode tiles
    ("p-40-dec16-g4", "paged", 40, 4, 8192, "mixed", [], 16, 32, 8, 128, "bf16", "NHD", True, "5d"),
    ("p-24-dec16-ps1-g8", "paged", 24, 2, 3000, "mixed", [], 1, 32, 4, 64, "fp16", "HND", False, "tuple"),
    ("p-12-dec16-ps64-g1-d256", "paged", 12, 16, 4000, "append", [], 64, 32, 32, 256, "bf16", "NHD", True, "5d"),
    ("r-20-dec16-d256", "ragged", 20, 4, 6000, "mixed", [], 0, 32, 8, 256, "fp16", "NHD", True, None),
    ("r-16-dec16-g1-hnd", "ragged", 16, 16, 2000, "append", [], 0, 16, 16, 64, "bf16", "HND", False, None),
    ("r-64-dec16-long", "ragged", 64, 1, 16384, "append", [(1, 16384)], 0, 32, 4, 128, "bf16", "NHD", True, None),
    # 17-32 packed rows at hd64 / hd128 (DECODE_MAX_ROWS): the 32-row decode tile (paged), two
    # 16-row tiles (ragged)
    ("p-32-dec32-g4", "paged", 32, 8, 6000, "mixed", [(8, 6000)], 16, 32, 8, 128, "bf16", "NHD", True, "5d"),
    ("r-24-dec32-g1-d64", "ragged", 24, 32, 3000, "append", [(32, 3000)], 0, 16, 16, 64, "fp16", "NHD", True, None),
    ("p-12-dec32-g8-ps1-d64", "paged", 12, 4, 2000, "mixed", [(4, 2000)], 1, 64, 8, 64, "bf16", "HND", False,
     "tuple"),
    ("r-16-dec32-hnd-noncausal", "ragged", 16, 6, 9000, "mixed", [(6, 9000)], 0, 32, 8, 128, "fp16", "HND", False,
     None),
    ("p-20-dec32-ps64-long", "paged", 20, 8, 20000, "append", [(8, 20000)], 64, 32, 8, 128, "fp16", "NHD", True,
     "tuple_views"),
    # 33-64 packed rows over a page table: the 64-row decode tile (ragged 16-bit K/V: the 128-row kernel)
    ("p-24-dec64-g8", "paged", 24, 8, 7000, "mixed", [(8, 7000)], 16, 64, 8, 128, "bf16", "NHD", True, "5d"),
    ("p-10-dec64-g1-d64-ps1", "paged", 10, 64, 3000, "append", [(64, 3000)], 1, 16, 16, 64, "fp16", "HND", True,
     "tuple"),
    ("r-12-rows64-g8", "ragged", 12, 8, 3000, "mixed", [(8, 3000)], 0, 64, 8, 128, "fp16", "NHD", True, None),
    # hd256 keeps the decode tile to 16 rows: 32 rows take the 128-row kernel
    ("r-10-rows32-d256", "ragged", 10, 8, 3000, "mixed", [(8, 3000)], 0, 32, 8, 256, "bf16", "NHD", True, None),
    # GQA groups that divide neither the row tile (128 / 192 packed rows) nor the sm90 producer's Q
    # row step (16 / 8 / 4 rows at head_dim 64 / 128 / 256): tiles start inside a token's heads
    ("r-6-g5-d64", "ragged", 6, 300, 900, "mixed", [(300, 900)], 0, 15, 3, 64, "bf16", "NHD", True, None),
    ("p-5-g24-d64", "paged", 5, 200, 700, "mixed", [(200, 700)], 16, 24, 1, 64, "fp16", "NHD", False, "5d"),
    ("r-5-g7-d128", "ragged", 5, 300, 800, "append", [(300, 800)], 0, 21, 3, 128, "fp16", "HND", False, None),
    ("p-6-g16-d128", "paged", 6, 160, 600, "mixed", [(160, 600)], 16, 32, 2, 128, "bf16", "NHD", True, "tuple"),
    ("r-4-g3-d256", "ragged", 4, 200, 600, "mixed", [(200, 600)], 0, 9, 3, 256, "bf16", "NHD", True, None),
    ("p-4-g5-d256", "paged", 4, 150, 500, "append", [(150, 500)], 64, 10, 2, 256, "fp16", "HND", False, "5d"),
]


def _build(key, kind, batch, qo_max, kv_max, mode, pin, ps, hq, hkv, d, dtype, layout, form, q_scale=1.0):
    dt = DTYPES[dtype]
    seed = _seed(key)
    qo_lens, kv_lens = _lens(seed, batch, qo_max, kv_max, mode, pin)
    b = _make_batch(qo_lens, kv_lens, hq, hkv, d, dt, seed + 100, q_scale)
    if kind == "paged":
        pg = _paginate(b, ps, layout, form, seed + 200)
        return b, pg, (pg.cache,)
    return b, None, _ragged_kv(b, layout)


def _wrapper_for(kind, layout, **kw):
    return _paged_wrapper(layout, **kw) if kind == "paged" else _ragged_wrapper(layout, **kw)


def _plan(w, kind, b, pg, causal, **opts):
    return _plan_paged(w, b, pg, causal, **opts) if kind == "paged" else _plan_ragged(w, b, causal, **opts)


def _kv_inputs(kind, b, layout, seed):
    """run()'s K/V arguments for batch b: (page table or None, args) -- a 5-D paged cache with
    page_size 16 (pages in the order seed gives) or the ragged k, v."""
    if kind == "paged":
        pg = _paginate(b, 16, layout, "5d", seed)
        return pg, (pg.cache,)
    return None, _ragged_kv(b, layout)


@pytest.mark.parametrize("key,kind,batch,qo_max,kv_max,mode,pin,ps,hq,hkv,d,dtype,layout,causal,form",
                         [pytest.param(*c, id=c[0]) for c in GRID])
def test_batch_grid(key, kind, batch, qo_max, kv_max, mode, pin, ps, hq, hkv, d, dtype, layout, causal, form,
                    kv_load):
    b, pg, kv_args = _build(key, kind, batch, qo_max, kv_max, mode, pin, ps, hq, hkv, d, dtype, layout, form)
    snap = [x.clone() for x in [b.q] + _tensors(kv_args)]
    w = _wrapper_for(kind, layout)
    _plan(w, kind, b, pg, causal)
    _assert_kv_load(w, kv_load, kind == "paged", ps)
    # a decode tile exactly when every request is within DECODE_MAX_ROWS packed rows: the smallest
    # that holds the longest
    short = {"fp16": "f16", "bf16": "bf16"}[dtype]
    tiles = built_decode_tiles(torch.cuda.current_device(), short, short, d, kind == "paged")
    tile = decode_tile_rows(d, max(b.qo_lens) * (hq // hkv), tiles)
    # (the row-tile kernel's rows: 128, or the sm90 hd64 row's three consumer warpgroups, 192)
    assert w._engine.attn.meta["decode"] is bool(tile), w._engine.attn.name
    assert w._engine.schedule.block_m == (tile or w._engine.attn.meta["block_m"]), w._engine.attn.name
    # allocated path
    o1, lse1 = w.run(b.q, *kv_args, return_lse=True)
    # out=/lse= path, NaN-poisoned, same plan: same kernel, same inputs -> the same bits
    o2, lse2 = _run_into(w, b, kv_args)
    assert o1.shape == b.q.shape and o1.dtype == b.dt and o1.device == b.q.device
    assert lse1.shape == (b.q.shape[0], hq) and lse1.dtype == torch.float32
    assert torch.equal(o1, o2) and torch.equal(lse1, lse2), "allocated and out= results differ"
    now = [b.q] + _tensors(kv_args)
    assert all(torch.equal(a, s) for a, s in zip(now, snap)), "an input was modified"
    _check_batch(b, o2, lse2, causal, {}, _seed(key, "heads"), key)
    meta = w._engine.attn.meta
    sm90_row = kind == "paged" and not tile and meta.get("impl") == "sm90"
    if meta.get("dense_kv"):  # the dense twin ran, or (strided page slots) its row
        assert w._engine.kv_fallback is (form == "padded"), key
    elif sm90_row and kv_load == "default" and d <= 128 and dense_pays(layout, hkv, ps):
        assert not twin_built("dense_kv"), f"{key}: a dense layout on {w._engine.attn.name}"
    # the span twin: exactly the cp.async plans with pages of 16 (hd128), at any strides (under
    # "tma" too where no paged TMA twin is built)
    spans = sm90_row and not meta.get("tma") and span_pays(ps) and twin_built("span_kv", d)
    assert bool(meta.get("span_kv")) is spans, f"{key}: {w._engine.attn.name}"


# ---------------------------------------------------------------------------------------
# Options through the batch wrappers (window, soft cap, ALiBi, RoPE, lse_base, sm_scale)
# ---------------------------------------------------------------------------------------
OPTION_CASES = [
    # (id, kind, mode, dtype, layout, causal, opts, visible-override, q_scale)
    ("window-causal-paged", "paged", "append", "fp16", "NHD", True, dict(window_left=17), dict(window_left=-1), 1.0),
    ("window-full-ragged", "ragged", "mixed", "bf16", "NHD", False, dict(window_left=200), dict(window_left=-1), 1.0),
    ("window0-paged-hnd", "paged", "mixed", "bf16", "HND", True, dict(window_left=0), dict(window_left=-1), 1.0),
    ("softcap-paged", "paged", "append", "bf16", "HND", True, dict(logits_soft_cap=2.0, sm_scale=0.5),
     dict(logits_soft_cap=None), 1.0),
    ("softcap-ragged-full", "ragged", "mixed", "fp16", "NHD", False, dict(logits_soft_cap=5.0),
     dict(logits_soft_cap=None), 3.0),
    ("alibi-causal-ragged", "ragged", "append", "fp16", "NHD", True, dict(pos_encoding_mode="ALIBI"),
     dict(pos_encoding_mode="NONE"), 1.0),
    ("alibi-full-paged", "paged", "mixed", "bf16", "NHD", False, dict(pos_encoding_mode="ALIBI"),
     dict(pos_encoding_mode="NONE"), 1.0),
    ("rope-causal-paged", "paged", "append", "fp16", "HND", True,
     dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=500.0, rope_scale=2.0), dict(pos_encoding_mode="NONE"), 1.0),
    ("rope-full-ragged", "ragged", "append", "bf16", "NHD", False, dict(pos_encoding_mode="ROPE_LLAMA"),
     dict(pos_encoding_mode="NONE"), 1.0),
    ("lse-ln-paged", "paged", "mixed", "bf16", "NHD", True, dict(lse_base="ln"), None, 1.0),
    ("window-softcap-ln-ragged", "ragged", "append", "fp16", "NHD", True,
     dict(window_left=64, logits_soft_cap=3.0, lse_base="ln"), dict(window_left=-1), 2.0),
    ("sm-scale-paged", "paged", "mixed", "fp16", "HND", False, dict(sm_scale=0.3), dict(sm_scale=None), 1.0),
]


@pytest.mark.parametrize("key,kind,mode,dtype,layout,causal,opts,visible,q_scale",
                         [pytest.param(*c, id=c[0]) for c in OPTION_CASES])
def test_batch_options(key, kind, mode, dtype, layout, causal, opts, visible, q_scale):
    ps = {"NHD": 16, "HND": 64}[layout] if kind == "paged" else 0
    b, pg, kv_args = _build(key, kind, 12, 300, 2500, mode, [], ps, 32, 8, 128, dtype, layout, "5d", q_scale)
    w = _wrapper_for(kind, layout)
    _plan(w, kind, b, pg, causal, **opts)
    o, lse = _run_into(w, b, kv_args)
    refs = _check_batch(b, o, lse, causal, opts, _seed(key, "heads"), key)
    if visible is not None:
        _assert_visible(b, refs, causal, opts, visible, b.dt, key)


# ---------------------------------------------------------------------------------------
# Batch vs single prefill, request by request
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["paged", "ragged"])
@pytest.mark.parametrize("causal,opts", [
    (True, {}), (False, {}), (True, dict(window_left=100)), (False, dict(logits_soft_cap=4.0)),
    (True, dict(pos_encoding_mode="ALIBI")), (True, dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=1e5)),
], ids=["causal", "full", "window", "softcap", "alibi", "rope"])
def test_batch_matches_single_prefill(kind, causal, opts):
    key = ("vs-single", kind, causal, repr(sorted(opts.items())))
    b, pg, kv_args = _build(key, kind, 10, 600, 4000, "append", [(1, 3000), (600, 600)], 16, 32, 8, 128, "bf16",
                            "NHD", "5d")
    w = _wrapper_for(kind, "NHD")
    _plan(w, kind, b, pg, causal, **opts)
    o, lse = _run_into(w, b, kv_args)
    tol = _otol(b.dt, opts)
    checked = 0
    for i in range(len(b.qo_lens)):
        if b.qo_lens[i] == 0 or b.kv_lens[i] == 0:
            continue
        q, k, v = _req(b, i)
        o_s, lse_s = pyflashattn.single_prefill_with_kv_cache_return_lse(q, k, v, causal=causal, **opts)
        r0, r1 = int(b.qo_indptr[i]), int(b.qo_indptr[i + 1])
        tag = f"req {i} (qo {b.qo_lens[i]}, kv {b.kv_lens[i]})"
        assert_close(o[r0:r1], to_numpy_f64(o_s), what=f"{tag} o vs single", **tol)
        assert_close(lse[r0:r1], to_numpy_f64(lse_s), what=f"{tag} lse vs single", **LSE_TOL[b.dt])
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("qo,hq,hkv,hd,dtype,causal,window,kv_len", [
    (1, 32, 8, 128, "bf16", True, -1, 9000),    # decode, GQA 4
    (4, 32, 8, 64, "fp16", True, -1, 7001),     # speculative decode: 16 packed rows
    (2, 64, 8, 256, "bf16", True, 500, 6000),   # GQA 8 with a window
    (13, 8, 8, 128, "fp16", False, -1, 3333),   # a short MHA append, not causal
    (1, 32, 32, 64, "bf16", False, -1, 100),    # too short to split
    (8, 32, 8, 128, "bf16", True, -1, 20000),   # 8-token speculative decode: 32 rows, two row tiles
    (32, 16, 16, 64, "fp16", True, -1, 5000),   # MHA append of 32 tokens at hd64
    (4, 64, 8, 64, "bf16", False, 300, 3000),   # GQA 8, 32 rows, a window
    (7, 32, 8, 128, "fp16", True, 1000, 777),   # 28 rows, short KV with a window
])
def test_single_decode_tile_matches_one_request_batch(qo, hq, hkv, hd, dtype, causal, window, kv_len):
    """single_prefill runs requests of <= DECODE_MAX_ROWS packed rows on the batch's decode tile
    with the one-request batch plan's KV chunks: the same kernel, chunks and merge order give the
    same bits. Both are also checked against the float64 reference."""
    dt = DTYPES[dtype]
    seed = _seed("single-decode", qo, hq, hkv, hd, dtype, causal, window, kv_len)
    q = _randn((qo, hq, hd), dt, seed)
    k, v = _randn((kv_len, hkv, hd), dt, seed + 1), _randn((kv_len, hkv, hd), dt, seed + 2)
    o_s = torch.full_like(q, NAN)
    lse_s = torch.full((qo, hq), NAN, dtype=torch.float32, device=DEV)
    pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=causal, window_left=window, out=o_s, lse=lse_s)
    w = _wrapper_for("ragged", "NHD")
    w.plan(np.array([0, qo], np.int32), np.array([0, kv_len], np.int32), hq, hkv, hd, causal=causal,
           window_left=window, q_data_type=dt)
    assert w._engine.attn.meta["decode"] and qo * (hq // hkv) <= DECODE_MAX_ROWS[hd]
    o_b, lse_b = w.run(q, k, v, return_lse=True)
    torch.cuda.synchronize()
    assert torch.equal(o_s, o_b) and torch.equal(lse_s, lse_b), "single vs one-request batch differ"
    ref_o, ref_lse = attention_ref(q, k, v, causal=causal, window_left=window)
    assert_close(o_s, ref_o, what="single decode-tile o", **O_TOL[dt])
    assert_close(lse_s, ref_lse, what="single decode-tile lse", **LSE_TOL[dt])


# ---------------------------------------------------------------------------------------
# Empty requests and rows with no visible key
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_empty_requests_and_fully_masked_rows(kind, kv_load):
    # (qo, kv): causal kv < qo (the first 30 rows see nothing), no queries, no keys, kv = qo,
    # one key, and a request with no queries and no keys.
    pairs = [(50, 20), (0, 100), (10, 0), (64, 64), (3, 1), (0, 0), (7, 200)]
    b = _make_batch([p[0] for p in pairs], [p[1] for p in pairs], 16, 4, 128, F16, _seed("empty", kind))
    pg, kv_args = _kv_inputs(kind, b, "NHD", _seed("empty-pages", kind))
    w = _wrapper_for(kind, "NHD")
    _plan(w, kind, b, pg, True)
    o, lse = _run_into(w, b, kv_args)
    _check_batch(b, o, lse, True, {}, 0, "empty/masked")
    # the explicit contract, independent of the reference
    r = int(b.qo_indptr[0])
    assert torch.all(o[r:r + 30] == 0) and torch.all(torch.isneginf(lse[r:r + 30])), "causal rows with no key"
    assert torch.isfinite(lse[r + 30:r + 50]).all()
    r = int(b.qo_indptr[2])
    assert torch.all(o[r:r + 10] == 0) and torch.all(torch.isneginf(lse[r:r + 10])), "kv_len 0 request"


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_batch_without_query_tokens(kind):
    b = _make_batch([0, 0, 0], [5, 0, 40], 8, 8, 64, BF16, _seed("noq", kind))
    pg, kv_args = _kv_inputs(kind, b, "NHD", _seed("noq-pages"))
    w = _wrapper_for(kind, "NHD")
    _plan(w, kind, b, pg, False)
    o, lse = w.run(b.q, *kv_args, return_lse=True)
    torch.cuda.synchronize()
    assert o.shape == (0, 8, 64) and lse.shape == (0, 8)


# ---------------------------------------------------------------------------------------
# Split-KV: short queries over long KV (the grid under-fills the GPU, so requests are split)
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,layout,causal,dtype", [
    ("paged", "HND", True, "fp16"), ("paged", "NHD", False, "bf16"),
    ("ragged", "NHD", True, "bf16"), ("ragged", "NHD", False, "fp16"),
])
def test_split_kv_batch(kind, layout, causal, dtype, kv_load):
    qo_lens = [1, 0, 2, 5, 16, 33, 1, 64]
    kv_lens = [16384, 3000, 4096, 12000, 8192, 16000, 0, 10000]
    dt = DTYPES[dtype]
    b = _make_batch(qo_lens, kv_lens, 32, 8, 128, dt, _seed("split", kind, layout, causal))
    pg, kv_args = _kv_inputs(kind, b, layout, _seed("split-pages", kind, layout, causal))
    w = _wrapper_for(kind, layout)
    _plan(w, kind, b, pg, causal)
    _assert_kv_load(w, kv_load, kind == "paged", 16)
    assert w.workspace_size() > 0, "this batch should be split across CTAs (split-KV is what it tests)"
    o, lse = _run_into(w, b, kv_args)
    _check_batch(b, o, lse, causal, {}, _seed("split-heads"), "split-kv")


@pytest.mark.parametrize("kind", ["paged", "ragged"])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (32, 8, 128), (8, 8, 256)])
def test_merge_of_many_chunks(kind, hq, hkv, d, kv_load):
    # One-tile chunks: 1 .. 130 partial states per row, around the merge kernel's 32-split
    # weight batches and its 4-split unrolled loads (and every head_dim's column stripes).
    kv_lens = [64, 100, 1984, 2048, 2049, 2350, 4096, 5000, 8300]
    qo_lens = [1, 3, 1, 2, 5, 1, 1, 4, 2]
    b = _make_batch(qo_lens, kv_lens, hq, hkv, d, BF16, _seed("many-chunks", kind, d))
    pg, kv_args = _kv_inputs(kind, b, "NHD", _seed("many-chunks-pages", d))
    w = _wrapper_for(kind, "NHD")
    _plan(w, kind, b, pg, True, fixed_split_size=64)
    assert int(w._engine.schedule.num_chunks.max()) == 130, "the longest request should merge 130 one-tile chunks"
    o, lse = _run_into(w, b, kv_args)
    _check_batch(b, o, lse, True, {}, _seed("many-chunks-heads"), "many-chunks")


# ---------------------------------------------------------------------------------------
# enable_pdl=True: the attention kernel is launched programmatically (sm_90). Run 2 reads run
# 1's output as its q right behind it; run 1's kernel lets dependents start at once, so only run
# 2's griddepcontrol.wait keeps it from reading a half-written q. "few_long": 32 CTAs walking
# 16K keys each, so run 2's CTAs find free SMs at once (without the wait it reads NaN: checked
# by removing it); "split": run 1's merge sits between the two (launched programmatically too).
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["paged", "ragged"])
@pytest.mark.parametrize("case", ["few_long", "split"])
def test_enable_pdl_chain_reads_the_finished_previous_output(kind, case, kv_load):
    split = case == "split"
    qo_lens, kv_lens = ([1, 2, 5, 16], [16384, 9000, 12000, 8192]) if split else ([128], [16384])
    b = _make_batch(qo_lens, kv_lens, 32, 8, 128, BF16, _seed("pdl", kind, case))
    pg, kv_args = _kv_inputs(kind, b, "NHD", _seed("pdl-pages", kind, case))
    w = _wrapper_for(kind, "NHD")
    _plan(w, kind, b, pg, True, **({} if split else {"disable_split_kv": True}))
    assert (w.workspace_size() > 0) is split

    def chain(pdl):
        o1, o2 = torch.empty_like(b.q), torch.empty_like(b.q)
        for _ in range(3):  # back to back, so run 2 really is launched while run 1 is in flight
            o1.fill_(float("nan"))  # what run 2 would read without its wait
            o2.fill_(float("nan"))
            w.run(b.q, *kv_args, out=o1, enable_pdl=pdl)
            w.run(o1, *kv_args, out=o2, enable_pdl=pdl)
        torch.cuda.synchronize()
        return o1, o2

    plain, pdl = chain(False), chain(True)
    assert not torch.isnan(pdl[1]).any()
    assert torch.equal(pdl[0], plain[0]) and torch.equal(pdl[1], plain[1]), "enable_pdl changed the result"
    # and captured in a CUDA graph (programmatic edges), replayed. Capturing takes a graph-mode
    # wrapper (run() of one without use_cuda_graph refuses a capture), whose plan (merge always
    # launched, padded grid) is held to its own eager chain.
    i32 = lambda n: torch.empty(n, dtype=torch.int32, device=DEV)  # noqa: E731
    B, pages = len(qo_lens), len(pg.indices) if kind == "paged" else 0
    graph_bufs = (dict(paged_kv_indptr_buf=i32(B + 1), paged_kv_indices_buf=i32(pages),
                       paged_kv_last_page_len_buf=i32(B)) if kind == "paged" else dict(kv_indptr_buf=i32(B + 1)))
    w = _wrapper_for(kind, "NHD", use_cuda_graph=True, qo_indptr_buf=i32(B + 1), **graph_bufs)
    _plan(w, kind, b, pg, True, **({} if split else {"disable_split_kv": True}))
    eager = chain(True)  # chain() runs the current w
    o1, o2 = torch.full_like(b.q, float("nan")), torch.full_like(b.q, float("nan"))
    g = _capture(lambda: (w.run(b.q, *kv_args, out=o1, enable_pdl=True),
                          w.run(o1, *kv_args, out=o2, enable_pdl=True)))
    o1.fill_(float("nan"))
    o2.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(o1, eager[0]) and torch.equal(o2, eager[1]), "graph replay with enable_pdl differs"
    # the replayed chain against the float64 reference too: run 1 on b.q, run 2 on run 1's output
    seed = _seed("pdl-ref", kind, case)
    _check_batch(b, o1, None, True, {}, seed, "graph pdl run 1")
    _check_batch(SimpleNamespace(**{**vars(b), "q": o1}), o2, None, True, {}, seed, "graph pdl run 2")


# ---------------------------------------------------------------------------------------
# Batch invariance: fixed_split_size / disable_split_kv make a request's rows independent of
# the rest of the batch, bit for bit (semantics notes 2.5).
# ---------------------------------------------------------------------------------------
def _others(seed, n, qo_max, kv_max, hq, hkv, d, dt):
    qo, kv = _lens(seed, n, qo_max, kv_max, "mixed")
    ob = _make_batch(qo, kv, hq, hkv, d, dt, seed + 1)
    return [_req(ob, i) for i in range(n)]


@pytest.mark.parametrize("kind", ["paged", "ragged"])
@pytest.mark.parametrize("split", ["fixed_split_size", "disable_split_kv"])
def test_batch_invariance(kind, split, kv_load):
    hq, hkv, d, dt, ps = 32, 8, 128, BF16, 16
    kw = dict(fixed_split_size=512) if split == "fixed_split_size" else dict(disable_split_kv=True)
    # the target: a short query over a long KV, which the default scheduler would split
    # differently depending on how full the GPU is
    tb = _make_batch([37], [9000], hq, hkv, d, dt, _seed("inv-target", kind, split))
    target = _req(tb, 0)
    compositions = [
        ([], []),
        ([], [(200, 300), (1, 5000), (1000, 1000)]),
        (_others(_seed("inv-a", kind, split), 7, 64, 16000, hq, hkv, d, dt),
         _others(_seed("inv-b", kind, split), 12, 512, 4000, hq, hkv, d, dt)),
        ([(1024, 4096)], [(5, 12000)]),
    ]
    results = []
    for j, (before, after) in enumerate(compositions):
        def mk(reqs, tag):
            out = []
            for n, r in enumerate(reqs):
                if isinstance(r, tuple) and isinstance(r[0], int):
                    rb = _make_batch([r[0]], [r[1]], hq, hkv, d, dt, _seed("inv-fill", kind, split, j, tag, n))
                    r = _req(rb, 0)
                out.append(r)
            return out
        reqs = mk(before, "b") + [target] + mk(after, "a")
        pos = len(before)
        b = _batch_from(reqs, hq, hkv, d, dt)
        if kind == "paged":
            pg = _paginate(b, ps, "NHD", "5d", _seed("inv-pages", kind, split, j))
            kv_args = (pg.cache,)
        else:
            pg, kv_args = None, _ragged_kv(b, "NHD")
        w = _wrapper_for(kind, "NHD")
        _plan(w, kind, b, pg, True, **kw)
        if j == 0:
            if split == "disable_split_kv":
                assert w.workspace_size() == 0, "disable_split_kv=True must not split"
            else:
                assert w.workspace_size() > 0, "fixed_split_size=512 must split a 9000-token KV"
        o, lse = _run_into(w, b, kv_args)
        r0, r1 = int(b.qo_indptr[pos]), int(b.qo_indptr[pos + 1])
        results.append((o[r0:r1].clone(), lse[r0:r1].clone()))
        if j == 0:
            _check_batch(b, o, lse, True, {}, 1, f"invariance alone ({split})")
        del b, pg, kv_args, o, lse
    o0, lse0 = results[0]
    for j, (oj, lsej) in enumerate(results[1:], 1):
        assert torch.equal(oj, o0), f"{split}: output of the request differs in batch {j} from the request alone"
        assert torch.equal(lsej, lse0), f"{split}: lse of the request differs in batch {j} from the request alone"


# ---------------------------------------------------------------------------------------
# Reuse: one plan, many runs (layers); re-planning to other shapes
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_plan_once_run_per_layer_then_replan(kind, kv_load):
    w = _wrapper_for(kind, "NHD")
    for shape_id, (qo_max, kv_max, batch, causal) in enumerate([(200, 2000, 9, True), (50, 6000, 30, False),
                                                                  (1024, 1024, 2, True)]):
        qo, kv = _lens(_seed("layers", kind, shape_id), batch, qo_max, kv_max, "append")
        layers = []
        for layer in range(3):
            b = _make_batch(qo, kv, 16, 4, 128, F16, _seed("layers", kind, shape_id, layer))
            if kind == "paged":
                pg = _paginate(b, 16, "NHD", "5d", _seed("layers-pages", kind, shape_id))  # same table per layer
                layers.append((b, pg, (pg.cache,)))
            else:
                layers.append((b, None, _ragged_kv(b, "NHD")))
        b0, pg0, _ = layers[0]
        _plan(w, kind, b0, pg0, causal)
        for layer, (b, _pg, kv_args) in enumerate(layers):
            o, lse = _run_into(w, b, kv_args)
            _check_batch(b, o, lse, causal, {}, layer, f"shape {shape_id} layer {layer}", budget=1 << 22)


# ---------------------------------------------------------------------------------------
# Index arrays: device tensors, CPU tensors and numpy give the same plan (bitwise results)
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_device_and_host_index_arrays_agree(kind):
    qo, kv = _lens(_seed("idx", kind), 13, 300, 5000, "mixed")
    b = _make_batch(qo, kv, 32, 8, 128, BF16, _seed("idx-data", kind))
    if kind == "paged":
        pg = _paginate(b, 16, "HND", "5d", _seed("idx-pages"))
        arrays = [b.qo_indptr, pg.kv_indptr, pg.indices, pg.last]
        kv_args = (pg.cache,)
        tail = (b.hq, b.hkv, b.d, 16)
        w = _paged_wrapper("HND")
    else:
        arrays = [b.qo_indptr, b.kv_tok_indptr]
        kv_args = _ragged_kv(b, "NHD")
        tail = (b.hq, b.hkv, b.d)
        w = _ragged_wrapper("NHD")
    variants = {
        "numpy": arrays,
        "cuda": [torch.as_tensor(a, dtype=torch.int32, device=DEV) for a in arrays],
        "cpu": [torch.as_tensor(a, dtype=torch.int32) for a in arrays],
    }
    snaps = [a.clone() for a in variants["cuda"]]
    results = {}
    for name, arrs in variants.items():
        w.plan(*arrs, *tail, causal=True, q_data_type=BF16)
        results[name] = _run_into(w, b, kv_args)
    assert all(torch.equal(a, s) for a, s in zip(variants["cuda"], snaps)), "plan() modified an index tensor"
    for name in ("cuda", "cpu"):
        assert torch.equal(results[name][0], results["numpy"][0]), f"o differs: {name} vs numpy index arrays"
        assert torch.equal(results[name][1], results["numpy"][1]), f"lse differs: {name} vs numpy index arrays"
    _check_batch(b, *results["cuda"], True, {}, 3, "device index arrays")


# ---------------------------------------------------------------------------------------
# out= / lse= handling
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_out_and_lse_buffers_honoured(kind):
    b, pg, kv_args = _build(("outbuf", kind), kind, 6, 100, 700, "append", [], 16, 16, 4, 128, "fp16", "NHD",
                            "5d")
    w = _wrapper_for(kind, "NHD")
    _plan(w, kind, b, pg, True)
    out, lse = _poisoned(b)
    r = w.run(b.q, *kv_args, out=out)
    torch.cuda.synchronize()
    assert r is out
    _check_batch(b, out, None, True, {}, 0, "out= only")

    r_o, r_lse = w.run(b.q, *kv_args, lse=lse, return_lse=True)
    torch.cuda.synchronize()
    assert r_lse is lse
    _check_batch(b, r_o, lse, True, {}, 0, "lse= only")

    out.fill_(NAN)
    lse.fill_(NAN)
    r_o, r_lse = w.run_return_lse(b.q, *kv_args, out=out, lse=lse)
    torch.cuda.synchronize()
    assert r_o is out and r_lse is lse
    _check_batch(b, out, lse, True, {}, 0, "run_return_lse out= and lse=")

    _assert_guards(out, lse, "out=/lse=")

    # lse= without return_lse: FlashInfer returns o alone and fills the buffer; refusing the
    # combination is acceptable too, leaving it unwritten silently is not
    out.fill_(NAN)
    lse.fill_(NAN)
    try:
        r = w.run(b.q, *kv_args, out=out, lse=lse)
    except (ValueError, TypeError):
        return
    torch.cuda.synchronize()
    assert r is out
    _check_batch(b, out, lse, True, {}, 0, "lse= without return_lse")


# ---------------------------------------------------------------------------------------
# run() rejects inputs that do not match the plan, before launching anything
# ---------------------------------------------------------------------------------------
def _paged_bad_runs(b, pg):
    hq, hkv, d = b.hq, b.hkv, b.d
    T = b.q.shape[0]
    few = pg.store[: int(pg.indices.max())]  # one page too few for the highest planned index
    return [
        ("q_rows", (_randn((T + 1, hq, d), F16, 1), pg.cache), {}, r"(?i)\bq\b"),
        ("q_heads", (_randn((T, hq // 2, d), F16, 2), pg.cache), {}, r"(?i)\bq\b"),
        ("q_head_dim", (_randn((T, hq, 64), F16, 3), pg.cache), {}, r"(?i)\bq\b"),
        ("q_dtype", (b.q.to(BF16), pg.cache), {}, r"(?i)\bq\b|dtype"),
        ("q_fp32", (b.q.float(), pg.cache), {}, r"(?i)\bq\b|dtype"),
        ("q_cpu", (b.q.cpu(), pg.cache), {}, r"(?i)\bq\b|cuda|device"),
        ("too_few_pages", (b.q, few), {}, r"(?i)page"),
        ("too_few_pages_tuple", (b.q, (few[:, 0], few[:, 1])), {}, r"(?i)page"),
        ("page_size", (b.q, _randn((pg.num_pages, 2, 8, hkv, d), F16, 4)), {}, r"(?i)paged_kv_cache|shape"),
        ("cache_heads", (b.q, _randn((pg.num_pages, 2, 16, hkv * 2, d), F16, 5)), {}, r"(?i)paged_kv_cache|shape"),
        ("cache_dtype", (b.q, pg.store.to(BF16)), {}, r"(?i)dtype|paged_kv_cache"),
        ("cache_4d", (b.q, pg.store[:, 0]), {}, r"(?i)paged_kv_cache|shape"),
        ("tuple_len", (b.q, (pg.store[:, 0],)), {}, r"(?i)tuple|paged_kv_cache"),
        ("tuple_v_shape", (b.q, (pg.store[:, 0], pg.store[:-1, 1])), {}, r"(?i)v_cache|shape"),
        ("out_shape", (b.q, pg.cache), {"out": torch.empty((T, hq, d // 2), dtype=F16, device=DEV)}, r"(?i)\bout\b"),
        ("out_dtype", (b.q, pg.cache), {"out": torch.empty((T, hq, d), dtype=BF16, device=DEV)}, r"(?i)\bout\b"),
        ("lse_shape", (b.q, pg.cache), {"lse": torch.empty((hq, T), dtype=torch.float32, device=DEV),
                                        "return_lse": True}, r"(?i)\blse\b"),
        ("lse_dtype", (b.q, pg.cache), {"lse": torch.empty((T, hq), dtype=F16, device=DEV),
                                        "return_lse": True}, r"(?i)\blse\b"),
    ]


def test_paged_run_rejects_mismatched_inputs_before_launch():
    qo, kv = [40, 0, 77, 5], [300, 10, 1000, 0]
    b = _make_batch(qo, kv, 16, 4, 128, F16, _seed("badrun"))
    pg = _paginate(b, 16, "NHD", "5d", _seed("badrun-pages"), extra_pages=5)
    assert int(pg.indices.max()) >= 1
    w = _paged_wrapper("NHD")
    _plan_paged(w, b, pg, True)
    good_o, good_lse = _run_into(w, b, (pg.cache,))
    _check_batch(b, good_o, good_lse, True, {}, 0, "before bad runs")
    for name, args, kw, pattern in _paged_bad_runs(b, pg):
        out, lse = _poisoned(b)
        kw = dict(kw)
        kw.setdefault("out", out)
        if "lse" not in kw:
            kw["lse"], kw["return_lse"] = lse, True
        with pytest.raises((ValueError, TypeError), match=pattern):
            w.run(*args, **kw)
        torch.cuda.synchronize()
        # nothing was launched: the (valid) poisoned buffers are untouched
        assert torch.isnan(out).all() and torch.isnan(lse).all(), f"{name}: a kernel ran before the error"
        # and the wrapper keeps working with the same plan: the same bits as before
        o, l2 = _run_into(w, b, (pg.cache,))
        assert torch.equal(o, good_o) and torch.equal(l2, good_lse), f"after {name}"


def test_ragged_run_rejects_mismatched_inputs_before_launch():
    qo, kv = [40, 0, 77, 5], [300, 10, 1000, 0]
    b = _make_batch(qo, kv, 16, 4, 128, BF16, _seed("badrun-ragged"))
    w = _ragged_wrapper("NHD")
    _plan_ragged(w, b, False)
    good_o, good_lse = _run_into(w, b, (b.k, b.v))
    _check_batch(b, good_o, good_lse, False, {}, 0, "before bad runs")
    T, K = b.q.shape[0], b.k.shape[0]
    bad = [
        ("q_rows", (b.q[:-1], b.k, b.v), r"(?i)\bq\b"),
        ("q_dtype", (b.q.to(F16), b.k, b.v), r"(?i)\bq\b|dtype"),
        ("k_rows", (b.q, b.k[:-1], b.v), r"(?i)\bk\b"),
        ("v_rows", (b.q, b.k, torch.cat([b.v, b.v[:1]])), r"(?i)\bv\b"),
        ("k_heads", (b.q, _randn((K, 8, 128), BF16, 1), b.v), r"(?i)\bk\b"),
        ("k_dtype", (b.q, b.k.to(F16), b.v), r"(?i)\bk\b|dtype"),
        ("kv_layout", (b.q, b.k.transpose(0, 1), b.v.transpose(0, 1)), r"(?i)\bk\b"),
        ("k_cpu", (b.q, b.k.cpu(), b.v), r"(?i)\bk\b|cuda|device"),
    ]
    assert T > 0
    for name, args, pattern in bad:
        out, lse = _poisoned(b)
        with pytest.raises((ValueError, TypeError), match=pattern):
            w.run(*args, out=out, lse=lse, return_lse=True)
        torch.cuda.synchronize()
        assert torch.isnan(out).all() and torch.isnan(lse).all(), f"{name}: a kernel ran before the error"
        o, l2 = _run_into(w, b, (b.k, b.v))
        assert torch.equal(o, good_o) and torch.equal(l2, good_lse), f"after {name}"


def test_run_before_plan_raises():
    w = _paged_wrapper("NHD")
    q = _randn((4, 8, 128), F16, 0)
    with pytest.raises(RuntimeError, match="plan"):
        w.run(q, _randn((2, 2, 16, 8, 128), F16, 1))


# ---------------------------------------------------------------------------------------
# Float workspace: the exact size, the error naming it, nothing written outside the buffer
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_workspace_too_small_names_the_size(kind):
    qo, kv = [1, 4, 2, 16], [16384, 12000, 9000, 16000]
    b = _make_batch(qo, kv, 32, 8, 128, F16, _seed("ws", kind))
    if kind == "paged":
        pg = _paginate(b, 16, "NHD", "5d", _seed("ws-pages"))
        kv_args = (pg.cache,)
        mk = pyflashattn.BatchPrefillWithPagedKVCacheWrapper
    else:
        pg, kv_args = None, (b.k, b.v)
        mk = pyflashattn.BatchPrefillWithRaggedKVCacheWrapper

    big = mk(_workspace(), "NHD")
    _plan(big, kind, b, pg, True)
    need = big.workspace_size()
    assert need > 0, "this batch should be split (it needs a float workspace)"
    o_big, lse_big = _run_into(big, b, kv_args)

    tiny = mk(torch.empty(4096, dtype=torch.uint8, device=DEV), "NHD")
    with pytest.raises(ValueError) as e:
        _plan(tiny, kind, b, pg, True)
    msg = re.sub(r"(?<=\d)[,_](?=\d)", "", str(e.value))
    assert str(need) in msg, f"the error should name the needed size {need}: {e.value}"
    # the same wrapper keeps working: a plan that needs no workspace fits
    _plan(tiny, kind, b, pg, True, disable_split_kv=True)
    assert tiny.workspace_size() == 0
    o_ns, lse_ns = _run_into(tiny, b, kv_args)
    _check_batch(b, o_ns, lse_ns, True, {}, 0, "disable_split_kv with a tiny workspace")

    # exactly `need` bytes, at an offset inside a sentinel-filled buffer: enough, and nothing is
    # written outside it
    pad = 4096
    backing = torch.full((need + 2 * pad,), 0xA5, dtype=torch.uint8, device=DEV)
    exact = mk(backing[pad:pad + need], "NHD")
    _plan(exact, kind, b, pg, True)
    assert exact.workspace_size() == need
    o_ex, lse_ex = _run_into(exact, b, kv_args)
    assert torch.equal(o_ex, o_big) and torch.equal(lse_ex, lse_big), "same plan, another workspace: other bits"
    assert torch.all(backing[:pad] == 0xA5) and torch.all(backing[pad + need:] == 0xA5), \
        "the kernel wrote outside the float workspace it was given"
    _check_batch(b, o_ex, lse_ex, True, {}, 0, "exact workspace")

    # reset_workspace_buffer: too small for the current plan -> ValueError, and the wrapper keeps
    # its buffer (a new plan still fits and runs); big enough -> works
    with pytest.raises(ValueError):
        exact.reset_workspace_buffer(torch.empty(need // 2, dtype=torch.uint8, device=DEV),
                                     torch.empty(8 << 20, dtype=torch.uint8, device=DEV))
    _plan(exact, kind, b, pg, True)
    o_ex, lse_ex = _run_into(exact, b, kv_args)
    assert torch.equal(o_ex, o_big) and torch.equal(lse_ex, lse_big), "after a refused reset_workspace_buffer"
    exact.reset_workspace_buffer(torch.empty(need + 512, dtype=torch.uint8, device=DEV),
                                 torch.empty(8 << 20, dtype=torch.uint8, device=DEV))
    o_r, lse_r = _run_into(exact, b, kv_args)
    assert torch.equal(o_r, o_big) and torch.equal(lse_r, lse_big)


# ---------------------------------------------------------------------------------------
# CUDA graphs: capture run() once, re-plan with other lengths (within capacity), replay
# ---------------------------------------------------------------------------------------


def _graph_rounds():
    """(qo_lens, kv_lens, causal-compatible) per plan; the first fixes the capacity (8 requests,
    511 query tokens); later ones change batch size, lengths, pages and the split pattern."""
    return [
        ([70, 1, 129, 33, 0, 256, 5, 17], [700, 4000, 129, 2000, 50, 300, 9000, 17]),
        ([3, 200, 1, 100, 2], [12000, 250, 8000, 3000, 0]),  # fewer requests, longer KV
        ([111, 100, 100, 100, 100], [111, 150, 90, 100, 1]),  # causal kv < qo rows, short KV
        ([511], [600]),  # one request using the whole token capacity
        ([60, 61, 62, 63, 64, 65, 66, 70], [1, 2, 3, 4, 5, 6, 7, 8000]),  # full batch again
    ]


def _graph_rounds_decode32():
    """A paged decode graph whose first plan (8 tokens x group 4 = 32 rows) picks the 32-row
    decode tile, replanned with shorter, equal and longer requests (several 32-row tiles each)."""
    return [
        ([8, 5, 8, 1, 3, 8, 2, 8], [900, 4000, 129, 2000, 50, 300, 9000, 17]),
        ([1, 2, 3, 4, 1, 1, 1], [12000, 250, 8000, 3000, 7, 1, 600]),
        ([20, 12], [500, 2600]),  # 80 and 48 rows
        ([0, 1, 8, 27], [0, 5, 4000, 27]),
    ]


@pytest.mark.parametrize("decode32", [False, True])
def test_cuda_graph_paged_replay_after_replan(decode32, kv_load):
    hq, hkv, d, ps, dt, layout = 32, 8, 128, 16, F16, "HND"
    max_batch, max_pages, pool = 8, 2048, 2400
    causal = True
    store = _randn((pool, 2, hkv, ps, d), dt, _seed("graph-cache"), GARBAGE_SCALE)
    nhd_view = store.permute(0, 1, 3, 2, 4)
    bufs = dict(qo_indptr_buf=torch.empty(max_batch + 1, dtype=torch.int32, device=DEV),
                paged_kv_indptr_buf=torch.empty(max_batch + 1, dtype=torch.int32, device=DEV),
                paged_kv_indices_buf=torch.empty(max_pages, dtype=torch.int32, device=DEV),
                paged_kv_last_page_len_buf=torch.empty(max_batch, dtype=torch.int32, device=DEV))
    w = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(_workspace(), layout, use_cuda_graph=True, **bufs)
    rounds = _graph_rounds_decode32() if decode32 else _graph_rounds()
    T = sum(rounds[0][0])
    q_static = torch.empty((T, hq, d), dtype=dt, device=DEV)
    out = torch.full((T, hq, d), NAN, dtype=dt, device=DEV)
    lse = torch.full((T, hq), NAN, dtype=torch.float32, device=DEV)
    g = None
    for j, (qo, kv) in enumerate(rounds):
        b = _make_batch(qo, kv, hq, hkv, d, dt, _seed("graph-paged", j))
        rng = np.random.default_rng(_seed("graph-pages", j))
        kv_indptr, indices, last = _page_table(kv, ps, rng.permutation(pool))
        assert len(indices) <= max_pages
        _write_pages(nhd_view, b, ps, kv_indptr, indices)
        n = b.q.shape[0]
        q_static[:n].copy_(b.q)
        w.plan(b.qo_indptr, kv_indptr, indices, last, hq, hkv, d, ps, causal=causal, q_data_type=dt)
        assert w._engine.schedule.block_m == (32 if decode32 else 128), "the graph keeps its first plan's tile"
        _assert_kv_load(w, kv_load, True, ps)
        out.fill_(NAN)
        lse.fill_(NAN)
        if g is None:
            g = _capture(lambda: w.run(q_static, store, out=out, lse=lse, return_lse=True))
            out.fill_(NAN)
            lse.fill_(NAN)
        g.replay()
        torch.cuda.synchronize()
        _check_batch(b, out[:n], lse[:n], causal, {}, j, f"graph replay {j}", budget=1 << 23)
        # and the same as a fresh wrapper without graphs
        pg = SimpleNamespace(kv_indptr=kv_indptr, indices=indices, last=last, page_size=ps)
        fresh = _paged_wrapper(layout)
        _plan_paged(fresh, b, pg, causal)
        o_f, lse_f = fresh.run(b.q, store, return_lse=True)
        assert_close(out[:n], to_numpy_f64(o_f), what=f"replay {j} vs fresh o", **O_TOL[dt])
        assert_close(lse[:n], to_numpy_f64(lse_f), what=f"replay {j} vs fresh lse", **LSE_TOL[dt])


def _graph_rounds_decode():
    """A decode graph (16 / 4 heads: the first plan's requests fit the 16-row decode tile, which
    the graph then keeps), replanned with decode, speculative and prefill-sized requests."""
    return [
        ([4, 4, 4, 4, 4, 4, 4, 4], [900, 4000, 129, 2000, 50, 300, 9000, 17]),
        ([1, 2, 3, 4, 1, 1, 1], [12000, 250, 8000, 3000, 7, 1, 600]),
        ([20, 12], [500, 2600]),  # 80 and 48 rows: several 16-row tiles per request
        ([0, 1, 4, 27], [0, 5, 4000, 27]),
    ]


@pytest.mark.parametrize("decode", [False, True])
def test_cuda_graph_ragged_replay_after_replan(decode, kv_load):
    hq, hkv, d, dt = 16, 4, 128, BF16
    max_batch = 8
    causal = True
    w = pyflashattn.BatchPrefillWithRaggedKVCacheWrapper(
        _workspace(), "NHD", use_cuda_graph=True,
        qo_indptr_buf=torch.empty(max_batch + 1, dtype=torch.int32, device=DEV),
        kv_indptr_buf=torch.empty(max_batch + 1, dtype=torch.int32, device=DEV))
    rounds = _graph_rounds_decode() if decode else _graph_rounds()
    T = sum(rounds[0][0])
    K = max(sum(kv) for _, kv in rounds)
    # the first plan sets k/v's shape (run() checks it), so make its total KV the largest
    qo0, kv0 = rounds[0]
    kv0 = kv0[:-1] + [kv0[-1] + K - sum(kv0)]
    rounds[0] = (qo0, kv0)
    q_static = torch.empty((T, hq, d), dtype=dt, device=DEV)
    k_static = _randn((K, hkv, d), dt, _seed("graph-k"), GARBAGE_SCALE)
    v_static = _randn((K, hkv, d), dt, _seed("graph-v"), GARBAGE_SCALE)
    out = torch.full((T, hq, d), NAN, dtype=dt, device=DEV)
    lse = torch.full((T, hq), NAN, dtype=torch.float32, device=DEV)
    g = None
    for j, (qo, kv) in enumerate(rounds):
        b = _make_batch(qo, kv, hq, hkv, d, dt, _seed("graph-ragged", j))
        n, m = b.q.shape[0], b.k.shape[0]
        q_static[:n].copy_(b.q)
        k_static[:m].copy_(b.k)
        v_static[:m].copy_(b.v)
        _plan_ragged(w, b, causal)
        assert w._engine.attn.meta["decode"] is decode, "the graph keeps its first plan's tile"
        _assert_kv_load(w, kv_load, False, 0)
        out.fill_(NAN)
        lse.fill_(NAN)
        if g is None:
            g = _capture(lambda: w.run(q_static, k_static, v_static, out=out, lse=lse, return_lse=True))
            out.fill_(NAN)
            lse.fill_(NAN)
        g.replay()
        torch.cuda.synchronize()
        _check_batch(b, out[:n], lse[:n], causal, {}, j, f"ragged graph replay {j}", budget=1 << 23)
        fresh = _ragged_wrapper("NHD")
        _plan_ragged(fresh, b, causal)
        o_f, lse_f = fresh.run(b.q, b.k, b.v, return_lse=True)
        assert_close(out[:n], to_numpy_f64(o_f), what=f"replay {j} vs fresh o", **O_TOL[dt])
        assert_close(lse[:n], to_numpy_f64(lse_f), what=f"replay {j} vs fresh lse", **LSE_TOL[dt])


def _graph_paged_wrapper(max_batch, max_pages):
    return pyflashattn.BatchPrefillWithPagedKVCacheWrapper(
        _workspace(), "NHD", use_cuda_graph=True,
        qo_indptr_buf=torch.empty(max_batch + 1, dtype=torch.int32, device=DEV),
        paged_kv_indptr_buf=torch.empty(max_batch + 1, dtype=torch.int32, device=DEV),
        paged_kv_indices_buf=torch.empty(max_pages, dtype=torch.int32, device=DEV),
        paged_kv_last_page_len_buf=torch.empty(max_batch, dtype=torch.int32, device=DEV))


def _graph_plan_args(qo, kv, ps=16, seed=0):
    rng = np.random.default_rng(seed)
    kv_indptr, indices, last = _page_table(kv, ps, rng.permutation(4096))
    return (_indptr(qo), kv_indptr, indices, last, 8, 2, 128, ps)


def test_cuda_graph_capacity_errors_then_recover():
    w = _graph_paged_wrapper(max_batch=4, max_pages=32)
    # the first plan fixes the token capacity: 100
    w.plan(*_graph_plan_args([40, 30, 20, 10], [200, 100, 60, 40]), causal=True)  # 13+7+4+3 = 27 pages
    with pytest.raises(ValueError, match=r"(?i)batch|capacity"):  # 5 requests > 4
        w.plan(*_graph_plan_args([10, 10, 10, 10, 10], [16, 16, 16, 16, 16]), causal=True)
    with pytest.raises(ValueError, match=r"(?i)page|indices|capacity"):  # 33 pages > 32
        w.plan(*_graph_plan_args([1, 1, 1, 1], [16 * 9, 16 * 8, 16 * 8, 16 * 8]), causal=True)
    with pytest.raises(ValueError, match=r"(?i)token|capacity"):  # 101 query tokens > 100
        w.plan(*_graph_plan_args([41, 30, 20, 10], [200, 100, 60, 40]), causal=True)
    # within capacity, after the errors: plan and run, correct
    qo, kv = [50, 0, 50], [16 * 20, 7, 60]  # 100 tokens, 20 + 1 + 4 = 25 pages
    b = _make_batch(qo, kv, 8, 2, 128, F16, _seed("graph-recover"))
    pg = _paginate(b, 16, "NHD", "5d", _seed("graph-recover-pages"))
    assert len(pg.indices) <= 32
    _plan_paged(w, b, pg, True)
    o, lse = _run_into(w, b, (pg.cache,))
    _check_batch(b, o, lse, True, {}, 0, "graph wrapper after capacity errors")


def test_cuda_graph_failed_first_plan_fixes_no_capacity():
    # A plan() that raised must leave no trace: the capacity is fixed by the first plan that
    # succeeds, not by a rejected one with fewer tokens.
    w = _graph_paged_wrapper(max_batch=4, max_pages=32)
    with pytest.raises(ValueError, match=r"(?i)batch|capacity"):
        w.plan(*_graph_plan_args([1, 1, 1, 1, 1], [16, 16, 16, 16, 16]), causal=True)  # 5 tokens, 5 requests
    qo, kv = [50, 0, 50], [16 * 20, 7, 60]
    b = _make_batch(qo, kv, 8, 2, 128, F16, _seed("graph-first-fail"))
    pg = _paginate(b, 16, "NHD", "5d", _seed("graph-first-fail-pages"))
    _plan_paged(w, b, pg, True)
    o, lse = _run_into(w, b, (pg.cache,))
    _check_batch(b, o, lse, True, {}, 0, "graph wrapper after a failed first plan")


def test_cuda_graph_first_plan_with_more_pages_than_the_buffer_raises():
    w = _graph_paged_wrapper(max_batch=4, max_pages=32)
    with pytest.raises(ValueError, match=r"(?i)page|indices|capacity"):
        w.plan(*_graph_plan_args([1, 1, 1, 1], [16 * 9, 16 * 8, 16 * 8, 16 * 8]), causal=True)  # 33 pages


def test_cuda_graph_ragged_batch_capacity():
    w = pyflashattn.BatchPrefillWithRaggedKVCacheWrapper(
        _workspace(), "NHD", use_cuda_graph=True,
        qo_indptr_buf=torch.empty(3, dtype=torch.int32, device=DEV),
        kv_indptr_buf=torch.empty(3, dtype=torch.int32, device=DEV))
    w.plan(_indptr([5, 5]), _indptr([5, 5]), 8, 2, 128, causal=True)
    with pytest.raises(ValueError, match=r"(?i)batch|capacity"):
        w.plan(_indptr([1, 1, 1]), _indptr([5, 5, 5]), 8, 2, 128, causal=True)
    with pytest.raises(ValueError, match=r"(?i)token|capacity"):
        w.plan(_indptr([5, 6]), _indptr([5, 6]), 8, 2, 128, causal=True)
    b = _make_batch([4, 6], [9, 6], 8, 2, 128, F16, _seed("graph-ragged-cap"))
    _plan_ragged(w, b, True)
    o, lse = _run_into(w, b, (b.k, b.v))
    _check_batch(b, o, lse, True, {}, 0, "ragged graph wrapper after capacity errors")


@pytest.mark.parametrize("kind", ["ragged", "paged"])
@pytest.mark.parametrize("d", [128, 256])
def test_l2_sections_and_their_tail_cover_every_block(monkeypatch, kind, d, kv_load):
    """L2 sections forced to one kv head each (routing.l2_section) with the tail after them
    (routing.section_head_z): a batch of several waves, so both parts of LogicalGrid's order run,
    on the tile scheduler (hd128, persistent) and in the hardware's launch order (hd256)."""
    from pyflashattn._engine import routing
    monkeypatch.setenv(routing.L2_SECTION_ENV, "1e-9")
    seed = _seed("sections", kind, d)
    rng = np.random.default_rng(seed)
    lens = [int(x) for x in rng.integers(600, 2100, size=6)]
    b = _make_batch(lens, lens, 16, 4, d, BF16, seed)
    w = _ragged_wrapper() if kind == "ragged" else _paged_wrapper()
    if kind == "ragged":
        _plan_ragged(w, b, True)
        kv_args = _ragged_kv(b, "NHD")
    else:
        pg = _paginate(b, 16, "NHD", "5d", seed)
        _plan_paged(w, b, pg, True)
        kv_args = (pg.cache,)
    p = w._engine.attn.params
    if w._engine.attn.meta.get("impl") != "sm90":
        pytest.skip("L2 sections are an sm90 launch's order")
    assert p.grid_section == 1 and 0 < p.grid_section_z < p.grid_z, (p.grid_z, p.grid_section_z)
    o, lse = _run_into(w, b, kv_args)
    _check_batch(b, o, lse, True, {}, seed, f"sections {kind} hd{d}")
