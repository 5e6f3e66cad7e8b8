"""Per-block timeline of the sm_90a prefill (16-bit, and the e4m3 cases: the fp8 TMA row), in a tree
patched by timeline_patch.py: where a CTA's cycles go (block entry -> Q -> first turn -> first S ->
tile loop -> last P V -> epilogue, and the gaps between blocks) for a few single-prefill and ragged
shapes, and the producer's steps towards the next block's Q against consumer 0's stamps (the "P ..."
rows). TL_CARVEOUT=<percent> sets the kernels' preferred shared-memory carveout (an L1-size
experiment). Needs torch and a GPU."""
import sys, time, numpy as np, torch
import pyflashattn as pfa
from pyflashattn._runtime import registry, cuda as C

cu = C.driver()
import os
if os.environ.get("TL_CARVEOUT"):
    _gf = C.get_function
    def get_function(library, name, device_id, dynamic_smem):
        f = _gf(library, name, device_id, dynamic_smem)
        C.check(cu.cuFuncSetAttribute(f, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                      int(os.environ["TL_CARVEOUT"])), "carveout")
        return f
    C.get_function = get_function
    registry._cuda.get_function = get_function
TL_N, CTA_N = 1024 * 16 * 48, 1024 * 4

def libs():
    out = []
    for key, lib in list(registry._libraries.items()):
        try:
            r = cu.cuLibraryGetGlobal(lib, b"pfa_tl")
            r2 = cu.cuLibraryGetGlobal(lib, b"pfa_tl_cta")
        except Exception:
            continue
        if r[0] != cu.CUresult.CUDA_SUCCESS or r2[0] != cu.CUresult.CUDA_SUCCESS:
            continue
        out.append((key[0], int(r[1]), int(r2[1])))
    return out

def zero():
    for _, a, b in libs():
        cu.cuMemsetD8(a, 0, TL_N * 8); cu.cuMemsetD8(b, 0, CTA_N * 8)
    torch.cuda.synchronize()

def read():
    res = []
    for name, a, b in libs():
        tl = np.zeros(TL_N, np.uint64); cta = np.zeros(CTA_N, np.uint64)
        cu.cuMemcpyDtoH(tl.ctypes.data, a, TL_N * 8); cu.cuMemcpyDtoH(cta.ctypes.data, b, CTA_N * 8)
        if cta.any():
            res.append((name, tl.reshape(1024, 16, 48).astype(np.int64), cta.reshape(1024, 4).astype(np.int64)))
    return res

def analyse(label, fn, flops):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(10): fn()
    e.record(); torch.cuda.synchronize()
    ms = s.elapsed_time(e) / 10
    zero(); fn(); torch.cuda.synchronize()
    got = read()
    print(f"\n## {label}: {ms*1e3:.1f} us/call, {len(libs())} instrumented libraries, {len(got)} with stamps", flush=True)
    for name, tl, cta in got:
        used = np.nonzero(cta[:, 0])[0]
        g0, g1 = cta[used, 0], cta[used, 2]
        c0, c1 = cta[used, 1], cta[used, 3]
        span_ns = g1.max() - g0.min()
        ghz = np.median((c1 - c0) / np.maximum(g1 - g0, 1))
        print(f"\n== {label}: {ms*1e3:.1f} us/call ({flops/ms/1e9:.1f} TFLOP/s); kernel {name}")
        print(f"   CTAs {len(used)}, span (globaltimer) {span_ns/1e3:.1f} us, clock {ghz:.2f} GHz;"
              f" CTA start spread {(g0.max()-g0.min())/1e3:.1f} us, end spread {(g1.max()-g1.min())/1e3:.1f} us,"
              f" first end {(g1.min()-g0.min())/1e3:.1f} us")
        # CTA start -> first block's entry
        rows = {k: [] for k in ["start->entry0", "entry->q", "q->turn0", "turn0->S0", "S0->loopend",
                                 "loopend->lastPV", "epilogue", "  ahead()", "  epilogue proper",
                                 "gap(prev epi->entry)", "tiles", "per-tile(loop)", "block total", "end->cta end",
                                 "wg0 wait K/tile", "wg0 wait V/tile", "wg0 wait turn/tile", "wg0 wait S/tile",
                                 "wg0 wait PV/tile", "wg0 wait issue/tile", "wg0 wait softmax/tile",
                                 "wg1 wait K/tile", "wg1 wait V/tile", "wg1 wait turn/tile",
                                 "wg1 wait S/tile", "wg1 wait PV/tile", "wg1 wait issue/tile", "wg1 wait softmax/tile"]}
        waits = ["K", "V", "turn", "S", "PV", "issue", "softmax"]
        blocks = 0; tiles_total = 0
        for c in used:
            prev_end = None
            for k in range(16):
                t = tl[c, k]
                for wg in range(2):
                    e_ = t[wg * 16: wg * 16 + 16]
                    if e_[0] == 0: continue
                    n = e_[7]
                    if wg == 0:
                        blocks += 1; tiles_total += n
                    rows["entry->q"].append(e_[1] - e_[0]); rows["q->turn0"].append(e_[2] - e_[1])
                    rows["turn0->S0"].append(e_[3] - e_[2]); rows["S0->loopend"].append(e_[4] - e_[3])
                    rows["loopend->lastPV"].append(e_[5] - e_[4]); rows["epilogue"].append(e_[6] - e_[5])
                    if e_[15]:
                        rows["  ahead()"].append(e_[15] - e_[5]); rows["  epilogue proper"].append(e_[6] - e_[15])
                    rows["tiles"].append(n); rows["block total"].append(e_[6] - e_[0])
                    if n > 1:
                        rows["per-tile(loop)"].append((e_[4] - e_[3]) / (n - 1))
                        for i, wname in enumerate(waits):
                            rows[f"wg{wg} wait {wname}/tile"].append(e_[8 + i] / (n - 1))
                    if wg == 0:
                        if prev_end is None: rows["start->entry0"].append(e_[0] - cta[c, 1])
                        else: rows["gap(prev epi->entry)"].append(e_[0] - prev_end)
                        prev_end = e_[6]
            if prev_end is not None: rows["end->cta end"].append(cta[c, 3] - prev_end)
        print(f"   blocks {blocks}, tiles {tiles_total}, blocks/CTA {blocks/len(used):.2f}")
        # the producer (events 32 ..) against consumer 0's stamps of the same block
        prow = {k: [] for k in ["P fetch (top->index)", "P decode (index->run)", "P q free wait", "P q issue",
                                "P q issued -> C q landed", "P loop end -> next top", "P top - C0 prev loop end",
                                "P q issued - C0 entry"]}
        for c in used:
            for k in range(16):
                t = tl[c, k]
                if t[32] == 0 or t[36] == 0 or t[1] == 0: continue
                prow["P fetch (top->index)"].append(t[33] - t[32]); prow["P decode (index->run)"].append(t[34] - t[33])
                prow["P q free wait"].append(t[35] - t[34]); prow["P q issue"].append(t[36] - t[35])
                prow["P q issued -> C q landed"].append(t[1] - t[36]); prow["P q issued - C0 entry"].append(t[36] - t[0])
                if k > 0 and tl[c, k - 1][37] != 0:
                    prow["P loop end -> next top"].append(t[32] - tl[c, k - 1][37])
                    prow["P top - C0 prev loop end"].append(t[32] - tl[c, k - 1][4])
        rows.update(prow)
        for k, v in rows.items():
            if v:
                v = np.asarray(v, float)
                print(f"   {k:24s} mean {v.mean():9.0f}  p10 {np.percentile(v,10):9.0f}  p90 {np.percentile(v,90):9.0f}  (cycles)")
        # per-CTA busy: sum of block totals vs CTA lifetime
        life = (c1 - c0).astype(float)
        print(f"   CTA lifetime mean {life.mean():.0f} max {life.max():.0f} cycles; span*clock {span_ns*ghz:.0f}")

def single(seq, heads, hd, causal):
    q = torch.randn(seq, heads, hd, device="cuda", dtype=torch.bfloat16)
    k = torch.randn_like(q); v = torch.randn_like(q)
    flops = 4 * seq * seq * heads * hd * (0.5 if causal else 1)
    return (lambda: pfa.single_prefill_with_kv_cache(q, k, v, causal=causal)), flops

def ragged(causal):
    rng = np.random.RandomState(0)
    lens = rng.randint(1024, 4097, 16)
    ind = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(ind[-1])
    q = torch.randn(T, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, 8, 128, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = pfa.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    w.plan(ind, ind, 32, 8, 128, causal=causal, q_data_type=torch.bfloat16)
    flops = sum(4 * 32 * 128 * (l * l * (0.5 if causal else 1)) for l in lens)
    return (lambda: w.run(q, k, v)), flops

def paged(causal, ps=16):
    """The ragged batch's lengths in a paged cache (NHD, pages in random order): the cp.async
    producer's kernel, so its rows have the consumers' stamps only (the P rows are the TMA
    producer's)."""
    rng = np.random.RandomState(0)
    lens = rng.randint(1024, 4097, 16)
    ind = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    npg = [(int(l) + ps - 1) // ps for l in lens]
    kvi = np.concatenate([[0], np.cumsum(npg)]).astype(np.int32)
    perm = np.random.RandomState(1).permutation(sum(npg)).astype(np.int32)
    last = np.array([int(l) - (n - 1) * ps for l, n in zip(lens, npg)], np.int32)
    q = torch.randn(int(ind[-1]), 32, 128, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(sum(npg), 2, ps, 8, 128, device="cuda", dtype=torch.bfloat16)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = pfa.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(ind, kvi, perm, last, 32, 8, 128, ps, causal=causal, q_data_type=torch.bfloat16)
    flops = sum(4 * 32 * 128 * (l * l * (0.5 if causal else 1)) for l in lens)
    return (lambda: w.run(q, cache)), flops

def e4m3(seq, causal):
    """clock_probe.py's e4m3 row (trtllm_fmha_v2_prefill, CONTIGUOUS_Q_KV, 16384 / seq requests of
    seq, 16 x 128, e4m3 into bf16): the fp8 TMA row's consumer and producer stamps."""
    from clock_probe import e4m3_pair

    flops, fns = e4m3_pair(seq, causal, None)
    return fns[0][1], flops

# TL_CASES=<substring>[,<substring>...] runs only the cases whose label contains one of them (a
# whole run took over 200 s in session 34); each case's wall time is printed after it.
cases = [("1x2048 hd128 16h full", lambda: single(2048, 16, 128, False)),
         ("1x4096 hd128 16h full", lambda: single(4096, 16, 128, False)),
         ("1x4096 hd128 16h causal", lambda: single(4096, 16, 128, True)),
         ("1x16384 hd128 16h full", lambda: single(16384, 16, 128, False)),
         ("ragged 16x1k-4k causal", lambda: ragged(True)),
         ("ragged 16x1k-4k full", lambda: ragged(False)),
         ("paged 16x1k-4k causal", lambda: paged(True)),
         ("paged 16x1k-4k full", lambda: paged(False)),
         ("e4m3 4x4096 full", lambda: e4m3(4096, False)),
         ("e4m3 1x16384 full", lambda: e4m3(16384, False)),
         ("e4m3 16x1024 full", lambda: e4m3(1024, False))]
want = [w for w in os.environ.get("TL_CASES", "").split(",") if w]
for label, make in cases:
    if want and not any(w in label for w in want):
        continue
    t0 = time.time()
    analyse(label, *make())
    print(f"   ({time.time() - t0:.1f} s)", flush=True)
