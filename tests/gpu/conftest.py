"""GPU tests: marker ``gpu``; everything under tests/gpu is skipped when no CUDA GPU is visible.

The probe never raises: CI and developer machines without a GPU (or without torch) must see
these tests as skipped, not as collection errors.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent

# JAX grabs 75% of GPU memory on first use by default; torch and CuPy share the device in
# this process, so make JAX allocate on demand. Must be set before jax is imported.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# pyflashattn.jax NaN-fills its floating results before each launch (as these tests poison out=):
# an element a kernel leaves unwritten fails the checks instead of passing on reused memory.
os.environ.setdefault("PFA_JAX_POISON_OUTPUTS", "1")


@functools.lru_cache(maxsize=None)
def cuda_gpu_available() -> bool:
    try:
        import torch
    except Exception:
        torch = None
    if torch is not None:
        try:
            return bool(torch.cuda.is_available())
        except Exception:
            return False
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return False
        err, count = driver.cuDeviceGetCount()
        return err == driver.CUresult.CUDA_SUCCESS and count > 0
    except Exception:
        return False


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    # Hooks from a sub-directory conftest still see every collected item: filter by path.
    mine = [it for it in items if _HERE in Path(str(it.path)).resolve().parents]
    for it in mine:
        it.add_marker(pytest.mark.gpu)
    if mine and not cuda_gpu_available():
        skip = pytest.mark.skip(reason="no CUDA GPU visible")
        for it in mine:
            it.add_marker(skip)
