"""Launch-side helpers shared by every API: the streams a call runs on, the torch fast path's
signature key, and programmatic (PDL) launches.

The torch fast path: a call whose torch tensors have the signature (shapes, strides, dtypes,
devices) of a call already validated reads only their data pointers and launches; anything
else goes through the full path (DLPack views, the operand validator).
"""
from __future__ import annotations

import sys

from .._runtime import cuda as _cuda, tensor as _tensor
from . import params as _params

TORCH_TYPES: set = set()  # classes seen to be torch tensors (framework_of, once per class)


def is_torch(q) -> bool:
    """q is a torch tensor (the class test is cached: framework_of runs once per class)."""
    cls = q.__class__
    if cls in TORCH_TYPES:
        return True
    if _tensor.framework_of(q) != "torch":
        return False
    TORCH_TYPES.add(cls)
    return True


def torch_key(q, kv_parts, out, lse, tail):
    """The torch attributes a validated call depends on, as one flat tuple (no per-tensor helper
    calls: this is most of the fast path's own cost), followed by `tail` (the call's other
    arguments); None for a tensor torch's attributes cannot describe. get_device() is -1 off-GPU."""
    try:
        key = (q.shape, q.stride(), q.dtype, q.get_device(), tail)
        for t in kv_parts:
            key += (t.shape, t.stride(), t.dtype, t.get_device())
        key += (None,) if out is None else (out.shape, out.stride(), out.dtype, out.get_device())
        key += (None,) if lse is None else (lse.shape, lse.stride(), lse.dtype, lse.get_device())
        return key
    except Exception:  # noqa: BLE001 - not a plain strided torch tensor
        return None


_torch_getter = (None, None)


def torch_stream(dev):
    """torch's current raw stream (what tensor.current_stream("torch") reads), with the getter
    looked up once per torch module."""
    global _torch_getter
    mod = sys.modules["torch"]
    if _torch_getter[0] is not mod:
        _torch_getter = (mod, getattr(mod._C, "_cuda_getCurrentRawStream", None))
    raw = _torch_getter[1]
    return raw(dev) if raw is not None else _tensor.current_stream("torch", dev)


def call_stream(stream, framework: str, dev: int) -> int:
    """A call's stream: stream= if given, else the caller framework's current stream."""
    return _tensor.stream_handle(stream) if stream is not None else _tensor.current_stream(framework, dev)


def plan_stream(stream, dev):
    """plan()'s copy stream: stream= if given, else torch's / CuPy's current stream when that
    framework is loaded (what run() will use by default), else the library stream."""
    if stream is not None:
        return _tensor.stream_handle(stream)
    for fw in ("torch", "cupy"):
        if fw in sys.modules:
            try:
                return torch_stream(dev) if fw == "torch" else _tensor.current_stream(fw, dev)
            except Exception:  # noqa: BLE001 - framework without CUDA: fall through
                pass
    return _cuda.library_stream(dev)


def configure_grid(la, grid: tuple[int, int, int], dev: int, section: int = 0, sched: int = 0,
                   section_z: int = 0) -> None:
    """Launch grid of an attention kernel over the logical grid `grid` (one block a work item).
    sm90 rows launch one-dimensionally: the kernel finds its block's coordinates in
    PrefillParams.grid_x/y/z (work.cuh LogicalGrid), whose order runs in sections of `section` x
    values (kv heads; 0 = one section) for the z values below `section_z`, the rest after them as
    one (routing.section_head_z). A CTA a block: one CTA per logical block, which the hardware
    starts in launch order. Persistent (the manifest's persistent, sm90/cta.cuh): as many CTAs as fit
    the GPU at once (at most one a block), handed blocks by the tile scheduler's zeroed counters at
    `sched`; without counters (0) each CTA takes a fixed share (sm90/tile_scheduler.cuh), which
    balances one section only. The other kernels' launch grid is the logical grid itself."""
    if la.meta.get("impl") != "sm90":
        la.configure(grid)
        return
    p = la.params
    blocks = grid[0] * grid[1] * grid[2]
    persistent = bool(la.meta.get("persistent"))
    p.sched = sched if persistent else 0
    sectioned = 0 < section < grid[0] and (p.sched or not persistent)
    # one section: every x value together, every z value in it
    _params.set_grid_order(p, grid, section if sectioned else grid[0],
                           min(max(section_z, 0), grid[2]) if sectioned else grid[2])
    if persistent:
        blocks = min(blocks, _cuda.properties(dev)["sm_count"] * la.meta["ctas_per_sm"])
    la.configure((max(1, blocks), 1, 1))


class PdlLauncher:
    """enable_pdl=True: the attention kernel launched programmatically (sm_90+: it may start while
    the kernel ahead of it on the stream finishes, and waits for it in griddepcontrol.wait before
    reading anything), over the same params struct. GPUs without programmatic launch (sm_8x) take
    the plain launch: the results are the same."""

    __slots__ = ("dev", "pl")

    def __init__(self, dev: int):
        self.dev, self.pl = dev, None

    def __call__(self, la, pdl):
        if not pdl:
            return la
        pl = self.pl
        if pl is None or pl.params is not la.params:
            if _cuda.properties(self.dev)["cc"] < (9, 0):
                return la
            pl = self.pl = _cuda.ProgrammaticLauncher.sharing(la)
        if pl.grid != la.grid:
            pl.configure(la.grid)
        return pl
