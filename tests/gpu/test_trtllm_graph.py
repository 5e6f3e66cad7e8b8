"""The TRT-LLM entry points over device metadata on a CUDA GPU: CUDA-graph capture (torch and
CuPy) with replays at new lengths, separate K / V page ids, and bad device metadata (clamped:
no read outside the tensors; the checked mode's ValueErrors).

A graph is captured after one warm-up call with the same shapes; each replay writes fresh
random lengths (within max_q_len / max_kv_len), inputs and page tables into the captured
buffers, poisons the output (NaN) and compares the rows the lengths cover with the float64
reference (checks.assert_close: NaN never passes).

    python -m pytest -q tests/gpu/test_trtllm_graph.py
"""
from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import pytest

from pyflashattn.testing.gpu import (cuda_generator, cuda_randn, require_cuda_torch, require_cupy, scratch_workspace,
                                     select_kv_load)

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()

import pyflashattn  # noqa: E402
from pyflashattn._engine import metadata_check, trtllm as _trtllm  # noqa: E402
from pyflashattn.testing.checks import assert_close  # noqa: E402
from pyflashattn.testing.frameworks import capture_torch_graph  # noqa: E402
from pyflashattn.testing.reference import attention_ref  # noqa: E402

DEV = "cuda"
BF16, F16 = torch.bfloat16, torch.float16
TOL = {BF16: dict(atol=1e-2, rtol=1e-2), F16: dict(atol=1e-3, rtol=1e-3)}
fmha = pyflashattn.prefill.trtllm_fmha_v2_prefill
context = pyflashattn.prefill.trtllm_batch_context_with_kv_cache
B, HQ, HKV, D, PS = 3, 8, 2, 128, 32
MAX_Q, MAX_KV = 150, 400
Q_CAP, KV_CAP = B * MAX_Q, B * MAX_KV  # tokens the captured buffers hold
PAGES = 2 * B * -(-MAX_KV // PS) + 5  # twice what any batch needs: K and V pages drawn apart
SCALE1, SCALE2 = 0.11, 0.8


def i32(a):
    return torch.tensor(np.asarray(a, np.int64), dtype=torch.int32, device=DEV)


def cum(lens):
    return np.concatenate([[0], np.cumsum(lens)])


class Batch:
    """Random lengths (queries <= keys per request, at most MAX_Q / MAX_KV), q / k / v rows and,
    paged, independent random K and V page ids into a cache of PAGES pages."""

    def __init__(self, seed, separate, dtype=BF16):
        rng = np.random.default_rng(seed)
        self.dtype = dtype
        self.kl = rng.integers(1, MAX_KV + 1, B)
        self.kl[rng.integers(B)] = MAX_KV
        self.ql = np.minimum(rng.integers(1, MAX_Q + 1, B), self.kl)
        g = cuda_generator("trtllm_graph", seed)
        self.q = cuda_randn((int(self.ql.sum()), HQ, D), g, dtype)
        self.k = cuda_randn((int(self.kl.sum()), HKV, D), g, dtype)
        self.v = cuda_randn((int(self.kl.sum()), HKV, D), g, dtype)
        need = -(-self.kl // PS)
        width = -(-MAX_KV // PS)
        perm = rng.permutation(PAGES)
        self.k_ids = np.full((B, width), PAGES - 1, np.int64)
        self.v_ids = self.k_ids.copy()
        used = 0
        for b in range(B):
            self.k_ids[b, :need[b]] = perm[used:used + need[b]]
            used += need[b]
        if separate:
            perm = rng.permutation(PAGES)
            used = 0
            for b in range(B):
                self.v_ids[b, :need[b]] = perm[used:used + need[b]]
                used += need[b]
        else:
            self.v_ids = self.k_ids

    def fill_cache(self, k_pages, v_pages, layout, k_base=0, v_base=0):
        """Write k / v into [P, page_size, Hkv, D] (NHD) / [P, Hkv, page_size, D] (HND) page
        tensors at this batch's ids (minus the bases: the ids' origin in each tensor)."""
        c = cum(self.kl)
        for b in range(B):
            for j in range(-(-int(self.kl[b]) // PS)):
                lo, hi = c[b] + j * PS, min(c[b] + (j + 1) * PS, c[b + 1])
                for pages, ids, base, src in ((k_pages, self.k_ids, k_base, self.k), (v_pages, self.v_ids, v_base,
                                                                                       self.v)):
                    page = pages[int(ids[b, j]) - base]
                    if layout == "NHD":
                        page[:hi - lo] = src[lo:hi]
                    else:
                        page[:, :hi - lo] = src[lo:hi].transpose(0, 1)

    def check(self, out, what):
        cq, ck = cum(self.ql), cum(self.kl)
        ref = [attention_ref(self.q[cq[b]:cq[b + 1]], self.k[ck[b]:ck[b + 1]], self.v[ck[b]:ck[b + 1]], causal=True,
                             sm_scale=SCALE1)[0] * SCALE2 for b in range(B)]
        assert_close(out[:cq[-1]], np.concatenate(ref), **TOL[self.dtype], what=what)


class Static:
    """The buffers a captured call reads: q / k / v rows, lengths, block tables, the cache."""

    def __init__(self, layout, dtype=BF16):
        self.q = torch.zeros(Q_CAP, HQ, D, dtype=dtype, device=DEV)
        self.k = torch.zeros(KV_CAP, HKV, D, dtype=dtype, device=DEV)
        self.v = torch.zeros(KV_CAP, HKV, D, dtype=dtype, device=DEV)
        self.out = torch.full((Q_CAP, HQ, D), float("nan"), dtype=dtype, device=DEV)
        self.cq, self.ck, self.sl = i32(np.zeros(B + 1)), i32(np.zeros(B + 1)), i32(np.zeros(B))
        width = -(-MAX_KV // PS)
        self.table2 = i32(np.zeros((B, width)))
        self.table3 = i32(np.zeros((B, 2, width)))
        shape = (PAGES, PS, HKV, D) if layout == "NHD" else (PAGES, HKV, PS, D)
        self.cache = torch.randn((PAGES, 2) + shape[1:], device=DEV).to(dtype)  # random pages nobody reads
        self.alloc = torch.randn((2 * PAGES,) + shape[1:], device=DEV).to(dtype)  # one allocation: K, then V

    def load(self, b: Batch, form, layout):
        """Write batch b into the buffers (lengths, rows, pages) the captured call reads."""
        nq, nk = int(b.ql.sum()), int(b.kl.sum())
        self.q[:nq].copy_(b.q)
        self.k[:nk].copy_(b.k)
        self.v[:nk].copy_(b.v)
        self.cq.copy_(i32(cum(b.ql)))
        self.ck.copy_(i32(cum(b.kl)))
        self.sl.copy_(i32(b.kl))
        self.table2.copy_(i32(b.k_ids))
        if form == "fmha_tuple":  # offsets from K's base: V's ids count from K's first page
            self.table3.copy_(i32(np.stack([b.k_ids, b.v_ids + PAGES], 1)))
            b.fill_cache(self.alloc[:PAGES], self.alloc[PAGES:], layout, 0, 0)
        else:
            self.table3.copy_(i32(np.stack([b.k_ids, b.v_ids], 1)))
            b.fill_cache(self.cache[:, 0], self.cache[:, 1], layout)
        self.out.fill_(float("nan"))


FORMS = ["separate_q_k_v", "contiguous", "fmha_paged", "fmha_tuple", "context", "context_separate"]


def call_for(st: Static, form, layout, host=False):
    """The captured call of each form (out given, device metadata; host: the metadata copied to
    numpy arrays at each call instead, the host path)."""
    ws = scratch_workspace()
    if host:
        return lambda: call_for(HostMeta(st), form, layout)()
    common = dict(workspace_buffer=ws, seq_lens=st.sl, max_q_len=MAX_Q, max_kv_len=MAX_KV, bmm1_scale=SCALE1,
                  bmm2_scale=SCALE2, batch_size=B, cum_seq_lens_q=st.cq, cum_seq_lens_kv=st.ck, out=st.out)
    if form == "separate_q_k_v":
        return lambda: fmha((st.q, st.k, st.v), "SEPARATE_Q_K_V", **common)
    if form == "contiguous":
        kv = torch.stack([st.k, st.v], 1)  # a copy: refreshed before each replay by load_kv
        st.kv = kv
        return lambda: fmha((st.q, kv), "CONTIGUOUS_Q_KV", **common)
    if form == "fmha_paged":
        return lambda: fmha((st.q, st.cache), f"Q_PAGED_KV_{layout}", block_tables=st.table2, **common)
    if form == "fmha_tuple":
        pair = (st.alloc[:PAGES], st.alloc[PAGES:])
        return lambda: fmha((st.q, pair), f"Q_PAGED_KV_{layout}", block_tables=st.table3, **common)
    separate = form == "context_separate"
    return lambda: context(st.q, st.cache, ws, st.table3 if separate else st.table2, st.sl, MAX_Q, MAX_KV, SCALE1,
                           SCALE2, B, st.cq, st.ck, out=st.out, kv_layout=layout,
                           uses_shared_paged_kv_idx=not separate)


class HostMeta:
    """st with its metadata (lengths, block tables) as numpy copies: the host-metadata path, whose
    exact plan takes q / out of exactly the batch's tokens (views of st's)."""

    def __init__(self, st: Static):
        self.__dict__.update(st.__dict__)
        for name in ("sl", "cq", "ck", "table2", "table3"):
            setattr(self, name, getattr(st, name).cpu().numpy())
        n = int(self.cq[-1])
        self.q, self.out = st.q[:n], st.out[:n]


@pytest.mark.parametrize("kv_load", ["default", "tma"])
@pytest.mark.parametrize("form", ["fmha_tuple", "context_separate"])
def test_separate_ids_host_metadata(form, kv_load, monkeypatch):
    """Separate K / V page ids from host metadata on both sm90 K/V loads: the tuple form's V ids
    count from K's base past K's pages, which V's tensor map must span."""
    select_kv_load(kv_load, monkeypatch)
    monkeypatch.setattr(_trtllm, "_ENGINES", OrderedDict())
    st = Static("HND")
    fn = call_for(st, form, "HND", host=True)
    for seed in (21, 22):
        b = Batch(seed, True)
        _load(st, b, form, "HND")
        fn()
        torch.cuda.synchronize()
        b.check(st.out, f"{form} host {kv_load} {seed}")


def _load(st, b, form, layout):
    st.load(b, form, layout)
    if form == "contiguous":
        st.kv.copy_(torch.stack([st.k, st.v], 1))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("form", FORMS)
def test_torch_graph_replays_new_lengths(form, layout):
    if layout == "NHD" and form in ("separate_q_k_v", "contiguous"):
        pytest.skip("ragged layouts have no kv_layout")
    st = Static(layout)
    separate = form in ("fmha_tuple", "context_separate")
    fn = call_for(st, form, layout)
    warm = Batch(1, separate)
    _load(st, warm, form, layout)
    fn()  # the plan of this shape key, outside the capture
    torch.cuda.synchronize()
    warm.check(st.out, f"{form} {layout} eager")
    _load(st, Batch(2, separate), form, layout)
    graph = capture_torch_graph(fn)
    for seed in (3, 4, 5):
        b = Batch(seed, separate)
        _load(st, b, form, layout)
        graph.replay()
        torch.cuda.synchronize()
        b.check(st.out, f"{form} {layout} replay {seed}")


def test_cupy_graph_replays_new_lengths():
    """The context API captured in a CuPy stream capture (CuPy arrays throughout; fp16, which
    every CuPy holds)."""
    cupy = require_cupy()
    st = Static("HND", F16)
    s = cupy.cuda.Stream(non_blocking=True)
    to_cp = lambda t: cupy.from_dlpack(t)  # noqa: E731 (torch -> CuPy, same memory)
    q, cache, table, sl, cq, ck = (to_cp(t) for t in (st.q, st.cache, st.table3, st.sl, st.cq, st.ck))
    out = cupy.from_dlpack(st.out)
    ws = cupy.from_dlpack(scratch_workspace())

    def fn():
        context(q, cache, ws, table, sl, MAX_Q, MAX_KV, SCALE1, SCALE2, B, cq, ck, out=out, kv_layout="HND",
                uses_shared_paged_kv_idx=False)
    st.load(Batch(11, True, F16), "context_separate", "HND")
    torch.cuda.synchronize()
    with s:
        fn()
        s.synchronize()
        if not hasattr(s, "begin_capture"):
            pytest.skip("this CuPy has no stream capture")
        s.begin_capture()
        fn()
        graph = s.end_capture()
    for seed in (12, 13):
        b = Batch(seed, True, F16)
        st.load(b, "context_separate", "HND")
        torch.cuda.synchronize()
        graph.launch(stream=s)
        s.synchronize()
        b.check(st.out, f"cupy graph replay {seed}")


@pytest.mark.parametrize("ps", [16, 32, 64, 128])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_context_separate_ids_geometry(ps, d):
    """Independent random K and V page ids, every page size and head dim (sm90: the producer's
    second id buffer; sm80: the halved staged-id space)."""
    rng = np.random.default_rng(ps + d)
    ql, kl = [33, 200, 1], [700, 200, 129]
    g = cuda_generator("separate", ps, d)
    q = cuda_randn((sum(ql), 8, d), g, BF16)
    k, v = cuda_randn((sum(kl), 2, d), g, BF16), cuda_randn((sum(kl), 2, d), g, BF16)
    need = [-(-n // ps) for n in kl]
    P = 2 * sum(need) + 3
    cache = torch.randn(P, 2, 2, ps, d, device=DEV).to(BF16)  # HND
    width = max(need)
    ids = np.full((3, 2, width), P - 1, np.int64)
    ck = cum(kl)
    for kv in (0, 1):
        perm = rng.permutation(P)
        used = 0
        for b in range(3):
            ids[b, kv, :need[b]] = perm[used:used + need[b]]
            used += need[b]
            for j in range(need[b]):
                lo, hi = ck[b] + j * ps, min(ck[b] + (j + 1) * ps, ck[b + 1])
                cache[int(ids[b, kv, j]), kv, :, :hi - lo] = (k if kv == 0 else v)[lo:hi].transpose(0, 1)
    out = torch.full(q.shape, float("nan"), dtype=BF16, device=DEV)
    context(q, cache, scratch_workspace(), i32(ids), i32(kl), max(ql), max(kl), 1 / math.sqrt(d), 1.0, 3, i32(cum(ql)),
            i32(ck), out=out, uses_shared_paged_kv_idx=False)
    cq = cum(ql)
    ref = [attention_ref(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], causal=True)[0] for b in range(3)]
    assert_close(out, np.concatenate(ref), **TOL[BF16], what=f"separate ids ps{ps} d{d}")


def test_bad_device_metadata_stays_inside_the_tensors(monkeypatch):
    """Lengths past max_q_len / the tensors' tokens and page ids outside the cache: the kernel
    clamps (a finite answer, no fault: the next sync would report one); the checked mode refuses
    them by name."""
    st = Static("HND")
    b = Batch(21, True)
    st.load(b, "context_separate", "HND")
    st.cq.copy_(i32([0, 2 * Q_CAP, -5, 10**9]))
    st.sl.copy_(i32([10**6, -1, 7]))
    st.table3.copy_(i32(np.where(np.arange(st.table3.numel()).reshape(st.table3.shape) % 3 == 0, 10**6,
                                 -7)))
    fn = call_for(st, "context_separate", "HND")
    fn()
    torch.cuda.synchronize()  # a read outside the cache would fault here
    st.ck.copy_(i32([0, 10**9, 5, 3]))
    call_for(st, "separate_q_k_v", "HND")()
    torch.cuda.synchronize()
    monkeypatch.setenv(metadata_check.ENV, "1")
    with pytest.raises(ValueError, match="cum_seq_lens_q|seq_lens"):
        fn()
    st.load(b, "context_separate", "HND")
    st.table3[0, 1, 0] = PAGES
    with pytest.raises(ValueError, match="block_tables"):
        fn()
