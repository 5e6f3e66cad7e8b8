"""Compare prefill tile variants (`make TUNE=1`) on the local GPU: TFLOP/s per variant.

    python build_tools/tune_prefill.py [--seqs 4096,16384] [--json out.json]

Each variant is checked against torch SDPA on the timed shape before its number counts.
Shapes follow the standard sweep: bf16, batch*seq = 16k tokens, heads = 2048 / head_dim.
"""
import argparse
import json

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
    args = ap.parse_args()
    hds = {int(x) for x in args.head_dims.split(",")}
    causals = [bool(int(x)) for x in args.causal.split(",")]
    # Single-prefill candidates only: lean, contiguous, K/V in the query dtype.
    rows = [r for r in _registry.manifest()["kernels"] if r["family"] == "prefill" and r["arch"] == "sm_90a"
            and r["dtype"] == "bf16" and r["kv_dtype"] == "bf16" and not r["general"] and not r["paged"]
            and r["head_dim"] in hds]
    results = []
    for r in sorted(rows, key=lambda r: (r["head_dim"], r["name"])):
        d = r["head_dim"]
        h = 2048 // d
        _registry.force("prefill", r["name"])
        for s in map(int, args.seqs.split(",")):
            q, k, v = (torch.randn(s, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
            for causal in causals:
                o = pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=causal)
                ref = torch.nn.functional.scaled_dot_product_attention(
                    *(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), is_causal=causal)[0].transpose(0, 1)
                err = (o.float() - ref.float()).abs().max().item()
                t = bench_ms(lambda: pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=causal), rep=10)
                tf = 4 * s * s * h * d / (2 if causal else 1) / t / 1e9
                results.append({"name": r["name"], "seq": s, "causal": causal, "tflops": tf, "max_err": err})
                print(f"{r['name']:48s} s={s:6d} causal={int(causal)} {tf:7.1f} TFLOP/s  err {err:.1e}"
                      f"{'  BAD' if not err < 0.05 else ''}", flush=True)
    _registry.force("prefill", None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
