"""THE operand validator: every API's tensors are checked here, and layouts become strides here.

Errors name the argument and are raised before anything launches. The kernels copy 16-byte
chunks, so every row start must be 16-byte aligned: the data pointer, and the row / head / page
strides in multiples of 16 / itemsize elements ("epc", elements per chunk: 8 for 16-bit
tensors, 16 for fp8 and for NVFP4 code bytes). An NVFP4 cache's block scales (kv_cache_sf) are
copied a row at a time, HEAD_DIM / 16 bytes (4, 8 or 16): their rows are aligned to that.
"""
from __future__ import annotations

import math

import numpy as np

from .._runtime import dtypes as _dtypes, tensor as _tensor
from . import options

KV_LAYOUTS = ("NHD", "HND")
# NVFP4 K/V codes: two e2m1 values a byte, the even element in the low nibble. FlashInfer passes
# them as uint8 (kv_data_type=torch.uint8); torch's float4_e2m1fn_x2 holds the same bytes.
NVFP4_CODES = (_dtypes.UINT8, _dtypes.FLOAT4_E2M1_X2)
NVFP4_BLOCK = 16  # head-dim elements per e4m3 block scale


def kv_layout(layout) -> str:
    if layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {layout!r}")
    return layout


# ---- the single checks every operand check below is made of (the cascade merge's too) ----
def require_cuda(t, name: str) -> None:
    """t (a view) is in CUDA device memory: "v is on the CPU; pyflashattn needs CUDA tensors"."""
    if not t.is_cuda:
        raise ValueError(_tensor.not_cuda_message(name, t.device_type, t.device_id))


def require_ndim(t, name: str, ndim: int, layout: str = "") -> None:
    """t has ndim dims (layout: what they are, for the message, e.g. "[seq, num_heads, head_dim]")."""
    if t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D{' ' + layout if layout else ''}, got shape {t.shape}")


def require_shape(t, name: str, shape: tuple, what: str = "") -> None:
    """t has this shape (what: the message's explanation after the shape, e.g. ", the (seq, heads) of v")."""
    if t.shape != shape:
        raise ValueError(f"{name} must have shape {shape}{what}, got {t.shape}")


def require_dtype(t, name: str, dtypes: tuple, what: str = "") -> None:
    """t's dtype is one of dtypes (what: after their names, e.g. " (an LSE)"); TypeError otherwise."""
    if t.dtype not in dtypes:
        names = [d.name for d in dtypes]
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        raise TypeError(f"{name} must be {listed}{what}, got {t.dtype.name}")


def require_last_dim_contiguous(t, name: str, dim: str = "") -> None:
    """t's last dim has stride 1 (or one element); dim: its name for the message ("head_dim")."""
    if t.strides[-1] != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous in its last dim{f' ({dim})' if dim else ''}, "
                         f"got strides {t.strides}")


def require_device(t, name: str, dev: int, ref: str = "q") -> None:
    """t is a CUDA tensor on cuda:dev (ref: what fixed that device, for the message)."""
    require_cuda(t, name)
    if t.device_id != dev:
        raise ValueError(f"{name} is on cuda:{t.device_id} but {ref} is on cuda:{dev}")


def check_rows(name: str, t, dtype, dev: int, ndim: int | None = None, expected: str = "q has ",
               ref: str = "q") -> None:
    """An attention operand (q, k, v, out, a KV cache): CUDA on dev, of dtype, ndim dims, last dim
    contiguous, 16-byte aligned rows. expected / ref: what fixed the dtype and the device, for
    the messages."""
    require_device(t, name, dev, ref)
    if t.dtype is not dtype:
        raise TypeError(f"{name} has dtype {t.dtype.name} but {expected}{dtype.name}")
    if ndim is not None:
        require_ndim(t, name, ndim)
    check_alignment(name, t, 16 // (dtype.bits // 8))


def check_alignment(name: str, t, epc: int) -> None:
    require_last_dim_contiguous(t, name)
    if t.ptr % 16 or any(s % epc for s in t.strides[:-1]):
        raise ValueError(f"{name} must have 16-byte aligned rows (data pointer 16-byte aligned, strides multiples "
                         f"of {epc} elements), got strides {t.strides}, address %16 = {t.ptr % 16}")


def check_lse(lv, shape: tuple, dev: int) -> None:
    """lse: float32 CUDA on dev, of shape (rows, heads), contiguous."""
    require_cuda(lv, "lse")
    if lv.shape != shape or lv.dtype != _dtypes.FLOAT32 or lv.device_id != dev:
        raise ValueError(f"lse must be a float32 CUDA tensor of shape {shape} on cuda:{dev}, got "
                         f"{lv.dtype.name} {lv.shape} on {_tensor.device_name(lv.device_type, lv.device_id)}")
    if shape[0] * shape[1] > 1 and lv.strides != (shape[1], 1):
        raise ValueError(f"lse must be contiguous, got strides {lv.strides}")


def check_out(ov, shape: tuple, dtype, dev: int, ref: str = "q", expected: str = "q has ") -> None:
    """out: dtype (q's, or the plan's o_data_type: expected says which, for the message), shape,
    CUDA on dev, 16-byte aligned rows."""
    require_shape(ov, "out", shape)
    check_rows("out", ov, dtype, dev, expected=expected, ref=ref)


# The output formats every attention kernel writes (PrefillParams / MergeParams.o_format,
# OutFormat in kernel_src/include/pfa/common/dtypes.cuh): the query dtype, the other 16-bit type,
# float8_e4m3fn (saturated to +-448, rounded to nearest even), NVFP4 (e2m1 code pairs in uint8 with
# swizzled e4m3 block scales: the TRT-LLM context API's FP4Tensor, nvfp4_out.py).
OUT_ELEM, OUT_OTHER16, OUT_E4M3, OUT_NVFP4 = 0, 1, 2, 3


class _Nvfp4Output:
    """The o_data_type that plans the NVFP4 output: only the TRT-LLM context API passes it (it
    points the block scales, nvfp4_out.py); a user's o_data_type string never becomes it."""
    name = "nvfp4"

    def __repr__(self):
        return "NVFP4_OUTPUT"


NVFP4_OUTPUT = _Nvfp4Output()


def output_dtype(o_data_type, q_dtype, name: str = "o_data_type"):
    """(output dtype, PrefillParams.o_format) for an output dtype given as o_data_type (None: q's)
    or (name="out") as out's dtype: float16, bfloat16 or float8_e4m3fn."""
    if o_data_type is None or o_data_type is q_dtype:
        return q_dtype, OUT_ELEM
    if o_data_type is NVFP4_OUTPUT:  # the data container of e2m1 code pairs
        return _dtypes.UINT8, OUT_NVFP4
    odt = o_data_type if isinstance(o_data_type, _dtypes.DType) else dtype_arg(o_data_type, name)
    if odt is q_dtype:
        return q_dtype, OUT_ELEM
    if odt is _dtypes.FLOAT16 or odt is _dtypes.BFLOAT16:
        return odt, OUT_OTHER16
    if odt is _dtypes.FLOAT8_E4M3:
        return odt, OUT_E4M3
    if odt is _dtypes.FLOAT8_E5M2:
        raise NotImplementedError(f"{name}: a float8_e5m2 output is not implemented in pyflashattn (float16, "
                                  "bfloat16 or float8_e4m3fn are)")
    raise TypeError(f"{name}: the output dtype must be float16, bfloat16 or float8_e4m3fn, got {odt.name}")


def ragged_kv_strides(layout: str, strides: tuple) -> tuple:
    """(stride_n, stride_h) of a 3-D K or V tensor: [kv_len, heads, D] (NHD) / [heads, kv_len, D] (HND)."""
    return (strides[0], strides[1]) if layout == "NHD" else (strides[1], strides[0])


def paged_kv_strides(layout: str, strides: tuple) -> tuple:
    """(stride_page, stride_n, stride_h) of a 4-D page tensor [pages, page_size, heads, D] (NHD) /
    [pages, heads, page_size, D] (HND)."""
    return (strides[0], strides[1], strides[2]) if layout == "NHD" else (strides[0], strides[2], strides[1])


def ragged_kv_dims(layout: str, shape: tuple) -> tuple:
    """(kv_len, num_kv_heads, head_dim) of a 3-D K/V tensor in this layout."""
    return (shape[0], shape[1], shape[2]) if layout == "NHD" else (shape[1], shape[0], shape[2])


def kv_dtype_pair(q_data_type, kv_data_type):
    """(q dtype, K/V dtype, PrefillParams.kv_fp8): q fp16/bf16; K/V in q's dtype, fp8, or NVFP4
    codes (NVFP4_CODES; kv_fp8 0, the kernel knows its storage)."""
    # DTypes are table singletons: identity tests (the dataclass __eq__ / __hash__ cost ~1 us each)
    qdt = dtype_arg(q_data_type, "q_data_type")
    if qdt is not _dtypes.FLOAT16 and qdt is not _dtypes.BFLOAT16:
        raise TypeError(f"q_data_type must be float16 or bfloat16, got {qdt.name}")
    kdt = qdt if kv_data_type is None else dtype_arg(kv_data_type, "kv_data_type")
    fp8 = 1 if kdt is _dtypes.FLOAT8_E4M3 else 2 if kdt is _dtypes.FLOAT8_E5M2 else 0  # PrefillParams.kv_fp8
    if kdt is not qdt and not fp8 and kdt not in NVFP4_CODES:
        raise TypeError(f"kv_data_type {kdt.name} with q_data_type {qdt.name}: K/V must be in q's dtype, fp8 "
                        "(float8_e4m3fn, float8_e5m2) or NVFP4 (uint8 code pairs, with kv_cache_sf at run)")
    return qdt, kdt, fp8


def nvfp4_settings(paged: bool, general: bool, head_dim: int) -> None:
    """What an NVFP4 cache's plan may ask for: its kernels are the lean paged decode tiles."""
    if not paged:
        raise NotImplementedError("kv_data_type uint8: an NVFP4 K/V cache is implemented for paged caches only")
    if general:
        raise NotImplementedError("an NVFP4 K/V cache (kv_data_type uint8) with a custom mask, soft cap, ALiBi or "
                                  "RoPE is not implemented in pyflashattn yet")
    if head_dim % NVFP4_BLOCK:
        raise ValueError(f"head_dim {head_dim}: an NVFP4 cache needs a multiple of {NVFP4_BLOCK}")


def nvfp4_scales(kv_cache_sf, pair: bool, kv_dim: int, code_shape: tuple, dev: int, stream=None) -> tuple:
    """The block scales of an NVFP4 paged cache (kv_cache_sf) against its codes. code_shape: the
    shape of one K page tensor of codes, [pages, ..., head_dim / 2] (layout order); pair: the
    cache is a (k, v) tuple, so kv_cache_sf must be a (k_sf, v_sf) tuple of tensors shaped like
    them with head_dim / 16 in the last dim; else kv_cache_sf is one tensor [pages, kv_dim, ...]
    like the cache (kv_dim 2: K then V; 1: K and V share it). float8_e4m3fn, on cuda:dev, rows
    aligned to their copy. Returns (k address, v address, k strides, v strides): strides of the
    4-D page tensors, in elements (= bytes)."""
    head_dim = 2 * code_shape[-1]
    if head_dim % NVFP4_BLOCK:
        raise ValueError(f"kv_cache_sf: head_dim {head_dim} is not a multiple of {NVFP4_BLOCK}")
    want = code_shape[:-1] + (head_dim // NVFP4_BLOCK,)
    if pair:
        if not isinstance(kv_cache_sf, (tuple, list)) or len(kv_cache_sf) != 2:
            raise ValueError("kv_cache_sf must be a (k_sf, v_sf) tuple when the cache is a (k, v) tuple")
        k, v = (_nvfp4_scale_tensor(t, dev, want, stream) for t in kv_cache_sf)
        return k.ptr, v.ptr, k.strides, v.strides
    if isinstance(kv_cache_sf, (tuple, list)):
        raise ValueError("kv_cache_sf must be one tensor [num_pages, 2, ...] when the cache is one tensor")
    t = _nvfp4_scale_tensor(kv_cache_sf, dev, want[:1] + (kv_dim,) + want[1:], stream)
    strides = (t.strides[0],) + t.strides[2:]
    return t.ptr, t.ptr + (t.strides[1] if kv_dim == 2 else 0), strides, strides


def _nvfp4_scale_tensor(x, dev: int, want: tuple, stream):
    """One block-scale tensor of kv_cache_sf: its view, checked."""
    t = _tensor.view(x, "kv_cache_sf", stream=stream)
    require_device(t, "kv_cache_sf", dev, "the cache")
    if t.dtype is not _dtypes.FLOAT8_E4M3:
        raise TypeError(f"kv_cache_sf must be float8_e4m3fn (one e4m3 scale per {NVFP4_BLOCK} head-dim elements), "
                        f"got {t.dtype.name}")
    if t.shape != want:
        raise ValueError(f"kv_cache_sf must have shape {want} (the cache's, with head_dim / {NVFP4_BLOCK} in the last "
                         f"dim), got {t.shape}")
    row = min(16, want[-1])  # bytes the kernel copies a row at a time
    if t.strides[-1] != 1 and t.shape[-1] > 1:
        raise ValueError(f"kv_cache_sf must be contiguous in its last dim, got strides {t.strides}")
    if t.ptr % row or any(s % row for s in t.strides[:-1]):
        raise ValueError(f"kv_cache_sf must have {row}-byte aligned rows (data pointer and strides multiples of "
                         f"{row}), got strides {t.strides}, address %{row} = {t.ptr % row}")
    return t


def dtype_arg(x, name):
    try:
        return _dtypes.normalize(x)
    except TypeError:
        raise TypeError(f"{name}: unsupported dtype {x!r}") from None


def positive_int(val, name: str) -> int:
    if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val <= 0:
        raise ValueError(f"{name} must be a positive int, got {val!r}")
    return int(val)


def scale_arg(x, name) -> float:
    """k_scale / v_scale: None -> 1.0; an int, float or numpy real scalar, finite and > 0."""
    if x is None:
        return 1.0
    if type(x) is not float:
        if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
            raise TypeError(f"{name} must be a number (int, float or numpy real scalar) or None, "
                            f"got {type(x).__name__}")
        x = float(x)
    if not (0.0 < x < math.inf):  # NaN fails too
        raise ValueError(f"{name} must be a finite number > 0, got {x!r}")
    return x


def contiguous_1d(buf, name: str, dtype=None, dev: int | None = None):
    """A 1-D contiguous CUDA buffer (workspace, mask and index buffers): its view."""
    v = _tensor.view(buf, name)
    require_cuda(v, name)
    if dev is not None and v.device_id != dev:
        raise ValueError(f"{name} must be a CUDA tensor on cuda:{dev} (the float workspace's device), "
                         f"got one on cuda:{v.device_id}")
    if dtype is not None and v.dtype != dtype:
        raise TypeError(f"{name} must be {dtype.name}, got {v.dtype.name}")
    if v.ndim != 1 or (v.shape[0] > 1 and v.strides[0] != 1):
        raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {v.shape} strides {v.strides}")
    return v


def entries(buf, name: str) -> int:
    """The first dimension of a buffer (a CUDA-graph capacity)."""
    return _tensor.view(buf, name).shape[0]


def check_mask_operand(kind: str, v, dev: int, need_bytes: int, bool_shape: tuple | None = None) -> None:
    """A custom mask: packed_custom_mask (uint8, 1-D contiguous, >= need_bytes) or custom_mask
    (bool or uint8, contiguous, of bool_shape), on cuda:dev."""
    name = "packed_custom_mask" if kind == "packed" else "custom_mask"
    require_cuda(v, name)
    if v.device_id != dev:
        raise ValueError(f"{name} must be a CUDA tensor on q's device cuda:{dev}, got "
                         f"{_tensor.device_name(v.device_type, v.device_id)}")
    if kind == "packed":
        if v.dtype != _dtypes.UINT8:
            raise TypeError(f"packed_custom_mask must be uint8, got {v.dtype.name}")
        if v.ndim != 1 or (v.shape[0] > 1 and v.strides[0] != 1):
            raise ValueError(f"packed_custom_mask must be a contiguous 1-D uint8 tensor, got shape {v.shape}")
        if v.shape[0] < need_bytes:
            raise ValueError(f"packed_custom_mask has {v.shape[0]} bytes; the mask's bits need {need_bytes} "
                             "(segments of ceil(qo_len * kv_len / 8) bytes)")
        return
    if v.dtype not in (_dtypes.BOOL, _dtypes.UINT8):
        raise TypeError(f"custom_mask must be bool (or uint8), got {v.dtype.name}")
    require_shape(v, "custom_mask", bool_shape)
    if not _contiguous(v.shape, v.strides):
        raise ValueError(f"custom_mask must be contiguous, got strides {v.strides}")


def _contiguous(shape: tuple, strides: tuple) -> bool:
    """Row-major contiguous (dims of size 1 may have any stride)."""
    want = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n > 1 and s != want:
            return False
        want *= n
    return True


def sinks_operand(sinks, num_qo_heads: int, num_kv_heads: int, dev: int) -> int:
    """Attention sinks: float32 CUDA on dev, contiguous, [Hq] or (XQA's form) [Hkv, Hq / Hkv]:
    the same order, query head h = kv head * group + h in group. Returns the address."""
    v = _tensor.view(sinks, "sinks")
    require_device(v, "sinks", dev)
    require_dtype(v, "sinks", (_dtypes.FLOAT32,))
    ok = (num_qo_heads,), (num_kv_heads, num_qo_heads // num_kv_heads)
    if v.shape not in ok:
        raise ValueError(f"sinks must have shape {ok[0]} or {ok[1]} (num_kv_heads, group), got {v.shape}")
    if not _contiguous(v.shape, v.strides):
        raise ValueError(f"sinks must be contiguous, got strides {v.strides}")
    return v.ptr


def device_scalar(x, name: str, dev: int) -> int:
    """A one-element float32 CUDA tensor on dev (a scale read by the kernel): its address."""
    v = _tensor.view(x, name)
    require_device(v, name, dev)
    if v.dtype is not _dtypes.FLOAT32:
        raise TypeError(f"{name} as a tensor must be float32, got {v.dtype.name}")
    if math.prod(v.shape) != 1:
        raise ValueError(f"{name} as a tensor must hold one value, got shape {v.shape}")
    if v.ptr % 4:
        raise ValueError(f"{name} must be 4-byte aligned")
    return v.ptr


def index_array(v, name: str, dev: int, ref: str = "q", dtypes=(_dtypes.INT32,)) -> None:
    """A device index array (a view): CUDA on dev, of one of dtypes (int32 unless the API also
    takes another), 1-D and contiguous. Index arrays are never converted: int64 metadata read
    as int32 is FlashInfer's silent-zeros bug (#1654)."""
    require_device(v, name, dev, ref)
    if v.dtype not in dtypes:
        raise TypeError(f"{name} must be {' or '.join(d.name for d in dtypes)}, got {v.dtype.name} (index arrays "
                        "are not converted)")
    require_ndim(v, name, 1)
    if v.shape[0] > 1 and v.strides[0] != 1:
        raise ValueError(f"{name} must be contiguous, got strides {v.strides}")


# ---- TRT-LLM entry points (trtllm_fmha_v2_prefill, trtllm_batch_context_with_kv_cache) ----------
TRTLLM_LAYOUTS = ("PACKED_QKV", "CONTIGUOUS_Q_KV", "SEPARATE_Q_K_V", "Q_PAGED_KV_NHD", "Q_PAGED_KV_HND")
TRTLLM_MASKS = ("padding", "causal", "sliding_window", "chunked")


def trtllm_input_layout(layout) -> str:
    """input_layout: one of TRTLLM_LAYOUTS (case-insensitive)."""
    name = layout.upper() if isinstance(layout, str) else None
    if name not in TRTLLM_LAYOUTS:
        raise ValueError(f"input_layout must be one of {TRTLLM_LAYOUTS}, got {layout!r}")
    return name


def trtllm_mask(mask_mode, window_left, chunked_attention_size) -> tuple:
    """FMHAv2's mask_mode with window_left / chunked_attention_size -> (causal, window_left,
    chunk size or 0). causal with window_left >= 0 acts as sliding_window (FlashInfer); the
    sliding window and chunked attention are causal (TRT-LLM's), padding is no mask."""
    mode = mask_mode.lower() if isinstance(mask_mode, str) else None
    if mode == "custom":
        raise NotImplementedError("mask_mode='custom': the FMHAv2 API takes no mask tensor; pyflashattn's custom "
                                  "masks are on BatchPrefillWith*Wrapper.plan(custom_mask=...)")
    if mode not in TRTLLM_MASKS:
        raise ValueError(f"mask_mode must be one of {TRTLLM_MASKS}, got {mask_mode!r}")
    wl = options.window(window_left)
    if mode != "chunked" and chunked_attention_size not in (0, None):
        raise ValueError(f"chunked_attention_size={chunked_attention_size!r} needs mask_mode='chunked', got "
                         f"{mask_mode!r}")
    if mode == "sliding_window" and wl < 0:
        raise ValueError("mask_mode='sliding_window' needs window_left >= 0 (the keys before each query it keeps)")
    if mode == "padding":
        if wl >= 0:
            raise ValueError(f"window_left={wl}: a sliding window needs mask_mode 'sliding_window' or 'causal', "
                             "not 'padding'")
        return False, -1, 0
    if mode == "chunked":
        if wl >= 0:
            raise ValueError(f"window_left={wl}: chunked attention excludes a sliding window")
        return True, -1, attention_chunk(chunked_attention_size)
    return True, wl, 0


def attention_chunk(size) -> int:
    """chunked_attention_size: a power of two >= 2."""
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 2 or size & (size - 1):
        raise ValueError(f"chunked_attention_size must be a power of two >= 2 with mask_mode='chunked', got {size!r}")
    return int(size)


def trtllm_lengths(seq_lens, cum_q, cum_kv, batch_size, max_q_len, max_kv_len) -> tuple:
    """Host copies of seq_lens / cum_seq_lens_q / cum_seq_lens_kv checked against each other and
    batch_size, max_q_len, max_kv_len: (q lengths, kv lengths) as int64."""
    B = positive_int(batch_size, "batch_size")
    for a, name, n in ((seq_lens, "seq_lens", B), (cum_q, "cum_seq_lens_q", B + 1), (cum_kv, "cum_seq_lens_kv", B + 1)):
        if a.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},) for batch_size={B}, got {a.shape}")
    kv = seq_lens.astype(np.int64)
    ql, kl = np.diff(cum_q.astype(np.int64)), np.diff(cum_kv.astype(np.int64))
    if cum_q[0] != 0 or (ql < 0).any():
        raise ValueError("cum_seq_lens_q must start at 0 and be non-decreasing")
    if cum_kv[0] != 0 or (kl < 0).any():
        raise ValueError("cum_seq_lens_kv must start at 0 and be non-decreasing")
    if (kv < 0).any() or not np.array_equal(kv, kl):
        b = int(np.flatnonzero(kv != kl)[0]) if kv.size == kl.size else 0
        raise ValueError(f"seq_lens[{b}] = {kv[b]} disagrees with cum_seq_lens_kv (request {b} has {kl[b]} keys)")
    mq, mk = positive_int(max_q_len, "max_q_len"), positive_int(max_kv_len, "max_kv_len")
    if ql.max(initial=0) > mq:
        raise ValueError(f"a request has {ql.max()} queries, more than max_q_len={mq}")
    if kv.max(initial=0) > mk:
        raise ValueError(f"a request has {kv.max()} keys, more than max_kv_len={mk}")
    return ql, kv


def block_table_rows(table, batch: int, page_size: int, kv_lens, num_pages: int, separate: bool):
    """Host block tables [B, M] (or [B, 2, M]: K ids then V ids, separate=True) for requests of
    kv_lens keys: (K page ids, V page ids or None) of the pages each request uses, concatenated,
    each id checked against num_pages."""
    want = 3 if separate else 2
    if table.ndim != want or table.shape[0] != batch or (separate and table.shape[1] != 2):
        form = "[batch_size, 2, max_pages]" if separate else "[batch_size, max_pages]"
        raise ValueError(f"block_tables must be {form} with batch_size={batch}, got shape {table.shape}")
    pages = -(-kv_lens // page_size)
    if pages.max(initial=0) > table.shape[-1]:
        raise ValueError(f"block_tables rows hold {table.shape[-1]} pages, a request needs {pages.max()} "
                         f"(page_size={page_size})")
    m = np.arange(table.shape[-1])[None, :] < pages[:, None]
    ids = [(table[:, 0] if separate else table)[m]] + ([table[:, 1][m]] if separate else [])
    for i in ids:
        if i.size and (i.min() < 0 or i.max() >= num_pages):
            raise ValueError(f"block_tables holds page id {int(i.max() if i.max() >= num_pages else i.min())} "
                             f"outside the cache's {num_pages} pages")
    return ids[0].astype(np.int32), (ids[1].astype(np.int32) if separate else None)


def paged_cache(kv_cache, layout: str, kv_dims=(1, 2)) -> tuple:
    """A paged cache operand (XQA, both TRT-LLM APIs): a (k, v) tuple of alike 4-D page tensors,
    or one 5-D [P, 2, ...] tensor ([P, 1, ...] too where 1 is in kv_dims: K and V share it).
    Returns (what run_paged takes: the tuple, the 5-D cache as is, or a [P, 1, ...] cache as the
    pair of its views; K's page shape [P, ...4-D]; page geometry (page_size, Hkv, D) by layout;
    V's distance from K in K pages when V sits a whole number of K pages after K in a tuple
    of one dtype and strides, else None)."""
    if isinstance(kv_cache, (tuple, list)):
        if len(kv_cache) != 2:
            raise ValueError("kv_cache tuple must be (k_cache, v_cache)")
        k, v = _tensor.view(kv_cache[0], "k_cache"), _tensor.view(kv_cache[1], "v_cache")
        if k.ndim != 4 or v.shape != k.shape:
            raise ValueError(f"kv_cache pages must be 4-D [num_pages, ...] ({layout}) with K and V alike, got "
                             f"{k.shape} and {v.shape}")
        form, shape = tuple(kv_cache), k.shape
        unit, diff = k.strides[0] * (k.dtype.bits // 8), v.ptr - k.ptr
        alike = v.strides == k.strides and v.dtype is k.dtype
        shift = diff // unit if alike and unit > 0 and diff >= 0 and diff % unit == 0 else None
    else:
        c = _tensor.view(kv_cache, "kv_cache")
        if c.ndim != 5 or c.shape[1] not in kv_dims:
            raise ValueError(f"kv_cache must be 5-D [num_pages, {' or '.join(map(str, kv_dims))}, ...] ({layout}) "
                             f"or a (k, v) tuple, got shape {c.shape}")
        shape, shift = (c.shape[0],) + c.shape[2:], None
        if c.shape[1] == 2:
            form = kv_cache
        else:  # [P, 1, ...]: K and V share the pages
            half = _tensor.slice_dim1(kv_cache, _tensor.launch_view(kv_cache, "kv_cache", c), 0)
            form = (half, half)
    geometry = (shape[1], shape[2], shape[3]) if layout == "NHD" else (shape[2], shape[1], shape[3])
    return form, shape, geometry, shift


def trtllm_query(qv, name: str) -> None:
    """A TRT-LLM query, [tokens, heads, head_dim]: float16, bfloat16 or float8_e4m3fn (the caller
    runs an fp8 one on the fp8 prefill, fp8.py, over any K/V layout); a float8_e5m2 query raises
    NotImplementedError naming `name`."""
    if qv.dtype is _dtypes.FLOAT8_E5M2:
        raise NotImplementedError(f"{name}: float8_e5m2 queries are not implemented in pyflashattn (the fp8 prefill "
                                  "takes float8_e4m3fn)")
    if qv.dtype not in (_dtypes.FLOAT16, _dtypes.BFLOAT16, _dtypes.FLOAT8_E4M3):
        raise TypeError(f"{name} must be float16, bfloat16 or float8_e4m3fn, got {qv.dtype.name}")
    if qv.ndim != 3:
        raise ValueError(f"{name} must be [num_tokens, num_heads, head_dim], got shape {qv.shape}")


def bool_arg(x, name: str) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")
    return bool(x)


def trtllm_pos_encoding(mode) -> str:
    """pos_encoding_mode of trtllm_fmha_v2_prefill: None / 'none' or 'alibi' (FlashInfer's slopes)."""
    if mode is None:
        return "NONE"
    m = mode.upper() if isinstance(mode, str) else None
    if m not in ("NONE", "ALIBI"):
        raise ValueError(f"pos_encoding_mode must be None or 'alibi', got {mode!r}")
    return m


def trtllm_bounds(batch_size, max_q_len, max_kv_len) -> tuple:
    """(batch_size, max_q_len, max_kv_len) as positive ints within int32."""
    out = tuple(positive_int(x, n) for x, n in ((batch_size, "batch_size"), (max_q_len, "max_q_len"),
                                                 (max_kv_len, "max_kv_len")))
    for x, n in zip(out, ("batch_size", "max_q_len", "max_kv_len")):
        if x > 2**31 - 1:
            raise ValueError(f"{n}={x} exceeds the int32 range")
    return out


def trtllm_device_lengths(arrays: tuple, batch: int, dev: int) -> tuple:
    """Device length arrays (name, tensor) of a TRT-LLM call: int32 / uint32 on dev, contiguous,
    seq_lens [batch], cum_seq_lens_* [batch + 1]; their addresses (nothing is copied)."""
    ptrs = []
    for name, x in arrays:
        v = _tensor.view(x, name)
        index_array(v, name, dev, "query", (_dtypes.INT32, _dtypes.UINT32))
        n = batch if name == "seq_lens" else batch + 1
        if v.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},) for batch_size={batch}, got {v.shape}")
        ptrs.append(v.ptr)
    return tuple(ptrs)


def trtllm_device_block_table(block_tables, batch: int, separate: bool, pages_needed: int, dev: int) -> tuple:
    """A device block table: int32 [batch, M] (separate: [batch, 2, M], K ids then V ids), rows
    of contiguous ids at any row stride, M >= pages_needed (the pages max_kv_len takes). Returns
    (K ids' address, V ids' address or 0, entries between rows, M)."""
    if block_tables is None:
        raise ValueError("block_tables is required for a paged KV cache")
    v = _tensor.view(block_tables, "block_tables")
    require_device(v, "block_tables", dev, "query")
    if v.dtype is not _dtypes.INT32:
        raise TypeError(f"block_tables must be int32, got {v.dtype.name}")
    want = 3 if separate else 2
    if v.ndim != want or v.shape[0] != batch or (separate and v.shape[1] != 2):
        form = "[batch_size, 2, max_pages]" if separate else "[batch_size, max_pages]"
        raise ValueError(f"block_tables must be {form} with batch_size={batch}, got shape {v.shape}")
    width = v.shape[-1]
    if width > 1 and v.strides[-1] != 1:
        raise ValueError(f"block_tables rows must be contiguous, got strides {v.strides}")
    if pages_needed > width:
        raise ValueError(f"max_kv_len needs {pages_needed} pages but block_tables rows hold {width}")
    row = v.strides[0] if batch > 1 else width
    if row < 0 or row * batch > 2**31 - 1 or (separate and not 0 <= v.strides[1] <= 2**31 - 1):
        raise ValueError("block_tables is too large (or strided backwards) for int32 page offsets")
    return v.ptr, (v.ptr + 4 * v.strides[1] if separate else 0), row, width


def trtllm_kv(kv_dtype, num_kv_heads: int, kv_head_dim: int, qv, packed: bool = False, fp8: bool = False,
              nvfp4: bool = False) -> None:
    """A TRT-LLM call's K/V against its query: the query's dtype (fp8 e4m3 / e5m2 too where fp8
    K/V is taken, NVFP4 code pairs where an NVFP4 cache is: the context API), the query's
    head_dim (an NVFP4 row: head_dim / 2 bytes), and (PACKED_QKV) as many heads."""
    nv = nvfp4 and kv_dtype in NVFP4_CODES
    if kv_dtype is not qv.dtype and not nv and not (fp8 and kv_dtype in (_dtypes.FLOAT8_E4M3, _dtypes.FLOAT8_E5M2)):
        raise TypeError(f"K/V must have the query's dtype ({qv.dtype.name}){' or fp8' if fp8 else ''}"
                        f"{' or NVFP4 (uint8 code pairs)' if nvfp4 else ''}, got {kv_dtype.name}")
    if (2 * kv_head_dim if nv else kv_head_dim) != qv.shape[2]:
        raise ValueError(f"the K/V head_dim {2 * kv_head_dim if nv else kv_head_dim} differs from the query's "
                         f"{qv.shape[2]}" + (f" (NVFP4: {kv_head_dim} bytes of code pairs a row)" if nv else ""))
    if num_kv_heads <= 0 or qv.shape[1] % num_kv_heads:
        raise ValueError(f"the query's heads ({qv.shape[1]}) must be a multiple of K/V's ({num_kv_heads})")
    if packed and num_kv_heads != qv.shape[1]:
        raise ValueError("PACKED_QKV is multi-head attention: num_kv_heads must equal num_heads")


def trtllm_context_mask(causal, window_left) -> tuple:
    """The context API's (causal, window_left): a window needs causal (NotImplementedError, as in
    FlashInfer)."""
    causal = bool_arg(causal, "causal")
    wl = options.window(window_left)
    if not causal and wl != -1:
        raise NotImplementedError("window_left: a sliding window without causal masking is not implemented (as in "
                                  "FlashInfer)")
    return causal, int(wl)
