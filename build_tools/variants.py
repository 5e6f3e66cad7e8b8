"""THE table of kernel variants: what gets built, for which arch, with which launch shape.

gen_kernels.py writes one translation unit per row into kernel_src/generated/; the Makefile
compiles each for every arch in ARCHS; make_manifest.py records the rows next to the cubins,
and the runtime picks kernels from the manifest alone (pyflashattn/_registry.py).

Prefill tile shapes (BLOCK_M = warps * mq * 16 packed rows, BLOCK_N keys per tile) were
chosen by measurement on an H100/H200 (see NOTES.md); rows marked tune=True are alternatives
built only with `make TUNE=1` so the benchmark can compare them.
"""
import dataclasses
from dataclasses import dataclass

DTYPES = {"f16": "half", "bf16": "__nv_bfloat16"}
# K/V storage types next to the query dtype: "fp8" kernels read one-byte K/V (e4m3fn or e5m2,
# chosen at run time by PrefillParams.kv_fp8) and widen it to the query dtype in shared memory.
KV_STORAGE = {"fp8": "pfa::fp8_storage"}
ARCHS_DEFAULT = ("sm_80", "sm_89", "sm_90a")


@dataclass(frozen=True)
class PrefillVariant:
    dtype: str
    head_dim: int
    warps: int
    mq: int  # m16 row tiles per warp
    block_n: int
    q_in_regs: bool
    stages: int  # K/V shared-memory stages: 1 = FA2 interleave, 2 = double-buffered K and V
    min_blocks: int  # __launch_bounds__ min CTAs per SM (caps registers)
    # Rescale O only when a row max of the warp moved (a warp vote per tile). A register-
    # allocation lever as much as an arithmetic one: measured per shape (NOTES.md).
    lazy_rescale: bool = False
    # Warp pairs share their rows: each computes S for half of a tile's keys and O for half of
    # the head dim (prefill_sm80.cuh, PAIR). BLOCK_M counts rows, so it is warps / 2 * mq * 16.
    pair: bool = False
    tune: bool = False
    # general = custom mask, soft cap, ALiBi, RoPE compiled in (runtime fields pick them); the
    # lean kernel (plain, causal, window) carries none of that code, so it pays nothing for it.
    general: bool = False
    paged: bool = False  # K/V rows gathered through a page table (batch paged wrapper)
    kv_dtype: str = ""  # "" = K/V in the query dtype; "fp8" = one-byte K/V widened in the kernel
    # Decode tile: one warp, 16 packed rows, for batches whose every request fits 16 rows (decode,
    # speculative decode: qo_len * group <= 16). KV streaming is what such a batch costs; the
    # 128-row kernels spend 7/8 of their MMAs on padding rows there (NOTES.md).
    decode: bool = False

    @property
    def kv(self):
        return self.kv_dtype or self.dtype

    @property
    def block_m(self):
        return self.warps // (2 if self.pair else 1) * self.mq * 16

    @property
    def name(self):
        return (f"pfa_prefill_sm80_{self.dtype}{'_kv' + self.kv_dtype if self.kv_dtype else ''}_hd{self.head_dim}"
                f"_m{self.block_m}n{self.block_n}w{self.warps}s{self.stages}{'_qr' if self.q_in_regs else ''}{'_lr' if self.lazy_rescale else ''}{'_pr' if self.pair else ''}"
                f"{'_gen' if self.general else ''}{'_paged' if self.paged else ''}")

    @property
    def threads(self):
        return self.warps * 32

    @property
    def smem_bytes(self):
        # PrefillSm80::SMEM_BYTES (the generated source static_asserts the two agree): Q + the K/V
        # stages; fp8 K/V: the one-byte ring plus one widened K/V pair; + the paged kernels'
        # page-id staging (max_page_ids int32 entries), the others' row map (8 bytes per packed row);
        # + (pair) per warp and lane a float4 of row maxes and the warp's P words (mq * block_n / 8).
        # (the hd256 fp8 decode tile widens K and V one after the other into one tile:
        # PrefillSm80::SPLIT_WIDEN)
        kv_tile = self.block_n * self.head_dim
        wide = (1 if self.block_m == 16 and self.head_dim >= 256 else 2) * kv_tile * 2
        kv = 2 * self.stages * kv_tile * 2 if not self.kv_dtype else 2 * self.stages * kv_tile + wide
        xch = self.warps * 32 * (16 + self.mq * self.block_n // 8 * 4) if self.pair else 0
        return self.block_m * self.head_dim * 2 + kv + (self.max_page_ids * 4 if self.paged else self.block_m * 8) + xch

    @property
    def max_page_ids(self):
        # PrefillSm80::MAX_PAGE_IDS: the decode tiles stage fewer page ids (3 CTAs per SM)
        return 2048 if self.block_m > 16 or self.head_dim > 128 else 1024

    @property
    def rows_fastest(self):
        # honours PrefillParams.rows_fastest (PrefillSm80::ROWS_FASTEST, static_assert'ed equal)
        return self.pair and not self.paged

    def source(self):
        return ('#include "pfa/attention/prefill_sm80.cuh"\n'
                f"PFA_DEFINE_PREFILL_SM80({self.name}, {DTYPES[self.dtype]}, "
                f"{KV_STORAGE[self.kv_dtype] if self.kv_dtype else DTYPES[self.dtype]}, {self.head_dim}, {self.warps}, "
                f"{self.mq}, {self.block_n}, {'true' if self.q_in_regs else 'false'}, {self.stages}, {self.min_blocks}, "
                f"{'true' if self.general else 'false'}, {'true' if self.paged else 'false'}, "
                f"{'true' if self.lazy_rescale else 'false'}, {'true' if self.pair else 'false'}, {self.smem_bytes}, "
                f"{'true' if self.rows_fastest else 'false'})\n")

    def manifest(self):
        return {"family": "prefill", "dtype": self.dtype, "kv_dtype": self.kv, "head_dim": self.head_dim,
                "block_m": self.block_m,
                "block_n": self.block_n, "threads": self.threads, "smem_bytes": self.smem_bytes,
                "tune": self.tune, "general": self.general, "paged": self.paged, "decode": self.decode,
                "rows_fastest": self.rows_fastest}


@dataclass(frozen=True)
class MergeVariant:
    dtype: str
    tune: bool = False

    @property
    def name(self):
        return f"pfa_merge_{self.dtype}"

    def source(self):
        return f'#include "pfa/attention/merge.cuh"\nPFA_DEFINE_MERGE({self.name}, {DTYPES[self.dtype]})\n'

    def manifest(self):
        # programmatic_launch: it follows the attention kernel on the stream and waits for it in
        # griddepcontrol.wait before reading a partial (sm_90+; launched plainly elsewhere).
        return {"family": "merge", "dtype": self.dtype, "threads": 128, "smem_bytes": 0, "rows_per_block": 4,
                "programmatic_launch": True, "tune": self.tune}


@dataclass(frozen=True)
class PackbitsVariant:
    tune: bool = False

    @property
    def name(self):
        return "pfa_packbits"

    def source(self):
        return '#include "pfa/misc/packbits.cuh"\nPFA_DEFINE_PACKBITS(pfa_packbits)\n'

    def manifest(self):
        return {"family": "packbits", "threads": 256, "smem_bytes": 0, "tune": self.tune}


# head_dim -> (warps, mq, block_n, q_in_regs, stages, min_blocks, lazy_rescale[, pair]): the shipped
# default per head dim. lazy_rescale applies to the lean kernels only (it made the general ones spill
# more); it took hd128 from 40 B of spills to none (+8-12 %) but cost hd64 ~8 % (H100, NOTES.md).
# hd256 runs warp pairs (8 warps, 128 rows, 2 row tiles per pair): +3 % over 8 single-row-tile warps.
PREFILL_TILES = {
    64: (4, 2, 64, True, 2, 2, False),
    128: (4, 2, 64, False, 2, 2, True),
    256: (8, 2, 64, False, 2, 1, True, True),
}
# head_dim -> the decode tile (same fields; warps 1, mq 1 = 16 rows). Lean kernels only (masks, soft
# cap, ALiBi, RoPE take the 128-row general kernels); lazy rescale and no Q in registers: the
# variants that ptxas fits without spills (hd256 needs 32-key tiles). min_blocks 1: one warp never
# runs out of registers; the CTAs per SM the scheduler plans with come from the shared memory
# (the batch wrapper computes them per GPU). hd128 runs 32-key tiles: five CTAs per SM instead of
# three (H100, bench_decode, paged TB/s 64 -> 32 keys: 2.58-2.61 -> 2.66-2.67, 2.80-2.84 -> 2.89-2.90,
# 2.98 -> 2.98-2.99, spec-decode 2.69-2.72 -> 2.83-2.84; ragged unchanged). hd64 / hd256 keep theirs (32 / 16 keys there: hd64
# within noise or lower; hd256 paged spec-decode 2.36 -> 2.87 but B=64 2.80 -> 2.54).
DECODE_TILES = {
    64: (1, 1, 64, False, 2, 1, True),
    128: (1, 1, 32, False, 2, 1, True),
    256: (1, 1, 32, False, 2, 1, True),
}
# The decode tile over an fp8 K/V cache. Its warps widen every K/V tile into a 16-bit copy in
# shared memory (~2 instructions an element), which with the bf16 tiles above ran at 0.23-0.62 of
# the copy bandwidth in fp8 bytes, slower than the bf16 cache at hd128 / hd256: latency-bound
# with 2-3 warps per SM. Smaller tiles fit more CTAs per SM, and a warp pair (2 warps, the same 16
# rows: PAIR) halves each warp's widening. H100, bench_decode fp8 paged TB/s (fp8 bytes), the
# four cases B=64 / B=16 / B=128 / spec-decode, one-wave split budget, base (the bf16 tiles) ->
# one warp 32 keys (hd256: 16) / pair 32 keys: hd64 1.16 / 1.47 / 1.87 / 1.58 -> 1.60 / 2.08 /
# 1.73 / 1.96 (pair: wrong outputs, see PrefillSm80's PAIR assert); hd128 1.13 / 1.23 / 1.38 /
# 0.99 -> 1.28 / 1.57 / 1.82 / 1.64, pair 1.70 / 1.41 / 2.07 / 1.91; hd256 0.99 / 0.85 / 1.08 /
# 0.69 -> 1.10 / 1.64 / 1.73 / 1.44, pair 1.55 / 1.37 / 1.75 / 1.14. With the two-wave split
# budget (_batch_prefill._FP8_DECODE_WAVES) the ranking moved; H200, two rounds: hd128 pair 32
# keys 1.87-1.89 / 1.84-1.85 / 2.06-2.08 / 1.75-1.76, one warp 32 keys 1.61-1.62 / 1.65-1.66 /
# 1.79-1.80 / 1.75-1.77, one warp 16 keys 1.87 / 2.11-2.12 / 1.97 / 2.03-2.04 (shipped); hd256
# one warp 16 keys 1.61-1.62 / 1.67-1.68 / 1.74-1.75 / 1.74, pair 32 keys 1.76-1.78 / 1.77-1.79 /
# 2.00-2.01 / 1.88-1.89 (shipped); hd64 16 keys 1.99-2.00 / 1.88-1.89 / 2.05 / 2.19-2.20 against
# 32 keys 1.84-1.85 / 2.13-2.14 / 2.15-2.16 / 2.01-2.02 (kept).
DECODE_TILES_FP8 = {
    64: (1, 1, 32, False, 2, 1, True),
    128: (1, 1, 16, False, 2, 1, True),
    256: (2, 1, 32, False, 2, 1, True, True),
}
# The wide decode tiles: rows -> head_dim -> tile, 32 or 64 packed rows on 2 or 4 warps with 16 rows
# each, sharing every K/V tile, its page-table lookups and, over an fp8 cache, its widening; the
# 16-row tiles' key counts per K/V storage. For requests of 17-64 packed rows (8-token speculative
# decode at GQA 4 / 8) over a paged or fp8 cache: only those kernels are built, since contiguous
# 16-bit K/V stream faster as several 16-row tiles (prefill.decode_tiles; NOTES.md, session 11).
# hd256 has none (prefill.DECODE_MAX_ROWS keeps it at 16 rows).
WIDE_DECODE_TILES = {
    32: {64: (2, 1, 64, False, 2, 1, True), 128: (2, 1, 32, False, 2, 1, True)},
    64: {64: (4, 1, 64, False, 2, 1, True), 128: (4, 1, 32, False, 2, 1, True)},
}
WIDE_DECODE_TILES_FP8 = {
    32: {64: (2, 1, 32, False, 2, 1, True), 128: (2, 1, 16, False, 2, 1, True)},
    64: {64: (4, 1, 32, False, 2, 1, True), 128: (4, 1, 16, False, 2, 1, True)},
}
# Alternatives the tuning sweep compares against the defaults.
PREFILL_TUNE_TILES = {
    64: [(4, 2, 64, True, 3, 2), (8, 2, 64, True, 2, 1)],
    128: [(8, 1, 64, True, 2, 1), (4, 2, 48, False, 2, 2), (4, 2, 64, False, 1, 2), (4, 2, 32, False, 3, 2)],
    # (4, 1, 64, False, 1, 2) is FA2's hd256 shape: 64-row CTAs, two per SM, one K and one V buffer.
    256: [(4, 1, 64, False, 1, 2, True), (8, 1, 64, False, 2, 1), (8, 1, 32, False, 3, 1),
          (8, 2, 64, False, 2, 1, False, True)],
}


def variants(tune=False):
    out = []
    for dtype in DTYPES:
        for hd, tile in PREFILL_TILES.items():
            for kv_dtype in ("", "fp8"):
                for general in (False, True):
                    for paged in (False, True):
                        v = PrefillVariant(dtype, hd, *tile, general=general, paged=paged, kv_dtype=kv_dtype)
                        out.append(dataclasses.replace(v, lazy_rescale=False) if general else v)
                for paged in (False, True):
                    dec = (DECODE_TILES_FP8 if kv_dtype else DECODE_TILES)[hd]
                    out.append(PrefillVariant(dtype, hd, *dec, paged=paged, kv_dtype=kv_dtype, decode=True))
                    if paged or kv_dtype:
                        for wide in (WIDE_DECODE_TILES_FP8 if kv_dtype else WIDE_DECODE_TILES).values():
                            if hd in wide:
                                out.append(PrefillVariant(dtype, hd, *wide[hd], paged=paged, kv_dtype=kv_dtype,
                                                          decode=True))
            if tune:
                out += [PrefillVariant(dtype, hd, *t, tune=True) for t in PREFILL_TUNE_TILES[hd]]
        out.append(MergeVariant(dtype))
    out.append(PackbitsVariant())
    return out
