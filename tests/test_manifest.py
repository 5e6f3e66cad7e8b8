"""The variant table, the generated kernel sources and the cubin manifest agree."""
import hashlib
import json
import pathlib
import subprocess
import sys

import pytest

from pyflashattn._runtime import params_gen as _params_gen, registry as _registry
from pyflashattn.prefill import DECODE_MAX_ROWS, WIDE_DECODE_ROWS

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
            assert v.smem_bytes <= 227 * 1024
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


@pytest.mark.skipif(not MANIFEST.exists(), reason="cubins not built (run make)")
def test_built_manifest_is_consistent():
    m = json.loads(MANIFEST.read_text())
    assert m["params_sha256"] == _params_gen.PARAMS_SHA256
    assert m["nvcc"] != "unknown"
    names = {v.name for v in variants.variants()}
    built = {}
    for row in m["kernels"]:
        path = ROOT / "cubins" / row["file"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == row["sha256"], row["file"]
        assert path.read_bytes()[:4] == b"\x7fELF"
        built.setdefault(row["arch"], set()).add(row["name"])
    for arch in m["archs"]:
        assert names <= built[arch], f"{arch} lacks {names - built[arch]}"


def test_prefill_tiles_are_the_tables_rows():
    """Every shipped kernel has its table's tile (the decode tiles theirs, by K/V storage)."""
    for v in variants.variants():
        if not isinstance(v, variants.PrefillVariant):
            continue
        if not v.decode:
            table = variants.PREFILL_TILES
        elif v.block_m > 16:
            table = (variants.WIDE_DECODE_TILES_FP8 if v.kv_dtype else variants.WIDE_DECODE_TILES)[v.block_m]
        else:
            table = variants.DECODE_TILES_FP8 if v.kv_dtype else variants.DECODE_TILES
        row = table[v.head_dim]
        assert (v.warps, v.mq, v.block_n, v.q_in_regs, v.stages, v.min_blocks) == row[:6], v.name
        assert v.pair == (len(row) > 7 and row[7]), v.name


def test_decode_tiles_exist_for_every_lean_kernel():
    vs = [v for v in variants.variants() if isinstance(v, variants.PrefillVariant)]
    lean = {(v.dtype, v.head_dim, v.kv, v.paged) for v in vs if not v.general and not v.decode}
    assert {(v.dtype, v.head_dim, v.kv, v.paged) for v in vs if v.decode} == lean
    # the wide tiles (what prefill.decode_tiles routes to): every row count and head dim of
    # WIDE_DECODE_ROWS, for paged or fp8 K/V (contiguous 16-bit K/V never use them)
    for rows in (32, 64):
        wide = {(v.dtype, v.head_dim, v.kv, v.paged) for v in vs if v.decode and v.block_m == rows}
        assert wide == {k for k in lean if rows in WIDE_DECODE_ROWS.get(k[1], ()) and (k[3] or k[2] == "fp8")}
    for table in (variants.WIDE_DECODE_TILES, variants.WIDE_DECODE_TILES_FP8):
        assert {(r, hd) for r, t in table.items() for hd in t} == {
            (r, hd) for hd, rs in WIDE_DECODE_ROWS.items() for r in rs}
    # several 16-row tiles (contiguous 16-bit K/V) go to 32 rows at most, and only where wide tiles
    # exist for the other K/V kinds
    assert all(DECODE_MAX_ROWS[hd] <= (32 if hd in WIDE_DECODE_ROWS else 16) for hd in DECODE_MAX_ROWS)
    for v in vs:
        if v.decode:
            # 16 rows: one warp, or a warp pair sharing them (the fp8 hd256 tile); wider: 16 rows a warp
            assert v.general is False and v.block_m in (16, 32, 64), v.name
            assert v.warps == (2 if v.pair else v.block_m // 16), v.name
            # several CTAs per SM on an H100 (228 KB, 1 KB reserved each): the point of the tile
            assert 228 * 1024 // (v.smem_bytes + 1024) >= 2, v.name
            assert v.manifest()["decode"] is True
