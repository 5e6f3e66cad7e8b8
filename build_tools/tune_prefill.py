"""Compare prefill tile variants (`make TUNE=1`) on the local GPU: TFLOP/s per variant.

    python build_tools/tune_prefill.py [--seqs 4096,16384] [--fp8] [--rounds 2] [--names c2s2_pp,_tma]
                                       [--json out.json]
    python build_tools/tune_prefill.py --batch [--page-sizes 16,64] [--causal 0,1] [--lengths 32,32,32,32]
                                       [--json out.json]

Each variant is checked against torch SDPA on the timed shape before its number counts.
Shapes follow the standard sweep: bf16, batch*seq = 16k tokens, heads = 2048 / head_dim.

--batch: the sm90 K/V loads side by side (cp.async against the TMA twins, PFA_SM90_KV_LOAD) on
`python -m pyflashattn.bench batch`'s 16-request batch (lengths 512..4096, 32 / 8 heads, hd128,
bf16), ragged and paged (pages in random order), every kernel checked against SDPA per request,
then timed in interleaved rounds (bench_util.interleaved_median_ms) so both loads see the same
clocks.
"""
import argparse
import json
import os

import torch

import pyflashattn
from pyflashattn._runtime import registry as _registry
from pyflashattn.testing.bench_util import bench_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="4096,16384")
    ap.add_argument("--json")
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--causal", default="0,1", help="which of non-causal (0) / causal (1) to time")
    ap.add_argument("--batch", action="store_true", help="A/B the sm90 K/V loads on batch prefill")
    ap.add_argument("--fp8", action="store_true", help="the sm90 fp8 prefill rows (e4m3 q / k / v, bf16 out)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the sweep (the variants alternate per round)")
    ap.add_argument("--names", default="", help="only rows whose name contains one of these (comma-separated)")
    ap.add_argument("--page-sizes", default="16", help="--batch: the paged cache's page sizes")
    ap.add_argument("--rep", type=int, default=30, help="--batch: timed repetitions per kernel")
    ap.add_argument("--lengths", default="uniform16",
                    help="--batch: a named batch of bench batch (uniform16, skewed) or request lengths, e.g. 32,32,32,32")
    args = ap.parse_args()
    hds = {int(x) for x in args.head_dims.split(",")}
    causals = [bool(int(x)) for x in args.causal.split(",")]
    if args.batch:
        return batch_ab(args, causals)
    # Single-prefill candidates only: lean, contiguous, K/V in the query dtype.
    dt = "e4m3" if args.fp8 else "bf16"
    names = [x for x in args.names.split(",") if x]
    rows = [r for r in _registry.manifest()["kernels"] if r["family"] == "prefill" and r["arch"] == "sm_90a"
            and r["dtype"] == dt and r["kv_dtype"] == dt and not r["general"] and not r["paged"]
            and r["head_dim"] in hds and not r.get("skip_softmax_rows")
            and (not names or any(n in r["name"] for n in names))]
    results = []
    rows = sorted(rows, key=lambda r: (r["head_dim"], r["name"]))
    for rnd in range(args.rounds):
        for r in (rows if rnd % 2 == 0 else rows[::-1]):
            results += _time_row(r, args, causals, rnd)
    _registry.force("prefill", None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def _time_row(r, args, causals, rnd):
    """One row forced for single prefill at each --seqs x causal: checked against SDPA (on the fp8
    values widened to bf16 for --fp8: the kernels round P to e4m3, so a looser bound), then timed."""
    d = r["head_dim"]
    h = 2048 // d
    out = []
    _registry.force("prefill", r["name"])
    for s in map(int, args.seqs.split(",")):
        q, k, v = (torch.randn(s, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        if args.fp8:
            q, k, v = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
        o_kw = {"o_dtype": torch.bfloat16} if args.fp8 else {}
        for causal in causals:
            def call():
                return pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=causal, **o_kw)
            o = call()
            ref = torch.nn.functional.scaled_dot_product_attention(
                *(x.to(torch.bfloat16).transpose(0, 1).unsqueeze(0) for x in (q, k, v)),
                is_causal=causal)[0].transpose(0, 1)
            err = (o.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)
            t = bench_ms(call, rep=10)
            tf = 4 * s * s * h * d / (2 if causal else 1) / t / 1e9
            bad = not err < (0.1 if args.fp8 else 0.05)
            out.append({"name": r["name"], "seq": s, "causal": causal, "tflops": tf, "rel_err": err, "round": rnd})
            print(f"{r['name']:52s} s={s:6d} causal={int(causal)} {tf:7.1f} TFLOP/s  rel err {err:.1e}"
                  f"{'  BAD' if bad else ''}", flush=True)
    return out


def batch_ab(args, causals):
    from pyflashattn._engine.routing import KV_LOAD_ENV
    from pyflashattn.bench import batch as bb
    from pyflashattn.testing.bench_util import gpu_warmup, interleaved_median_ms

    ctx = bb._Ctx()
    lens = ([int(x) for x in args.lengths.split(",")] if args.lengths[:1].isdigit()
            else bb.batch_lengths(args.lengths))
    qi = bb._indptr(lens)
    g = bb.HQ // bb.HKV
    results, errors = [], []
    gpu_warmup()
    for causal in causals:
        q, k, v = bb._make_inputs(ctx, lens, 1234 + causal)
        refs = []
        for i in range(len(lens)):
            s0, s1 = int(qi[i]), int(qi[i + 1])
            qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (
                q[s0:s1], k[s0:s1].repeat_interleave(g, dim=1), v[s0:s1].repeat_interleave(g, dim=1)))
            refs.append(ctx.sdpa(qs, ks, vs, causal)[0].transpose(0, 1))
        flops = sum(bb.request_flops(n, n, causal) for n in lens)
        timers, names = {}, {}
        for storage in ["ragged"] + [f"paged{ps}" for ps in map(int, args.page_sizes.split(","))]:
            if storage != "ragged":
                page_size = int(storage[5:])
                cache, kv_indptr, indices, last = bb._paged_cache(ctx, lens, k, v, 77, page_size)
            for load in ("cpasync", "tma"):
                os.environ[KV_LOAD_ENV] = load  # read when a plan routes
                out = torch.empty_like(q)
                if storage == "ragged":
                    w = pyflashattn.BatchPrefillWithRaggedKVCacheWrapper(ctx.ws, "NHD")
                    w.plan(qi, qi, bb.HQ, bb.HKV, bb.HEAD_DIM, causal=causal, q_data_type=torch.bfloat16)
                    kv = (k, v)
                else:
                    w = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(ctx.ws, "NHD")
                    w.plan(qi, kv_indptr, indices, last, bb.HQ, bb.HKV, bb.HEAD_DIM, page_size, causal=causal,
                           q_data_type=torch.bfloat16)
                    kv = (cache,)
                key = f"{storage} {load}"
                names[key] = w._engine.attn.name
                w.run(q, *kv, out=out)
                torch.cuda.synchronize()
                rel = bb._check_per_request(ctx, out, refs, qi)
                if not rel <= bb.REL_TOL:
                    errors.append(f"{key} ({names[key]}): worst request rel err {rel:.3g} vs SDPA")
                    continue
                timers[key] = (lambda w, kv, out: lambda wu, r: ctx.bench_samples_ms(
                    lambda: w.run(q, *kv, out=out), warmup=wu, rep=r))(w, kv, out)
        os.environ.pop(KV_LOAD_ENV, None)
        for key, ms in interleaved_median_ms(timers, 3, args.rep, errors).items():
            tf = flops / ms / 1e9
            results.append({"kernel": names[key], "case": key, "causal": causal, "ms": ms, "tflops": tf})
            print(f"{key:16s} causal={int(causal)} {names[key]:52s} {ms:8.3f} ms {tf:7.1f} TFLOP/s", flush=True)
        by = {(r["case"], r["causal"]): r["tflops"] for r in results}
        for key in timers:
            if key.endswith("tma") and (key.replace("tma", "cpasync"), causal) in by:
                print(f"  {key}: TMA / cp.async = {by[(key, causal)] / by[(key.replace('tma', 'cpasync'), causal)]:.3f}")
        refs.clear()
        torch.cuda.empty_cache()
    for e in errors:
        print("ERROR", e)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"lengths": lens, "results": results, "errors": errors}, f, indent=1)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
