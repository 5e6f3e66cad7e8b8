"""cubins/<arch>/*.cubin -> cubins/manifest.json.

Each kernel row (exactly the rows variants.py builds for each arch) carries what the runtime
needs to choose and launch it (family, impl, dtype, kv_dtype, head_dim, tile rows and keys,
warps, threads, dynamic shared memory, CTAs per SM, decode / paged / general / rows_fastest)
plus provenance: arch and sha256 of the cubin; the manifest adds the nvcc version that built
them and a hash of the params header, so a runtime whose ctypes mirror disagrees with the
cubins refuses to launch them. "unbuilt" lists the rows left out of an arch and why, so the
runtime can say why a configuration has no kernel there.
"""
import argparse
import datetime
import hashlib
import json
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from variants import IMPL_ARCHS, unbuilt_reason, variants  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
PARAMS_H = ROOT / "kernel_src/include/pfa/attention/params.h"
MANIFEST_FORMAT = 1  # rows and keys only ever added since: readers of format 1 read this one


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def nvcc_version(nvcc):
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    line = [x for x in out.splitlines() if "release" in x]
    return line[-1].split("release")[-1].strip() if line else "unknown"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("archs", nargs="+")
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "cubins"))
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    vs = variants(tune=args.tune)
    kernels, unbuilt = [], []
    for arch in args.archs:
        if not any(arch in v.archs for v in vs):
            sys.exit(f"no variant is built for {arch} (archs of variants.py: "
                     f"{' '.join(sorted({x for xs in IMPL_ARCHS.values() for x in xs}))})")
        for v in vs:
            if arch not in v.archs:
                if arch in IMPL_ARCHS[v.impl]:
                    unbuilt.append({"name": v.name, "arch": arch, **v.manifest(), "reason": unbuilt_reason(v, arch)})
                continue
            cubin = out / arch / f"{v.name}.cubin"
            if not cubin.exists():
                sys.exit(f"missing {cubin}: run make ARCHS={arch}")
            kernels.append({"name": v.name, "arch": arch, "file": f"{arch}/{cubin.name}",
                            "sha256": sha256(cubin), **v.manifest()})
    manifest = {
        "format": MANIFEST_FORMAT,
        "nvcc": nvcc_version(args.nvcc),
        "params_sha256": sha256(PARAMS_H),
        "archs": args.archs,
        "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "kernels": kernels,
        "unbuilt": unbuilt,
    }
    # Written atomically: a reader never sees half a manifest.
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(out / "manifest.json")


if __name__ == "__main__":
    main()
