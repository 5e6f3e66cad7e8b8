"""CPU test fixtures: ``fake`` (a simulated CUDA driver with the variant table's manifest) and
``fake_torch`` (a torch module with just the attributes pyflashattn reads)."""
import pathlib
import sys

import pytest

from pyflashattn._runtime import tensor as _tensor
from pyflashattn.testing.fake_driver import FakeEnv, FakeTorch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "build_tools"))
import variants  # noqa: E402


@pytest.fixture
def fake(monkeypatch):
    return FakeEnv(monkeypatch, variants.variants())


@pytest.fixture
def fake_torch(fake, monkeypatch):
    ft = FakeTorch(fake)
    monkeypatch.setitem(sys.modules, "torch", ft.module)
    monkeypatch.setattr(_tensor, "_TORCH_STRIDED", {"torch.strided"})
    monkeypatch.setattr(_tensor, "_TORCH_BY_NAME", {})  # dtypes cached from a real torch imported earlier
    return ft
