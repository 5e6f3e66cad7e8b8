"""Routing: which kernel (family, tile) runs a problem on this device, and how many CTAs per SM.

Everything comes from the manifest's rows (what was built, with its tile rows, shared memory
and designed CTAs per SM) and from the device's own properties at run time: an sm_80 cubin also
runs on 8.6 / 8.9, which have less shared memory per SM, so the CTAs per SM are recomputed here.
The registry picks the implementation (kernel family) per arch by preference.
"""
from __future__ import annotations

import os

import numpy as np

from .._runtime import cuda as _cuda, registry as _registry
from . import switches, tma

HEAD_DIMS = (64, 128, 256)
SMEM_RESERVED_PER_CTA = 1024  # the driver's shared memory per resident CTA
# head_dim -> the most packed rows (qo_len * num_qo_heads / num_kv_heads) a request may have to run
# as several row tiles of a decode tile instead of on the 128-row kernel. Requests that fit one
# decode tile always go there (decode_tile_rows). Beyond these bounds the 128-row kernel was
# faster on an H100 (NOTES.md, session 11): at hd256 already for 2 x 16 rows.
DECODE_MAX_ROWS = {64: 32, 128: 32, 256: 16}
# Decode tiles that widen every K/V tile into shared memory (NVFP4's wide and warp-pair tiles)
# are latency-bound, and one wave of equal chunks streamed slower than twice as many half chunks:
# their split-KV budget is two waves. The tiles that widen fragments in registers (the manifest's
# reg_widen: every fp8 decode tile, NVFP4's 16-row ones) take one wave, as 16-bit K/V do
# (1.00-1.04x over two on an H200, NOTES.md).
FP8_DECODE_WAVES = 2
# A tuning switch (read when a plan resolves its route): the decode tiles' split-KV budget in
# waves of CTAs, for every K/V storage (a positive number; unset: 1, FP8_DECODE_WAVES widened).
DECODE_WAVES_ENV = "PYFLASHATTN_DECODE_SPLIT_WAVES"


def decode_waves(widened: bool) -> float:
    """The decode tiles' split-KV budget in waves (DECODE_WAVES_ENV, else the measured default)."""
    forced = os.environ.get(DECODE_WAVES_ENV)
    if forced:
        try:
            waves = float(forced)
        except ValueError:
            waves = 0.0
        if not waves > 0:
            raise ValueError(f"{DECODE_WAVES_ENV} must be a positive number, got {forced!r}")
        return waves
    return FP8_DECODE_WAVES if widened else 1
# K/V storages built only as paged decode tiles (build_tools/variants.py DECODE_ONLY_KV): every
# request runs on them, one longer than their rows as several row tiles; lean options only.
DECODE_ONLY_KV = frozenset(("nvfp4",))


# How the sm90 family loads K/V (build_tools/variants.py HOPPER_KV_LOAD): a row-tile kernel's TMA
# twin (its name + TMA_SUFFIX: the same tile, K/V by TMA boxes) runs instead of it wherever the twin
# is a shipped row and the call's K/V allow TMA (tma_fits, tma.addressable). PFA_SM90_KV_LOAD
# overrides the table for A/B runs and tests: "tma" runs the twins even as tune rows (`make
# TUNE=1`), "cpasync" never runs them.
KV_LOAD_ENV = "PFA_SM90_KV_LOAD"
KV_LOADS = ("tma", "cpasync")
TMA_SUFFIX = "_tma"


def kv_load_override():
    """PFA_SM90_KV_LOAD: "tma", "cpasync" or None (unset: the variant table decides)."""
    return switches.choice(KV_LOAD_ENV, KV_LOADS, lower=True) or None


def _built_row(dev: int, name: str = None, pick=None):
    """The manifest row built for this device's arch named `name` (or, `pick` given, the first that
    pick(row) accepts), or None."""
    archs = _registry.arch_candidates(_cuda.properties(dev)["cc"])
    return next((r for r in _registry.manifest()["kernels"]
                 if r["arch"] in archs and (pick(r) if pick is not None else r["name"] == name)), None)


def _twin_launcher(named, row, meta, keys: tuple, what: str):
    """The launcher of twin `row` of the row-tile kernel of meta, None without a row; a twin whose
    meta differs from its row's at `keys` (what they share) is a build error."""
    if row is None:
        return None
    twin = named(row["name"])
    if tuple(twin.meta[k] for k in keys) != tuple(meta[k] for k in keys):
        raise RuntimeError(f"{row['name']} is no {what} of {meta['name']}: their {', '.join(keys)} differ")
    return twin


def kv_load_pair(dev: int, la, named):
    """(the cp.async kernel, its TMA twin or None) for row-tile launcher la; named(name) makes a
    launcher by kernel name. A TMA kernel forced by name (registry.force) is its own twin, its
    cp.async sibling the fallback."""
    meta = la.meta
    if meta.get("tma"):
        base = _built_row(dev, base_kernel_name(meta))
        if base is None:
            raise RuntimeError(f"{meta['name']} loads K/V by TMA; its cp.async sibling (for K/V that TMA cannot "
                               "address) is not built")
        return named(base["name"]), la
    if meta.get("impl") != "sm90":
        return la, None
    want = kv_load_override()
    row = _built_row(dev, meta["name"] + TMA_SUFFIX)
    if want == "tma" and row is None and not any(r.get("tma") for r in _registry.manifest()["kernels"]):
        raise RuntimeError(f"{KV_LOAD_ENV}=tma, but no TMA kernel is among the built cubins: build the TMA "
                           "rows with `make TUNE=1` (or ship them: variants.HOPPER_KV_LOAD)")
    # (a row without a twin, e.g. an fp8 or tune tile, keeps its cp.async load)
    if row is None or want == "cpasync" or (row.get("tune") and want != "tma"):
        return la, None
    return la, _twin_launcher(named, row, meta, ("block_m", "block_n", "ctas_per_sm"), "TMA twin")


# The paged rows' dense twins (build_tools/variants.py HOPPER_DENSE_KV: name + DENSE_SUFFIX, the
# same tile): a plan whose cache keeps a kv head's page slots back to back (HND, or NHD with one kv
# head) runs the twin, whose copies step by a constant; a run() whose cache strides are not dense
# falls back to the row itself (BatchEngine.kv_fallback). PFA_SM90_DENSE_KV=0 never runs the twins
# (A/B runs); 1 or unset runs them where dense_pays.
DENSE_SUFFIX = "_dense"
DENSE_ENV = "PFA_SM90_DENSE_KV"


def dense_twin(dev: int, la, named):
    """The dense twin of paged row-tile launcher la (named(name) makes a launcher by kernel name), or
    None: not built, not a paged cp.async row, or switched off by PFA_SM90_DENSE_KV=0."""
    return _paged_twin(dev, la, named, DENSE_SUFFIX, DENSE_ENV)


# The hd128 paged rows' page-16 twins (build_tools/variants.py HOPPER_SPAN_KV: name + SPAN_SUFFIX,
# the same tile): their copies go in warp spans, two page runs a thread a tile at page 16 against
# eight (PrefillSm90Config::SPAN_KV); any strides, so no fallback. A plan with pages of SPAN_PAGE
# slots runs the twin; PFA_SM90_SPAN_KV=0 never (A/B runs).
SPAN_SUFFIX = "_span"
SPAN_ENV = "PFA_SM90_SPAN_KV"
# Same-process A/B of the spans against the interleaved rows, hd128 (NOTES.md, session 40, H200 and
# H100): page 16 +0.8-1.3% (NHD and HND), pages 8 / 32 / 64 -2 to -6%.
SPAN_PAGE = 16


def span_twin(dev: int, la, named):
    """The page-16 span twin of paged row-tile launcher la, or None: not built, not a paged cp.async
    row, or switched off by PFA_SM90_SPAN_KV=0."""
    return _paged_twin(dev, la, named, SPAN_SUFFIX, SPAN_ENV)


def span_pays(page_size: int) -> bool:
    """Whether a paged plan takes the span twin: pages of SPAN_PAGE slots."""
    return page_size == SPAN_PAGE


def _paged_twin(dev: int, la, named, suffix: str, env: str):
    """The twin (name + suffix, the same tile) of paged cp.async row-tile launcher la, or None where
    it is not built, la is no such row, or the switch env is "0"."""
    meta = la.meta
    want = switches.choice(env, ("0", "1"))
    if meta.get("impl") != "sm90" or not meta.get("paged") or meta.get("tma") or want == "0":
        return None
    return _twin_launcher(named, _built_row(dev, meta["name"] + suffix), meta, ("block_m", "block_n"), "twin")


# Pages from which the dense twin pays: same-process A/B against its row (NOTES.md, session 36,
# H200): page 32 +1.2-2.9% (HND, hd64 and hd128), page 64 +0.4%, page 16 -1.0 to -1.4%.
DENSE_MIN_PAGE = 32


def dense_pays(kv_layout: str, num_kv_heads: int, page_size: int) -> bool:
    """Whether a paged plan takes the dense twin: a layout whose contiguous cache keeps a kv head's
    page slots back to back (HND; NHD only with one kv head), pages of DENSE_MIN_PAGE slots or more."""
    return (kv_layout == "HND" or num_kv_heads == 1) and page_size >= DENSE_MIN_PAGE


# The e4m3 rows' long-KV twins (build_tools/variants.py HOPPER_FP8_LONG: their own tile, 256-key
# serial steps, the manifest's long_kv and twin_of = the default row of their storage: contiguous,
# or paged, HOPPER_FP8_LONG_PAGED): a plan whose requests are long runs one instead of the row and
# its TMA or dense twin. Same lease against the default TMA row (NOTES.md,
# session 44, H200, TRT-LLM contiguous e4m3): no mask 4k +5%, 16k +3-6%, 16 x 1k -2%; causal 2k -5%,
# 4k -1 to -2.5%, 16k +3-5%. Never for a frozen kernel: graph-mode plans, and batch-invariant ones
# (fixed_split_size, or disable_split_kv over host-planned lengths), where a request's kernel must
# not depend on its batch. TRT-LLM's device-metadata plans never split and take it by their shape
# key's max lengths (BatchEngine.plan).
# PFA_SM90_LONG_KV=0 never runs the twins, 1 runs them wherever built (A/B runs and tests).
LONG_ENV = "PFA_SM90_LONG_KV"
LONG_MIN_KV = 4096
LONG_MIN_KV_CAUSAL = 16384


def long_twin(dev: int, la, named):
    """The long-KV twin of row-tile launcher la (contiguous or paged; named(name) makes a launcher by
    kernel name), or None: none built for it, switched off by PFA_SM90_LONG_KV=0, or la forced by
    name (registry.force: a tuning sweep times the row it names)."""
    meta = la.meta
    if meta.get("impl") != "sm90" or meta.get("tma") or \
            switches.choice(LONG_ENV, ("0", "1")) == "0" or _registry.forced("prefill") == meta["name"]:
        return None
    row = _built_row(dev, pick=lambda r: r.get("long_kv") and not r.get("tma") and r.get("twin_of") == meta["name"])
    return _twin_launcher(named, row, meta, ("block_m", "ctas_per_sm"), "long-KV twin")


def long_pays(kv_lens, causal: bool, frozen: bool) -> bool:
    """Whether a plan with a long-KV twin runs it: PFA_SM90_LONG_KV=1 always, 0 never; else not
    for a frozen kernel, and where the requests' mean KV length reaches LONG_MIN_KV (causal:
    LONG_MIN_KV_CAUSAL)."""
    want = switches.choice(LONG_ENV, ("0", "1"))
    if want:
        return want == "1"
    return not frozen and len(kv_lens) > 0 and \
        float(np.mean(kv_lens)) >= (LONG_MIN_KV_CAUSAL if causal else LONG_MIN_KV)


def base_kernel_name(meta) -> str:
    """A twin's (TMA, dense or span) row name without its suffix: the kernel its skip twin is named after."""
    name = meta["name"]
    for suffix, flag in ((TMA_SUFFIX, "tma"), (DENSE_SUFFIX, "dense_kv"), (SPAN_SUFFIX, "span_kv")):
        if meta.get(flag) and name.endswith(suffix):
            return name[:-len(suffix)]
    return name


def tma_fits(paged: bool, page_size: int, block_n: int, total_kv: int) -> bool:
    """Whether a plan's K/V geometry has TMA boxes: pages of tma.paged_box_rows, ragged rows
    within the 32-bit coordinates."""
    return tma.paged_box_rows(page_size, block_n) > 0 if paged else total_kv < tma.ROW_EXTENT


# TMA K/V pays on long requests only. Measured when each request's last tile was copied by one
# warp with zero-filled cp.async, so that a batch of one-tile requests ran mostly that path (H200,
# 32/8 heads, hd128, page 16): 4 requests of 32 keys 25.1 us by TMA against 11.0 by cp.async.
# That tile now goes by TMA too where its boxes stay inside K / V (producer_tma.cuh).
TMA_MIN_TILES = 8
# Paged TMA pays from boxes of PAGED_TMA_MIN_BOX_ROWS rows: a page of 16 rows is a box of 16 rows,
# 32 boxes a 128-key tile, and the TMA unit, not memory, then limits the kernel. (Measured against
# the owned-row copies before those became persistent and ran in page runs; since, the paged twins
# are tune rows, variants.HOPPER_KV_LOAD, and ran 0.75-0.98x the copies at pages 16-64: NOTES.md,
# session 32. The rule applies where a TUNE build and PFA_SM90_KV_LOAD=tma run them.)
PAGED_TMA_MIN_BOX_ROWS = 32


def tma_pays(paged: bool, page_size: int, kv_lens, block_n: int, frozen: bool) -> bool:
    """Whether a plan whose K/V TMA can address (tma_fits) runs the TMA twin: PFA_SM90_KV_LOAD=tma
    always; paged, boxes of at least PAGED_TMA_MIN_BOX_ROWS rows; then a frozen kernel (graph-mode
    plans) or requests of TMA_MIN_TILES key tiles on average."""
    if kv_load_override() == "tma":
        return True
    if paged and tma.paged_box_rows(page_size, block_n) < PAGED_TMA_MIN_BOX_ROWS:
        return False
    return frozen or (len(kv_lens) > 0 and float(kv_lens.mean()) >= TMA_MIN_TILES * block_n)


# L2 sections of an sm90 launch's logical grid (PrefillParams.grid_section, work.cuh LogicalGrid):
# a section's blocks (its kv heads x every work item) run before the next section's (handed out by
# the tile scheduler in persistent launches, started in launch order by the hardware in the
# others), so K/V of at most L2_SECTION_SHARE of the L2 is read at a time and the row tiles of a
# head find it there. One section made a batch of short causal requests re-read
# each head's K/V from DRAM for every row tile (ncu, H200, 16 x 1k, 16 heads, hd128: L2 hit rate
# 35%, DRAM 66% busy, against cuDNN's 60% / 33%). PFA_L2_SECTION_SHARE overrides the share for A/B
# runs (0: one section).
L2_SECTION_SHARE = 0.25
L2_SECTION_ENV = "PFA_L2_SECTION_SHARE"


def l2_section(num_kv_heads: int, kv_tokens: int, head_dim: int, elem_bytes: int, l2_bytes: int) -> int:
    """kv heads per L2 section: as many as keep their K and V (kv_tokens rows each) within the
    share of the L2, at least one; num_kv_heads = one section."""
    share = L2_SECTION_SHARE
    env = os.environ.get(L2_SECTION_ENV, "").strip()
    if env:
        try:
            share = float(env)
        except ValueError:
            raise ValueError(f"{L2_SECTION_ENV}={env!r}: expected a number (0 = one section)") from None
    per_head = 2 * kv_tokens * head_dim * elem_bytes
    if share <= 0 or per_head <= 0 or l2_bytes <= 0:  # (an unknown L2: one section)
        return num_kv_heads
    fit = max(1, min(num_kv_heads, int(share * l2_bytes) // per_head))
    sections = -(-num_kv_heads // fit)
    return -(-num_kv_heads // sections)  # the sections evened out: 8 + 8, never 15 + 1


def l2_order(props: dict, meta: dict, num_kv_heads: int, kv_tokens: int, head_dim: int, elem_bytes: int, tiles_of,
             per_z: int) -> tuple[int, int]:
    """(kv heads per L2 section, z values in sections before the tail) of an sm90 launch's logical
    grid (launch.configure_grid's section / section_z); (0, 0): one section. tiles_of() gives the
    z values' KV tiles, heaviest first (section_head_z), asked for only where there are sections."""
    section = l2_section(num_kv_heads, kv_tokens, head_dim, elem_bytes, props.get("l2_bytes", 0))
    if section >= num_kv_heads:
        return 0, 0
    return section, section_head_z(tiles_of(), per_z, props["sm_count"] * ctas_per_sm(meta, props))


# Per-block cost beyond its KV tiles, in tiles (CTA start or block switch, Q load, first K/V
# latency, epilogue: session 18's profile put it at 2-3 tiles), in section_head_z's balance.
BLOCK_OVERHEAD_TILES = 2


def section_head_z(tiles_by_z, per_z: int, ctas: int) -> int:
    """How many z values (work items or row tiles, heaviest first: `tiles_by_z`, the KV tiles a
    block of each iterates; anything with len() and numpy slicing) run in L2 sections before the
    tail (PrefillParams.grid_section_z). In sections, the last section's heaviest blocks start
    late and would set the launch's end; the tail, every x together in longest-first order, must
    hold at least `ctas` such blocks' worth of work so the others finish beside them. `per_z`
    blocks share a z value. 0: no section at all (a launch of about one wave). Reads the first
    value and as few of the last as the tail needs (plan() runs this for every batch)."""
    n = len(tiles_by_z)
    if n == 0:
        return 0
    need = -(-ctas * (int(tiles_by_z[0]) + BLOCK_OVERHEAD_TILES) // per_z)  # tail work a z column holds
    k = 256
    while True:
        k = min(k, n)
        acc = np.add.accumulate(tiles_by_z[n - k:][::-1])  # the k lightest, lightest first
        hit = int((acc + _overhead_ramp(k)).searchsorted(need))  # the fewest lightest values holding `need`
        if hit < k:
            return n - 1 - hit
        if k == n:
            return 0
        k *= 8


_ramp = np.zeros(0, np.int64)


def _overhead_ramp(k: int) -> np.ndarray:
    """BLOCK_OVERHEAD_TILES * (1 .. k): the overhead of the k lightest blocks, accumulated."""
    global _ramp
    if _ramp.size < k:
        _ramp = np.arange(1, max(k, 1024) + 1, dtype=np.int64) * BLOCK_OVERHEAD_TILES
    return _ramp[:k]


def ctas_per_sm(meta: dict, props: dict) -> int:
    """CTAs of a kernel per SM on this device: what it was designed for (the manifest's
    ctas_per_sm), at most what the device's shared memory holds."""
    fit = props["smem_per_sm"] // (meta["smem_bytes"] + SMEM_RESERVED_PER_CTA)
    return max(1, min(meta["ctas_per_sm"], fit))


_decode_rows_cache: dict = {}


def built_decode_tiles(dev: int, dtype: str, kv_dtype: str, head_dim: int, paged: bool) -> tuple:
    """The decode tiles (by packed rows, smallest first) the manifest has for this K/V on this
    device's arch: 16 rows, and the wide ones (32, 64) where they were built (paged or fp8 K/V:
    contiguous 16-bit K/V run 17-32 rows as two 16-row tiles instead); () where none was built."""
    key = (dev, dtype, kv_dtype, head_dim, paged)
    hit = _decode_rows_cache.get(key)
    if hit is None:
        archs = _registry.arch_candidates(_cuda.properties(dev)["cc"])
        rows = set()
        for arch in archs:
            rows = {r["block_m"] for r in _registry.manifest()["kernels"]
                    if r["arch"] == arch and r["family"] == "prefill" and r.get("decode") and not r.get("tune")
                    and r["dtype"] == dtype and r["kv_dtype"] == kv_dtype and r["head_dim"] == head_dim
                    and r["paged"] == paged}
            if rows:
                break
        hit = _decode_rows_cache[key] = tuple(sorted(rows))  # () = none built: the row-tile kernels
    return hit


_registry._on_force.append(_decode_rows_cache.clear)


# A head dim's 16-bit sm90 row tiles' steady-state speeds relative to each other (block_m -> speed),
# where it has more than one (variants.HOPPER_TILES_ALT; the fp8 rows have one tile a head dim):
# hd64's 192-row tile (three consumers) ran 1.13x the 128-row one at long lengths (NOTES.md,
# session 14).
SM90_ROW_TILE_SPEED = {64: {192: 1.13, 128: 1.0}}


def row_tile_block_m(meta: dict, kv_heads: int, rows: int, slots: int) -> int:
    """The block_m of the sm90 row-tile kernel for kv_heads x `rows` packed query rows, among the
    default row's (meta) and its head dim's alternatives (SM90_ROW_TILE_SPEED): the one whose launch
    ends first, counted as rounds of `slots` blocks (rounded up) times a block's time (block_m over
    its speed). A persistent CTA takes blocks as it frees up, so a launch's last round is what a
    coarse tile loses: hd64 at 32 heads x 1024 rows makes 192 blocks of 192 rows on 132 SMs (two
    rounds, 0.73 full) but 256 of 128 (0.97). The default's block_m where nothing beats it."""
    sixteen_bit = meta.get("impl") == "sm90" and meta.get("dtype") in ("bf16", "f16")
    speeds = SM90_ROW_TILE_SPEED.get(meta["head_dim"]) if sixteen_bit else None
    best = meta["block_m"]
    if not speeds or best not in speeds:
        return best

    def cost(bm):
        return -(-kv_heads * -(-rows // bm) // slots) * bm / speeds[bm]
    for bm in speeds:
        if cost(bm) < cost(best):
            best = bm
    return best


def decode_tile_rows(head_dim: int, rows: int, tiles: tuple, decode_only: bool = False) -> int:
    """The decode tile (by its packed rows, one of `tiles`) for requests of at most `rows` packed
    rows: the smallest that holds them, else (up to DECODE_MAX_ROWS, or any number for a
    decode-only K/V storage) several row tiles of the largest; 0 = the 128-row kernel (also when
    no decode tile was built)."""
    if not tiles or (rows > max(DECODE_MAX_ROWS[head_dim], tiles[-1]) and not decode_only):
        return 0
    for t in tiles:
        if rows <= t:
            return t
    return tiles[-1]


def new_attention(dev: int, dtype: str, kv_dtype: str, head_dim: int, general: bool, paged: bool,
                  decode_rows: int = 0, nvfp4_out: bool = False, block_m: int = 0):
    """A fresh launcher (its own params struct) for the attention kernel of this problem:
    decode_rows = the decode tile's packed rows, 0 for the row-tile kernels; nvfp4_out: a kernel
    that writes the NVFP4 output (the manifest's nvfp4_out; on sm_90a the sm80 family where the
    sm90 row lacks it); block_m: a row-tile kernel of these rows (row_tile_block_m), 0 = the
    default one."""
    tile = dict(decode=True, block_m=decode_rows) if decode_rows else dict(decode=False)
    if block_m and not decode_rows:
        tile["block_m"] = block_m
    if nvfp4_out:
        tile["nvfp4_out"] = True
    return _registry.new_launcher("prefill", dev, dtype=dtype, kv_dtype=kv_dtype, head_dim=head_dim,
                                  general=general, paged=paged, **tile)


def nvfp4_out_built(dev: int, dtype: str, kv_dtype: str, head_dim: int, general: bool, paged: bool) -> bool:
    """Whether this device's cubins write the NVFP4 output for such a plan: a row-tile kernel with
    the manifest's nvfp4_out (PrefillSm80Config / PrefillSm90Config::NVFP4_OUT: the paged kernels
    but the sm80 hd256 general ones and the sm90 hd256 ones), or, for a decode-only K/V storage,
    its decode tiles (paged: all have it)."""
    if kv_dtype in DECODE_ONLY_KV:
        return bool(built_decode_tiles(dev, dtype, kv_dtype, head_dim, paged))
    for arch in _registry.arch_candidates(_cuda.properties(dev)["cc"]):
        rows = [r for r in _registry.manifest()["kernels"]
                if r["arch"] == arch and r["family"] == "prefill" and not r.get("decode") and not r.get("tune")
                and r["dtype"] == dtype and r["kv_dtype"] == kv_dtype and r["head_dim"] == head_dim
                and r["paged"] == paged and r["general"] == general]
        if rows:
            return any(r.get("nvfp4_out") for r in rows)
    return False


class Route:
    """The kernels a batch plan may run, resolved once per plan settings: the row-tile kernel
    (`attn`, `ctas`, `budget` = CTAs per wave; None for a decode-only K/V storage), its TMA twin
    (`tma`, or None; the plan runs it where tma_fits), its dense twin (`dense`, or None; the plan
    runs it where dense_pays), its span twin (`span`, or None; where span_pays), its long-KV twin
    (`long`, or None: its own tile, where long_pays) and, for lean
    options, the decode tiles by rows: decode[rows] = (launcher, budget, ctas), their rows in
    `tiles` (the plan picks one per batch with decode_tile_rows; `decode_only`: always one)."""

    __slots__ = ("attn", "tma", "dense", "span", "long", "long_tma", "ctas", "budget", "decode", "tiles",
                 "decode_only")

    def __init__(self, launcher, dev: int, dtype: str, kv_dtype: str, head_dim: int, general: bool, paged: bool,
                 widened: bool, nvfp4_out: bool = False):
        """widened: the K/V tiles are widened in the kernel (fp8, NVFP4): two waves of split budget
        where they widen in shared memory (decode_waves).
        nvfp4_out: only kernels that write the NVFP4 output (new_attention)."""
        props = _cuda.properties(dev)
        self.decode_only = kv_dtype in DECODE_ONLY_KV
        self.attn = self.tma = self.dense = self.span = self.long = self.long_tma = self.ctas = self.budget = None
        if not self.decode_only:
            # attn: the cp.async kernel; tma: its TMA twin where the K/V load says so (kv_load_pair);
            # dense, span: its dense and span twins (paged; dense_twin, span_twin); long: its
            # long-KV twin (e4m3, contiguous and paged; long_twin); long_tma: (paged) the long
            # twin's TMA twin
            row_tile = launcher("prefill", dtype, kv_dtype, head_dim, general, nvfp4_out=nvfp4_out)
            named = lambda name: launcher("prefill", dtype, name=name)  # noqa: E731
            self.attn, self.tma = kv_load_pair(dev, row_tile, named)
            self.dense = dense_twin(dev, self.attn, named)
            self.span = span_twin(dev, self.attn, named)
            self.long = long_twin(dev, self.attn, named)
            if self.long is not None and paged:
                self.long_tma = kv_load_pair(dev, self.long, named)[1]
            self.ctas = ctas_per_sm(self.attn.meta, props)
            self.budget = props["sm_count"] * self.ctas
        self.decode = None
        self.tiles = ()  # the decode tiles' rows, smallest first
        if not general:
            self.decode = {}
            for rows in built_decode_tiles(dev, dtype, kv_dtype, head_dim, paged):
                ld = launcher("prefill", dtype, kv_dtype, head_dim, False, decode=rows, nvfp4_out=nvfp4_out)
                cps = ctas_per_sm(ld.meta, props)
                waves = decode_waves(widened and not ld.meta.get("reg_widen", False))
                self.decode[rows] = (ld, max(1, int(props["sm_count"] * cps * waves)), cps)
            self.tiles = tuple(self.decode)
        if self.decode_only and not self.tiles:
            raise RuntimeError(f"no {kv_dtype} K/V kernel for {dtype}, head_dim {head_dim} among the cubins for "
                               f"this GPU (its paged decode tiles); rebuild them with `make`")
