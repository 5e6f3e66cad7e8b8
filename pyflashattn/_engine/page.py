"""The paged KV cache helpers (flashinfer.page) behind pyflashattn.page: operand checks, the
checked mode, the host (numpy) paths and the launches of the page kernel
(kernel_src/include/pfa/misc/page.cuh, one kernel whose PageParams.mode picks the job).

Device-resident index arrays are never read by the host (that would be a sync) unless the
checked mode is on (metadata_check): the kernel skips every token whose metadata points
outside the cache instead.

Each device entry point is its checks (check_*) and its launch (launch_*, into given views on a
given stream): pyflashattn.jax runs the checks at trace time on views without addresses and the
launches inside XLA's callback on its buffers.
"""
from __future__ import annotations

import ctypes
import math
import sys
from typing import NamedTuple

import numpy as np

from .._runtime import cuda as _cuda, dtypes as _dtypes, registry as _registry, tensor as _tensor
from .._runtime.dlpack import kDLCPU
from . import indices, metadata_check, operands

THREADS = 256  # PageKernel::THREADS
MAX_TOKENS = 64  # PageKernel::MAX_TOKENS: tokens of one CTA of the append
CHUNKS_PER_CTA = 1024  # the append's copies per CTA it is sized for (4 per thread)
APPEND, BATCH_POSITIONS, SEQ_LENS = 0, 1, 2  # PageKernel::Mode
I32_MAX = 2**31 - 1
ROW_BYTES_MAX = 1 << 28  # one token's K (or V) bytes: keeps the kernel's chunk counts in int32

CACHE_DTYPES = (_dtypes.FLOAT16, _dtypes.BFLOAT16, _dtypes.FLOAT8_E4M3, _dtypes.FLOAT8_E5M2, _dtypes.FLOAT32)
# frameworks whose arrays may be written in place (xla: pyflashattn.jax's views of the XLA buffers
# its append aliases to the cache it returns)
_CACHE_FRAMEWORKS = ("torch", "cupy", "xla")
# frameworks pyflashattn can allocate outputs for (xla: pyflashattn.jax's, its outputs XLA's buffers)
_OUTPUT_FRAMEWORKS = ("torch", "cupy", "jax", "xla")
INT32 = _dtypes.INT32


class Cache(NamedTuple):
    """A paged cache's K and V halves: addresses, (page, slot, head) strides in elements, sizes."""
    k_ptr: int
    v_ptr: int
    k_strides: tuple
    v_strides: tuple
    num_pages: int
    page_size: int
    num_heads: int
    head_dim: int
    dtype: object
    views: tuple  # (view, name) of each tensor the caller passed


# ---------------------------------------------------------------- append_paged_kv_cache

def append(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
           kv_last_page_len, kv_layout="NHD") -> None:
    """append_paged_kv_cache (pyflashattn.page): every check before the launch, then one launch on
    the cache framework's current stream (none for nnz = 0)."""
    a = check_append(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
                     kv_last_page_len, kv_layout)
    if metadata_check.metadata_checks_enabled():
        check_append_metadata(batch_indices, positions, kv_indices, kv_indptr, a.cache.num_pages, a.cache.page_size)
    if a.nnz == 0:
        return
    s = _tensor.current_stream(a.cache.views[0][0].framework, a.dev)
    # Inputs of other frameworks (CuPy, JAX, ...): the launch stream waits for their pending writes.
    names = ("append_key", "append_value")
    vk, vv = (v if v.framework == "torch" else _tensor.view(v.obj, n, stream=s) for v, n in zip(a.kv, names))
    ix = {n: v if v.framework == "torch" else _tensor.view(v.obj, n, stream=s) for n, v in a.ix.items()}
    launch_append(a.dev, s, vk, vv, a.cache, ix, a.nnz, a.batch)


class Append(NamedTuple):
    """An append's checked operands (check_append): the cache, the keys' and values' views, the
    index arrays' views by name, nnz, the batch size and the device."""
    cache: Cache
    kv: list
    ix: dict
    nnz: int
    batch: int
    dev: int


def check_append(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
                 kv_last_page_len, kv_layout="NHD") -> Append:
    """append_paged_kv_cache's checks, every one before the driver is touched (the checked mode's
    host copy of the metadata is the caller's: pyflashattn.jax cannot read it)."""
    layout = operands.kv_layout(kv_layout)
    cache = cache_operand(paged_kv_cache, layout)
    ref, dev = cache.views[0][1], cache.views[0][0].device_id
    if cache.page_size < 1:
        raise ValueError(f"{ref} has shape {cache.views[0][0].shape}: page_size 0 ({layout})")
    kv = _append_operands(append_key, append_value, cache, ref, dev)
    nnz = kv[0].shape[0]
    ix = {name: _index_operand(x, name, dev, ref) for name, x in (
        ("batch_indices", batch_indices), ("positions", positions), ("kv_indices", kv_indices),
        ("kv_indptr", kv_indptr), ("kv_last_page_len", kv_last_page_len))}
    for name in ("batch_indices", "positions"):
        if ix[name].shape[0] != nnz:
            raise ValueError(f"{name} has {ix[name].shape[0]} entries but append_key has nnz = {nnz} rows")
    batch = ix["kv_indptr"].shape[0] - 1
    if batch < 0:
        raise ValueError("kv_indptr must have batch_size + 1 >= 1 entries, got an empty array")
    if ix["kv_last_page_len"].shape[0] != batch:
        raise ValueError(f"kv_last_page_len has {ix['kv_last_page_len'].shape[0]} entries but kv_indptr describes "
                         f"batch_size = {batch} requests (len(kv_indptr) - 1)")
    _check_int32_extents(("nnz", nnz), ("num_pages", cache.num_pages), ("len(kv_indices)", ix["kv_indices"].shape[0]),
                         ("len(kv_indptr)", batch + 1))
    for v, name in cache.views:
        _check_cache_framework(v, name)
    return Append(cache, kv, ix, nnz, batch, dev)


def cache_operand(paged_kv_cache, layout: str) -> Cache:
    """The K and V halves of a paged cache: one tensor [P, 2, ps, Hkv, D] (NHD) / [P, 2, Hkv, ps, D]
    (HND), [:, 0] = K, [:, 1] = V, or a (k_cache, v_cache) pair of [P, ps, Hkv, D] / [P, Hkv, ps, D];
    one dim less (a 4-D tensor, 3-D pair members) reads as page_size = 1, as in FlashInfer."""
    pair = isinstance(paged_kv_cache, (tuple, list))
    if pair and len(paged_kv_cache) != 2:
        raise ValueError(f"paged_kv_cache tuple must be (k_cache, v_cache), got {len(paged_kv_cache)} tensors")
    parts = tuple(zip(paged_kv_cache, ("k_cache", "v_cache"))) if pair else ((paged_kv_cache, "paged_kv_cache"),)
    for obj, name in parts:
        if _tensor.framework_of(obj) == "jax":
            raise TypeError(f"{name} is a JAX array: JAX arrays are immutable and append_paged_kv_cache writes the "
                            "cache in place; keep the cache in torch or CuPy")
    views = tuple((_tensor.view(obj, name), name) for obj, name in parts)
    for v, name in views:
        if not v.is_cuda:
            raise ValueError(_tensor.not_cuda_message(name, v.device_type, v.device_id))
        if v.readonly:
            raise TypeError(f"{name} is read-only; append_paged_kv_cache writes the cache in place")
        if v.dtype not in CACHE_DTYPES:
            raise TypeError(f"{name} has dtype {v.dtype.name}; the cache must be float16, bfloat16, float8_e4m3fn, "
                            "float8_e5m2 or float32")
        if v.ndim and v.strides[-1] != 1 and v.shape[-1] > 1 and 0 not in v.shape:
            raise ValueError(f"{name} must be contiguous in its last dim (head_dim), got strides {v.strides}")
    nhd = layout == "NHD"
    if pair:
        (k, _), (v, _) = views
        operands.require_device(v, "v_cache", k.device_id, "k_cache")
        if v.dtype is not k.dtype:
            raise TypeError(f"v_cache has dtype {v.dtype.name} but k_cache has {k.dtype.name}")
        if k.ndim not in (3, 4) or v.shape != k.shape:
            raise ValueError(f"k_cache and v_cache must have one shape [num_pages, page_size, num_kv_heads, head_dim] "
                             f"(NHD) or [num_pages, num_kv_heads, page_size, head_dim] (HND), got {k.shape} and "
                             f"{v.shape}")
        if k.ndim == 3:  # [P, Hkv, D]: page_size 1
            P, H, D = k.shape
            return Cache(k.ptr, v.ptr, (k.strides[0], 0, k.strides[1]), (v.strides[0], 0, v.strides[1]), P, 1, H, D,
                         k.dtype, views)
        P, ps, H, D = k.shape if nhd else (k.shape[0], k.shape[2], k.shape[1], k.shape[3])
        return Cache(k.ptr, v.ptr, operands.paged_kv_strides(layout, k.strides),
                     operands.paged_kv_strides(layout, v.strides), P, ps, H, D, k.dtype, views)
    c = views[0][0]
    if c.ndim not in (4, 5) or c.shape[1] != 2:
        raise ValueError(f"paged_kv_cache must have shape [num_pages, 2, page_size, num_kv_heads, head_dim] (NHD) or "
                         f"[num_pages, 2, num_kv_heads, page_size, head_dim] (HND), got {c.shape}")
    v_ptr = c.ptr + c.strides[1] * (c.dtype.bits // 8)
    if c.ndim == 4:  # [P, 2, Hkv, D]: page_size 1
        P, _, H, D = c.shape
        st = (c.strides[0], 0, c.strides[2])
        return Cache(c.ptr, v_ptr, st, st, P, 1, H, D, c.dtype, views)
    P, _, a, b, D = c.shape
    ps, H = (a, b) if nhd else (b, a)
    st = operands.paged_kv_strides(layout, (c.strides[0],) + c.strides[2:])
    return Cache(c.ptr, v_ptr, st, st, P, ps, H, D, c.dtype, views)


def _append_operands(append_key, append_value, cache: Cache, ref: str, dev: int):
    views = []
    for obj, name in ((append_key, "append_key"), (append_value, "append_value")):
        v = _tensor.view(obj, name)
        operands.require_device(v, name, dev, ref)
        if v.dtype is not cache.dtype:
            raise TypeError(f"{name} has dtype {v.dtype.name} but {ref} holds {cache.dtype.name}; the appended "
                            "keys and values must have the cache's dtype")
        if v.ndim != 3:
            raise ValueError(f"{name} must be 3-D [nnz, num_kv_heads, head_dim], got shape {v.shape}")
        if v.shape[1:] != (cache.num_heads, cache.head_dim):
            raise ValueError(f"{name} has shape {v.shape} but {ref} has num_kv_heads = {cache.num_heads} and "
                             f"head_dim = {cache.head_dim}")
        if v.strides[2] != 1 and v.shape[2] > 1 and 0 not in v.shape:
            raise ValueError(f"{name} must be contiguous in its last dim (head_dim), got strides {v.strides}")
        views.append(v)
    if views[1].shape != views[0].shape:
        raise ValueError(f"append_key and append_value must have the same shape, got {views[0].shape} and "
                         f"{views[1].shape}")
    row_bytes = cache.num_heads * cache.head_dim * cache.dtype.bits // 8
    if row_bytes > ROW_BYTES_MAX:
        raise ValueError(f"append_key rows of {row_bytes} bytes (num_kv_heads * head_dim) exceed the page kernel's "
                         f"{ROW_BYTES_MAX}")
    return views


def _index_operand(x, name: str, dev: int, ref: str):
    """A 1-D contiguous int32 CUDA index array on dev (the validator's index_array)."""
    v = _tensor.view(x, name)
    operands.index_array(v, name, dev, ref)
    return v


def _check_int32_extents(*extents) -> None:
    for name, n in extents:
        if n > I32_MAX:
            raise ValueError(f"{name} = {n} exceeds the page kernel's int32 range")


def _check_cache_framework(v, name: str) -> None:
    """Last check before the driver is touched (CPU tests' fake producers stop here)."""
    if v.framework not in _CACHE_FRAMEWORKS:
        raise TypeError(f"{name}: a cache of framework {v.framework!r} cannot be written in place here "
                        "(torch or CuPy)")


def check_append_metadata(batch_indices, positions, kv_indices, kv_indptr, num_pages: int, page_size: int) -> None:
    """The checked mode (PYFLASHATTN_CHECK_METADATA=1): copy the index arrays to the host (a sync)
    and raise ValueError naming the argument whose entry would make the kernel skip a token."""
    bi = indices.host_int(batch_indices, "batch_indices")
    pos = indices.host_int(positions, "positions")
    idx = indices.host_int(kv_indices, "kv_indices")
    ind = indices.host_int(kv_indptr, "kv_indptr").astype(np.int64)
    pages = np.diff(ind)
    if ind[0] < 0 or (pages.size and pages.min() < 0):
        raise ValueError(f"kv_indptr must be >= 0 and non-decreasing ({metadata_check.ENV}=1)")
    if ind[-1] > idx.size:
        raise ValueError(f"kv_indptr[-1] = {int(ind[-1])} exceeds len(kv_indices) = {idx.size} "
                         f"({metadata_check.ENV}=1)")
    first = int(ind[0])
    metadata_check.check_range(idx[first:int(ind[-1])], 0, num_pages, "kv_indices",
                               f"a page id must index the cache's {num_pages} pages", offset=first)
    metadata_check.check_range(bi, 0, pages.size, "batch_indices",
                               f"the batch has {pages.size} requests, len(kv_indptr) - 1")
    owned = pages[bi] * page_size  # bi is in range now
    metadata_check.check_range(pos.astype(np.int64), 0, owned, "positions",
                               f"positions[i] // page_size must be < the pages request batch_indices[i] owns, "
                               f"page_size = {page_size}")


def _vec_bytes(item: int, head_dim: int, ptrs, strided) -> int:
    """The widest copy (16, 8, 4, 2 or 1 bytes) that divides every address, every stride of a dim
    with more than one entry, and a row (gcd with 16 is a power of two)."""
    g = math.gcd(16, head_dim * item)
    for p in ptrs:
        g = math.gcd(g, p)
    for n, stride in strided:
        if n > 1:
            g = math.gcd(g, abs(stride) * item)
    return g


def launch_append(dev, s, vk, vv, cache: Cache, ix: dict, nnz: int, batch: int, la=None) -> None:
    """The append of nnz > 0 rows vk / vv into the cache on stream s. la: the page kernel's launcher
    to fill (pyflashattn.jax: its own, from new_launcher); None: this thread's cached one."""
    item = cache.dtype.bits // 8
    H, D, P, ps = cache.num_heads, cache.head_dim, cache.num_pages, cache.page_size
    ks, vs = cache.k_strides, cache.v_strides
    vec = _vec_bytes(item, D, (vk.ptr, vv.ptr, cache.k_ptr, cache.v_ptr),
                     ((nnz, vk.strides[0]), (H, vk.strides[1]), (nnz, vv.strides[0]), (H, vv.strides[1]),
                      (P, ks[0]), (ps, ks[1]), (H, ks[2]), (P, vs[0]), (ps, vs[1]), (H, vs[2])))
    per_token = 2 * H * (D * item // vec)
    tpb = max(1, min(MAX_TOKENS, CHUNKS_PER_CTA // max(per_token, 1)))
    if la is None:
        _cuda.ensure_context(dev)
        la = _registry.launcher("page", dev)
    p = _cleared(la.params)
    p.mode = APPEND
    p.append_k, p.append_v, p.k_cache, p.v_cache = vk.ptr, vv.ptr, cache.k_ptr, cache.v_ptr
    p.batch_indices, p.positions = ix["batch_indices"].ptr, ix["positions"].ptr
    p.kv_indices, p.kv_indptr = ix["kv_indices"].ptr, ix["kv_indptr"].ptr
    p.append_k_stride_n, p.append_k_stride_h = vk.strides[0], vk.strides[1]
    p.append_v_stride_n, p.append_v_stride_h = vv.strides[0], vv.strides[1]
    p.k_stride_page, p.k_stride_n, p.k_stride_h = ks
    p.v_stride_page, p.v_stride_n, p.v_stride_h = vs
    p.nnz, p.batch_size, p.num_heads, p.head_dim, p.page_size = nnz, batch, H, D, ps
    p.num_pages, p.num_indices = P, ix["kv_indices"].shape[0]
    p.elem_bytes, p.vec_bytes, p.tokens_per_block = item, vec, tpb
    la.launch((-(-nnz // tpb), 1, 1), s)


def new_launcher(dev: int):
    """A page kernel launcher with its own params struct (not the thread's cached one), for a
    caller that launches from other threads (XLA's) under its own lock."""
    return _registry.new_launcher("page", dev)


def _cleared(p):
    """The launcher's params struct zeroed: no field of another mode's launch survives."""
    ctypes.memset(ctypes.addressof(p), 0, ctypes.sizeof(p))
    return p


# ---------------------------------------------------------------- get_batch_indices_positions

def batch_indices_positions(append_indptr, seq_lens, nnz):
    """get_batch_indices_positions (pyflashattn.page): (batch_indices, positions), int32 [nnz]."""
    nnz = count(nnz, "nnz")
    iv, sv = _device_view(append_indptr, "append_indptr"), _device_view(seq_lens, "seq_lens")
    if iv is None and sv is None:
        ip = indices.host_int(append_indptr, "append_indptr").astype(np.int64)
        sl = indices.host_int(seq_lens, "seq_lens")
        B = _host_batch(ip, sl, "append_indptr", "seq_lens")
        lens = np.diff(ip)
        if ip[0] < 0 or (lens.size and lens.min() < 0):
            raise ValueError("append_indptr must be >= 0 and non-decreasing")
        if ip[-1] > nnz:
            raise ValueError(f"append_indptr[-1] = {int(ip[-1])} exceeds nnz = {nnz}")
        bi = np.full(nnz, -1, dtype=np.int32)
        pos = np.full(nnz, -1, dtype=np.int32)
        b = np.repeat(np.arange(B), lens)
        tok = np.arange(ip[0], ip[-1])
        bi[tok] = b
        pos[tok] = (sl[b].astype(np.int64) - lens[b] + (tok - ip[b])).astype(np.int32)  # int32 arithmetic
        return _host_result(bi, append_indptr), _host_result(pos, append_indptr)
    iv, sv, dev = check_batch_positions(iv, sv, nnz)
    s, (iv, sv) = _launch_views(iv, sv, dev, ("append_indptr", "seq_lens"))
    bi, biv = _tensor.empty(iv, (nnz,), INT32, s)
    pos, posv = _tensor.empty(iv, (nnz,), INT32, s)
    launch_batch_positions(iv, sv, biv, posv, nnz, s)
    return _tensor.finalize(bi), _tensor.finalize(pos)


def check_batch_positions(iv, sv, nnz: int):
    """get_batch_indices_positions' checks of device arrays (views; nnz checked): (iv, sv, device)."""
    iv, sv, dev = _device_pair(iv, sv, "append_indptr", "seq_lens")
    B = iv.shape[0] - 1
    if B < 0:
        raise ValueError("append_indptr must have batch_size + 1 >= 1 entries, got an empty array")
    if sv.shape[0] != B:
        raise ValueError(f"seq_lens has {sv.shape[0]} entries but append_indptr describes batch_size = {B} requests")
    _check_int32_extents(("nnz", nnz), ("len(append_indptr)", B + 1))
    _check_output_framework(iv, "append_indptr")
    return iv, sv, dev


def launch_batch_positions(iv, sv, biv, posv, nnz: int, s: int, la=None) -> None:
    """batch_indices / positions [nnz] into biv / posv on stream s (la: as launch_append's)."""
    if nnz:
        la = _registry.launcher("page", iv.device_id) if la is None else la
        p = _cleared(la.params)
        p.mode = BATCH_POSITIONS
        p.append_indptr, p.seq_lens, p.batch_indices, p.positions = iv.ptr, sv.ptr, biv.ptr, posv.ptr
        p.nnz, p.batch_size = nnz, iv.shape[0] - 1
        la.launch((-(-nnz // THREADS), 1, 1), s)


# ---------------------------------------------------------------- get_seq_lens

def seq_lens(kv_indptr, kv_last_page_len, page_size):
    """get_seq_lens (pyflashattn.page): int32 [batch_size]."""
    ps = page_size_arg(page_size)
    iv, lv = _device_view(kv_indptr, "kv_indptr"), _device_view(kv_last_page_len, "kv_last_page_len")
    if iv is None and lv is None:
        ind = indices.host_int(kv_indptr, "kv_indptr").astype(np.int64)
        last = indices.host_int(kv_last_page_len, "kv_last_page_len")
        _host_batch(ind, last, "kv_indptr", "kv_last_page_len")
        pages = np.diff(ind)
        out = np.where(pages > 0, (pages - 1) * ps + last, 0).astype(np.int32)  # int32 arithmetic
        return _host_result(out, kv_indptr)
    iv, lv, dev = check_seq_lens(iv, lv, ps)
    s, (iv, lv) = _launch_views(iv, lv, dev, ("kv_indptr", "kv_last_page_len"))
    out, ov = _tensor.empty(iv, (iv.shape[0] - 1,), INT32, s)
    launch_seq_lens(iv, lv, ov, ps, s)
    return _tensor.finalize(out)


def check_seq_lens(iv, lv, page_size: int):
    """get_seq_lens' checks of device arrays (views; page_size checked): (iv, lv, device)."""
    iv, lv, dev = _device_pair(iv, lv, "kv_indptr", "kv_last_page_len")
    B = iv.shape[0] - 1
    if B < 0:
        raise ValueError("kv_indptr must have batch_size + 1 >= 1 entries, got an empty array")
    if lv.shape[0] != B:
        raise ValueError(f"kv_last_page_len has {lv.shape[0]} entries but kv_indptr describes batch_size = {B} "
                         "requests")
    _check_int32_extents(("len(kv_indptr)", B + 1))
    _check_output_framework(iv, "kv_indptr")
    return iv, lv, dev


def launch_seq_lens(iv, lv, ov, page_size: int, s: int, la=None) -> None:
    """seq_lens [batch_size] into ov on stream s (la: as launch_append's)."""
    B = iv.shape[0] - 1
    if B:
        la = _registry.launcher("page", iv.device_id) if la is None else la
        p = _cleared(la.params)
        p.mode = SEQ_LENS
        p.kv_indptr, p.kv_last_page_len, p.seq_lens = iv.ptr, lv.ptr, ov.ptr
        p.batch_size, p.page_size = B, page_size
        la.launch((-(-B // THREADS), 1, 1), s)


# ---------------------------------------------------------------- helpers of the two above

def page_size_arg(page_size) -> int:
    """get_seq_lens' page_size: an int in [1, INT32_MAX]."""
    ps = operands.positive_int(page_size, "page_size")
    _check_int32_extents(("page_size", ps))
    return ps


def count(n, name: str) -> int:
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
        raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    return int(n)


def _device_view(x, name: str):
    """The view of a device array, None for host data (numpy, lists, CPU tensors)."""
    if isinstance(x, (np.ndarray, np.generic, list, tuple)) or not hasattr(x, "__dlpack__"):
        return None
    v = _tensor.view(x, name)
    return None if v.device_type == kDLCPU else v


def _device_pair(a, b, a_name: str, b_name: str):
    """Two device index arrays (int32, 1-D, contiguous, one CUDA device) and that device; an
    argument on the host next to a device one is named."""
    if a is None or b is None:
        host, dev_v = (a_name, b) if a is None else (b_name, a)
        other = b_name if a is None else a_name
        raise ValueError(f"{_tensor.not_cuda_message(host, kDLCPU)}: {other} is on "
                         f"{_tensor.device_name(dev_v.device_type, dev_v.device_id)} (pass both on one CUDA device, "
                         "or both on the host)")
    if not a.is_cuda:
        raise ValueError(_tensor.not_cuda_message(a_name, a.device_type, a.device_id))
    dev = a.device_id
    for v, name in ((a, a_name), (b, b_name)):
        operands.index_array(v, name, dev, a_name)
    return a, b, dev


def _check_output_framework(v, name: str) -> None:
    """Last check before the driver is touched (CPU tests' fake producers stop here)."""
    if v.framework not in _OUTPUT_FRAMEWORKS:
        raise TypeError(f"{name}: CUDA arrays of framework {v.framework!r} are not supported (torch, CuPy or JAX)")


def _launch_views(a, b, dev: int, names):
    """The stream of a's framework on dev and the two views, re-read with that stream for
    frameworks other than torch (the DLPack handshake orders their pending writes first)."""
    _cuda.ensure_context(dev)
    s = _tensor.current_stream(a.framework, dev)
    return s, tuple(v if v.framework == "torch" else _tensor.view(v.obj, n, stream=s) for v, n in zip((a, b), names))


def _host_batch(indptr: np.ndarray, per_request: np.ndarray, indptr_name: str, name: str) -> int:
    B = indptr.size - 1
    if B < 0:
        raise ValueError(f"{indptr_name} must have batch_size + 1 >= 1 entries, got an empty array")
    if per_request.size != B:
        raise ValueError(f"{name} has {per_request.size} entries but {indptr_name} describes batch_size = {B} "
                         "requests")
    return B


def _host_result(arr: np.ndarray, like):
    """arr in the framework of a host input: torch for a CPU torch tensor, numpy otherwise."""
    if _tensor.framework_of(like) == "torch":
        return sys.modules["torch"].from_numpy(arr)
    return arr
