"""pyflashattn.jax on the CPU without JAX's CUDA backend: the import refuses a JAX without
buffer_callback with the version it needs, and the bridge's buffer views (fake XLA buffers)."""
from __future__ import annotations

import importlib
import pathlib
import sys
import types

import pytest

import pyflashattn
from pyflashattn._runtime import dtypes as _dtypes


def _fake_jax(monkeypatch, version: str, with_callback: bool):
    jax = types.ModuleType("jax")
    jax.__version__ = version
    exp = types.ModuleType("jax.experimental")
    jax.experimental = exp
    mods = {"jax": jax, "jax.experimental": exp}
    if with_callback:
        bc = types.ModuleType("jax.experimental.buffer_callback")
        bc.buffer_callback = lambda *a, **k: None
        exp.buffer_callback = bc
        mods["jax.experimental.buffer_callback"] = bc
    else:
        mods["jax.experimental.buffer_callback"] = None  # import fails
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    # pyflashattn.jax and its modules are imported afresh against the fake; afterwards sys.modules
    # and the package attribute are as before (a module first imported here must not outlive the
    # test: a later `import pyflashattn.jax` would get this copy, not the real JAX's)
    pkg = pathlib.Path(pyflashattn.__file__).parent / "jax"
    names = {"pyflashattn.jax"} | {f"pyflashattn.jax.{f.stem}" for f in pkg.glob("*.py") if f.stem != "__init__"}
    names |= {m for m in sys.modules if m.startswith("pyflashattn.jax.")}
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)  # recorded, so teardown restores or removes it
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(pyflashattn, "jax", getattr(pyflashattn, "jax", None), raising=False)


def test_import_names_the_jax_it_needs(monkeypatch):
    _fake_jax(monkeypatch, "0.4.30", with_callback=False)
    with pytest.raises(ImportError, match=r"buffer_callback \(JAX 0\.6\.1 or newer\); this JAX is 0\.4\.30"):
        importlib.import_module("pyflashattn.jax")


def test_buffer_views_of_xla_buffers(monkeypatch):
    _fake_jax(monkeypatch, "0.11.2", with_callback=True)
    from pyflashattn.jax import _bridge

    class Buf:  # what XLA hands a callback: shape, dtype, __cuda_array_interface__
        def __init__(self, shape, ptr):
            self.shape, self.dtype = shape, "uint8"
            self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": "|u1"}

    fp8 = _bridge.XBuf(Buf((3, 4, 8), 0x10000), _dtypes.FLOAT8_E4M3)  # an fp8 array crossing as uint8
    v = _bridge.buffer_view(fp8, 2, offset=32, lead=1)  # the second vmapped slice
    assert (v.ptr, v.shape, v.strides, v.dtype, v.device_id) == (0x10000 + 32, (4, 8), (8, 1), _dtypes.FLOAT8_E4M3, 2)
    assert _bridge.buffer_ptr(fp8) == 0x10000
    assert _bridge.lead_count(fp8, 2) == (1, 3)
    assert _bridge._is_fp8(_dtypes.FLOAT8_E5M2) and not _bridge._is_fp8(_dtypes.UINT8)
    with pytest.raises(TypeError, match="out= is not supported: JAX arrays are immutable"):
        _bridge.no_out("f", out=object())


def test_the_fake_imports_leave_nothing_behind(monkeypatch):
    """After the tests above (and here after a fake import within a nested patch), no
    pyflashattn.jax module imported against a fake JAX remains importable from sys.modules."""
    before = {m for m in sys.modules if m == "pyflashattn.jax" or m.startswith("pyflashattn.jax.")}
    had = hasattr(pyflashattn, "jax")
    with pytest.MonkeyPatch.context() as mp:
        _fake_jax(mp, "0.11.2", with_callback=True)
        importlib.import_module("pyflashattn.jax._bridge")
    after = {m for m in sys.modules if m == "pyflashattn.jax" or m.startswith("pyflashattn.jax.")}
    assert after == before and hasattr(pyflashattn, "jax") == had


def test_poisoned_results_are_the_floating_unaliased_ones(monkeypatch):
    _fake_jax(monkeypatch, "0.11.2", with_callback=True)
    from pyflashattn._runtime import dtypes as dt
    from pyflashattn.jax import _bridge

    outs = [dt.BFLOAT16, dt.FLOAT32, dt.UINT8, dt.INT32, dt.FLOAT8_E4M3, dt.FLOAT4_E2M1_X2, dt.FLOAT16]
    monkeypatch.delenv(_bridge.POISON_ENV, raising=False)
    assert _bridge.poisoned_results(outs, None) == []
    monkeypatch.setenv(_bridge.POISON_ENV, "1")
    assert _bridge.poisoned_results(outs, None) == [0, 1, 4, 6]
    assert _bridge.poisoned_results(outs, {3: 0, 4: 6}) == [1, 4]  # input 3 -> result 0, 4 -> 6: in place
