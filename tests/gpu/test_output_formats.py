"""Outputs in another dtype than q's on a CUDA GPU (torch inputs) against the float64 reference:
float8_e4m3fn (XQA's out=, the decode and prefill wrappers' o_data_type) and the other 16-bit
type, written by the attention kernel's epilogue (unsplit rows) and by the split-KV merge.

e4m3 outputs are compared after dequantising (out * o_scale) with a tolerance fitting three
mantissa bits (rtol 0.07: half an ulp is at most 6.25%; atol half a subnormal step, 2^-10 *
o_scale) on top of the 16-bit kernels' own error (COMPUTE_ATOL * v_scale).
XQA: bmm2_scale = v_scale / o_scale, so out * o_scale ~ attention * v_scale (FlashInfer's
convention); the decode wrapper has no o_scale: v_scale = 1 / o_scale plays its part. Outputs
are poisoned (NaN) before every launch, inputs are fresh seeded random tensors, and every case
says whether it ran split KV (the merge wrote the rows) or not (the epilogue did).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from pyflashattn.testing.gpu import require_cuda_torch

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()

import pyflashattn  # noqa: E402
from pyflashattn import decode  # noqa: E402
from pyflashattn._engine import xqa as _xqa  # noqa: E402
from pyflashattn.testing import attention_ref, to_numpy_f64  # noqa: E402
from pyflashattn.testing.checks import assert_close  # noqa: E402
from pyflashattn.testing.gpu import scratch_workspace as _ws, cuda_generator as _gen, cuda_randn as _randn  # noqa: E402

DEV = "cuda"
F16, BF16, E4M3 = torch.float16, torch.bfloat16, torch.float8_e4m3fn
E4M3_MAX = 448.0
TOL_16 = {F16: dict(atol=2e-3, rtol=2e-3), BF16: dict(atol=1.5e-2, rtol=1.5e-2)}
COMPUTE_ATOL = {F16: 2e-3, BF16: 1e-2}  # the 16-bit kernels' error against float64 (by q's dtype)


def _poisoned(shape, dtype):
    return torch.full(shape, float("nan"), device=DEV).to(dtype)  # e4m3 NaN is 0x7f


class Cache:
    """A batch's K/V in a paged NHD cache [P, 2, ps, Hkv, D] at shuffled page ids among garbage
    pages; k[b] / v[b] hold what the cache holds for request b (float64)."""

    def __init__(self, kv_lens, hkv, d, ps, dtype, g):
        pages = [-(-n // ps) for n in kv_lens]
        total = sum(pages) + 2
        perm = torch.randperm(total, generator=torch.Generator().manual_seed(total)).tolist()
        cache = _randn((total, 2, ps, hkv, d), g, torch.float32, 4.0)
        self.table = torch.zeros(len(kv_lens), max(max(pages), 1), dtype=torch.int32)
        self.indptr, self.indices, self.k, self.v = [0], [], [], []
        for b, n in enumerate(kv_lens):
            ids, perm = perm[:pages[b]], perm[pages[b]:]
            self.table[b, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
            self.indices += ids
            self.indptr.append(len(self.indices))
            kb, vb = _randn((n, hkv, d), g, torch.float32), _randn((n, hkv, d), g, torch.float32)
            for j, pid in enumerate(ids):
                t0, t1 = j * ps, min(n, (j + 1) * ps)
                cache[pid, 0, :t1 - t0], cache[pid, 1, :t1 - t0] = kb[t0:t1], vb[t0:t1]
            self.k.append(kb.to(dtype).double())
            self.v.append(vb.to(dtype).double())
        self.last = [n - (p - 1) * ps if p else 0 for n, p in zip(kv_lens, pages)]
        self.cache, self.kv_lens, self.ps = cache.to(dtype), list(kv_lens), ps

    def paged_args(self):
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
        return i32(self.indptr), i32(self.indices), i32(self.last)

    def ref(self, q, q_len=1, sm_scale=None, v_scale=1.0, masks=None, **opts):
        """float64 o of every request (q_len query rows each), concatenated."""
        return np.concatenate([attention_ref(q[b * q_len:(b + 1) * q_len], self.k[b], self.v[b] * v_scale,
                                             sm_scale=sm_scale, custom_mask=None if masks is None else masks[b],
                                             **opts)[0] for b in range(len(self.kv_lens))])


def _check_e4m3(out, ref, o_scale, v_scale, qdt, what):
    """out (e4m3) * o_scale against ref (attention * v_scale, computed from q of dtype qdt); where
    ref / o_scale is beyond e4m3's range, out must be exactly +-448 (saturated, never NaN)."""
    assert out.dtype == E4M3
    got = to_numpy_f64(out)
    scaled = ref / o_scale
    sat = np.abs(scaled) > E4M3_MAX * 1.07  # clearly out of range (not a rounding case at the edge)
    assert not np.isnan(got).any(), f"{what}: NaN in the output (unwritten, or not saturated)"
    np.testing.assert_array_equal(got[sat], np.sign(scaled[sat]) * E4M3_MAX, err_msg=f"{what}: saturation")
    keep = ~sat
    assert_close(got[keep] * o_scale, ref[keep], atol=2.0**-10 * o_scale + COMPUTE_ATOL[qdt] * v_scale, rtol=0.07,
                 what=what)


def _last_xqa_engine():
    return next(reversed(_xqa._ENGINES.values()))


XQA_CASES = [
    # name, kv_lens, hq, hkv, d, ps, q dtype, cache dtype, q_len, o_scale, split expected
    # (XQA plans every request at max_seq_len: few long requests split, many short ones do not)
    ("long-split-fp8kv", [3000], 32, 8, 128, 16, BF16, E4M3, 1, 0.05, True),
    ("many-short-unsplit", [max(1, 50 - (7 * i) % 50) for i in range(160)], 32, 8, 128, 16, BF16, E4M3, 1, 0.5,
     False),
    ("f16-kv-oscale4", [700, 33, 1], 16, 2, 64, 32, F16, F16, 1, 4.0, True),
    ("d256-split", [2500, 90], 16, 4, 256, 64, BF16, BF16, 1, 0.25, True),
    ("spec4-mask-general", [300, 45], 16, 4, 128, 16, BF16, E4M3, 4, 0.1, True),
]


@pytest.mark.parametrize("case", XQA_CASES, ids=[c[0] for c in XQA_CASES])
def test_xqa_fp8_output(case):
    name, kv_lens, hq, hkv, d, ps, qdt, kvdt, q_len, o_scale, split = case
    g = _gen("xqa-e4m3", name)
    c = Cache(kv_lens, hkv, d, ps, kvdt, g)
    B = len(kv_lens)
    q = _randn((B * q_len, hq, d), g, qdt)
    masks = mask = None
    if q_len > 1:  # XQA's bit mask (the general kernels): draft i sees drafts j <= i and every earlier key
        words = np.zeros((B, q_len, 2), np.uint16)
        words[:, :, 0] = [(1 << (i + 1)) - 1 for i in range(q_len)]
        mask = torch.from_numpy(words).to(DEV)
        masks = [np.concatenate([np.ones((q_len, n - q_len), bool), np.tril(np.ones((q_len, q_len), bool))], 1)
                 for n in kv_lens]
    seq = torch.tensor(kv_lens, dtype=torch.int32, device=DEV)
    v_scale, bmm1 = 1.3, 0.8 / math.sqrt(d)
    out = _poisoned((B * q_len, hq, d), E4M3)
    res = decode.xqa_batch_decode_with_kv_cache(q, c.cache, _ws(), c.table.to(DEV), seq, max(kv_lens),
                                                bmm1_scale=bmm1, bmm2_scale=v_scale / o_scale, out=out,
                                                q_len_per_req=q_len, o_scale=o_scale, mask=mask)
    assert res is out
    assert (_last_xqa_engine().merge is not None) == split, "the case did not run the path it is for"
    ref = c.ref(q, q_len, sm_scale=bmm1, v_scale=v_scale, masks=masks)
    _check_e4m3(out, ref, o_scale, v_scale, qdt, f"xqa {name}")
    out2 = decode.xqa_batch_decode_with_kv_cache(q, c.cache, _ws(), c.table.to(DEV), seq, max(kv_lens),  # fast path
                                                 bmm1_scale=bmm1, bmm2_scale=v_scale / o_scale,
                                                 out=_poisoned(out.shape, E4M3), q_len_per_req=q_len,
                                                 o_scale=o_scale, mask=mask)
    torch.testing.assert_close(out2.view(torch.uint8), out.view(torch.uint8), atol=0, rtol=0)


def test_xqa_fp8_output_saturates():
    g = _gen("xqa-sat")
    c = Cache([900, 5], 4, 128, 16, BF16, g)
    q = _randn((2, 16, 128), g, BF16)
    seq = torch.tensor(c.kv_lens, dtype=torch.int32, device=DEV)
    o_scale = 1.0 / 1024  # |o| ~ 0.05..2 -> |o / o_scale| well past 448 for many elements
    out = _poisoned((2, 16, 128), E4M3)
    decode.xqa_batch_decode_with_kv_cache(q, c.cache, _ws(), c.table.to(DEV), seq, 900, bmm1_scale=0.2,
                                          bmm2_scale=1.0 / o_scale, out=out, o_scale=o_scale)
    ref = c.ref(q, sm_scale=0.2)
    assert (np.abs(ref / o_scale) > E4M3_MAX * 1.07).mean() > 0.1  # the case saturates a good share
    _check_e4m3(out, ref, o_scale, 1.0, BF16, "xqa saturated")


DECODE_CASES = [
    # name, kv_lens, hq, hkv, d, q dtype, o dtype, split (fixed_split_size) or unsplit (disable_split_kv)
    ("e4m3-unsplit", [200, 37, 1, 510], 32, 8, 128, BF16, E4M3, False),
    ("e4m3-split", [4000, 300], 32, 8, 128, BF16, E4M3, True),
    ("e4m3-d64-split-f16", [1500, 9], 8, 1, 64, F16, E4M3, True),
    ("bf16-out-of-f16-unsplit", [90, 333], 16, 4, 128, F16, BF16, False),
    ("f16-out-of-bf16-split", [2100, 17], 16, 4, 256, BF16, F16, True),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode_wrapper_output_dtype(case):
    name, kv_lens, hq, hkv, d, qdt, odt, split = case
    g = _gen("dec-out", name)
    c = Cache(kv_lens, hkv, d, 16, qdt, g)
    q = _randn((len(kv_lens), hq, d), g, qdt)
    w = decode.BatchDecodeWithPagedKVCacheWrapper(_ws(), "NHD")
    w.plan(*c.paged_args(), hq, hkv, d, 16, q_data_type=qdt, o_data_type=odt,
           **(dict(fixed_split_size=256) if split else dict(disable_split_kv=True)))
    assert (w._engine.merge is not None) == split
    o_scale = 0.125 if odt is E4M3 else 1.0
    out = _poisoned(q.shape, odt)
    assert w.run(q, c.cache, out=out, v_scale=1.0 / o_scale) is out
    ref = c.ref(q)
    for o in (out, w.run(q, c.cache, v_scale=1.0 / o_scale), w.run(q, c.cache, v_scale=1.0 / o_scale)):
        assert o.dtype == odt and o.shape == q.shape  # allocated outputs (full path, then the fast path)
        if odt is E4M3:
            _check_e4m3(o, ref, o_scale, 1.0, qdt, f"decode {name}")  # ref: attention itself (v_scale 1 / o_scale)
        else:  # the output's rounding and the inputs' precision: the looser of the two 16-bit tolerances
            assert_close(to_numpy_f64(o), ref, what=f"decode {name}", **TOL_16[BF16 if BF16 in (qdt, odt) else F16])


@pytest.mark.parametrize("opts", [{}, dict(logits_soft_cap=15.0)], ids=["lean", "general"])
@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split"])
def test_prefill_wrapper_fp8_output(opts, split):
    g = _gen("prefill-e4m3", split, tuple(opts))
    qo, kv_lens = [70, 1, 200], [700, 40, 1200]
    c = Cache(kv_lens, 4, 128, 16, F16, g)
    q = _randn((sum(qo), 16, 128), g, F16)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
    w = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(_ws(), "NHD")
    w.plan(i32(np.concatenate([[0], np.cumsum(qo)])), *c.paged_args(), 16, 4, 128, 16, causal=True,
           q_data_type=F16, o_data_type=E4M3, **opts,
           **(dict(fixed_split_size=128) if split else dict(disable_split_kv=True)))
    assert (w._engine.merge is not None) == split
    out = _poisoned(q.shape, E4M3)
    w.run(q, c.cache, out=out, v_scale=2.0)  # v_scale = 1 / o_scale with o_scale 0.5
    r0, refs = 0, []
    for b, n in enumerate(qo):
        refs.append(attention_ref(q[r0:r0 + n], c.k[b], c.v[b], causal=True, **opts)[0])
        r0 += n
    _check_e4m3(out, np.concatenate(refs), 0.5, 1.0, F16, f"prefill e4m3 {'split' if split else 'unsplit'} {opts}")
