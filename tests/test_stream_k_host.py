"""Stream-K for single prefill (sm90/stream_k.cuh) on the host: when the scheduler shares a
persistent launch's last blocks out, how the kernel's ranges (mirrored here from StreamK's
formulas) cover the tiles, and what a single prefill plan hands the kernel on the simulated driver."""
from __future__ import annotations

import ctypes
import pathlib
import sys

import pytest

import pyflashattn
from pyflashattn._engine import routing, schedule, single, tma
from pyflashattn._runtime import cuda as _cuda
from pyflashattn.testing.fake_driver import FakeEnv, T, last_attn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "build_tools"))
import variants  # noqa: E402


@pytest.mark.parametrize("blocks,ctas,tiles,force,first", [
    (512, 132, 32, False, None),    # 1 x 4096, 16 heads, hd128: 3.88 rounds, 3.9 tiles a CTA to gain
    (512, 132, 32, True, 264),
    (1024, 132, 64, False, 792),    # 1 x 8192: 15.5 tiles a CTA
    (2048, 132, 128, False, 1848),  # 1 x 16384: 15.5 rounds
    (704, 132, 32, False, 528),     # hd64's 192-row tile, 32 heads x 4096: 5.33 rounds
    (528, 132, 33, False, None),    # whole rounds
    (100, 132, 32, False, None),    # less than a round: a block a CTA already
    (264, 132, 64, False, None),
    (1000, 132, 2, False, None),    # 0.58 of a tile a CTA to gain
    (1000, 132, 2, True, 792),      # unless forced (tests)
    (150, 132, 16, False, 0),       # one round and a bit: everything shared out
    (150, 132, 1, True, None),      # one-tile blocks cannot be split
])
def test_stream_k_first(blocks, ctas, tiles, force, first):
    assert schedule.stream_k_first(blocks, ctas, tiles, force) == first


def _bound(blocks, first, tiles, c, G):  # StreamK::bound
    cr = c * (blocks - first)
    q = cr // G
    return q * tiles + (cr - q * G) * tiles // G


def _walk(blocks, first, tiles, c, G):
    """CTA c's (block, first tile, tile count) in walk order, as StreamK::block and ::clip give them."""
    out, k = [], 0
    while True:
        rounds = first // G
        if k < rounds:
            b = k * G + c
        else:
            lo, hi = _bound(blocks, first, tiles, c, G), _bound(blocks, first, tiles, c + 1, G)
            item = lo // tiles + (k - rounds)
            b = first + item if item * tiles < hi else blocks
        if b >= blocks:
            return out
        a, e = 0, tiles
        if b >= first:
            item0 = (b - first) * tiles
            a = max(_bound(blocks, first, tiles, c, G), item0) - item0
            e = min(_bound(blocks, first, tiles, c + 1, G), item0 + tiles) - item0
        out.append((b, a, e - a))
        k += 1


@pytest.mark.parametrize("blocks,ctas,tiles", [(512, 132, 32), (2048, 132, 128), (150, 132, 8), (1000, 132, 2),
                                               (263, 132, 5), (4096, 132, 7), (1371, 114, 129)])
def test_stream_k_ranges_cover_every_tile_once_and_hand_off_between_neighbours(blocks, ctas, tiles):
    first = schedule.stream_k_first(blocks, ctas, tiles, force=True)
    assert first is not None
    seen = {}
    for c in range(ctas):
        walk = _walk(blocks, first, tiles, c, ctas)
        for j, (b, a, n) in enumerate(walk):
            assert n > 0
            for t in range(a, a + n):
                assert (b, t) not in seen, f"tile {t} of block {b} twice"
                seen[b, t] = c
            head, tail = a == 0 and n < tiles, a > 0
            # a tail piece is the CTA's first after its whole rounds (it writes slot c early), a
            # head piece its last (it reads slot c + 1: its right neighbour's tail), never both
            sk0 = first // ctas
            assert not (head and tail) and (not tail or j == sk0) and (not head or j == len(walk) - 1)
            if head:
                b1, a1, n1 = _walk(blocks, first, tiles, c + 1, ctas)[sk0]
                assert (b1, a1, a1 + n1) == (b, n, tiles)
    assert len(seen) == blocks * tiles


def _env(monkeypatch):
    monkeypatch.setattr(variants, "HOPPER_KV_LOAD", {s: "tma" if s == "ragged" else "cpasync"
                                                     for s in variants.HOPPER_KV_LOAD})
    rows = variants.variants()
    env = FakeEnv(monkeypatch, rows)
    env.use_sm90_rows(monkeypatch, rows)
    for name in ("_FIELD", "_TEMPLATES"):
        monkeypatch.setattr(tma, name, {})
    monkeypatch.delenv(routing.KV_LOAD_ENV, raising=False)
    monkeypatch.delenv(schedule.STREAM_K_ENV, raising=False)
    monkeypatch.setattr(_cuda.Workspace, "_spaces", {})
    monkeypatch.setattr(single._tls, "plans", {}, raising=False)
    return env


def _call(causal=False, s=8192, h=16, d=128, **kw):
    q, k, v = (T((s, h, d), data=a) for a in (0x1000000, 0x5000000, 0x9000000))
    return pyflashattn.single_prefill_with_kv_cache(q, k, v, causal=causal, out=T((s, h, d), data=0xd000000), **kw)


def test_single_prefill_plans_stream_k_on_equal_blocks(monkeypatch):
    env = _env(monkeypatch)
    _call()  # 64 row tiles x 16 heads = 1024 blocks of 64 tiles on 132 CTAs
    name, grid, _, p = last_attn(env)
    assert variants_row(name).persistent and grid == (132, 1, 1) and p.rows_fastest == 1
    (plan,) = single._tls.plans.values()
    assert plan.stream_k == (64, 792, 132) and (p.sk_tiles, p.sk_first) == (64, 792)
    consumers = plan.attn.meta["block_m"] // 64
    assert plan.ws_sk_bytes == 132 * consumers * (128 // 2 + 4) * 128 * 4
    (ws,) = _cuda.Workspace._spaces.values()  # (the fake torch's current stream)
    assert p.sk_partial == ws.ptr + plan.ws_bytes and ws.size >= plan.ws_bytes + plan.ws_sk_bytes
    assert p.sk_flags == ws.flag_ptr and ctypes.string_at(p.sk_flags, _cuda.Workspace.FLAG_BYTES) == bytes(
        _cuda.Workspace.FLAG_BYTES)
    _call()
    assert last_attn(env)[3].sk_flags == p.sk_flags  # the stream's flags, made once


def variants_row(name):
    return next(v for v in variants.variants() if v.name == name)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_left=1000), dict(s=4224), dict(s=4096)])
def test_single_prefill_without_stream_k(monkeypatch, kw):
    # unequal blocks (causal, a window), whole rounds (4224 = 33 row tiles: 528 = 4 x 132), or too
    # little to gain (4096: 3.9 tiles a CTA)
    env = _env(monkeypatch)
    _call(**kw)
    p = last_attn(env)[3]
    (plan,) = single._tls.plans.values()
    assert plan.stream_k is None and p.sk_tiles == 0 and plan.ws_sk_bytes == 0


def test_stream_k_env_and_the_callers_scratch(monkeypatch):
    env = _env(monkeypatch)
    monkeypatch.setenv(schedule.STREAM_K_ENV, "0")
    _call()
    assert last_attn(env)[3].sk_tiles == 0
    monkeypatch.setattr(single._tls, "plans", {}, raising=False)
    monkeypatch.setenv(schedule.STREAM_K_ENV, "1")
    _call(s=4096, h=2)  # 64 blocks: less than a round, nothing to share even when forced
    assert last_attn(env)[3].sk_tiles == 0
    monkeypatch.delenv(schedule.STREAM_K_ENV)
    monkeypatch.setattr(single._tls, "plans", {}, raising=False)
    _call()
    (plan,) = single._tls.plans.values()
    assert plan.stream_k is not None
    # a caller's scratch (pyflashattn.jax) has no room for the slots: the launch does without
    plan.run(0x1000000, 0x5000000, 0x9000000, 0xd000000, 0, 0, ws=0, sched=None)
    assert last_attn(env)[3].sk_tiles == 0
    plan.run(0x1000000, 0x5000000, 0x9000000, 0xd000000, 0, 0)
    assert last_attn(env)[3].sk_tiles == 64


@pytest.mark.parametrize("value", ["2", "yes", "off"])
def test_a_stream_k_switch_it_does_not_know_is_refused(monkeypatch, value):
    env = _env(monkeypatch)
    monkeypatch.setenv(schedule.STREAM_K_ENV, value)
    with pytest.raises(ValueError, match=schedule.STREAM_K_ENV):
        _call()
    assert not env.attn_launches()  # refused before any launch
    monkeypatch.setenv(schedule.STREAM_K_ENV, " 1 ")
    assert schedule.stream_k_mode() == "1"


def test_stream_k_flags_are_not_made_while_the_stream_captures(monkeypatch):
    env = _env(monkeypatch)
    _call()
    (plan,) = single._tls.plans.values()
    env.cu.capturing.add(7)
    plan.run(0x1000000, 0x5000000, 0x9000000, 0xd000000, 0, 7)
    p = last_attn(env)[3]
    assert (p.sk_tiles, p.sk_flags, p.sk_partial) == (0, 0, 0)  # a fixed share, whole blocks
    env.cu.capturing.discard(7)
    plan.run(0x1000000, 0x5000000, 0x9000000, 0xd000000, 0, 7)
    p = last_attn(env)[3]
    assert p.sk_tiles == 64 and p.sk_flags == _cuda.Workspace.flags(0, 7)
