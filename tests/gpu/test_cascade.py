"""pyflashattn.cascade on the GPU: merge_state, merge_state_in_place and merge_states against the
float64 reference merge (pyflashattn.testing.reference.merge_states_ref) on fresh random states.

Outputs the library allocates are poisoned first (NaN blocks freed into torch's caching allocator
just before the call, so the outputs reuse them); in-place updates start from the inputs and rows
the mask leaves out must come back bit for bit. Empty states (LSE -inf) have NaN values, which
the merge must never read. Values fp16 / bf16 / fp32, head dims 64 / 128 / 256 and odd ones (80:
16-byte path; 37: element path), odd seq and head counts, 1 / 2 / 5 / 40 states, both LSE bases,
strided and unaligned inputs; torch, CuPy and JAX inputs; the errors FlashInfer's merge does not
raise (JAX in place, a non-float32 s); a CUDA graph replaying a masked in-place merge.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from pyflashattn.testing.gpu import require_cuda_torch

pytestmark = pytest.mark.gpu

torch = require_cuda_torch()

import pyflashattn  # noqa: E402
from pyflashattn import cascade  # noqa: E402
from pyflashattn.testing.checks import assert_close  # noqa: E402
from pyflashattn.testing.gpu import cuda_generator as _gen, require_cupy as _cupy  # noqa: E402
from pyflashattn.testing.frameworks import capture_torch_graph, jax_gpu  # noqa: E402
from pyflashattn.testing.reference import merge_state_ref, merge_states_ref, to_numpy_f64  # noqa: E402

DEV = "cuda"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
V_TOL = {torch.float16: dict(atol=1e-3, rtol=1e-3), torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
         torch.float32: dict(atol=1e-5, rtol=1e-5)}
S_TOL = dict(atol=1e-5, rtol=1e-5)  # LSEs are float32 in and out, whatever the values' dtype
LN2 = math.log(2.0)


def _states(shape, dt, key, empty_frac=0.1):
    """Random values [..., D] and float32 LSEs [...] a few units apart (every state weighs in);
    a fraction of the states empty: LSE -inf, values NaN (never to be read)."""
    g = _gen(*key)
    v = torch.randn(shape, device=DEV, generator=g).to(dt)
    s = torch.rand(shape[:-1], device=DEV, generator=g) * 12.0 - 6.0
    empty = torch.rand(shape[:-1], device=DEV, generator=g) < empty_frac
    s[empty] = -math.inf
    v[empty] = math.nan
    return v, s


def _poison(*shapes_dtypes):
    """Fill blocks of the outputs' sizes with NaN and free them: torch's caching allocator hands
    them to the next allocations of those sizes on this stream, i.e. to the merge's outputs."""
    blocks = [torch.full(shape, math.nan, dtype=dt, device=DEV) for shape, dt in shapes_dtypes]
    del blocks


def _check(v, s, ref, dt, what):
    assert_close(v, ref[0], **V_TOL[dt], what=f"{what} v")
    assert_close(s, ref[1], **S_TOL, what=f"{what} s")


# ---------------------------------------------------------------- merge_state

PAIR_SHAPES = [(1, 1, 64), (7, 3, 128), (33, 5, 256), (130, 8, 128), (9, 7, 80), (11, 3, 37)]


@pytest.mark.parametrize("lse_base", ["log2", "ln"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", PAIR_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_merge_state(shape, dtype, lse_base):
    dt = DTYPES[dtype]
    v_a, s_a = _states(shape, dt, ("a", shape, dtype))
    v_b, s_b = _states(shape, dt, ("b", shape, dtype))
    s_a[0, 0] = s_b[0, 0] = -math.inf  # a row with no keys on either side
    _poison((shape, dt), (shape[:2], torch.float32))
    v, s = cascade.merge_state(v_a, s_a, v_b, s_b, lse_base=lse_base)
    torch.cuda.synchronize()
    assert isinstance(v, torch.Tensor) and v.dtype == dt and v.shape == v_a.shape and v.device == v_a.device
    assert s.dtype == torch.float32 and s.shape == s_a.shape
    _check(v, s, merge_state_ref(v_a, s_a, v_b, s_b, lse_base=lse_base), dt, f"{shape} {dtype} {lse_base}")
    assert (v[0, 0] == 0).all() and s[0, 0] == -math.inf


def test_merge_state_ln_is_log2_rescaled():
    v_a, s_a = _states((17, 4, 128), torch.float16, ("ln", 0))
    v_b, s_b = _states((17, 4, 128), torch.float16, ("ln", 1))
    v2, s2 = cascade.merge_state(v_a, s_a, v_b, s_b)
    ve, se = cascade.merge_state(v_a, s_a * LN2, v_b, s_b * LN2, lse_base="ln")
    assert_close(ve, v2, atol=1e-3, rtol=1e-3, what="v")
    assert_close(se, s2 * LN2, atol=1e-5, rtol=1e-5, what="s")


def test_merge_state_strided_and_unaligned_inputs():
    seq, h, d = 21, 6, 128
    dt = torch.bfloat16
    g = _gen("strided")
    v_a = torch.randn(seq, h, d + 64, device=DEV, generator=g).to(dt)[:, :, 32:32 + d]  # padded rows, 16B aligned
    v_b = torch.randn(h, seq, d, device=DEV, generator=g).to(dt).transpose(0, 1)  # head-major
    s_a = (torch.rand(h, seq, device=DEV, generator=g) * 8 - 4).t()  # head-major LSE
    s_b = torch.rand(seq, h, device=DEV, generator=g) * 8 - 4
    v, s = cascade.merge_state(v_a, s_a, v_b, s_b)
    _check(v, s, merge_state_ref(v_a, s_a, v_b, s_b), dt, "strided")
    # 2 bytes off a 16-byte boundary: the element path
    flat = torch.randn(seq * h * d + 1, device=DEV, generator=g).to(dt)
    v_u = flat[1:].view(seq, h, d)
    v, s = cascade.merge_state(v_a, s_a, v_u, s_b)
    _check(v, s, merge_state_ref(v_a, s_a, v_u, s_b), dt, "unaligned")


def test_merge_state_on_a_side_stream():
    v_a, s_a = _states((64, 4, 128), torch.float16, ("side", 0))
    v_b, s_b = _states((64, 4, 128), torch.float16, ("side", 1))
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        v, s = cascade.merge_state(v_a, s_a, v_b, s_b)
    st.synchronize()
    _check(v, s, merge_state_ref(v_a, s_a, v_b, s_b), torch.float16, "side stream")


# ---------------------------------------------------------------- merge_state_in_place

@pytest.mark.parametrize("mask_kind", [None, "bool", "uint8"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(13, 3, 128), (5, 1, 64), (40, 8, 256), (7, 2, 37)], ids=lambda s: "x".join(map(str, s)))
def test_merge_state_in_place(shape, dtype, mask_kind):
    dt = DTYPES[dtype]
    v, s = _states(shape, dt, ("ip", shape, dtype), empty_frac=0.0)
    v_o, s_o = _states(shape, dt, ("ipo", shape, dtype))
    v0, s0 = v.clone(), s.clone()
    keep = torch.rand(shape[0], device=DEV, generator=_gen("mask", shape)) < 0.6
    mask = None if mask_kind is None else keep if mask_kind == "bool" else keep.to(torch.uint8) * 7
    assert cascade.merge_state_in_place(v, s, v_o, s_o, mask) is None
    torch.cuda.synchronize()
    rows = keep if mask is not None else torch.ones_like(keep)
    ref_v, ref_s = merge_state_ref(v0, s0, v_o, s_o)
    r = rows.cpu().numpy()
    _check(v[rows], s[rows], (ref_v[r], ref_s[r]), dt, f"in place {shape} {dtype}")
    assert torch.equal(v[~rows].view(torch.uint8), v0[~rows].view(torch.uint8)), "masked-out rows of v changed"
    assert torch.equal(s[~rows].view(torch.uint8), s0[~rows].view(torch.uint8)), "masked-out rows of s changed"


def test_merge_state_in_place_graph_replay():
    """One captured masked in-place merge, replayed with new states and a new mask each time."""
    shape, dt = (24, 4, 128), torch.float16
    v, s = _states(shape, dt, ("graph", "v"), empty_frac=0.0)
    v_o, s_o = _states(shape, dt, ("graph", "o"))
    mask = torch.ones(shape[0], dtype=torch.bool, device=DEV)
    graph = capture_torch_graph(lambda: cascade.merge_state_in_place(v, s, v_o, s_o, mask))
    for rnd in range(3):
        nv, ns = _states(shape, dt, ("graph", rnd, "v"), empty_frac=0.0)
        no, nso = _states(shape, dt, ("graph", rnd, "o"))
        keep = torch.rand(shape[0], device=DEV, generator=_gen("graph mask", rnd)) < 0.5
        v.copy_(nv), s.copy_(ns), v_o.copy_(no), s_o.copy_(nso), mask.copy_(keep)
        graph.replay()
        torch.cuda.synchronize()
        ref_v, ref_s = merge_state_ref(nv, ns, no, nso)
        k = keep.cpu().numpy()
        _check(v[keep], s[keep], (ref_v[k], ref_s[k]), dt, f"replay {rnd}")
        assert torch.equal(v[~keep], nv[~keep]) and torch.equal(s[~keep], ns[~keep])


# ---------------------------------------------------------------- merge_states

@pytest.mark.parametrize("lse_base", ["log2", "ln"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n", [1, 2, 5, 40])
@pytest.mark.parametrize("shape", [(9, 3, 128), (1, 16, 64), (31, 5, 256), (6, 3, 80)], ids=lambda s: "x".join(map(str, s)))
def test_merge_states(shape, n, dtype, lse_base):
    dt = DTYPES[dtype]
    seq, h, d = shape
    v, s = _states((seq, n, h, d), dt, ("states", shape, n, dtype), empty_frac=0.2)
    s[0, :, 0] = -math.inf  # a row and head with every state empty
    _poison((shape, dt), ((seq, h), torch.float32))
    out, lse = cascade.merge_states(v, s, lse_base=lse_base)
    torch.cuda.synchronize()
    assert out.shape == shape and out.dtype == dt and lse.shape == (seq, h) and lse.dtype == torch.float32
    _check(out, lse, merge_states_ref(v, s, lse_base=lse_base), dt, f"{shape} n={n} {dtype} {lse_base}")
    assert (out[0, 0] == 0).all() and lse[0, 0] == -math.inf
    if n == 1:  # one state: a copy, bit for bit, where it has keys
        live = s[:, 0] != -math.inf
        assert torch.equal(out[live], v[:, 0][live]) and torch.equal(lse[live], s[:, 0][live])


def test_merge_states_equals_merge_state_and_strided_stack():
    shape, dt = (19, 4, 128), torch.bfloat16
    v_a, s_a = _states(shape, dt, ("eq", "a"))
    v_b, s_b = _states(shape, dt, ("eq", "b"))
    v1, s1 = cascade.merge_state(v_a, s_a, v_b, s_b)
    # the stack as a view: states in dim 1 of a [seq, H, N, D] buffer
    buf = torch.stack([v_a, v_b], dim=2)
    out, lse = cascade.merge_states(buf.transpose(1, 2), torch.stack([s_a, s_b], dim=1))
    torch.cuda.synchronize()
    assert torch.equal(out, v1) and torch.equal(lse, s1)


# ---------------------------------------------------------------- errors

def test_errors_then_the_library_still_works():
    v, s = _states((8, 2, 64), torch.float16, ("err",), empty_frac=0.0)
    v_o, s_o = _states((8, 2, 64), torch.float16, ("err", "o"), empty_frac=0.0)
    with pytest.raises(TypeError, match="s must be float32.*loses the update"):
        cascade.merge_state_in_place(v, s.half(), v_o, s_o)
    with pytest.raises(TypeError, match="s_b must be float32"):
        cascade.merge_state(v, s, v_o, s_o.bfloat16())
    with pytest.raises(TypeError, match="v_b has dtype bfloat16 but v_a has float16"):
        cascade.merge_state(v, s, v_o.bfloat16(), s_o)
    with pytest.raises(ValueError, match="v_a is on the CPU; pyflashattn needs CUDA tensors"):
        cascade.merge_state(v.cpu(), s, v_o, s_o)
    with pytest.raises(ValueError, match="mask must have shape"):
        cascade.merge_state_in_place(v, s, v_o, s_o, torch.ones(9, dtype=torch.bool, device=DEV))
    with pytest.raises(ValueError, match="v must be contiguous in its last dim"):
        cascade.merge_states(torch.randn(4, 2, 8, 3, device=DEV).transpose(2, 3), torch.zeros(4, 2, 3, device=DEV))
    with pytest.raises(ValueError, match="lse_base"):
        cascade.merge_state(v, s, v_o, s_o, lse_base="e")
    v0, s0 = v.clone(), s.clone()
    torch.cuda.synchronize()
    assert torch.equal(v, v0) and torch.equal(s, s0)  # nothing was launched
    out, lse = pyflashattn.merge_state(v, s, v_o, s_o)
    _check(out, lse, merge_state_ref(v, s, v_o, s_o), torch.float16, "after errors")


# ---------------------------------------------------------------- CuPy and JAX


def test_cupy():
    cupy = _cupy()
    shape = (15, 3, 128)
    v_a, s_a = _states(shape, torch.float16, ("cupy", "a"))
    v_b, s_b = _states(shape, torch.float16, ("cupy", "b"))
    ca, cb = (cupy.asarray(t.cpu().numpy()) for t in (v_a, v_b))
    csa, csb = (cupy.asarray(t.cpu().numpy()) for t in (s_a, s_b))
    v, s = cascade.merge_state(ca, csa, cb, csb)
    cupy.cuda.get_current_stream().synchronize()
    assert isinstance(v, cupy.ndarray) and isinstance(s, cupy.ndarray) and v.dtype == np.float16
    ref = merge_state_ref(v_a, s_a, v_b, s_b)
    _check(v, s, ref, torch.float16, "cupy merge_state")
    v_t, s_t = cascade.merge_state(v_a, s_a, v_b, s_b)
    assert np.array_equal(v.get().view(np.uint16), v_t.cpu().numpy().view(np.uint16)), "cupy and torch differ"
    # in place, with a CuPy mask
    keep = np.arange(shape[0]) % 3 != 0
    ca0, csa0 = ca.copy(), csa.copy()
    cascade.merge_state_in_place(ca, csa, cb, csb, cupy.asarray(keep))
    cupy.cuda.get_current_stream().synchronize()
    _check(ca[cupy.asarray(keep)], csa[cupy.asarray(keep)], (ref[0][keep], ref[1][keep]), torch.float16, "cupy in place")
    out_rows = cupy.asarray(~keep)
    assert np.array_equal(ca[out_rows].get().view(np.uint16), ca0[out_rows].get().view(np.uint16))
    assert np.array_equal(csa[out_rows].get().view(np.uint32), csa0[out_rows].get().view(np.uint32))
    # merge_states, fp32
    vs, ss = _states((6, 5, 2, 64), torch.float32, ("cupy", "states"))
    out, lse = cascade.merge_states(cupy.asarray(vs.cpu().numpy()), cupy.asarray(ss.cpu().numpy()), lse_base="ln")
    cupy.cuda.get_current_stream().synchronize()
    _check(out, lse, merge_states_ref(vs, ss, lse_base="ln"), torch.float32, "cupy merge_states")


def test_jax():
    jax, jnp, gpu = jax_gpu()
    shape = (10, 4, 128)
    v_a, s_a = _states(shape, torch.float32, ("jax", "a"))
    v_b, s_b = _states(shape, torch.float32, ("jax", "b"))
    ja, jb, jsa, jsb = (jax.device_put(t.cpu().numpy(), gpu) for t in (v_a, v_b, s_a, s_b))
    v, s = cascade.merge_state(ja, jsa, jb, jsb)
    assert isinstance(v, jax.Array) and isinstance(s, jax.Array) and v.dtype == jnp.float32
    _check(v, s, merge_state_ref(v_a, s_a, v_b, s_b), torch.float32, "jax merge_state")
    vs, ss = _states((7, 5, 3, 64), torch.float32, ("jax", "states"))
    out, lse = cascade.merge_states(jax.device_put(vs.cpu().numpy(), gpu), jax.device_put(ss.cpu().numpy(), gpu))
    _check(out, lse, merge_states_ref(vs, ss), torch.float32, "jax merge_states")
    with pytest.raises(TypeError, match="v is a JAX array, and JAX arrays are immutable"):
        cascade.merge_state_in_place(ja, jsa, jb, jsb)
    # a JAX other state merged into torch tensors in place: allowed (only v and s are written)
    v_t, s_t = v_a.clone(), s_a.clone()
    cascade.merge_state_in_place(v_t, s_t, jb, jsb)
    torch.cuda.synchronize()
    _check(v_t, s_t, merge_state_ref(v_a, s_a, v_b, s_b), torch.float32, "torch in place, jax other")


def test_reference_is_not_trivially_satisfied():
    """The tolerance check rejects a merge that ignores one side's weight (guards the tests above)."""
    v_a, s_a = _states((5, 2, 64), torch.float32, ("guard", "a"), empty_frac=0.0)
    v_b, s_b = _states((5, 2, 64), torch.float32, ("guard", "b"), empty_frac=0.0)
    ref = merge_state_ref(v_a, s_a, v_b, s_b)
    with pytest.raises(AssertionError):
        assert_close(to_numpy_f64(v_a), ref[0], **V_TOL[torch.float32], what="v_a alone")
