"""TRT-LLM calls whose length metadata (and block tables) stay on the device: no sync, no plan
per call, CUDA-graph capturable.

As XQA does (xqa.py), the batch engine runs them from a plan per shape key: batch_size requests,
each planned at (coarsely rounded) max_q_len queries and max_kv_len keys, so the work items are
batch_size x ceil(max_q_len * group / BLOCK_M) row tiles in longest-first order (causal: the
bottom tiles first). The kernel reads each request's real rows from the caller's arrays:
qo_indptr = cum_seq_lens_q, and ragged K/V kv_indptr = cum_seq_lens_kv, or paged K/V seq_lens
and block_tables (a "block_table" KV source; [B, 2, M] tables give V its own page ids). Row tiles
past a request's rows exit at once. There is no split KV on this path: its merge needs partial
rows known on the host.

Device metadata is not checked on the host (that would sync). The kernel clamps every request's
rows into q / o and K / V and to max_q_len / max_kv_len, and every page id into the cache, so bad
metadata gives a wrong answer but never a read or write outside them (PrefillParams q_tokens,
qo_max_len, kv_tokens, kv_max_len, num_pages). PYFLASHATTN_CHECK_METADATA=1 checks them on the
host (a sync per call) with ValueErrors naming the argument.

After one call of a shape key (which plans: it allocates and copies), a call with the same key
and out= given only points the structs and launches: capturable in a CUDA graph, whose replays
read the arrays' current contents (new lengths within max_q_len / max_kv_len).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .._runtime import dtypes as _dtypes, tensor as _tensor
from . import indices, operands
from .batch import BatchEngine
from .metadata_check import ENV, metadata_checks_enabled
from .problem import KVSource, PlanSettings

_ENGINES: OrderedDict = OrderedDict()  # shape key -> a planned BatchEngine (never re-planned)
_MAX_ENGINES = 16
_settings = tuple.__new__


def on_device(*arrays) -> bool:
    """Whether the arrays the kernel reads are all device tensors (numpy or lists: the host path)."""
    return all(a is not None and not isinstance(a, (np.ndarray, list, tuple)) for a in arrays)


def coarse(n: int) -> int:
    """n rounded up to 1/8 of its power of two (at most 12.5% more): the planned length, so a
    batch whose maximum grows a little keeps its plan (the kernel clamps to the exact maximum)."""
    grid = 1 << max(n.bit_length() - 4, 0)
    return -(-n // grid) * grid


def ragged_source(batch: int, q_len: int, kv_len: int) -> KVSource:
    """The plan's stand-in for a ragged batch: every request q_len queries over kv_len keys (the
    kernel reads the real indptrs from the caller's arrays)."""
    qo = (np.arange(batch + 1, dtype=np.int64) * q_len).astype(np.int32)
    kv = (np.arange(batch + 1, dtype=np.int64) * kv_len).astype(np.int32)
    return indices.ragged_source(qo, kv)


def planned_lengths(max_q: int, max_kv: int, paging=None) -> tuple:
    """(queries, keys) a request is planned at: coarse() maxima, the keys within a block-table row."""
    q_plan, kv_plan = coarse(max_q), coarse(max_kv)
    if paging is not None:
        ps, row, width = paging
        kv_plan = min(-(-kv_plan // ps), width) * ps
    return q_plan, kv_plan


def plan(dev, workspace, kv_layout, paged, heads, dtypes, batch, max_q, max_kv, causal, wl, chunk, pos, cap,
         general, stats, paging=None) -> BatchEngine:
    """The planned engine of this shape key. heads = (Hq, Hkv, D), dtypes = (q, kv, out); paging =
    (page_size, block-table row stride, row width) for a paged cache. Stats calls run on the
    general kernels (the sm80 epilogue writes them)."""
    qdt, kdt, odt = dtypes
    general = general or stats
    q_plan, kv_plan = planned_lengths(max_q, max_kv, paging)
    key = (dev, kv_layout, paged, heads, qdt.name, kdt.name, odt.name, batch, q_plan, kv_plan, causal, wl, chunk, pos,
           cap, general, stats, paging)
    e = _ENGINES.get(key)
    if e is not None:
        _ENGINES.move_to_end(key)
        if workspace is not e.ws_buf:
            e.reset_workspace(workspace)  # nothing is split: any workspace will do
        return e
    e = new_engine(workspace, kv_layout, paged, heads, dtypes, batch, q_plan, kv_plan, causal, wl, chunk, pos, cap,
                   general, paging)
    if len(_ENGINES) >= _MAX_ENGINES:
        _ENGINES.popitem(last=False)
    _ENGINES[key] = e
    return e


def new_engine(workspace, kv_layout, paged, heads, dtypes, batch, q_plan, kv_plan, causal, wl, chunk, pos, cap,
               general, paging=None) -> BatchEngine:
    """A new engine planned at planned_lengths() (uncached: pyflashattn.jax keeps its own per trace;
    its metadata copy is pending on e.plan_stream)."""
    hq, hkv, hd = heads
    qdt, kdt, odt = dtypes
    if batch * q_plan > 2**31 - 1 or (paging is None and batch * kv_plan > 2**31 - 1):
        raise ValueError("batch_size x max_q_len (or max_kv_len) exceeds the int32 range of the kernel metadata")
    e = BatchEngine(workspace, kv_layout, False, paged, capture_safe=True)  # never re-planned: capturable
    e.device_lengths = True
    settings = _settings(PlanSettings, (hq, hkv, hd, pos, False, cap, None, None, "log2", qdt, kdt, wl, 1.0, None,
                                        False, general, odt))
    src = (indices.block_table_source(batch, q_plan, kv_plan, paging[1], paging[0], 0) if paged
           else ragged_source(batch, q_plan, kv_plan))
    e.plan(src, settings, causal, None, None, True, None, chunk)
    return e


def point(e: BatchEngine, cum_q: int, max_q: int, max_kv: int, ragged_kv=0, paged=None) -> None:
    """Point the plan's struct at this call's device metadata: cum_q (cum_seq_lens_q's address),
    ragged_kv (cum_seq_lens_kv's), or paged = (seq_lens, K page ids, V page ids or 0, pages the
    ids may address)."""
    p = e.attn.params
    p.qo_indptr, p.qo_max_len = cum_q, max_q
    if paged is None:
        p.kv_indptr, p.kv_max_len = ragged_kv, max_kv
        return
    p.kv_seq_lens, p.kv_page_indices, p.v_page_indices, p.num_pages = paged
    p.kv_max_len = min(max_kv, e.src.max_kv)  # the pages the plan covers (<= a table row)


def host_array(x, name: str, dev: int, dtypes=(_dtypes.INT32,)) -> np.ndarray:
    """A device (or host) index tensor of any rank, checked and copied to the host (a sync)."""
    if isinstance(x, np.ndarray):
        return x
    v = _tensor.view(x, name)
    operands.require_device(v, name, dev, "query")
    if v.dtype not in dtypes:
        raise TypeError(f"{name} must be {' or '.join(d.name for d in dtypes)}, got {v.dtype.name}")
    flat = indices.host_int(x if v.ndim == 1 else x.reshape(-1), name)
    return flat.reshape(v.shape)


def check_on_host(dev, seq_lens, cum_q, cum_kv, batch, max_q, max_kv, q_tokens, kv_tokens=None,
                  tables=None) -> None:
    """PYFLASHATTN_CHECK_METADATA=1: the device metadata copied to the host (a sync) and checked
    as host metadata is (ValueErrors naming the argument); tables = (block_tables, page_size,
    pages K ids may address, separate, pages V ids may address)."""
    if not metadata_checks_enabled():
        return
    ints = (_dtypes.INT32, _dtypes.UINT32)
    seq = host_array(seq_lens, "seq_lens", dev, ints)
    cq = host_array(cum_q, "cum_seq_lens_q", dev, ints)
    ck = host_array(cum_kv, "cum_seq_lens_kv", dev, ints)
    ql, kl = operands.trtllm_lengths(seq, cq, ck, batch, max_q, max_kv)
    if int(cq[-1]) > q_tokens:
        raise ValueError(f"cum_seq_lens_q[-1] = {int(cq[-1])} exceeds the query's {q_tokens} tokens ({ENV}=1)")
    if kv_tokens is not None and int(ck[-1]) > kv_tokens:
        raise ValueError(f"cum_seq_lens_kv[-1] = {int(ck[-1])} exceeds K/V's {kv_tokens} rows ({ENV}=1)")
    if tables is not None:
        bt, ps, k_pages, separate, v_pages = tables
        table = host_array(bt, "block_tables", dev)
        k_ids, v_ids = operands.block_table_rows(table, batch, ps, kl, v_pages if separate else k_pages, separate)
        if separate and k_ids.size and int(k_ids.max()) >= k_pages:
            raise ValueError(f"block_tables holds K page id {int(k_ids.max())} outside the cache's {k_pages} pages "
                             f"({ENV}=1)")
