"""A representative subset of the library's kernels, small shapes, for compute-sanitizer:

    compute-sanitizer --tool memcheck|racecheck|synccheck python build_tools/sanitize_subset.py

One call each: sm90 single prefill (TMA K/V, causal, partial tiles: the tail copied; and with more
row tiles than SMs, so persistent CTAs walk several blocks), sm90 paged
batch by the cp.async producer's owned-row copies (pages 16, 64 and 8, shuffled, NHD and HND, hd128
and hd64: interleaved rows, warp spans, the dense and span twins; with PFA_SM90_KV_LOAD=tma
and a `make TUNE=1` build, page 16 by TMA boxes), sm90 ragged batch with split KV and its merge (TMA,
a tail box with V's rows zeroed), a bf16 query over fp8 caches (paged and ragged: the sm90 rows
that widen raw one-byte tiles), sm90 fp8 prefill, single and over a paged fp8 cache (by
copies, and at page 32 by the TMA twin in a TUNE build; walking several blocks, single and ragged), the sm80
decode tile through XQA (bf16, fp8 and NVFP4 caches: the last two register-widened), a TRT-LLM
context call over device metadata. Every output is checked for NaN; the sanitizer's report is the
point.
"""
import os

import numpy as np
import torch

import pyflashattn
from pyflashattn import decode, prefill

DEV, BF16 = "cuda", torch.bfloat16


def rnd(*shape, dtype=BF16):
    return torch.randn(*shape, device=DEV).to(dtype)


def finite(name, x):
    x = x[0] if isinstance(x, tuple) else x
    assert torch.isfinite(x.float()).all(), name
    print(name, "ok")


def main():
    torch.manual_seed(0)
    ws = torch.zeros(64 << 20, dtype=torch.uint8, device=DEV)
    q, k, v = rnd(200, 8, 128), rnd(333, 2, 128), rnd(333, 2, 128)
    finite("single sm90", pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=True))
    # more row tiles than SMs: the persistent CTAs walk two or more blocks each (sm90/cta.cuh: Q
    # and the ring handed on across blocks)
    for d, heads, n in ((64, 48, 640), (128, 16, 1280)):
        qw, kw, vw = (rnd(n, heads, d) for _ in range(3))
        finite(f"single sm90 walk hd{d}", pyflashattn.single_prefill_with_kv_cache(qw, kw, vw, causal=True))
    qo, kv = np.array([0, 70, 130], np.int32), np.array([0, 300, 333], np.int32)
    w = pyflashattn.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    w.plan(qo, kv, 8, 2, 128, causal=True, fixed_split_size=128, q_data_type=BF16)
    finite("ragged split", w.run(q[:130], k, v))
    # 16: boxes where PFA_SM90_KV_LOAD=tma runs the TMA twin; 8: cp.async always. The copies' page
    # runs (bf16 hd128, rows 8 apart): 64 -> runs of 8, 8 -> one row each; 16: the span twin's warp
    # spans (producer.cuh load_tile_spans), runs of 8. hd64: spans always (16 -> 4, 64 -> 8, 8 -> 2).
    q64 = rnd(130, 8, 64)
    for ps in (16, 64, 8):
        lens = [300, 33]
        pages = [-(-n // ps) for n in lens]
        perm = torch.randperm(sum(pages) + 3).to(torch.int32)[:sum(pages)]
        cache = rnd(sum(pages) + 3, 2, ps, 2, 128)
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        last = np.array([n - (p - 1) * ps for n, p in zip(lens, pages)], np.int32)
        wp = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        wp.plan(qo, indptr, perm.numpy(), last, 8, 2, 128, ps, causal=True, q_data_type=BF16)
        finite(f"paged page {ps} ({wp._engine.attn.name})", wp.run(q[:130], cache))
        # HND: a kv head's slots of a page back to back, the copies' dense runs (16: 2, 64: 8)
        wh = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(ws, "HND")
        wh.plan(qo, indptr, perm.numpy(), last, 8, 2, 128, ps, causal=True, q_data_type=BF16)
        finite(f"paged HND page {ps} ({wh._engine.attn.name})", wh.run(q[:130], cache.transpose(2, 3).contiguous()))
        w64 = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        w64.plan(qo, indptr, perm.numpy(), last, 8, 2, 64, ps, causal=True, q_data_type=BF16)
        finite(f"paged hd64 page {ps} ({w64._engine.attn.name})", w64.run(q64, rnd(sum(pages) + 3, 2, ps, 2, 64)))
    e4 = torch.float8_e4m3fn
    # a bf16 q over an fp8 cache: the sm90 rows that copy raw one-byte tiles and widen them
    # (widen_producer.cuh), paged (e4m3, the last page size's cache) and ragged (e5m2) walking
    # several blocks at hd64 (three consumers) and hd128
    wk = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    wk.plan(qo, indptr, perm.numpy(), last, 8, 2, 128, ps, causal=True, q_data_type=BF16, kv_data_type=e4)
    finite(f"paged bf16 q, e4m3 cache ({wk._engine.attn.name})", wk.run(q[:130], cache.to(e4)))
    for d, heads, n in ((64, 48, 640), (128, 16, 1280)):
        wr = pyflashattn.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        ind = np.array([0, n // 2, n], np.int32)
        wr.plan(ind, ind, heads, heads // 4, d, causal=True, q_data_type=BF16, kv_data_type=torch.float8_e5m2)
        kv5 = [rnd(n, heads // 4, d).to(torch.float8_e5m2) for _ in range(2)]
        finite(f"ragged bf16 q, e5m2 K/V walk hd{d} ({wr._engine.attn.name})", wr.run(rnd(n, heads, d), *kv5))
    wp = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    wp.plan(qo, indptr, perm.numpy(), last, 8, 2, 128, ps, causal=True, q_data_type=e4, kv_data_type=e4,
            o_data_type=BF16)
    finite(f"paged fp8 page {ps} ({wp._engine.attn.name})", wp.run(q[:130].to(e4), cache.to(e4)))
    # the fp8 paged TMA twin (a box a page at page 32; the partial last tiles copied) where the build
    # has it (`make TUNE=1`: a tune row), forced as PFA_SM90_KV_LOAD=tma does: these requests are
    # shorter than the routing's TMA threshold; without the twin the copies run
    lens32, ps32 = [700, 297], 32
    pages32 = [-(-n // ps32) for n in lens32]
    cache32 = rnd(sum(pages32) + 3, 2, ps32, 2, 128).to(e4)
    ind32 = np.concatenate([[0], np.cumsum(pages32)]).astype(np.int32)
    perm32 = torch.randperm(sum(pages32) + 3).to(torch.int32)[:sum(pages32)].numpy()
    last32 = np.array([n - (p - 1) * ps32 for n, p in zip(lens32, pages32)], np.int32)
    os.environ["PFA_SM90_KV_LOAD"] = "tma"
    try:
        wt = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        wt.plan(np.array([0, 200, 330], np.int32), ind32, perm32, last32, 8, 2, 128, ps32, causal=True,
                q_data_type=e4, kv_data_type=e4, o_data_type=BF16)
    finally:
        del os.environ["PFA_SM90_KV_LOAD"]
    finite(f"paged fp8 page 32 ({wt._engine.attn.name})", wt.run(rnd(330, 8, 128).to(e4), cache32))
    finite("fp8 prefill", pyflashattn.single_prefill_with_kv_cache(q.to(e4), k.to(e4), v.to(e4), causal=True,
                                                                    o_dtype=BF16))
    # the persistent fp8 rows walking several blocks: single (fixed shares), and a ragged batch (the
    # tile scheduler's counters, L2 sections)
    for d, heads, n in ((64, 48, 640), (128, 16, 1280)):
        qw, kw, vw = (rnd(n, heads, d).to(e4) for _ in range(3))
        finite(f"single fp8 walk hd{d}", pyflashattn.single_prefill_with_kv_cache(qw, kw, vw, causal=True,
                                                                                  o_dtype=BF16))
        wr = pyflashattn.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        ind = np.array([0, n // 2, n], np.int32)
        wr.plan(ind, ind, heads, heads, d, causal=True, q_data_type=e4, kv_data_type=e4, o_data_type=BF16)
        finite(f"ragged fp8 walk hd{d} ({wr._engine.attn.name})", wr.run(qw, kw, vw))
    B, P, ps = 4, 64, 16
    cache = rnd(P, 2, ps, 2, 128)
    bt = torch.randperm(P, device=DEV).to(torch.int32).view(B, -1)
    sl = torch.tensor([200, 1, 77, 256], dtype=torch.int32, device=DEV)
    qd = rnd(B, 8, 128)
    finite("xqa bf16", decode.xqa_batch_decode_with_kv_cache(qd, cache, ws, bt, sl, 256))
    finite("xqa fp8", decode.xqa_batch_decode_with_kv_cache(qd, cache.to(e4), ws, bt, sl, 256))
    codes = torch.randint(0, 256, (P, 2, ps, 2, 64), dtype=torch.uint8, device=DEV)  # negative codes too
    sf = (torch.rand(P, 2, ps, 2, 8, device=DEV) * 0.5 + 0.1).to(e4)
    finite("xqa nvfp4", decode.xqa_batch_decode_with_kv_cache(qd, codes, ws, bt, sl, 256, kv_cache_sf=sf))
    cq = torch.tensor([0, 50, 51, 120, 130], dtype=torch.int32, device=DEV)
    ck = torch.tensor([0, 200, 201, 278, 534], dtype=torch.int32, device=DEV)
    out = torch.empty(130, 8, 128, dtype=BF16, device=DEV)
    hnd = cache.transpose(2, 3).contiguous()
    finite("trtllm context", prefill.trtllm_batch_context_with_kv_cache(
        q[:130], hnd, ws, bt, sl, 70, 256, 0.1, 1.0, B, cq, ck, out=out))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
