"""``python -m pyflashattn.bench jax``: pyflashattn.jax inside jax.jit against the eager call on the
same JAX arrays and, where it applies, jax.nn.dot_product_attention (cuDNN), in one run.

Times are wall clock over pipelined calls ended by one block_until_ready (the kernels here run for
tens of microseconds to milliseconds, far above a call's dispatch), median of interleaved rounds.
"host us/call" is the time the host spends issuing one call (dispatch loop, no wait), in a row
small enough that the GPU never holds the host back: for a jitted call with a warm command buffer
that is XLA's dispatch alone ("python launches" counts the callbacks that ran: 0 a call once the
buffer is recorded), for the eager call the whole run() path.

XLA records a sequence into a command buffer from xla_gpu_graph_min_graph_size commands on (5 by
default), which a model's step reaches and these one-call functions do not: unless XLA_FLAGS sets
it, the benchmark sets it to 1 (--xla-default leaves XLA's default).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def _block(x):
    for leaf in (x if isinstance(x, tuple) else (x,)):
        leaf.block_until_ready()


def _wall_ms(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn()
    _block(out)
    return (time.perf_counter() - t0) / n * 1e3


def _dispatch_us(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn()
    t1 = time.perf_counter()
    _block(out)
    return (t1 - t0) / n * 1e6


def _measure(fns: dict, n: int, rounds: int) -> dict:
    """name -> (median ms/call, median host us/call), the fns interleaved round by round."""
    for fn in fns.values():
        _block(fn())
        _block(fn())
    ms, us = {k: [] for k in fns}, {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            ms[k].append(_wall_ms(fn, n))
            us[k].append(_dispatch_us(fn, n))
    return {k: (statistics.median(ms[k]), statistics.median(us[k])) for k in fns}


def _single_rows(jax, jnp, pfa, pfj, quick: bool) -> list:
    rows = []
    rng = np.random.default_rng(0)
    for seq, causal in ((16384, False), (16384, True)) if not quick else ((16384, True),):
        h, d = 16, 128
        q, k, v = (jnp.asarray(rng.standard_normal((seq, h, d)).astype(np.float32), jnp.bfloat16) for _ in range(3))
        jit = jax.jit(lambda q, k, v: pfj.single_prefill_with_kv_cache(q, k, v, causal=causal))
        fns = {"jit": lambda: jit(q, k, v), "eager": lambda: pfa.single_prefill_with_kv_cache(q, k, v, causal=causal)}
        try:
            cud = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=causal,
                                                                       implementation="cudnn")[0])
            _block(cud(q, k, v))
            fns["cudnn"] = lambda: cud(q, k, v)
        except Exception as e:  # noqa: BLE001 - cuDNN attention unavailable in this JAX: the row says so
            print(f"  jax.nn.dot_product_attention(cudnn): {type(e).__name__}: {str(e)[:120]}")
        res = _measure(fns, 10, 5)
        flops = 4 * seq * seq * h * d * (0.5 if causal else 1.0)
        rows.append({"case": f"single 1x{seq} hd{d} {'causal' if causal else 'full'}",
                     **{f"{k}_ms": round(t, 4) for k, (t, _) in res.items()},
                     **{f"{k}_tflops": round(flops / t / 1e9, 1) for k, (t, _) in res.items()},
                     "jit/eager time": round(res["jit"][0] / res["eager"][0], 4)})
    return rows


def _decode_calls(jax, jnp, pfa, pfj, B: int, seq: int, seed: int):
    """A paged decode batch (32/8 heads, hd128, page 16, random page order): the jitted wrapper,
    its call and the eager wrapper's call on the same arrays."""
    rng = np.random.default_rng(seed)
    hq, hkv, d, ps = 32, 8, 128, 16
    pages = B * seq // ps
    cache = jnp.asarray(rng.standard_normal((pages, 2, ps, hkv, d)).astype(np.float32), jnp.bfloat16)
    indptr = (np.arange(B + 1) * (seq // ps)).astype(np.int32)
    idx, last = rng.permutation(pages).astype(np.int32), np.full(B, ps, np.int32)
    q = jnp.asarray(rng.standard_normal((B, hq, d)).astype(np.float32), jnp.bfloat16)
    w = pfj.BatchDecodeWithPagedKVCacheWrapper("NHD", max_batch_size=B, max_num_pages=pages)
    plan = w.plan(indptr, idx, last, hq, hkv, d, ps, q_data_type="bfloat16")
    jit = jax.jit(w.run)
    ew = pfa.BatchDecodeWithPagedKVCacheWrapper(jnp.zeros(64 << 20, jnp.uint8), "NHD")
    ew.plan(indptr, idx, last, hq, hkv, d, ps, q_data_type="bfloat16")
    return w, {"jit": lambda: jit(q, cache, plan), "eager": lambda: ew.run(q, cache)}


def _decode_row(jax, jnp, pfa, pfj) -> dict:
    B, seq = 64, 4096
    _, fns = _decode_calls(jax, jnp, pfa, pfj, B, seq, 1)
    res = _measure(fns, 200, 5)
    nbytes = 2 * B * seq * 8 * 128 * 2
    return {"case": f"decode B={B} x {seq} 32/8 hd128 page 16",
            **{f"{k}_ms": round(t, 4) for k, (t, _) in res.items()},
            **{f"{k}_TBps": round(nbytes / t / 1e9, 3) for k, (t, _) in res.items()},
            "jit/eager time": round(res["jit"][0] / res["eager"][0], 4)}


def _host_row(jax, jnp, pfa, pfj) -> dict:
    """Host time per call of a small decode (B=8 x 256 keys: microseconds of GPU work)."""
    B, seq = 8, 256
    w, fns = _decode_calls(jax, jnp, pfa, pfj, B, seq, 3)
    n, rounds = 2000, 3
    _block(fns["jit"]())
    before = sum(c.python_launches for c in w.calls.values())
    res = _measure(fns, n, rounds)
    launches = sum(c.python_launches for c in w.calls.values()) - before
    calls = 2 + 2 * rounds * n  # _measure: two warm-up calls, then two loops of n a round
    return {"case": f"host time: decode B={B} x {seq} 32/8 hd128",
            **{f"{k}_host_us": round(u, 2) for k, (_, u) in res.items()},
            **{f"{k}_ms": round(t, 4) for k, (t, _) in res.items()},
            "jit python launches per call": round(launches / calls, 4)}


def _paged_row(jax, jnp, pfa, pfj) -> dict:
    rng = np.random.default_rng(2)
    lens = [1024, 2048, 3072, 4096] * 2
    hq, hkv, d, ps = 32, 8, 128, 16
    pages_of = [n // ps for n in lens]
    pages = sum(pages_of)
    cache = jnp.asarray(rng.standard_normal((pages, 2, ps, hkv, d)).astype(np.float32), jnp.bfloat16)
    qo = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    kvp = np.concatenate([[0], np.cumsum(pages_of)]).astype(np.int32)
    idx, last = rng.permutation(pages).astype(np.int32), np.full(len(lens), ps, np.int32)
    q = jnp.asarray(rng.standard_normal((int(qo[-1]), hq, d)).astype(np.float32), jnp.bfloat16)
    w = pfj.BatchPrefillWithPagedKVCacheWrapper("NHD", max_batch_size=len(lens), max_num_pages=pages,
                                                max_num_tokens=int(qo[-1]))
    plan = w.plan(qo, kvp, idx, last, hq, hkv, d, ps, causal=True, q_data_type="bfloat16")
    jit = jax.jit(w.run)
    ew = pfa.BatchPrefillWithPagedKVCacheWrapper(jnp.zeros(64 << 20, jnp.uint8), "NHD")
    ew.plan(qo, kvp, idx, last, hq, hkv, d, ps, causal=True, q_data_type="bfloat16")
    res = _measure({"jit": lambda: jit(q, cache, plan), "eager": lambda: ew.run(q, cache)}, 10, 5)
    flops = sum(4 * n * n * hq * d * 0.5 for n in lens)
    return {"case": f"paged causal {len(lens)} x 1k-4k 32/8 hd128 page {ps}",
            **{f"{k}_ms": round(t, 4) for k, (t, _) in res.items()},
            **{f"{k}_tflops": round(flops / t / 1e9, 1) for k, (t, _) in res.items()},
            "jit/eager time": round(res["jit"][0] / res["eager"][0], 4)}


def _row(case: str, res: dict, unit: str, work: float) -> dict:
    """A row of times, their throughput (`unit`: "tflops" for work in FLOPs, "TBps" in bytes) and
    jit / eager (when timed)."""
    row = {"case": case, **{f"{k}_ms": round(t, 4) for k, (t, _) in res.items()},
           **{f"{k}_{unit}": round(work / t / 1e9, 3) for k, (t, _) in res.items()}}
    if "eager" in res:
        row["jit/eager time"] = round(res["jit"][0] / res["eager"][0], 4)
    return row


def _rand(jnp, rng, shape, dtype="bfloat16"):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype)


def _ragged_row(jax, jnp, pfa, pfj) -> dict:
    rng = np.random.default_rng(4)
    lens, hq, hkv, d = [1024, 2048, 3072, 4096] * 2, 32, 8, 128
    ind = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v = _rand(jnp, rng, (int(ind[-1]), hq, d)), _rand(jnp, rng, (int(ind[-1]), hkv, d)), \
        _rand(jnp, rng, (int(ind[-1]), hkv, d))
    w = pfj.BatchPrefillWithRaggedKVCacheWrapper("NHD", max_batch_size=len(lens), max_num_tokens=int(ind[-1]))
    plan = w.plan(ind, ind, hq, hkv, d, causal=True, q_data_type="bfloat16")
    jit = jax.jit(w.run)
    ew = pfa.BatchPrefillWithRaggedKVCacheWrapper(jnp.zeros(64 << 20, jnp.uint8), "NHD")
    ew.plan(ind, ind, hq, hkv, d, causal=True, q_data_type="bfloat16")
    res = _measure({"jit": lambda: jit(q, k, v, plan), "eager": lambda: ew.run(q, k, v)}, 10, 5)
    return _row(f"ragged causal {len(lens)} x 1k-4k 32/8 hd128", res, "tflops",
                sum(4 * n * n * hq * d * 0.5 for n in lens))


def _xqa_row(jax, jnp, pfa, pfj) -> dict:
    rng = np.random.default_rng(5)
    B, seq, hq, hkv, d, ps = 64, 4096, 32, 8, 128, 16
    pages = B * seq // ps
    cache = _rand(jnp, rng, (pages, 2, ps, hkv, d))
    bt = jnp.asarray(rng.permutation(pages).astype(np.int32).reshape(B, -1))
    sl = jnp.full((B,), seq, jnp.int32)
    q, ws = _rand(jnp, rng, (B, hq, d)), jnp.zeros(128 << 20, jnp.uint8)
    jit = jax.jit(lambda q, c, bt, sl: pfj.xqa_batch_decode_with_kv_cache(q, c, ws, bt, sl, seq))
    res = _measure({"jit": lambda: jit(q, cache, bt, sl),
                    "eager": lambda: pfa.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, sl, seq)}, 200, 5)
    return _row(f"xqa B={B} x {seq} 32/8 hd128 page {ps}", res, "TBps", 2 * B * seq * hkv * d * 2)


def _trtllm_row(jax, jnp, pfa, pfj) -> dict:
    rng = np.random.default_rng(6)
    B, seq, h, d = 4, 4096, 16, 128
    q, kv = _rand(jnp, rng, (B * seq, h, d)), _rand(jnp, rng, (B * seq, 2, h, d))
    sl = jnp.full((B,), seq, jnp.int32)
    cum = jnp.asarray(np.arange(B + 1, dtype=np.int32) * seq)
    ws = jnp.zeros(128 << 20, jnp.uint8)
    args = ("CONTIGUOUS_Q_KV", ws, sl, seq, seq, 1 / d ** 0.5, 1.0, B, cum, cum)
    jit = jax.jit(lambda q, kv: pfj.trtllm_fmha_v2_prefill((q, kv), *args))
    res = _measure({"jit": lambda: jit(q, kv), "eager": lambda: pfa.trtllm_fmha_v2_prefill((q, kv), *args)}, 10, 5)
    return _row(f"trtllm_fmha_v2_prefill contiguous causal {B} x {seq} hd{d}", res, "tflops",
                B * 4 * seq * seq * h * d * 0.5)


def _merge_append_row(jax, jnp, pfa, pfj) -> dict:
    """merge_state of 8192 x 32 x 128 bf16 states (jit vs eager, TB/s of states read and written)
    and a 64-token append into a paged cache (jit only: an eager append refuses JAX caches)."""
    rng = np.random.default_rng(7)
    n, h, d = 8192, 32, 128
    va, vb = _rand(jnp, rng, (n, h, d)), _rand(jnp, rng, (n, h, d))
    sa, sb = _rand(jnp, rng, (n, h), "float32"), _rand(jnp, rng, (n, h), "float32")
    jit = jax.jit(pfj.merge_state)
    res = _measure({"jit": lambda: jit(va, sa, vb, sb), "eager": lambda: pfa.merge_state(va, sa, vb, sb)}, 50, 5)
    row = _row(f"merge_state {n} x {h} x {d} bf16", res, "TBps", 3 * n * h * (d * 2 + 4))
    pages, ps, hkv = 1024, 16, 8
    cache = _rand(jnp, rng, (pages, 2, ps, hkv, d))
    kn, vn = _rand(jnp, rng, (64, hkv, d)), _rand(jnp, rng, (64, hkv, d))
    ind = jnp.asarray(np.arange(65, dtype=np.int32) * (pages // 64))
    idx = jnp.arange(pages, dtype=jnp.int32)
    last, bi = jnp.full((64,), 1, jnp.int32), jnp.arange(64, dtype=jnp.int32)
    pos = jnp.full((64,), (pages // 64 - 1) * ps, jnp.int32)
    app = jax.jit(lambda c, kn, vn: pfj.append_paged_kv_cache(kn, vn, bi, pos, c, idx, ind, last), donate_argnums=0)
    state = {"cache": cache}

    def step():
        state["cache"] = app(state["cache"], kn, vn)
        return state["cache"]

    t = _measure({"jit": step}, 200, 5)["jit"]
    row["append 64 tokens jit_ms"], row["append jit_host_us"] = round(t[0], 4), round(t[1], 2)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pyflashattn.bench jax", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the causal 16k single prefill row only, then decode")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    ap.add_argument("--xla-default", action="store_true", help="leave xla_gpu_graph_min_graph_size at XLA's default")
    args = ap.parse_args(argv)
    flags = os.environ.get("XLA_FLAGS", "")
    if not args.xla_default and "xla_gpu_graph_min_graph_size" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_gpu_graph_min_graph_size=1").strip()
    try:
        import jax
        import jax.numpy as jnp
        jax.devices("gpu")
    except Exception as e:  # noqa: BLE001
        print(f"pyflashattn bench jax: needs JAX with a CUDA GPU ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    import pyflashattn as pfa
    import pyflashattn.jax as pfj

    rows = _single_rows(jax, jnp, pfa, pfj, args.quick) + [_decode_row(jax, jnp, pfa, pfj),
                                                           _host_row(jax, jnp, pfa, pfj)]
    if not args.quick:
        rows += [f(jax, jnp, pfa, pfj) for f in (_paged_row, _ragged_row, _xqa_row, _trtllm_row, _merge_append_row)]
    for r in rows:
        print("  ".join(f"{k}={v}" for k, v in r.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(jax.devices("gpu")[0].device_kind), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
