"""GPU timing helpers (torch imported on first use, so CPU-only imports stay cheap).

``bench_ms`` times device work with CUDA events on the current torch stream and flushes L2
between repetitions, so a kernel whose inputs fit in L2 (50 MB on H100, 60 MB on H200) is not
credited with cache-resident reads it would not get in a model. ``host_overhead_us`` measures
the Python-side cost of issuing one call, which events cannot see.
"""

from __future__ import annotations

import statistics
import time

__all__ = ["bench_ms", "bench_samples_ms", "host_overhead_us", "host_overhead_interleaved_us",
           "interleaved_median_ms", "short_error", "import_flashinfer", "gpu_warmup", "L2_FLUSH_BYTES"]

L2_FLUSH_BYTES = 256 << 20

_flush_bufs: dict = {}


def _torch():
    import torch

    return torch


def flush_buffer(device):
    """The device's L2-sized int32 buffer whose zeroing flushes L2 before a timed call (bench_ms,
    build_tools/ab_kernels.py's alternating pairs)."""
    torch = _torch()
    key = str(device)
    buf = _flush_bufs.get(key)
    if buf is None:
        buf = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
        _flush_bufs[key] = buf
    return buf


def bench_samples_ms(fn, *, warmup: int = 3, rep: int = 20, flush_l2: bool = True, device=None):
    """Per-repetition device times (ms) of ``fn()``, measured with CUDA events.

    Each repetition is ``[flush] -> start event -> fn() -> end event`` on the current stream.
    The flush (a 256 MiB write, ~0.1 ms) also gives the host a head start, so launch
    overhead of ``fn`` up to that long is hidden and not counted; use
    :func:`host_overhead_us` for that.
    """
    torch = _torch()
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    buf = flush_buffer(device) if flush_l2 else None
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    for i in range(rep):
        if buf is not None:
            buf.fill_(i)  # a write, so no line stays valid in L2 from the previous rep
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def bench_ms(fn, *, warmup: int = 3, rep: int = 20, flush_l2: bool = True, device=None) -> float:
    """Median device time of ``fn()`` in milliseconds (see :func:`bench_samples_ms`)."""
    return statistics.median(
        bench_samples_ms(fn, warmup=warmup, rep=rep, flush_l2=flush_l2, device=device)
    )


def host_overhead_us(fn, n: int = 1000, *, warmup: int = 20, rounds: int = 5, sync=None) -> float:
    """Host (Python) cost of one ``fn()`` call in microseconds.

    Calls ``fn`` ``n`` times back to back with no synchronisation in between and divides the
    wall time of the loop (stopped before the closing sync) by ``n``; the median over
    ``rounds`` such loops is returned, so one scheduler hiccup does not move it. The problem
    given should be tiny so the device keeps up and a full launch queue never blocks the host.
    ``sync`` defaults to ``torch.cuda.synchronize``.
    """
    return host_overhead_interleaved_us({"fn": fn}, n, warmup=warmup, rounds=rounds, sync=sync)["fn"]


def host_overhead_interleaved_us(fns: dict, n: int = 1000, *, warmup: int = 20, rounds: int = 5,
                                 sync=None) -> dict:
    """:func:`host_overhead_us` of several callables (name -> fn), measured in ``rounds``
    interleaved rounds whose order rotates: the host's speed drifts by up to 2x over seconds on
    the test VMs, and one candidate measured after the other would carry that drift into the
    comparison. Returns the median per name."""
    if sync is None:
        sync = _torch().cuda.synchronize
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    sync()
    per_call = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            fn = fns[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            t1 = time.perf_counter()
            sync()
            per_call[name].append((t1 - t0) / n * 1e6)
    return {name: statistics.median(v) for name, v in per_call.items()}


def gpu_warmup(seconds: float = 1.0, device=None) -> None:
    """Keep the GPU busy with bf16 matmuls for about ``seconds``: an idle GPU takes a while to reach
    its working clocks, and the first row of a benchmark would pay for it (H100, bench_batch without
    it: the first row's ragged column read 338-346 TFLOP/s, 346-360 with it; within the noise, but
    a second of matmuls is cheap insurance)."""
    torch = _torch()
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=device)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize(device)


def short_error(e: BaseException, limit: int = 200) -> str:
    """One line naming an exception, for a benchmark row's error list."""
    return f"{type(e).__name__}: {e}".replace("\n", " ")[:limit]


def import_flashinfer():
    """(the flashinfer module, None) for the benches' same-run comparisons, or (None, why it is not
    timed): switched off by PFA_BENCH_FLASHINFER=0, or the import's error (a missing module, or a
    broken install, which the report names instead of silently leaving FlashInfer's rows out)."""
    import os

    if os.environ.get("PFA_BENCH_FLASHINFER", "1") == "0":
        return None, "PFA_BENCH_FLASHINFER=0"
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - any import failure: the run goes on without it
        return None, short_error(e)
    return flashinfer, None


def interleaved_median_ms(timers: dict, warmup: int, rep: int, errors: list, rounds: int = 3) -> dict:
    """Median time (ms) per candidate of ``timers`` (name -> fn(warmup, rep) returning per-rep
    times), measured in ``rounds`` rounds of about rep / rounds repetitions each, the order rotated
    every round. A candidate that raises is dropped (its error noted), the others go on."""
    names = list(timers)
    samples = {n: [] for n in names}
    per = max(1, -(-rep // rounds))
    for r in range(rounds):
        k = r % len(names) if names else 0
        for n in names[k:] + names[:k]:
            if n not in samples:
                continue
            try:
                samples[n] += timers[n](warmup, per)
            except Exception as e:
                errors.append(f"{n}: {short_error(e)}")
                del samples[n]
    return {n: statistics.median(s) for n, s in samples.items()}


def torch_cuda_problem(prog: str = "pyflashattn bench") -> str | None:
    """One line saying why the benchmarks cannot run here (torch missing, a CPU-only torch, no GPU
    visible to torch), or None when they can."""
    try:
        import torch
    except ImportError:
        return f"{prog} needs PyTorch with CUDA: pip install torch"
    if not torch.cuda.is_available():
        if not getattr(torch.version, "cuda", None):
            return (f"{prog} needs PyTorch with CUDA; torch {torch.__version__} is a CPU-only build: "
                    "pip install torch (a CUDA build)")
        from pyflashattn._runtime import cuda as _cuda

        try:
            found = _cuda.devices()
            why = "the driver lists none; check CUDA_VISIBLE_DEVICES" if not found else "torch sees none"
        except _cuda.DriverError as e:
            why = e.reason
        return f"{prog}: no CUDA GPU found ({why})"
    return None


def run_if_cuda(run, args, prog: str = "pyflashattn bench") -> int:
    """``run(args)`` when torch is installed and sees a CUDA device; else one line on stderr
    saying what is missing and exit code 2 (the benchmarks' common entry). A RuntimeError from
    pyflashattn itself (no cubins, no driver) is also one line, exit code 1."""
    import sys

    problem = torch_cuda_problem(prog)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    try:
        return run(args)
    except RuntimeError as e:
        from pyflashattn._runtime import cuda as _cuda

        if not isinstance(e, _cuda.CudaError) and "`make" not in str(e):
            raise  # neither a driver error nor the registry's "build the cubins" errors: keep the traceback
        text = str(e).strip()
        print(f"{prog}: {text.splitlines()[0] if text else type(e).__name__}", file=sys.stderr)
        return 1


def bench_main(run, argv, *, prog: str, doc: str, quick_help: str, rep: int, add_args=None) -> int:
    """The batch benchmarks' command line (--quick, --json, --warmup, --rep, and whatever
    ``add_args(parser)`` adds), then run_if_cuda."""
    import argparse

    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--json", metavar="PATH", help="write all numbers here")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rep", type=int, default=rep)
    if add_args is not None:
        add_args(p)
    return run_if_cuda(run, p.parse_args(argv))
