"""build_tools/ab_kernels.py on the CPU: the before manifest's check, the paired statistics and the
launch swap (a stand-in cuda module: which function and shared memory each side launches)."""
import importlib.util
import pathlib
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("ab_kernels", ROOT / "build_tools" / "ab_kernels.py")
abk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(abk)


def test_before_rows_by_name_of_the_arch_and_the_params_check():
    m = {"params_sha256": "abc", "kernels": [{"name": "k1", "arch": "sm_90a"}, {"name": "k1", "arch": "sm_80"},
                                              {"name": "k2", "arch": "sm_90a"}]}
    assert sorted(abk.before_rows(m, "abc", "sm_90a")) == ["k1", "k2"]
    assert abk.before_rows(m, "abc", "sm_80")["k1"]["arch"] == "sm_80"
    with pytest.raises(ValueError, match="params layout"):
        abk.before_rows(m, "other", "sm_90a")


def test_paired_stats_take_each_pairs_ratio():
    st = abk.paired_stats([2.0, 2.2, 1.0, 4.0], [1.0, 2.0, 1.0, 2.0])  # ratios 2, 1.1, 1, 2
    assert st["ratio"] == pytest.approx(1.55) and st["pairs"] == 4
    assert st["q1"] <= st["ratio"] <= st["q3"]
    assert (st["before_ms"], st["after_ms"]) == (2.1, 1.5)
    assert abk.paired_stats([3.0], [2.0])["ratio"] == 1.5
    with pytest.raises(ValueError):
        abk.paired_stats([1.0], [])


class _Cu:
    class CUresult:
        CUDA_SUCCESS = 0

    def __init__(self):
        self.calls = []

    def cuLaunchKernel(self, *args):
        self.calls.append(("plain",) + args)
        return (0,)

    def cuLaunchKernelEx(self, cfg, func, argv, extra):
        self.calls.append(("ex", func, cfg.sharedMemBytes, cfg.hStream))
        return (0,)


def _fake_cuda(cu, loaded):
    class Launcher:
        def __init__(self, name, threads, smem):
            self.name, self.threads, self._cu, self._argv_addr = name, threads, cu, 0xA0
            self._head = ("after_func", 4, 1, 1, threads, 1, 1, smem)

        def __call__(self, stream):
            cu.calls.append(("after", self.name, stream))

    class ProgrammaticLauncher(Launcher):
        def __init__(self, name, threads, smem):
            super().__init__(name, threads, smem)
            self._config = types.SimpleNamespace(sharedMemBytes=smem, hStream=None)

        def __call__(self, stream):
            cu.calls.append(("after_ex", self.name, stream))

    def load_library(data, what):
        loaded.append(what)
        return ("lib", what)

    def get_function(lib, name, dev, smem):
        return ("before_func", name, smem)

    return types.SimpleNamespace(Launcher=Launcher, ProgrammaticLauncher=ProgrammaticLauncher, CudaError=RuntimeError,
                                 load_library=load_library, get_function=get_function)


def test_the_swap_launches_the_before_function_with_its_shared_memory(tmp_path):
    cu, loaded = _Cu(), []
    cuda = _fake_cuda(cu, loaded)
    (tmp_path / "attn.cubin").write_bytes(b"x")
    (tmp_path / "merge.cubin").write_bytes(b"y")
    rows = {"attn": {"name": "attn", "file": "attn.cubin", "threads": 384, "smem_bytes": 1000},
            "merge": {"name": "merge", "file": "merge.cubin", "threads": 128, "smem_bytes": 0},
            "wide": {"name": "wide", "file": "attn.cubin", "threads": 256, "smem_bytes": 0}}
    swap = abk.BeforeKernels(cuda, tmp_path, rows, 0)
    swap.install()
    attn, merge = cuda.Launcher("attn", 384, 1008), cuda.ProgrammaticLauncher("merge", 128, 0)
    attn(7)
    merge(7)
    assert cu.calls == [("after", "attn", 7), ("after_ex", "merge", 7)]
    cu.calls.clear()
    swap.active = True
    attn(9)
    attn(9)
    merge(9)
    assert cu.calls[0] == ("plain", ("before_func", "attn", 1000), 4, 1, 1, 384, 1, 1, 1000, 9, 0xA0, 0)
    assert cu.calls[1] == cu.calls[0] and loaded == ["attn.cubin", "merge.cubin"]  # loaded once each
    assert cu.calls[2] == ("ex", ("before_func", "merge", 0), 0, 9) and merge._config.sharedMemBytes == 0
    with pytest.raises(RuntimeError, match="no kernel missing"):
        cuda.Launcher("missing", 128, 0)(9)
    with pytest.raises(RuntimeError, match="256 threads before, 128 after"):
        cuda.Launcher("wide", 128, 0)(9)
