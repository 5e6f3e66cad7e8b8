"""SM clock and board power while one attention kernel runs back to back (GPU machine only).

    python3 build_tools/clock_probe.py [--seconds 2] [--shapes 16384:0,16384:1,4096:0] [--e4m3]

Under the board's power cap a kernel's speed is its cycles per tile times the clock it is allowed:
two kernels with the same cycles can differ by the clock alone, and a fixed-clock profile (ncu's
default) hides that. For each shape (1 x s, 16 heads x 128, bf16; causal 0 / 1) this runs
pyflashattn's single prefill and torch SDPA's cuDNN kernel, each for --seconds in turns (pfa,
cuDNN, pfa, cuDNN), while `nvidia-smi -lms 50` samples the SM clock, the power draw and the
active clock-event reasons; it prints per window the TFLOP/s, the median clock and power, and the
TFLOP/s per GHz (the kernel's work per cycle).

--e4m3: #20's e4m3 rows instead (bench trtllm's 16384 tokens: 16384 / s requests of s, 16 heads x
128, e4m3 Q / K / V into bf16, trtllm_fmha_v2_prefill CONTIGUOUS_Q_KV), pyflashattn against
FlashInfer's fmha_v2 kernel where flashinfer imports (../shared/tools/README.md): a clock gap
(power per FLOP) told apart from a cycle gap.
"""
import argparse
import statistics
import subprocess
import threading
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import pyflashattn

QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"


class Sampler:
    """nvidia-smi in the background; samples(t0, t1) = the (clock MHz, watts, reasons) taken between."""

    def __init__(self):
        self.rows, self.proc = [], subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
            stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                self.rows.append((time.time(), float(parts[0]), float(parts[1]), parts[2]))
            except (ValueError, IndexError):
                pass

    def samples(self, t0, t1):
        return [r[1:] for r in self.rows if t0 <= r[0] <= t1]

    def stop(self):
        self.proc.terminate()


def window(fn, seconds, flops, sampler):
    """Run fn back to back for seconds; TFLOP/s from events, clock / power from the sampler's
    middle 80% (the first and last samples straddle the window's edges)."""
    fn(); torch.cuda.synchronize()
    t0 = time.time(); n = 0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(20):
            fn()
        n += 20
        torch.cuda.synchronize()
    end.record(); end.synchronize()
    t1 = time.time()
    ms = start.elapsed_time(end) / n
    pad = 0.1 * (t1 - t0)
    rows = sampler.samples(t0 + pad, t1 - pad)
    clk = statistics.median(r[0] for r in rows) if rows else float("nan")
    watts = statistics.median(r[1] for r in rows) if rows else float("nan")
    reasons = sorted({r[2] for r in rows})
    return flops / ms / 1e9, clk, watts, reasons


def sdpa_pair(s, causal):
    """(flops, [(name, fn)]): pyflashattn's single prefill and torch SDPA's cuDNN, 1 x s, 16 x 128 bf16."""
    q, k, v = (torch.randn(s, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))  # BHSD, as the peer script
    flops = 4 * s * s * 16 * 128 / (2 if causal else 1)

    def pfa():
        pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=bool(causal))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=bool(causal))
    return flops, [("pfa", pfa), ("cudnn", cudnn)]


def e4m3_pair(s, causal, fi):
    """(flops, [(name, fn)]): trtllm_fmha_v2_prefill on e4m3 inputs into bf16, CONTIGUOUS_Q_KV,
    16384 / s requests of s tokens (bench trtllm's rows), pyflashattn's and (fi given) FlashInfer's."""
    from pyflashattn.bench import trtllm as bt

    b, h = bt.TOKENS // s, bt.HIDDEN // bt.HD
    q, k, v, cum, sl, _, _ = bt._inputs(torch, b, s)
    q, k, v = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
    kv = torch.stack([k, v], 1)
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    common = dict(workspace_buffer=ws, seq_lens=sl, max_q_len=s, max_kv_len=s, bmm1_scale=bt.HD**-0.5,
                  bmm2_scale=1.0, batch_size=b, cum_seq_lens_q=cum, cum_seq_lens_kv=cum,
                  mask_mode="causal" if causal else "padding", out_dtype=torch.bfloat16)
    flops = 4 * b * h * s * s * bt.HD / (2 if causal else 1)
    fns = [("pfa", lambda: pyflashattn.prefill.trtllm_fmha_v2_prefill((q, kv), "CONTIGUOUS_Q_KV", **common))]
    if fi is not None:
        fns.append(("fmha2", lambda: fi.prefill.trtllm_fmha_v2_prefill((q, kv), "CONTIGUOUS_Q_KV", **common)))
    return flops, fns


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--shapes", default="16384:0,16384:1,4096:0")
    ap.add_argument("--e4m3", action="store_true", help="the e4m3 TRT-LLM rows against FlashInfer's fmha_v2")
    args = ap.parse_args()
    torch.manual_seed(0)
    fi = None
    if args.e4m3:
        from pyflashattn.bench import trtllm as bt
        from pyflashattn.testing.bench_util import import_flashinfer

        fi, why = import_flashinfer()
        if fi is None:
            print(f"FlashInfer not timed: {why}")
        else:
            bt._restrict_flashinfer_fmha_v2()
    sampler = Sampler()
    time.sleep(0.5)
    print(f"{'shape':>14} {'kernel':>6} {'TFLOP/s':>8} {'MHz':>6} {'W':>6} {'TF/GHz':>7}  reasons")
    for spec in args.shapes.split(","):
        s, causal = (int(x) for x in spec.split(":"))
        flops, fns = e4m3_pair(s, causal, fi) if args.e4m3 else sdpa_pair(s, causal)
        for name, fn in fns * 2:  # each in turn, twice
            tf, clk, w, reasons = window(fn, args.seconds, flops, sampler)
            print(f"{s:>8} {'causal' if causal else 'full':>5} {name:>6} {tf:8.1f} {clk:6.0f} {w:6.0f} "
                  f"{tf / clk * 1000:7.1f}  {','.join(reasons)}", flush=True)
    sampler.stop()


if __name__ == "__main__":
    main()
