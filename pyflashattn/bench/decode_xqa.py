"""The XQA rows of ``python -m pyflashattn.bench decode``: one decode batch (B=64 requests of 4096
keys, one query token each) through ``xqa_batch_decode_with_kv_cache`` over a paged cache held
as bf16, fp8 e4m3 and NVFP4 (e2m1 code pairs plus one e4m3 scale per 16 elements), judged by KV
bytes read per second: every request's K and V once, as stored (NVFP4: codes + scales, 9/16 of
a byte an element). The "spec8" column is the bf16 cache read by an 8-token speculative decode
(q_len_per_req=8 with a random draft mask): the same bytes, 8 query tokens a request.

Before a time is posted, the fp8 and NVFP4 outputs are compared with the bf16 cache's on the
same widened values (e4m3 and e2m1 * e4m3 are exact in bf16), so only rounding of the
accumulation separates them.
"""
from __future__ import annotations

from pyflashattn.testing.bench_util import bench_samples_ms, interleaved_median_ms, short_error

B, KV_LEN, HQ, HKV, PAGE_SIZE = 64, 4096, 32, 8, 16
REL_TOL = 2e-2
KINDS = ("bf16", "fp8", "nvfp4", "spec8")
SPEC_Q = 8  # the speculative-decoding row: 8 draft tokens a request (GQA 4: 32 packed rows)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _nvfp4_cache(torch, pages, head_dim, gen, chunk_pages=1024):
    """(codes uint8 [P, 2, ps, Hkv, D/2], scales float8_e4m3fn [P, 2, ps, Hkv, D/16], the bf16
    cache they decode to, exactly): random codes over all 16 (negative ones too), scales 1/16 ..
    1/2. Decoded a chunk of pages at a time (the float32 temporaries of a whole hd256 cache would
    take several GB)."""
    shape = (pages, 2, PAGE_SIZE, HKV)
    codes = torch.randint(0, 256, shape + (head_dim // 2,), dtype=torch.uint8, device="cuda", generator=gen)
    # e4m3 bits 0x18 .. 0x30: 2^-4 .. 2^-1
    sf = torch.randint(0x18, 0x31, shape + (head_dim // 16,), dtype=torch.uint8, device="cuda", generator=gen)
    sf = sf.view(torch.float8_e4m3fn)
    table = torch.tensor(E2M1 + tuple(-x for x in E2M1), device="cuda")
    wide = torch.empty(shape + (head_dim,), dtype=torch.bfloat16, device="cuda")
    for p0 in range(0, pages, chunk_pages):
        c = codes[p0:p0 + chunk_pages]
        nib = torch.stack([c & 0xF, c >> 4], dim=-1).flatten(-2).long()  # element 2i: the low nibble
        wide[p0:p0 + chunk_pages] = table[nib] * sf[p0:p0 + chunk_pages].float().repeat_interleave(16, dim=-1)
    return codes, sf, wide


def xqa_rows(torch, pfa, ws, head_dims, seed, warmup, rep) -> list:
    """One row per head dim: us and TB/s per cache kind (None where not measured), errors."""
    rows = []
    for hd in head_dims:
        gen = torch.Generator(device="cuda").manual_seed(seed + hd)
        pages = B * KV_LEN // PAGE_SIZE
        codes, sf, wide = _nvfp4_cache(torch, pages, hd, gen)
        cache8 = wide.to(torch.float8_e4m3fn)  # (rounded: e2m1 * e4m3 may need a fifth significant bit)
        # kind -> (cache, kv_cache_sf, the bf16 cache of the same values to check against; None: unchecked)
        caches = {"bf16": (wide, None, None), "fp8": (cache8, None, cache8.to(torch.bfloat16)),
                  "nvfp4": (codes, sf, wide), "spec8": (wide, None, None)}
        elems = 2 * B * KV_LEN * HKV * hd  # K and V elements read
        nbytes = {"bf16": 2 * elems, "fp8": elems, "nvfp4": elems // 2 + elems // 16, "spec8": 2 * elems}
        q = torch.randn(B, HQ, hd, dtype=torch.bfloat16, device="cuda", generator=gen)
        bt = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).view(B, -1)
        sl = torch.full((B,), KV_LEN, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        row = {"case": f"xqa B={B} kv {KV_LEN}", "head_dim": hd, "errors": []}

        q8 = torch.randn(B * SPEC_Q, HQ, hd, dtype=torch.bfloat16, device="cuda", generator=gen)
        out8 = torch.empty_like(q8)
        # a random draft mask (bit j of row i: draft i sees draft j), every draft seeing itself
        bits = torch.randint(0, 1 << SPEC_Q, (B, SPEC_Q), device="cuda", generator=gen) | (
            1 << torch.arange(SPEC_Q, device="cuda"))
        mask = torch.zeros(B, SPEC_Q, 2, dtype=torch.int16, device="cuda")
        mask[:, :, 0] = bits.to(torch.int16)
        mask = mask.view(torch.uint16)

        def call(c, s):
            return pfa.decode.xqa_batch_decode_with_kv_cache(q, c, ws, bt, sl, KV_LEN, bmm1_scale=hd**-0.5, out=out,
                                                             kv_cache_sf=s)

        def call_spec(c, s):
            return pfa.decode.xqa_batch_decode_with_kv_cache(q8, c, ws, bt, sl, KV_LEN, bmm1_scale=hd**-0.5, out=out8,
                                                             q_len_per_req=SPEC_Q, mask=mask)

        timers = {}
        for kind in KINDS:
            c, s, check = caches[kind]
            fn = call_spec if kind == "spec8" else call
            try:
                o = fn(c, s).float()
                if check is not None:
                    ref = call(check, None).float()
                    rel = ((o - ref).norm() / ref.norm()).item()
                    if not rel <= REL_TOL:
                        row["errors"].append(f"{kind}: mismatch vs the bf16 cache of the same values, rel {rel:.3g}")
                        continue
                timers[kind] = lambda wu, r, c=c, s=s, fn=fn: bench_samples_ms(lambda: fn(c, s), warmup=wu, rep=r)
            except Exception as e:
                row["errors"].append(f"{kind}: {short_error(e)}")
        ms = interleaved_median_ms(timers, warmup, rep, row["errors"]) if timers else {}
        for kind in KINDS:
            t = ms.get(kind)
            row[f"{kind}_us"] = None if t is None else t * 1e3
            row[f"{kind}_tbps"] = None if t is None else nbytes[kind] / t / 1e9
        rows.append(row)
        del caches, codes, sf, wide, cache8
    return rows


def print_xqa_rows(rows, copy, fmt, errors) -> None:
    print(f"XQA over a paged cache (B={B} x {KV_LEN} keys, {HQ}/{HKV} heads, page {PAGE_SIZE}): KV bytes read per "
          "second (TB/s, as stored: NVFP4 = codes + scales)")
    head = (f"{'case':<34} {'hd':>3} | {'bf16':>6} {'fp8':>6} {'nvfp4':>6} {'spec8':>6} | {'nvfp4/copy':>10} | "
            f"{'fp8 x':>5} {'nvfp4 x':>7} {'spec/bf16':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        def speed(kind):
            return None if r["bf16_us"] is None or r[f"{kind}_us"] is None else r["bf16_us"] / r[f"{kind}_us"]
        over = None if r["nvfp4_tbps"] is None else r["nvfp4_tbps"] / copy
        spec = None if r["bf16_tbps"] is None or r["spec8_tbps"] is None else r["spec8_tbps"] / r["bf16_tbps"]
        print(f"{r['case']:<34} {r['head_dim']:>3} | {fmt(r['bf16_tbps']):>6} {fmt(r['fp8_tbps']):>6} "
              f"{fmt(r['nvfp4_tbps']):>6} {fmt(r['spec8_tbps']):>6} | {fmt(over):>10} | {fmt(speed('fp8')):>5} "
              f"{fmt(speed('nvfp4')):>7} {fmt(spec):>9}" + errors(r))
