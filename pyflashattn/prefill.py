"""Single-request prefill / append attention with FlashInfer's API.

    o = single_prefill_with_kv_cache(q, k, v, causal=True)
    o, lse = single_prefill_with_kv_cache_return_lse(q, k, v)

q: [qo_len, num_qo_heads, head_dim]; k, v: [kv_len, num_kv_heads, head_dim] (kv_layout "NHD")
or [num_kv_heads, kv_len, head_dim] ("HND"); any DLPack CUDA tensor (torch, CuPy, JAX), fp16 or
bf16, strided views allowed as long as the last dim is contiguous. Conventions (FlashInfer's):
causal is bottom-right aligned (query i sits at i + kv_len - qo_len), window_left is an
inclusive left window from that position, lse is base 2 over the scaled logits
(log2(sum_j 2^(s_j * log2 e))), a row with no visible key gives o = 0 and lse = -inf.
"""
from __future__ import annotations

import functools
import math
import threading

import numpy as np

from ._runtime import cuda as _cuda, dtypes as _dtypes, registry as _registry, tensor as _tensor
from . import _options, _plan, _split_kv

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128, 256)
_MERGE_ROWS_PER_BLOCK = 4


def _check_io(name: str, t, dtype, device_id: int):
    """A 3-D q/k/v/out operand: CUDA, on device_id, dtype, last dim contiguous, 16-byte aligned rows."""
    if not t.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got a tensor on DLPack device type {t.device_type}")
    if t.device_id != device_id:
        raise ValueError(f"{name} is on cuda:{t.device_id} but q is on cuda:{device_id}")
    if t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype.name} but q has {dtype.name}; they must match")
    if t.ndim != 3:
        raise ValueError(f"{name} must be 3-D, got shape {t.shape}")
    if t.strides[2] != 1 and t.shape[2] > 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.strides}")
    # 16-byte cp.async / vector stores: base and row/head strides on 8-element boundaries.
    if t.ptr % 16 or t.strides[0] % 8 or t.strides[1] % 8:
        raise ValueError(f"{name} must be 16-byte aligned with row and head strides that are multiples of 8 "
                         f"elements, got address %16 = {t.ptr % 16}, strides {t.strides}")


def single_prefill_with_kv_cache(q, k, v, custom_mask=None, packed_custom_mask=None, causal: bool = False,
                                 kv_layout: str = "NHD", pos_encoding_mode: str = "NONE",
                                 allow_fp16_qk_reduction: bool = False, sm_scale: float | None = None,
                                 window_left: int = -1, logits_soft_cap: float | None = None,
                                 rope_scale: float | None = None, rope_theta: float | None = None, *,
                                 return_lse: bool = False, out=None, lse=None, stream=None,
                                 lse_base: str = "log2"):
    """Attention of one request's queries over its KV cache (FlashInfer's single prefill).

    Parameters beyond FlashInfer's: ``out`` / ``lse`` (preallocated outputs, written in place and
    returned; ``lse`` is filled whenever given), ``stream`` (a CUDA stream handle or stream
    object; default: the caller framework's current stream), ``lse_base`` ("log2", FlashInfer's
    convention).

    Returns o [qo_len, num_qo_heads, head_dim] in q's dtype and framework, and with
    ``return_lse`` also lse [qo_len, num_qo_heads] float32.
    """
    opts = _options.resolve(pos_encoding_mode, allow_fp16_qk_reduction, logits_soft_cap, rope_scale, rope_theta,
                            lse_base)
    has_mask = custom_mask is not None or packed_custom_mask is not None
    framework = _tensor.framework_of(q)
    if framework == "torch" and opts is _options.PLAIN and not has_mask:
        res = _torch_fast_path(q, k, v, causal, kv_layout, window_left, sm_scale, return_lse, out, lse, stream)
        if res is not _MISS:
            return res
    # Views are taken without a stream first so bad input raises before the driver is touched;
    # JAX arrays are exported again below with the launch stream (the DLPack handshake makes that
    # stream wait for JAX's pending writes).
    qv, kv, vv = _tensor.view(q, "q"), _tensor.view(k, "k"), _tensor.view(v, "v")
    ov = _tensor.view(out, "out") if out is not None else None
    lv = _tensor.view(lse, "lse") if lse is not None else None
    # FlashInfer: a packed mask, when given, wins over the boolean one.
    mask_kind = "packed" if packed_custom_mask is not None else "bool" if custom_mask is not None else None
    mv = (_tensor.view(packed_custom_mask, "packed_custom_mask") if mask_kind == "packed"
          else _tensor.view(custom_mask, "custom_mask") if mask_kind == "bool" else None)
    key = (qv.shape, qv.strides, qv.dtype, qv.device_type, qv.device_id,
           kv.shape, kv.strides, kv.dtype, kv.device_type, kv.device_id,
           vv.shape, vv.strides, vv.dtype, vv.device_type, vv.device_id,
           None if ov is None else (ov.shape, ov.strides, ov.dtype, ov.device_type, ov.device_id),
           None if lv is None else (lv.shape, lv.strides, lv.dtype, lv.device_type, lv.device_id),
           causal, kv_layout, window_left, sm_scale, opts, mask_kind,
           None if mv is None else (mv.shape, mv.strides, mv.dtype, mv.device_type, mv.device_id))
    plans = getattr(_tls, "plans", None)
    if plans is None:
        plans = _tls.plans = {}
    plan = plans.get(key)
    if plan is None:
        # Full validation and planning happen once per problem signature; repeated calls with
        # the same shapes, strides, dtypes and options reuse the plan and its params struct.
        plan = _Plan(qv, kv, vv, ov, lv, bool(causal), kv_layout, window_left, sm_scale, opts, mask_kind, mv)
        if len(plans) >= _PLAN_CACHE_SIZE:
            plans.clear()
        plans[key] = plan
    if framework == "torch" and opts is _options.PLAIN and mask_kind is None:
        try:  # later calls with this signature take the fast path
            plans[_torch_key(q, k, v, out, lse, causal, kv_layout, window_left, sm_scale)] = plan
        except Exception:  # noqa: BLE001 - a tensor the attribute reads cannot describe
            pass
    if (qv.ptr | kv.ptr | vv.ptr | (ov.ptr if ov is not None else 0)) & 15:
        _check_alignment(qv, kv, vv, ov)

    dev = qv.device_id
    _cuda.ensure_context(dev)
    s = _tensor.stream_handle(stream) if stream is not None else _tensor.current_stream(framework, dev)
    if framework == "jax":
        qv, kv, vv = _tensor.view(q, "q", stream=s), _tensor.view(k, "k", stream=s), _tensor.view(v, "v", stream=s)
    if out is None:
        out, ov = _tensor.empty(qv, plan.o_shape, plan.dtype, s)
    if lse is None and return_lse:
        lse, lv = _tensor.empty(qv, plan.lse_shape, _dtypes.FLOAT32, s)
    if plan.attn is not None:
        if framework == "jax" and mv is not None:
            mv = _tensor.view(packed_custom_mask if mask_kind == "packed" else custom_mask, "custom_mask", stream=s)
        plan.run(qv.ptr, kv.ptr, vv.ptr, ov.ptr, lv.ptr if lv is not None else 0, s, mv)
    # JAX outputs are handed to JAX only now, so JAX's reads are ordered after the launch.
    out = _tensor.finalize(out)
    if lse is None:
        return out
    lse = _tensor.finalize(lse)
    return (out, lse) if return_lse else out


_MISS = object()


def _torch_sig(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.get_device())


def _torch_key(q, k, v, out, lse, causal, kv_layout, window_left, sm_scale):
    # torch.Size and stride tuples hash like the values they hold; get_device() is -1 off-GPU.
    return ("torch", q.shape, q.stride(), q.dtype, q.get_device(), k.shape, k.stride(), k.dtype, k.get_device(),
            v.shape, v.stride(), v.dtype, v.get_device(), _torch_sig(out), _torch_sig(lse),
            causal, kv_layout, window_left, sm_scale)


def _torch_fast_path(q, k, v, causal, kv_layout, window_left, sm_scale, return_lse, out, lse, stream):
    """Repeated torch calls with a known signature: attribute reads, one dict lookup, launch.

    Only plans built (and fully validated) by the general path are found here, keyed by the
    same torch attributes (out=/lse= buffers included); anything else returns _MISS.
    """
    plans = getattr(_tls, "plans", None)
    if plans is None:
        return _MISS
    try:
        plan = plans.get(_torch_key(q, k, v, out, lse, causal, kv_layout, window_left, sm_scale))
    except Exception:  # noqa: BLE001 - not a plain strided torch tensor: the general path decides
        return _MISS
    if plan is None:
        return _MISS
    qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
    op = out.data_ptr() if out is not None else 0
    if (qp | kp | vp | op) & 15:
        return _MISS  # the general path raises the precise error
    dev = plan.dev
    _cuda.ensure_context(dev)
    s = _tensor.stream_handle(stream) if stream is not None else _tensor.current_stream("torch", dev)
    if out is None:
        out = _tensor.torch_empty_like(q)  # o has q's shape (the plan's key fixed it)
        op = out.data_ptr()
    if lse is None and return_lse:
        lse = _tensor.torch_empty_f32(q, plan.lse_shape)
    if plan.attn is not None:
        plan.run(qp, kp, vp, op, lse.data_ptr() if lse is not None else 0, s)
    if lse is None:
        return out
    return (out, lse) if return_lse else out


# Plans own a mutable params struct, so each thread keeps its own cache.
_tls = threading.local()
_PLAN_CACHE_SIZE = 1024
_registry._on_force.append(lambda: getattr(_tls, "plans", {}).clear())


def _check_alignment(qv, kv, vv, ov):
    for name, t in (("q", qv), ("k", kv), ("v", vv), ("out", ov)):
        if t is not None and t.ptr % 16:
            raise ValueError(f"{name} must start on a 16-byte boundary, got address %16 = {t.ptr % 16}")


class _Plan:
    """Everything about one problem signature except its pointers: validated shapes, the chosen
    kernel with its own params struct (constant fields filled once), grid and KV split."""

    __slots__ = ("o_shape", "o_strides", "lse_shape", "dtype", "attn", "merge", "splits", "ws_mask_bytes",
                 "ws_o_bytes", "ws_bytes", "dev", "mask_kind", "mask_bits")

    def __init__(self, qv, kv, vv, ov, lv, causal, kv_layout, window_left, sm_scale, opts=_options.PLAIN,
                 mask_kind=None, mv=None):
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        window_left = _options.window(window_left)
        if not qv.is_cuda:
            raise ValueError(f"q must be a CUDA tensor, got a tensor on DLPack device type {qv.device_type}")
        dev = self.dev = qv.device_id
        dtype = self.dtype = qv.dtype
        if dtype not in (_dtypes.FLOAT16, _dtypes.BFLOAT16):
            raise TypeError(f"q must be float16 or bfloat16, got {dtype.name}")
        _check_io("q", qv, dtype, dev)
        _check_io("k", kv, dtype, dev)
        _check_io("v", vv, dtype, dev)
        qo_len, num_qo_heads, head_dim = qv.shape
        if kv_layout == "NHD":
            kv_len, num_kv_heads, head_dim_k = kv.shape
            k_sn, k_sh, v_sn, v_sh = kv.strides[0], kv.strides[1], vv.strides[0], vv.strides[1]
        else:
            num_kv_heads, kv_len, head_dim_k = kv.shape
            k_sn, k_sh, v_sn, v_sh = kv.strides[1], kv.strides[0], vv.strides[1], vv.strides[0]
        if vv.shape != kv.shape:
            raise ValueError(f"v must have k's shape {kv.shape}, got {vv.shape}")
        if head_dim_k != head_dim:
            raise ValueError(f"k head_dim {head_dim_k} differs from q head_dim {head_dim}")
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim {head_dim} is not supported (supported: {HEAD_DIMS})")
        if num_kv_heads == 0 or num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.mask_kind, self.mask_bits = mask_kind, qo_len * kv_len
        if mask_kind is not None:
            _check_mask(mask_kind, mv, qo_len, kv_len, dev)
            causal = False  # a custom mask replaces causal (FlashInfer)
        if causal and kv_len < qo_len:
            raise ValueError(f"causal attention needs kv_len >= qo_len, got kv_len={kv_len}, qo_len={qo_len}")
        sm_scale = _options.softmax_scale(sm_scale, head_dim)
        self.o_shape, self.lse_shape = (qo_len, num_qo_heads, head_dim), (qo_len, num_qo_heads)
        # Output strides: the caller's out= (part of the plan's key), else our contiguous allocation.
        self.o_strides = ov.strides if ov is not None else (num_qo_heads * head_dim, head_dim, 1)
        if ov is not None:
            if ov.shape != self.o_shape:
                raise ValueError(f"out must have shape {self.o_shape}, got {ov.shape}")
            _check_io("out", ov, dtype, dev)
        if lv is not None:
            if lv.shape != self.lse_shape or lv.dtype != _dtypes.FLOAT32 or not lv.is_cuda or lv.device_id != dev:
                raise ValueError(f"lse must be a float32 CUDA tensor of shape {self.lse_shape} on cuda:{dev}, got "
                                 f"{lv.dtype.name} {lv.shape} on device {lv.device_type}:{lv.device_id}")
            if lv.strides != (num_qo_heads, 1) and qo_len * num_qo_heads > 1:
                raise ValueError(f"lse must be contiguous, got strides {lv.strides}")
        self.attn = self.merge = None
        if qo_len * num_qo_heads == 0:
            return  # nothing to compute: empty outputs

        _cuda.ensure_context(dev)
        general = opts.general or mask_kind is not None
        group = num_qo_heads // num_kv_heads
        props = _cuda.properties(dev)
        tile = 0 if general else decode_tile_rows(head_dim, qo_len * group, decode_tiles(head_dim))
        if tile:
            # Decode / speculative decode / a short append: the request's packed rows fit one or
            # two 16-row decode tiles (DECODE_MAX_ROWS, decode_tiles), and the launch is a stream
            # over K/V (the 128-row kernel would spend at least 3/4 of its MMAs on padding rows).
            # KV is chunked the way the batch planner chunks a one-request ragged batch on this
            # tile (one wave of CTAs), so the same request gives the same chunks, hence the same
            # bits, in both APIs.
            la = _decode_launcher(dev, dtype.short, head_dim, tile)
            ctas_per_sm = _decode_ctas_per_sm(la, props)
            one = _plan.plan_prefill(np.array([0, qo_len]), np.array([kv_len]), group_size=group,
                                     num_kv_heads=num_kv_heads, block_m=la.meta["block_m"],
                                     block_n=la.meta["block_n"], num_sms=props["sm_count"],
                                     ctas_per_sm=ctas_per_sm, causal=causal, window_left=window_left)
            splits, chunk = int(one.num_chunks[0]), one.kv_chunk_size
        else:
            la = _registry.new_launcher("prefill", dev, dtype=dtype.short, kv_dtype=dtype.short, head_dim=head_dim,
                                        general=general, paged=False)
        self.attn = la
        meta = la.meta
        row_tiles = -(-qo_len * group // meta["block_m"])
        if row_tiles > 65535:
            raise ValueError(f"qo_len * (num_qo_heads / num_kv_heads) = {qo_len * group} rows exceeds the "
                             f"{65535 * meta['block_m']} a single launch covers")
        if not meta.get("decode"):
            splits, chunk = _split_kv.plan_splits(qo_len, kv_len, group, num_kv_heads, meta["block_m"],
                                                  meta["block_n"], props["sm_count"],
                                                  2 if meta["threads"] <= 128 else 1, causal=causal,
                                                  window_left=window_left, head_dim=head_dim)
        self.splits = splits
        p = la.params
        p.q_stride_n, p.q_stride_h = qv.strides[0], qv.strides[1]
        p.k_stride_n, p.k_stride_h, p.v_stride_n, p.v_stride_h = k_sn, k_sh, v_sn, v_sh
        p.qo_len, p.kv_len, p.num_qo_heads, p.num_kv_heads = qo_len, kv_len, num_qo_heads, num_kv_heads
        p.group_size, p.num_splits, p.kv_chunk_size = group, splits, chunk
        p.causal, p.window_left, p.sm_scale_log2 = int(causal), window_left, sm_scale * LOG2E
        p.lse_scale, p.logits_soft_cap, p.v_scale = opts.lse_scale, opts.soft_cap, 1.0
        p.rope = int(opts.pos == "ROPE_LLAMA")
        p.rope_rcp_scale, p.rope_log2_theta = 1.0 / opts.rope_scale, math.log2(opts.rope_theta)
        p.alibi_slopes = _alibi_buffer(dev, num_qo_heads) if opts.pos == "ALIBI" else 0
        # Equal-cost tiles (no causal/window range), in a kernel that supports it (hd256): a head's row
        # tiles run together, for L2 reuse of its K/V; otherwise heads vary fastest so every head's
        # heaviest row tiles go first.
        p.rows_fastest = rows_fastest = int(meta.get("rows_fastest", False) and not causal and window_left < 0)
        la.configure((row_tiles, splits, num_kv_heads) if rows_fastest else (num_kv_heads, splits, row_tiles))
        # Workspace: [packed bool mask, 16-byte padded] [split partial o] [split partial lse].
        self.ws_mask_bytes = (-(-self.mask_bits // 8) + 15) // 16 * 16 if mask_kind == "bool" else 0
        self.ws_o_bytes = self.ws_bytes = self.ws_mask_bytes
        if splits > 1:
            pairs = qo_len * num_qo_heads
            self.ws_o_bytes = self.ws_mask_bytes + splits * pairs * head_dim * 4
            self.ws_bytes = self.ws_o_bytes + splits * pairs * 4
            mg = self.merge = _registry.new_launcher("merge", dev, dtype=dtype.short)
            mp = mg.params
            mp.rows, mp.num_heads, mp.head_dim, mp.num_splits = qo_len, num_qo_heads, head_dim, splits
            mp.lse_scale = opts.lse_scale
            mg.configure((-(-pairs // _MERGE_ROWS_PER_BLOCK), 1, 1))

    def run(self, q, k, v, o, lse, stream, mask_view=None):
        """Refill the pointers and launch (mask packing, attention, merge when KV is split)."""
        p = self.attn.params
        p.q, p.k, p.v, p.o = q, k, v, o
        p.o_stride_n, p.o_stride_h = self.o_strides[0], self.o_strides[1]
        ws = _cuda.Workspace.get(self.dev, stream, self.ws_bytes) if self.ws_bytes else 0
        if self.mask_kind == "packed":
            p.custom_mask = mask_view.ptr
        elif self.mask_kind == "bool":
            from .quantization import pack_mask_into
            pack_mask_into(mask_view, ws, self.mask_bits, stream, self.dev)
            p.custom_mask = ws
        if self.merge is None:
            p.lse = lse
            self.attn(stream)
            return
        p.lse, p.o_partial, p.lse_partial = 0, ws + self.ws_mask_bytes, ws + self.ws_o_bytes
        self.attn(stream)
        mp = self.merge.params
        mp.o_partial, mp.lse_partial, mp.o, mp.lse = p.o_partial, p.lse_partial, o, lse
        mp.o_stride_n, mp.o_stride_h = self.o_strides[0], self.o_strides[1]
        self.merge(stream)


# head_dim -> the most packed rows (qo_len * num_qo_heads / num_kv_heads) a request may have to run
# as several row tiles of a decode tile instead of on the 128-row kernel (requests that fit one
# decode tile always go there: decode_tile_rows); both APIs use it (a batch goes there when its
# longest request fits). H100 A/B, causal, 32/8 heads, K/V TB/s, 128-row kernel -> two row tiles of
# the 16-row tile (NOTES.md, session 11): 8-token speculative decode (32 rows), B=32 kv 2K-16K,
# ragged / paged / fp8 paged: hd64 1.75 -> 2.51, 1.63 -> 2.08-2.15, 0.67 -> 0.71-1.13; hd128
# 2.02-2.05 -> 2.66, 1.89-1.93 -> 2.27-2.29, 0.73 -> 1.03; single qo=8 kv 32K hd64 1.28 -> 1.49,
# hd128 1.63 -> 1.92. hd256 stays at 16 rows (paged 2.38 -> 1.97, single 2.23 -> 2.12), and 64 rows
# lost almost everywhere (hd128 paged 1.92 -> 1.71, fp8 0.73 -> 0.51; hd256 paged 2.48 -> 1.10).
DECODE_MAX_ROWS = {64: 32, 128: 32, 256: 16}
# head_dim -> the wide decode tiles' packed rows (variants.py WIDE_DECODE_TILES: 2 or 4 warps with 16
# rows each, sharing every K/V tile, its page-table lookups and, over an fp8 cache, its widening),
# built for paged or fp8 K/V. A request up to the largest runs on a decode tile whatever
# DECODE_MAX_ROWS says (that bound is for several row tiles of a smaller one).
WIDE_DECODE_ROWS = {64: (32, 64), 128: (32, 64)}


def decode_tiles(head_dim: int, paged: bool = False, fp8: bool = False) -> tuple:
    """The decode tiles (by packed rows, smallest first) a plan over this K/V may run on.

    The wide tiles (32 and 64 rows) for paged or fp8 K/V; contiguous 16-bit K/V (the ragged
    wrapper, single prefill) run 17-32 rows as two 16-row tiles instead, and more on the 128-row
    kernel. 64 rows over paged / fp8 K/V, 128-row kernel -> the 64-row tile (H100, NOTES.md, session
    11): paged 1.47-2.36 -> 1.92-2.55 (+7..+63 %, one case -2 %), fp8 0.63-0.94 -> 0.81-1.19. 32 rows, K/V
    TB/s two 16-row tiles -> the 32-row tile (NOTES.md, session 11): paged 2.16-2.59 -> 2.37-2.85
    (hd64 spec-decode B=32 2.18 -> 2.70), fp8 paged 0.94-1.11 -> 1.40-1.67; but ragged 16-bit
    2.41-2.71 -> 2.37-2.70 (hd128 B=16 long KV 2.70 -> 2.37-2.45) and single qo=8 kv 32K 1.48 /
    1.95 -> 1.34 / 1.70 (hd64 / hd128): six one-warp CTAs per SM keep more K/V in flight than five
    two-warp ones, and the second read of a contiguous stream mostly hits L2, while through a page
    table each row tile repeats the page-id staging and address math, and over fp8 the widening."""
    return (16,) + WIDE_DECODE_ROWS.get(head_dim, ()) if paged or fp8 else (16,)


def decode_tile_rows(head_dim: int, rows: int, tiles: tuple = (16,)) -> int:
    """The decode tile (by its packed rows, one of `tiles`) for requests of at most `rows` packed
    rows: the smallest that holds them, else (up to DECODE_MAX_ROWS) several row tiles of the
    largest; 0 = the 128-row kernel."""
    if rows > max(DECODE_MAX_ROWS[head_dim], tiles[-1]):
        return 0
    for t in tiles:
        if rows <= t:
            return t
    return tiles[-1]


def _decode_launcher(dev: int, dtype: str, head_dim: int, rows: int):
    """A launcher for the decode tile of `rows` packed rows of this dtype / head_dim."""
    return _registry.new_launcher("prefill", dev, dtype=dtype, kv_dtype=dtype, head_dim=head_dim, general=False,
                                  paged=False, decode=True, block_m=rows)


def _decode_ctas_per_sm(la, props) -> int:
    """CTAs of a decode tile per SM: what its shared memory allows (1 KB each reserved), at most 8;
    the batch wrappers plan their decode tiles with the same count."""
    return max(1, min(8, props["smem_per_sm"] // (la.smem + 1024)))


def _check_mask(kind, mv, qo_len, kv_len, dev):
    name = "packed_custom_mask" if kind == "packed" else "custom_mask"
    if not mv.is_cuda or mv.device_id != dev:
        raise ValueError(f"{name} must be a CUDA tensor on q's device cuda:{dev}, got device type "
                         f"{mv.device_type}:{mv.device_id}")
    if kind == "packed":
        if mv.dtype != _dtypes.UINT8:
            raise TypeError(f"packed_custom_mask must be uint8, got {mv.dtype.name}")
        need = -(-qo_len * kv_len // 8)
        if mv.ndim != 1 or (mv.shape[0] > 1 and mv.strides[0] != 1):
            raise ValueError(f"packed_custom_mask must be a contiguous 1-D uint8 tensor, got shape {mv.shape}")
        if mv.shape[0] < need:
            raise ValueError(f"packed_custom_mask has {mv.shape[0]} bytes; qo_len * kv_len = {qo_len * kv_len} "
                             f"bits need {need}")
    else:
        if mv.dtype not in (_dtypes.BOOL, _dtypes.UINT8):
            raise TypeError(f"custom_mask must be bool (or uint8), got {mv.dtype.name}")
        if mv.shape != (qo_len, kv_len):
            raise ValueError(f"custom_mask must have shape (qo_len, kv_len) = {(qo_len, kv_len)}, got {mv.shape}")
        if qo_len > 1 and kv_len > 1 and mv.strides != (kv_len, 1):
            raise ValueError(f"custom_mask must be contiguous, got strides {mv.strides}")


_alibi_buffers: dict = {}


def _alibi_buffer(dev: int, num_heads: int) -> int:
    """Device copy of FlashInfer's ALiBi slopes for num_heads, uploaded once per device."""
    ptr = _alibi_buffers.get((dev, num_heads))
    if ptr is None:
        ptr = _alibi_buffers[(dev, num_heads)] = _cuda.upload(_options.alibi_slopes(num_heads).tobytes())
    return ptr


single_prefill_with_kv_cache_return_lse = functools.partial(single_prefill_with_kv_cache, return_lse=True)
single_prefill_with_kv_cache_return_lse.__doc__ = "single_prefill_with_kv_cache with return_lse=True: (o, lse)."


# The batch wrappers live in their own module (they import this one); FlashInfer users find them here.
from ._batch_prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper  # noqa: E402
