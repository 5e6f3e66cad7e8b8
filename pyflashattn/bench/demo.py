"""The main job in one command: ``python -m pyflashattn.bench.demo`` (`make demo` builds the cubins for
this GPU first).

Runs a causal GQA prefill (bf16, 4096 tokens, 32 query / 8 kv heads, head_dim 128) on the GPU,
checks output and LSE against the float64 reference, and prints its speed next to torch SDPA
(flash and cuDNN backends) measured in the same run.
"""
import sys


def main() -> int:
    try:
        import torch
    except ImportError:
        print("the demo uses torch to make inputs and to time torch SDPA beside us; install torch")
        return 1
    if not torch.cuda.is_available():
        print("no CUDA GPU visible: pyflashattn runs its kernels on NVIDIA GPUs (sm_80 / sm_89 / sm_90a)")
        return 1
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
