"""What the GPU test modules (tests/gpu) share: the entry check (skip the whole module, not error,
on a machine without torch or without a visible CUDA GPU, as CI is), seeded CUDA inputs, one
scratch workspace, and the CuPy check of the interop tests. torch is imported only by these
functions, which only GPU tests call."""
from __future__ import annotations

import zlib

__all__ = ["require_cuda_torch", "require_cupy", "cuda_generator", "cuda_randn", "scratch_workspace", "tma_built",
           "select_kv_load", "page_spans"]

WORKSPACE_BYTES = 1 << 28
_WORKSPACE: list = []


def require_cuda_torch():
    """torch, when it sees a CUDA GPU; otherwise skips the calling test module."""
    import pytest

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible", allow_module_level=True)
    return torch


def require_cupy():
    """CuPy with a device; otherwise skips the calling test."""
    import pytest

    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
        return cupy
    except Exception:
        pytest.skip("CuPy not importable or has no device")


def cuda_generator(*key):
    """A CUDA torch.Generator seeded from `key` (the same inputs for the same test case)."""
    import torch

    return torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(key).encode()))


def cuda_randn(shape, g, dtype, scale=1.0):
    """Normal values * scale drawn in float32 on the GPU from generator g, then cast to dtype."""
    import torch

    return (torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) * scale).to(dtype)


def scratch_workspace():
    """One 256 MiB uint8 CUDA buffer for every wrapper and XQA call of the session (the library
    keeps no state in it)."""
    import torch

    if not _WORKSPACE:
        _WORKSPACE.append(torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda"))
    return _WORKSPACE[0]


def tma_built(paged: bool, fp8: bool = False) -> bool:
    """Whether this build has the sm90 TMA K/V twins for paged (else ragged) plans of 16-bit (else
    e4m3) queries: shipped per storage by variants.HOPPER_KV_LOAD / HOPPER_FP8_TMA_SHIPPED, the
    others only in `make TUNE=1` builds. The fp8 rows' twins say nothing about the 16-bit ones'."""
    from pyflashattn._runtime import registry

    return any(r.get("tma") and bool(r.get("paged")) == paged and (r.get("dtype") == "e4m3") == fp8
               for r in registry.manifest()["kernels"])


def twin_built(key: str, head_dim: int = 0) -> bool:
    """Whether this build has paged twins of manifest flag `key` ("dense_kv": the dense twins,
    variants.HOPPER_DENSE_KV; "span_kv": the span twins, HOPPER_SPAN_KV), of head_dim if given."""
    from pyflashattn._runtime import registry

    return any(r.get(key) and head_dim in (0, r.get("head_dim")) for r in registry.manifest()["kernels"])


def select_kv_load(load: str, monkeypatch) -> None:
    """The sm90 family's K/V load for one test: "default" (what the variant table ships), or
    "cpasync" / "tma" forced through PFA_SM90_KV_LOAD (skipped off sm_90a, and "tma" where no TMA
    twin is built); cached routes are dropped so plans pick up the choice."""
    import pytest
    import torch

    from pyflashattn._engine.routing import KV_LOAD_ENV
    from pyflashattn._runtime import registry

    if load != "default":
        if torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the sm90 family's K/V loads are sm_90a only")
        if load == "tma" and not any(r.get("tma") for r in registry.manifest()["kernels"]):
            pytest.skip("no TMA twin is built (make TUNE=1, or variants.HOPPER_KV_LOAD)")
        monkeypatch.setenv(KV_LOAD_ENV, load)
    registry.force("prefill", None)


def page_spans(kv_lens, page_size: int, perm, filler: int):
    """Requests of kv_lens keys laid out on pages in the order perm hands page ids out: (block
    table int32 [B, max pages] padded with filler, [(page id, first key row, end row)] in the
    requests' concatenated key rows), for a test to copy each span's K / V rows into its page."""
    import numpy as np

    pages = [-(-int(n) // page_size) for n in kv_lens]
    table = np.full((len(pages), max(max(pages, default=0), 1)), filler, np.int32)
    spans, c0, used = [], 0, 0
    for b, n in enumerate(kv_lens):
        for j in range(pages[b]):
            pid = int(perm[used])
            used += 1
            table[b, j] = pid
            spans.append((pid, c0 + j * page_size, min(c0 + (j + 1) * page_size, c0 + int(n))))
        c0 += int(n)
    return table, spans
