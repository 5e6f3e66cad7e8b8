"""Host index arrays of a batch plan: ingested (numpy, lists or device tensors), checked, and
turned into a KV source (problem.KVSource) with each request's query and key lengths.

plan() is on the serving loop's critical path: the common case (int32 numpy arrays) is kept
cheap, and checks are folded into few numpy calls (see npfast).
"""
from __future__ import annotations

import numpy as np

from .._runtime import cuda as _cuda, dtypes as _dtypes, tensor as _tensor
from .npfast import consts as _k, unsigned_max
from .problem import KVSource

I32_MAX = 2**31 - 1
_new_source = tuple.__new__  # a KVSource from its fields in order, without NamedTuple's keyword parsing
# numpy's descriptors: `is` tests them, and numpy takes them faster than the scalar types
_INT32, _INT64, _UINT32 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.uint32)


def host_int(x, name):
    """A host int32 numpy copy of an index array (numpy, list, or a device tensor: a sync)."""
    if x is None:
        raise ValueError(f"{name} is required")
    if type(x) is np.ndarray and x.dtype is _INT32 and x.ndim == 1:
        return x  # the common case, kept cheap: plan() is on the serving loop's critical path
    if isinstance(x, np.ndarray):
        a = x
    elif isinstance(x, (list, tuple)):
        a = np.asarray(x)
    else:
        if not hasattr(x, "__dlpack__"):
            raise TypeError(f"{name} must be an integer array (numpy or a DLPack tensor), got {type(x).__name__}")
        v = _tensor.view(x, name)
        if v.dtype not in (_dtypes.INT32, _dtypes.INT64, _dtypes.UINT32):
            raise TypeError(f"{name} must be int32 (or int64), got {v.dtype.name}")
        if v.is_cuda:
            a = _device_to_host(x, v, name)
        else:
            a = np.from_dlpack(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got {a.dtype}")
    if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
        raise ValueError(f"{name} has values outside int32")
    return a.astype(np.int32, copy=False)


def lengths(indptr):
    """(lengths as int64, their maximum as uint64): a negative length, i.e. an indptr that
    decreases, gives a maximum >= 2**63 (int64: the differences of int32 entries never wrap;
    a conversion first is cheaper than a mixed-type subtraction)."""
    a = indptr.astype(_INT64)
    lens = a[1:] - a[:-1]
    return lens, unsigned_max(lens)


def _device_to_host(x, v, name):
    """Copy a 1-D device index array to the host, ordered after its producer's pending writes:
    on torch's / CuPy's current stream, or (JAX, others) on the library stream after the DLPack
    handshake; then wait for that stream (this is the one sync a device index array costs)."""
    n = v.shape[0] if v.ndim == 1 else None
    if n is None:
        raise ValueError(f"{name} must be 1-D, got shape {v.shape}")
    if n > 1 and v.strides[0] != 1:
        raise ValueError(f"{name} must be contiguous")
    itemsize = v.dtype.bits // 8
    out = np.empty(n, dtype=np.int32 if itemsize == 4 else np.int64)
    if n:
        dev = v.device_id
        _cuda.ensure_context(dev)
        if v.framework in ("torch", "cupy"):
            s = _tensor.current_stream(v.framework, dev)
        else:
            s = _cuda.library_stream(dev)
            v = _tensor.view(x, name, stream=s)
        cu = _cuda.driver()
        _cuda.check(cu.cuMemcpyDtoHAsync(out.ctypes.data, v.ptr, n * itemsize, s), f"copy {name} to host")
        _cuda.check(cu.cuStreamSynchronize(s), f"cuStreamSynchronize (copy of {name})")
    return out


def _page_size_arg(page_size) -> int:
    if type(page_size) is not int or page_size <= 0:
        if not isinstance(page_size, (int, np.integer)) or isinstance(page_size, bool) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        page_size = int(page_size)
    return page_size


def paged_source(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size,
                 max_pages: int | None = None) -> KVSource:
    """The KV source of a paged batch; max_pages: the CUDA-graph capacity in pages (or None)."""
    qo = host_int(qo_indptr, "qo_indptr")
    ind = host_int(paged_kv_indptr, "paged_kv_indptr")
    idx = host_int(paged_kv_indices, "paged_kv_indices")
    last = host_int(paged_kv_last_page_len, "paged_kv_last_page_len")
    page_size = _page_size_arg(page_size)
    B = qo.size - 1
    if B < 0 or ind.size != B + 1 or last.size != B:
        raise ValueError(f"qo_indptr ({qo.size}), paged_kv_indptr ({ind.size}) and paged_kv_last_page_len "
                         f"({last.size}) must describe the same batch (B+1, B+1, B)")
    qo_lens, max_qo = lengths(qo)
    if max_qo >> 63:
        raise ValueError("qo_indptr must start at 0 and be non-decreasing")
    pages, max_pages_req = lengths(ind)
    if max_pages_req >> 63:
        raise ValueError("paged_kv_indptr must start at 0 and be non-decreasing")
    # kv_len = (pages - 1) * page_size + last_page_len, 0 without pages (FlashInfer ignores
    # that request's last_page_len), in few numpy calls (their fixed cost dominates here).
    has = pages != _k[0]
    full = pages * _k[page_size]
    kv_lens = full + last
    kv_lens -= _k[page_size]
    kv_lens *= has
    # full - kv_len = page_size - last_page_len, 0 without pages, must lie in [0, page_size):
    # as unsigned, anything else is >= page_size, so one argmax checks every request.
    if unsigned_max(full - kv_lens) >= page_size:
        raise ValueError(f"paged_kv_last_page_len must be in [1, page_size={page_size}] for requests with pages")
    max_kv = kv_lens.item(kv_lens.argmax()) if B else 0
    if qo[0] != 0:
        raise ValueError("qo_indptr must start at 0 and be non-decreasing")
    if ind[0] != 0:
        raise ValueError("paged_kv_indptr must start at 0 and be non-decreasing")
    n_used = ind.item(-1)
    if n_used > idx.size:
        raise ValueError(f"paged_kv_indptr[-1] = {n_used} exceeds len(paged_kv_indices) = {idx.size}")
    used = idx[:n_used]
    max_page = -1
    if n_used:
        # One pass for both checks: negative ids become huge as unsigned (argmax + one index
        # are cheaper than a max reduction).
        u = used.view(_UINT32)
        max_page = u.item(u.argmax())
        if max_page > I32_MAX:
            raise ValueError("paged_kv_indices must be >= 0")
    if max_pages is not None and n_used > max_pages:
        raise ValueError(f"the plan uses {n_used} pages but paged_kv_indices_buf holds {max_pages} "
                         "(the CUDA-graph capacity)")
    return _new_source(KVSource, ("paged", qo, qo_lens, kv_lens, max_qo, max_kv, (ind, used, last), page_size,
                                  max_page, 0))


def ragged_source(qo_indptr, kv_indptr) -> KVSource:
    """The KV source of a ragged batch."""
    qo = host_int(qo_indptr, "qo_indptr")
    kvi = host_int(kv_indptr, "kv_indptr")
    B = qo.size - 1
    if B < 0 or kvi.size != B + 1:
        raise ValueError(f"qo_indptr ({qo.size}) and kv_indptr ({kvi.size}) must both have B+1 entries")
    qo_lens, max_qo = lengths(qo)
    kv_lens, max_kv = lengths(kvi)
    if (max_qo | max_kv) >> 63:
        if max_qo >> 63:
            raise ValueError("qo_indptr must start at 0 and be non-decreasing")
        raise ValueError("kv_indptr must start at 0 and be non-decreasing")
    if qo[0] != 0:
        raise ValueError("qo_indptr must start at 0 and be non-decreasing")
    if kvi[0] != 0:
        raise ValueError("kv_indptr must start at 0 and be non-decreasing")
    return _new_source(KVSource, ("ragged", qo, qo_lens, kv_lens, max_qo, max_kv, (kvi,), 1, -1, kvi.item(-1)))


def block_table_arrays(block_tables, seq_lens, page_size):
    """(indptr, indices, last_page_len) of a batch given as block_tables [B, max_pages] and
    seq_lens [B] (host arrays, or device arrays copied once: a sync): request b's pages are the
    first ceil(seq_lens[b] / page_size) entries of its row."""
    if block_tables is None or seq_lens is None:
        raise ValueError("plan() needs indptr, indices and last_page_len, or block_tables and seq_lens")
    page_size = _page_size_arg(page_size)
    lens = host_int(seq_lens, "seq_lens").astype(np.int64)
    if hasattr(block_tables, "__dlpack__") and not isinstance(block_tables, np.ndarray):
        v = _tensor.view(block_tables, "block_tables")
        if v.ndim != 2:
            raise ValueError(f"block_tables must be 2-D [batch, max_pages], got shape {v.shape}")
        if v.shape[0] > 1 and v.strides != (v.shape[1], 1):
            raise ValueError("plan(block_tables=...) needs a contiguous block_tables (or a numpy array)")
        table = host_int(block_tables.reshape(-1), "block_tables").reshape(v.shape)
    else:
        table = np.asarray(block_tables)
        if table.ndim != 2:
            raise ValueError(f"block_tables must be 2-D [batch, max_pages], got shape {table.shape}")
        table = host_int(table.reshape(-1), "block_tables").reshape(table.shape)  # int32, range-checked
    B, width = table.shape
    if lens.size != B:
        raise ValueError(f"seq_lens has {lens.size} entries but block_tables has {B} rows")
    if lens.size and lens.min() < 0:
        raise ValueError("seq_lens must be >= 0")
    pages = -(-lens // page_size)
    if pages.size and pages.max() > width:
        raise ValueError(f"seq_lens needs up to {int(pages.max())} pages but block_tables rows hold {width}")
    indptr = np.zeros(B + 1, np.int32)
    np.cumsum(pages, out=indptr[1:])
    used = np.arange(width)[None, :] < pages[:, None]
    idx = np.ascontiguousarray(table[used], dtype=np.int32)
    last = np.where(pages > 0, lens - (pages - 1) * page_size, 0).astype(np.int32)
    return indptr, idx, last


def block_table_source(batch: int, q_len: int, planned_len: int, row_stride: int, page_size: int,
                       mask_row_bytes: int) -> KVSource:
    """The KV source of an XQA call: B requests of q_len query rows, each planned at planned_len
    keys (its length at run is seq_lens[b] <= that, read by the kernel); page ids at row b of a
    block table with row_stride entries per row; mask_row_bytes: bytes of one request's
    speculative-decoding mask (0: none), whose per-request offsets are staged with the plan."""
    qo = np.arange(batch + 1, dtype=np.int32) * np.int32(q_len)
    qo_lens = np.full(batch, q_len, np.int64)
    kv_lens = np.full(batch, planned_len, np.int64)
    kv_indptr = (np.arange(batch + 1, dtype=np.int64) * row_stride).astype(np.int32)
    mask_indptr = (np.arange(batch + 1, dtype=np.int64) * mask_row_bytes).astype(np.int32)
    return _new_source(KVSource, ("block_table", qo, qo_lens, kv_lens, q_len if batch else 0,
                                  planned_len if batch else 0, (kv_indptr, mask_indptr), page_size, -1, 0))
