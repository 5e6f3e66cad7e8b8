"""Batch prefill benchmark: ``python -m pyflashattn.bench batch [--quick] [--json PATH]``.

bf16, head_dim 128, 32 q heads / 8 kv heads (GQA 4), causal and non-causal, prefill requests
(qo_len = kv_len per request):

* ``uniform16``: 16 requests, lengths uniform in [512, 4096] (seeded);
* ``skewed``: one 8192-token request and 32 (16 with ``--quick``) of 256..512 tokens.

Each batch runs through BatchPrefillWithRaggedKVCacheWrapper and, with the same tensors
scattered into a paged cache (page_size 16, pages in random order), through
BatchPrefillWithPagedKVCacheWrapper, and once more with the paged cache in fp8 (e4m3, the bf16
cache cast once, k_scale = v_scale = 1). Columns:

* TFLOP/s. FLOPs are counted per request and summed: ``4 * qo * kv * Hq * D`` non-causal; causal
  (bottom-right, qo <= kv) ``4 * Hq * D * (qo * kv - qo^2 / 2)``, i.e. half of it when
  qo = kv, the convention of ``python -m pyflashattn.bench prefill``;
* ``single``: our single_prefill_with_kv_cache on ONE request whose length is the batch's total
  tokens. It does a different amount of work (one long attention instead of many short ones),
  so only the TFLOP/s *rates* compare: ``ragged/single`` says how much of the big-request
  efficiency the batch path keeps on short, ragged requests;
* ``paged/ragged``: the cost of the page-table indirection;
* ``fp8 paged`` and ``fp8/paged``: the e4m3 paged cache against the bf16 one (half the K/V bytes,
  plus the widening in shared memory: on sm_90 K to bf16 and V to fp16). Its check is against our
  bf16 paged kernel on the same (widened) fp8 values, since fp8 rounding alone moves the output
  ~3% from SDPA's;
* ``sdpa loop``: torch SDPA (flash backend where it takes the shape) called once per request
  in a Python loop, K/V expanded to 32 heads beforehand (outside the timed region). There is no
  varlen SDPA in torch, so this is what a torch user would do; reported for scale, launch gaps
  included.

When flashinfer is importable (and PFA_BENCH_FLASHINFER is not 0), FlashInfer's wrappers run the
same three kinds on the same tensors, checked as ours are, timed in the same rounds, and a second
table gives their TFLOP/s and pyflashattn's ratio to each: the ragged and bf16 paged ones on its
FA3 backend on sm_90 (FA2 elsewhere), the fp8 paged one on FA2 (FlashInfer's FA3 backend does not
take an fp8 cache under a 16-bit query). FlashInfer JIT-compiles them on first use (minutes).

Timing: CUDA-event medians with an L2 flush before each repetition; plan() outside the timed
region. Before a number is posted, the batch output of every request is compared with SDPA's on
the same inputs (relative Frobenius error <= REL_TOL); a failing row posts no time. All columns
of a row are then timed in three interleaved rounds whose order rotates
(``bench_util.interleaved_median_ms``): timed one after the other, each column would carry the
power and clock state its predecessor left. The GPU is warmed up for a second before the first
row (``bench_util.gpu_warmup``).

Host costs: plan() in microseconds at batch 64 and 1024 (numpy index arrays; qo 1..256,
kv qo..4096; median of repeated plans, each a full plan including its metadata copy; ragged and
paged alternating), and run() per call (wall time per call of back-to-back runs with out= given,
on a tiny batch of 4 x 16 tokens; ragged and paged in interleaved rounds).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import zlib

import numpy as np

from pyflashattn.testing.bench_util import bench_main, gpu_warmup, import_flashinfer, interleaved_median_ms, short_error

REL_TOL = 2e-2  # bf16: two correct kernels differ by ~1e-3..1e-2; a wrong mask or tile lands far above
HQ, HKV, HEAD_DIM = 32, 8, 128
PAGE_SIZE = 16
WORKSPACE_BYTES = 512 << 20


def _tflops(flops, ms):
    return None if not ms else flops / (ms * 1e-3) / 1e12


def _ratio(a, b):
    return None if (a is None or not b) else a / b


_short_err = short_error


def _fmt(x, spec=".1f", width=7):
    return f"{'-':>{width}}" if x is None else f"{x:>{width}{spec}}"


def request_flops(qo: int, kv: int, causal: bool, heads: int = HQ, head_dim: int = HEAD_DIM) -> float:
    """FLOPs of one request (QK^T and PV, 2 each per multiply-add); causal counts the visible
    half-triangle (bottom-right), qo <= kv."""
    pairs = qo * kv - (qo * qo / 2.0 if causal else 0.0)
    return 4.0 * heads * head_dim * pairs


def batch_lengths(name: str, quick: bool = False) -> list[int]:
    """Per-request lengths of the named batch (seeded, so every run times the same batch)."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if name == "uniform16":
        return [int(x) for x in rng.integers(512, 4097, 16)]
    if name == "skewed":
        n = 16 if quick else 32
        return [8192] + [int(x) for x in rng.integers(256, 513, n)]
    raise ValueError(name)


def _indptr(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


class _Ctx:
    def __init__(self):
        import torch

        from pyflashattn.testing.bench_util import bench_samples_ms, host_overhead_interleaved_us

        self.torch = torch
        self.bench_samples_ms = bench_samples_ms
        self.host_overhead_interleaved_us = host_overhead_interleaved_us
        try:
            import pyflashattn

            self.pfa = pyflashattn
            self.pfa_error = None
        except Exception as e:  # still time SDPA
            self.pfa = None
            self.pfa_error = _short_err(e)
        self.ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        # FlashInfer, when importable: its own workspace (its plans stage metadata there, as ours do)
        self.fi, self.fi_error = import_flashinfer()
        self.ws_fi = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda") if self.fi else None

    def sdpa(self, q, k, v, causal):
        """q [1, H, s, d], k/v [1, H, s, d]: flash backend when it takes the call, else default."""
        F = self.torch.nn.functional
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        except Exception:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _make_inputs(ctx: _Ctx, lens, seed):
    torch = ctx.torch
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = int(sum(lens))

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16, device="cuda", generator=gen)

    q, k, v = rand(T, HQ, HEAD_DIM), rand(T, HKV, HEAD_DIM), rand(T, HKV, HEAD_DIM)
    return q, k, v


def _paged_cache(ctx: _Ctx, lens, k, v, seed, page_size: int = PAGE_SIZE, shuffle: bool = True,
                 layout: str = "NHD"):
    """k/v ([tokens, Hkv, D]) scattered into a paged cache, [P, 2, page_size, Hkv, D] (NHD) or
    [P, 2, Hkv, page_size, D] (HND), its pages in random order (else in order); returns the cache
    and the plan's index arrays."""
    torch = ctx.torch
    pages = [-(-n // page_size) for n in lens]
    used = int(sum(pages))
    rng = np.random.default_rng(seed)
    num_pages = used + max(4, used // 8)
    perm = (rng.permutation(num_pages) if shuffle else np.arange(num_pages)).astype(np.int32)
    kv_indptr = _indptr(pages)
    indices = perm[:used]
    last = np.asarray([n - (p - 1) * page_size for n, p in zip(lens, pages)], np.int32)
    tok_page = np.concatenate([indices[kv_indptr[i] + np.arange(n) // page_size] for i, n in enumerate(lens)])
    tok_slot = np.concatenate([np.arange(n) % page_size for n in lens])
    hkv, d = k.shape[1], k.shape[2]
    shape = (num_pages, 2, page_size, hkv, d) if layout == "NHD" else (num_pages, 2, hkv, page_size, d)
    cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(seed + 1))
    tp = torch.as_tensor(tok_page.astype(np.int64), device="cuda")
    ts = torch.as_tensor(tok_slot.astype(np.int64), device="cuda")
    for j, x in enumerate((k, v)):
        half = cache[:, j] if layout == "NHD" else cache[:, j].transpose(1, 2)  # [P, page, Hkv, D] either way
        half[tp, ts] = x
    return cache, kv_indptr, indices, last


def _rel(torch, a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def _check_per_request(ctx, o, refs, qo_indptr):
    """Worst relative error over requests of o (packed [T, Hq, D]) against refs [s, Hq, D]."""
    worst = 0.0
    for i, ref in enumerate(refs):
        r = _rel(ctx.torch, o[int(qo_indptr[i]):int(qo_indptr[i + 1])], ref)
        if r != r:  # NaN
            return r
        worst = max(worst, r)
    return worst


# FlashInfer's backend per kind on sm_90 (elsewhere FA2): its FA3 kernels take no fp8 cache under
# a 16-bit query.
FI_KINDS = ("ragged", "paged", "fp8_paged")
FI_BACKEND_SM90 = {"ragged": "fa3", "paged": "fa3", "fp8_paged": "fa2"}


def _flashinfer_timer(ctx: _Ctx, row, kind, q, kv_args, check, qo_indptr, plan_args, causal, kv_dtype):
    """FlashInfer's wrapper of this kind planned and run on our inputs, checked against the same
    references as ours; its timer, or None with the reason in row["errors"]."""
    torch, fi = ctx.torch, ctx.fi
    backend = FI_BACKEND_SM90[kind] if torch.cuda.get_device_capability()[0] == 9 else "fa2"
    row[f"fi_{kind}_backend"] = backend
    try:
        cls = fi.BatchPrefillWithRaggedKVCacheWrapper if kind == "ragged" else fi.BatchPrefillWithPagedKVCacheWrapper
        w = cls(ctx.ws_fi, "NHD", backend=backend)
        args = [torch.as_tensor(a, device="cuda") if isinstance(a, np.ndarray) else a for a in plan_args]
        w.plan(*args, causal=causal, q_data_type=torch.bfloat16, kv_data_type=kv_dtype or torch.bfloat16)
        out = w.run(q, *kv_args)
        torch.cuda.synchronize()
        rel = _check_per_request(ctx, out, check, qo_indptr)
        row[f"fi_{kind}_rel_err"] = rel
        if not rel <= REL_TOL:  # NaN fails too
            row["errors"].append(f"flashinfer {kind} ({backend}): output mismatch, worst request rel {rel:.3g}")
            return None
        return lambda wu, r: ctx.bench_samples_ms(lambda: w.run(q, *kv_args), warmup=wu, rep=r)
    except Exception as e:
        row["errors"].append(f"flashinfer {kind} ({backend}): {_short_err(e)}")
        return None


def _bench_batch(ctx: _Ctx, name, lens, causal, warmup, rep):
    torch = ctx.torch
    seed = zlib.crc32(repr((name, causal)).encode())
    flops = sum(request_flops(n, n, causal) for n in lens)
    total = int(sum(lens))
    row = {"batch": name, "causal": causal, "num_requests": len(lens), "total_tokens": total,
           "lengths": list(lens), "flops": flops, "errors": []}
    q, k, v = _make_inputs(ctx, lens, seed)
    qo_indptr = _indptr(lens)
    g = HQ // HKV
    # SDPA per request: the reference for every check, and the timed loop
    views = []
    for i in range(len(lens)):
        s0, s1 = int(qo_indptr[i]), int(qo_indptr[i + 1])
        views.append(tuple(x.transpose(0, 1).unsqueeze(0) for x in (
            q[s0:s1], k[s0:s1].repeat_interleave(g, dim=1), v[s0:s1].repeat_interleave(g, dim=1))))
    refs = [ctx.sdpa(qs, ks, vs, causal)[0].transpose(0, 1) for qs, ks, vs in views]

    def sdpa_loop():
        for qs, ks, vs in views:
            ctx.sdpa(qs, ks, vs, causal)

    # Every candidate is checked first, then all are timed in interleaved rounds (the order rotated
    # each round: bench_util.interleaved_median_ms), so none always runs after the most power-hungry one.
    timers = {"sdpa_loop": lambda w, r: ctx.bench_samples_ms(sdpa_loop, warmup=w, rep=r)}
    row["sdpa_loop_ms"] = None

    for kind in ("ragged", "paged", "fp8_paged"):
        row[f"{kind}_ms"] = None
        if ctx.pfa is None:
            row["errors"].append(f"pfa {kind}: {ctx.pfa_error}")
            continue
        try:
            out = torch.empty_like(q)
            kv_dtype = None
            if kind == "ragged":
                plan_args = (qo_indptr, qo_indptr, HQ, HKV, HEAD_DIM)
                w = ctx.pfa.BatchPrefillWithRaggedKVCacheWrapper(ctx.ws, "NHD")
                w.plan(*plan_args, causal=causal, q_data_type=torch.bfloat16)
                kv_args = (k, v)
                check = refs
            else:
                cache, kv_indptr, indices, last = _paged_cache(ctx, lens, k, v, seed + 7)
                plan_args = (qo_indptr, kv_indptr, indices, last, HQ, HKV, HEAD_DIM, PAGE_SIZE)
                check = refs
                if kind == "fp8_paged":
                    cache8 = cache.float().to(torch.float8_e4m3fn)
                    # the reference: our bf16 paged kernel on the widened fp8 values
                    wide = cache8.float().to(torch.bfloat16)
                    w16 = ctx.pfa.BatchPrefillWithPagedKVCacheWrapper(ctx.ws, "NHD")
                    w16.plan(qo_indptr, kv_indptr, indices, last, HQ, HKV, HEAD_DIM, PAGE_SIZE, causal=causal,
                             q_data_type=torch.bfloat16)
                    o16 = w16.run(q, wide)
                    check = [o16[int(qo_indptr[i]):int(qo_indptr[i + 1])] for i in range(len(lens))]
                    del wide, cache
                    cache, kv_dtype = cache8, torch.float8_e4m3fn
                w = ctx.pfa.BatchPrefillWithPagedKVCacheWrapper(ctx.ws, "NHD")
                w.plan(*plan_args, causal=causal, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
                kv_args = (cache,)
            row[f"{kind}_workspace_bytes"] = w.workspace_size()
            w.run(q, *kv_args, out=out)
            torch.cuda.synchronize()
            rel = _check_per_request(ctx, out, check, qo_indptr)
            row[f"{kind}_rel_err"] = rel
            if not rel <= REL_TOL:  # NaN fails too
                row["errors"].append(f"pfa {kind}: output mismatch vs {'bf16 paged' if kind == 'fp8_paged' else 'SDPA'}"
                                     f", worst request rel {rel:.3g} > {REL_TOL}")
            else:
                timers[kind] = (lambda w, kv_args, out: lambda wu, r: ctx.bench_samples_ms(
                    lambda: w.run(q, *kv_args, out=out), warmup=wu, rep=r))(w, kv_args, out)
            if ctx.fi is not None:
                fi_timer = _flashinfer_timer(ctx, row, kind, q, kv_args, check, qo_indptr, plan_args, causal,
                                             kv_dtype)
                if fi_timer is not None:
                    timers[f"fi_{kind}"] = fi_timer
        except Exception as e:
            row["errors"].append(f"pfa {kind}: {_short_err(e)}")
    refs.clear()  # free the references before the single-request run (the views stay: SDPA's timer)

    # one request of the batch's total length through single prefill (a rate to compare)
    row["single_ms"] = None
    row["single_flops"] = request_flops(total, total, causal)
    single = _single_timer(ctx, row, total, causal, seed + 13)
    if single is not None:
        timers["single"] = single

    for key, ms in interleaved_median_ms(timers, warmup, rep, row["errors"]).items():
        row[f"{key}_ms"] = ms
    views.clear()
    timers.clear()
    _rates(row, flops)
    torch.cuda.empty_cache()
    return row


def _single_timer(ctx: _Ctx, row, total, causal, seed):
    """Single prefill over one request of the batch's total length, its last rows checked against
    SDPA; its timer, or None with the reason in row["errors"]."""
    if ctx.pfa is None:
        return None
    torch, g = ctx.torch, HQ // HKV
    try:
        qs, ks, vs = _make_inputs(ctx, [total], seed)
        o = ctx.pfa.single_prefill_with_kv_cache(qs, ks, vs, causal=causal)
        torch.cuda.synchronize()
        # check the last rows against SDPA (a full reference would cost as much as the run);
        # with qo = kv, causal row total - n + i sees keys [0, total - n + i]
        n = min(total, 256)
        qv = qs[-n:].transpose(0, 1).unsqueeze(0)
        kv_ = ks.repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0)
        vv = vs.repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0)
        mask = torch.ones(n, total, dtype=torch.bool, device="cuda").tril(total - n) if causal else None
        ref = torch.nn.functional.scaled_dot_product_attention(qv, kv_, vv, attn_mask=mask)
        del qv, kv_, vv, mask
        rel = _rel(torch, o[-n:], ref[0].transpose(0, 1))
        row["single_rel_err"] = rel
        del ref, o
        if not rel <= REL_TOL:
            row["errors"].append(f"pfa single: output mismatch vs SDPA, rel {rel:.3g}")
            return None
        return lambda wu, r: ctx.bench_samples_ms(
            lambda: ctx.pfa.single_prefill_with_kv_cache(qs, ks, vs, causal=causal), warmup=wu, rep=r)
    except Exception as e:
        row["errors"].append(f"pfa single: {_short_err(e)}")
        return None


def _rates(row, flops):
    """TFLOP/s from the timed milliseconds, and the ratios the tables print."""
    for key in ("ragged", "paged", "fp8_paged", "sdpa_loop"):
        row[f"{key}_tflops"] = _tflops(flops, row.get(f"{key}_ms"))
    row["single_tflops"] = _tflops(row["single_flops"], row["single_ms"])
    row["ragged_over_single"] = _ratio(row["ragged_tflops"], row["single_tflops"])
    row["paged_over_ragged"] = _ratio(row["paged_tflops"], row["ragged_tflops"])
    row["fp8_over_bf16_paged"] = _ratio(row["fp8_paged_tflops"], row["paged_tflops"])
    row["ragged_over_sdpa_loop"] = _ratio(row["ragged_tflops"], row["sdpa_loop_tflops"])
    for kind in FI_KINDS:
        row[f"fi_{kind}_tflops"] = _tflops(flops, row.get(f"fi_{kind}_ms"))
        row[f"{kind}_over_fi"] = _ratio(row[f"{kind}_tflops"], row[f"fi_{kind}_tflops"])


def _plan_lengths(B, seed):
    rng = np.random.default_rng(seed)
    qo = rng.integers(1, 257, B)
    kv = qo + rng.integers(0, 4097 - 256, B)
    return qo.astype(np.int64), kv.astype(np.int64)


def _host_plan_us(ctx: _Ctx, B, reps):
    """Median wall time of plan() (paged and ragged) for a batch of B requests, numpy arrays."""
    torch = ctx.torch
    qo, kv = _plan_lengths(B, B)
    qo_indptr, kv_indptr_tok = _indptr(qo), _indptr(kv)
    pages = -(-kv // PAGE_SIZE)
    kv_indptr = _indptr(pages)
    indices = np.random.default_rng(B + 1).permutation(int(kv_indptr[-1])).astype(np.int32)
    last = (kv - (pages - 1) * PAGE_SIZE).astype(np.int32)
    res = {"batch": B, "total_q": int(qo_indptr[-1]), "pages": int(kv_indptr[-1]), "reps": reps}
    plans = {
        "ragged": (ctx.pfa.BatchPrefillWithRaggedKVCacheWrapper(ctx.ws, "NHD"),
                   lambda w: w.plan(qo_indptr, kv_indptr_tok, HQ, HKV, HEAD_DIM, causal=True,
                                    q_data_type=torch.bfloat16)),
        "paged": (ctx.pfa.BatchPrefillWithPagedKVCacheWrapper(ctx.ws, "NHD"),
                  lambda w: w.plan(qo_indptr, kv_indptr, indices, last, HQ, HKV, HEAD_DIM, PAGE_SIZE, causal=True,
                                   q_data_type=torch.bfloat16)),
    }
    # Ragged and paged alternate rep by rep (the first of each pair alternating too): the host's
    # speed drifts by up to 2x over seconds on the test VMs, and both should see the same drift.
    ts = {kind: [] for kind in plans}
    live = dict(plans)
    for kind, (w, fn) in plans.items():
        try:
            for _ in range(5):
                fn(w)
        except Exception as e:
            res[f"{kind}_error"] = _short_err(e)
            del live[kind]
    torch.cuda.synchronize()
    for i in range(reps):
        order = list(live)
        for kind in (order if i % 2 == 0 else order[::-1]):
            w, fn = live[kind]
            try:
                t0 = time.perf_counter()
                fn(w)
                ts[kind].append((time.perf_counter() - t0) * 1e6)
            except Exception as e:
                res[f"{kind}_error"] = _short_err(e)
                del live[kind]
                ts[kind] = []
    for kind in plans:
        res[f"{kind}_us"] = statistics.median(ts[kind]) if ts[kind] else None
    torch.cuda.synchronize()
    return res


def _host_run_us(ctx: _Ctx, calls):
    """Wall time per run() call, back to back, out= given, tiny batch (4 requests x 16 tokens)."""
    torch = ctx.torch
    lens = [16, 16, 16, 16]
    q, k, v = _make_inputs(ctx, lens, 4321)
    qo_indptr = _indptr(lens)
    out = torch.empty_like(q)
    res = {"shape": "4 requests x 16 tokens, 32/8 heads, head_dim 128", "calls": calls}
    try:
        w = ctx.pfa.BatchPrefillWithRaggedKVCacheWrapper(ctx.ws, "NHD")
        w.plan(qo_indptr, qo_indptr, HQ, HKV, HEAD_DIM, causal=True, q_data_type=torch.bfloat16)
        cache, kv_indptr, indices, last = _paged_cache(ctx, lens, k, v, 99)
        wp = ctx.pfa.BatchPrefillWithPagedKVCacheWrapper(ctx.ws, "NHD")
        wp.plan(qo_indptr, kv_indptr, indices, last, HQ, HKV, HEAD_DIM, PAGE_SIZE, causal=True,
                q_data_type=torch.bfloat16)
        us = ctx.host_overhead_interleaved_us({"ragged": lambda: w.run(q, k, v, out=out),
                                               "paged": lambda: wp.run(q, cache, out=out)}, calls)
        res["ragged_us"], res["paged_us"] = us["ragged"], us["paged"]
    except Exception as e:
        res["error"] = _short_err(e)
    return res


def _table(rows) -> str:
    head = (f"{'batch':>10} {'causal':>6} {'reqs':>4} {'tokens':>6} | {'ragged':>7} {'paged':>7} {'fp8pag':>7} "
            f"{'single':>7} {'sdpa*n':>7} | {'rag/sgl':>7} {'pag/rag':>7} {'fp8/pag':>7} {'rag/sdpa':>8}")
    lines = ["TFLOP/s (bf16, head_dim 128, 32/8 heads; fp8pag = the paged cache in e4m3; single = one request of "
             "the batch's total length, sdpa*n = SDPA once per request)", head, "-" * len(head)]
    for r in rows:
        line = (f"{r['batch']:>10} {str(r['causal']):>6} {r['num_requests']:>4} {r['total_tokens']:>6} | "
                f"{_fmt(r.get('ragged_tflops'))} {_fmt(r.get('paged_tflops'))} {_fmt(r.get('fp8_paged_tflops'))} "
                f"{_fmt(r.get('single_tflops'))} {_fmt(r.get('sdpa_loop_tflops'))} | "
                f"{_fmt(r.get('ragged_over_single'), '.2f')} {_fmt(r.get('paged_over_ragged'), '.2f')} "
                f"{_fmt(r.get('fp8_over_bf16_paged'), '.2f')} {_fmt(r.get('ragged_over_sdpa_loop'), '.2f', 8)}")
        if r["errors"]:
            line += "  !"
        lines.append(line)
    if any(r.get(f"fi_{k}_tflops") for r in rows for k in FI_KINDS):
        head = (f"{'batch':>10} {'causal':>6} | {'FI rag':>7} {'FI pag':>7} {'FI fp8':>7} | {'rag/FI':>7} "
                f"{'pag/FI':>7} {'fp8/FI':>7}")
        backends = "/".join(sorted({r.get(f"fi_{k}_backend") for r in rows for k in FI_KINDS} - {None}))
        lines += ["", f"FlashInfer on the same inputs, same rounds (TFLOP/s; backends {backends}: FA3 for the 16-bit "
                      "K/V on sm_90, FA2 for the fp8 cache) and pyflashattn's ratio to it", head, "-" * len(head)]
        for r in rows:
            lines.append(f"{r['batch']:>10} {str(r['causal']):>6} | "
                         + " ".join(_fmt(r.get(f"fi_{k}_tflops")) for k in FI_KINDS) + " | "
                         + " ".join(_fmt(r.get(f"{k}_over_fi"), ".2f") for k in FI_KINDS))
    return "\n".join(lines)


def run(args) -> int:
    ctx = _Ctx()
    torch = ctx.torch
    warmup, rep = (2, 5) if args.quick else (args.warmup, args.rep)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    meta = {"device": props.name, "sm_count": props.multi_processor_count, "torch": torch.__version__,
            "dtype": "bf16", "num_qo_heads": HQ, "num_kv_heads": HKV, "head_dim": HEAD_DIM, "page_size": PAGE_SIZE,
            "warmup": warmup, "rep": rep, "l2_flush": True, "rel_tol": REL_TOL, "quick": bool(args.quick),
            "flops": "per request: 4*qo*kv*Hq*D, causal 4*Hq*D*(qo*kv - qo^2/2)",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "pyflashattn": getattr(ctx.pfa, "__version__", None) if ctx.pfa else None,
            "flashinfer": getattr(ctx.fi, "__version__", None) if ctx.fi else None, "flashinfer_error": ctx.fi_error}
    print(f"# {meta['device']} ({meta['sm_count']} SMs), torch {meta['torch']}, bf16, head_dim {HEAD_DIM}, "
          f"{HQ}/{HKV} heads", flush=True)
    if ctx.pfa_error:
        print(f"# pyflashattn unavailable: {ctx.pfa_error}", flush=True)
    if ctx.fi_error:
        print(f"# FlashInfer not timed: {ctx.fi_error}", flush=True)
    gpu_warmup()
    rows = []
    for name in ("uniform16", "skewed"):
        lens = batch_lengths(name, args.quick)
        for causal in (False, True):
            r = _bench_batch(ctx, name, lens, causal, warmup, rep)
            rows.append(r)
            print(f"# {name} causal={causal}: ragged {_fmt(r['ragged_tflops']).strip()} paged "
                  f"{_fmt(r['paged_tflops']).strip()} fp8 paged {_fmt(r['fp8_paged_tflops']).strip()} single "
                  f"{_fmt(r['single_tflops']).strip()} sdpa*n "
                  f"{_fmt(r['sdpa_loop_tflops']).strip()} TFLOP/s", flush=True)
    host_plan, host_run = [], None
    if ctx.pfa is not None:
        for B in (64, 1024):
            host_plan.append(_host_plan_us(ctx, B, 50 if args.quick else 200))
        host_run = _host_run_us(ctx, 200 if args.quick else 1000)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "host_plan": host_plan, "host_run": host_run}, f, indent=1)
    for r in rows:
        for e in r["errors"]:
            print(f"! {r['batch']} causal={r['causal']}: {e}")
    for h in host_plan:
        print(f"plan() host time, batch {h['batch']} ({h['total_q']} q tokens, {h['pages']} pages), median of "
              f"{h['reps']}: ragged {_fmt(h.get('ragged_us')).strip()} us, paged {_fmt(h.get('paged_us')).strip()} us"
              + "".join(f"  [{k}: {h[k]}]" for k in ("ragged_error", "paged_error") if k in h))
    if host_run is not None:
        print(f"run() host time per call ({host_run['shape']}, out= given, {host_run['calls']} back-to-back calls): "
              f"ragged {_fmt(host_run.get('ragged_us')).strip()} us, paged {_fmt(host_run.get('paged_us')).strip()} us"
              + (f"  [{host_run['error']}]" if host_run.get("error") else ""))
    print(_table(rows))
    bad = any(e.startswith("pfa") and "mismatch" in e for r in rows for e in r["errors"])
    return 1 if bad else 0


def main(argv=None) -> int:
    return bench_main(run, argv, prog="python -m pyflashattn.bench batch", doc=__doc__,
                      quick_help="fewer repetitions, a smaller skewed batch", rep=20)


if __name__ == "__main__":
    sys.exit(main())
