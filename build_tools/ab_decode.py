"""Same-run A/B of the decode switches (issue #18's decode speed goals; H100 shapes: 32 q / 8 kv
heads, head_dim 128, page 16 in random order) through xqa_batch_decode_with_kv_cache.

    python build_tools/ab_decode.py [--switch merge] [--cases b1_bf16,b1_fp8,...] [--rep 30]

A switch's settings are environment variables the engine reads at plan time and/or a kernel
forced by name (registry.force: the `make TUNE=1` decode tiles); each setting plans its own engine
(XQA caches one per shape, so the cache is swapped per setting). Every
setting's output is checked against a float32 reference over the same values as the cache holds
(fp8 / NVFP4 widen exactly to bf16) before it is timed; then the settings are timed in
interleaved rounds (CUDA events, L2 flushed, median). Printed per case and setting: us, KV bytes
read per second (as stored), each setting's speed over "old", and the device copy bandwidth of
the same run for the "vs copy" goal. A setting that forces no kernel for a case's cache is skipped.

Switches:
  merge  PYFLASHATTN_MERGE_CTA_PER_ROW: old = "0" (one warp per (row, head)), new = unset (a CTA
         per (row, head) when the one-warp grid leaves SMs idle: few rows over many chunks)
  spec   PYFLASHATTN_XQA_SPEC_GENERAL: old = "1" (a speculative-decoding mask on the 128-row
         general kernel), new = unset (on the lean paged decode tile that honours it); the
         spec8_* cases (8 drafts a request, a random draft mask, GQA 4: 32 packed rows)
  waves  PYFLASHATTN_DECODE_SPLIT_WAVES: the decode tiles' split-KV budget in waves (old = the
         default: 1 for bf16, 2 for fp8 / NVFP4) against 0.5, 1, 2 and 4
  tile   the 16-row decode tile against the `make TUNE=1` alternatives (variants.DECODE_TUNE_TILES:
         3 K/V stages; fp8 32- and 64-key tiles, 32 keys on 3 stages or capped at 12 CTAs per SM;
         3 stages with half a wave of split budget)
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

import pyflashattn
from pyflashattn._engine import xqa
from pyflashattn._runtime import registry
from pyflashattn.bench.decode_xqa import _nvfp4_cache
from pyflashattn.testing.bench_util import bench_samples_ms, interleaved_median_ms

HQ, HKV, PS = 32, 8, 16
_S3 = {"bf16": "pfa_prefill_sm80_bf16_hd128_m16n32w1s3_lr_paged"}
# switch -> setting -> (environment: variable -> value, None = unset; cache kind -> forced kernel)
SWITCHES = {
    "merge": {"old": ({"PYFLASHATTN_MERGE_CTA_PER_ROW": "0"}, None),
              "new": ({"PYFLASHATTN_MERGE_CTA_PER_ROW": None}, None)},
    "spec": {"old": ({"PYFLASHATTN_XQA_SPEC_GENERAL": "1"}, None),
             "new": ({"PYFLASHATTN_XQA_SPEC_GENERAL": None}, None)},
    "waves": {"old": ({"PYFLASHATTN_DECODE_SPLIT_WAVES": None}, None),
              **{f"w{w}": ({"PYFLASHATTN_DECODE_SPLIT_WAVES": w}, None) for w in ("0.5", "0.75", "1", "2", "4")}},
    "tile": {"old": ({}, None), "s3": ({}, _S3),
             "n32": ({}, {"fp8": "pfa_prefill_sm80_bf16_kvfp8_hd128_m16n32w1s2_lr_paged"}),
             # 16-bit K/V, 16-key tiles capped at 128 registers (9 CTAs per SM by shared memory)
             "n16b16": ({}, {"bf16": "pfa_prefill_sm80_bf16_hd128_m16n16w1s2_lr_b16_paged"}),
             "n64": ({}, {"fp8": "pfa_prefill_sm80_bf16_kvfp8_hd128_m16n64w1s2_lr_paged"}),
             "n32s3": ({}, {"fp8": "pfa_prefill_sm80_bf16_kvfp8_hd128_m16n32w1s3_lr_paged"}),
             # NVFP4: 32-key tiles capped at 168 registers; 16-key tiles uncapped (8 CTAs per SM)
             "nv32": ({}, {"nvfp4": "pfa_prefill_sm80_bf16_kvnvfp4_hd128_m16n32w1s2_lr_b12_paged"}),
             "nv16u": ({}, {"nvfp4": "pfa_prefill_sm80_bf16_kvnvfp4_hd128_m16n16w1s2_lr_paged"}),
             # registers capped for 12 warps per SM (min blocks; shared memory allows 9)
             "n32b12": ({}, {"fp8": "pfa_prefill_sm80_bf16_kvfp8_hd128_m16n32w1s2_lr_b12_paged"}),
             # longer walks a CTA with more in flight each: for B=1, whose 13-tile chunks ramp up
             # and down at 72% of DRAM peak
             "s3w.5": ({"PYFLASHATTN_DECODE_SPLIT_WAVES": "0.5"}, _S3)},
}
# case -> (batch, kv_len, cache kind, q_len)
CASES = {
    "b1_bf16": (1, 32768, "bf16", 1), "b1_fp8": (1, 32768, "fp8", 1), "b2_bf16": (2, 16384, "bf16", 1),
    "b16_bf16": (16, 8192, "bf16", 1), "b16_fp8": (16, 8192, "fp8", 1), "b1_nvfp4": (1, 32768, "nvfp4", 1),
    "b64_bf16": (64, 4096, "bf16", 1), "b64_fp8": (64, 4096, "fp8", 1), "b64_nvfp4": (64, 4096, "nvfp4", 1),
    "spec8_bf16": (64, 4096, "bf16", 8), "spec8_fp8": (64, 4096, "fp8", 8), "spec8_b1_bf16": (1, 32768, "bf16", 8),
}
DEFAULT_CASES = {"merge": "b1_bf16,b1_fp8,b2_bf16,b16_bf16,b64_bf16,b64_fp8",
                 "spec": "spec8_bf16,spec8_fp8,spec8_b1_bf16,b64_bf16",
                 "waves": "b1_bf16,b1_fp8,b16_bf16,b64_bf16,b64_fp8",
                 "tile": "b64_bf16,b64_fp8,b16_bf16,b1_bf16"}
REL_TOL = 2e-2  # max |o - ref| over max |ref|: bf16 output rounding and accumulation order


def _reference(q, wide, bt, kv_len, scale, q_len, bits):
    """float32 attention of q [B * q_len, HQ, D] over the bf16 values of the cache, request by
    request; bits [B, q_len] (q_len > 1): draft i sees draft j where bit j of bits[b, i] is set
    (every key before the drafts is visible)."""
    d = q.shape[-1]
    B = q.shape[0] // q_len
    out = torch.empty(B * q_len, HQ, d, dtype=torch.float32, device=q.device)
    for b in range(B):
        kv = wide[bt[b].long()]  # [pages, 2, ps, Hkv, D]
        k = kv[:, 0].reshape(-1, HKV, d)[:kv_len].float()
        v = kv[:, 1].reshape(-1, HKV, d)[:kv_len].float()
        qb = q[b * q_len:(b + 1) * q_len].float().view(q_len, HKV, HQ // HKV, d)
        s = torch.einsum("qhgd,khd->qhgk", qb, k) * scale
        if q_len > 1:
            j = torch.arange(q_len, device=q.device)
            keep = ((bits[b][:, None] >> j[None, :]) & 1).bool()  # [draft i, draft j]
            s[..., kv_len - q_len:] = s[..., kv_len - q_len:].masked_fill(~keep[:, None, None, :], float("-inf"))
        out[b * q_len:(b + 1) * q_len] = torch.einsum("qhgk,khd->qhgd", s.softmax(-1), v).reshape(q_len, HQ, d)
    return out


def _copy_tbs(warmup, rep):
    """Device-to-device copy bandwidth (read + write bytes per second) of a 1 GiB buffer."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = sorted(bench_samples_ms(lambda: dst.copy_(src), warmup=warmup, rep=rep))[rep // 2]
    return 2 * src.numel() / (t * 1e-3) / 1e12


def run_case(name, settings, ws, warmup, rep, hd=128):
    B, kv_len, kind, q_len = CASES[name]
    settings = {s: (env, None if force is None else force[kind]) for s, (env, force) in settings.items()
                if force is None or kind in force}
    gen = torch.Generator(device="cuda").manual_seed(sum(name.encode()))
    pages = B * kv_len // PS
    codes, sf, wide = _nvfp4_cache(torch, pages, hd, gen)
    if kind == "fp8":
        cache, cache_sf = wide.to(torch.float8_e4m3fn), None
        wide = cache.to(torch.bfloat16)
    elif kind == "nvfp4":
        cache, cache_sf = codes, sf
    else:
        cache, cache_sf = wide, None
    elems = 2 * B * kv_len * HKV * hd
    nbytes = {"bf16": 2 * elems, "fp8": elems, "nvfp4": elems // 2 + elems // 16}[kind]
    q = torch.randn(B * q_len, HQ, hd, dtype=torch.bfloat16, device="cuda", generator=gen)
    bt = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).view(B, -1)
    sl = torch.full((B,), kv_len, dtype=torch.int32, device="cuda")
    scale = hd ** -0.5
    bits = mask = None
    if q_len > 1:  # a random draft mask (as the bench's spec8 row), every draft seeing itself
        bits = torch.randint(0, 1 << q_len, (B, q_len), device="cuda", generator=gen) | (
            1 << torch.arange(q_len, device="cuda"))
        mask = torch.zeros(B, q_len, 2, dtype=torch.int16, device="cuda")  # one 32-bit word a draft
        mask[:, :, 0] = bits.to(torch.int16)
        mask = mask.view(torch.uint16)
    ref = _reference(q, wide, bt, kv_len, scale, q_len, bits)
    outs, engines = {}, {}

    def call():
        return pyflashattn.decode.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, sl, kv_len, bmm1_scale=scale,
                                                                 out=outs[cur[0]], kv_cache_sf=cache_sf,
                                                                 q_len_per_req=q_len, mask=mask)

    cur = [None]

    def use(setting):
        """Point XQA's caches at this setting's planned engine (planning it on first use)."""
        cur[0] = setting
        xqa._ENGINES.clear()
        xqa._FAST.clear()
        if setting in engines:
            xqa._ENGINES.update(engines[setting])
            return
        env, forced = settings[setting]
        saved = {k: os.environ.get(k) for k in env}
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        registry.force("prefill", forced)
        try:
            outs[setting] = torch.full_like(q, float("nan"))
            call()
            torch.cuda.synchronize()
        finally:
            registry.force("prefill", None)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        engines[setting] = dict(xqa._ENGINES)
        (e,) = engines[setting].values()
        if forced is not None and e.attn.name != forced:
            raise RuntimeError(f"{setting}: {forced} did not run ({e.attn.name} did): build with `make TUNE=1`")

    errors = []
    for s in settings:
        use(s)
        err = ((outs[s].float() - ref).abs().max() / ref.abs().max()).item()
        if not err <= REL_TOL:  # NaN fails too
            errors.append(f"{s}: max error {err:.3g} over max |ref| (> {REL_TOL})")
        (e,) = engines[s].values()
        print(f"  {name} {s}: attention {e.attn.name} grid {e.attn.grid}"
              + (f", merge {e.merge.name} grid {e.merge.grid}" if e.merge is not None else ", no merge")
              + f"; rel. error {err:.2e}")
    if errors:
        print(f"  {name}: NOT TIMED: " + "; ".join(errors))
        return None

    def timer(s):
        def t(w, r):
            use(s)
            return bench_samples_ms(call, warmup=w, rep=r)
        return t

    ms = interleaved_median_ms({s: timer(s) for s in settings}, warmup, rep, errors)
    row = {s: (ms[s] * 1e3, nbytes / (ms[s] * 1e-3) / 1e12) for s in ms}
    for s, (us, tbs) in row.items():
        vs = f"  {row['old'][0] / us:.3f}x old" if "old" in row and s != "old" else ""
        print(f"{name:14s} {s:4s} {us:9.1f} us {tbs:6.3f} TB/s{vs}")
    xqa._ENGINES.clear()
    xqa._FAST.clear()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--switch", default="merge", choices=sorted(SWITCHES))
    ap.add_argument("--cases", help="comma-separated keys of CASES (default: the switch's DEFAULT_CASES)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rep", type=int, default=30)
    args = ap.parse_args()
    settings = SWITCHES[args.switch]
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    print(f"{torch.cuda.get_device_name()}: switch {args.switch}: "
          + "; ".join(f"{k} = {env or ''}{' ' + str(f) if f else ''}" for k, (env, f) in settings.items()))
    print(f"device copy {_copy_tbs(args.warmup, args.rep):.3f} TB/s")
    failed = False
    for name in (args.cases or DEFAULT_CASES[args.switch]).split(","):
        failed |= run_case(name, settings, ws, args.warmup, args.rep) is None
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
