"""run()'s per-call options written into a batch plan's structs (BatchEngine's share of run()):
k / v / q scales, attention sinks, and the skip-softmax factor, whose kernel may be a sibling of
the plan's (the "_skip" twin, or an sm80 plan's general kernel of the same tile). Each writes the
struct only when its value changes: run() stays host work on pointers and a few fields."""
from __future__ import annotations

from .._runtime import cuda as _cuda, registry as _registry
from . import fp8, operands, options, routing


class RunOptions:
    """Mixed into BatchEngine: the methods below read its plan (cfg, attn, merge, launchers, dev,
    kv_maps, q_map) and keep their last values on it (ks, vs, scale_ptrs, scaled, sinks, skip,
    skip_home)."""

    def apply_scales(self, k_scale, v_scale, q_scale=None):
        """k_scale (and q_scale) fold into the logit scale, v_scale into the output multiplier (both
        in the kernel, split-KV partials included). An fp8-q plan also takes them as per-head
        float32 tensors (q [Hq], k and v [Hkv]: fp8.scale_operands), which the kernel reads; a
        16-bit q numbers only. The struct is only written when a value changes."""
        scales, names = (q_scale, k_scale, v_scale), ("q_scale", "k_scale", "v_scale")
        ptrs = (0, 0, 0)
        if fp8.is_fp8(self.cfg.q_dtype):
            ptrs, ks, vs = fp8.scale_operands(scales, self.cfg.num_qo_heads, self.cfg.num_kv_heads, self.dev, names)
        else:
            fp8.refuse_tensors(scales, names)
            ks = operands.scale_arg(k_scale, "k_scale") * operands.scale_arg(q_scale, "q_scale")
            vs = operands.scale_arg(v_scale, "v_scale")
        p = self.attn.params
        if ks != self.ks or vs != self.vs:
            p.sm_scale_log2 = self.sm_log2 * ks
            p.v_scale = vs
            self.ks, self.vs = ks, vs
        if ptrs != self.scale_ptrs:
            fp8.point_scales(p, ptrs)
            self.scale_ptrs = ptrs
        self.scaled = ks != 1.0 or vs != 1.0 or ptrs != (0, 0, 0)

    def apply_sinks(self, sinks):
        """Point the attention and merge structs at run()'s sinks (None: none); the kernel adds
        each row's sink where the row is finished."""
        self.point_sinks(0 if sinks is None else operands.sinks_operand(sinks, self.cfg.num_qo_heads,
                                                                        self.cfg.num_kv_heads, self.dev))

    def point_sinks(self, ptr: int):
        """The structs' sinks address (validated by the caller; 0 = none), written when it changes."""
        if ptr != self.sinks:
            self.attn.params.sinks = ptr
            if self.merge is not None:
                self.merge.params.sinks = ptr
            self.sinks = ptr

    def apply_skip_softmax(self, factor):
        """run()'s skip_softmax_threshold_scale_factor (validated here; None / 0 = off) into the struct.
        A plan on a kernel without skip-softmax (the 128-row lean sm80 kernels: the manifest's
        skip_softmax_rows = 0) runs skip-softmax calls on the general kernel of the same tile, so
        the same schedule: its struct takes a copy of the plan's, and hands it back when the
        factor returns to 0. (Host work only: no sync, no allocation after the first such call.)"""
        f = options.skip_softmax_factor(factor)
        if f == self.skip:
            return
        if f and fp8.is_fp8(self.cfg.q_dtype):
            fp8.refuse_skip_softmax()
        la = self.attn
        if f and not la.meta.get("skip_softmax_rows"):
            m = la.meta
            sib = self.skip_sibling(m)
            if self.cfg.o_format == operands.OUT_NVFP4 and not sib.meta.get("nvfp4_out"):
                raise NotImplementedError(f"{options.SKIP_SOFTMAX_ARG} with out_dtype='nvfp4': the kernel skip-softmax "
                                          f"runs on ({sib.meta.get('name', sib.name)}) lacks the NVFP4 output (the "
                                          "hd256 general kernels)")
            if (sib.meta["block_m"], sib.meta["block_n"]) != (m["block_m"], m["block_n"]) or \
                    not sib.meta.get("skip_softmax_rows"):
                raise NotImplementedError(f"{options.SKIP_SOFTMAX_ARG}: {m['name']} has no skip-softmax and no "
                                          f"general kernel of its tile has it ({sib.meta['name']})")
            _cuda.copy_params(sib, la)
            sib.params.q_tma = 0  # (Q's map is pointed in home's struct only: the sibling copies Q)
            self.skip_home, self.attn = la, sib
        elif not f and self.skip_home is not None:
            home = self.skip_home
            _cuda.copy_params(home, la)
            self.skip_home, self.attn = None, home
            if self.kv_maps is not None:  # home's maps came back from the sibling's struct: rewrite them
                self.kv_maps.forget()
            if self.q_map is not None:
                self.q_map.forget()
        self.attn.params.skip_softmax_factor = f
        self.skip = f

    def skip_sibling(self, m):
        """The kernel of the same tile with skip-softmax compiled in, for the plan's kernel (manifest
        row m): the sm90 family's "_skip" twin (a TMA kernel's: its cp.async row's, which reads no
        tensor maps), else (sm80 lean) the general kernel of the tile."""
        if m.get("impl") == "sm90":
            key = ("skip", m["name"])
            la = self.launchers.get(key)
            if la is None:
                la = self.launchers[key] = _registry.new_launcher("prefill", self.dev,
                                                                  name=routing.base_kernel_name(m) + "_skip")
            return la
        return self.launcher("prefill", m["dtype"], m["kv_dtype"], m["head_dim"], True)
