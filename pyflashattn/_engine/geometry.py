"""THE causal/window tile geometry on the host: which KV tiles each packed-row tile can see.

The device's rule is MaskRule in kernel_src/include/pfa/attention/mask.cuh (kv_begin / kv_end of
a tile's first and last query row); tests/test_geometry.py holds the two equal by brute force
over that predicate. The scheduler orders and splits work with these spans, and the split cost
model (cost_model.py) prices them, so the two can never disagree about a tile's work.
"""
from __future__ import annotations

import numpy as np

from .npfast import consts as _k, div as _div


def tile_spans(qo_lens, kv, tiles, first, req, g, bm, bn, causal, wl, chunk=0):
    """Per q tile of the batch (request-major), [l, h): the KV tiles its rows can see at all,
    returned as (-h, l), l None without a window. Token i of a request sits at i + shift (shift =
    kv_len - qo_len; packed row r is token r // g): h = clip(ceil(hi / bn), 0, ceil(kv / bn))
    with hi the causal end of the tile's last token (-h computed as floor(-hi / bn)), and
    l = floor(max(lo, 0) / bn) with lo the window start of its first token (chunked attention,
    chunk > 0: the larger of that and its chunk start, floor(pos / chunk) * chunk, MaskRule::left;
    its causal end as above). tiles None: one
    tile per request; else ``first`` is each request's first tile and ``req`` each tile's
    request."""
    if tiles is None:  # the tile holds the request's last token, which sees every key
        nkvt = np.floor_divide(kv, _k[-bn])  # -ceil(kv / bn)
        if wl < 0 and not chunk:
            return nkvt, None
        lo = _left(kv - qo_lens, wl, chunk)
        np.maximum(lo, _k[0], out=lo)
        return nkvt, _div(lo, bn)
    T = req.size
    # per-request values, per tile: a repeat costs per request, a gather per tile
    expand = (lambda x: x.repeat(tiles)) if T > 4 * kv.size else (lambda x: x[req])
    if not (causal or wl >= 0 or chunk):
        return expand(np.floor_divide(kv, _k[-bn])), None
    shift = kv - qo_lens
    nh = l = None
    if bm % g == 0:  # tile t holds tokens [t*s, (t+1)*s) (s = bm / g), clipped by qo_len
        s = bm // g
        js = np.arange(s, (T + 1) * s, s)  # (global tile index + 1) * s = (t+1)*s + first*s
        d = expand(first * _k[s] - shift)  # so that js - d = (t+1)*s + shift
        if causal:  # -hi = -((t+1)*s + shift)
            nh = d - js
            _div(nh, bn)
            # Only a request's last tile (it holds its last token, which sees every key) can
            # reach past kv: clip every tile at -ceil(kv / bn) (3 numpy calls; writing the last
            # tiles alone needs as many plus a check that every request has one).
            np.maximum(nh, expand(np.floor_divide(kv, _k[-bn])), out=nh)
        if wl >= 0 or chunk:  # the first token's position t*s + shift, then lo
            l = np.subtract(js, d, out=js)
            l -= _k[s]
            l = _left(l, wl, chunk)
    else:
        r0 = np.arange(T)
        r0 -= expand(first)
        r0 *= _k[bm]  # the tile's first packed row
        sh = expand(shift)
        if causal:  # -hi = -ceil(min(r0 + bm, qo_len * g) / g) - shift: hi <= qo_len + shift = kv
            nh = np.minimum(r0 + _k[bm], expand(qo_lens * _k[g]))
            np.floor_divide(nh, _k[-g], out=nh)
            nh -= sh
            _div(nh, bn)
        if wl >= 0 or chunk:  # the first token's position r0 // g + shift, then lo
            l = r0
            l //= _k[g]
            l += sh
            l = _left(l, wl, chunk)
    if nh is None:
        nh = expand(np.floor_divide(kv, _k[-bn]))
    else:
        np.minimum(nh, _k[0], out=nh)  # hi >= 0
    if l is not None:
        np.maximum(l, _k[0], out=l)
        _div(l, bn)
    return nh, l




def _left(pos, wl, chunk):
    """MaskRule::left of tokens at positions pos (int64, modified): pos - wl (window), raised to
    floor(pos / chunk) * chunk (chunked attention)."""
    if chunk:
        c = np.floor_divide(pos, chunk)
        c *= chunk
        if wl < 0:
            return c
        pos -= _k[wl]
        return np.maximum(pos, c, out=pos)
    pos -= _k[wl]
    return pos
