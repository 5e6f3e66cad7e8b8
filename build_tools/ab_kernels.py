"""Same-process A/B of two kernel builds: this checkout's host code and cubins ("after") against
another build's cubins ("before"), launched call by call on the same inputs.

    python3 build_tools/ab_kernels.py --before OLDTREE/cubins [--cases prefill,batch,decode] [--pairs 40]
        [--match REGEX] [--alias NEW=OLD ...] [--json F]

Why: build_tools/ab_compare.py runs each version's bench in a process of its own, so the two
versions meet different moments of the machine (the clock under the power cap, other tenants of
the host): its same-run spreads were +-3-5% (NOTES.md, sessions 25 and 27), larger than most
kernel changes are after. Here the two builds alternate call by call (before, after, then after,
before) in one process, and each pair's time ratio is taken: drifts slower than a call cancel.

How: plans, params structs and grids come from this checkout (one host path); Launcher calls are
patched so that on the "before" side a launch runs the before build's kernel of the same name
(its cubin loaded from --before, with its own dynamic shared memory). So it compares kernels
only. A change of host code, of the params layout (refused: params_sha256 differs) or of which
kernel a call picks (a name the before build lacks: refused at the first launch) needs
ab_compare.py.

Each case reports the median of the pairs' ratios (before time / after time: above 1 the after
build is faster) with its quartiles, each side's median time, and how far the two sides' outputs
are apart (one call each into a NaN-poisoned output; a case past OUTPUT_TOL is flagged and the exit
status is 1: the grid is this checkout's, so a before kernel written for another grid contract
would be timed on partial work). L2 is flushed before every call (bench_util's flush), as the
benches do.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys

CASES = ("prefill", "fp8", "batch", "pages", "decode", "trtllm")
# Outputs of the two builds further apart than this (relative, or any unwritten element) flag the
# case: a kernel change that only reorders arithmetic stays far below it (bf16 rounding ~4e-3 an
# element); a before kernel running under a grid it was not written for does not.
OUTPUT_TOL = 1e-2
# e4m3 queries: P is rounded to e4m3 (3 mantissa bits) before P V, so two kernels that form P at
# another scale (a lazy running max, another offset) land ~2-3% apart; a wrong grid still lands far
# past this.
OUTPUT_TOL_FP8 = 5e-2


def output_tol(case: str) -> float:
    """The outputs' tolerance of a case by its name (e4m3 queries: OUTPUT_TOL_FP8)."""
    return OUTPUT_TOL_FP8 if "e4m3" in case.split() else OUTPUT_TOL


# ---- what runs on the CPU too (tests/test_ab_kernels.py) --------------------------------------
def case_selected(name: str, match: str) -> bool:
    """--match: every case when empty, else those whose name the regular expression finds."""
    return not match or re.search(match, name) is not None


def before_rows(before: dict, params_sha256: str, aliases: dict | None = None) -> dict:
    """The before manifest's kernel rows by (name, arch) (an sm_89 GPU runs sm_80 rows too: the
    launcher's own row says which); ValueError if it was built against another params layout (its
    kernels would read this checkout's params struct wrongly). aliases {new: old} (--alias): where
    the after build launches kernel `new`, which the before build lacks (a new twin of a row), the
    before side runs its kernel `old` (the row's row "function")."""
    if before.get("params_sha256") != params_sha256:
        raise ValueError("the before cubins were built against another params layout (params_sha256 differs): "
                         "compare such builds with ab_compare.py")
    rows = {(r["name"], r.get("arch")): r for r in before.get("kernels", ())}
    for new, old in (aliases or {}).items():
        hits = {arch: r for (name, arch), r in rows.items() if name == old}
        if not hits:
            raise ValueError(f"--alias {new}={old}: the before build has no kernel {old}")
        rows.update({(new, arch): dict(r, function=old) for arch, r in hits.items()})
    return rows


def parse_aliases(items) -> dict:
    """--alias NEW=OLD arguments as {new: old}; ValueError naming a malformed one."""
    out = {}
    for item in items or ():
        new, sep, old = item.partition("=")
        if not sep or not new or not old:
            raise ValueError(f"--alias {item!r}: expected NEW=OLD (kernel names)")
        out[new] = old
    return out


def outputs_differ(before, after) -> float:
    """Relative Frobenius distance of two outputs (numpy float64 arrays, NaN-poisoned before each
    call); inf where either has a NaN (an element the call did not write) or the shapes differ."""
    import numpy as np

    if before.shape != after.shape or np.isnan(before).any() or np.isnan(after).any():
        return float("inf")
    scale = float(np.linalg.norm(after)) or 1.0
    return float(np.linalg.norm(before - after)) / scale


def paired_stats(before_ms: list, after_ms: list) -> dict:
    """Per-pair speed ratios (before / after time) summarised: median and quartiles, and each
    side's median time."""
    if len(before_ms) != len(after_ms) or not before_ms:
        raise ValueError("paired_stats needs as many before as after times, at least one")
    ratios = sorted(b / a for b, a in zip(before_ms, after_ms))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"ratio": statistics.median(ratios), "q1": q[0], "q3": q[2], "pairs": len(ratios),
            "before_ms": statistics.median(before_ms), "after_ms": statistics.median(after_ms)}


# ---- the swap ----------------------------------------------------------------------------------
class BeforeKernels:
    """Launcher.__call__ patched: while `active`, a launch runs the before build's function of the
    launcher's kernel name and arch (loaded on first use) with the before row's dynamic shared
    memory. What it cannot see: a kernel whose grid contract changed under the same name (the
    grid is this checkout's); main() therefore compares the two sides' outputs."""

    def __init__(self, cuda, cubins: pathlib.Path, rows: dict, device: int):
        self.cuda, self.cubins, self.rows, self.device = cuda, cubins, rows, device
        self.active = False
        self._funcs: dict = {}

    def function(self, launcher):
        hit = self._funcs.get(launcher.name)
        if hit is None:
            row = self.rows.get((launcher.name, (getattr(launcher, "meta", None) or {}).get("arch")))
            if row is None:
                raise RuntimeError(f"the before build has no kernel {launcher.name}: the call picks a kernel it "
                                   "lacks (compare with ab_compare.py)")
            if row["threads"] != launcher.threads:
                raise RuntimeError(f"{launcher.name}: {row['threads']} threads before, {launcher.threads} after")
            lib = self.cuda.load_library((self.cubins / row["file"]).read_bytes(), row["file"])
            func = self.cuda.get_function(lib, row.get("function", row["name"]), self.device, row["smem_bytes"])
            hit = self._funcs[launcher.name] = (func, row["smem_bytes"])
        return hit

    def install(self):
        cuda, swap = self.cuda, self
        plain, programmatic = cuda.Launcher.__call__, cuda.ProgrammaticLauncher.__call__

        def call(la, stream):
            if not swap.active:
                return plain(la, stream)
            func, smem = swap.function(la)
            err, = la._cu.cuLaunchKernel(func, *la._head[1:7], smem, stream, la._argv_addr, 0)
            if err != la._cu.CUresult.CUDA_SUCCESS:
                raise cuda.CudaError(f"launch of the before {la.name} failed: {err}")

        def call_programmatic(la, stream):
            if not swap.active:
                return programmatic(la, stream)
            func, smem = swap.function(la)
            cfg = la._config
            cfg.hStream, kept, cfg.sharedMemBytes = stream, cfg.sharedMemBytes, smem
            try:
                err, = la._cu.cuLaunchKernelEx(cfg, func, la._argv_addr, 0)
            finally:
                cfg.sharedMemBytes = kept
            if err != la._cu.CUresult.CUDA_SUCCESS:
                raise cuda.CudaError(f"launch of the before {la.name} (programmatic) failed: {err}")

        cuda.Launcher.__call__ = call
        cuda.ProgrammaticLauncher.__call__ = call_programmatic


# ---- the cases (torch on a CUDA GPU) -----------------------------------------------------------
def prefill_cases(torch, pfa):
    """bench prefill --quick's single-request rows: 2048 / head_dim heads, bf16."""
    for hd in (64, 128, 256):
        for seq in (2048, 8192):
            for causal in (False, True):
                h = 2048 // hd
                q, k, v = (torch.randn(seq, h, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                out = torch.empty_like(q)
                flops = 4 * seq * seq * h * hd * (0.5 if causal else 1.0)
                yield (f"prefill hd{hd} {seq} {'causal' if causal else 'full'}", flops, "TFLOP/s",
                       lambda q=q, k=k, v=v, out=out, c=causal: pfa.single_prefill_with_kv_cache(q, k, v, causal=c,
                                                                                                  out=out))


def fp8_cases(torch, pfa):
    """bench prefill's fp8 column: the same rows with q, k, v in e4m3 (unit scales), bf16 out."""
    for hd in (64, 128, 256):
        for seq in (2048, 8192):
            for causal in (False, True):
                h = 2048 // hd
                q, k, v = (torch.randn(seq, h, hd, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
                           for _ in range(3))
                out = torch.empty(seq, h, hd, device="cuda", dtype=torch.bfloat16)
                flops = 4 * seq * seq * h * hd * (0.5 if causal else 1.0)
                yield (f"e4m3 hd{hd} {seq} {'causal' if causal else 'full'}", flops, "TFLOP/s",
                       lambda q=q, k=k, v=v, out=out, c=causal: pfa.single_prefill_with_kv_cache(
                           q, k, v, causal=c, o_dtype=torch.bfloat16, out=out))


def batch_cases(torch, pfa):
    """bench batch --quick's ragged, paged and fp8-cache paged rows (32 / 8 heads, hd128, page 16 in
    random order; the fp8 row: the same cache in e4m3 under the bf16 query)."""
    from pyflashattn.bench import batch as bb

    ctx = bb._Ctx()
    for name in ("uniform16", "skewed"):
        lens = bb.batch_lengths(name, quick=True)
        indptr = bb._indptr(lens)
        for causal in (False, True):
            q, k, v = bb._make_inputs(ctx, lens, 7)
            cache, kv_indptr, indices, last = bb._paged_cache(ctx, lens, k, v, 11)
            flops = sum(bb.request_flops(n, n, causal) for n in lens)
            out = torch.empty_like(q)
            tag = f"{name} {'causal' if causal else 'full'}"
            ragged = pfa.BatchPrefillWithRaggedKVCacheWrapper(ctx.ws, "NHD")
            ragged.plan(indptr, indptr, bb.HQ, bb.HKV, bb.HEAD_DIM, causal=causal, q_data_type=torch.bfloat16)
            yield f"ragged {tag}", flops, "TFLOP/s", lambda w=ragged, q=q, k=k, v=v, out=out: w.run(q, k, v, out=out)
            ws = torch.empty(bb.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
            paged = pfa.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            paged.plan(indptr, kv_indptr, indices, last, bb.HQ, bb.HKV, bb.HEAD_DIM, bb.PAGE_SIZE, causal=causal,
                       q_data_type=torch.bfloat16)
            yield f"paged {tag}", flops, "TFLOP/s", lambda w=paged, q=q, c=cache, out=out: w.run(q, c, out=out)
            cache8 = cache.float().to(torch.float8_e4m3fn)
            ws8 = torch.empty(bb.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
            paged8 = pfa.BatchPrefillWithPagedKVCacheWrapper(ws8, "NHD")
            paged8.plan(indptr, kv_indptr, indices, last, bb.HQ, bb.HKV, bb.HEAD_DIM, bb.PAGE_SIZE, causal=causal,
                        q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)
            yield f"fp8pag {tag}", flops, "TFLOP/s", lambda w=paged8, q=q, c=cache8, out=out: w.run(q, c, out=out)


# pages_cases' sweep: (head_dim, kv_layout, page_size); the paged copies' addressing depends on
# all three (the page runs, the dense twins from page 32 in HND)
PAGE_SWEEP = tuple((hd, layout, ps) for hd in (128, 64) for layout, ps in
                   (("NHD", 8), ("NHD", 16), ("NHD", 32), ("NHD", 64), ("HND", 16), ("HND", 32)))


def pages_cases(torch, pfa):
    """The paged batch at the PAGE_SWEEP page sizes, layouts and head dims: bench batch's uniform16
    (32 / 8 heads at hd128, 16 / 4 at hd64: the same rows per kv head), bf16, pages in random order."""
    from pyflashattn.bench import batch as bb

    ctx = bb._Ctx()
    lens = bb.batch_lengths("uniform16", quick=True)
    indptr = bb._indptr(lens)
    gen = torch.Generator(device="cuda").manual_seed(7)
    for hd, layout, ps in PAGE_SWEEP:
        hq, hkv = (bb.HQ, bb.HKV) if hd == 128 else (bb.HQ // 2, bb.HKV // 2)
        q, k, v = (torch.randn(int(sum(lens)), h, hd, dtype=torch.bfloat16, device="cuda", generator=gen)
                   for h in (hq, hkv, hkv))
        cache, kv_indptr, indices, last = bb._paged_cache(ctx, lens, k, v, 11, page_size=ps, layout=layout)
        out = torch.empty_like(q)
        for causal in (False, True):
            flops = sum(bb.request_flops(n, n, causal, hq, hd) for n in lens)
            w = pfa.BatchPrefillWithPagedKVCacheWrapper(ctx.ws, layout)
            w.plan(indptr, kv_indptr, indices, last, hq, hkv, hd, ps, causal=causal, q_data_type=torch.bfloat16)
            yield (f"pages hd{hd} {layout} p{ps} {'causal' if causal else 'full'}", flops, "TFLOP/s",
                   lambda w=w, q=q, c=cache, out=out: w.run(q, c, out=out))


def decode_cases(torch, pfa):
    """bench decode's XQA rows (B=64 x 4096 keys, 32 / 8 heads, hd128, page 16): the bf16, fp8 and
    NVFP4 caches and the 8-token speculative decode; rates in TB/s of K/V as stored."""
    from pyflashattn.bench import decode_xqa as dx

    gen = torch.Generator(device="cuda").manual_seed(5)
    hd, pages = 128, dx.B * dx.KV_LEN // dx.PAGE_SIZE
    codes, sf, wide = dx._nvfp4_cache(torch, pages, hd, gen)
    elems = 2 * dx.B * dx.KV_LEN * dx.HKV * hd
    q = torch.randn(dx.B, dx.HQ, hd, dtype=torch.bfloat16, device="cuda", generator=gen)
    q8 = torch.randn(dx.B * dx.SPEC_Q, dx.HQ, hd, dtype=torch.bfloat16, device="cuda", generator=gen)
    bt = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).view(dx.B, -1)
    sl = torch.full((dx.B,), dx.KV_LEN, dtype=torch.int32, device="cuda")
    out, out8 = torch.empty_like(q), torch.empty_like(q8)
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    xqa = pfa.decode.xqa_batch_decode_with_kv_cache
    for kind, cache, scales, nbytes in (("bf16", wide, None, 2 * elems),
                                        ("fp8", wide.to(torch.float8_e4m3fn), None, elems),
                                        ("nvfp4", codes, sf, elems // 2 + elems // 16)):
        yield (f"xqa {kind} B={dx.B} x {dx.KV_LEN}", nbytes, "TB/s",
               lambda c=cache, s=scales: xqa(q, c, ws, bt, sl, dx.KV_LEN, bmm1_scale=hd**-0.5, out=out,
                                            kv_cache_sf=s))
    yield (f"xqa spec{dx.SPEC_Q} B={dx.B} x {dx.KV_LEN}", 2 * elems, "TB/s",
           lambda: xqa(q8, wide, ws, bt, sl, dx.KV_LEN, bmm1_scale=hd**-0.5, out=out8, q_len_per_req=dx.SPEC_Q))
    # #18's other shape: one request of 32768 keys, split over every SM and merged (the same cache's
    # pages, read as one long request)
    kv1 = 32768
    bt1 = bt.view(1, -1)[:, :kv1 // dx.PAGE_SIZE].contiguous()
    sl1 = torch.full((1,), kv1, dtype=torch.int32, device="cuda")
    q1, out1 = q[:1].clone(), torch.empty_like(q[:1])
    for kind, cache in (("bf16", wide), ("fp8", wide.to(torch.float8_e4m3fn))):
        yield (f"xqa {kind} B=1 x {kv1}", 2 * kv1 * dx.HKV * hd * cache.element_size(), "TB/s",
               lambda c=cache: xqa(q1, c, ws, bt1, sl1, kv1, bmm1_scale=hd**-0.5, out=out1))


def trtllm_cases(torch, pfa):
    """bench trtllm's rows at 16 x 1024, 4 x 4096 and 1 x 16384 tokens, causal, 16 heads x 128: trtllm_fmha_v2_prefill
    over CONTIGUOUS_Q_KV and Q_PAGED_KV_HND (page 32), bf16 inputs and e4m3 inputs into a bf16
    output (#20's paging cost and e4m3 rows); the contiguous rows without a mask too."""
    from pyflashattn.bench import trtllm as bt

    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    h = bt.HIDDEN // bt.HD
    for s in (1024, 4096, 16384):
        b = bt.TOKENS // s
        q, k, v, cum, sl, cache, table = bt._inputs(torch, b, s)
        flops = 4 * b * h * s * s * bt.HD / 2
        for fp8 in (False, True):
            qq, kk, vv, cc = (x.to(torch.float8_e4m3fn) for x in (q, k, v, cache)) if fp8 else (q, k, v, cache)
            kv = torch.stack([kk, vv], 1)
            out = torch.empty(b * s, h, bt.HD, dtype=torch.bfloat16, device="cuda")
            common = dict(workspace_buffer=ws, seq_lens=sl, max_q_len=s, max_kv_len=s, bmm1_scale=bt.HD**-0.5,
                          bmm2_scale=1.0, batch_size=b, cum_seq_lens_q=cum, cum_seq_lens_kv=cum, mask_mode="causal",
                          out=out, out_dtype=torch.bfloat16)
            tag = f"{'e4m3' if fp8 else 'bf16'} {b}x{s} causal"
            yield (f"trtllm contig {tag}", flops, "TFLOP/s",
                   lambda qq=qq, kv=kv, c=common: pfa.prefill.trtllm_fmha_v2_prefill((qq, kv), "CONTIGUOUS_Q_KV", **c))
            full = dict(common, mask_mode="padding")  # (#20's non-causal shapes: contiguous only)
            yield (f"trtllm contig {tag[:-6]}full", 2 * flops, "TFLOP/s",
                   lambda qq=qq, kv=kv, c=full: pfa.prefill.trtllm_fmha_v2_prefill((qq, kv), "CONTIGUOUS_Q_KV", **c))
            yield (f"trtllm paged {tag}", flops, "TFLOP/s",
                   lambda qq=qq, cc=cc, t=table, c=common: pfa.prefill.trtllm_fmha_v2_prefill(
                       (qq, cc), "Q_PAGED_KV_HND", block_tables=t, **c))


GENERATORS = {"prefill": prefill_cases, "fp8": fp8_cases, "batch": batch_cases, "pages": pages_cases,
              "decode": decode_cases, "trtllm": trtllm_cases}


def compare_outputs(torch, swap: BeforeKernels, fn) -> float:
    """outputs_differ of one call on each side, the output (fn's result, the same out= tensor
    every call) NaN-poisoned before each: an element either side leaves unwritten shows."""
    res = []
    for side in (True, False):
        out = fn()
        out.fill_(float("nan"))
        swap.active = side
        fn()
        swap.active = False
        torch.cuda.synchronize()
        res.append(out.float().cpu().double().numpy())
    return outputs_differ(*res)


def time_pairs(torch, swap: BeforeKernels, fn, pairs: int, warmup: int = 3) -> tuple[list, list]:
    """Device times (ms) of fn() on each side, `pairs` pairs, the order alternating per pair."""
    from pyflashattn.testing.bench_util import flush_buffer

    buf = flush_buffer(torch.device("cuda", torch.cuda.current_device()))
    for side in (True, False):
        swap.active = side
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    events = {True: [], False: []}
    for i in range(pairs):
        for side in ((True, False) if i % 2 == 0 else (False, True)):
            swap.active = side
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            buf.fill_(i)
            start.record()
            fn()
            end.record()
            events[side].append((start, end))
    swap.active = False
    torch.cuda.synchronize()
    return ([s.elapsed_time(e) for s, e in events[True]], [s.elapsed_time(e) for s, e in events[False]])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, type=pathlib.Path, help="the before build's cubins/ directory")
    ap.add_argument("--cases", default="prefill,batch", help="comma-separated: " + ", ".join(CASES))
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--match", default="", help="only the cases whose name matches this regular expression")
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--alias", action="append", metavar="NEW=OLD",
                    help="the before side runs its kernel OLD where the after build launches NEW (a new twin)")
    args = ap.parse_args(argv)
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        ap.error(f"--cases: unknown {', '.join(unknown)} (choose from {', '.join(CASES)})")
    import torch

    import pyflashattn
    from pyflashattn._runtime import cuda as _cuda, registry as _registry

    dev = torch.cuda.current_device()
    rows = before_rows(json.loads((args.before / "manifest.json").read_text()), _registry.PARAMS_SHA256,
                       parse_aliases(args.alias))
    swap = BeforeKernels(_cuda, args.before, rows, dev)
    swap.install()
    results = []
    print(f"{'case':34s} {'after/before speed':>18s} {'q1..q3':>13s} {'before ms':>10s} {'after ms':>9s} "
          f"{'after rate':>16s} {'outputs rel diff':>16s}")
    differ = 0
    for kind in args.cases.split(","):
        for name, work, unit, fn in GENERATORS[kind](torch, pyflashattn):
            if not case_selected(name, args.match):
                continue
            rel = compare_outputs(torch, swap, fn)
            st = paired_stats(*time_pairs(torch, swap, fn, args.pairs))
            # work: FLOPs (TFLOP/s) or bytes (TB/s), either way / ms / 1e9
            st.update(case=name, after_rate=work / st["after_ms"] / 1e9, unit=unit, outputs_rel_diff=rel)
            results.append(st)
            bad = not rel <= output_tol(name)
            differ += bad
            print(f"{name:34s} {st['ratio']:18.4f} {st['q1']:6.3f}..{st['q3']:.3f} {st['before_ms']:10.4f} "
                  f"{st['after_ms']:9.4f} {st['after_rate']:8.2f} {unit:>7s} {rel:9.2e}"
                  + ("  OUTPUTS DIFFER: the timing compares different work" if bad else ""), flush=True)
    ratios = [r["ratio"] for r in results]
    geo = statistics.geometric_mean(ratios) if ratios else float("nan")
    print(f"geomean after/before speed over {len(ratios)} cases: {geo:.4f}")
    if args.json:
        args.json.write_text(json.dumps({"cases": results, "geomean": geo}, indent=1))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    sys.exit(main())
