"""Prefill benchmarks: ``python -m pyflashattn.bench prefill [options]`` and
``python -m pyflashattn.bench prefill-features [--json PATH] [--quick]`` (see
``run_prefill_features`` for the second).

Prefill sweep (the shapes of the project's H200 anchor table): bf16, heads = 2048 / head_dim
with as many kv heads as q heads, seq in 512..16384, head_dim 64/128/256, causal and not.
FLOPs = 4 * s^2 * h * d per request, halved when causal.

What is timed, and why:

* **single** columns: one request of length ``s`` with ``h`` heads. ``single_prefill_with_kv_cache``
  takes one request, so this is the natural unit, and torch SDPA is timed on exactly the same
  request as ``[1, h, s, d]`` views of the same memory (no copies), so ``pfa/flash`` and
  ``pfa/cudnn`` compare like with like. For short ``s`` one request does not fill the GPU; that
  handicaps every backend alike.
* **batch** columns (full sweep only; ``--no-batch`` drops them): ``b = 16384 / s`` requests, as
  in the anchor table. pyflashattn runs ``b`` single-prefill calls back to back on ``b``
  different (q, k, v) sets inside one timed region; SDPA runs one batched call ``[b, h, s, d]``.
  This is *not* like with like for small ``s`` (b sequential launches, no overlap, host
  launch gaps included), and is reported because it is what a user of the single-request
  API gets; the batch wrappers are the right tool for batches.

Timing: CUDA-event medians (``pyflashattn.testing.bench_util.bench_ms``), 256 MiB L2 flush
before every repetition, fresh random inputs per shape (never zeros). The single-request
columns are timed in ``ROUNDS`` interleaved rounds whose order rotates (flash, cudnn, pfa; then
cudnn, pfa, flash; ...), the median over all their repetitions: no backend always runs right
after the most power-hungry one, whose clock and power state would carry over into its
successor's time. Before any number is
posted, the pyflashattn output is checked against SDPA's on the same inputs; a row whose
relative error ``||o - o_sdpa|| / ||o_sdpa||`` exceeds ``REL_TOL`` (or is NaN) posts no
pyflashattn number, so a broken kernel cannot post a fast time.

**fi** column: FlashInfer's single_prefill_with_kv_cache on the same request (backend "fa3" on
sm_90, "fa2" elsewhere) when flashinfer is importable (PFA_BENCH_FLASHINFER=0 leaves it out; the
report says why it is missing), checked against SDPA like ours and timed in the same interleaved
rounds. ``pfa/best`` is pyflashattn over the fastest of cuDNN and FlashInfer: the issue's
single-prefill bar at every head dim (the shared peer script times head_dim 128 only). Its first
call at a head dim JIT-compiles FlashInfer's module (minutes).

**fp8** column (sm_90 GPUs): the same request with q, k and v cast to
float8_e4m3fn (unit scales) and a bf16 output, on the fp8 prefill kernels, timed in the same
interleaved rounds as the 16-bit pyflashattn column, so ``fp8/pfa`` is a same-run ratio. It is
checked against SDPA (flash) on the fp8 values widened to bf16 (exact), within ``FP8_REL_TOL``
(P is rounded to e4m3 before P V).

Host overhead: wall-clock per call of N back-to-back calls on a tiny problem (qo = kv = 16,
8 heads, head_dim 128), without sync in between, with and without ``out=``; torch SDPA on the
same problem for scale.

The table is the last thing printed; ``--json PATH`` also writes every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib

from pyflashattn.testing.bench_util import gpu_warmup, import_flashinfer, interleaved_median_ms, run_if_cuda, short_error

# Two correct bf16 kernels differ by ~1e-3..1e-2 relative (bf16 P before PV); a wrong mask,
# a dropped tile or garbage lands far above.
REL_TOL = 2e-2
# The fp8 prefill rounds P to e4m3 (3 mantissa bits) before P V: ~1e-2 relative against a 16-bit
# reference on the same fp8 inputs; a wrong transpose or key order lands near 1.
FP8_REL_TOL = 5e-2

FULL_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQS = (2048, 8192)
HEAD_DIMS = (64, 128, 256)


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _pfa_version() -> str | None:
    """pyflashattn's version for the JSON metadata; None when it does not import."""
    try:
        import pyflashattn
    except Exception:
        return None
    return getattr(pyflashattn, "__version__", "unknown")


def _tflops(flops: float, ms: float | None) -> float | None:
    return None if not ms else flops / (ms * 1e-3) / 1e12


def _ratio(a, b):
    return None if (a is None or not b) else a / b


def _short_err(e: BaseException) -> str:
    return short_error(e, 160)


class _Ctx:
    """torch, pyflashattn and the SDPA backends, resolved once."""

    def __init__(self):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.torch = torch
        self.sdpa_kernel = sdpa_kernel
        self.backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
        try:
            import pyflashattn

            self.pfa = pyflashattn.single_prefill_with_kv_cache
            self.pfa_error = None
        except Exception as e:  # keep benchmarking SDPA so the anchors can still be checked
            self.pfa = None
            self.pfa_error = _short_err(e)
        from pyflashattn.testing.bench_util import bench_ms, bench_samples_ms, host_overhead_interleaved_us

        self.bench_ms = bench_ms
        self.bench_samples_ms = bench_samples_ms
        self.host_overhead_interleaved_us = host_overhead_interleaved_us
        self.fi, self.fi_error = import_flashinfer()
        self.fi_backend = "fa3" if torch.cuda.get_device_capability()[0] == 9 else "fa2"
        # the fp8 prefill kernels are sm_90a only (elsewhere fp8 q raises NotImplementedError)
        self.fp8 = (self.pfa is not None and hasattr(torch, "float8_e4m3fn")
                    and torch.cuda.get_device_capability() == (9, 0))

    def sdpa(self, backend, q, k, v, causal):
        with self.sdpa_kernel(self.backends[backend]):
            return self.torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def time_sdpa(self, backend, q, k, v, causal, warmup, rep):
        """Median time (ms) of one SDPA backend (see sdpa_samples)."""
        return statistics.median(self.sdpa_samples(backend, q, k, v, causal, warmup, rep))

    def sdpa_samples(self, backend, q, k, v, causal, warmup, rep):
        """Per-repetition times (ms) of one SDPA backend. The backend context is entered once: its
        cost is host-side and belongs to no backend."""
        F = self.torch.nn.functional
        with self.sdpa_kernel(self.backends[backend]):
            return self.bench_samples_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                         warmup=warmup, rep=rep)


ROUNDS = 3


def _interleaved_ms(timers: dict, warmup: int, rep: int, errors: list, rounds: int = ROUNDS) -> dict:
    """bench_util.interleaved_median_ms with this benchmark's number of rounds."""
    return interleaved_median_ms(timers, warmup, rep, errors, rounds)


def _check(torch, o, ref) -> tuple[float, float]:
    """(relative Frobenius error, max abs diff) of ``o`` against ``ref``, both [s, h, d]."""
    o = o.float()
    ref = ref.float()
    diff = o - ref
    rel = (diff.norm() / ref.norm()).item()
    return rel, diff.abs().max().item()


def _bench_row(ctx: _Ctx, hd, seq, causal, dtype, hidden, tokens, batch, warmup, rep):
    torch = ctx.torch
    h = max(1, hidden // hd)
    b = max(1, tokens // seq)
    flops = 4.0 * seq * seq * h * hd / (2 if causal else 1)
    row = {"head_dim": hd, "seq": seq, "causal": causal, "heads": h, "flops": flops,
           "batch": b if batch else None, "errors": []}
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((hd, seq, causal)).encode()))

    def rand(*shape):
        return torch.randn(*shape, dtype=dtype, device="cuda", generator=gen)

    q, k, v = rand(seq, h, hd), rand(seq, h, hd), rand(seq, h, hd)  # NHD, one request
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, h, s, d] views

    # Correctness first (every backend that runs), then the timing rounds of those that passed.
    ref = None
    timers = {}
    for be in ("flash", "cudnn"):
        row[f"{be}_ms"] = None
        try:
            out = ctx.sdpa(be, qs, ks, vs, causal)[0].transpose(0, 1)
            if ref is None:
                ref = out
            else:
                row[f"{be}_vs_ref_rel"] = _check(torch, out, ref)[0]
            timers[be] = (lambda be: lambda w, r: ctx.sdpa_samples(be, qs, ks, vs, causal, w, r))(be)
        except Exception as e:
            row["errors"].append(f"{be}: {_short_err(e)}")
    if ref is None:  # no SDPA backend ran: fall back to upcast math for the check
        ref = torch.nn.functional.scaled_dot_product_attention(
            qs.float(), ks.float(), vs.float(), is_causal=causal)[0].transpose(0, 1)

    row["pfa_ms"] = None
    if ctx.pfa is None:
        row["errors"].append(f"pfa: {ctx.pfa_error}")
    else:
        try:
            o = ctx.pfa(q, k, v, causal=causal)
            torch.cuda.synchronize()
            rel, mad = _check(torch, o, ref)
            row["pfa_rel_err"], row["pfa_max_abs_diff"] = rel, mad
            if not rel <= REL_TOL:  # NaN fails too
                row["errors"].append(f"pfa: output mismatch vs SDPA, rel {rel:.3g} > {REL_TOL}")
            else:
                timers["pfa"] = lambda w, r: ctx.bench_samples_ms(lambda: ctx.pfa(q, k, v, causal=causal),
                                                                  warmup=w, rep=r)
        except Exception as e:
            row["errors"].append(f"pfa: {_short_err(e)}")
    _flashinfer_timer(ctx, row, q, k, v, causal, ref, timers)
    del ref
    _fp8_timer(ctx, row, q, k, v, causal, timers)
    for key, ms in _interleaved_ms(timers, warmup, rep, row["errors"]).items():
        row[f"{key}_ms"] = ms

    for key in ("pfa", "flash", "cudnn", "fi", "fp8"):
        row[f"{key}_tflops"] = _tflops(flops, row.get(f"{key}_ms"))
    row["pfa_over_flash"] = _ratio(row["pfa_tflops"], row["flash_tflops"])
    row["pfa_over_cudnn"] = _ratio(row["pfa_tflops"], row["cudnn_tflops"])
    peers = [row[f"{key}_tflops"] for key in ("cudnn", "fi") if row.get(f"{key}_tflops")]
    row["pfa_over_best"] = _ratio(row["pfa_tflops"], max(peers)) if peers else None
    row["fp8_over_pfa"] = _ratio(row["fp8_tflops"], row["pfa_tflops"])

    if batch:
        _bench_batch(ctx, row, hd, seq, causal, h, b, flops * b, rand, warmup, rep)
    return row


def _flashinfer_timer(ctx: _Ctx, row, q, k, v, causal, ref, timers):
    """The fi column (module docstring): FlashInfer's single prefill on our request, checked
    against `ref`, then a timer in `timers`; a failure is an error of the row, not of the run."""
    row["fi_ms"] = None
    if ctx.fi is None:
        return
    row["fi_backend"] = backend = ctx.fi_backend
    try:
        def call():
            return ctx.fi.single_prefill_with_kv_cache(q, k, v, causal=causal, backend=backend)

        rel = _check(ctx.torch, call(), ref)[0]
        row["fi_rel_err"] = rel
        if not rel <= REL_TOL:  # NaN fails too
            row["errors"].append(f"flashinfer ({backend}): output mismatch vs SDPA, rel {rel:.3g} > {REL_TOL}")
            return
        timers["fi"] = lambda w, r: ctx.bench_samples_ms(call, warmup=w, rep=r)
    except Exception as e:
        row["errors"].append(f"flashinfer ({backend}): {_short_err(e)}")


def _fp8_timer(ctx: _Ctx, row, q, k, v, causal, timers):
    """The fp8 column (module docstring): q, k, v cast to e4m3, checked, then a timer in `timers`."""
    row["fp8_ms"] = None
    if not ctx.fp8:
        return
    torch = ctx.torch
    q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
    try:
        o = ctx.pfa(q8, k8, v8, causal=causal, o_dtype=torch.bfloat16)
        wide = [x.to(torch.bfloat16).transpose(0, 1).unsqueeze(0) for x in (q8, k8, v8)]
        ref = ctx.sdpa("flash", *wide, causal)[0].transpose(0, 1)
        rel = _check(ctx.torch, o, ref)[0]
        row["fp8_rel_err"] = rel
        if not rel <= FP8_REL_TOL:
            row["errors"].append(f"pfa fp8: output mismatch vs SDPA on the fp8 values, rel {rel:.3g} > {FP8_REL_TOL}")
            return
        out = torch.empty_like(o)
        timers["fp8"] = lambda w, r: ctx.bench_samples_ms(
            lambda: ctx.pfa(q8, k8, v8, causal=causal, o_dtype=torch.bfloat16, out=out), warmup=w, rep=r)
    except Exception as e:
        row["errors"].append(f"pfa fp8: {_short_err(e)}")


def _bench_batch(ctx: _Ctx, row, hd, seq, causal, h, b, flops_b, rand, warmup, rep):
    torch = ctx.torch
    qb, kb, vb = rand(b, seq, h, hd), rand(b, seq, h, hd), rand(b, seq, h, hd)
    qs, ks, vs = (x.transpose(1, 2) for x in (qb, kb, vb))  # [b, h, s, d] views
    ref = None
    for be in ("flash", "cudnn"):
        try:
            out = ctx.sdpa(be, qs, ks, vs, causal)
            ref = out if ref is None else ref
            row[f"{be}_b_ms"] = ctx.time_sdpa(be, qs, ks, vs, causal, warmup, rep)
        except Exception as e:
            row[f"{be}_b_ms"] = None
            row["errors"].append(f"{be} batch: {_short_err(e)}")
    row["pfa_b_ms"] = None
    if ctx.pfa is not None and ref is not None:
        def run_all():
            return [ctx.pfa(qb[i], kb[i], vb[i], causal=causal) for i in range(b)]

        try:
            outs = run_all()
            torch.cuda.synchronize()
            worst = 0.0
            for i in {0, b - 1}:  # first and last request: catches per-call state leaks
                worst = max(worst, _check(torch, outs[i], ref[i].transpose(0, 1))[0])
            row["pfa_b_rel_err"] = worst
            del outs
            if not worst <= REL_TOL:
                row["errors"].append(f"pfa batch: mismatch vs SDPA, rel {worst:.3g}")
            else:
                row["pfa_b_ms"] = ctx.bench_ms(run_all, warmup=warmup, rep=rep)
        except Exception as e:
            row["errors"].append(f"pfa batch: {_short_err(e)}")
    for key in ("pfa", "flash", "cudnn"):
        row[f"{key}_b_tflops"] = _tflops(flops_b, row.get(f"{key}_b_ms"))
    row["pfa_b_over_cudnn"] = _ratio(row["pfa_b_tflops"], row["cudnn_b_tflops"])


def _host_overhead(ctx: _Ctx, dtype, n):
    torch = ctx.torch
    gen = torch.Generator(device="cuda").manual_seed(1234)
    q, k, v = (torch.randn(16, 8, 128, dtype=dtype, device="cuda", generator=gen) for _ in range(3))
    res = {"shape": "qo=kv=16, 8 heads, head_dim 128", "calls": n}
    F = torch.nn.functional
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    sdpa = lambda: F.scaled_dot_product_attention(qs, ks, vs)  # noqa: E731
    if ctx.pfa is None:
        res["torch_sdpa_us"] = ctx.host_overhead_interleaved_us({"sdpa": sdpa}, n)["sdpa"]
        res["error"] = ctx.pfa_error
        return res
    out = torch.empty_like(q)
    try:
        # interleaved rounds: SDPA and both pfa calls see the same phases of the host's speed
        us = ctx.host_overhead_interleaved_us({"sdpa": sdpa, "pfa": lambda: ctx.pfa(q, k, v),
                                               "pfa_out": lambda: ctx.pfa(q, k, v, out=out)}, n)
        res["torch_sdpa_us"], res["pfa_us"], res["pfa_out_us"] = us["sdpa"], us["pfa"], us["pfa_out"]
    except Exception as e:
        res["error"] = _short_err(e)
        res["torch_sdpa_us"] = ctx.host_overhead_interleaved_us({"sdpa": sdpa}, n)["sdpa"]
    return res


def _fmt(x, spec=".1f", width=7):
    return f"{'-':>{width}}" if x is None else f"{x:>{width}{spec}}"


def _table(rows, batch) -> str:
    fi = any(r.get("fi_tflops") for r in rows)  # FlashInfer's columns only when it was timed
    head = (f"{'hd':>4} {'seq':>6} {'causal':>6} {'h':>3} | {'pfa':>7} {'flash':>7} {'cudnn':>7} "
            + (f"{'fi':>7} " if fi else "")
            + f"{'pfa/fl':>6} {'pfa/cu':>6} " + (f"{'pfa/best':>8} " if fi else "")
            + f"{'maxdiff':>8} | {'fp8':>7} {'fp8/pfa':>7}")
    if batch:
        head += f" | {'b':>3} {'pfa*b':>7} {'flash*b':>7} {'cudnn*b':>7} {'pfa/cu':>6}"
    backends = "/".join(sorted({r.get("fi_backend") for r in rows} - {None}))
    lines = ["TFLOP/s (single request; *b = 16384-token batch, pfa as b sequential calls; fp8 = e4m3 q/k/v, "
             "bf16 out, same rounds as pfa"
             + (f"; fi = FlashInfer {backends}, best = the faster of cuDNN and it" if fi else "") + ")", head,
             "-" * len(head)]
    for r in rows:
        line = (f"{r['head_dim']:>4} {r['seq']:>6} {str(r['causal']):>6} {r['heads']:>3} | "
                f"{_fmt(r['pfa_tflops'])} {_fmt(r['flash_tflops'])} {_fmt(r['cudnn_tflops'])} "
                + (f"{_fmt(r.get('fi_tflops'))} " if fi else "")
                + f"{_fmt(r['pfa_over_flash'], '.2f', 6)} {_fmt(r['pfa_over_cudnn'], '.2f', 6)} "
                + (f"{_fmt(r.get('pfa_over_best'), '.2f', 8)} " if fi else "")
                + f"{_fmt(r.get('pfa_max_abs_diff'), '.1e', 8)} | "
                f"{_fmt(r.get('fp8_tflops'))} {_fmt(r.get('fp8_over_pfa'), '.2f', 7)}")
        if batch:
            line += (f" | {r['batch']:>3} {_fmt(r.get('pfa_b_tflops'))} "
                     f"{_fmt(r.get('flash_b_tflops'))} {_fmt(r.get('cudnn_b_tflops'))} "
                     f"{_fmt(r.get('pfa_b_over_cudnn'), '.2f', 6)}")
        if r["errors"]:
            line += "  !"
        lines.append(line)
    return "\n".join(lines)


def run_prefill(args) -> int:
    ctx = _Ctx()
    torch = ctx.torch
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    seqs = args.seqs or (QUICK_SEQS if args.quick else FULL_SEQS)
    head_dims = args.head_dims or HEAD_DIMS
    causals = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    batch = not (args.quick or args.no_batch)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    meta = {
        "device": props.name, "sm_count": props.multi_processor_count,
        "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
        "dtype": args.dtype, "tokens": args.tokens, "hidden": args.hidden,
        "warmup": args.warmup, "rep": args.rep, "rounds": ROUNDS, "l2_flush": True, "rel_tol": REL_TOL,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    meta["pyflashattn"] = _pfa_version()
    meta["flashinfer"] = getattr(ctx.fi, "__version__", None) if ctx.fi else None
    meta["flashinfer_error"] = ctx.fi_error
    print(f"# {meta['device']} ({meta['sm_count']} SMs), torch {meta['torch']}, "
          f"cuDNN {meta['cudnn']}, {args.dtype}", flush=True)
    if ctx.pfa_error:
        print(f"# pyflashattn unavailable: {ctx.pfa_error}", flush=True)
    if ctx.fi_error:
        print(f"# FlashInfer not timed: {ctx.fi_error}", flush=True)

    gpu_warmup()  # the first row must not pay for an idle GPU's clock ramp
    rows = []
    for hd in head_dims:
        for seq in seqs:
            for causal in causals:
                r = _bench_row(ctx, hd, seq, causal, dtype, args.hidden, args.tokens, batch,
                               args.warmup, args.rep)
                rows.append(r)
                print(f"# hd={hd} seq={seq} causal={causal}: pfa {_fmt(r['pfa_tflops']).strip()} "
                      f"cudnn {_fmt(r['cudnn_tflops']).strip()} fi {_fmt(r.get('fi_tflops')).strip()} "
                      f"fp8 {_fmt(r.get('fp8_tflops')).strip()} TFLOP/s, "
                      f"rel err {_fmt(r.get('pfa_rel_err'), '.2e', 0).strip()}", flush=True)
                torch.cuda.empty_cache()
    host = _host_overhead(ctx, dtype, args.host_calls)

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "host_overhead": host}, f, indent=1)

    for r in rows:
        for e in r["errors"]:
            print(f"! hd={r['head_dim']} seq={r['seq']} causal={r['causal']}: {e}")
    print(f"host overhead per call ({host['shape']}, {host['calls']} calls, no sync between): "
          f"pfa {_fmt(host.get('pfa_us')).strip()} us, pfa out= {_fmt(host.get('pfa_out_us')).strip()} us, "
          f"torch SDPA {_fmt(host.get('torch_sdpa_us')).strip()} us"
          + (f"  [{host['error']}]" if host.get("error") else ""))
    print(_table(rows, batch))
    bad = any(e.startswith("pfa") and "mismatch" in e for r in rows for e in r["errors"])
    return 1 if bad else 0


# ---------------------------------------------------------------------------------------
# prefill-features: what each attention option costs relative to the plain path
# ---------------------------------------------------------------------------------------
FEATURE_SEQS = (4096, 16384)
FEATURE_QUICK_SEQS = (4096,)
FEATURE_HEADS = ((16, 16), (32, 8))  # (num_qo_heads, num_kv_heads): MHA and GQA 32/8
FEATURE_HEAD_DIM = 128
FEATURES = ("plain", "window", "softcap", "alibi", "rope", "mask_packed", "mask_bool")
FEATURE_WINDOW_LEFT = 1024
FEATURE_SOFT_CAP = 30.0
# q ~ N(0, Q_STD^2): with N(0,1) logits a soft cap of 30 changes the output by < 1e-2 relative,
# below bf16 noise, so the check could not tell a working cap from an ignored one. At 3 the
# capped answer moves by ~5-20 % (the timing does not depend on the values).
FEATURE_Q_STD = 3.0
FEATURE_CHECK_ROWS = 128  # rows checked at each end and in the middle (float64 reference)
# A feature must move the checked rows by more than this (relative) away from the plain answer,
# else the check cannot see it: guards against a setting that is silently ignored.
FEATURE_MIN_EFFECT = 2 * REL_TOL  # bf16 noise between correct kernels is ~3e-3


def _feature_kwargs(name: str, mask_bool, mask_packed) -> dict:
    """Call arguments of one feature; every one is causal (the masks are the causal tril)."""
    return {
        "plain": {"causal": True},
        "window": {"causal": True, "window_left": FEATURE_WINDOW_LEFT},
        "softcap": {"causal": True, "logits_soft_cap": FEATURE_SOFT_CAP},
        "alibi": {"causal": True, "pos_encoding_mode": "ALIBI"},
        "rope": {"causal": True, "pos_encoding_mode": "ROPE_LLAMA"},
        "mask_packed": {"packed_custom_mask": mask_packed},
        "mask_bool": {"custom_mask": mask_bool},
    }[name]


def _packbits_little(torch, mask):
    """Independent torch packer (not the library's): bit i of byte j is element 8*j + i."""
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    w = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=mask.device)
    out = torch.empty(flat.numel() // 8, dtype=torch.uint8, device=mask.device)
    step = 1 << 24  # bytes per chunk: bounds the temporaries at 16M x 8 entries
    for i in range(0, out.numel(), step):
        chunk = flat[8 * i: 8 * (i + step)].view(-1, 8).to(torch.uint8)
        out[i: i + step] = (chunk * w).sum(dim=1, dtype=torch.uint8)
    return out


def _rope_f64(torch, x, pos, rope_scale=1.0, rope_theta=1e4):
    """Rotate-half RoPE (FlashInfer ROPE_LLAMA) of x [n, h, d] float64 at positions pos [n]."""
    d = x.shape[-1]
    half = d // 2
    inv = rope_theta ** (-2.0 * torch.arange(half, dtype=torch.float64, device=x.device) / d) / rope_scale
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _feature_ref_rows(torch, q, k, v, rows, feature):
    """Float64 reference for the query rows ``rows`` of one causal (qo_len = kv_len) request,
    with FlashInfer's semantics: soft cap on the scaled logit, ALiBi slope*(kv - q_row), RoPE
    rotate-half at absolute positions, inclusive window from the diagonal. [len(rows), hq, d]."""
    from pyflashattn.testing import alibi_slopes

    s_len, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    sm_scale = 1.0 / d ** 0.5
    qf = q.index_select(0, rows).double()
    kf = k.double()
    kv_idx = torch.arange(s_len, device=q.device)
    if feature == "rope":
        qf = _rope_f64(torch, qf, rows)
        kf = _rope_f64(torch, kf, kv_idx)
    keep = kv_idx[None, :] <= rows[:, None]
    if feature == "window":
        keep &= kv_idx[None, :] >= rows[:, None] - FEATURE_WINDOW_LEFT
    slopes = None
    if feature == "alibi":
        slopes = torch.as_tensor(alibi_slopes(hq), dtype=torch.float64, device=q.device)
        dist = (kv_idx[None, :] - rows[:, None]).double()
    out = torch.empty((rows.numel(), hq, v.shape[-1]), dtype=torch.float64, device=q.device)
    for j in range(hkv):
        qh = qf[:, j * g:(j + 1) * g, :].transpose(0, 1)  # [g, r, d]
        s = (qh @ kf[:, j, :].T) * sm_scale  # [g, r, s]
        if feature == "softcap":
            s = FEATURE_SOFT_CAP * torch.tanh(s / FEATURE_SOFT_CAP)
        if slopes is not None:
            s += slopes[j * g:(j + 1) * g, None, None] * dist[None]
        s.masked_fill_(~keep[None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[:, j * g:(j + 1) * g, :] = (p @ v[:, j, :].double()).transpose(0, 1)
        del s, p
    return out


def _rel(torch, a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _feature_rows(ctx: _Ctx, hq, hkv, seq, warmup, rep):
    torch = ctx.torch
    d = FEATURE_HEAD_DIM
    flops = 4.0 * seq * seq * hq * d / 2  # the causal count, for every feature (see the doc)
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(("features", hq, hkv, seq)).encode()))

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * std).to(torch.bfloat16)

    q = rand(seq, hq, d, std=FEATURE_Q_STD)
    k, v = rand(seq, hkv, d), rand(seq, hkv, d)
    # Masks prepared outside every timed region: the causal tril as bool, and packed (little).
    mask_bool = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril_()
    mask_packed = _packbits_little(torch, mask_bool)
    n = FEATURE_CHECK_ROWS
    mid = torch.randperm(seq - 2 * n, generator=torch.Generator().manual_seed(seq))[:n].to("cuda") + n
    rows = torch.cat([torch.arange(n, device="cuda"), mid.sort().values,
                      torch.arange(seq - n, seq, device="cuda")])

    # SDPA on the full request, causal: the anchor for plain and for the two tril masks.
    sdpa_ref = None
    sdpa_err = None
    try:
        g = hq // hkv
        qs = q.transpose(0, 1).unsqueeze(0)
        ks = k.repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0)
        vs = v.repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0)
        sdpa_ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0].transpose(0, 1)
        del qs, ks, vs
    except Exception as e:  # the float64 rows still check every feature
        sdpa_err = _short_err(e)

    out_rows = []
    plain_rows = None
    for name in FEATURES:
        r = {"num_qo_heads": hq, "num_kv_heads": hkv, "head_dim": d, "seq": seq, "feature": name,
             "flops": flops, "ms": None, "tflops": None, "errors": []}
        out_rows.append(r)
        if ctx.pfa is None:
            r["errors"].append(f"pfa: {ctx.pfa_error}")
            continue
        kw = _feature_kwargs(name, mask_bool, mask_packed)
        try:
            o = ctx.pfa(q, k, v, **kw)
            torch.cuda.synchronize()
            ok = bool(torch.isfinite(o).all())
            if not ok:
                r["errors"].append("pfa: non-finite output")
            o_rows = o.index_select(0, rows)
            ref_name = "plain" if name.startswith("mask") else name
            ref = _feature_ref_rows(torch, q, k, v, rows, ref_name)
            r["rel_err_rows"] = _rel(torch, o_rows, ref)
            if not r["rel_err_rows"] <= REL_TOL:  # NaN fails too
                ok = False
                r["errors"].append(f"pfa: output mismatch vs float64 reference rows, rel "
                                   f"{r['rel_err_rows']:.3g} > {REL_TOL}")
            if name in ("plain", "mask_packed", "mask_bool") and sdpa_ref is not None:
                r["rel_err_sdpa"] = _rel(torch, o, sdpa_ref)
                if not r["rel_err_sdpa"] <= REL_TOL:
                    ok = False
                    r["errors"].append(f"pfa: output mismatch vs SDPA, rel {r['rel_err_sdpa']:.3g}")
            if name == "plain":
                plain_rows = o_rows
            elif not name.startswith("mask") and plain_rows is not None:
                # the feature must change the answer, or the check above proves nothing
                r["effect_vs_plain"] = _rel(torch, o_rows, plain_rows)
                if not r["effect_vs_plain"] > FEATURE_MIN_EFFECT:
                    ok = False
                    r["errors"].append(f"pfa: output barely differs from plain (rel "
                                       f"{r['effect_vs_plain']:.3g}): feature ignored? mismatch")
            del o, ref
            if ok:
                r["ms"] = ctx.bench_ms(lambda: ctx.pfa(q, k, v, **kw), warmup=warmup, rep=rep)
        except Exception as e:
            r["errors"].append(f"pfa: {_short_err(e)}")
        r["tflops"] = _tflops(flops, r["ms"])
    if sdpa_err:
        out_rows[0]["errors"].append(f"sdpa: {sdpa_err}")
    plain_tf = out_rows[0]["tflops"]
    for r in out_rows:
        r["ratio_to_plain"] = _ratio(r["tflops"], plain_tf)
    return out_rows


def _features_table(rows) -> str:
    groups = {}
    for r in rows:
        groups.setdefault((r["num_qo_heads"], r["num_kv_heads"], r["seq"]), {})[r["feature"]] = r
    names = [f[:9] for f in FEATURES]
    head = f"{'heads':>6} {'seq':>6} | " + " ".join(f"{n:>9}" for n in names)
    lines = [f"TFLOP/s and ratio to plain (bf16, head_dim {FEATURE_HEAD_DIM}, causal; FLOPs = causal count "
             f"for every feature)", head, "-" * len(head)]
    for (hq, hkv, seq), fs in groups.items():
        tf = " ".join(_fmt(fs.get(f, {}).get("tflops"), ".1f", 9) for f in FEATURES)
        ra = " ".join(_fmt(fs.get(f, {}).get("ratio_to_plain"), ".2f", 9) for f in FEATURES)
        bad = "  !" if any(fs.get(f, {}).get("errors") for f in FEATURES) else ""
        lines.append(f"{f'{hq}/{hkv}':>6} {seq:>6} | {tf}{bad}")
        lines.append(f"{'':>6} {'':>6} | {ra}")
    return "\n".join(lines)


def run_prefill_features(args) -> int:
    """Cost of each prefill option next to the plain path, ``python -m pyflashattn.bench
    prefill-features [--json PATH] [--quick]``.

    bf16, head_dim 128, 16 q/kv heads (MHA) and 32/8 (GQA), seq 4096 and 16384 (4096 only with
    ``--quick``), one causal request. Timed: plain, window_left=1024, logits_soft_cap=30, ALIBI,
    ROPE_LLAMA, the causal mask as packed_custom_mask (packed outside the timed region) and as a
    bool custom_mask (packed inside every call, as FlashInfer does). TFLOP/s use the causal FLOP
    count (2*s^2*h*d) for every feature, so the numbers compare costs: window's is an effective
    rate (it skips most tiles) and a ratio > 1 just means cheaper than plain.

    Before a number is posted the output is checked: every feature on 384 query rows (first,
    middle, last) against a float64 torch reference with FlashInfer's semantics; plain and the
    masks also against SDPA (causal) on the whole request; window/soft cap/ALiBi/RoPE must also
    differ from plain by > FEATURE_MIN_EFFECT (q ~ N(0, 3^2) so the cap bites). A failing row
    posts no time, so a broken feature cannot post a number.
    """
    ctx = _Ctx()
    torch = ctx.torch
    seqs = FEATURE_QUICK_SEQS if args.quick else FEATURE_SEQS
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    meta = {"device": props.name, "sm_count": props.multi_processor_count, "torch": torch.__version__,
            "dtype": "bf16", "head_dim": FEATURE_HEAD_DIM, "heads": FEATURE_HEADS, "seqs": seqs,
            "features": FEATURES, "window_left": FEATURE_WINDOW_LEFT, "logits_soft_cap": FEATURE_SOFT_CAP,
            "q_std": FEATURE_Q_STD, "warmup": args.warmup, "rep": args.rep, "l2_flush": True,
            "rel_tol": REL_TOL, "min_effect": FEATURE_MIN_EFFECT, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    meta["pyflashattn"] = _pfa_version()
    print(f"# {meta['device']} ({meta['sm_count']} SMs), torch {meta['torch']}, bf16, "
          f"head_dim {FEATURE_HEAD_DIM}", flush=True)
    if ctx.pfa_error:
        print(f"# pyflashattn unavailable: {ctx.pfa_error}", flush=True)
    rows = []
    for hq, hkv in FEATURE_HEADS:
        for seq in seqs:
            rs = _feature_rows(ctx, hq, hkv, seq, args.warmup, args.rep)
            rows.extend(rs)
            print(f"# heads {hq}/{hkv} seq {seq}: " + ", ".join(
                f"{r['feature']} {_fmt(r['tflops']).strip()}" for r in rs) + " TFLOP/s", flush=True)
            torch.cuda.empty_cache()
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    for r in rows:
        for e in r["errors"]:
            print(f"! heads {r['num_qo_heads']}/{r['num_kv_heads']} seq {r['seq']} {r['feature']}: {e}")
    print(_features_table(rows))
    bad = any(e.startswith("pfa") and "mismatch" in e for r in rows for e in r["errors"])
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pyflashattn.bench",
                                description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="op", required=True)
    pp = sub.add_parser("prefill", help="single-request prefill vs torch SDPA (flash, cudnn)")
    pp.add_argument("--quick", action="store_true",
                    help="seq 2048,8192 only and no batch columns")
    pp.add_argument("--json", metavar="PATH", help="write all numbers here")
    pp.add_argument("--head-dims", type=_ints, metavar="LIST", help="default 64,128,256")
    pp.add_argument("--seqs", type=_ints, metavar="LIST",
                    help="default 512,...,16384 (2048,8192 with --quick)")
    pp.add_argument("--causal", choices=("both", "true", "false"), default="both")
    pp.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    pp.add_argument("--tokens", type=int, default=16384, help="batch*seq of the batch columns")
    pp.add_argument("--hidden", type=int, default=2048, help="heads = hidden / head_dim")
    pp.add_argument("--no-batch", action="store_true", help="skip the batch columns")
    pp.add_argument("--warmup", type=int, default=3)
    pp.add_argument("--rep", type=int, default=20)
    pp.add_argument("--host-calls", type=int, default=1000)
    pf = sub.add_parser("prefill-features",
                        help="cost of window/soft cap/ALiBi/RoPE/custom masks vs the plain prefill")
    pf.add_argument("--quick", action="store_true", help="seq 4096 only")
    pf.add_argument("--json", metavar="PATH", help="write all numbers here")
    pf.add_argument("--warmup", type=int, default=3)
    pf.add_argument("--rep", type=int, default=20)
    args = p.parse_args(argv)
    # torch missing / CPU-only / no GPU, no cubins or driver: one line, no traceback (run_if_cuda)
    if args.op == "prefill":
        return run_if_cuda(run_prefill, args)
    if args.op == "prefill-features":
        return run_if_cuda(run_prefill_features, args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
