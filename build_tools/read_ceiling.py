"""What the GPU reads per second in the benches' harness, beside our decode over the same bytes.

    python3 build_tools/read_ceiling.py [--json F]

#18's decode goals are ratios to FlashInfer's kernels (B=64 x 4096: 1.05x the better of its
two; B=1 x 32768: 1.3x). A decode call reads its K/V once, so no kernel can beat the rate at
which this GPU streams those bytes in the same harness: L2 flushed by a 256 MB write before each
call (bench_util.bench_samples_ms, whose dirty lines are written back during the call), CUDA
events, median of the repetitions. This tool measures that rate with a plain streaming read
(16-byte loads, several in flight a thread, the grid swept over CTAs a SM and threads a CTA; the
best row is the ceiling), a device-to-device copy (read + write bytes), and the XQA decode of
bench decode's shapes over the same byte counts, in one process. It is a measuring tool: the
read kernel is compiled here by CuPy (NVRTC), never by the library.
"""
from __future__ import annotations

import argparse
import json

READ_SRC = r"""
extern "C" __global__ void stream_read(const uint4* __restrict__ p, unsigned long long n, unsigned* out) {
  unsigned acc = 0;
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {  // four 16-byte loads in flight a thread
    uint4 a = __ldcs(p + i), b = __ldcs(p + i + stride), c = __ldcs(p + i + 2 * stride), d = __ldcs(p + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    uint4 a = __ldcs(p + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9E3779B9u) out[0] = acc;  // keeps the loads; practically never true
}
"""


def read_rates(torch, cp, nbytes: int, sms: int) -> list:
    """(ctas a SM, threads, TB/s) of the streaming read over nbytes, best first."""
    from pyflashattn.testing.bench_util import bench_samples_ms
    import statistics

    kern = cp.RawKernel(READ_SRC, "stream_read")
    buf = torch.randint(0, 1 << 30, (nbytes // 4,), dtype=torch.int32, device="cuda")
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    n16 = nbytes // 16
    rows = []
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    for per_sm in (2, 4, 8, 16):
        for threads in (256, 512, 1024):
            if per_sm * threads > 2048:
                continue

            def call(per_sm=per_sm, threads=threads):
                with stream:
                    kern((sms * per_sm,), (threads,), (buf.data_ptr(), n16, out.data_ptr()))

            ms = statistics.median(bench_samples_ms(call, rep=20))
            rows.append((per_sm, threads, nbytes / ms / 1e9))
    return sorted(rows, key=lambda r: -r[2])


def copy_rate(torch, nbytes: int) -> float:
    from pyflashattn.testing.bench_util import bench_samples_ms
    import statistics

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = statistics.median(bench_samples_ms(lambda: dst.copy_(src), rep=20))
    return 2 * nbytes / ms / 1e9


def decode_rates(torch) -> dict:
    """bench decode's XQA shapes (32 / 8 heads, hd128, page 16, bf16 cache): TB/s of K/V."""
    from pyflashattn.bench import decode_xqa as dx
    from pyflashattn.testing.bench_util import bench_samples_ms
    import pyflashattn as pfa
    import statistics

    res = {}
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    for b, kv in ((64, 4096), (1, 32768)):
        pages = b * kv // dx.PAGE_SIZE
        cache = torch.randn(pages, 2, dx.PAGE_SIZE, dx.HKV, 128, dtype=torch.bfloat16, device="cuda")
        q = torch.randn(b, dx.HQ, 128, dtype=torch.bfloat16, device="cuda")
        bt = torch.randperm(pages, device="cuda").to(torch.int32).view(b, -1)
        sl = torch.full((b,), kv, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        fn = lambda: pfa.decode.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, sl, kv, bmm1_scale=128**-0.5,
                                                               out=out, kv_layout="NHD")
        ms = statistics.median(bench_samples_ms(fn, rep=20))
        res[f"B={b} x {kv}"] = (cache.numel() * 2, cache.numel() * 2 / ms / 1e9)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args(argv)
    import cupy as cp
    import torch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# {torch.cuda.get_device_name(0)}, {sms} SMs; TB/s, L2 flushed before each call")
    report = {"device": torch.cuda.get_device_name(0), "decode": {}, "read": {}, "copy": {}}
    for tag, (nbytes, rate) in decode_rates(torch).items():
        rows = read_rates(torch, cp, nbytes, sms)
        cp_rate = copy_rate(torch, nbytes)
        best = rows[0]
        report["decode"][tag], report["read"][tag], report["copy"][tag] = rate, rows, cp_rate
        print(f"{tag}: {nbytes / 1e6:.0f} MB  xqa decode {rate:.3f}  stream read best {best[2]:.3f} "
              f"({best[0]} CTAs/SM x {best[1]} threads; worst {rows[-1][2]:.3f})  copy (r+w) {cp_rate:.3f}  "
              f"decode / read {rate / best[2]:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
