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


def test_before_rows_by_name_and_arch_and_the_params_check():
    m = {"params_sha256": "abc", "kernels": [{"name": "k1", "arch": "sm_90a"}, {"name": "k1", "arch": "sm_80"},
                                              {"name": "k2", "arch": "sm_90a"}]}
    rows = abk.before_rows(m, "abc")
    assert sorted(rows) == [("k1", "sm_80"), ("k1", "sm_90a"), ("k2", "sm_90a")]
    assert rows[("k1", "sm_80")]["arch"] == "sm_80"
    with pytest.raises(ValueError, match="params layout"):
        abk.before_rows(m, "other")


def test_aliases_run_the_old_kernel_where_the_after_build_launches_a_new_one():
    m = {"params_sha256": "abc", "kernels": [{"name": "k1", "arch": "sm_90a", "file": "k1.cubin"},
                                              {"name": "k1", "arch": "sm_80", "file": "k1_80.cubin"}]}
    rows = abk.before_rows(m, "abc", abk.parse_aliases(["k1_span=k1"]))
    assert rows[("k1_span", "sm_90a")] == {"name": "k1", "arch": "sm_90a", "file": "k1.cubin", "function": "k1"}
    assert rows[("k1_span", "sm_80")]["file"] == "k1_80.cubin" and "function" not in rows[("k1", "sm_90a")]
    with pytest.raises(ValueError, match="no kernel k9"):
        abk.before_rows(m, "abc", {"x": "k9"})
    for bad in ("k1_span", "=k1", "k1_span="):
        with pytest.raises(ValueError, match="NEW=OLD"):
            abk.parse_aliases([bad])


def test_outputs_differ_flags_unwritten_elements_and_distance():
    np = pytest.importorskip("numpy")
    a = np.ones((4, 3))
    assert abk.outputs_differ(a, a.copy()) == 0.0
    assert abk.outputs_differ(a * 1.001, a) == pytest.approx(1e-3)
    nan = a.copy()
    nan[2, 1] = np.nan  # an element the before kernel left unwritten (NaN-poisoned)
    assert abk.outputs_differ(nan, a) == float("inf") and abk.outputs_differ(a, nan) == float("inf")
    assert abk.outputs_differ(a[:2], a) == float("inf")
    assert not abk.outputs_differ(a * 2, a) <= abk.OUTPUT_TOL


def test_every_case_set_has_its_generator():
    assert set(abk.GENERATORS) == set(abk.CASES)


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
            self.meta = {"arch": "sm_90a"}
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
    rows = {("attn", "sm_90a"): {"name": "attn", "file": "attn.cubin", "threads": 384, "smem_bytes": 1000},
            ("merge", "sm_90a"): {"name": "merge", "file": "merge.cubin", "threads": 128, "smem_bytes": 512},
            ("wide", "sm_90a"): {"name": "wide", "file": "attn.cubin", "threads": 256, "smem_bytes": 0},
            ("other_arch", "sm_80"): {"name": "other_arch", "file": "attn.cubin", "threads": 128, "smem_bytes": 0},
            # an alias (--alias attn_twin=attn): the before function is the row's "function"
            ("attn_twin", "sm_90a"): {"name": "attn", "file": "attn.cubin", "threads": 384, "smem_bytes": 1000,
                                      "function": "attn"}}
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
    # the before row's shared memory for its launch, the launcher's own restored after it
    assert cu.calls[2] == ("ex", ("before_func", "merge", 512), 512, 9) and merge._config.sharedMemBytes == 0
    with pytest.raises(RuntimeError, match="no kernel missing"):
        cuda.Launcher("missing", 128, 0)(9)
    with pytest.raises(RuntimeError, match="no kernel other_arch"):  # a row of another arch is not this one's
        cuda.Launcher("other_arch", 128, 0)(9)
    with pytest.raises(RuntimeError, match="256 threads before, 128 after"):
        cuda.Launcher("wide", 128, 0)(9)
    cu.calls.clear()
    cuda.Launcher("attn_twin", 384, 1008)(9)
    assert cu.calls[0][1] == ("before_func", "attn", 1000)


def test_output_tolerance_by_case():
    """e4m3 query cases allow P's e4m3 rounding at another scale; every other case stays at bf16's."""
    assert abk.output_tol("e4m3 hd128 8192 full") == abk.OUTPUT_TOL_FP8
    assert abk.output_tol("trtllm paged e4m3 1x16384 causal") == abk.OUTPUT_TOL_FP8
    assert abk.output_tol("fp8pag uniform16 full") == abk.OUTPUT_TOL  # (a bf16 query over an fp8 cache)
    assert abk.output_tol("ragged uniform16 full") == abk.OUTPUT_TOL < abk.OUTPUT_TOL_FP8


def test_match_selects_cases_by_regular_expression():
    assert abk.case_selected("trtllm contig e4m3 4x4096 full", "")
    assert abk.case_selected("trtllm contig e4m3 4x4096 full", "contig e4m3|e4m3 hd128")
    assert abk.case_selected("e4m3 hd128 8192 causal", "contig e4m3|e4m3 hd128")
    assert not abk.case_selected("trtllm paged bf16 4x4096 causal", "contig e4m3|e4m3 hd128")
