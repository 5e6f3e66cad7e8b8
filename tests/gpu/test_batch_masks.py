"""Per-request custom masks in the batch wrappers (bool flat and packed segments), GPU.

Each request's rows are checked against the float64 reference with the same mask, so a mask
read from the wrong request segment, bit order or row stride fails; fully masked rows must give
o = 0 and lse = -inf."""
import numpy as np
import pytest

import pyflashattn
from pyflashattn.quantization import segment_packbits
from pyflashattn.testing.gpu import require_cuda_torch
from pyflashattn.testing.reference import attention_ref

torch = require_cuda_torch()
pytestmark = pytest.mark.gpu


def _batch(qo, kv, hq, hkv, d, seed, dt=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(qo), hq, d, generator=g, device="cuda").to(dt)
    k = torch.randn(sum(kv), hkv, d, generator=g, device="cuda").to(dt)
    v = torch.randn(sum(kv), hkv, d, generator=g, device="cuda").to(dt)
    return q, k, v


def _ind(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("density", [0.1, 0.6])
@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_batch_custom_mask_matches_reference(packed, density, kind):
    rng = np.random.default_rng(int(density * 100) + 7 * packed + (kind == "paged"))
    qo = [37, 1, 0, 130, 9]
    kv = [200, 65, 10, 1500, 0]
    hq, hkv, d = 8, 2, 128
    q, k, v = _batch(qo, kv, hq, hkv, d, seed=11 + packed)
    masks = [rng.random((a, b)) < density for a, b in zip(qo, kv)]
    masks[0][3] = False  # a fully masked row
    flat = np.concatenate([m.reshape(-1) for m in masks]) if masks else np.zeros(0, bool)
    flat_t = torch.as_tensor(flat, device="cuda")
    kw = {}
    if packed:
        seg = np.concatenate([[0], np.cumsum([m.size for m in masks])])
        kw["packed_custom_mask"], _ = segment_packbits(flat_t, seg, bitorder="little")
    else:
        kw["custom_mask"] = flat_t
    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    if kind == "ragged":
        w = pyflashattn.BatchPrefillWithRaggedKVCacheWrapper(ws)
        w.plan(_ind(qo), _ind(kv), hq, hkv, d, causal=True, q_data_type=torch.bfloat16, **kw)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((q.shape[0], hq), float("nan"), device="cuda")
        w.run(q, k, v, out=out, lse=lse)
    else:
        ps = 16
        pages = [(n + ps - 1) // ps for n in kv]
        perm = rng.permutation(sum(pages) + 3).astype(np.int32)
        cache = torch.randn(len(perm), 2, ps, hkv, d, device="cuda").to(torch.bfloat16)
        kvp = _ind(kv)
        pin = _ind(pages)
        for b, n in enumerate(kv):
            for j in range(pages[b]):
                t0, t1 = j * ps, min((j + 1) * ps, n)
                pg = perm[pin[b] + j]
                cache[pg, 0, :t1 - t0] = k[kvp[b] + t0:kvp[b] + t1]
                cache[pg, 1, :t1 - t0] = v[kvp[b] + t0:kvp[b] + t1]
        last = np.array([n - (p - 1) * ps if p else 1 for n, p in zip(kv, pages)], np.int32)
        w = pyflashattn.BatchPrefillWithPagedKVCacheWrapper(ws)
        w.plan(_ind(qo), pin, perm[:max(pin[-1], 1)], last, hq, hkv, d, ps, causal=True,
               q_data_type=torch.bfloat16, **kw)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((q.shape[0], hq), float("nan"), device="cuda")
        w.run(q, cache, out=out, lse=lse)
    torch.cuda.synchronize()
    qi, ki = _ind(qo), _ind(kv)
    for b in range(len(qo)):
        if qo[b] == 0:
            continue
        sl = slice(qi[b], qi[b + 1])
        o_b, l_b = out[sl].float().cpu().numpy(), lse[sl].cpu().numpy()
        if kv[b] == 0:
            assert (o_b == 0).all() and np.isneginf(l_b).all()
            continue
        ro, rl = attention_ref(q[sl].float().cpu().numpy(), k[ki[b]:ki[b + 1]].float().cpu().numpy(),
                               v[ki[b]:ki[b + 1]].float().cpu().numpy(), custom_mask=masks[b])
        assert not np.isnan(o_b).any() and not np.isnan(l_b).any()
        np.testing.assert_allclose(o_b, ro, atol=1e-2, rtol=1e-2)
        fin = np.isfinite(rl)
        assert (np.isneginf(l_b) == ~fin).all(), "fully masked rows must give lse = -inf"
        np.testing.assert_allclose(l_b[fin], rl[fin], atol=1e-2, rtol=1e-2)
        assert (o_b[~fin.all(axis=1)] == 0).all() if (~fin).any() else True
    if not packed and kind == "ragged":
        bad = torch.ones(flat.size + 1, dtype=torch.bool, device="cuda")
        with pytest.raises(ValueError, match="custom_mask"):
            w.plan(_ind(qo), _ind(kv), hq, hkv, d, custom_mask=bad, q_data_type=torch.bfloat16)
