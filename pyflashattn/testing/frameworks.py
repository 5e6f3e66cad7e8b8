"""Moving test tensors between frameworks bit for bit (torch -> host bits -> CuPy / JAX), so
interop tests compare results across frameworks exactly. torch/CuPy/JAX come in as arguments:
importing this module imports none of them."""
from __future__ import annotations

import numpy as np

__all__ = ["bits", "to_cupy", "to_jax", "jax_gpu", "capture_torch_graph"]


def bits(t) -> np.ndarray:
    """Raw bits of a torch tensor as a host numpy array (uint16 for 16-bit, uint8 for fp8)."""
    import torch

    t = t.contiguous()
    if t.element_size() == 2:
        return t.view(torch.int16).cpu().numpy().view(np.uint16)
    return t.view(torch.uint8).cpu().numpy()


def to_cupy(cupy, t, dtype: str):
    """The same bits as a CuPy array of dtype "fp16" or "bf16" (bf16 needs ml_dtypes; skips the
    calling test when this CuPy or environment cannot hold bf16)."""
    import pytest

    b = bits(t)
    if dtype == "fp16":
        return cupy.asarray(b.view(np.float16))
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="CuPy bf16 arrays need ml_dtypes")
    try:
        return cupy.asarray(b.view(ml_dtypes.bfloat16))
    except Exception as e:  # older CuPy without bf16
        pytest.skip(f"this CuPy has no bfloat16 arrays: {type(e).__name__}: {e}")


def jax_gpu():
    """(jax, jax.numpy, the first JAX GPU device); skips the calling test without JAX or its GPU."""
    import pytest

    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    try:
        return jax, jnp, jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX sees no GPU", allow_module_level=True)  # called at module level by the jax test files


def capture_torch_graph(fn):
    """fn() once on a side stream (warm-up: the first run after a plan orders itself after the
    plan's copy), then captured into a torch CUDA graph, which is returned."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def to_jax(jax, jnp, gpu, t, jdt):
    """The same bits as a JAX array of dtype jdt on device gpu."""
    return jax.lax.bitcast_convert_type(jax.device_put(jnp.asarray(bits(t)), gpu), jdt)
