"""One launch of each decode shape of the #18 speed goals, for Nsight Compute reports.

    ncu --clock-control none -k regex:pfa_ --set detailed \\
        python build_tools/profile_decode.py --cases b64_bf16,b64_fp8,b64_nvfp4,b1_bf16,spec8

32 q / 8 kv heads, head_dim 128, page 16 in random order, through xqa_batch_decode_with_kv_cache
(the decode wrapper plans to the same kernels). Each case runs twice: the first call plans (and,
for a new shape, may launch setup kernels), the second is the one to read in the report.
"""
import argparse

import torch

import pyflashattn
from pyflashattn.bench.decode_xqa import _nvfp4_cache

HQ, HKV, PS, HD = 32, 8, 16, 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="b64_bf16,b64_fp8,b64_nvfp4,b1_bf16,b1_fp8,spec8")
    args = ap.parse_args()
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in args.cases.split(","):
        shape, kind = case.split("_") if "_" in case else (case, "bf16")
        batch, kv_len, q_len = {"b64": (64, 4096, 1), "b1": (1, 32768, 1), "spec8": (64, 4096, 8)}[shape]
        pages = batch * kv_len // PS
        codes, sf, wide = _nvfp4_cache(torch, pages, HD, gen)
        cache, cache_sf = {"bf16": (wide, None), "fp8": (wide.to(torch.float8_e4m3fn), None),
                           "nvfp4": (codes, sf)}[kind]
        q = torch.randn(batch * q_len, HQ, HD, dtype=torch.bfloat16, device="cuda", generator=gen)
        bt = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).view(batch, -1)
        sl = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        torch.cuda.nvtx.range_push(case)
        for _ in range(2):
            pyflashattn.decode.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, sl, kv_len, bmm1_scale=HD**-0.5,
                                                              out=out, kv_cache_sf=cache_sf, q_len_per_req=q_len)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print(case, "ok")
        del codes, sf, wide, cache


if __name__ == "__main__":
    main()
