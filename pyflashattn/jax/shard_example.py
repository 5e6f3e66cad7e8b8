"""``python -m pyflashattn.jax.shard_example``: one jitted prefill per local GPU under ``shard_map``.

The heads of one request are sharded over a mesh of every local GPU JAX sees; each device runs
pyflashattn's kernel on its own shard (plans are built for every local GPU at trace time). The
result is checked against the eager call on each shard's arrays, bit for bit, and the per-device
launch is timed. On one GPU the mesh has one device.
"""
from __future__ import annotations

import sys
import time

import numpy as np


def main(argv=None) -> int:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    try:
        from jax import shard_map
    except ImportError:  # older JAX
        from jax.experimental.shard_map import shard_map
    import pyflashattn
    import pyflashattn.jax as pfj

    devs = jax.local_devices(backend="gpu")
    n = len(devs)
    seq, hq, hkv, d = 8192, 8 * n, 2 * n, 128
    mesh = Mesh(np.array(devs), ("heads",))
    spec = P(None, "heads", None)
    rng = np.random.default_rng(0)
    q, k, v = (jax.device_put(jnp.asarray(rng.standard_normal((seq, h, d)).astype(np.float32), jnp.bfloat16),
                              NamedSharding(mesh, spec)) for h in (hq, hkv, hkv))
    fn = jax.jit(shard_map(lambda q, k, v: pfj.single_prefill_with_kv_cache(q, k, v, causal=True), mesh=mesh,
                           in_specs=(spec, spec, spec), out_specs=spec))
    o = fn(q, k, v)
    o.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(10):
        o = fn(q, k, v)
    o.block_until_ready()
    ms = (time.perf_counter() - t0) / 10 * 1e3
    ok = True
    for shard in o.addressable_shards:  # each device's heads against the eager call on that device
        h0, h1, _ = shard.index[1].indices(hq)
        heads, kh = slice(h0, h1), slice(h0 // (hq // hkv), h1 // (hq // hkv))
        ref = pyflashattn.single_prefill_with_kv_cache(
            jax.device_put(q[:, heads], shard.device), jax.device_put(k[:, kh], shard.device),
            jax.device_put(v[:, kh], shard.device), causal=True)
        same = np.array_equal(np.asarray(shard.data).view(np.uint16), np.asarray(ref).view(np.uint16))
        ok &= same
        print(f"{shard.device}: heads {h0}..{h1 - 1}, jit == eager bit for bit: {same}")
    print(f"{n} device(s), {seq} tokens x {hq} heads x {d}, causal: {ms:.3f} ms per sharded call")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
