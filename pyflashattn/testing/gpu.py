"""The GPU test modules' entry check (tests/gpu): skip the whole module, not error, on a machine
without torch or without a visible CUDA GPU (CI runs the suite on such a machine)."""
from __future__ import annotations

__all__ = ["require_cuda_torch"]


def require_cuda_torch():
    """torch, when it sees a CUDA GPU; otherwise skips the calling test module."""
    import pytest

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible", allow_module_level=True)
    return torch
