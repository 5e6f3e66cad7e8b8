"""Decode benchmark: ``python -m pyflashattn.bench decode [--quick] [--json PATH]``.

Decode-like batches (every request 1 to 8 query tokens over a long KV cache) through the batch
wrappers, which run them on the decode tiles (16 packed rows; at head_dim 64 / 128 the 32- and
64-row tiles over a paged or fp8 cache, two 16-row tiles for up to 32 rows over ragged K/V;
``routing.built_decode_tiles``).
Such a batch is a stream over its
K/V, so it is judged against memory bandwidth: KV bytes read per second (K and V of every
request once, 2 bytes an element, 1 in the fp8 cache) next to the device-to-device copy
bandwidth torch gets on the same GPU in the same run (a 1 GiB ``copy_``, read + write counted),
the practical ceiling.

bf16, 32 q heads / 8 kv heads (GQA 4), causal (a query token sees its whole cache), head_dim 128
(and 64 / 256 without ``--quick``); ragged and paged (page_size 16, pages in random order) K/V,
and the paged cache in fp8 e4m3 (``fp8 x``: its speedup over the bf16 paged cache).
Single-request rows: ``single_prefill_with_kv_cache`` on one request of 1, 4 or 8 query tokens
(it routes requests to the same decode tile by the same rule) next to torch SDPA
(``enable_gqa``, torch's own backend choice) on the same tensors. SDPA gets the bottom-right
causal mask as an explicit boolean mask, which keeps it off its flash / cuDNN kernels: its
column is what a torch user gets for that mask (for qo=1 the mask hides nothing, and a
maskless call could be faster).
XQA rows (``decode_xqa``): B=64 requests of 4096 keys through ``xqa_batch_decode_with_kv_cache``
over the cache as bf16, fp8 and NVFP4 (codes + block scales: their bytes are what its TB/s count).
Before a time is posted, a few requests' outputs are compared with torch SDPA on the same inputs
(the XQA rows: fp8 and NVFP4 with the bf16 cache of the same values).
Timing: CUDA-event medians with an L2 flush before each repetition, the three columns in
rotating interleaved rounds (``bench_util.interleaved_median_ms``).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np

from pyflashattn.bench.decode_xqa import print_xqa_rows, xqa_rows
from pyflashattn.testing.bench_util import (bench_main, bench_samples_ms, gpu_warmup, interleaved_median_ms,
                                            short_error)

HQ, HKV, PAGE_SIZE = 32, 8, 16
REL_TOL = 2e-2
CHECKED_REQUESTS = 4
# (name, requests, query tokens per request, kv_len range): decode at a few batch sizes and
# cache lengths, and speculative-decode batches (4 tokens x group 4 = 16 packed rows; 8 tokens = 32
# rows: the decode tiles at hd64 / hd128, the 128-row kernel at hd256).
CASES = [("decode B=64 kv 1K-4K", 64, 1, (1024, 4096)),
         ("decode B=16 kv 8K-32K", 16, 1, (8192, 32768)),
         ("decode B=128 kv 2K-8K", 128, 1, (2048, 8192)),
         ("spec-decode B=32 qo 4 kv 2K-16K", 32, 4, (2048, 16384)),
         ("spec-decode B=32 qo 8 kv 2K-16K", 32, 8, (2048, 16384))]


# (name, query tokens, kv_len): one request through single_prefill_with_kv_cache
SINGLE_CASES = [("single qo=1 kv 32K", 1, 32768), ("single qo=1 kv 4K", 1, 4096),
                ("single spec qo=4 kv 16K", 4, 16384), ("single spec qo=8 kv 32K", 8, 32768)]


def _indptr(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def copy_bandwidth_tbps(torch, nbytes: int = 1 << 30) -> float:
    """torch's device-to-device copy rate (read + write bytes per second, TB/s): the practical
    memory-bandwidth ceiling of this GPU, measured the same way as the kernels (median)."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = statistics.median(bench_samples_ms(lambda: y.copy_(x), warmup=3, rep=10))
    return 2 * nbytes / ms / 1e9


def _case(torch, pfa, ws, name, B, qo, kv_range, head_dim, seed, warmup, rep):
    rng = np.random.default_rng(seed)
    kv_lens = rng.integers(kv_range[0], kv_range[1] + 1, B)
    qo_lens = np.full(B, qo)
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16, device="cuda", generator=gen)

    q = rand(int(qo_lens.sum()), HQ, head_dim)
    k, v = rand(int(kv_lens.sum()), HKV, head_dim), rand(int(kv_lens.sum()), HKV, head_dim)
    qi, ki = _indptr(qo_lens), _indptr(kv_lens)
    pages = -(-kv_lens // PAGE_SIZE)
    pi = _indptr(pages)
    perm = rng.permutation(int(pi[-1])).astype(np.int32)
    cache = torch.zeros(int(pi[-1]), 2, PAGE_SIZE, HKV, head_dim, dtype=torch.bfloat16, device="cuda")
    tok_page = np.concatenate([perm[pi[b] + np.arange(n) // PAGE_SIZE] for b, n in enumerate(kv_lens)])
    tok_slot = np.concatenate([np.arange(n) % PAGE_SIZE for n in kv_lens])
    tp, ts = (torch.as_tensor(a.astype(np.int64), device="cuda") for a in (tok_page, tok_slot))
    cache[:, 0][tp, ts] = k
    cache[:, 1][tp, ts] = v
    last = (kv_lens - (pages - 1) * PAGE_SIZE).astype(np.int32)
    row = {"case": name, "head_dim": head_dim, "batch": B, "qo_len": qo, "kv_tokens": int(kv_lens.sum()),
           "kv_bytes": 2 * k.numel() * 2, "errors": []}
    wr = pfa.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    wr.plan(qi, ki, HQ, HKV, head_dim, causal=True, q_data_type=torch.bfloat16)
    wp = pfa.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    wp.plan(qi, pi, perm, last, HQ, HKV, head_dim, PAGE_SIZE, causal=True, q_data_type=torch.bfloat16)
    row["kernel"] = wr._engine.attn.name
    # fp8 (e4m3) paged cache: half the bytes; checked against the bf16 paged kernel on the same
    # widened values (fp8 rounding alone moves the output ~3 % from the bf16 inputs' result)
    cache8 = cache.to(torch.float8_e4m3fn)
    w8 = pfa.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    w8.plan(qi, pi, perm, last, HQ, HKV, head_dim, PAGE_SIZE, causal=True, q_data_type=torch.bfloat16,
            kv_data_type=torch.float8_e4m3fn)
    wide = cache8.to(torch.bfloat16)
    out = torch.empty_like(q)
    timers = {}
    for kind, fn in (("ragged", lambda: wr.run(q, k, v, out=out)), ("paged", lambda: wp.run(q, cache, out=out)),
                     ("fp8_paged", lambda: w8.run(q, cache8, out=out))):
        try:
            o = fn().clone()
            if kind == "fp8_paged":
                ref = wp.run(q, wide)
                rel = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
                if not rel <= REL_TOL:
                    row["errors"].append(f"pfa {kind}: mismatch vs bf16 paged on the widened cache, rel {rel:.3g}")
                    continue
                timers[kind] = lambda wu, r, fn=fn: bench_samples_ms(fn, warmup=wu, rep=r)
                continue
            worst = 0.0
            for b in range(min(CHECKED_REQUESTS, B)):
                qs = q[qi[b]:qi[b + 1]].transpose(0, 1)[None].float()
                ks = k[ki[b]:ki[b + 1]].repeat_interleave(HQ // HKV, 1).transpose(0, 1)[None].float()
                vs = v[ki[b]:ki[b + 1]].repeat_interleave(HQ // HKV, 1).transpose(0, 1)[None].float()
                # causal, bottom-right: query token i sees keys 0 .. n_k - n_q + i
                n_q, n_k = int(qo_lens[b]), int(kv_lens[b])
                last_key = n_k - n_q + torch.arange(n_q, device="cuda")
                mask = torch.arange(n_k, device="cuda")[None, :] <= last_key[:, None]
                ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)[0].transpose(0, 1)
                got = o[qi[b]:qi[b + 1]].float()
                worst = max(worst, ((got - ref).norm() / ref.norm()).item())
            if not worst <= REL_TOL:
                row["errors"].append(f"pfa {kind}: mismatch vs SDPA, rel {worst:.3g}")
                continue
            timers[kind] = lambda wu, r, fn=fn: bench_samples_ms(fn, warmup=wu, rep=r)
        except Exception as e:
            row["errors"].append(f"pfa {kind}: {short_error(e)}")
    ms = interleaved_median_ms(timers, warmup, rep, row["errors"]) if timers else {}
    for kind in ("ragged", "paged", "fp8_paged"):
        t = ms.get(kind)
        nbytes = row["kv_bytes"] // 2 if kind == "fp8_paged" else row["kv_bytes"]
        row[f"{kind}_us"] = None if t is None else t * 1e3
        row[f"{kind}_tbps"] = None if t is None else nbytes / t / 1e9
    return row


def _single_case(torch, pfa, name, qo, kv_len, head_dim, seed, warmup, rep):
    """One request, NHD, causal: pfa's single prefill vs torch SDPA, KV bytes per second."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(qo, HQ, head_dim, dtype=torch.bfloat16, device="cuda", generator=gen)
    k = torch.randn(kv_len, HKV, head_dim, dtype=torch.bfloat16, device="cuda", generator=gen)
    v = torch.randn(kv_len, HKV, head_dim, dtype=torch.bfloat16, device="cuda", generator=gen)
    row = {"case": name, "head_dim": head_dim, "batch": 1, "qo_len": qo, "kv_tokens": kv_len,
           "kv_bytes": 2 * k.numel() * 2, "errors": []}
    # SDPA: [1, heads, tokens, D]; causal bottom-right as an explicit mask (query i sees kv - qo + i)
    qs, ks, vs = (t.transpose(0, 1)[None] for t in (q, k, v))
    mask = (torch.arange(kv_len, device="cuda")[None, :]
            <= (kv_len - qo + torch.arange(qo, device="cuda"))[:, None])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = torch.empty_like(q)
    timers = {}
    try:
        o = pfa.single_prefill_with_kv_cache(q, k, v, causal=True, out=out).float()
        ref = sdpa(qs.float(), ks.float(), vs.float(), attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
        rel = ((o - ref).norm() / ref.norm()).item()
        if not rel <= REL_TOL:
            row["errors"].append(f"pfa single: mismatch vs SDPA, rel {rel:.3g}")
        else:
            row["kernel"] = pfa._engine.single._tls.plans[next(reversed(pfa._engine.single._tls.plans))].attn.name
            timers["pfa"] = lambda wu, r: bench_samples_ms(
                lambda: pfa.single_prefill_with_kv_cache(q, k, v, causal=True, out=out), warmup=wu, rep=r)
    except Exception as e:
        row["errors"].append(f"pfa single: {short_error(e)}")
    try:
        sdpa(qs, ks, vs, attn_mask=mask, enable_gqa=True)
        timers["sdpa"] = lambda wu, r: bench_samples_ms(lambda: sdpa(qs, ks, vs, attn_mask=mask, enable_gqa=True),
                                                        warmup=wu, rep=r)
    except Exception as e:
        row["errors"].append(f"sdpa: {short_error(e)}")
    ms = interleaved_median_ms(timers, warmup, rep, row["errors"]) if timers else {}
    for kind in ("pfa", "sdpa"):
        t = ms.get(kind)
        row[f"{kind}_us"] = None if t is None else t * 1e3
        row[f"{kind}_tbps"] = None if t is None else row["kv_bytes"] / t / 1e9
    return row


def _fmt(x, spec=".2f"):
    return "   -" if x is None else format(x, spec)


def _errors(r):
    return "  ! " + "; ".join(r["errors"]) if r["errors"] else ""


def _print_tables(rows, singles, copy):
    """The batch rows, then the single-request rows (TB/s and ratios; '-' where not measured)."""
    print(f"KV bytes read per second (TB/s) against torch's device copy, {copy:.2f} TB/s (read + write) in this run")
    head = (f"{'case':<34} {'hd':>3} {'kernel':<27} | {'ragged':>6} {'paged':>6} {'fp8pag':>6} | {'rag/copy':>8} "
            f"{'pag/copy':>8} {'fp8/copy':>8} | {'fp8 x':>5}")
    print(head)
    print("-" * len(head))
    for r in rows:
        speed = (None if r["paged_us"] is None or r["fp8_paged_us"] is None else r["paged_us"] / r["fp8_paged_us"])
        print(f"{r['case']:<34} {r['head_dim']:>3} {r.get('kernel', '-')[16:]:<27} | {_fmt(r['ragged_tbps']):>6} "
              f"{_fmt(r['paged_tbps']):>6} {_fmt(r['fp8_paged_tbps']):>6} | {_fmt(r['ragged_over_copy']):>8} "
              f"{_fmt(r['paged_over_copy']):>8} {_fmt(r['fp8_paged_over_copy']):>8} | {_fmt(speed):>5}" + _errors(r))
    head = (f"{'one request (single_prefill)':<34} {'hd':>3} {'kernel':<27} | {'pfa':>6} {'sdpa':>6} | "
            f"{'pfa/copy':>8} {'pfa/sdpa':>8}")
    print(head)
    print("-" * len(head))
    for r in singles:
        ratio = None if r["pfa_us"] is None or r["sdpa_us"] is None else r["sdpa_us"] / r["pfa_us"]
        print(f"{r['case']:<34} {r['head_dim']:>3} {r.get('kernel', '-')[16:]:<27} | {_fmt(r['pfa_tbps']):>6} "
              f"{_fmt(r['sdpa_tbps']):>6} | {_fmt(r['pfa_over_copy']):>8} {_fmt(ratio):>8}" + _errors(r))


def host_times(torch, pfa, ws, calls: int = 200, rounds: int = 5) -> dict:
    """Host time per call (us) of the decode wrapper's run() and of XQA (out= given, torch tensors,
    back-to-back calls; the best of a few rounds' means): 4 requests of 64 keys, bf16, hd128."""
    B, n, hd = 4, 64, 128
    q = torch.randn(B, HQ, hd, dtype=torch.bfloat16, device="cuda")
    cache = torch.randn(B * n // PAGE_SIZE, 2, PAGE_SIZE, HKV, hd, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    pages = n // PAGE_SIZE
    w = pfa.decode.BatchDecodeWithPagedKVCacheWrapper(ws)
    w.plan(np.arange(B + 1, dtype=np.int32) * pages, np.arange(B * pages, dtype=np.int32),
           np.full(B, PAGE_SIZE, np.int32), HQ, HKV, hd, PAGE_SIZE, q_data_type=torch.bfloat16)
    bt = torch.arange(B * pages, dtype=torch.int32, device="cuda").view(B, pages)
    sl = torch.full((B,), n, dtype=torch.int32, device="cuda")
    fns = {"decode_run_us": lambda: w.run(q, cache, out=out),
           "xqa_us": lambda: pfa.decode.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, sl, n, bmm1_scale=0.088,
                                                                       out=out)}
    res = {}
    for name, fn in fns.items():
        fn()
        best = float("inf")
        for _ in range(rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()
        res[name] = best
    return res


def run(args) -> int:
    import torch

    import pyflashattn as pfa

    warmup, rep = (2, 6) if args.quick else (args.warmup, args.rep)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    print(f"# {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, bf16, {HQ}/{HKV} heads",
          flush=True)
    gpu_warmup()
    copy = copy_bandwidth_tbps(torch)
    rows = []
    head_dims = (128,) if args.quick else (64, 128, 256)
    for hd in head_dims:
        for i, (name, B, qo, kv_range) in enumerate(CASES[:2] if args.quick else CASES):
            r = _case(torch, pfa, ws, name, B, qo, kv_range, hd, 1000 + 10 * i + hd, warmup, rep)
            for kind in ("ragged", "paged", "fp8_paged"):
                r[f"{kind}_over_copy"] = None if r[f"{kind}_tbps"] is None else r[f"{kind}_tbps"] / copy
            rows.append(r)
    singles = []
    for hd in head_dims:
        for i, (name, qo, kv_len) in enumerate(SINGLE_CASES[:1] if args.quick else SINGLE_CASES):
            r = _single_case(torch, pfa, name, qo, kv_len, hd, 2000 + 10 * i + hd, warmup, rep)
            r["pfa_over_copy"] = None if r["pfa_tbps"] is None else r["pfa_tbps"] / copy
            singles.append(r)
    xqa = xqa_rows(torch, pfa, ws, head_dims, 3000, warmup, rep)
    meta = {"device": props.name, "torch": torch.__version__, "copy_tbps": copy, "page_size": PAGE_SIZE,
            "num_qo_heads": HQ, "num_kv_heads": HKV, "warmup": warmup, "rep": rep, "quick": bool(args.quick),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "single": singles, "xqa": xqa}, f, indent=1)
    _print_tables(rows, singles, copy)
    print_xqa_rows(xqa, copy, _fmt, _errors)
    h = host_times(torch, pfa, ws)
    print(f"host time per call (4 requests x 64 keys, out= given, best of 5 x 200 calls): decode wrapper run() "
          f"{h['decode_run_us']:.1f} us, xqa_batch_decode_with_kv_cache {h['xqa_us']:.1f} us "
          f"(xqa / run {h['xqa_us'] / h['decode_run_us']:.2f})")
    return 1 if any("mismatch" in e for r in rows + singles + xqa for e in r["errors"]) else 0


def main(argv=None) -> int:
    return bench_main(run, argv, prog="python -m pyflashattn.bench decode", doc=__doc__,
                      quick_help="head_dim 128 and two cases only", rep=15)


if __name__ == "__main__":
    sys.exit(main())
