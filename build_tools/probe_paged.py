"""Where the paged batch's cost goes: bench batch's uniform16 (32 / 8 heads, hd128, bf16) run ragged
(TMA, and cp.async under PFA_SM90_KV_LOAD=cpasync) and paged at page sizes 16 / 32 / 64 (NHD pages
shuffled or in order, HND shuffled), the calls round-robin in one process (L2 flushed before each,
CUDA events), medians over the rounds. Prints TFLOP/s, ragged time / this, and the kernel and grid
each plan launched (the same grid everywhere: only the K/V loads differ).

    PYTHONPATH=. python3 build_tools/probe_paged.py [ROUNDS]
"""
import statistics
import sys
import types

import torch

import pyflashattn as pfa
from pyflashattn.bench import batch as bb
from pyflashattn.testing.bench_util import flush_buffer



KERNELS = {}


CURRENT = [None]


def spy(w, name):
    CURRENT[0] = name


def _install_spy():
    from pyflashattn._engine import batch as eb
    orig = eb.launch.configure_grid

    def configure_grid(la, grid, *a, **k):
        KERNELS[CURRENT[0]] = (la.name, grid)
        return orig(la, grid, *a, **k)
    eb.launch.configure_grid = configure_grid


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    _install_spy()
    lens = bb.batch_lengths("uniform16", quick=True)
    indptr = bb._indptr(lens)
    T = int(sum(lens))
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(T, bb.HQ, bb.HEAD_DIM, dtype=torch.bfloat16, device="cuda", generator=g)
    k, v = (torch.randn(T, bb.HKV, bb.HEAD_DIM, dtype=torch.bfloat16, device="cuda", generator=g) for _ in range(2))
    out = torch.empty_like(q)
    for causal in (False, True):
        flops = sum(bb.request_flops(n, n, causal) for n in lens)
        calls = {}
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        rag = pfa.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        spy(rag, "ragged")
        rag.plan(indptr, indptr, bb.HQ, bb.HKV, bb.HEAD_DIM, causal=causal, q_data_type=torch.bfloat16)
        calls["ragged"] = lambda: rag.run(q, k, v, out=out)
        import os
        os.environ["PFA_SM90_KV_LOAD"] = "cpasync"
        rag2 = pfa.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), "NHD")
        spy(rag2, "ragged cpasync")
        rag2.plan(indptr, indptr, bb.HQ, bb.HKV, bb.HEAD_DIM, causal=causal, q_data_type=torch.bfloat16)
        del os.environ["PFA_SM90_KV_LOAD"]
        calls["ragged cpasync"] = lambda: rag2.run(q, k, v, out=out)
        ref = None
        for layout in ("NHD", "HND"):
            for page in (16, 32, 64):
                for shuffle in (True, False):
                    if layout == "HND" and not shuffle:
                        continue
                    c, kvi, idx, last = bb._paged_cache(types.SimpleNamespace(torch=torch), lens, k, v, 3, page,
                                                        shuffle, layout)
                    w = pfa.BatchPrefillWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8,
                                                                            device="cuda"), layout)
                    spy(w, f"{layout} p{page} {'shuf' if shuffle else 'order'}")
                    w.plan(indptr, kvi, idx, last, bb.HQ, bb.HKV, bb.HEAD_DIM, page, causal=causal,
                           q_data_type=torch.bfloat16)
                    calls[f"{layout} p{page} {'shuf' if shuffle else 'order'}"] = (
                        lambda w=w, c=c: w.run(q, c, out=out))
        outs = {}
        for name, fn in calls.items():
            out.fill_(float("nan"))
            fn()
            outs[name] = out.clone()
        base = outs["ragged"].float()
        for name, o in outs.items():
            err = ((o.float() - base).norm() / base.norm()).item()
            if not err < 1e-2:
                print(f"{name}: differs from ragged by {err:.2e}")
        buf = flush_buffer(torch.device("cuda"))
        times = {n: [] for n in calls}
        for r in range(rounds + 2):
            for name, fn in calls.items():
                buf.zero_()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                if r >= 2:
                    times[name].append(s.elapsed_time(e))
        rag_ms = statistics.median(times["ragged"])
        print(f"uniform16 {'causal' if causal else 'full'} ({rounds} rounds)")
        for name, t in times.items():
            ms = statistics.median(t)
            print(f"  {name:18s} {flops / ms / 1e9:7.1f} TFLOP/s  ragged/this {rag_ms / ms:.3f}  {KERNELS.get(name)}")


if __name__ == "__main__":
    main()
