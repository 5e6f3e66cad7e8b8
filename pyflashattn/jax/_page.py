"""append_paged_kv_cache inside ``jax.jit``: functional, the cache updated in place by XLA.

JAX arrays are immutable, so the append returns the new cache (the pytree it was given: one array
or a (k_cache, v_cache) tuple). The cache input(s) are aliased to the output(s)
(``input_output_aliases``): the callback's output buffers already hold the cache, and the page
kernel writes only the appended rows into them. XLA copies the cache first unless it may reuse the
input's buffer: donate it (``jax.jit(step, donate_argnums=...)``) or carry it through a jitted loop,
and the append costs only its rows.

The engine's checks (pyflashattn._engine.page.check_append) run at trace time on the arguments'
shapes and dtypes; the callback runs the engine's launch on XLA's buffers and stream. The device
index arrays are never read on the host: tokens whose metadata points outside the cache are
skipped by the kernel (the eager checked mode, PYFLASHATTN_CHECK_METADATA=1, copies the metadata
to the host and so does not apply under jit). kv_last_page_len is checked (shape, dtype) but not
passed to the call: the kernel does not read it. vmap is refused (the batch is the metadata's).

get_seq_lens and get_batch_indices_positions run the page kernel's other modes the same way
(page_size and nnz are Python ints, static under jit); their vmap is refused by JAX.
"""
from __future__ import annotations

from .._engine import page as _engine
from .._runtime import cuda as _cuda, dtypes as _dtypes
from . import _bridge

_CACHE = _bridge.CallCache()  # (what, signature, GPUs) -> _bridge.Callable
_INDEX_NAMES = ("batch_indices", "positions", "kv_indices", "kv_indptr")


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
                          kv_last_page_len, kv_layout: str = "NHD"):
    """pyflashattn.append_paged_kv_cache as a jittable JAX function returning the new cache (one
    array [P, 2, ...] or a (k_cache, v_cache) tuple, as given).

    Token i goes to request batch_indices[i] at position positions[i] (int32 device arrays, with
    kv_indices / kv_indptr / kv_last_page_len already grown to hold the new tokens, as in
    FlashInfer). Errors are raised at trace time with the eager API's messages; vmap is refused."""
    pair = isinstance(paged_kv_cache, (tuple, list))
    parts = tuple(paged_kv_cache) if pair else (paged_kv_cache,)
    ordinals = _bridge.gpu_ordinals()
    dev0 = ordinals[0]
    if pair and len(parts) == 2:
        cache_views = tuple(_bridge.aval_view(x, n, dev0) for x, n in zip(parts, ("k_cache", "v_cache")))
    elif pair:  # the engine's "tuple must be (k_cache, v_cache)"
        cache_views = parts
    else:
        cache_views = _bridge.aval_view(paged_kv_cache, "paged_kv_cache", dev0)
    named = ((append_key, "append_key"), (append_value, "append_value"), (batch_indices, "batch_indices"),
             (positions, "positions"), (kv_indices, "kv_indices"), (kv_indptr, "kv_indptr"),
             (kv_last_page_len, "kv_last_page_len"))
    k, v, bi, pos, idx, indptr, last = (_bridge.aval_view(x, n, dev0) for x, n in named)
    a = _engine.check_append(k, v, bi, pos, cache_views, idx, indptr, last, kv_layout)
    key = ("append", tuple((t.shape, t.dtype.name) for t in (k, bi, idx, indptr)),
           tuple((t.shape, t.dtype.name) for t, _ in a.cache.views), kv_layout, tuple(ordinals))
    call = _CACHE.get(key, lambda: _build(a, pair, kv_layout, ordinals))
    out = call(*parts, append_key, append_value, batch_indices, positions, kv_indices, kv_indptr)
    return (out[0], out[1]) if pair else out[0]


def _build(a, pair: bool, kv_layout: str, ordinals) -> _bridge.Callable:
    """The callable: inputs (*cache, append_key, append_value, batch_indices, positions,
    kv_indices, kv_indptr), the cache aliased to the outputs."""
    import jax

    n_cache = 2 if pair else 1
    specs = tuple(jax.ShapeDtypeStruct(t.shape, _bridge.jax_dtype(t.dtype)) for t, _ in a.cache.views)
    launchers = _launchers(ordinals)
    nnz, batch = a.nnz, a.batch

    def launch(stream, outs, ins):
        if nnz == 0:  # the outputs alias the cache: nothing to write
            return
        dev = _bridge.device_of(stream, ordinals)
        # the output buffers: XLA's alias of the cache (its contents, or the cache's own memory)
        cache_bufs = tuple(_bridge.buffer_view(b, dev) for b in outs)
        cache = _engine.cache_operand(cache_bufs if pair else cache_bufs[0], kv_layout)
        vk, vv = (_bridge.buffer_view(b, dev) for b in ins[n_cache:n_cache + 2])
        ix = {n: _bridge.buffer_view(b, dev) for n, b in zip(_INDEX_NAMES, ins[n_cache + 2:])}
        _engine.launch_append(dev, stream, vk, vv, cache, ix, nnz, batch, launchers[dev])

    aliases = {i: i for i in range(n_cache)}
    return _bridge.Callable("append_paged_kv_cache (page)", launch, specs, aliases=aliases, no_vmap=(
        "pyflashattn.jax.append_paged_kv_cache does not support vmap: the batch is the one its index arrays "
        "describe (batch_indices, kv_indptr); append every request in one call"))


def get_seq_lens(kv_indptr, kv_last_page_len, page_size: int):
    """pyflashattn.get_seq_lens as a jittable JAX function: int32 [batch_size], (pages - 1) *
    page_size + kv_last_page_len (0 for a request with no pages); page_size a Python int."""
    ordinals = _bridge.gpu_ordinals()
    ps = _engine.page_size_arg(page_size)
    iv, lv = (_bridge.aval_view(x, n, ordinals[0]) for x, n in ((kv_indptr, "kv_indptr"),
                                                                  (kv_last_page_len, "kv_last_page_len")))
    _engine.check_seq_lens(iv, lv, ps)
    B = iv.shape[0] - 1

    def build():
        launchers = _launchers(ordinals)

        def launch(stream, outs, ins):
            if B:
                dev = _bridge.device_of(stream, ordinals)
                v = [_bridge.buffer_view(b, dev) for b in (*ins, outs[0])]
                _engine.launch_seq_lens(*v, ps, stream, launchers[dev])

        return _bridge.Callable("get_seq_lens (page)", launch, (_int32((B,)),))

    return _CACHE.get(("seq_lens", B, ps, tuple(ordinals)), build)(kv_indptr, kv_last_page_len)[0]


def get_batch_indices_positions(append_indptr, seq_lens, nnz: int):
    """pyflashattn.get_batch_indices_positions as a jittable JAX function: (batch_indices,
    positions), int32 [nnz] (-1 for tokens of no request); nnz a Python int (static)."""
    ordinals = _bridge.gpu_ordinals()
    nnz = _engine.count(nnz, "nnz")
    iv, sv = (_bridge.aval_view(x, n, ordinals[0]) for x, n in ((append_indptr, "append_indptr"),
                                                                  (seq_lens, "seq_lens")))
    _engine.check_batch_positions(iv, sv, nnz)

    def build():
        launchers = _launchers(ordinals)

        def launch(stream, outs, ins):
            if nnz:
                dev = _bridge.device_of(stream, ordinals)
                v = [_bridge.buffer_view(b, dev) for b in (*ins, *outs)]
                _engine.launch_batch_positions(*v, nnz, stream, launchers[dev])

        return _bridge.Callable("get_batch_indices_positions (page)", launch, (_int32((nnz,)),) * 2)

    bi, pos = _CACHE.get(("positions", iv.shape, nnz, tuple(ordinals)), build)(append_indptr, seq_lens)
    return bi, pos


def _launchers(ordinals) -> dict:
    """The page kernel's launcher for each local GPU, made at trace time (the module load is host
    work, not for XLA's threads), each with its own params struct (the callable's lock guards it)."""
    launchers = {}
    for dev in ordinals:
        _cuda.ensure_context(dev)
        launchers[dev] = _engine.new_launcher(dev)
    return launchers


def _int32(shape):
    import jax

    return jax.ShapeDtypeStruct(shape, _bridge.jax_dtype(_dtypes.INT32))
