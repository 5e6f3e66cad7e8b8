"""One launch per backend of one prefill shape, for Nsight Compute side-by-side reports.

    ncu --clock-control none -k regex:'pfa_prefill|flash_fwd|cudnn' --set detailed \\
        python build_tools/profile_prefill.py --head-dim 128 --seq 2048

Shape as the benchmark sweep (bf16, one request, heads = 2048 / head_dim, NHD). Each backend runs
exactly once: ncu replays every profiled kernel itself (flushing caches between passes), so no
warm-up is needed and none would stay out of the report.
"""
import argparse

import torch

import pyflashattn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--backends", default="pfa,flash")
    ap.add_argument("--batch", type=int, default=0,
                    help="instead: a batch of this many requests of --seq tokens (32/8 heads), run through the "
                         "ragged wrapper and the paged one (page size 16, pages shuffled)")
    args = ap.parse_args()
    if args.batch:
        return batch(args)
    d, s = args.head_dim, args.seq
    h = 2048 // d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(s, h, d, dtype=torch.bfloat16, device="cuda", generator=g) for _ in range(3))
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for be in args.backends.split(","):
        if be == "pfa":
            pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=args.causal)
        else:
            backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[be]
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=args.causal)
    torch.cuda.synchronize()


def batch(args):
    import numpy as np
    d, s, b, hq, hkv, ps = args.head_dim, args.seq, args.batch, 32, 8, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b * s, hq, d, dtype=torch.bfloat16, device="cuda", generator=g)
    k, v = (torch.randn(b * s, hkv, d, dtype=torch.bfloat16, device="cuda", generator=g) for _ in range(2))
    indptr = np.arange(b + 1, dtype=np.int32) * s
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = pyflashattn.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    w.plan(indptr, indptr, hq, hkv, d, causal=args.causal, q_data_type=torch.bfloat16)
    w.run(q, k, v)
    pages = b * s // ps
    perm = torch.randperm(pages, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    cache = torch.empty(pages, 2, ps, hkv, d, dtype=torch.bfloat16, device="cuda")
    cache[perm.long().cuda(), 0] = k.view(pages, ps, hkv, d)
    cache[perm.long().cuda(), 1] = v.view(pages, ps, hkv, d)
    wp = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    wp.plan(indptr, indptr // ps, perm.numpy(), np.full(b, ps, np.int32), hq, hkv, d, ps, causal=args.causal,
            q_data_type=torch.bfloat16)
    wp.run(q, cache)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
