"""The cubin manifest -> launchable kernels, per device, loaded lazily and cached.

Lookup goes by (family, dtype, head_dim, ...) on the archs that match the device, in order
(sm_90 loads sm_90a cubins, 8.9 prefers sm_89 then sm_80, other 8.x take sm_80), and within an
arch by implementation family in IMPL_PREFERENCE order. Nothing is compiled at call time; a
missing GPU, arch or kernel raises an error that names it and says how to build, and a cubin
whose sha256 differs from its manifest row is refused when loaded.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import threading

from . import cuda as _cuda
from .params_gen import FAMILIES, PARAMS_SHA256

_PKG = pathlib.Path(__file__).resolve().parent.parent  # the pyflashattn package
_manifest = None
_manifest_dir = None
_libraries: dict[tuple[str, int], object] = {}
_functions: dict[tuple[str, int], object] = {}
_local = threading.local()  # Launchers own a mutable params struct: one set per thread
_lock = threading.Lock()
_forced: dict[str, str] = {}  # family -> kernel name (the tuning sweep's hook; empty in normal use)

# arch -> the implementation families (a manifest row's "impl") to pick from, preferred first.
# The Hopper family ("sm90", warp-specialised wgmma) goes first on sm_90a wherever it has a row
# for the call; the mma.sync family ("sm80") covers the rest there and everything elsewhere. An
# impl not listed for an arch is never picked there (except by exact name); rows of the portable
# kernels (merge, packbits) fit every arch.
IMPL_PREFERENCE: dict[str, tuple[str, ...]] = {
    "sm_80": ("sm80",),
    "sm_89": ("sm80",),
    "sm_90a": ("sm90", "sm80"),
}
# PFA_FORCE_FAMILY=sm80|sm90: every arch picks only that family's rows (benchmarks and tests run
# either family on the same inputs). Read at each kernel lookup; plans and launchers already made
# keep theirs (registry.force("prefill", None) drops the cached ones). A call the forced family
# does not cover finds no kernel and says so.
FORCE_FAMILY_ENV = "PFA_FORCE_FAMILY"
PORTABLE = "portable"  # variants.py's impl of the merge / packbits rows (also: rows without "impl")
DECODE_TILE_ROWS = 16  # the decode tile picked unless another is named: one warp's m16 row tile


def force(family: str, name: str | None) -> None:
    """Use kernel `name` for `family` wherever its dtype/head_dim match (None restores the defaults).

    For the tile-tuning sweep (build_tools/tune_prefill.py) comparing `make TUNE=1` variants.
    """
    if name is None:
        _forced.pop(family, None)
    else:
        _forced[family] = name
    getattr(_local, "cache", {}).clear()
    for hook in _on_force:
        hook()


def forced(family: str) -> str | None:
    """The kernel name force() set for `family`, or None."""
    return _forced.get(family)


_on_force: list = []  # callbacks that drop caches holding launchers (prefill's plan cache)


def cubin_dir() -> pathlib.Path:
    """$PFA_CUBIN_DIR, else the cubins packaged in the wheel, else the source tree's cubins/."""
    env = os.environ.get("PFA_CUBIN_DIR")
    candidates = [pathlib.Path(env)] if env else [_PKG / "_cubins", _PKG.parent / "cubins"]
    for c in candidates:
        if (c / "manifest.json").exists():
            return c
    raise RuntimeError(
        "pyflashattn has no compiled kernels: cubins/manifest.json not found (looked in "
        + ", ".join(str(c) for c in candidates)
        + "). Build them with `make` (or `make ARCHS=sm_90a` for one arch) in the source tree.")


def manifest() -> dict:
    global _manifest, _manifest_dir
    if _manifest is None:
        d = cubin_dir()
        m = json.loads((d / "manifest.json").read_text())
        if m.get("params_sha256") != PARAMS_SHA256:
            raise RuntimeError(
                f"cubins in {d} were built against another params layout than this package's "
                "(params_sha256 mismatch); rebuild them with `make`.")
        _manifest, _manifest_dir = m, d
    return _manifest


def arch_candidates(cc: tuple[int, int]) -> list[str]:
    major, minor = cc
    if major == 9:
        return ["sm_90a"]
    if (major, minor) == (8, 9):
        return ["sm_89", "sm_80"]
    if major == 8:
        return ["sm_80"]
    return []


def build_arch(cc: tuple[int, int]) -> str | None:
    """The arch to build for a GPU of compute capability cc (9.0 -> sm_90a, 8.9 -> sm_89, other
    8.x -> sm_80), None where pyflashattn has no kernels."""
    archs = arch_candidates(cc)
    return archs[0] if archs else None


def manifest_summary() -> dict:
    """What ``python -m pyflashattn`` reports about the cubins, read fresh (never cached, never
    raising): {"dir", "archs": {arch: kernel count}, "missing": files listed but absent,
    "params_match", "nvcc", "built"}, or {"error": why there are none}."""
    try:
        d = cubin_dir()
        m = json.loads((d / "manifest.json").read_text())
    except (RuntimeError, OSError, ValueError) as e:
        return {"error": str(e)}
    archs: dict[str, int] = {}
    files = set()
    for row in m.get("kernels", ()):
        archs[row.get("arch", "?")] = archs.get(row.get("arch", "?"), 0) + 1
        files.add(row.get("file"))
    missing = sum(1 for f in files if f and not (d / f).exists())
    return {"dir": d, "archs": archs, "missing": missing, "params_match": m.get("params_sha256") == PARAMS_SHA256,
            "nvcc": m.get("nvcc"), "built": m.get("built")}


def find(family: str, device_id: int, **match) -> dict:
    """The manifest row of the shipped (non-tuning) kernel matching `match` for this device."""
    row = _find(family, device_id, dict(match))
    props = _cuda.properties(device_id)
    if _too_big(row, props):
        raise _smem_refusal(family, row, match, props)
    return row


def _too_big(row: dict, props: dict) -> bool:
    limit = props.get("smem_optin")
    return limit is not None and row["smem_bytes"] > limit


def _smem_refusal(family: str, row: dict, match: dict, props: dict) -> ValueError:
    # e.g. fp8 K/V at head_dim 256 (~200 KiB) on sm_80 (163 KiB), head_dim 256 on sm_89 (99 KiB):
    # refused here, before the driver would reject the launch with a bare error code
    what = ", ".join(f"{k}={v}" for k, v in match.items() if k != "name")
    return ValueError(f"{family} kernel {row['name']} ({what}) needs {row['smem_bytes']} bytes of shared memory "
                      f"per block, but this GPU (compute capability {props['cc'][0]}.{props['cc'][1]}) allows "
                      f"{props['smem_optin']}: that configuration is not supported on this device")


def _impl_rank(row: dict, arch: str):
    """Where row's implementation family stands in arch's preference order (None: not picked there)."""
    impl = row.get("impl", PORTABLE)
    if impl == PORTABLE:
        return 0
    order = _forced_family() or IMPL_PREFERENCE.get(arch, ())
    return order.index(impl) if impl in order else None


def _forced_family() -> tuple:
    """PFA_FORCE_FAMILY as a one-family preference order, or () when unset."""
    fam = os.environ.get(FORCE_FAMILY_ENV)
    if not fam:
        return ()
    if fam not in ("sm80", "sm90"):
        raise ValueError(f"{FORCE_FAMILY_ENV}={fam!r}: must be sm80 or sm90 (or unset)")
    return (fam,)


def _pick(rows, family: str, archs: list, want_name, match: dict):
    """The first matching row, archs in order and within an arch impls in preference order
    (within an impl, manifest order); None if none matches."""
    best, best_key = None, None
    for i, row in enumerate(rows):
        if row["family"] != family or row["arch"] not in archs:
            continue
        if want_name is not None:
            if row["name"] != want_name:
                continue
            rank = 0  # a kernel asked for by name: any impl
        else:
            # tuning rows and twins (a shipped row's variant, e.g. with skip-softmax) only by name
            if row.get("tune") or row.get("twin_of") or not all(row.get(k) == v for k, v in match.items()):
                continue
            rank = _impl_rank(row, row["arch"])
            if rank is None:
                continue
        key = (archs.index(row["arch"]), rank, i)
        if best_key is None or key < best_key:
            best, best_key = row, key
    return best


def _find(family: str, device_id: int, match: dict) -> dict:
    cc = _cuda.properties(device_id)["cc"]
    archs = arch_candidates(cc)
    if not archs:
        raise RuntimeError(f"pyflashattn has no kernels for compute capability {cc[0]}.{cc[1]} "
                           "(supported: 8.x as sm_80/sm_89, 9.0 as sm_90a)")
    _forced_family()  # a bad PFA_FORCE_FAMILY is refused before any lookup
    m = manifest()
    rows = m["kernels"]
    want_name = match.pop("name", None)
    if family == "prefill" and "dtype" in match:
        match.setdefault("kv_dtype", match["dtype"])  # K/V in the query dtype unless asked otherwise
    if family == "prefill" and want_name is None:
        match.setdefault("decode", False)  # the decode tiles only when asked for
        if match["decode"]:
            match.setdefault("block_m", DECODE_TILE_ROWS)
    forced = _forced.get(family)
    if forced is not None and want_name is None:
        row = next((r for r in rows if r["name"] == forced and r["arch"] in archs), None)
        if row is not None and all(row.get(k) == v for k, v in match.items()):
            return row
    row = _pick(rows, family, archs, want_name, match)
    if row is not None:
        return row
    # Left out of the build for these archs (variants.py: it cannot launch or be routed there)?
    row = _pick(m.get("unbuilt", ()), family, archs, want_name, match)
    if row is not None:
        props = _cuda.properties(device_id)
        if _too_big(row, props):
            raise _smem_refusal(family, row, match, props)
        raise RuntimeError(f"{family} kernel {row['name']} is not built for {row['arch']}: {row['reason']}")
    what = want_name or ", ".join(f"{k}={v}" for k, v in match.items())
    raise RuntimeError(f"no {family} kernel for {what} among the cubins for {'/'.join(archs)} in "
                       f"{_manifest_dir}; build them with `make ARCHS={archs[0]}`")


def _library(row: dict, device_id: int):
    key = (row["file"], device_id)
    lib = _libraries.get(key)
    if lib is None:
        with _lock:
            lib = _libraries.get(key)
            if lib is None:
                _cuda.ensure_context(device_id)
                path = _manifest_dir / row["file"]
                try:
                    data = path.read_bytes()
                except OSError as e:
                    raise RuntimeError(f"cannot read cubin {path} ({e.strerror}); rebuild the cubins with "
                                       "`make`") from None
                if hashlib.sha256(data).hexdigest() != row.get("sha256"):
                    raise RuntimeError(f"cubin {path} does not match {_manifest_dir / 'manifest.json'} (sha256 "
                                       "differs): it changed after the manifest was written; rebuild the cubins "
                                       "with `make`")
                lib = _libraries[key] = _cuda.load_library(data, row["file"])
    return lib


def new_launcher(family: str, device_id: int, **match) -> _cuda.Launcher:
    """A fresh Launcher (its own params struct) for the matching kernel on device_id.

    Plans own theirs, so a cached plan's constant fields are filled once and a launch only
    refills pointers. The CUfunction (and its shared-memory attribute) is shared and cached.
    """
    row = find(family, device_id, **dict(match))
    fkey = (row["file"], device_id)
    func = _functions.get(fkey)
    if func is None:
        func = _functions[fkey] = _cuda.get_function(_library(row, device_id), row["name"], device_id,
                                                     row["smem_bytes"])
    cls = _cuda.Launcher
    if row.get("programmatic_launch") and _cuda.properties(device_id)["cc"] >= (9, 0):
        cls = _cuda.ProgrammaticLauncher  # the kernel waits for the one before it (sm_90 cubins)
    la = cls(row["name"], func, FAMILIES[family], row["threads"], row["smem_bytes"])
    la.meta = row
    return la


def launcher(family: str, device_id: int, **match) -> _cuda.Launcher:
    """A Launcher for the matching kernel on device_id, cached per thread, device and match
    (callers refill its params before each launch)."""
    cache = getattr(_local, "cache", None)
    if cache is None:
        cache = _local.cache = {}
    key = (family, device_id, tuple(sorted(match.items())))
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = new_launcher(family, device_id, **match)
    return hit
