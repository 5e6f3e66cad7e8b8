"""Paged KV cache helpers with FlashInfer's API (``flashinfer.page``).

    seq_lens = get_seq_lens(kv_indptr, kv_last_page_len, page_size)   # after growing the pages
    batch_indices, positions = get_batch_indices_positions(append_indptr, seq_lens, nnz)
    append_paged_kv_cache(k, v, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
                          kv_last_page_len, kv_layout="NHD")

Token ``i`` of an append goes to request ``b = batch_indices[i]`` at position
``p = positions[i]``: page ``kv_indices[kv_indptr[b] + p // page_size]``, slot
``p % page_size``. As in FlashInfer the caller grows ``kv_indptr`` / ``kv_indices`` /
``kv_last_page_len`` to include the new tokens first.

Device arrays of torch or CuPy (the cache is written in place, so it cannot be a JAX array; the
helpers that return new arrays take JAX too) are handled by the ``page`` kernel on the framework's
current stream, without a host sync: graph-safe. Index arrays are int32 (other dtypes are a
TypeError: FlashInfer converts them, and int64 metadata silently broke its decode, issue #1654).

Safety: the page tables, batch indices and positions live on the device and are not checked by
the host, but the append never writes outside the cache: a token whose batch index is outside
``[0, batch_size)``, whose position is negative or beyond the pages its request owns
(``p // page_size >= kv_indptr[b+1] - kv_indptr[b]``), or whose page id is outside
``[0, num_pages)`` is skipped. With the environment variable ``PYFLASHATTN_CHECK_METADATA=1``
the append copies those arrays to the host (a sync) and raises ValueError naming the argument
and the first bad entry instead.
"""
from __future__ import annotations

from ._engine import page as _page

__all__ = ["append_paged_kv_cache", "get_batch_indices_positions", "get_seq_lens"]


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
                          kv_last_page_len, kv_layout: str = "NHD") -> None:
    r"""Append a batch of key-value pairs to a paged key-value cache, in place.

    Parameters
    ----------
    append_key : CUDA tensor
        The keys to append, ``[nnz, num_kv_heads, head_dim]`` (rows and heads may be strided; the
        last dim contiguous), in the cache's dtype.
    append_value : CUDA tensor
        The values to append, same shape and dtype as ``append_key``.
    batch_indices : int32 CUDA tensor
        ``[nnz]``: the request of each appended token.
    positions : int32 CUDA tensor
        ``[nnz]``: the position of each appended token in its request's sequence.
    paged_kv_cache : CUDA tensor or (k_cache, v_cache)
        The paged KV cache (torch or CuPy), float16, bfloat16, float8_e4m3fn, float8_e5m2 or
        float32, written in place:

        * a single 5-D tensor ``[max_num_pages, 2, page_size, num_kv_heads, head_dim]`` (NHD) or
          ``[max_num_pages, 2, num_kv_heads, page_size, head_dim]`` (HND), where
          ``paged_kv_cache[:, 0]`` is the key cache and ``paged_kv_cache[:, 1]`` the value cache;
        * a tuple ``(k_cache, v_cache)`` of 4-D tensors ``[max_num_pages, page_size,
          num_kv_heads, head_dim]`` (NHD) or ``[max_num_pages, num_kv_heads, page_size,
          head_dim]`` (HND), each with its own strides.

        One dim less (a 4-D single tensor, 3-D pair members) reads as ``page_size = 1``. Strides
        are taken from the tensors; only the last dim must be contiguous.
    kv_indices : int32 CUDA tensor
        The page ids of the paged cache, ``[kv_indptr[-1]]``.
    kv_indptr : int32 CUDA tensor
        ``[batch_size + 1]``: request ``b`` owns pages ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.
    kv_last_page_len : int32 CUDA tensor
        ``[batch_size]``, the tokens in each request's last page. Accepted for FlashInfer's
        signature and checked for shape and dtype; the kernel does not read it (``positions``
        say where every token goes).
    kv_layout : str
        ``"NHD"`` (default) or ``"HND"``.

    Notes
    -----
    The caller must already have allocated the pages of the appended tokens: ``kv_indices``,
    ``kv_indptr`` and ``kv_last_page_len`` include them. Runs on the cache framework's current
    stream with no host sync, so it can be captured in a CUDA graph (unless
    ``PYFLASHATTN_CHECK_METADATA=1``). Tokens whose metadata points outside the cache are skipped
    (module docstring); the checked mode raises ValueError for them instead.

    Raises
    ------
    ValueError
        A bad ``kv_layout``; shapes that do not match (ranks, ``append_key`` vs
        ``append_value``, heads / head_dim vs the cache, ``[nnz]`` index arrays,
        ``[batch_size]`` ``kv_last_page_len``); a tensor on the CPU or on another device; with
        ``PYFLASHATTN_CHECK_METADATA=1``, out-of-range metadata.
    TypeError
        Append data not in the cache's dtype, an unsupported cache dtype, index arrays that are
        not int32, a JAX (immutable) cache.
    """
    _page.append(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
                 kv_last_page_len, kv_layout)


def get_batch_indices_positions(append_indptr, seq_lens, nnz: int):
    r"""Convert append indptr and sequence lengths to batch indices and positions.

    Parameters
    ----------
    append_indptr : int32 array
        The indptr of the ragged append, ``[batch_size + 1]``: request ``b`` appends tokens
        ``append_indptr[b]:append_indptr[b+1]``.
    seq_lens : int32 array
        The sequence length of each request in the KV cache, the appended tokens included,
        ``[batch_size]`` (see :func:`get_seq_lens`).
    nnz : int
        The number of entries of the ragged append (the length of the outputs).

    Returns
    -------
    batch_indices : int32 array ``[nnz]``
        ``b`` for token ``i`` of request ``b``.
    positions : int32 array ``[nnz]``
        Right-aligned: ``seq_lens[b] - (append_indptr[b+1] - append_indptr[b]) + (i - append_indptr[b])``.

    Tokens of no request (``i < append_indptr[0]`` or ``i >= append_indptr[-1]``, e.g. padding up
    to a CUDA-graph size) get ``-1`` for both, which :func:`append_paged_kv_cache` skips
    (FlashInfer leaves them uninitialised).

    CUDA inputs (torch, CuPy, JAX; both on one device) run a kernel on the framework's current
    stream with no host sync (graph-safe; ``nnz`` comes from the caller) and return arrays of
    that framework; an ``append_indptr[-1]`` above ``nnz`` drops the tokens beyond ``nnz``. Host
    inputs (numpy, lists, CPU tensors) are computed with numpy, checked (non-decreasing
    ``append_indptr``, ``append_indptr[-1] <= nnz``) and come back as numpy (torch for CPU
    torch inputs).

    Example
    -------
    >>> append_indptr = np.array([0, 1, 3, 6, 10], dtype=np.int32)
    >>> batch_indices, positions = get_batch_indices_positions(append_indptr, np.full(4, 5, np.int32), 10)
    >>> batch_indices
    array([0, 1, 1, 2, 2, 2, 3, 3, 3, 3], dtype=int32)
    >>> positions
    array([4, 3, 4, 2, 3, 4, 1, 2, 3, 4], dtype=int32)
    """
    return _page.batch_indices_positions(append_indptr, seq_lens, nnz)


def get_seq_lens(kv_indptr, kv_last_page_len, page_size: int):
    r"""Convert KV indptr and last page lengths to sequence lengths.

    Parameters
    ----------
    kv_indptr : int32 array
        The indptr of the paged KV cache, ``[batch_size + 1]``.
    kv_last_page_len : int32 array
        The number of entries in the last page of each request, ``[batch_size]``.
    page_size : int
        The size of a page of the paged KV cache.

    Returns
    -------
    seq_lens : int32 array ``[batch_size]``
        ``(pages - 1) * page_size + kv_last_page_len`` with ``pages = kv_indptr[b+1] -
        kv_indptr[b]``, and 0 for a request with no pages: the kv length the attention kernels
        use (FlashInfer's ``get_length``; its torch one-liner clamps ``pages - 1`` at 0 and so
        gives ``kv_last_page_len`` there, which is 0 whenever a page-less request's
        ``kv_last_page_len`` is).

    CUDA inputs run a small kernel on the framework's current stream (no sync) and return an
    array of that framework; host inputs are computed with numpy.
    """
    return _page.seq_lens(kv_indptr, kv_last_page_len, page_size)
