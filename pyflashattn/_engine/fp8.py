"""FP8 prefill (fp8 Q): the host rules of the e4m3 Q, K and V path (FlashInfer 0.7's fp8 prefill,
semantics 1.9), shared by single prefill and the batch wrappers.

- dtypes: q, k and v float8_e4m3fn; the output bfloat16, float16 or float8_e4m3fn (o_dtype /
  o_data_type; default q's, as FlashInfer). The kernels count PrefillParams.o_format from
  bfloat16, their own 16-bit type (OWN16), and split-KV partials merge in its merge kernel.
- scales: scale_q [Hq], scale_k [Hkv], scale_v [Hkv] (single prefill) / run(q_scale, k_scale,
  v_scale) (batch wrappers): float32 per-head tensors on q's device, or numbers. Logits of query
  head h over kv head g get sm_scale * scale_q[h] * scale_k[g] (the LSE too), output rows of kv
  head g times scale_v[g]. Numbers fold into sm_scale and v_scale on the host; tensors travel as
  PrefillParams.q_scale_heads / k_scale_heads / v_scale_heads, read by the kernel.
- where: the sm_90a fp8 prefill kernels (prefill_sm90_fp8.cuh), head_dim 64, 128 and 256,
  contiguous, ragged or paged K/V (the paged batch wrapper, the TRT-LLM context API and fmha_v2's
  paged layouts: any page size, separate V page ids), lean options (causal, window_left, LSE,
  sinks). FlashInfer's single prefill asserts window_left == -1 for fp8; here the window is
  applied like everywhere else (the one mask predicate). Everything else raises
  NotImplementedError naming what is missing: another GPU (sm_80 / sm_89 have no fp8 Q K^T path
  in pyflashattn), custom masks and score transforms. The paged rows also write the context API's
  NVFP4 output (FlashInfer's rule: an fp8 query).
"""
from __future__ import annotations

import numpy as np

from .._runtime import cuda as _cuda, dtypes as _dtypes, tensor as _tensor
from . import operands, options

FP8 = _dtypes.FLOAT8_E4M3
OWN16 = _dtypes.BFLOAT16  # the fp8 kernels' own 16-bit output type (o_format 0)
SCALE_NAMES = ("scale_q", "scale_k", "scale_v")


def is_fp8(dtype) -> bool:
    """Whether a q dtype (a DType) selects the fp8 prefill."""
    return dtype is FP8


def kv_dtype(kv_data_type, name: str = "kv_data_type"):
    """K/V of an fp8-Q plan: float8_e4m3fn (None: q's)."""
    kdt = FP8 if kv_data_type is None else operands.dtype_arg(kv_data_type, name)
    if kdt is not FP8:
        raise TypeError(f"{name} {kdt.name} with an fp8 query: the fp8 prefill takes float8_e4m3fn q, k and v")
    return kdt


def output_dtype(o_data_type, name: str = "o_data_type"):
    """(output dtype, PrefillParams.o_format counted from OWN16) of an fp8-Q call; None: e4m3; the
    context API's NVFP4 output (operands.NVFP4_OUTPUT) as for any query."""
    if o_data_type is operands.NVFP4_OUTPUT:  # the context API's (the paged fp8 rows write it)
        return operands.output_dtype(o_data_type, FP8, name)
    odt = FP8 if o_data_type is None else (o_data_type if isinstance(o_data_type, _dtypes.DType)
                                           else operands.dtype_arg(o_data_type, name))
    if odt is OWN16:
        return odt, operands.OUT_ELEM
    if odt is _dtypes.FLOAT16:
        return odt, operands.OUT_OTHER16
    if odt is FP8:
        return odt, operands.OUT_E4M3
    raise TypeError(f"{name}: the output of an fp8 prefill must be bfloat16, float16 or float8_e4m3fn, "
                    f"got {odt.name}")


def check_call(dev: int, general: bool) -> None:
    """What the fp8 kernels cover (module docstring); NotImplementedError naming the rest."""
    cc = _cuda.properties(dev)["cc"]
    if cc[0] != 9:
        raise NotImplementedError(
            f"fp8 (float8_e4m3fn) q: pyflashattn's fp8 prefill runs on fp8 wgmma (sm_90a: H100 / H200); this GPU "
            f"(compute capability {cc[0]}.{cc[1]}) has no fp8 Q K^T path here (fp8 K/V with a float16 / bfloat16 "
            "q runs everywhere)")
    if general:
        raise NotImplementedError("fp8 (float8_e4m3fn) q with a custom mask, logits_soft_cap, ALiBi or RoPE is not "
                                  "implemented in pyflashattn (causal, window_left, LSE and sinks are)")


def refuse_skip_softmax() -> None:
    """Skip-softmax is not in the fp8 kernels (their manifest rows: skip_softmax_rows 0)."""
    raise NotImplementedError(f"{options.SKIP_SOFTMAX_ARG} with an fp8 (float8_e4m3fn) q is not implemented in "
                              "pyflashattn")


def merge_dtype(q_dtype) -> str:
    """The merge kernel's dtype (short name) for a plan of this q dtype."""
    return OWN16.short if q_dtype is FP8 else q_dtype.short


def _is_tensor(x) -> bool:
    """A framework tensor (a per-head scale: DLPack, or torch's data_ptr), not a number; numpy arrays
    are neither (they live on the host: scale_arg refuses them with the other non-numbers)."""
    return type(x) is _tensor.TensorView or (hasattr(x, "__dlpack__") or hasattr(x, "data_ptr")) and \
        not isinstance(x, np.ndarray)


def fold_numbers(scales: tuple, sm_scale, v_scale: float, head_dim: int, names: tuple = SCALE_NAMES) -> tuple:
    """The numbers among the (q, k, v) scales folded on the host: (sm_scale * q * k, v_scale * v).
    Tensors count 1 here (scale_operands points the kernel at them)."""
    f = [1.0 if x is None or _is_tensor(x) else operands.scale_arg(x, n) for x, n in zip(scales, names)]
    if f[0] != 1.0 or f[1] != 1.0:
        sm_scale = options.softmax_scale(sm_scale, head_dim) * f[0] * f[1]
    return sm_scale, v_scale * f[2]


def scale_operand(x, heads: int, name: str, dev: int, what: str) -> tuple:
    """One of scale_q / scale_k / scale_v (q_scale / k_scale / v_scale): (device pointer, host
    factor). None -> (0, 1.0); a number -> (0, its value, finite and > 0); a tensor -> float32,
    [heads] (or one element when heads == 1), contiguous, on cuda:dev -> (its address, 1.0).
    what: "query" or "kv", the heads it scales (for the message)."""
    if x is None or not _is_tensor(x):
        return 0, operands.scale_arg(x, name)
    t = _tensor.view(x, name)
    operands.require_device(t, name, dev)
    operands.require_dtype(t, name, (_dtypes.FLOAT32,), " (a per-head scale)")
    if t.shape not in ((heads,), ()) or (t.shape == () and heads != 1):
        raise ValueError(f"{name} must have shape ({heads},) (one scale per {what} head), got {t.shape}")
    if t.shape == (heads,) and heads > 1 and t.strides != (1,):
        raise ValueError(f"{name} must be contiguous, got strides {t.strides}")
    return t.ptr, 1.0


def scale_operands(scales: tuple, hq: int, hkv: int, dev: int, names: tuple = SCALE_NAMES) -> tuple:
    """(q, k, v) scales -> ((q ptr, k ptr, v ptr), logit factor, output factor)."""
    (qp, qf), (kp, kf), (vp, vf) = (scale_operand(x, h, n, dev, w) for x, h, n, w in
                                    zip(scales, (hq, hkv, hkv), names, ("query", "kv", "kv")))
    return (qp, kp, vp), qf * kf, vf


def refuse_tensors(scales: tuple, names: tuple = SCALE_NAMES) -> None:
    """A 16-bit q: per-head scale tensors are an fp8-prefill feature (numbers fold anywhere)."""
    for x, n in zip(scales, names):
        if x is not None and _is_tensor(x):
            raise NotImplementedError(f"{n} as a per-head tensor applies to fp8 (float8_e4m3fn) q only in "
                                      "pyflashattn; with a float16 / bfloat16 q pass a number")


def point_scales(p, ptrs: tuple) -> None:
    """The kernel's per-head scale pointers (0 = none)."""
    p.q_scale_heads, p.k_scale_heads, p.v_scale_heads = ptrs

