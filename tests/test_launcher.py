"""Launchers without a GPU: the plain cuLaunchKernel path, the programmatic (PDL) path for the
split-KV merge and which one the registry picks on which GPU."""
import ctypes
import sys
import pathlib

import pytest

from pyflashattn._runtime import cuda as _cuda, registry as _registry
from pyflashattn._runtime.params_gen import MergeParams

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "build_tools"))
import variants  # noqa: E402


class _Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Attr:
    def __init__(self):
        self.id = None
        self.value = _Obj(programmaticStreamSerializationAllowed=0)


class _Driver:
    """cuLaunchKernel / cuLaunchKernelEx recorders with cuda.bindings' argument shapes."""

    CUresult = _Obj(CUDA_SUCCESS=0, CUDA_ERROR_INVALID_VALUE=1)
    CUlaunchAttributeID = _Obj(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION=6)
    CUlaunchAttribute = _Attr

    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    @staticmethod
    def CUlaunchConfig():
        return _Obj(gridDimX=None, gridDimY=None, gridDimZ=None, blockDimX=None, blockDimY=None, blockDimZ=None,
                    sharedMemBytes=None, hStream=None, attrs=[], numAttrs=None)

    def _params(self, argv_addr):
        argv = ctypes.cast(argv_addr, ctypes.POINTER(ctypes.c_void_p))
        return MergeParams.from_buffer_copy(ctypes.string_at(argv[0], ctypes.sizeof(MergeParams)))

    def cuLaunchKernel(self, func, gx, gy, gz, bx, by, bz, smem, stream, argv_addr, extra):
        self.calls.append(("plain", func, (gx, gy, gz), (bx, by, bz), smem, stream, self._params(argv_addr)))
        return (1 if self.fail else 0,)

    def cuLaunchKernelEx(self, cfg, func, argv_addr, extra):
        attrs = [(a.id, a.value.programmaticStreamSerializationAllowed) for a in cfg.attrs[:cfg.numAttrs]]
        self.calls.append(("ex", func, (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ),
                           (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ), cfg.sharedMemBytes, cfg.hStream,
                           self._params(argv_addr), attrs, extra))
        return (1 if self.fail else 0,)

    def cuGetErrorName(self, err):
        return 0, b"CUDA_ERROR_INVALID_VALUE"


@pytest.fixture
def drv(monkeypatch):
    d = _Driver()
    monkeypatch.setattr(_cuda, "driver", lambda: d)
    return d


def test_programmatic_launcher_sets_the_pdl_attribute_and_follows_grid_and_params(drv):
    la = _cuda.ProgrammaticLauncher("pfa_merge_bf16", "FUNC", MergeParams, 128, 0)
    la.configure((77, 1, 1))
    la.params.rows, la.params.num_kv_chunks = 5, 3
    la(0x1234)
    la.configure((9, 2, 3))
    la.params.rows = 6
    la(0x99)
    (k1, f1, g1, b1, s1, st1, p1, a1, e1), (k2, f2, g2, b2, s2, st2, p2, a2, e2) = drv.calls
    assert k1 == k2 == "ex" and f1 == f2 == "FUNC" and b1 == b2 == (128, 1, 1) and s1 == s2 == 0 and e1 == e2 == 0
    assert (g1, st1, p1.rows, p1.num_kv_chunks) == ((77, 1, 1), 0x1234, 5, 3)
    assert (g2, st2, p2.rows) == ((9, 2, 3), 0x99, 6)
    assert a1 == a2 == [(6, 1)], "programmatic stream serialization must be on"
    assert la.grid == (9, 2, 3)


def test_plain_launcher_uses_cu_launch_kernel(drv):
    la = _cuda.Launcher("pfa_merge_bf16", "FUNC", MergeParams, 128, 0).configure((3, 1, 1))
    la(0x42)
    assert [c[:6] for c in drv.calls] == [("plain", "FUNC", (3, 1, 1), (128, 1, 1), 0, 0x42)]


def test_failed_programmatic_launch_names_the_kernel(monkeypatch):
    d = _Driver(fail=True)
    monkeypatch.setattr(_cuda, "driver", lambda: d)
    la = _cuda.ProgrammaticLauncher("pfa_merge_f16", "FUNC", MergeParams, 128, 0).configure((1, 1, 1))
    with pytest.raises(_cuda.CudaError, match=r"pfa_merge_f16.*programmatic.*CUDA_ERROR_INVALID_VALUE"):
        la(0)


@pytest.mark.parametrize("cc,programmatic", [((9, 0), True), ((8, 9), False), ((8, 0), False)])
def test_registry_launches_the_merge_programmatically_only_on_sm90(monkeypatch, drv, cc, programmatic):
    row = {"name": "pfa_merge_bf16", "file": "x.cubin", "family": "merge", "threads": 128, "smem_bytes": 0,
           "programmatic_launch": True}
    monkeypatch.setattr(_registry, "find", lambda family, dev, **m: row)
    monkeypatch.setattr(_registry, "_library", lambda r, dev: None)
    monkeypatch.setattr(_registry, "_functions", {})
    monkeypatch.setattr(_cuda, "get_function", lambda lib, name, dev, smem: "FUNC")
    monkeypatch.setattr(_cuda, "properties", lambda dev: {"cc": cc, "sm_count": 132})
    la = _registry.new_launcher("merge", 0, dtype="bf16")
    assert isinstance(la, _cuda.ProgrammaticLauncher) is programmatic
    # a kernel without the flag (attention, packbits) is never launched programmatically
    row = dict(row, programmatic_launch=False)
    assert type(_registry.new_launcher("merge", 0, dtype="bf16")) is _cuda.Launcher


def test_only_the_merge_variants_ask_for_programmatic_launch():
    # The flag is a promise about the kernel: it waits (griddepcontrol.wait) before reading
    # anything the kernel ahead of it wrote. Only the merge makes it.
    for v in variants.variants(tune=True):
        assert v.manifest().get("programmatic_launch", False) is isinstance(v, variants.MergeVariant)
