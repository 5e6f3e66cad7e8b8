"""CUDA-graph mode of a batch engine: a fixed capacity, fixed device addresses, and the settings a
captured run() baked in.

A captured graph replays the params struct, kernel and grid it was captured with; only
device-resident metadata follows new plans. So the first plan fixes the token capacity and the
staging layout (every array gets its capacity's room), and a plan the replay would not honour
(other options, kernel, mask or workspace) is refused once a run() was captured.
"""
from __future__ import annotations

from .._runtime import cuda as _cuda


class FrozenSettingsError(ValueError):
    """A plan whose settings differ from those a captured (or frozen) run() baked in."""


class GraphState:
    __slots__ = ("max_batch", "max_pages", "max_total_q", "capacity", "captured", "sig", "probe")

    def __init__(self, max_batch: int, max_pages: int):
        self.max_batch, self.max_pages = max_batch, max_pages
        # query tokens: None until the first plan fixes it (pyflashattn.jax sets it before then)
        self.max_total_q = None
        self.capacity = None  # fixed by the first plan that succeeds
        self.captured = None  # the plan settings a captured run() baked in
        self.sig = None  # the current plan's settings
        self.probe = True  # run() still checks whether its stream is capturing

    def check_capacity(self, B: int, total_q: int) -> dict:
        """The capacity dict for this plan (new and uncommitted at the first plan: a rejected plan
        leaves no trace, the dict is only stored by commit())."""
        cap = self.capacity
        if cap is None:
            cap = {"max_batch": self.max_batch, "max_total_q": self.max_total_q or total_q, "max_work": None}
        if B > cap["max_batch"]:
            raise ValueError(f"batch size {B} exceeds the CUDA-graph capacity {cap['max_batch']} "
                             "(the length of qo_indptr_buf - 1)")
        if total_q > cap["max_total_q"]:
            raise ValueError(f"{total_q} query tokens exceed the CUDA-graph capacity {cap['max_total_q']} "
                             "fixed by the first plan()")
        return cap

    def layout(self, sizes: dict, cap: dict, staging) -> dict:
        """Fixed offsets (sizes: name -> entries of each array this plan stages): every array gets
        its capacity's room, so device addresses never change between plans (the mask arrays have
        room whether or not the first plan has a mask)."""
        if "layout" not in cap:
            B, TQ = cap["max_batch"], cap["max_total_q"]
            bound = {"qo_indptr": B + 1, "kv_indptr": B + 1, "kv_last_page_len": B, "num_chunks": B,
                     "o_indptr": B + 1, "merge_indptr": TQ + 1, "chunk_size": 1,
                     "kv_page_indices": self.max_pages, "mask_indptr": B + 1, "mask_in_indptr": B + 1}
            first = dict(sizes)
            first.setdefault("mask_indptr", 0)
            first.setdefault("mask_in_indptr", 0)
            layout, off, room = {}, 0, {}
            for name, n in first.items():
                room[name] = max(n, bound.get(name, n))
                layout[name] = off
                off += (room[name] * 4 + 15) // 16 * 16
            layout["__end__"] = off
            # Reserve first: a refused reserve must not leave a layout behind.
            staging.reserve(off, fixed=True)
            cap["layout"], cap["sizes"] = layout, room
        room = cap["sizes"]
        for name, n in sizes.items():
            if n > room[name]:
                raise ValueError(f"{name} has {n} entries, more than the CUDA-graph buffers hold ({room[name]})")
        return cap["layout"]

    def check_sig(self, sig: dict) -> None:
        """Refuse a plan the captured replay would not honour."""
        old = self.captured
        if old is None:
            return
        for key, val in sig.items():
            if old[key] == val:
                continue
            if key == "custom_mask":
                raise FrozenSettingsError(
                    f"custom_mask / packed_custom_mask: run() was captured in a CUDA graph "
                    f"{'with' if old[key] else 'without'} a custom mask and replays that kernel as captured, so a "
                    f"plan {'without' if old[key] else 'with'} one would not be honoured; use another wrapper (and "
                    "graph) for it" + (", or pass an all-True mask" if old[key] else ""))
            raise FrozenSettingsError(f"{key}: run() was captured in a CUDA graph with {key} = {old[key]!r}; the "
                                      f"replay keeps it, so a plan with {val!r} would not be honoured; use another "
                                      "wrapper (and graph) for it")

    def commit(self, cap: dict, tile: int, sig: dict) -> None:
        cap.setdefault("decode_rows", tile)  # the first successful plan's tile, for good
        self.capacity, self.sig = cap, sig

    def fix_token_capacity(self, max_total_q: int) -> None:
        """The query-token capacity, before the first plan (which otherwise takes its own token
        count): pyflashattn.jax's wrappers, whose q / out hold max_num_tokens rows."""
        self.max_total_q = max_total_q

    def freeze(self) -> None:
        """The current plan's settings frozen as a capture freezes them, and no capture probing:
        pyflashattn.jax, where any jitted run() may be recorded by XLA."""
        self.captured, self.probe = self.sig, False

    def note_capture(self, s: int) -> None:
        """The first run() recorded into a CUDA graph freezes the plan settings it baked in."""
        if _cuda.stream_capturing(s):
            self.captured = self.sig
            self.probe = False


CAPTURE_REFUSED = (
    "run() was called while its stream is being captured into a CUDA graph, but this wrapper was built "
    "without use_cuda_graph=True: its plan() may move or rewrite the metadata, workspace and grid that a "
    "replay would read (FlashInfer replays such a graph with silently wrong output). Build the wrapper with "
    "use_cuda_graph=True (and its capacity buffers) to capture run(); nothing was launched.")


def refuse_capture(s: int) -> None:
    """A wrapper built without use_cuda_graph: RuntimeError when s is capturing (every run(),
    before anything is launched; one cuStreamIsCapturing query)."""
    if _cuda.stream_capturing(s):
        raise RuntimeError(CAPTURE_REFUSED)
