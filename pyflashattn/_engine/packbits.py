"""The packbits kernel's launches: one place for its grid rules (quantization's device packing
and the attention masks both launch it here)."""
from __future__ import annotations

from .._runtime import registry as _registry

THREADS = 256  # Packbits::THREADS: one output byte per thread
MAX_SEGMENTS_PER_LAUNCH = 65535  # blockIdx.y carries the segment: the CUDA limit of gridDim.y


def launch_segments(dev: int, x: int, y: int, in_indptr: int, out_indptr: int, n: int, seg_bytes, little: int,
                    stream: int) -> None:
    """Pack segments [in_indptr[i], in_indptr[i+1]) of the n bool/uint8 elements at x into bytes
    out_indptr[i].. of y (device int32 offset arrays); seg_bytes = each segment's output bytes on
    the host (sizes the grid). More segments than a grid column holds go in several launches."""
    la = _registry.launcher("packbits", dev)
    p = la.params
    nseg = len(seg_bytes)
    for first in range(0, nseg, MAX_SEGMENTS_PER_LAUNCH):
        count = min(MAX_SEGMENTS_PER_LAUNCH, nseg - first)
        most = int(seg_bytes[first:first + count].max())
        if not most:
            continue
        p.x, p.y = x, y
        p.in_indptr, p.out_indptr = in_indptr + 4 * first, out_indptr + 4 * first
        p.n, p.num_segments, p.little = n, count, little
        la.launch((-(-most // THREADS), count, 1), stream)


def launch_flat(dev: int, x: int, y: int, n: int, little: int, stream: int) -> None:
    """Pack the first n elements at x into ceil(n / 8) bytes at y (one segment, no offsets)."""
    nbytes = -(-n // 8)
    if nbytes <= 0:
        return
    la = _registry.launcher("packbits", dev)
    p = la.params
    p.x, p.y, p.in_indptr, p.out_indptr = x, y, 0, 0
    p.n, p.num_segments, p.little = n, 1, little
    la.launch((-(-nbytes // THREADS), 1, 1), stream)
