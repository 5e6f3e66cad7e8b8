"""Custom masks of a batch plan: validated at plan() (before the driver is touched), then packed
or copied where the kernel reads them.

FlashInfer's layout: request b's [qo_len, kv_len] boolean matrix, row-major, packed
little-endian into its own byte-aligned segment. packed_custom_mask (FlashInfer's
segment_packbits(..., bitorder="little") output) wins when both are given; a flat boolean
custom_mask (the matrices concatenated) is packed on the device at plan time.
"""
from __future__ import annotations

import numpy as np

from .._runtime import cuda as _cuda, dtypes as _dtypes, tensor as _tensor
from . import operands, packbits

I32_MAX = 2**31 - 1
MASK_MIN_BYTES = 64 << 10  # smallest library-owned packed-mask buffer


class MaskPlan:
    """What plan() validated about a custom mask (no driver touched yet) and where it goes."""

    __slots__ = ("kind", "obj", "view", "need", "byte_indptr", "elem_indptr", "seg_bytes", "dst")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)

    @property
    def offset_arrays(self) -> tuple:
        """The int32 offset arrays the device needs: byte offsets (and a bool mask's element offsets)."""
        return (self.byte_indptr, self.elem_indptr) if self.kind == "bool" else (self.byte_indptr,)


class MaskBuffers:
    """Where one batch engine's packed masks live: custom_mask_buf / qk_indptr_buf when the caller
    gave them (FlashInfer's CUDA-graph buffers, honoured in any mode), else a library buffer (fixed
    under CUDA graphs: sized once, at the first plan with a mask), else a packed mask in place."""

    def __init__(self, dev: int, fixed: bool, custom_mask_buf=None, qk_indptr_buf=None):
        self.dev, self.fixed = dev, fixed
        self.user = self._aux(custom_mask_buf, "custom_mask_buf", _dtypes.UINT8)
        self.qk_user = self._aux(qk_indptr_buf, "qk_indptr_buf", _dtypes.INT32)
        self.dev_ptr = self.cap = 0  # library-owned packed-mask buffer
        self.keep = None  # the caller's mask tensor a plan reads (asynchronously) or points at

    def _aux(self, buf, name, dtype):
        """(tensor, address, elements) of a constructor buffer on the wrapper's device, or None."""
        if buf is None:
            return None
        v = operands.contiguous_1d(buf, name, dtype, self.dev)
        return buf, v.ptr, v.shape[0]

    def plan(self, custom_mask, packed_custom_mask, qo_lens, kv_lens) -> MaskPlan:
        """Validate a per-request custom mask and decide where its packed bits go (no driver)."""
        bits = qo_lens.astype(np.int64)
        bits *= kv_lens
        seg_bytes = bits + 7
        seg_bytes >>= 3
        byte_indptr = np.zeros(bits.size + 1, np.int64)
        np.cumsum(seg_bytes, out=byte_indptr[1:])
        need = int(byte_indptr[-1])
        if need > I32_MAX:
            raise ValueError(f"the packed custom mask would take {need} bytes: more than 2 GiB (int32 byte offsets)")
        elem_indptr = None
        if packed_custom_mask is not None:
            kind, obj = "packed", packed_custom_mask
            v = _tensor.view(obj, "packed_custom_mask")
            operands.check_mask_operand(kind, v, self.dev, need)
        else:
            kind, obj = "bool", custom_mask
            v = _tensor.view(obj, "custom_mask")
            elem_indptr = np.zeros(bits.size + 1, np.int64)
            np.cumsum(bits, out=elem_indptr[1:])
            total = int(elem_indptr[-1])
            operands.check_mask_operand(kind, v, self.dev, need, bool_shape=(total,))
            if total > I32_MAX:
                raise ValueError(f"custom_mask has {total} entries, more than the device packer's int32 offsets "
                                 "take; pass packed_custom_mask")
        dst = None
        if self.user is not None:
            dst, cap = self.user[1], self.user[2]
            if need > cap:
                raise ValueError(f"the packed custom mask of this plan needs {need} bytes but custom_mask_buf holds "
                                 f"{cap}")
        elif self.fixed and self.cap:
            dst, cap = self.dev_ptr, self.cap
            if need > cap:
                raise ValueError(f"the packed custom mask of this plan needs {need} bytes but the CUDA-graph mask "
                                 f"buffer (sized at the first plan with a mask) holds {cap}; pass custom_mask_buf "
                                 f"with at least {need} bytes to the constructor")
        if self.qk_user is not None and self.qk_user[2] < bits.size + 1:
            raise ValueError(f"qk_indptr_buf holds {self.qk_user[2]} entries; this plan needs batch size + 1 = "
                             f"{bits.size + 1}")
        return MaskPlan(kind=kind, obj=obj, view=v, need=need, byte_indptr=byte_indptr.astype(np.int32),
                        elem_indptr=None if elem_indptr is None else elem_indptr.astype(np.int32),
                        seg_bytes=seg_bytes, dst=dst)

    def write(self, m: MaskPlan, ptrs, s) -> tuple:
        """Put the plan's packed mask and byte offsets where the kernel reads them, on the plan
        stream s (async: a device-to-device copy or the packbits kernel, no sync). ptrs: the
        device addresses of m.byte_indptr (and m.elem_indptr for a bool mask). Returns the
        (custom_mask, mask_indptr) addresses."""
        cu = _cuda.driver()
        v = m.view
        if v.framework not in ("torch", "cupy"):
            # JAX & co.: the plan stream waits for the producer's pending writes (DLPack handshake)
            v = _tensor.view(m.obj, "packed_custom_mask" if m.kind == "packed" else "custom_mask", stream=s)
        dst = m.dst
        if dst is None:
            dst = self._library_buffer(m, v, s, cu)
        if m.kind == "packed":
            if dst != v.ptr and m.need:
                _cuda.check(cu.cuMemcpyDtoDAsync(dst, v.ptr, m.need, s), "cuMemcpyDtoDAsync (packed_custom_mask)")
        elif m.need:
            packbits.launch_segments(self.dev, v.ptr, dst, ptrs[1], ptrs[0], 0, m.seg_bytes, 1, s)
        self.keep = m.obj  # read asynchronously (or in place): alive as long as the plan
        indptr = ptrs[0]
        if self.qk_user is not None:
            nbytes = 4 * m.byte_indptr.size
            _cuda.check(cu.cuMemcpyDtoDAsync(self.qk_user[1], indptr, nbytes, s), "cuMemcpyDtoDAsync (qk_indptr_buf)")
            indptr = self.qk_user[1]
        return dst, indptr

    def _library_buffer(self, m: MaskPlan, v, s, cu) -> int:
        if self.fixed:
            # Fixed for the wrapper's lifetime: captured graphs keep this address.
            self.cap = max(2 * m.need, MASK_MIN_BYTES)
            self.dev_ptr = _cuda.mem_alloc(self.cap)
            return self.dev_ptr
        if m.kind == "packed":
            return v.ptr  # used in place
        if m.need > self.cap:
            size = max(m.need, 2 * self.cap, MASK_MIN_BYTES)
            new = _cuda.mem_alloc_async(size, s)
            if self.dev_ptr:
                _cuda.check(cu.cuMemFreeAsync(self.dev_ptr, s), "cuMemFreeAsync")
            self.dev_ptr, self.cap = new, size
        return self.dev_ptr
