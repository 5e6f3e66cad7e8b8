"""THE table of kernel variants: what gets built, for which arch, with which launch shape.

Every row names its implementation family (`impl`) and the archs it is built for (`archs`).
gen_kernels.py writes one translation unit per row into kernel_src/generated/ plus
kernel_src/generated/kernels.mk (the kernels of each arch), from which the Makefile compiles
each row for its archs only; make_manifest.py records the built rows next to the cubins, and
the runtime picks kernels from the manifest alone (pyflashattn/_runtime/registry.py).

A row is built for an arch of its family unless it cannot run there: its dynamic shared memory
exceeds the arch's per-block opt-in limit, or (decode tiles) the Python host can never route a
launch to it on that arch (unbuilt_reason says which, and the manifest lists the rows left out).

Prefill tile shapes (BLOCK_M = warps * mq * 16 packed rows, BLOCK_N keys per tile) were
chosen by measurement on an H100/H200 (see NOTES.md); rows marked tune=True are alternatives
built only with `make TUNE=1` so the benchmark can compare them.
"""
import dataclasses
from dataclasses import dataclass

DTYPES = {"f16": "half", "bf16": "__nv_bfloat16"}
# K/V storage types next to the query dtype: "fp8" kernels read one-byte K/V (e4m3fn or e5m2,
# chosen at run time by PrefillParams.kv_fp8) and widen it to the query dtype in shared memory;
# "nvfp4" kernels read e2m1 code pairs plus one e4m3 scale per 16 elements (PrefillParams.k_sf /
# v_sf) and widen them the same way.
KV_STORAGE = {"fp8": "pfa::fp8_storage", "nvfp4": "pfa::nvfp4_storage"}
# K/V storages built only as the paged decode tiles (the decode wrapper and XQA): any request
# runs on them, past their rows as several row tiles (routing.DECODE_ONLY_KV mirrors this).
DECODE_ONLY_KV = ("nvfp4",)
ARCHS_DEFAULT = ("sm_80", "sm_89", "sm_90a")

# Dynamic shared memory a block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin), per arch:
# a kernel that asks for more can never launch there, so it is not built for that arch. 8.6 GPUs
# allow what sm_89 does but run the sm_80 cubins (registry.arch_candidates), which are sized for
# the A100; the runtime refuses the rows that exceed their own GPU's limit.
SMEM_OPTIN = {"sm_80": 166912, "sm_89": 101376, "sm_90a": 232448}

# Implementation families: impl -> the archs its rows are built for. A prefill row's kernel name,
# header and definition macro derive from its impl (pfa_prefill_<impl>_...,
# pfa/attention/prefill_<impl>.cuh, PFA_DEFINE_PREFILL_<IMPL>).
#   "sm80": the mma.sync family, sm_80 class (cp.async, ldmatrix, mma.sync): every arch here.
#   "sm90": the Hopper family (warp-specialised wgmma, mbarrier pipelines), sm_90a only.
#   "portable": plain CUDA kernels (merge, packbits), one source for every arch.
SM80 = "sm80"
SM90 = "sm90"
PORTABLE = "portable"
IMPL_ARCHS = {SM80: ARCHS_DEFAULT, SM90: ("sm_90a",), PORTABLE: ARCHS_DEFAULT}

WARP_THREADS = 32
MMA_ROWS = 16  # rows of one m16 MMA tile: a warp's row tile, and the decode tile's height
HALF_BYTES = 2  # a 16-bit (f16 / bf16) element
FP8_BYTES = 1
NVFP4_BLOCK = 16  # head-dim elements per NVFP4 block scale (one e4m3 byte)
ROW_MAP_BYTES = 8  # per packed row: its (token, q head), kept by the non-paged kernels
PAGE_ID_BYTES = 4  # one int32 page id staged in shared memory by the paged kernels
PAGE_IDS = 2048  # PrefillSm80::MAX_PAGE_IDS
DECODE_PAGE_IDS = 1024  # ... of the 16-row tiles up to DECODE_PAGE_IDS_MAX_HD: less staging, more CTAs per SM
DECODE_PAGE_IDS_MAX_HD = 128
# PrefillSm80::SPLIT_WIDEN: the fp8 / NVFP4 16-row tiles from this head dim widen K and V one after
# the other into one 16-bit tile (one widened tile instead of a pair: more CTAs per SM)
SPLIT_WIDEN_MIN_HD = 256
PAIR_LANE_BYTES = 16  # PAIR exchange: each lane's float4 of row maxes (row sums in the epilogue)
P_WORD_KEYS = 8  # PAIR exchange: P's words per lane come to mq * block_n / 8 ...
P_WORD_BYTES = 4  # ... of 4 bytes each
# The decode tiles' CTAs per SM as designed: an upper bound; the host takes what shared memory
# allows, min(8, smem_per_sm // (smem_bytes + 1024)) (prefill._decode_ctas_per_sm).
DECODE_CTAS_PER_SM = 8


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
    impl: str = SM80  # the implementation family (IMPL_ARCHS)
    # The archs it is built for; None = every arch of its impl whose shared memory holds it
    # (variants() narrows the decode tiles to where the host can route them).
    archs: tuple = None

    def __post_init__(self):
        if self.archs is None:
            object.__setattr__(self, "archs", tuple(a for a in IMPL_ARCHS[self.impl] if self.fits(a)))

    def fits(self, arch):
        return self.smem_bytes <= SMEM_OPTIN[arch]

    @property
    def kv(self):
        return self.kv_dtype or self.dtype

    @property
    def block_m(self):
        return self.warps // (2 if self.pair else 1) * self.mq * MMA_ROWS

    @property
    def name(self):
        return (f"pfa_prefill_{self.impl}_{self.dtype}{'_kv' + self.kv_dtype if self.kv_dtype else ''}_hd{self.head_dim}"
                f"_m{self.block_m}n{self.block_n}w{self.warps}s{self.stages}{'_qr' if self.q_in_regs else ''}{'_lr' if self.lazy_rescale else ''}{'_pr' if self.pair else ''}"
                f"{f'_b{self.min_blocks}' if self.decode and self.min_blocks > 1 else ''}"
                f"{'_gen' if self.general else ''}{'_paged' if self.paged else ''}")

    @property
    def threads(self):
        return self.warps * WARP_THREADS

    @property
    def ctas_per_sm(self):
        """The CTAs per SM the variant is designed for (the host's planning figure)."""
        return max(DECODE_CTAS_PER_SM, self.min_blocks) if self.decode else self.min_blocks

    @property
    def smem_bytes(self):
        # PrefillSm80::SMEM_BYTES (the generated source static_asserts the two agree): Q + the K/V
        # stages; fp8 / NVFP4 K/V: the narrow ring plus one widened K/V pair (none: reg_widen); + the paged kernels'
        # page-id staging (max_page_ids int32 entries), the others' row map (8 bytes per packed row);
        # + (pair) per warp and lane a float4 of row maxes and the warp's P words (mq * block_n / 8).
        # (the hd256 fp8 / NVFP4 decode tiles widen K and V one after the other into one tile:
        # PrefillSm80::SPLIT_WIDEN)
        kv_tile = self.block_n * self.head_dim  # elements of one K (or V) tile
        split_widen = self.block_m == MMA_ROWS and self.head_dim >= SPLIT_WIDEN_MIN_HD
        # the widened K and V (or one of them); none where fragments widen in registers
        wide = 0 if self.reg_widen else (1 if split_widen else 2) * kv_tile * HALF_BYTES
        # each stage holds a K and a V tile
        kv = (2 * self.stages * kv_tile * HALF_BYTES if not self.kv_dtype
              else 2 * self.stages * self.block_n * self.ring_row_bytes + wide)
        xch = (self.threads * (PAIR_LANE_BYTES + self.mq * self.block_n // P_WORD_KEYS * P_WORD_BYTES)
               if self.pair else 0)
        rows = self.max_page_ids * PAGE_ID_BYTES if self.paged else self.block_m * ROW_MAP_BYTES
        return self.block_m * self.head_dim * HALF_BYTES + kv + rows + xch

    @property
    def reg_widen(self):
        """fp8 / NVFP4 K/V widened in registers, fragment by fragment (PrefillSm80Config::
        KV_REG_WIDEN): the one-warp decode tiles, and the wide fp8 ones (a warp per 16 rows)."""
        if self.general or self.mq != 1:
            return False
        if self.block_m == MMA_ROWS:  # one warp, or (fp8) a warp pair that splits keys / dims
            return self.kv_dtype == "fp8" or (self.kv_dtype == "nvfp4" and not self.pair)
        return self.kv_dtype == "fp8" and self.block_m <= 4 * MMA_ROWS and not self.pair

    @property
    def ring_row_bytes(self):
        """Bytes of one K (or V) row in the ring of a narrow-K/V kernel: fp8 one per element,
        NVFP4 half a byte per element plus one scale byte per NVFP4_BLOCK (PrefillSm80Config)."""
        if self.kv_dtype == "nvfp4":
            return self.head_dim // 2 + self.head_dim // NVFP4_BLOCK
        return self.head_dim * FP8_BYTES

    @property
    def max_page_ids(self):
        # PrefillSm80::MAX_PAGE_IDS: the 16-row tiles up to hd128 stage fewer page ids
        return PAGE_IDS if self.block_m > MMA_ROWS or self.head_dim > DECODE_PAGE_IDS_MAX_HD else DECODE_PAGE_IDS

    @property
    def rows_fastest(self):
        # honours PrefillParams.rows_fastest (PrefillSm80::ROWS_FASTEST, static_assert'ed equal)
        return self.pair and not self.paged

    def source(self):
        return (f'#include "pfa/attention/prefill_{self.impl}.cuh"\n'
                f"PFA_DEFINE_PREFILL_{self.impl.upper()}({self.name}, {DTYPES[self.dtype]}, "
                f"{KV_STORAGE[self.kv_dtype] if self.kv_dtype else DTYPES[self.dtype]}, {self.head_dim}, {self.warps}, "
                f"{self.mq}, {self.block_n}, {'true' if self.q_in_regs else 'false'}, {self.stages}, {self.min_blocks}, "
                f"{'true' if self.general else 'false'}, {'true' if self.paged else 'false'}, "
                f"{'true' if self.lazy_rescale else 'false'}, {'true' if self.pair else 'false'}, {self.smem_bytes}, "
                f"{'true' if self.rows_fastest else 'false'})\n")

    def manifest(self):
        return {"family": "prefill", "impl": self.impl, "dtype": self.dtype, "kv_dtype": self.kv,
                "head_dim": self.head_dim, "block_m": self.block_m, "block_n": self.block_n, "warps": self.warps,
                "threads": self.threads, "smem_bytes": self.smem_bytes, "ctas_per_sm": self.ctas_per_sm,
                "tune": self.tune, "general": self.general, "paged": self.paged, "decode": self.decode,
                "rows_fastest": self.rows_fastest, "device_scale": self.device_scale,
                "skip_softmax_rows": self.skip_softmax_rows, "spec_mask": self.spec_mask,
                "nvfp4_out": self.nvfp4_out, "reg_widen": self.reg_widen}

    @property
    def nvfp4_out(self):
        """Whether the kernel writes the NVFP4 output (PrefillSm80Config::NVFP4_OUT): the paged
        kernels but the hd256 general ones (warp pairs)."""
        return self.paged and not (self.general and self.pair)

    @property
    def device_scale(self):
        # honours PrefillParams.scale_dev (PrefillSm80Config::DEVICE_SCALE)
        return self.general or self.block_m < 128

    @property
    def skip_softmax_rows(self):
        """The packed rows voting together in skip-softmax (PrefillParams.skip_softmax_factor): one
        warp's (its pair's) m16 row tiles; 0 where the kernel lacks it (PrefillSm80Config::
        SKIP_SOFTMAX: the general kernels and the decode tiles have it)."""
        return self.mq * MMA_ROWS if self.general or self.block_m < 128 else 0

    @property
    def spec_mask(self):
        # honours XQA's speculative-decoding mask (PrefillParams.spec_mask_words; the general kernels
        # every custom mask): the lean paged hd128 decode tiles over 16-bit or fp8 K/V
        # (PrefillSm80Config::SPEC_MASK)
        return self.general or (self.paged and self.block_m < 128 and self.head_dim == 128
                                and self.kv_dtype != "nvfp4")


class Sm90Roles:
    """What the sm_90a variants share with their kernels' Sm90Pipeline (sm90/pipeline.cuh): one
    producer warpgroup and `consumers` consumer warpgroups of 64 rows, tiles aligned to the
    1024-byte swizzle atom, 8-byte mbarriers."""
    WG_ROWS = 64
    WG_THREADS = 128
    ATOM_BYTES = 1024  # the 128-byte swizzle's 8-row atom: tiles aligned to it (slack for the base)
    BARRIER_BYTES = 8

    @property
    def block_m(self):
        return self.consumers * self.WG_ROWS

    @property
    def threads(self):
        return (self.consumers + 1) * self.WG_THREADS


@dataclass(frozen=True)
class HopperPrefillVariant(Sm90Roles):
    """A row of the sm_90a prefill family (prefill_sm90.cuh): one producer warpgroup and
    `consumers` warpgroups of 64 rows (BLOCK_M = 64 * consumers), a `stages`-deep K/V ring of
    block_n-key tiles. The registry prefers it on sm_90a wherever a row matches the call; what it
    does not cover (general options, fp8 K/V at head_dim 256, NVFP4 K/V, decode tiles) has no row
    and runs on sm80."""
    dtype: str
    head_dim: int
    block_n: int
    consumers: int
    stages: int
    # the two consumer warpgroups take turns issuing their GEMMs (consumer.cuh, Turns)
    pingpong: bool = True
    paged: bool = False  # K/V rows through a page table (the batch paged wrapper, block tables)
    # K/V tiles by TMA from host-encoded tensor maps (PrefillParams.k_tmap / v_tmap; producer_tma.cuh),
    # instead of the producer warpgroup's cp.async: the TMA twin of the row without it (HOPPER_KV_LOAD)
    tma: bool = False
    # skip-softmax compiled in (PrefillParams.skip_softmax_factor): the "_skip" twin of a shipped
    # row, run only for calls that ask for it (BatchEngine.apply_skip_softmax); the rows without it
    # keep every wgmma unserialised (consumer.cuh)
    skip: bool = False
    # the CTAs (at most one an SM) walk the logical grid, the ring running on across work items
    # (sm90/cta.cuh, PrefillSm90Config::PERSISTENT); the host launches them (launch.configure_grid).
    # None: the head dim's HOPPER_PERSISTENT entry.
    persistent: bool = None
    # "fp8": one-byte K/V (e4m3fn / e5m2, PrefillParams.kv_fp8) under the 16-bit Q, copied raw and
    # widened into the 16-bit ring by the producer (sm90/widen_producer.cuh; PrefillSm90Config::KV_FP8)
    kv_dtype: str = ""
    # the paged copies' dense twin (PrefillSm90Config::DENSE_KV): run instead of the row without it
    # where a kv head's page slots are back to back (routing.dense_twin); only by name
    dense: bool = False
    # the paged copies' page-16 twin in warp spans (PrefillSm90Config::SPAN_KV): run instead of the
    # row without it for pages of routing.SPAN_PAGE slots (routing.span_pays); only by name
    span: bool = False
    tune: bool = False
    impl: str = SM90
    archs: tuple = IMPL_ARCHS[SM90]

    def __post_init__(self):
        if self.persistent is None:
            object.__setattr__(self, "persistent", HOPPER_PERSISTENT[self.head_dim])

    @property
    def smem_bytes(self):
        # PrefillSm90Config::SMEM_BYTES: Q, STAGES K and V tiles, 1 + 4 * STAGES mbarriers, (TMA) the
        # tail tiles' STAGES mbarriers, (persistent) Q's empty mbarrier and the tile scheduler's index ring
        # (4 mbarriers, 2 int32), the alignment slack
        # (kv_dtype fp8: two raw K / V tile pairs of block_n rows of 128 bytes, sm90_raw_tile_bytes)
        tile = self.block_n * self.head_dim * HALF_BYTES
        tail = self.stages * self.BARRIER_BYTES if self.tma else 0  # a tail barrier a stage
        q_empty = self.BARRIER_BYTES + 4 * self.BARRIER_BYTES + 8 if self.persistent else 0
        raw = 4 * self.block_n * max(128, self.head_dim) if self.kv_dtype else 0
        return (self.block_m * self.head_dim * HALF_BYTES + 2 * self.stages * tile + raw
                + (1 + 4 * self.stages) * self.BARRIER_BYTES + tail + q_empty + self.ATOM_BYTES)

    def fits(self, arch):
        return self.smem_bytes <= SMEM_OPTIN[arch]

    @property
    def name(self):
        return (f"pfa_prefill_{self.impl}_{self.dtype}{'_kv' + self.kv_dtype if self.kv_dtype else ''}"
                f"_hd{self.head_dim}_m{self.block_m}n{self.block_n}"
                f"c{self.consumers}s{self.stages}{'_pp' if self.pingpong else ''}{'_paged' if self.paged else ''}"
                f"{'_ps' if self.persistent else ''}{'_tma' if self.tma else ''}{'_dense' if self.dense else ''}"
                f"{'_span' if self.span else ''}"
                f"{'_skip' if self.skip else ''}")

    def source(self):
        return (f'#include "pfa/attention/prefill_sm90.cuh"\n'
                f"PFA_DEFINE_PREFILL_SM90({self.name}, {DTYPES[self.dtype]}, {self.head_dim}, {self.block_n}, "
                f"{self.consumers}, {self.stages}, {'true' if self.pingpong else 'false'}, "
                f"{'true' if self.paged else 'false'}, {'true' if self.tma else 'false'}, "
                f"{'true' if self.skip else 'false'}, {'true' if self.persistent else 'false'}, "
                f"{'true' if self.kv_dtype else 'false'}, {'true' if self.dense else 'false'}, "
                f"{'true' if self.span else 'false'}, {self.smem_bytes})\n")

    def manifest(self):
        return {"family": "prefill", "impl": self.impl, "dtype": self.dtype, "kv_dtype": self.kv_dtype or self.dtype,
                "head_dim": self.head_dim, "block_m": self.block_m, "block_n": self.block_n,
                "warps": self.threads // WARP_THREADS, "threads": self.threads, "smem_bytes": self.smem_bytes,
                "ctas_per_sm": 1, "tune": self.tune, "general": False, "paged": self.paged, "decode": False,
                "rows_fastest": True, "device_scale": True, "tma": self.tma, "persistent": self.persistent,
                # PrefillSm90Config::STREAM_K (sm90/stream_k.cuh): single prefill's rows
                "stream_k": self.persistent and not self.paged and not self.kv_dtype,
                # one consumer warpgroup votes (consumer.cuh); a twin is only picked by name
                "skip_softmax_rows": self.WG_ROWS if self.skip else 0,
                "twin_of": (dataclasses.replace(self, skip=False, dense=False, span=False).name
                            if self.skip or self.dense or self.span else None),
                "dense_kv": self.dense,
                "span_kv": self.span,
                "nvfp4_out": self.paged and self.head_dim <= 128}  # PrefillSm90Config::NVFP4_OUT


@dataclass(frozen=True)
class HopperFp8PrefillVariant(Sm90Roles):
    """A row of the sm_90a fp8 prefill (prefill_sm90_fp8.cuh): e4m3 Q, K and V on e4m3 wgmma, into
    a bf16 / fp16 / e4m3 output (o_format counted from bf16). One producer warpgroup (Q, K, and V
    transposed for the P V wgmma) and `consumers` warpgroups of 64 rows; tiles of block_n keys (128;
    256 in the long-KV twins, HOPPER_FP8_LONG; 192 in the HOPPER_FP8_TUNE_TILES rows: a Vt row's
    keys in column blocks of 128, fp8_config.cuh).
    Contiguous and ragged K/V, or (paged) a paged cache by cp.async (owned-row copies,
    producer.cuh: 128-key tiles)."""
    head_dim: int
    consumers: int
    stages: int
    # S of one tile issued with P V of the previous (fp8_consumer.cuh OVERLAP); off at hd256, where
    # S, P and the 128-register O together spill and serialise the wgmmas
    overlap: bool = True
    pingpong: bool = True
    paged: bool = False  # K/V rows through a page table (PrefillSm90Fp8Config::PAGED)
    tune: bool = False
    impl: str = SM90
    archs: tuple = IMPL_ARCHS[SM90]
    # the CTAs walk the logical grid (sm90/cta.cuh); None: the head dim's HOPPER_FP8_PERSISTENT entry
    persistent: bool = None
    # K and raw V by TMA boxes (PrefillSm90Fp8Config::TMA): the TMA twin of the row
    # (routing.kv_load_pair), head_dim 128 / 256
    tma: bool = False
    # keys a tile (paged: 128, a producer lane owns each row)
    block_n: int = 128
    # the long-KV twin of the head dim's default row (HOPPER_FP8_LONG, routing.long_twin); with tma,
    # the long twin's TMA twin (paged: HOPPER_FP8_LONG_PAGED_TMA)
    long_kv: bool = False
    # the paged row's dense twin (HOPPER_FP8_DENSE_KV, PrefillSm90Fp8Config::DENSE_KV; routing.dense_twin)
    dense: bool = False

    dtype = "e4m3"  # Q, K and V: the manifest's dtype and kv_dtype
    RAW_V_TILES = 2  # PrefillSm90Fp8Config::RAW_TILES
    ROW_BYTES = 128  # one 128-byte swizzle row

    def __post_init__(self):
        if self.persistent is None:
            table = HOPPER_FP8_PERSISTENT_PAGED if self.paged else HOPPER_FP8_PERSISTENT
            object.__setattr__(self, "persistent", table[self.head_dim])
        if self.dense and not (self.paged and not self.tma):
            raise ValueError("a dense twin is one of a paged cp.async row")

    @property
    def smem_bytes(self):
        # PrefillSm90Fp8Config::SMEM_BYTES: Q, STAGES K and Vt tiles, the raw V tiles, 1 + 4 * STAGES
        # mbarriers, (persistent) Q's empty mbarrier and the tile scheduler's index ring (4 mbarriers,
        # 2 int32), the alignment slack; paged rows stage no page ids (one byte per element; Q / K /
        # raw V rows padded to the 128-byte swizzle row at head_dim 64: ROW_PAD)
        row = max(self.ROW_BYTES, self.head_dim * FP8_BYTES)
        vt = self.head_dim * -(-self.block_n * FP8_BYTES // self.ROW_BYTES) * self.ROW_BYTES  # whole column blocks
        walk = 5 * self.BARRIER_BYTES + 8 if self.persistent else 0
        # (TMA) the raw V buffers' mbarriers: full, and (paged: PrefillSm90Fp8Config::ISSUER_WARP) empty
        raw_bars = (2 if self.paged else 1) * self.RAW_V_TILES * self.BARRIER_BYTES if self.tma else 0
        return (self.block_m * row + (self.stages + self.RAW_V_TILES) * self.block_n * row + self.stages * vt
                + (1 + 4 * self.stages) * self.BARRIER_BYTES + raw_bars + walk + self.ATOM_BYTES)

    def fits(self, arch):
        return self.smem_bytes <= SMEM_OPTIN[arch]

    @property
    def name(self):
        return (f"pfa_prefill_{self.impl}_{self.dtype}_hd{self.head_dim}_m{self.block_m}n{self.block_n}"
                f"c{self.consumers}s{self.stages}{'_pp' if self.pingpong else ''}{'' if self.overlap else '_serial'}"
                f"{'_paged' if self.paged else ''}{'_ps' if self.persistent else ''}{'_tma' if self.tma else ''}"
                f"{'_dense' if self.dense else ''}")

    def source(self):
        return (f'#include "pfa/attention/prefill_sm90_fp8.cuh"\n'
                f"PFA_DEFINE_PREFILL_SM90_FP8({self.name}, {self.head_dim}, {self.block_n}, {self.consumers}, "
                f"{self.stages}, "
                f"{'true' if self.pingpong else 'false'}, {'true' if self.overlap else 'false'}, "
                f"{'true' if self.paged else 'false'}, {'true' if self.persistent else 'false'}, "
                f"{'true' if self.tma else 'false'}, {'true' if self.dense else 'false'}, {self.smem_bytes})\n")

    def manifest(self):
        return {"family": "prefill", "impl": self.impl, "dtype": self.dtype, "kv_dtype": self.dtype,
                "head_dim": self.head_dim, "block_m": self.block_m, "block_n": self.block_n,
                "warps": self.threads // WARP_THREADS, "threads": self.threads, "smem_bytes": self.smem_bytes,
                "ctas_per_sm": 1, "tune": self.tune, "general": False, "paged": self.paged, "decode": False,
                # device_scale: ConsumerSm90Fp8::row_scales starts from logit_scale(p) (scale_dev) and
                # the shared sm90 epilogue's output_scale(p) reads v_scale_dev
                "rows_fastest": True, "device_scale": True, "tma": self.tma, "out16": "bf16", "skip_softmax_rows": 0,
                "nvfp4_out": self.paged,  # Sm90Fp8OutCfg::NVFP4_OUT
                "persistent": self.persistent,
                # a twin is only picked by name (routing.long_twin finds it by twin_of, dense_twin by
                # the row's name + "_dense")
                "long_kv": self.long_kv, "dense_kv": self.dense,
                "twin_of": (self.default_row().name if self.long_kv
                            else dataclasses.replace(self, dense=False).name if self.dense else None)}

    def default_row(self):
        """The head dim's default cp.async row of this storage (contiguous, or paged): what a long-KV
        twin stands in for."""
        return HopperFp8PrefillVariant(self.head_dim, *HOPPER_FP8_TILES[self.head_dim],
                                       pingpong=HOPPER_FP8_PINGPONG[self.head_dim][self.paged], paged=self.paged)


# head_dim -> (consumers, stages, overlap) of the sm_90a fp8 prefill (hd64: three consumers, as the
# 16-bit family's hd64 row); the paged rows take the same tiles (hd256: the page ids fill what is
# left of the shared memory).
HOPPER_FP8_TILES = {64: (3, 2, True), 128: (2, 2, True), 256: (2, 2, False)}
# head_dim -> whether the consumers take turns issuing their wgmma (ping-pong: PINGPONG in
# fp8_consumer.cuh), contiguous / paged rows. Off where it measured faster without (H200, same-
# process A/B, NOTES.md session 43): hd128 contiguous +0.4-0.8% and paged +0.3% (TRT-LLM e4m3,
# single prefill 8k), the hd256 TMA row +0.9-1.0% at 8k; hd64 (three consumers) lost 0.6-1.0%
# without. The paged hd256 row was not measured and keeps the turns.
HOPPER_FP8_PINGPONG = {64: (True, True), 128: (False, False), 256: (False, True)}
# `make TUNE=1` alternatives (head_dim, block_n, overlap), contiguous / ragged with their TMA twins:
# longer tiles spread a tile's fixed work (the O rescale, row-max shuffles, barrier waits) over
# more keys, as FlashAttention-3's fp8 hd128 tile (224) and fmha_v2's e4m3 kernel (256) do. 192
# keeps S, P and O of the overlapped loop within the consumers' 232 registers (256, even serial,
# spills in the consumers). 192 against 128 (H200, NOTES.md session 21): +2-11% at 8k, -9 / -11%
# at 1k (a power-of-two length leaves a partial last tile), about even elsewhere.
HOPPER_FP8_TUNE_TILES = [(128, 192, True)]
# head_dim -> (block_n, overlap, ping-pong) of the e4m3 rows' long-KV twin (routing.long_twin; the
# manifest's long_kv, twin_of the default contiguous row): fmha_v2's e4m3 shape, 256-key serial
# steps, K/V by cp.async (no spill in the step loop, nvcc 13.0). Same lease against the default TMA
# row (H200, NOTES.md session 44): TRT-LLM contiguous e4m3 no mask 4k +5%, 16k +3-6%, 16 x 1k -2%;
# its TMA build (a `make TUNE=1` row) ran 4-10% behind it.
HOPPER_FP8_LONG = {128: (256, False, False)}
# Head dims whose paged row has a long-KV twin too: the same 256-key serial tile, its paged copies in
# two 128-key halves (fp8_producer.cuh PagedHalf), strided (any page slots: no fallback). Routed by
# routing.long_pays as the contiguous twin. TRT-LLM HND page 32 (H200, NOTES.md session 46): +1.6-2.2%
# over the dense twin at 4k / 16k without a mask and 16k causal (two runs, one lease).
HOPPER_FP8_LONG_PAGED = (128,)
# Head dims whose paged long-KV twin has a TMA twin (name + "_tma": 256-key tiles as boxes of a page,
# warp 0 issuing while three warps transpose, as the 128-key paged TMA twins); routing takes it
# where long_pays without a mask and its pages make boxes of 32+ rows (BatchEngine._twin), falling
# back to the copies twin over strides TMA cannot address. Against the 128-key paged TMA twin
# (TRT-LLM HND page 32, NOTES.md session 47): no mask 4k 0.99x, 16k 1.03x; causal 16k 0.97x.
HOPPER_FP8_LONG_PAGED_TMA = (128,)
# `make TUNE=1`: the 256-key serial steps with the consumers' turn around S only (fp8_config
# S_TURN_ONLY, as fmha_v2's), by cp.async and TMA (head_dim, block_n): 0.93-1.0x the long twin
HOPPER_FP8_TUNE_SERIAL_TURN = [(128, 256)]
# head_dim -> whether the fp8 rows are persistent (as HOPPER_PERSISTENT; hd256's serial consumers
# hold a 128-register O, as the 16-bit hd256 row that spilled with the walk's state).
HOPPER_FP8_PERSISTENT = {64: True, 128: True, 256: False}
# The paged fp8 rows: hd128 persistent, its producer at 56 registers (fp8_config.cuh; at 40 its copy
# loop spilled and long paged prefills lost 4-9%, NOTES.md sessions 20 and 30; at 56, against a CTA
# a block, TRT-LLM paged e4m3 1k / 4k / 16k causal +19 / +6 / +2%, session 32); hd64 (three
# consumers, a 32-register producer) stays a CTA a block.
HOPPER_FP8_PERSISTENT_PAGED = {64: False, 128: True, 256: False}
# Head dims whose paged fp8 rows have a dense twin (name + "_dense", as HOPPER_DENSE_KV's 16-bit
# ones): hd128, whose 56-register producer unrolls the copies. TRT-LLM HND page 32: +3.6-5.0% over
# the row before the unrolled copies, which alone gave +2.4% (NOTES.md, session 46).
HOPPER_FP8_DENSE_KV = (128,)
# The fp8 rows' TMA twins (K and raw V by boxes): head dims with whole 128-byte rows, and per
# storage the head dims whose twins ship (routing.kv_load_pair runs a shipped twin wherever TMA can
# address the call's K/V and routing.tma_pays; the others are tune rows, run only under
# PFA_SM90_KV_LOAD=tma). The paged twins: a box a page, page sizes that make whole boxes
# (tma.paged_box_rows; the others run the cp.async row); warp 0 issues, warps 1..3 transpose V
# (PrefillSm90Fp8Config::ISSUER_WARP). Measured against the copies (TRT-LLM e4m3 HND page 32,
# NOTES.md session 47): hd128 +9-10% over the dense twin, hd256 +11-20% over its paged row. (With
# one warp both issuing and transposing, hd128's had run 0.67-0.84x of the copies, session 46.)
HOPPER_FP8_TMA_HEAD_DIMS = (128, 256)
HOPPER_FP8_TMA_SHIPPED = {"ragged": (128, 256), "paged": (128, 256)}

# head_dim -> whether the sm_90a 16-bit rows are persistent (HopperPrefillVariant.persistent). hd256
# keeps a CTA a block: the walk's loop state made its consumers spill (O alone is 128 registers).
HOPPER_PERSISTENT = {64: True, 128: True, 256: False}

# head_dim -> (block_n, consumers, stages) of the sm_90a family: FlashAttention-3's tile shapes
# (hd64: three consumer warpgroups, 192 rows, +13% over two at 8k on an H100, NOTES.md; hd256:
# 80-key tiles, so Q and two K/V stages fit shared memory).
HOPPER_TILES = {64: (128, 3, 2), 128: (128, 2, 2), 256: (80, 2, 2)}
# Paged K/V: a third stage where shared memory holds it, the producer's page-table lookups have a
# tile more to land in.
HOPPER_TILES_PAGED = {64: (128, 2, 3), 128: (128, 2, 3), 256: (80, 2, 2)}
# One-byte K/V under a 16-bit Q (HopperPrefillVariant.kv_dtype "fp8"), by storage: head_dim ->
# (block_n, consumers, stages), the 16-bit rows' tiles where shared memory also holds the two raw
# tile pairs (hd128 paged: two stages, not three); hd256 has no room for them and runs on sm80.
HOPPER_TILES_KV_FP8 = {"ragged": {64: (128, 3, 2), 128: (128, 2, 2)},
                       "paged": {64: (128, 2, 3), 128: (128, 2, 2)}}
# Second contiguous / ragged row tiles, by head dim (block_n, consumers, stages), with their TMA
# twins: picked for single prefill where the default row's blocks fill the SMs' last round badly
# (routing.row_tile_block_m). hd64: 128 rows beside the default 192 (32 heads x 1024 tokens make
# 192 blocks of 192 rows, 0.73 of two rounds on 132 SMs; 256 of 128 rows, 0.97).
HOPPER_TILES_ALT = {64: (128, 2, 2)}
# Head dims whose paged rows have a dense twin (name + "_dense", PrefillSm90Config::DENSE_KV): the
# copies of a cache whose kv head's page slots are back to back (HND, TRT-LLM's default layout) step
# by a constant. Not hd256, whose 40-register producer spilled with the dense runs (NOTES.md, session 32).
HOPPER_DENSE_KV = (64, 128)
# Head dims whose paged rows have a page-16 twin in warp spans (name + "_span",
# PrefillSm90Config::SPAN_KV): hd128, whose rows interleave across the warpgroup and so cross a
# page every two copies at page 16 (hd64's rows copy in spans always: PrefillSm90Config::SPANS).
HOPPER_SPAN_KV = (128,)
# How the sm90 family loads K/V, per KV storage: "cpasync" (the producer warpgroup's cp.async,
# producer.cuh) or "tma" (one producer warp issuing boxes from host-encoded tensor maps,
# producer_tma.cuh; paged: pages of 16+ rows, smaller ones stay on cp.async). Each default row above
# has a TMA twin of the same tile (name + "_tma"): a shipped row where the storage says "tma" (the
# routing then prefers it: pyflashattn/_engine/routing.kv_load_pair), else a tune row (`make TUNE=1`,
# run by PFA_SM90_KV_LOAD=tma for A/B runs). Flip an entry to ship TMA for that storage. Paged ships
# cp.async: since the rows became persistent, the owned-row copies beat the TMA twin at every page
# size measured (NOTES.md, session 19: TRT-LLM paged HND page 32, 1k-16k causal, 1.03-1.23x;
# session 32, 16 x 512-4096 NHD: the twin 0.75-0.79x at page 16, 0.88-0.89x at 32, 0.94-0.98x at 64).
HOPPER_KV_LOAD = {"ragged": "tma", "paged": "cpasync"}
# Alternatives for `make TUNE=1`, each with its TMA twin: FA3's non-causal hd128 tile (176 keys; Q
# from shared memory, ConsumerSm90::Q_REGS), a third K/V stage at hd128, two consumers (128 rows) at
# hd64. 176 and 144 keys (Q in registers) ran 0.83-0.99x the 128-key TMA row at 4k-16k (NOTES.md,
# session 32).
HOPPER_TUNE_TILES = [(128, (176, 2, 2)), (128, (128, 2, 3)), (64, (128, 2, 3))]


MERGE_THREADS = 128
MERGE_ROWS_PER_BLOCK = 4  # (row, head) pairs per block: one warp each
PACKBITS_THREADS = 256
PAGE_THREADS = 256


@dataclass(frozen=True)
class MergeVariant:
    dtype: str
    # One CTA per (row, head), its warps sharing the row's chunks (merge.cuh merge_cta): for few
    # rows over many chunks, where one warp per (row, head) leaves SMs idle and walks every chunk.
    cta_per_row: bool = False
    tune: bool = False
    impl: str = PORTABLE
    archs: tuple = ARCHS_DEFAULT

    @property
    def name(self):
        return f"pfa_merge{'_cta' if self.cta_per_row else ''}_{self.dtype}"

    def source(self):
        macro = "PFA_DEFINE_MERGE_CTA" if self.cta_per_row else "PFA_DEFINE_MERGE"
        return f'#include "pfa/attention/merge.cuh"\n{macro}({self.name}, {DTYPES[self.dtype]})\n'

    def manifest(self):
        # programmatic_launch: it follows the attention kernel on the stream and waits for it in
        # griddepcontrol.wait before reading a partial (sm_90+; launched plainly elsewhere).
        return {"family": "merge", "impl": self.impl, "dtype": self.dtype, "warps": MERGE_THREADS // WARP_THREADS,
                "threads": MERGE_THREADS, "smem_bytes": 0,
                "rows_per_block": 1 if self.cta_per_row else MERGE_ROWS_PER_BLOCK,
                "cta_per_row": self.cta_per_row, "programmatic_launch": True, "tune": self.tune}


CASCADE_THREADS = 128  # CascadeMerge::WARPS * 32: one warp per (row, head)
# cascade merges take fp32 values too (the LSEs are float32 whatever the values are)
CASCADE_DTYPES = {**DTYPES, "f32": "float"}


@dataclass(frozen=True)
class MiscVariant:
    """A portable helper kernel of pfa/misc/<family>.cuh, defined by PFA_DEFINE_<FAMILY>(name[, T]):
    packbits (mask packing), page (flashinfer.page: append K/V into pages, batch indices and
    positions, seq_lens; dtype-agnostic, it copies elem_bytes-wide elements), cascade
    (merge_state(s): one row per value dtype)."""
    family: str
    threads: int
    dtype: str = ""  # a key of CASCADE_DTYPES for the kernels templated on a value type; "" = none
    tune: bool = False
    impl: str = PORTABLE
    archs: tuple = ARCHS_DEFAULT

    @property
    def name(self):
        return f"pfa_{self.family}{'_' + self.dtype if self.dtype else ''}"

    def source(self):
        args = f"{self.name}, {CASCADE_DTYPES[self.dtype]}" if self.dtype else self.name
        return f'#include "pfa/misc/{self.family}.cuh"\nPFA_DEFINE_{self.family.upper()}({args})\n'

    def manifest(self):
        return {"family": self.family, "impl": self.impl, **({"dtype": self.dtype} if self.dtype else {}),
                "warps": self.threads // WARP_THREADS, "threads": self.threads, "smem_bytes": 0, "tune": self.tune}


# head_dim -> (warps, mq, block_n, q_in_regs, stages, min_blocks, lazy_rescale[, pair]): the shipped
# default per head dim. lazy_rescale applies to the lean kernels only (it made the general ones spill
# more); it removed hd128's spills but slowed hd64 (NOTES.md). hd256 runs warp pairs (8 warps, 128
# rows, 2 row tiles per pair), which measured faster than 8 single-row-tile warps.
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
# three, which streamed paged K/V faster; hd64 / hd256 keep their key counts, where the
# alternatives were no better overall (NOTES.md).
DECODE_TILES = {
    64: (1, 1, 64, False, 2, 1, True),
    128: (1, 1, 32, False, 2, 1, True),
    256: (1, 1, 32, False, 2, 1, True),
}
# The decode tile over an fp8 K/V cache. The one-warp tiles (hd64, hd128) widen K/V fragments in
# registers and run fp16 MMAs (reg_widen, sm80/fp8_frags.cuh), with the registers capped at 128
# (hd64: fp8 over bf16 paged 1.66 / 1.52 / 1.52x at B=64 / 16 / 128, uncapped 1.49 / 1.57 /
# 1.23x, H200, bench decode). hd128: 16-key tiles with the
# registers capped at 128 (min blocks 16: four warps a scheduler, 13 CTAs per SM by shared memory)
# streamed B=64 x 4096 1.02x and B=16 x 8192 1.05x faster than uncapped 32-key tiles on an H200
# (B=1 x 32768: 1.00x); uncapped 16-key tiles (8 CTAs per SM, register-bound) lost 0.94-0.98x at
# B=16-64 and 64-key tiles lost everywhere. hd256 runs a warp pair (2 warps, the same 16 rows:
# PAIR; S over half the keys, O over half the dims a warp), each widening its own halves in
# registers (1.7-2.8x bf16 on an H200, was 1.1-1.5x with a shared widened copy); the pair is not
# an option at hd64 (see PrefillSm80's PAIR assert). NOTES.md has the measurements.
DECODE_TILES_FP8 = {
    64: (1, 1, 32, False, 2, 16, True),
    128: (1, 1, 16, False, 2, 16, True),
    256: (2, 1, 32, False, 2, 1, True, True),
}
# The wide decode tiles: rows -> head_dim -> tile, 32 or 64 packed rows on 2 or 4 warps with 16 rows
# each, sharing every K/V tile and its page-table lookups (over an fp8 cache each warp widens its
# own fragments in registers, reg_widen; over NVFP4 they share one widened copy); the 16-row
# tiles' key counts per K/V storage. For requests of 17-64 packed rows (8-token speculative
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
# The decode tiles over an NVFP4 cache; paged only (NVFP4 caches are paged: the scales share the
# page table). hd64 / hd128 widen fragments in registers (reg_widen, sm80/nvfp4_frags.cuh) with the
# registers capped at 128 (min blocks 16; ptxas: no spills), as the hd128 fp8 tile; hd256 keeps the
# warp pair and its shared widening. H200 (ab_decode, hd128): 32-key tiles capped at 168 registers
# 1.06x at B=64 x 4096 and 0.98x at B=1 x 32768, uncapped 16-key tiles 0.92x / 1.02x (TUNE rows).
DECODE_TILES_NVFP4 = {
    64: (1, 1, 32, False, 2, 16, True),
    128: (1, 1, 16, False, 2, 16, True),
    256: (2, 1, 32, False, 2, 1, True, True),
}
WIDE_DECODE_TILES_NVFP4 = WIDE_DECODE_TILES_FP8
# Alternatives the tuning sweep compares against the defaults.
PREFILL_TUNE_TILES = {
    64: [(4, 2, 64, True, 3, 2), (8, 2, 64, True, 2, 1)],
    128: [(8, 1, 64, True, 2, 1), (4, 2, 48, False, 2, 2), (4, 2, 64, False, 1, 2), (4, 2, 32, False, 3, 2)],
    # (4, 1, 64, False, 1, 2) is FA2's hd256 shape: 64-row CTAs, two per SM, one K and one V buffer.
    256: [(4, 1, 64, False, 1, 2, True), (8, 1, 64, False, 2, 1), (8, 1, 32, False, 3, 1),
          (8, 2, 64, False, 2, 1, False, True)],
}

# Alternative paged decode tiles for `make TUNE=1` (kv_dtype, head_dim) -> tiles, compared with the
# defaults by build_tools/ab_decode.py --switch tile: a third K/V stage (two tiles in flight a CTA,
# four CTAs per SM instead of five) for the bandwidth-bound 16-bit stream; over fp8 (widened in
# registers), 32- and 64-key tiles (more bytes in flight a warp), 32 keys on a third stage or with
# registers capped for 12 CTAs per SM.
DECODE_TUNE_TILES = {
    ("", 128): [(1, 1, 32, False, 3, 1, True), (1, 1, 16, False, 2, 16, True)],
    ("fp8", 128): [(1, 1, 32, False, 2, 1, True), (1, 1, 64, False, 2, 1, True), (1, 1, 32, False, 3, 1, True),
                   (1, 1, 32, False, 2, 12, True)],
    ("fp8", 64): [(1, 1, 64, False, 2, 1, True)],
    ("nvfp4", 128): [(1, 1, 32, False, 2, 12, True), (1, 1, 16, False, 2, 1, True)],
}


def _lean_kernel(v):
    """The 128-row lean kernel over the same dtype, head dim, K/V storage and paging as row v."""
    return PrefillVariant(v.dtype, v.head_dim, *PREFILL_TILES[v.head_dim], paged=v.paged, kv_dtype=v.kv_dtype,
                          impl=v.impl)


def single_prefill_routes(v):
    """Whether single prefill can launch decode tile v: it runs short requests on the 16-row tile
    over contiguous 16-bit K/V (prefill._decode_launcher), without the 128-row kernel."""
    return v.block_m == MMA_ROWS and not v.paged and not v.kv_dtype


def unbuilt_reason(v, arch):
    """Why row v is not built for arch, an arch of its impl (None: it is built there)."""
    if arch not in IMPL_ARCHS[v.impl]:
        return f"the {v.impl} family is built for {', '.join(IMPL_ARCHS[v.impl])} only"
    if isinstance(v, (HopperPrefillVariant, HopperFp8PrefillVariant)):
        return None if v.fits(arch) else f"needs {v.smem_bytes} bytes of shared memory per block"
    if not isinstance(v, PrefillVariant):
        return None
    if not v.fits(arch):
        return f"needs {v.smem_bytes} bytes of shared memory per block; {arch} allows {SMEM_OPTIN[arch]}"
    # The batch wrappers resolve the 128-row kernel before any decode tile (_batch_prefill.
    # _resolve_config), so where that kernel cannot launch, only single prefill reaches a decode tile.
    # (A decode-only K/V storage has no 128-row kernel: its decode tiles are all the wrappers use.)
    lean = _lean_kernel(v)
    decode_only = v.kv_dtype in DECODE_ONLY_KV
    if v.decode and not decode_only and not lean.fits(arch) and not single_prefill_routes(v):
        return (f"unroutable: the batch wrappers need {lean.name} ({lean.smem_bytes} bytes of shared "
                f"memory) first, which {arch} cannot launch")
    return None


def _placed(v):
    """Row v with archs = the archs of its impl where it can run and be routed."""
    return dataclasses.replace(v, archs=tuple(a for a in IMPL_ARCHS[v.impl] if unbuilt_reason(v, a) is None))


def variants(tune=False):
    """Every row built for at least one arch, each with its archs."""
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
                out += [PrefillVariant(dtype, hd, *t, paged=True, kv_dtype=kv, decode=True, tune=True)
                        for kv in ("", "fp8", "nvfp4") for t in DECODE_TUNE_TILES.get((kv, hd), ())]
        out += [HopperPrefillVariant(dtype, hd, *tile) for hd, tile in HOPPER_TILES.items()]
        out += [HopperPrefillVariant(dtype, hd, *tile, paged=True) for hd, tile in HOPPER_TILES_PAGED.items()]
        out += [HopperPrefillVariant(dtype, hd, *tile, paged=paged, skip=True)
                for paged, tiles in ((False, HOPPER_TILES), (True, HOPPER_TILES_PAGED)) for hd, tile in tiles.items()]
        out += [HopperPrefillVariant(dtype, hd, *tile, paged=True, dense=True)
                for hd, tile in HOPPER_TILES_PAGED.items() if hd in HOPPER_DENSE_KV]
        out += [HopperPrefillVariant(dtype, hd, *tile, paged=True, span=True)
                for hd, tile in HOPPER_TILES_PAGED.items() if hd in HOPPER_SPAN_KV]
        for storage, tiles in (("ragged", HOPPER_TILES), ("paged", HOPPER_TILES_PAGED)):
            twin_tune = HOPPER_KV_LOAD[storage] != "tma"
            if tune or not twin_tune:
                out += [HopperPrefillVariant(dtype, hd, *tile, paged=storage == "paged", tma=True, tune=twin_tune)
                        for hd, tile in tiles.items()]
        out += [HopperPrefillVariant(dtype, hd, *tile, paged=storage == "paged", kv_dtype="fp8", skip=skip)
                for storage, tiles in HOPPER_TILES_KV_FP8.items() for hd, tile in tiles.items()
                for skip in (False, True)]
        # after the default rows: the registry picks these only when asked for their block_m (their
        # skip twins keep every shipped row's, though only single prefill, without skip-softmax,
        # asks for them)
        out += [HopperPrefillVariant(dtype, hd, *tile, skip=skip) for hd, tile in HOPPER_TILES_ALT.items()
                for skip in (False, True)]
        if tune or HOPPER_KV_LOAD["ragged"] == "tma":
            out += [HopperPrefillVariant(dtype, hd, *tile, tma=True, tune=HOPPER_KV_LOAD["ragged"] != "tma")
                    for hd, tile in HOPPER_TILES_ALT.items()]
        if tune:
            out += [HopperPrefillVariant(dtype, hd, *tile, pingpong=False, tune=True)
                    for hd, tile in HOPPER_TILES.items()]
            out += [HopperPrefillVariant(dtype, hd, *tile, tma=tma, tune=True) for hd, tile in HOPPER_TUNE_TILES
                    for tma in (False, True)]
        out += [MergeVariant(dtype), MergeVariant(dtype, cta_per_row=True)]
    out += [HopperFp8PrefillVariant(hd, *tile, pingpong=HOPPER_FP8_PINGPONG[hd][paged], paged=paged)
            for paged in (False, True) for hd, tile in HOPPER_FP8_TILES.items()]
    out += [HopperFp8PrefillVariant(hd, *HOPPER_FP8_TILES[hd], pingpong=HOPPER_FP8_PINGPONG[hd][storage == "paged"],
                                    paged=storage == "paged", tma=True, tune=hd not in shipped)
            for storage, shipped in HOPPER_FP8_TMA_SHIPPED.items()
            for hd in HOPPER_FP8_TMA_HEAD_DIMS if tune or hd in shipped]
    out += [HopperFp8PrefillVariant(hd, *HOPPER_FP8_TILES[hd][:2], overlap, pp, block_n=bn, long_kv=True, paged=paged)
            for hd, (bn, overlap, pp) in HOPPER_FP8_LONG.items()
            for paged in (False, True) if not paged or hd in HOPPER_FP8_LONG_PAGED]
    out += [HopperFp8PrefillVariant(hd, *HOPPER_FP8_TILES[hd][:2], overlap, pp, block_n=bn, long_kv=True, paged=True,
                                    tma=True) for hd, (bn, overlap, pp) in HOPPER_FP8_LONG.items()
            if hd in HOPPER_FP8_LONG_PAGED and hd in HOPPER_FP8_LONG_PAGED_TMA]
    out += [HopperFp8PrefillVariant(hd, *HOPPER_FP8_TILES[hd], pingpong=HOPPER_FP8_PINGPONG[hd][True], paged=True,
                                    dense=True) for hd in HOPPER_FP8_DENSE_KV]
    if tune:
        out += [HopperFp8PrefillVariant(hd, *HOPPER_FP8_TILES[hd][:2], overlap, HOPPER_FP8_PINGPONG[hd][False], tma=tma,
                                        tune=True, block_n=bn)
                for hd, bn, overlap in HOPPER_FP8_TUNE_TILES for tma in (False, True)]
        out += [HopperFp8PrefillVariant(hd, *HOPPER_FP8_TILES[hd][:2], False, True, tma=tma, tune=True, block_n=bn)
                for hd, bn in HOPPER_FP8_TUNE_SERIAL_TURN for tma in (False, True)]
        out += [HopperFp8PrefillVariant(hd, *HOPPER_FP8_TILES[hd][:2], overlap, pp, tma=True, tune=True, block_n=bn)
                for hd, (bn, overlap, pp) in HOPPER_FP8_LONG.items()]
    out += nvfp4_variants()
    out.append(MiscVariant("packbits", PACKBITS_THREADS))
    out += [MiscVariant("cascade", CASCADE_THREADS, dtype) for dtype in CASCADE_DTYPES]
    out.append(MiscVariant("page", PAGE_THREADS))
    return [p for p in map(_placed, out) if p.archs]


def nvfp4_variants():
    """The NVFP4 rows: paged decode tiles only (DECODE_ONLY_KV), 16 rows and (hd64 / hd128) 32, 64."""
    out = []
    for dtype in DTYPES:
        for hd, tile in DECODE_TILES_NVFP4.items():
            out.append(PrefillVariant(dtype, hd, *tile, paged=True, kv_dtype="nvfp4", decode=True))
            out += [PrefillVariant(dtype, hd, *wide[hd], paged=True, kv_dtype="nvfp4", decode=True)
                    for wide in WIDE_DECODE_TILES_NVFP4.values() if hd in wide]
    return out


def kernels_by_arch(tune=False):
    """arch -> the names of the rows built for it, in table order."""
    vs = variants(tune=tune)
    return {a: [v.name for v in vs if a in v.archs] for a in ARCHS_DEFAULT}
