"""The registry without a GPU: implementation preference per arch, the rows left out of a build,
and the cubin sha256 check (fake manifests and cubins under tmp_path via PFA_CUBIN_DIR)."""
import hashlib
import json
import pathlib
import sys

import pytest

from pyflashattn._runtime import cuda as _cuda, registry as _registry
from pyflashattn._runtime.params_gen import PARAMS_SHA256

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "build_tools"))
import variants  # noqa: E402

H100 = {"cc": (9, 0), "smem_optin": 232448, "sm_count": 132, "smem_per_sm": 233472}
L40 = {"cc": (8, 9), "smem_optin": 101376, "sm_count": 142, "smem_per_sm": 102400}
A100 = {"cc": (8, 0), "smem_optin": 166912, "sm_count": 108, "smem_per_sm": 167936}


def _row(name, arch, impl="sm80", **kw):
    row = {"name": name, "arch": arch, "file": f"{arch}/{name}.cubin", "family": "prefill", "impl": impl,
           "dtype": "bf16", "kv_dtype": "bf16", "head_dim": 128, "block_m": 128, "smem_bytes": 99328,
           "tune": False, "general": False, "paged": False, "decode": False}
    row.update(kw)
    return row


@pytest.fixture
def fake(monkeypatch):
    """fake(rows, props, unbuilt=()) installs a manifest of those rows and a GPU with those properties."""
    def install(rows, props, unbuilt=()):
        monkeypatch.setattr(_registry, "manifest", lambda: {"kernels": rows, "unbuilt": list(unbuilt)})
        monkeypatch.setattr(_cuda, "properties", lambda dev: props)
    return install


def test_impl_preference_orders_the_implementations_within_an_arch(fake, monkeypatch):
    mma = _row("pfa_prefill_sm80_x", "sm_90a", impl="sm80")
    hopper = _row("pfa_prefill_sm90_x", "sm_90a", impl="sm90")
    # a family the arch does not list is never picked by match
    monkeypatch.setitem(_registry.IMPL_PREFERENCE, "sm_90a", ("sm80",))
    fake([mma, hopper], H100)
    assert _registry.find("prefill", 0, dtype="bf16", head_dim=128) is mma
    fake([hopper], H100)
    with pytest.raises(RuntimeError, match="no prefill kernel"):
        _registry.find("prefill", 0, dtype="bf16", head_dim=128)
    # (by name it is found: the tuning sweep and tests name kernels)
    assert _registry.find("prefill", 0, name="pfa_prefill_sm90_x") is hopper
    # Hopper first on sm_90a: picked whatever the manifest order; the other family still serves
    # what the preferred one lacks
    monkeypatch.setitem(_registry.IMPL_PREFERENCE, "sm_90a", ("sm90", "sm80"))
    fake([mma, hopper], H100)
    assert _registry.find("prefill", 0, dtype="bf16", head_dim=128) is hopper
    fake([hopper, mma], H100)
    assert _registry.find("prefill", 0, dtype="bf16", head_dim=128) is hopper
    only_mma = _row("pfa_prefill_sm80_y", "sm_90a", impl="sm80", head_dim=64)
    fake([mma, hopper, only_mma], H100)
    assert _registry.find("prefill", 0, dtype="bf16", head_dim=64) is only_mma
    monkeypatch.setitem(_registry.IMPL_PREFERENCE, "sm_90a", ("sm80", "sm90"))
    assert _registry.find("prefill", 0, dtype="bf16", head_dim=128) is mma


def test_twins_are_picked_only_by_name(fake):
    """A skip-softmax twin matches every field of its shipped row: only a request by name gets it."""
    base = _row("pfa_prefill_sm90_x", "sm_90a", impl="sm90")
    twin = _row("pfa_prefill_sm90_x_skip", "sm_90a", impl="sm90", twin_of="pfa_prefill_sm90_x", skip_softmax_rows=64)
    fake([twin, base], H100)
    assert _registry.find("prefill", 0, dtype="bf16", head_dim=128)["name"] == "pfa_prefill_sm90_x"
    assert _registry.find("prefill", 0, name="pfa_prefill_sm90_x_skip") is twin


def test_every_shipped_sm90_row_has_a_skip_twin():
    rows = [v for v in variants.variants() if isinstance(v, variants.HopperPrefillVariant) and not v.tune
            and v.dtype in ("bf16", "f16")]
    names = {v.name for v in rows}
    shipped = [v for v in rows if not v.skip]
    # a TMA, dense or span row's skip calls run its cp.async row's twin (BatchEngine.skip_sibling)
    assert shipped and all(v.name.removesuffix("_tma").removesuffix("_dense").removesuffix("_span") + "_skip" in names
                           for v in shipped)
    for v in rows:
        m = v.manifest()
        twin = (v.name.removesuffix("_skip") if v.skip else v.name.removesuffix("_dense") if v.dense
                else v.name.removesuffix("_span") if v.span else None)
        assert (m["skip_softmax_rows"], m["twin_of"]) == (64 if v.skip else 0, twin)


def test_fp8_cache_under_a_16bit_query_routes_by_head_dim(fake):
    """The sm90 family's fp8-K/V rows (widened in the kernel) serve lean hd64 / hd128 calls, ragged
    and paged, on sm_90a; hd256 and the general options fall to the sm80 rows."""
    rows = [dict(v.manifest(), name=v.name, arch=a, file=f"{a}/{v.name}.cubin")
            for v in variants.variants() for a in v.archs]
    fake(rows, H100)
    for hd in (64, 128, 256):
        for paged in (False, True):
            for general in (False, True):
                row = _registry.find("prefill", 0, dtype="bf16", kv_dtype="fp8", head_dim=hd, paged=paged,
                                     general=general)
                want = "sm90" if hd <= 128 and not general else "sm80"
                assert (row["impl"], row["kv_dtype"]) == (want, "fp8"), row["name"]
                if want == "sm90":
                    assert row["smem_bytes"] <= H100["smem_optin"] and row["name"] + "_skip" in \
                        {r["name"] for r in rows}


def test_archs_come_before_impls(fake, monkeypatch):
    # an 8.9 GPU walks sm_89 then sm_80: a less preferred family on sm_89 beats a preferred one on sm_80
    monkeypatch.setitem(_registry.IMPL_PREFERENCE, "sm_89", ("new", "sm80"))
    monkeypatch.setitem(_registry.IMPL_PREFERENCE, "sm_80", ("new", "sm80"))
    on89 = _row("k89", "sm_89", impl="sm80")
    on80 = _row("k80", "sm_80", impl="new")
    fake([on80, on89], L40)
    assert _registry.find("prefill", 0, dtype="bf16", head_dim=128) is on89
    fake([on80], L40)
    assert _registry.find("prefill", 0, dtype="bf16", head_dim=128) is on80


def test_portable_rows_and_rows_without_impl_are_found_everywhere(fake):
    merge = {"name": "pfa_merge_bf16", "arch": "sm_80", "file": "sm_80/pfa_merge_bf16.cubin", "family": "merge",
             "impl": variants.PORTABLE, "dtype": "bf16", "threads": 128, "smem_bytes": 0, "tune": False}
    old = _row("old", "sm_80")
    del old["impl"]  # a manifest written before rows named their impl
    fake([merge, old], A100)
    assert _registry.find("merge", 0, dtype="bf16") is merge
    assert _registry.find("prefill", 0, dtype="bf16", head_dim=128) is old


def test_default_preference_covers_the_variant_table():
    assert _registry.PORTABLE == variants.PORTABLE
    for impl, archs in variants.IMPL_ARCHS.items():
        if impl != variants.PORTABLE:
            assert all(impl in _registry.IMPL_PREFERENCE[a] for a in archs), impl
    assert set(_registry.IMPL_PREFERENCE) == set(variants.ARCHS_DEFAULT)
    # the Hopper family first where it is built, the mma.sync family first elsewhere
    assert _registry.IMPL_PREFERENCE["sm_90a"] == (variants.SM90, variants.SM80)
    assert all(_registry.IMPL_PREFERENCE[a] == (variants.SM80,) for a in ("sm_80", "sm_89"))


def test_rows_left_out_of_the_build_say_why(fake):
    # hd256 128-row kernels are not built for sm_80 / sm_89 (shared memory): the device's refusal
    big = _row("pfa_prefill_sm80_bf16_hd256_big", "sm_89", head_dim=256, smem_bytes=218112,
               reason="needs 218112 bytes of shared memory per block; sm_89 allows 101376")
    fake([], L40, unbuilt=[big, dict(big, arch="sm_80", reason="sm_80 ...")])
    with pytest.raises(ValueError, match=r"218112 bytes of shared memory .* allows 101376.*not supported"):
        _registry.find("prefill", 0, dtype="bf16", head_dim=256)
    # a decode tile the host cannot route there: the reason
    tile = _row("pfa_prefill_sm80_bf16_hd256_tile", "sm_80", head_dim=256, smem_bytes=81920, block_m=16,
                decode=True, paged=True, reason="unroutable: the batch wrappers need ...")
    fake([], A100, unbuilt=[tile])
    with pytest.raises(RuntimeError, match=r"hd256_tile is not built for sm_80: unroutable"):
        _registry.find("prefill", 0, dtype="bf16", head_dim=256, decode=True, paged=True)
    # nothing anywhere: how to build
    with pytest.raises(RuntimeError, match=r"no prefill kernel .*`make ARCHS=sm_80`"):
        _registry.find("prefill", 0, dtype="bf16", head_dim=64)


def test_unbuilt_rows_in_manifest_match_the_table():
    """make_manifest.py's unbuilt list: each row of the table that an arch of its impl does not get."""
    for v in variants.variants():
        for arch in variants.IMPL_ARCHS[v.impl]:
            assert (arch in v.archs) is (variants.unbuilt_reason(v, arch) is None), (v.name, arch)


@pytest.fixture
def cubin_tree(tmp_path, monkeypatch):
    """A cubin directory with one fake cubin and its manifest, installed as PFA_CUBIN_DIR."""
    data = b"\x7fELF fake cubin"
    (tmp_path / "sm_90a").mkdir()
    path = tmp_path / "sm_90a" / "pfa_merge_bf16.cubin"
    path.write_bytes(data)
    row = {"name": "pfa_merge_bf16", "arch": "sm_90a", "file": "sm_90a/pfa_merge_bf16.cubin",
           "sha256": hashlib.sha256(data).hexdigest(), "family": "merge", "impl": "portable", "dtype": "bf16",
           "threads": 128, "smem_bytes": 0, "programmatic_launch": False, "tune": False}
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"format": 1, "nvcc": "13.0", "params_sha256": PARAMS_SHA256, "archs": ["sm_90a"], "kernels": [row]}))
    monkeypatch.setenv("PFA_CUBIN_DIR", str(tmp_path))
    monkeypatch.setattr(_registry, "_manifest", None)
    monkeypatch.setattr(_registry, "_manifest_dir", None)
    monkeypatch.setattr(_registry, "_libraries", {})
    monkeypatch.setattr(_registry, "_functions", {})
    monkeypatch.setattr(_registry._local, "cache", {}, raising=False)
    loaded = []
    monkeypatch.setattr(_cuda, "driver", lambda: None)
    monkeypatch.setattr(_cuda, "ensure_context", lambda dev: None)
    monkeypatch.setattr(_cuda, "properties", lambda dev: H100)
    monkeypatch.setattr(_cuda, "load_library", lambda data, what: loaded.append((data, what)) or "LIB")
    monkeypatch.setattr(_cuda, "get_function", lambda lib, name, dev, smem: ("FUNC", lib, name))
    return path, loaded


def test_intact_cubin_loads(cubin_tree):
    path, loaded = cubin_tree
    la = _registry.new_launcher("merge", 0, dtype="bf16")
    assert la.meta["name"] == "pfa_merge_bf16" and loaded == [(path.read_bytes(), "sm_90a/pfa_merge_bf16.cubin")]


def test_tampered_cubin_is_refused(cubin_tree):
    path, loaded = cubin_tree
    path.write_bytes(path.read_bytes() + b"\0")  # rebuilt (or damaged) after the manifest was written
    with pytest.raises(RuntimeError, match=r"pfa_merge_bf16\.cubin.*sha256.*rebuild"):
        _registry.new_launcher("merge", 0, dtype="bf16")
    assert loaded == []


def test_missing_cubin_says_rebuild(cubin_tree):
    path, loaded = cubin_tree
    path.unlink()
    with pytest.raises(RuntimeError, match=r"pfa_merge_bf16\.cubin.*rebuild"):
        _registry.new_launcher("merge", 0, dtype="bf16")


def test_force_family_env_picks_one_family(fake, monkeypatch):
    """PFA_FORCE_FAMILY runs either family on the same call; a bad value names the variable."""
    mma = _row("pfa_prefill_sm80_x", "sm_90a", impl="sm80")
    hopper = _row("pfa_prefill_sm90_x", "sm_90a", impl="sm90")
    fake([mma, hopper], H100)
    monkeypatch.delenv("PFA_FORCE_FAMILY", raising=False)
    assert _registry.find("prefill", 0, dtype="bf16", head_dim=128)["name"] == "pfa_prefill_sm90_x"
    monkeypatch.setenv("PFA_FORCE_FAMILY", "sm80")
    assert _registry.find("prefill", 0, dtype="bf16", head_dim=128)["name"] == "pfa_prefill_sm80_x"
    monkeypatch.setenv("PFA_FORCE_FAMILY", "sm90")
    assert _registry.find("prefill", 0, dtype="bf16", head_dim=128)["name"] == "pfa_prefill_sm90_x"
    fake([mma], A100 | {"cc": (8, 0)})
    with pytest.raises(RuntimeError):  # sm80 GPUs have no sm90 rows: no kernel, said plainly
        _registry.find("prefill", 0, dtype="bf16", head_dim=128)
    monkeypatch.setenv("PFA_FORCE_FAMILY", "sm100")
    with pytest.raises(ValueError, match="PFA_FORCE_FAMILY"):
        _registry.find("prefill", 0, dtype="bf16", head_dim=128)
