"""Tensor maps for the sm90 kernels that load K/V by TMA (a manifest row with "tma"): the host
encodes one CUtensorMap per K and V tensor (cuTensorMapEncodeTiled) into the kernel parameters
(PrefillParams.k_tmap / v_tmap), read by kernel_src/include/pfa/attention/sm90/producer_tma.cuh:
  - contiguous / ragged K/V: 3-D (head_dim, kv heads, rows), boxes of 128 bytes of columns (64
    16-bit or 128 e4m3 elements) x 1 head x block_n rows (the fp8 rows: sm90/fp8_producer.cuh);
  - a paged cache: 4-D (head_dim, page slot, kv head, page), boxes of 128 bytes of columns x box_rows slots
    (min(page_size, block_n)) x 1 head x 1 page;
  - Q (PrefillParams.q_tmap, QMap): 3-D (head_dim, q heads, tokens), boxes of 128 bytes of columns
    x group heads x block_m / group tokens (sm90/producer.cuh QByTma, the 16-bit and e4m3 rows).
Boxes land in shared memory in the kernel's 128-byte-swizzled column blocks.

run() must stay cheap while K/V pointers change every call (a ragged batch's K/V are new tensors
each step; an encode through cuda.bindings costs several us): a map is encoded once per geometry
(what it encodes but the address: dims, strides, box), and later addresses are patched into those
bytes in Python. Where a map keeps its address is not documented, so it is learned from the driver
once per process and rank (two more encodes of probe addresses: the difference must be the
address, or address / 16, at one bit position) and checked on a third; where a driver's maps do
not follow that, each new address goes through cuTensorMapReplaceAddress (the documented way,
about a us more per map). Ragged maps cover ROW_EXTENT rows whatever the plan's length: the kernel never
issues a box past K / V's rows (PrefillParams.kv_tokens, set by run(); a tile whose box would pass
them is copied), so one geometry serves every plan and a CUDA graph's captured map stays right
after a re-plan.
"""
from __future__ import annotations

import ctypes

from .._runtime import cuda as _cuda

BOX_BYTES = 128  # a box's columns: one 128-byte swizzle row (64 16-bit or 128 one-byte elements)
ROW_EXTENT = (1 << 31) - 1  # ragged rows a map covers (TMA coordinates are signed 32-bit)
MIN_BOX_ROWS = 16  # ProducerSm90Tma::MIN_BOX_ROWS: smaller pages stay on the cp.async kernel
MAX_STRIDE = 1 << 40  # cuTensorMapEncodeTiled: byte strides are multiples of 16 below 2^40
MAX_ADDRESS = 1 << 57  # device addresses (57-bit virtual addresses at most)
_CACHE_SIZE = 256
_TEMPLATES: dict = {}  # geometry -> (address it was encoded with, its bytes as an int, the driver's map)
_FIELD: dict = {}  # rank -> (shift, bit position) of the address in a map; False: not patchable
# probe addresses for learning the address field (only encoded, never dereferenced)
_PROBES = (0x7F0000000000, 0x7F0000000010, 0x7F0012345670)


def paged_box_rows(page_size: int, block_n: int) -> int:
    """Rows per box of a paged map (ProducerSm90Tma::box_rows): min(page_size, block_n) where whole
    boxes tile a block_n-key tile and start on a swizzle atom; 0 = no TMA for this page size."""
    if page_size < MIN_BOX_ROWS or page_size % 8 or (block_n % page_size and page_size % block_n):
        return 0
    return min(page_size, block_n)


def ragged_geometry(heads: int, head_dim: int, stride_n: int, stride_h: int, itemsize: int, block_n: int) -> tuple:
    """(dims, byte strides, box) of a contiguous / ragged K or V tensor (strides in elements)."""
    return ((head_dim, heads, ROW_EXTENT), (stride_h * itemsize, stride_n * itemsize), (BOX_BYTES // itemsize, 1, block_n))


def paged_geometry(pages: int, page_size: int, heads: int, head_dim: int, strides: tuple, itemsize: int,
                   box_rows: int) -> tuple:
    """(dims, byte strides, box) of a paged K or V cache; strides = (page, slot, head) in elements."""
    sp, sn, sh = strides
    return ((head_dim, page_size, heads, pages), (sn * itemsize, sh * itemsize, sp * itemsize),
            (BOX_BYTES // itemsize, box_rows, 1, 1))


def kv_geometries(p, heads: int, head_dim: int, itemsize: int, block_n: int, page_size: int = 0,
                  num_pages: int = 0) -> tuple:
    """(K's, V's) geometry of a TMA plan's maps from the params struct p's strides: ragged
    (page_size 0), or a paged cache of num_pages pages. Separate V ids (TRT-LLM) may count from K's
    base across K and V (the fmha tuple form): V's map then spans the pages they address, p.num_pages
    (trtllm_device.point)."""
    if not page_size:
        return (ragged_geometry(heads, head_dim, p.k_stride_n, p.k_stride_h, itemsize, block_n),
                ragged_geometry(heads, head_dim, p.v_stride_n, p.v_stride_h, itemsize, block_n))
    rows = paged_box_rows(page_size, block_n)
    v_pages = max(num_pages, p.num_pages) if p.v_page_indices else num_pages
    return (paged_geometry(num_pages, page_size, heads, head_dim, (p.k_stride_page, p.k_stride_n, p.k_stride_h),
                           itemsize, rows),
            paged_geometry(v_pages, page_size, heads, head_dim, (p.v_stride_page, p.v_stride_n, p.v_stride_h),
                           itemsize, rows))


def q_geometry(heads: int, head_dim: int, stride_n: int, stride_h: int, itemsize: int, group: int,
               block_m: int):
    """(dims, byte strides, box) of Q [tokens, Hq, D] for row tiles of block_m packed rows (row r =
    token r / group, head r % group): a box of 128 bytes of columns x group heads x block_m / group
    tokens lands the tile's rows in order. None where a tile is not whole tokens (group does not
    divide block_m) or a box dim would pass 256."""
    if block_m % group or block_m // group > 256 or group > 256:
        return None
    return ((head_dim, heads, ROW_EXTENT), (stride_h * itemsize, stride_n * itemsize),
            (BOX_BYTES // itemsize, group, block_m // group))


def addressable(geometry: tuple) -> bool:
    """Whether TMA can address this geometry (the operand checks already require 16-byte rows;
    left: zero strides of broadcast views, huge strides, empty dims)."""
    dims, strides, _ = geometry
    return all(0 < s < MAX_STRIDE and s % 16 == 0 for s in strides) and all(0 < d < (1 << 32) for d in dims)


def _encode(short: str, ptr: int, geometry: tuple):
    dims, strides, box = geometry
    return _cuda.encode_tensor_map(short, ptr, dims, strides, box)


def _learn_field(short: str, geometry: tuple):
    """(shift, bit position) of the address in this rank's maps, or False (see the module doc)."""
    a, b, c = _PROBES
    try:
        xa, xb, xc = (int.from_bytes(_cuda.tensor_map_bytes(_encode(short, x, geometry)), "little") for x in _PROBES)
    except _cuda.CudaError:  # a driver that refuses addresses it did not allocate: nothing learned
        return False
    for shift in (0, 4):
        step = (b >> shift) - (a >> shift)
        d = xb - xa
        if step <= 0 or d <= 0 or d % step or (d // step) & (d // step - 1):
            continue
        pos = (d // step).bit_length() - 1
        if xa + (((c >> shift) - (a >> shift)) << pos) == xc:
            return shift, pos
    return False


def encode(short: str, ptr: int, geometry: tuple) -> bytes:
    """The 128-byte map of the tensor at ptr with this geometry (see the module doc for the cost)."""
    key = (short, geometry)
    tpl = _TEMPLATES.get(key)
    if tpl is not None:
        a, xa, obj = tpl
        field = _FIELD[len(geometry[0])]
        if field:
            shift, pos = field
            return (xa + (((ptr >> shift) - (a >> shift)) << pos)).to_bytes(128, "little")
        _cuda.tensor_map_replace_address(obj, ptr)
        return _cuda.tensor_map_bytes(obj)
    rank = len(geometry[0])
    if rank not in _FIELD:
        _FIELD[rank] = _learn_field(short, geometry)
    obj = _encode(short, ptr, geometry)
    data = _cuda.tensor_map_bytes(obj)
    if len(_TEMPLATES) >= _CACHE_SIZE:
        _TEMPLATES.clear()
    _TEMPLATES[key] = (ptr, int.from_bytes(data, "little"), obj)
    return data


class _MapField:
    """One tensor-map field of a params struct: what it holds, and (where the address field is
    known) a 64-bit view of the word holding the address, with that word's other bits."""

    __slots__ = ("addr", "ptr", "geometry", "word", "rest", "shift", "bit")

    def __init__(self, p, name: str):
        self.addr = ctypes.addressof(p) + getattr(type(p), name).offset
        self.ptr = self.geometry = self.word = None

    def write(self, short: str, ptr: int, geometry: tuple) -> None:
        if geometry == self.geometry and self.word is not None:
            self.word.value = self.rest | ((ptr >> self.shift) << self.bit)
        else:
            data = encode(short, ptr, geometry)
            ctypes.memmove(self.addr, data, len(data))
            self.geometry, self.word = geometry, None
            field = _FIELD.get(len(geometry[0]))
            if field:
                shift, pos = field
                start = min(pos // 8, 120)
                bit = pos - 8 * start
                if ((MAX_ADDRESS >> shift) << bit) < (1 << 64):
                    self.word = ctypes.c_uint64.from_address(self.addr + start)
                    self.shift, self.bit = shift, bit
                    self.rest = self.word.value - ((ptr >> shift) << bit)
        self.ptr = ptr

    def repoint(self, short: str, ptr: int) -> None:
        """A new address in the last geometry (runs every call: the word's patch inlined)."""
        if ptr != self.ptr:
            if self.word is not None:
                self.word.value = self.rest | ((ptr >> self.shift) << self.bit)
                self.ptr = ptr
            else:
                self.write(short, ptr, self.geometry)


class KvMaps:
    """The K and V maps in one launcher's params struct: a field is encoded when its geometry
    changes; a new address alone rewrites the word that holds it (see encode)."""

    __slots__ = ("short", "k", "v")

    def __init__(self, short: str, p):
        self.short = short
        self.k, self.v = _MapField(p, "k_tmap"), _MapField(p, "v_tmap")

    def point(self, k_ptr: int, v_ptr: int, k_geometry: tuple, v_geometry: tuple) -> bool:
        """Point the struct's maps at K and V; False (nothing written) where TMA cannot address them."""
        if not (addressable(k_geometry) and addressable(v_geometry)):
            return False
        k, v = self.k, self.v
        if k_ptr != k.ptr or k_geometry != k.geometry:
            k.write(self.short, k_ptr, k_geometry)
        if v_ptr != v.ptr or v_geometry != v.geometry:
            v.write(self.short, v_ptr, v_geometry)
        return True

    def forget(self) -> None:
        """The struct's maps were overwritten (a struct copied back into it): the next point() or
        repoint() writes whole maps."""
        for f in (self.k, self.v):
            f.ptr, f.word = None, None

    def repoint(self, k_ptr: int, v_ptr: int) -> None:
        """New addresses in the geometries of the last point() (the run() fast path's: same
        shapes and strides)."""
        self.k.repoint(self.short, k_ptr)
        self.v.repoint(self.short, v_ptr)


class QMap:
    """Q's map in a TMA launcher's struct (PrefillParams.q_tmap; q_tma = 1 while it holds a
    usable map, q_tokens = Q's rows, which the kernel keeps its boxes within): configure() per
    geometry (Q's rows and strides), point() per address. Where TMA cannot address Q, q_tma = 0
    and the producer copies Q as before."""

    __slots__ = ("short", "p", "f", "shape", "itemsize", "key", "geometry")

    def __init__(self, short: str, p, heads: int, head_dim: int, group: int, block_m: int, itemsize: int):
        self.short, self.p, self.f = short, p, _MapField(p, "q_tmap")
        self.shape, self.itemsize = (heads, head_dim, group, block_m), itemsize
        self.key = self.geometry = None

    def configure(self, rows: int, stride_n: int, stride_h: int) -> None:
        key = (rows, stride_n, stride_h)
        if key == self.key:
            return
        heads, head_dim, group, block_m = self.shape
        g = q_geometry(heads, head_dim, stride_n, stride_h, self.itemsize, group, block_m)
        self.key, self.geometry = key, (g if g is not None and addressable(g) and rows < ROW_EXTENT else None)
        p = self.p
        p.q_tma, p.q_tokens = (1, rows) if self.geometry is not None else (0, p.q_tokens)

    def point(self, ptr: int) -> None:
        if self.geometry is None:
            return
        f = self.f
        if f.geometry != self.geometry:
            f.write(self.short, ptr, self.geometry)
        else:
            f.repoint(self.short, ptr)

    def forget(self) -> None:
        """The struct was overwritten (see KvMaps.forget): configure() and point() rewrite it."""
        self.f.ptr, self.f.word, self.f.geometry, self.key = None, None, None, None


def q_map(short: str, p, meta: dict, heads: int, head_dim: int, group: int, itemsize: int):
    """A QMap for a launcher whose kernel loads Q by TMA (a TMA row: QByTma in sm90/producer.cuh,
    the 16-bit and the e4m3 rows), else None."""
    if not meta.get("tma") or itemsize not in (1, 2):
        return None
    return QMap(short, p, heads, head_dim, group, meta["block_m"], itemsize)
