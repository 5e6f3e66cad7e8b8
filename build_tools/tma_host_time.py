"""run() host time of a batch plan on the sm90 cp.async kernel against its TMA twin, on the
simulated driver (CPU only, no GPU): the Python side of run(), which is all the tensor maps add
(the driver's launch costs the same for both kernels).

    python build_tools/tma_host_time.py [--calls 20000] [--rounds 5]
    python build_tools/tma_host_time.py --gpu [--calls 2000]     (the real driver; `make TUNE=1`)

Times w.run(q, ...) of a 16-request plan (32 / 8 heads, hd128) on the torch fast path (the fake
torch module), ragged and paged (page 16), each kernel with the same K/V every call (a benchmark
loop) and with K/V alternating between two tensor pairs (serving: a ragged batch's K/V are new
tensors every step, so every run() repoints the maps). Prints the best of the rounds in us per
call and the TMA / cp.async ratios.

--gpu: the same comparison with torch tensors on the GPU (bench_util.host_overhead_interleaved_us:
wall time of back-to-back run() calls, the candidates in rotating rounds), on 4 requests of 32
tokens so the kernels stay shorter than the host's side of a call.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import variants  # noqa: E402

from pyflashattn._engine import routing, tma  # noqa: E402
from pyflashattn.testing.fake_driver import FakeEnv, FakeTorch, Paged, Ragged  # noqa: E402

HQ, HKV, D, B, PS = 32, 8, 128, 16, 16


def _setup(mp):
    rows = variants.variants(tune=True)
    env = FakeEnv(mp, rows)
    env.use_sm90_rows(mp, rows)
    ft = FakeTorch(env)
    mp.setitem(sys.modules, "torch", ft.module)
    from pyflashattn._runtime import tensor as _tensor
    mp.setattr(_tensor, "_TORCH_STRIDED", {"torch.strided"})
    mp.setattr(_tensor, "_TORCH_BY_NAME", {})
    return env, ft


def _time_runs(env, ft, kind: str, kv_load: str, alternate: bool, calls: int) -> float:
    os.environ[routing.KV_LOAD_ENV] = kv_load
    lens = np.full(B, 1024, np.int32)
    qo = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    tq = int(qo[-1])
    ws = env.dev(64 << 20)
    q, o = ft.tensor((tq, HQ, D), "bfloat16"), ft.tensor((tq, HQ, D), "bfloat16")
    if kind == "ragged":
        w = Ragged(ws, "NHD")
        w.plan(qo, qo, HQ, HKV, D, q_data_type="bfloat16")
        pairs = [(ft.tensor((tq, HKV, D), "bfloat16"), ft.tensor((tq, HKV, D), "bfloat16")) for _ in range(2)]
    else:
        w = Paged(ws, "NHD")
        pages = tq // PS
        w.plan(qo, qo // PS, np.arange(pages, dtype=np.int32), np.full(B, PS, np.int32), HQ, HKV, D, PS,
               q_data_type="bfloat16")
        pairs = [(ft.tensor((pages, PS, HKV, D), "bfloat16"), ft.tensor((pages, PS, HKV, D), "bfloat16"))
                 for _ in range(2)]
    assert bool(w._engine.attn.meta.get("tma")) is (kv_load == "tma"), w._engine.attn.name
    run = (lambda k, v: w.run(q, k, v, out=o)) if kind == "ragged" else (lambda k, v: w.run(q, (k, v), out=o))
    for k, v in pairs:
        run(k, v)  # the full path: validates, remembers the fast signature
    seq = [pairs[i % 2] if alternate else pairs[0] for i in range(calls)]
    env.cu.launches.clear()
    t = time.perf_counter()
    for k, v in seq:
        run(k, v)
    dt = (time.perf_counter() - t) / calls * 1e6
    env.cu.launches.clear()
    return dt


def gpu_main(calls: int) -> int:
    import itertools

    import torch

    import pyflashattn
    from pyflashattn.testing.bench_util import host_overhead_interleaved_us

    lens = np.full(4, 32, np.int32)
    qo = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    tq, pages = int(qo[-1]), int(qo[-1]) // PS
    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    q = torch.randn(tq, HQ, D, dtype=torch.bfloat16, device="cuda")
    o = torch.empty_like(q)
    fns, names = {}, {}
    for kind in ("ragged", "paged"):
        shape = (tq, HKV, D) if kind == "ragged" else (pages, PS, HKV, D)
        pairs = [tuple(torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2)) for _ in range(2)]
        for kv_load in ("cpasync", "tma"):
            os.environ[routing.KV_LOAD_ENV] = kv_load
            if kind == "ragged":
                w = pyflashattn.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
                w.plan(qo, qo, HQ, HKV, D, causal=True, q_data_type=torch.bfloat16)
            else:
                w = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
                w.plan(qo, qo // PS, np.arange(pages, dtype=np.int32), np.full(4, PS, np.int32), HQ, HKV, D, PS,
                       causal=True, q_data_type=torch.bfloat16)
            names[(kind, kv_load)] = w._engine.attn.name
            for alternate in (False, True):
                seq = itertools.cycle(pairs if alternate else pairs[:1] * 2)
                if kind == "ragged":
                    fn = (lambda w, seq: lambda: w.run(q, *next(seq), out=o))(w, seq)
                else:
                    fn = (lambda w, seq: lambda: w.run(q, next(seq), out=o))(w, seq)
                fn()
                fn()
                fns[(kind, alternate, kv_load)] = fn
    os.environ.pop(routing.KV_LOAD_ENV, None)
    us = host_overhead_interleaved_us(fns, calls)
    print(f"run() host time on {torch.cuda.get_device_name()}, torch fast path, 4 x 32 tokens, median of 5 "
          f"rotating rounds x {calls} calls")
    print(f"kernels: {names}\n(tensor-map address field learned: {tma._FIELD})\n")
    return _print_table(us)


def _print_table(us: dict) -> int:
    """The markdown table of run() us per (plan, K/V reuse, load) and the TMA / cp.async ratios."""
    print("| plan | K/V | cp.async us | TMA us | TMA / cp.async |\n|---|---|---:|---:|---:|")
    for kind in ("ragged", "paged"):
        for alternate in (False, True):
            c, t = us[(kind, alternate, "cpasync")], us[(kind, alternate, "tma")]
            print(f"| {kind} | {'new each call' if alternate else 'same'} | {c:.2f} | {t:.2f} | {t / c:.3f} |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gpu", action="store_true", help="torch tensors and the real driver (a GPU machine)")
    args = ap.parse_args(argv)
    if args.gpu:
        return gpu_main(args.calls)
    best: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        env, ft = _setup(mp)
        for _ in range(args.rounds):
            for kind in ("ragged", "paged"):
                for alternate in (False, True):
                    for kv_load in ("cpasync", "tma"):
                        key = (kind, alternate, kv_load)
                        us = _time_runs(env, ft, kind, kv_load, alternate, args.calls)
                        best[key] = min(best.get(key, us), us)
        os.environ.pop(routing.KV_LOAD_ENV, None)
    print(f"run() host time on the fake driver, torch fast path, best of {args.rounds} rounds x {args.calls} calls")
    print(f"(tensor-map address field learned: {tma._FIELD})\n")
    return _print_table(best)


if __name__ == "__main__":
    sys.exit(main())
