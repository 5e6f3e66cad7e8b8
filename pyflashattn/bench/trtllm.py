"""``python -m pyflashattn.bench trtllm``: the TRT-LLM prefill entry points at the standard
prefill sweep (batch x seq = 16k tokens, heads x head_dim = 2048, seq 1k .. 16k, causal, head_dim
128, bf16): TFLOP/s of trtllm_fmha_v2_prefill with CONTIGUOUS_Q_KV and Q_PAGED_KV_HND (page
32), of trtllm_batch_context_with_kv_cache over the same paged cache, the ratio to torch SDPA's
cuDNN backend on the same batch, the paging costs (time / CONTIGUOUS_Q_KV's time - 1) of the
fmha paged layout and of the context API, and FlashInfer's trtllm_fmha_v2_prefill
(CONTIGUOUS_Q_KV) when flashinfer is importable (PFA_BENCH_FLASHINFER=0 leaves it out; the
header says why it is not timed).

--fp8: e4m3 queries, keys and values (the bf16 inputs rounded to e4m3, scales 1) into a bf16
output, against FlashInfer's fmha_v2 with the same e4m3 inputs (#19 item 3, #20's e4m3 goal), and
checked against SDPA on the rounded inputs (FlashInfer's fp8 rtol, 8e-2: P is rounded to e4m3).

--full: no mask (fmha_v2's "padding", the context API's causal=False, SDPA without is_causal), for
the issues' non-causal shapes (4 x 4k and 1 x 16k full).

FlashInfer JIT-compiles fmha_v2 on first use; in either mode only its head_dim-128 kernels without
ALiBi / soft cap are compiled (the kernels are untouched, the list is cut): well under a minute.

The metadata are device tensors, so both APIs take their device path (a cached plan per shape
key, the kernel reading the lengths and block tables: no sync, no plan per call).
Causal FLOPs count the kept half: 2 * 2 * B * H * s * s * D / 2 (--full: all of it).
Each output is checked against SDPA's (relative Frobenius error) before its time is posted.
"""
from __future__ import annotations

import json
import math

from pyflashattn.testing.bench_util import (bench_main, bench_samples_ms, import_flashinfer, interleaved_median_ms,
                                             short_error)

TOKENS, HIDDEN, HD, PAGE = 16384, 2048, 128, 32
SEQS = (1024, 2048, 4096, 8192, 16384)
REL_TOL = 2e-2
REL_TOL_FP8 = 8e-2


def _inputs(torch, b, s):
    h = HIDDEN // HD
    gen = torch.Generator(device="cuda").manual_seed(s)
    q, k, v = (torch.randn(b * s, h, HD, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(3))
    cum = torch.arange(0, b * s + 1, s, dtype=torch.int32, device="cuda")
    sl = torch.full((b,), s, dtype=torch.int32, device="cuda")
    pages = b * s // PAGE
    cache = torch.stack([k, v], 1).view(pages, PAGE, 2, h, HD).permute(0, 2, 3, 1, 4).contiguous()  # HND
    table = torch.arange(pages, dtype=torch.int32, device="cuda").view(b, -1)
    return q, k, v, cum, sl, cache, table


def _restrict_flashinfer_fmha_v2():
    """Compile only FlashInfer's head_dim-HD fmha_v2 kernels without ALiBi / soft cap (its JIT
    otherwise builds every head dim and option of the input layout)."""
    try:
        from flashinfer.jit.attention.fmha_v2 import fmha_library as FL
    except Exception:
        return
    orig = FL.is_kernel_spec_valid
    if getattr(orig, "_pfa_restricted", False):
        return

    def valid(k):
        return orig(k) and k.head_size == HD and not k.alibi and not k.enable_attn_logit_softcapping
    valid._pfa_restricted = True
    FL.is_kernel_spec_valid = valid


def _row(torch, pfa, ws, s, warmup, rep, fp8=False, causal=True, fi=None):
    b, h = TOKENS // s, HIDDEN // HD
    q, k, v, cum, sl, cache, table = _inputs(torch, b, s)
    if fp8:
        q, k, v, cache = (x.to(torch.float8_e4m3fn) for x in (q, k, v, cache))
    scale = 1 / math.sqrt(HD)
    common = dict(workspace_buffer=ws, seq_lens=sl, max_q_len=s, max_kv_len=s, bmm1_scale=scale, bmm2_scale=1.0,
                  batch_size=b, cum_seq_lens_q=cum, cum_seq_lens_kv=cum, mask_mode="causal" if causal else "padding")
    if fp8:
        common["out_dtype"] = torch.bfloat16
    kv = torch.stack([k, v], 1)
    calls = {
        "contig": lambda: pfa.prefill.trtllm_fmha_v2_prefill((q, kv), "CONTIGUOUS_Q_KV", **common),
        "paged": lambda: pfa.prefill.trtllm_fmha_v2_prefill((q, cache), "Q_PAGED_KV_HND", block_tables=table,
                                                            **common),
        # (the same output dtype as the fmha calls: under --fp8 the context API's default, the
        # query's e4m3, would time another epilogue)
        "context": lambda: pfa.prefill.trtllm_batch_context_with_kv_cache(q, cache, ws, table, sl, s, s, scale, 1.0,
                                                                          b, cum, cum, causal=causal,
                                                                          out_dtype=common.get("out_dtype")),
    }
    qs, ks, vs = (x.to(torch.bfloat16).view(b, s, h, HD).transpose(1, 2) for x in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
    if fi is not None:
        calls["flashinfer"] = lambda: fi.prefill.trtllm_fmha_v2_prefill((q, kv), "CONTIGUOUS_Q_KV", **common)
    row = {"seq": s, "batch": b, "errors": []}
    ref = sdpa().transpose(1, 2).reshape(b * s, h, HD).float()
    timers = {"cudnn": lambda w, r: bench_samples_ms(sdpa, warmup=w, rep=r)}
    for name, fn in calls.items():
        try:
            o = fn().float()
            rel = ((o - ref).norm() / ref.norm()).item()
            if not rel <= (REL_TOL_FP8 if fp8 else REL_TOL):
                row["errors"].append(f"{name}: rel err {rel:.3g} vs SDPA")
                continue
            timers[name] = lambda w, r, fn=fn: bench_samples_ms(fn, warmup=w, rep=r)
        except Exception as e:
            row["errors"].append(f"{name}: {short_error(e)}")
    ms = interleaved_median_ms(timers, warmup, rep, row["errors"])
    flops = 4 * b * h * s * s * HD / (2 if causal else 1)
    for name in ("cudnn", "contig", "paged", "context", "flashinfer"):
        t = ms.get(name)
        row[f"{name}_tflops"] = None if t is None else flops / t / 1e9
    c, p, x = ms.get("contig"), ms.get("paged"), ms.get("context")
    row["paging_cost"] = None if c is None or p is None else p / c - 1
    row["context_paging_cost"] = None if c is None or x is None else x / c - 1
    return row


def run(args) -> int:
    import torch

    import pyflashattn as pfa
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    seqs = SEQS[::2] if args.quick else SEQS
    fi, fi_error = import_flashinfer()
    if fi is not None:
        _restrict_flashinfer_fmha_v2()
    rows = [_row(torch, pfa, ws, s, args.warmup, args.rep, args.fp8, not args.full, fi) for s in seqs]
    fmt = lambda x, spec=".1f": "-" if x is None else format(x, spec)  # noqa: E731
    inputs = "e4m3 -> bf16" if args.fp8 else "bf16"
    print(f"TRT-LLM prefill, {inputs}, {'no mask' if args.full else 'causal'}, {TOKENS} tokens, {HIDDEN // HD} heads x {HD}, page {PAGE} "
          f"({torch.cuda.get_device_name()}): TFLOP/s")
    head = (f"{'seq':>6} {'B':>3} | {'cudnn':>6} {'contig':>6} {'paged':>6} {'context':>7} {'fi fmha2':>8} | "
            f"{'contig/cudnn':>12} {'contig/fi':>9} {'paging cost':>11} {'context cost':>12}")
    if fi_error:
        print(f"# FlashInfer not timed: {fi_error}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        ratio = lambda a, b: None if r[a] is None or r[b] is None else r[a] / r[b]  # noqa: E731
        cost = None if r["paging_cost"] is None else 100 * r["paging_cost"]
        ctx = None if r["context_paging_cost"] is None else 100 * r["context_paging_cost"]
        print(f"{r['seq']:>6} {r['batch']:>3} | {fmt(r['cudnn_tflops']):>6} {fmt(r['contig_tflops']):>6} "
              f"{fmt(r['paged_tflops']):>6} {fmt(r['context_tflops']):>7} {fmt(r['flashinfer_tflops']):>8} | "
              f"{fmt(ratio('contig_tflops', 'cudnn_tflops'), '.2f'):>12} "
              f"{fmt(ratio('contig_tflops', 'flashinfer_tflops'), '.2f'):>9} {fmt(cost, '+.1f'):>10}% "
              f"{fmt(ctx, '+.1f'):>11}%"
              + ("  " + "; ".join(r["errors"]) if r["errors"] else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def main(argv=None) -> int:
    return bench_main(run, argv, prog="python -m pyflashattn.bench trtllm", doc=__doc__,
                      quick_help="seq 1k, 4k, 16k only", rep=20, add_args=_add_args)


def _add_args(p):
    p.add_argument("--fp8", action="store_true", help="e4m3 Q/K/V into a bf16 output (FlashInfer's too)")
    p.add_argument("--full", action="store_true", help="no mask (fmha_v2 'padding'), instead of causal")
