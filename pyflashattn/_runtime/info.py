"""``python -m pyflashattn``: what this installation has, in a couple of seconds, GPU or not.

Versions (pyflashattn, Python, numpy, cuda-bindings, the driver; torch / CuPy / JAX from their
package metadata, never imported: importing torch alone takes seconds), the GPUs with their
compute capability and build arch, and the cubins: where they were found, how many kernels per
arch, whether they match this package's params layout, and the nvcc that built them.
"""
from __future__ import annotations

import importlib.util
import platform
from importlib import metadata

from . import cuda as _cuda, registry as _registry

_W = 14  # label column width


def _line(label: str, text: str) -> str:
    return f"{label:<{_W}}{text}"


def _dist_version(*names: str) -> str | None:
    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return None


def _framework(module: str, dists: tuple[str, ...]) -> str:
    """A framework's version from its package metadata, without importing it."""
    if importlib.util.find_spec(module) is None:
        return "not installed"
    ver = _dist_version(*dists)
    if ver is None and module == "cupy":  # cupy-cuda12x, cupy-cuda13x, ...: any dist providing `cupy`
        names = metadata.packages_distributions().get("cupy", [])
        ver = next((f"{_dist_version(n)} ({n})" for n in names if _dist_version(n)), None)
    return ver or "installed (version unknown)"


def _numpy_version() -> str:
    try:
        import numpy
    except ImportError:
        return "not installed"
    return numpy.__version__


def _driver_lines() -> tuple[list[str], list[dict]]:
    """The cuda-bindings, driver and GPU lines, and the GPUs found (empty without a driver)."""
    lines = [_line("cuda-bindings", _cuda.bindings_version() or "not installed (pip install 'cuda-bindings>=13,<14')")]
    try:
        ver = _cuda.driver_version()
        gpus = _cuda.devices()
    except _cuda.DriverError as e:
        need = "" if _cuda.bindings_version() is None else f"; {_cuda.driver_requirement()}"
        lines.append(_line("driver", f"none: {e.reason}{need}"))
        lines.append(_line("GPUs", "none found"))
        return lines, []
    except Exception as e:  # noqa: BLE001 - a report, not a launch: say what failed and go on
        lines.append(_line("driver", f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        return lines, []
    lines.append(_line("driver", f"supports CUDA {ver}"))
    if not gpus:
        lines.append(_line("GPUs", "none visible (check CUDA_VISIBLE_DEVICES)"))
    return lines, gpus


def _gpu_lines(gpus: list[dict], cubins: dict) -> list[str]:
    lines = []
    for g in gpus:
        major, minor = g["cc"]
        arch = _registry.build_arch(g["cc"])
        if arch is None:
            where = "not supported by pyflashattn (needs compute capability 8.x or 9.0)"
        else:
            n = cubins.get("archs", {}).get(arch, 0)
            where = f"{arch}, {n} kernels" if n else f"{arch}, no cubins for it: build with `make ARCHS={arch}`"
        lines.append(_line(f"GPU {g['id']}", f"{g['name']}, compute capability {major}.{minor} -> {where}"))
    return lines


def _cubin_lines(cubins: dict) -> list[str]:
    if "error" in cubins:
        return [_line("cubins", "none: " + cubins["error"])]
    built = f", built {cubins['built']}" if cubins.get("built") else ""
    lines = [_line("cubins", f"{cubins['dir']}{built}")]
    for arch, n in sorted(cubins["archs"].items()):
        lines.append(_line(f"  {arch}", f"{n} kernels"))
    if not cubins["archs"]:
        lines.append(_line("", "the manifest lists no kernels: build them with `make`"))
    if cubins["missing"]:
        lines.append(_line("", f"{cubins['missing']} cubin files listed in the manifest are missing: rebuild with `make`"))
    lines.append(_line("nvcc", str(cubins.get("nvcc") or "not recorded")))
    if cubins["params_match"]:
        lines.append(_line("params", "match this package (params_sha256)"))
    else:
        lines.append(_line("params", "MISMATCH: the cubins were built against another params layout; rebuild "
                                     "with `make`"))
    return lines


def report(version: str) -> str:
    """The whole report, one fact a line."""
    lines = [_line("pyflashattn", version),
             _line("python", f"{platform.python_version()} ({platform.system()} {platform.machine()})"),
             _line("numpy", _numpy_version())]
    driver_lines, gpus = _driver_lines()
    lines += driver_lines
    for module, dists in (("torch", ("torch",)), ("cupy", ("cupy",)), ("jax", ("jax",))):
        lines.append(_line(module, _framework(module, dists)))
    cubins = _registry.manifest_summary()
    lines += _gpu_lines(gpus, cubins)
    lines += _cubin_lines(cubins)
    return "\n".join(lines)


def main(version: str) -> int:
    print(report(version))
    return 0
