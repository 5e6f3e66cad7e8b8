"""The device buffer for a plan's int metadata, filled by one async copy from pinned host memory."""
from __future__ import annotations

import ctypes

import numpy as np

from .._runtime import cuda as _cuda


class Staging:
    """The device buffer for all int metadata of a plan, filled by one async copy per plan from
    a small pool of pinned host buffers.

    plan() fills a pinned buffer and issues one cuMemcpyHtoDAsync on the plan stream; the copy's
    event guards that buffer. The next plan takes a pinned buffer whose copy has finished
    (cuEventQuery, no wait) or, while the GPU lags behind the host, adds one to the pool (up to
    MAX_PINNED): plan() never waits for the GPU to drain the stream its copy was queued on. The
    device buffer is one: copies and the runs that read it are ordered on the stream. Without a
    layout the arrays go back to back (the kernels read them as int32, 4-byte alignment is all
    they need); with fixed=True (CUDA graphs) every array has its own fixed room, so the device
    addresses captured launches point at never move.
    """

    MAX_PINNED = 4

    def __init__(self, device_id: int):
        self.dev = device_id
        self.device = 0
        self.size = 0
        self.fixed = False
        self.pinned = []  # [host address, int32 view, event or None]
        self.next = 0
        self.sched = 0
        self.last = None  # (the pinned int32 view, bytes) of the last upload

    def counters(self, stream: int) -> int:
        """The tile scheduler's counters of this wrapper's persistent launches (cuda.sched_counters:
        0 while none exist and the plan stream captures). A device allocation of their own: the int
        buffer moves when it grows, and plans rewrite it."""
        if not self.sched:
            _cuda.ensure_context(self.dev)
            self.sched = _cuda.sched_counters(stream)
        return self.sched

    def reserve(self, nbytes: int, fixed: bool = False):
        if nbytes <= self.size:
            return
        if self.fixed:
            raise ValueError(f"plan needs {nbytes} bytes of int metadata but the CUDA-graph buffers hold "
                             f"{self.size}; construct the wrapper with larger buffers")
        cu = _cuda.driver()
        _cuda.ensure_context(self.dev)
        for host, _, event in self.pinned:  # rare (growth): let pending copies read their bytes first
            if event is not None:
                _cuda.check(cu.cuEventSynchronize(event), "cuEventSynchronize")
                _cuda.check(cu.cuEventDestroy(event), "cuEventDestroy")
            _cuda.check(cu.cuMemFreeHost(host), "cuMemFreeHost")
        self.pinned, self.next = [], 0
        if self.device:
            _cuda.mem_free(self.device)
        size = (max(nbytes, 2 * self.size, 4096) + 15) // 16 * 16
        self.device = _cuda.mem_alloc(size)
        self.size, self.fixed = size, fixed

    def _pinned_buffer(self, cu):
        """A pinned buffer no pending copy reads (see the class docstring); cu = the driver."""
        if self.pinned:
            # The last plan's buffer first: its copy is usually done by now, and its lines may
            # still be in the CPU cache (round-robin over the pool would write a cold buffer).
            entry = self.pinned[self.next - 1]
            event = entry[2]
            if len(self.pinned) > 1 and (event is None
                                         or cu.cuEventQuery(event)[0] == cu.CUresult.CUDA_SUCCESS):
                return entry
            entry = self.pinned[self.next]
            event = entry[2]
            if event is None or cu.cuEventQuery(event)[0] == cu.CUresult.CUDA_SUCCESS:
                self.next = (self.next + 1) % len(self.pinned)
                return entry
            if len(self.pinned) >= self.MAX_PINNED:  # the GPU is MAX_PINNED plans behind: wait
                _cuda.check(cu.cuEventSynchronize(event), "cuEventSynchronize")
                self.next = (self.next + 1) % len(self.pinned)
                return entry
        host = int(_cuda.check(cu.cuMemHostAlloc(self.size, 0), "cuMemHostAlloc"))
        entry = [host, np.ctypeslib.as_array((ctypes.c_int32 * (self.size // 4)).from_address(host)), None]
        self.pinned.insert(self.next, entry)
        self.next = (self.next + 1) % len(self.pinned)
        return entry

    def upload(self, arrays, stream: int, offsets=None, nbytes: int = 0) -> list:
        """Copy int32 arrays (an int stands for a one-element array) to the device in one async
        copy, written straight into a pinned buffer; returns each one's device address.
        offsets: each one's fixed int32 offset and nbytes the bytes to copy (the CUDA-graph
        layout), else back to back (a slice assignment per array: cheaper than one concatenate
        at these sizes)."""
        if offsets is None:
            offsets, n = [], 0
            for a in arrays:
                offsets.append(n)
                n += 1 if type(a) is int else a.size
            nbytes = 4 * n
        if nbytes > self.size:  # (reserve's own test, without a method call per plan)
            self.reserve(nbytes)
        cu = _cuda.driver()
        entry = self._pinned_buffer(cu)
        host32 = entry[1]
        for a, o in zip(arrays, offsets):
            if type(a) is int:
                host32[o] = a
            else:
                host32[o:o + a.size] = a
        # The two driver calls of every plan test their status inline (_cuda.check raises the
        # error; on success it only costs a call and another driver() lookup).
        ok = cu.CUresult.CUDA_SUCCESS
        if nbytes:
            r = cu.cuMemcpyHtoDAsync(self.device, entry[0], nbytes, stream)
            if r[0] != ok:
                _cuda.check(r, "cuMemcpyHtoDAsync")
        if entry[2] is None:
            entry[2] = _cuda.check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        r = cu.cuEventRecord(entry[2], stream)
        if r[0] != ok:
            _cuda.check(r, "cuEventRecord")
        base = self.device
        self.last = (host32, nbytes)  # what this copy sends (pyflashattn.jax keeps the plan's bytes)
        return [base + 4 * o for o in offsets]
