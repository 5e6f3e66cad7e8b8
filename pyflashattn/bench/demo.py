"""The main job in one command: ``python -m pyflashattn.bench.demo`` (`make demo` builds the cubins for
this GPU first).

Runs a causal GQA prefill (bf16, 4096 tokens, 32 query / 8 kv heads, head_dim 128) on the GPU,
checks output and LSE against the float64 reference, and prints its speed next to torch SDPA
(flash and cuDNN backends) measured in the same run.
"""
import sys

PROG = "pyflashattn demo"


def _fail(msg: str, prefix: str = f"{PROG}: ") -> int:
    print(prefix + msg, file=sys.stderr)
    return 1


def local_archs() -> tuple[list[str], str | None]:
    """The build archs of the visible GPUs, in device order without repeats, and why there are
    none (None when there are some). Needs only cuda-bindings and a driver: no torch, no cubins."""
    from pyflashattn._runtime import cuda as _cuda, registry as _registry

    try:
        gpus = _cuda.devices()
    except _cuda.DriverError as e:
        return [], f"no CUDA GPU found ({e.reason})"
    if not gpus:
        return [], "no CUDA GPU found (the driver lists none; check CUDA_VISIBLE_DEVICES)"
    archs = []
    for g in gpus:
        arch = _registry.build_arch(g["cc"])
        if arch is not None and arch not in archs:
            archs.append(arch)
    if not archs:
        found = ", ".join(f"{g['name']} ({g['cc'][0]}.{g['cc'][1]})" for g in gpus)
        return [], f"no supported GPU: {found}; pyflashattn needs compute capability 8.x or 9.0"
    return archs, None


def print_arch() -> int:
    """``--arch``: the local GPUs' build archs (e.g. "sm_90a") on stdout for `make ARCHS=...`."""
    archs, why = local_archs()
    if why is not None:
        return _fail(why)
    print(" ".join(archs))
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in (["-h"], ["--help"]):
        print("usage: python -m pyflashattn.bench.demo [--arch]\n\n" + __doc__.strip() +
              "\n\n--arch: print the local GPU's build arch (sm_80 / sm_89 / sm_90a) and exit")
        return 0
    if argv == ["--arch"]:
        return print_arch()
    if argv:
        return _fail(f"unknown arguments {' '.join(argv)} (usage: python -m pyflashattn.bench.demo [--arch])")
    try:
        import torch
    except ImportError:
        return _fail(f"{PROG} needs PyTorch with CUDA (for its inputs and the SDPA timings): pip install torch",
                     prefix="")
    if not torch.cuda.is_available():
        _, why = local_archs()
        if why is None:
            why = "no CUDA GPU visible to torch" + ("" if torch.version.cuda else
                                                    f" (torch {torch.__version__} is a CPU-only build)")
        return _fail(why)
    try:
        return _run(torch)
    except RuntimeError as e:  # no cubins, no kernel for this GPU, a driver error: one line, no traceback
        return _fail(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)


def _run(torch) -> int:
    import numpy as np

    import pyflashattn
    from pyflashattn.testing.bench_util import bench_ms
    from pyflashattn.testing.reference import attention_ref, to_numpy_f64

    seq, hq, hkv, d = 4096, 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(torch.seed() % (1 << 31))
    q = torch.randn(seq, hq, d, dtype=torch.bfloat16, device="cuda", generator=g)
    k = torch.randn(seq, hkv, d, dtype=torch.bfloat16, device="cuda", generator=g)
    v = torch.randn(seq, hkv, d, dtype=torch.bfloat16, device="cuda", generator=g)
    o, lse = pyflashattn.single_prefill_with_kv_cache_return_lse(q, k, v, causal=True)
    torch.cuda.synchronize()

    heads = [0, 13, 31]  # the float64 reference on a few heads keeps the check quick
    kvh = sorted({h // (hq // hkv) for h in heads})
    o_ref, lse_ref = attention_ref(to_numpy_f64(q[:, [kh * (hq // hkv) + r for kh in kvh for r in range(4)]]),
                                   to_numpy_f64(k[:, kvh]), to_numpy_f64(v[:, kvh]), causal=True)
    cols = [kvh.index(h // 4) * 4 + h % 4 for h in heads]
    err_o = np.abs(to_numpy_f64(o[:, heads]) - o_ref[:, cols]).max()
    err_l = np.abs(to_numpy_f64(lse[:, heads]) - lse_ref[:, cols]).max()
    ok = err_o < 2e-2 and err_l < 1e-2
    print(f"check vs float64 reference (heads {heads}): max |o err| {err_o:.2e}, max |lse err| {err_l:.2e} "
          f"-> {'OK' if ok else 'FAIL'}")

    flops = 4 * seq * seq * hq * d / 2
    t = bench_ms(lambda: pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=True))
    print(f"pyflashattn      {t * 1e3:8.1f} us  {flops / t / 1e9:6.1f} TFLOP/s")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    for name, be in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(be):
                ts = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=True, enable_gqa=True))
            print(f"torch {name:10s} {ts * 1e3:8.1f} us  {flops / ts / 1e9:6.1f} TFLOP/s  (ours: {ts / t:.2f}x)")
        except RuntimeError as e:
            print(f"torch {name}: unavailable ({str(e).splitlines()[0]})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
