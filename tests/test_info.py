"""Errors in the library's own words, on a machine without a GPU: the no-driver error, CPU
tensors, ``python -m pyflashattn`` (the installation report), ``python -m pyflashattn.bench.demo
--arch`` and the benchmarks without torch. The driver is simulated by a fake ``cuda.bindings``
module (or a monkeypatched ``_cuda.devices``); cubins by a temporary manifest (PFA_CUBIN_DIR)."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from pyflashattn._runtime import cuda as _cuda, info as _info
from pyflashattn._runtime.params_gen import PARAMS_SHA256
from pyflashattn.testing import fake_driver as fd

ROOT = pathlib.Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------
# a fake cuda.bindings.driver
# ---------------------------------------------------------------------------------------------
class DynamicLibNotFoundError(RuntimeError):
    """Named like cuda-pathfinder's error for a missing libcuda."""


class _Result:
    CUDA_SUCCESS = 0
    CUDA_ERROR_INSUFFICIENT_DRIVER = 35
    CUDA_ERROR_NO_DEVICE = 100


_NAMES = {0: b"CUDA_SUCCESS", 35: b"CUDA_ERROR_INSUFFICIENT_DRIVER", 100: b"CUDA_ERROR_NO_DEVICE"}


def _install_bindings(monkeypatch, cu_init, driver_version=12040):
    cu = types.ModuleType("cuda.bindings.driver")
    cu.CUresult = _Result
    cu.cuInit = cu_init
    cu.cuGetErrorName = lambda err: (0, _NAMES[err])
    cu.cuDriverGetVersion = lambda: (0, driver_version)
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = cu
    pkg = types.ModuleType("cuda")
    pkg.bindings = bindings
    monkeypatch.setitem(sys.modules, "cuda", pkg)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", cu)
    monkeypatch.setattr(_cuda, "_driver", None)
    monkeypatch.setattr(_cuda, "bindings_version", lambda: "13.5.0")
    return cu


def _no_libcuda(monkeypatch):
    def cu_init(_flags):
        raise DynamicLibNotFoundError('"cuda" is an NVIDIA driver library and can only be found via system '
                                      "search. Ensure the NVIDIA display driver is installed.")

    return _install_bindings(monkeypatch, cu_init)


def test_no_driver_is_one_line_in_our_words(monkeypatch):
    _no_libcuda(monkeypatch)
    with pytest.raises(_cuda.DriverError) as e:
        _cuda.driver()
    msg = str(e.value)
    assert msg == ("pyflashattn cannot run: no NVIDIA driver, libcuda.so.1 not found; cuda-bindings 13.5.0 "
                   "needs an NVIDIA driver for CUDA 13 (r580 or newer)")
    assert "\n" not in msg
    assert isinstance(e.value, _cuda.CudaError) and isinstance(e.value, RuntimeError)
    assert type(e.value.__cause__).__name__ == "DynamicLibNotFoundError"  # the cause stays inspectable
    assert e.value.reason == "no NVIDIA driver, libcuda.so.1 not found"


def test_no_driver_reaches_the_user_from_a_valid_call(monkeypatch):
    import pyflashattn
    from pyflashattn._runtime import dtypes as _dtypes
    from pyflashattn.testing.fake_tensors import fake_cuda_tensor

    _no_libcuda(monkeypatch)
    t = lambda shape, data: fake_cuda_tensor(shape, _dtypes.FLOAT16, None, (2, 0), data)  # noqa: E731
    with pytest.raises(_cuda.DriverError, match="no NVIDIA driver"):
        pyflashattn.single_prefill_with_kv_cache(t((16, 8, 128), 0x10000), t((32, 2, 128), 0x20000),
                                                 t((32, 2, 128), 0x30000))


def test_other_load_failures_keep_their_first_line(monkeypatch):
    def cu_init(_flags):
        raise RuntimeError("Function \"cuInit\" not found\nsecond line")

    _install_bindings(monkeypatch, cu_init)
    with pytest.raises(_cuda.DriverError) as e:
        _cuda.driver()
    assert "could not be loaded: Function \"cuInit\" not found" in str(e.value)
    assert "second line" not in str(e.value)
    assert str(e.value.__cause__).startswith("Function")


@pytest.mark.parametrize("code, words", [
    (100, "the NVIDIA driver sees no GPU (cuInit: CUDA_ERROR_NO_DEVICE"),
    (35, "the NVIDIA driver (CUDA 12.4) is too old or mismatched (cuInit: CUDA_ERROR_INSUFFICIENT_DRIVER)"),
])
def test_cuinit_failures(monkeypatch, code, words):
    _install_bindings(monkeypatch, lambda _flags: (code,))
    with pytest.raises(_cuda.DriverError) as e:
        _cuda.driver()
    assert words in str(e.value) and "needs an NVIDIA driver for CUDA 13" in str(e.value)


def test_missing_bindings(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # import raises ImportError
    monkeypatch.setattr(_cuda, "_driver", None)
    with pytest.raises(_cuda.DriverError, match="pip install 'cuda-bindings") as e:
        _cuda.driver()
    assert isinstance(e.value.__cause__, ImportError)


def test_driver_requirement_reads_the_bindings_version(monkeypatch):
    monkeypatch.setattr(_cuda, "bindings_version", lambda: "12.9.1")
    assert _cuda.driver_requirement() == "cuda-bindings 12.9.1 needs an NVIDIA driver for CUDA 12 (r525 or newer)"


# ---------------------------------------------------------------------------------------------
# CPU tensors on the batch path (single prefill: tests/test_prefill_validation.py)
# ---------------------------------------------------------------------------------------------
def test_batch_run_refuses_a_numpy_q(fake):
    w = fd.paged(fake)
    fd.plan_paged(w)
    with pytest.raises(ValueError) as e:
        w.run(np.zeros((fd.TQ, fd.HQ, fd.D), np.float16), fd.cache_t())
    assert str(e.value) == "q is on the CPU; pyflashattn needs CUDA tensors"
    with pytest.raises(ValueError) as e:
        w.run(fd.q_t(), np.zeros((fd.NPAGES, 2, fd.PS, fd.HKV, fd.D), np.float16), out=fd.out_t())
    assert str(e.value) == "paged_kv_cache is on the CPU; pyflashattn needs CUDA tensors"


# ---------------------------------------------------------------------------------------------
# python -m pyflashattn
# ---------------------------------------------------------------------------------------------
def _manifest(tmp_path, kernels=(("sm_80", 2), ("sm_90a", 3)), params=PARAMS_SHA256):
    rows = [dict(name=f"k{i}", arch=arch, file=f"{arch}/k{i}.cubin", family="prefill")
            for arch, n in kernels for i in range(n)]
    m = dict(format=1, nvcc="13.0, V13.0.88", params_sha256=params, archs=[a for a, _ in kernels],
             built="2026-01-01T00:00:00+00:00", kernels=rows)
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    for r in rows[1:]:  # the first cubin missing
        (tmp_path / r["file"]).parent.mkdir(exist_ok=True)
        (tmp_path / r["file"]).write_bytes(b"")
    return tmp_path


def _lines(text):
    return {ln[:_info._W].strip(): ln[_info._W:] for ln in text.splitlines()}


def test_report_without_a_driver(monkeypatch, tmp_path):
    _no_libcuda(monkeypatch)
    monkeypatch.setenv("PFA_CUBIN_DIR", str(_manifest(tmp_path)))
    text = _info.report("9.9.9")
    got = _lines(text)
    assert got["pyflashattn"] == "9.9.9"
    assert got["cuda-bindings"] == "13.5.0"
    assert got["driver"] == ("none: no NVIDIA driver, libcuda.so.1 not found; cuda-bindings 13.5.0 needs an NVIDIA "
                             "driver for CUDA 13 (r580 or newer)")
    assert got["GPUs"] == "none found"
    assert got["numpy"] == np.__version__
    for fw in ("torch", "cupy", "jax"):
        assert got[fw]  # a version or "not installed"
    assert got["cubins"] == f"{tmp_path}, built 2026-01-01T00:00:00+00:00"
    assert got["sm_80"] == "2 kernels" and got["sm_90a"] == "3 kernels"
    assert "1 cubin files listed in the manifest are missing" in text
    assert got["nvcc"] == "13.0, V13.0.88"
    assert got["params"] == "match this package (params_sha256)"


def test_report_params_mismatch_and_no_cubins(monkeypatch, tmp_path):
    _no_libcuda(monkeypatch)
    monkeypatch.setenv("PFA_CUBIN_DIR", str(_manifest(tmp_path, params="0" * 64)))
    assert _lines(_info.report("0"))["params"].startswith("MISMATCH")
    monkeypatch.setenv("PFA_CUBIN_DIR", str(tmp_path / "nowhere"))
    got = _lines(_info.report("0"))
    assert got["cubins"].startswith("none: pyflashattn has no compiled kernels") and "`make`" in got["cubins"]


def test_report_with_gpus(monkeypatch, tmp_path):
    monkeypatch.setattr(_cuda, "driver_version", lambda: "13.0")
    monkeypatch.setattr(_cuda, "devices", lambda: [
        dict(id=0, name="NVIDIA H100 80GB HBM3", cc=(9, 0)), dict(id=1, name="NVIDIA L4", cc=(8, 9)),
        dict(id=2, name="Tesla T4", cc=(7, 5))])
    monkeypatch.setenv("PFA_CUBIN_DIR", str(_manifest(tmp_path)))
    got = _lines(_info.report("0"))
    assert got["driver"] == "supports CUDA 13.0"
    assert got["GPU 0"] == "NVIDIA H100 80GB HBM3, compute capability 9.0 -> sm_90a, 3 kernels"
    assert got["GPU 1"] == "NVIDIA L4, compute capability 8.9 -> sm_89, no cubins for it: build with `make ARCHS=sm_89`"
    assert got["GPU 2"].startswith("Tesla T4, compute capability 7.5 -> not supported")


def test_python_m_pyflashattn(tmp_path):
    env = dict(os.environ, PFA_CUBIN_DIR=str(_manifest(tmp_path)), PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pyflashattn"], capture_output=True, text=True, env=env, timeout=60)
    took = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    got = _lines(r.stdout)
    assert {"pyflashattn", "cuda-bindings", "driver", "numpy", "torch", "cubins", "params"} <= set(got)
    assert got["sm_90a"] == "3 kernels" and r.stderr == ""
    assert took < 10  # answers in ~0.3 s here; loose for a loaded CI machine


# ---------------------------------------------------------------------------------------------
# python -m pyflashattn.bench.demo --arch, and the demo / benchmarks without torch
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ccs, want", [([(9, 0)], "sm_90a"), ([(8, 9)], "sm_89"), ([(8, 6)], "sm_80"),
                                       ([(8, 0)], "sm_80"), ([(9, 0), (9, 0), (8, 0)], "sm_90a sm_80"),
                                       ([(7, 5), (8, 6)], "sm_80")])
def test_demo_arch(monkeypatch, capsys, ccs, want):
    from pyflashattn.bench import demo

    monkeypatch.setattr(_cuda, "devices", lambda: [dict(id=i, name="GPU", cc=cc) for i, cc in enumerate(ccs)])
    assert demo.main(["--arch"]) == 0
    out = capsys.readouterr()
    assert out.out == want + "\n" and out.err == ""


@pytest.mark.parametrize("ccs, words", [([(7, 5)], "no supported GPU: T (7.5)"), ([(10, 0)], "no supported GPU"),
                                        ([], "no CUDA GPU found (the driver lists none")])
def test_demo_arch_unsupported(monkeypatch, capsys, ccs, words):
    from pyflashattn.bench import demo

    monkeypatch.setattr(_cuda, "devices", lambda: [dict(id=i, name="T", cc=cc) for i, cc in enumerate(ccs)])
    assert demo.main(["--arch"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and out.err.startswith("pyflashattn demo: ")
    assert words in out.err


def test_demo_arch_without_a_driver(monkeypatch, capsys):
    from pyflashattn.bench import demo

    _no_libcuda(monkeypatch)
    assert demo.main(["--arch"]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == "pyflashattn demo: no CUDA GPU found (no NVIDIA driver, libcuda.so.1 not found)\n"


def test_demo_arch_here():
    # the real command on this machine: an arch (GPU machine) or one line on stderr, never a traceback
    r = subprocess.run([sys.executable, "-m", "pyflashattn.bench.demo", "--arch"], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    if r.returncode == 0:
        assert r.stdout.split() and all(a in ("sm_80", "sm_89", "sm_90a") for a in r.stdout.split())
    else:
        assert r.returncode == 1 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith("pyflashattn demo: ")


def test_bench_and_demo_without_torch(monkeypatch, capsys):
    from pyflashattn.bench import batch, decode, demo, prefill

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    for run in (lambda: prefill.main(["prefill", "--quick"]), lambda: prefill.main(["prefill-features"]),
                lambda: batch.main(["--quick"]), lambda: decode.main([])):
        assert run() != 0
        out = capsys.readouterr()
        assert out.err == "pyflashattn bench needs PyTorch with CUDA: pip install torch\n" and out.out == ""
    assert demo.main([]) == 1
    out = capsys.readouterr()
    assert out.err.startswith("pyflashattn demo needs PyTorch with CUDA") and out.err.count("\n") == 1
    assert "pip install torch" in out.err


def test_demo_without_a_gpu(monkeypatch, capsys):
    from pyflashattn.bench import demo

    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(is_available=lambda: False)
    torch.version = types.SimpleNamespace(cuda="13.0")
    monkeypatch.setitem(sys.modules, "torch", torch)
    _no_libcuda(monkeypatch)
    assert demo.main([]) == 1
    assert capsys.readouterr().err == "pyflashattn demo: no CUDA GPU found (no NVIDIA driver, libcuda.so.1 not found)\n"
