"""The variant table, the generated kernel sources and the cubin manifest agree."""
import hashlib
import json
import pathlib
import subprocess
import sys

import pytest

from pyflashattn._runtime import params_gen as _params_gen, registry as _registry
from pyflashattn._engine.routing import DECODE_MAX_ROWS

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "build_tools"))
import variants  # noqa: E402


def test_variant_names_unique_and_descriptive():
    for tune in (False, True):
        names = [v.name for v in variants.variants(tune=tune)]
        assert len(names) == len(set(names))
    for v in variants.variants(tune=True):
        if isinstance(v, variants.PrefillVariant):
            assert f"hd{v.head_dim}" in v.name and v.dtype in v.name
            assert v.smem_bytes <= max(variants.SMEM_OPTIN.values())
            assert v.head_dim % 64 == 0 and v.block_n % 16 == 0


def test_every_shipped_head_dim_and_dtype_has_a_kernel():
    shipped = {(v.dtype, v.head_dim) for v in variants.variants() if isinstance(v, variants.PrefillVariant)}
    assert shipped == {(d, h) for d in ("f16", "bf16") for h in (64, 128, 256)}
    assert {v.dtype for v in variants.variants() if isinstance(v, variants.MergeVariant)} == {"f16", "bf16"}


def test_generated_sources_match_table():
    out = subprocess.run([sys.executable, str(ROOT / "build_tools/gen_kernels.py"), "--list"], capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == [v.name for v in variants.variants()]


def test_kernel_needing_more_shared_memory_than_the_gpu_is_refused(monkeypatch):
    # fp8 K/V at head_dim 256 needs ~200 KiB of shared memory per block: more than sm_80's 163 KiB
    row = {"name": "pfa_prefill_x", "arch": "sm_80", "family": "prefill", "dtype": "bf16", "kv_dtype": "fp8",
           "head_dim": 256, "smem_bytes": 204800, "tune": False, "decode": False}
    monkeypatch.setattr(_registry, "manifest", lambda: {"kernels": [row]})
    monkeypatch.setattr(_registry._cuda, "properties", lambda dev: {"cc": (8, 0), "smem_optin": 166912})
    with pytest.raises(ValueError, match=r"204800 bytes of shared memory .* allows 166912"):
        _registry.find("prefill", 0, dtype="bf16", kv_dtype="fp8", head_dim=256)
    monkeypatch.setattr(_registry._cuda, "properties", lambda dev: {"cc": (9, 0), "smem_optin": 232448})
    row["arch"] = "sm_90a"
    assert _registry.find("prefill", 0, dtype="bf16", kv_dtype="fp8", head_dim=256) is row


def test_arch_candidates():
    assert _registry.arch_candidates((9, 0)) == ["sm_90a"]
    assert _registry.arch_candidates((8, 9)) == ["sm_89", "sm_80"]
    assert _registry.arch_candidates((8, 6)) == ["sm_80"]
    assert _registry.arch_candidates((7, 5)) == []


MANIFEST = ROOT / "cubins/manifest.json"


# What routing needs from every kernel row of the manifest (make_manifest.py adds name, arch, file, sha256).
PREFILL_KEYS = {"family", "impl", "arch", "dtype", "kv_dtype", "head_dim", "block_m", "block_n", "warps", "threads",
                "smem_bytes", "ctas_per_sm", "decode", "paged", "general", "rows_fastest", "sha256", "tune", "name",
                "file"}


@pytest.mark.skipif(not MANIFEST.exists(), reason="cubins not built (run make)")
def test_built_manifest_is_consistent():
    m = json.loads(MANIFEST.read_text())
    assert m["params_sha256"] == _params_gen.PARAMS_SHA256
    assert m["nvcc"] != "unknown"
    tune = any(row.get("tune") for row in m["kernels"])
    vs = variants.variants(tune=tune)
    built = {}
    for row in m["kernels"]:
        path = ROOT / "cubins" / row["file"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == row["sha256"], row["file"]
        assert path.read_bytes()[:4] == b"\x7fELF"
        if row["family"] == "prefill":
            assert PREFILL_KEYS <= set(row), row["name"]
        built.setdefault(row["arch"], []).append(row["name"])
    # exactly the rows variants.py builds for each arch, once each; the others listed with a reason
    for arch in m["archs"]:
        assert built[arch] == [v.name for v in vs if arch in v.archs], arch
        assert sorted(r["name"] for r in m["unbuilt"] if r["arch"] == arch) == sorted(
            v.name for v in vs if arch not in v.archs and arch in variants.IMPL_ARCHS[v.impl]), arch
    assert all(r["reason"] for r in m["unbuilt"])


def test_rows_name_their_impl_and_archs():
    for v in variants.variants(tune=True):
        assert v.archs and set(v.archs) <= set(variants.IMPL_ARCHS[v.impl]), v.name
        if isinstance(v, variants.HopperPrefillVariant):
            # the Hopper family: sm_90a only, name and header after its impl
            assert v.impl == variants.SM90 and v.archs == ("sm_90a",) and v.name.startswith("pfa_prefill_sm90_")
            assert v.source().startswith('#include "pfa/attention/prefill_sm90.cuh"\nPFA_DEFINE_PREFILL_SM90(')
            assert v.smem_bytes <= variants.SMEM_OPTIN["sm_90a"], v.name
            continue
        if isinstance(v, variants.HopperFp8PrefillVariant):
            # the fp8 prefill of the Hopper family: its own entry header
            assert v.impl == variants.SM90 and v.archs == ("sm_90a",) and v.name.startswith("pfa_prefill_sm90_e4m3_")
            assert v.source().startswith('#include "pfa/attention/prefill_sm90_fp8.cuh"\nPFA_DEFINE_PREFILL_SM90_FP8(')
            assert v.smem_bytes <= variants.SMEM_OPTIN["sm_90a"], v.name
            continue
        if not isinstance(v, variants.PrefillVariant):
            # merge / packbits: portable, built for every default arch
            assert v.impl == variants.PORTABLE and v.archs == variants.ARCHS_DEFAULT
            continue
        assert v.impl == variants.SM80 and v.name.startswith(f"pfa_prefill_{v.impl}_")
        # a kernel never goes where its shared memory cannot launch
        assert all(v.smem_bytes <= variants.SMEM_OPTIN[a] for a in v.archs), v.name


def test_every_arch_keeps_what_it_can_run():
    """A row is left out of an arch only when it cannot launch there or the host cannot route it:
    a decode tile needs its 128-row lean kernel on that arch (the batch wrappers resolve it first),
    unless it is the 16-row tile over contiguous 16-bit K/V that single prefill launches alone, or
    its K/V storage is decode-only (NVFP4: no 128-row kernel exists, the wrappers take the tiles)."""
    vs = [v for v in variants.variants(tune=True) if isinstance(v, variants.PrefillVariant)]
    lean = {(v.dtype, v.head_dim, v.kv, v.paged): v for v in vs if not v.decode and not v.general and not v.tune}
    for v in vs:
        for arch in variants.ARCHS_DEFAULT:
            fits = v.smem_bytes <= variants.SMEM_OPTIN[arch]
            if not v.decode or v.kv_dtype in variants.DECODE_ONLY_KV:
                assert (arch in v.archs) is fits, (v.name, arch)
                continue
            batch = arch in lean[(v.dtype, v.head_dim, v.kv, v.paged)].archs
            single = v.block_m == 16 and not v.paged and v.kv == v.dtype
            assert (arch in v.archs) is (fits and (batch or single)), (v.name, arch)
    # sm_90a (the largest opt-in) gets everything; every head dim keeps a kernel on every arch
    assert all("sm_90a" in v.archs for v in vs)
    for arch in variants.ARCHS_DEFAULT:
        assert {(v.dtype, v.head_dim) for v in vs if arch in v.archs} == {
            (d, h) for d in variants.DTYPES for h in variants.PREFILL_TILES}


def test_manifest_rows_carry_the_ctas_per_sm_the_host_plans_with():
    for v in variants.variants(tune=True):
        m = v.manifest()
        assert m["impl"] == v.impl and m["threads"] == m["warps"] * 32
        if isinstance(v, variants.PrefillVariant):
            # 128-row tiles: _batch_prefill / _split_kv plan 2 CTAs per SM at <= 128 threads, else 1
            # (the __launch_bounds__ min_blocks); decode tiles: 8, or their min_blocks where registers
            # are capped for more (the host takes fewer where shared memory says)
            want = max(8, v.min_blocks) if v.decode else 2 if v.threads <= 128 else 1
            assert m["ctas_per_sm"] == want, v.name
            if v.decode and v.min_blocks > 8:
                assert v.name.endswith(f"_b{v.min_blocks}_paged") or v.name.endswith(f"_b{v.min_blocks}"), v.name


def test_make_include_lists_each_arch_its_rows():
    sys.path.insert(0, str(ROOT / "build_tools"))
    import gen_kernels
    for tune in (False, True):
        text = gen_kernels.make_include(tune)
        for arch, names in variants.kernels_by_arch(tune=tune).items():
            block = text.split(f"KERNELS_{arch} := \\\n")[1].split("\n\n")[0]
            assert [x.strip(" \\") for x in block.splitlines()] == names, arch
    committed = (ROOT / "kernel_src/generated/kernels.mk").read_text()
    assert committed in (gen_kernels.make_include(False), gen_kernels.make_include(True))


def test_prefill_tiles_are_the_tables_rows():
    """Every shipped kernel has its table's tile (the decode tiles theirs, by K/V storage)."""
    for v in variants.variants():
        if not isinstance(v, variants.PrefillVariant):
            continue
        if not v.decode:
            table = variants.PREFILL_TILES
        elif v.block_m > 16:
            table = {"": variants.WIDE_DECODE_TILES, "fp8": variants.WIDE_DECODE_TILES_FP8,
                     "nvfp4": variants.WIDE_DECODE_TILES_NVFP4}[v.kv_dtype][v.block_m]
        else:
            table = {"": variants.DECODE_TILES, "fp8": variants.DECODE_TILES_FP8,
                     "nvfp4": variants.DECODE_TILES_NVFP4}[v.kv_dtype]
        row = table[v.head_dim]
        assert (v.warps, v.mq, v.block_n, v.q_in_regs, v.stages, v.min_blocks) == row[:6], v.name
        assert v.pair == (len(row) > 7 and row[7]), v.name


def test_decode_tiles_exist_for_every_lean_kernel():
    vs = [v for v in variants.variants() if isinstance(v, variants.PrefillVariant)]
    lean = {(v.dtype, v.head_dim, v.kv, v.paged) for v in vs if not v.general and not v.decode}
    only = variants.DECODE_ONLY_KV
    assert {(v.dtype, v.head_dim, v.kv, v.paged) for v in vs if v.decode and v.kv not in only} == lean
    # decode-only K/V storages (NVFP4): paged decode tiles of every dtype and head dim, wide ones
    # where the fp8 cache has them, and nothing else
    for kv in only:
        assert not [v.name for v in vs if v.kv == kv and (not v.decode or not v.paged or v.general)]
        assert {(v.dtype, v.head_dim, v.block_m) for v in vs if v.kv == kv} == {
            (d, hd, rows) for d in variants.DTYPES for hd in variants.PREFILL_TILES
            for rows in (16, *[r for r, t in variants.WIDE_DECODE_TILES_FP8.items() if hd in t])}
    # the wide tiles (32 / 64 rows) exist for paged or fp8 K/V only (contiguous 16-bit K/V run several
    # 16-row tiles instead), at the same head dims in both tables
    wide_rows = {hd: tuple(sorted(r for r, t in variants.WIDE_DECODE_TILES.items() if hd in t))
                 for hd in variants.PREFILL_TILES}
    for rows in (32, 64):
        wide = {(v.dtype, v.head_dim, v.kv, v.paged) for v in vs
                if v.decode and v.block_m == rows and v.kv not in only}
        assert wide == {k for k in lean if rows in wide_rows[k[1]] and (k[3] or k[2] == "fp8")}
    assert {(r, hd) for r, t in variants.WIDE_DECODE_TILES_FP8.items() for hd in t} == {
        (r, hd) for r, t in variants.WIDE_DECODE_TILES.items() for hd in t}
    # several 16-row tiles (contiguous 16-bit K/V) go to 32 rows at most, and only where wide tiles
    # exist for the other K/V kinds
    assert all(DECODE_MAX_ROWS[hd] <= (32 if wide_rows[hd] else 16) for hd in DECODE_MAX_ROWS)
    for v in vs:
        if v.decode:
            # 16 rows: one warp, or a warp pair sharing them (the fp8 hd256 tile); wider: 16 rows a warp
            assert v.general is False and v.block_m in (16, 32, 64), v.name
            assert v.warps == (2 if v.pair else v.block_m // 16), v.name
            # several CTAs per SM on an H100 (228 KB, 1 KB reserved each): the point of the tile
            assert 228 * 1024 // (v.smem_bytes + 1024) >= 2, v.name
            assert v.manifest()["decode"] is True


def test_routing_reads_the_decode_tiles_from_the_manifest(monkeypatch):
    """routing.built_decode_tiles: the decode rows the manifest has for this K/V on the device's
    arch (nothing mirrored by hand): 16, plus 32 / 64 over paged or fp8 K/V where built."""
    from pyflashattn._engine import routing
    rows = [dict(v.manifest(), name=v.name, arch="sm_90a") for v in variants.variants()]
    monkeypatch.setattr(_registry, "manifest", lambda: {"kernels": rows})
    monkeypatch.setattr(routing._cuda, "properties", lambda dev: {"cc": (9, 0)})
    monkeypatch.setattr(routing, "_decode_rows_cache", {})
    for hd in variants.PREFILL_TILES:
        wide = tuple(sorted(r for r, t in variants.WIDE_DECODE_TILES.items() if hd in t))
        assert routing.built_decode_tiles(0, "bf16", "bf16", hd, False) == (16,)
        assert routing.built_decode_tiles(0, "bf16", "bf16", hd, True) == (16, *wide)
        assert routing.built_decode_tiles(0, "f16", "fp8", hd, False) == (16, *wide)
        assert routing.built_decode_tiles(0, "bf16", "nvfp4", hd, True) == (16, *wide)
        assert routing.built_decode_tiles(0, "bf16", "nvfp4", hd, False) == ()
    assert routing.DECODE_ONLY_KV == set(variants.DECODE_ONLY_KV)
    # an arch without the wide tiles built: only what is there
    monkeypatch.setattr(_registry, "manifest", lambda: {"kernels": [r for r in rows if r.get("block_m") != 64]})
    monkeypatch.setattr(routing, "_decode_rows_cache", {})
    assert routing.built_decode_tiles(0, "bf16", "bf16", 128, True) == (16, 32)


def test_routing_without_decode_tiles_takes_the_row_tile_kernel(monkeypatch):
    """A manifest with no decode tile for this K/V (an arch where none was built): the plan routes
    to the row-tile kernel instead of asking for a kernel that is not there."""
    from pyflashattn._engine import routing
    rows = [dict(v.manifest(), name=v.name, arch="sm_90a") for v in variants.variants()
            if not getattr(v, "decode", False)]
    monkeypatch.setattr(_registry, "manifest", lambda: {"kernels": rows})
    monkeypatch.setattr(routing._cuda, "properties", lambda dev: {"cc": (9, 0)})
    monkeypatch.setattr(routing, "_decode_rows_cache", {})
    tiles = routing.built_decode_tiles(0, "bf16", "bf16", 128, True)
    assert tiles == () and routing.decode_tile_rows(128, 4, tiles) == 0
    assert routing.decode_tile_rows(128, 4, (16, 32)) == 16 and routing.decode_tile_rows(128, 20, (16,)) == 16
