"""Cases of rope: interleaved and half rotations, YaRN scaling, in place and on strided views."""
from __future__ import annotations

import numpy as np

from .common import FLOATS, Case, OpCases, ints, out, plain


# ====================================================================== builders


YARN = dict(scaling=1, factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0)


def rope(seed, T, H, D, dtype, interleaved=1, yarn=False, alias=False, view=False, max_pos=1024,
         attn_factor=1.0) -> Case:
    rng = np.random.default_rng(seed)
    shape = (T, H, D) if H else (T, D)
    pad = (16, 0) if view else (0, 0)     # q_pe = q[..., Dn:], k_pe = kv_a[:, Dc:]
    x = plain(rng, shape, dtype, pad=pad)
    pos = rng.integers(0, max_pos, T)
    if T:
        pos[0] = 0
    scal = dict(interleaved=interleaved, scaling=0, theta=10000.0, factor=1.0, original_max_position=0,
                beta_fast=0.0, beta_slow=0.0, attn_factor=attn_factor)
    if yarn:
        scal.update(YARN)
    o = out(shape, dtype, alias="x") if alias else out(shape, dtype)
    name = f"rope {dtype} shape={list(shape)} {'interleaved' if interleaved else 'half'}{' yarn' if yarn else ''}" \
           f"{' in-place' if alias else ''}{' view' if view else ''}"
    return Case("rope", name, dtype, {"x": x, "positions": ints(pos), "out": o}, scal, tol_key=dtype, seed=seed)


# ====================================================================== generators


def gen_rope(p, s):
    for dt in FLOATS:
        yield rope(s(), 0, 2, 8, dt)
        yield rope(s(), 5, 3, 64, dt, interleaved=1, yarn=True, attn_factor=1.1)
        yield rope(s(), 5, 3, 64, dt, interleaved=0)
        yield rope(s(), 4, 0, 8, dt, interleaved=1, alias=True)
        yield rope(s(), 6, 2, 16, dt, interleaved=1, yarn=True, view=True)
        yield rope(s(), 3, 1, 2, dt, interleaved=0, yarn=True)
        for _ in range(p.random_draws):
            r = s.rng
            yield rope(s(), int(r.integers(1, 9)), int(r.integers(0, 4)), 2 * int(r.integers(1, 40)), dt,
                       interleaved=int(r.integers(0, 2)), yarn=bool(r.integers(0, 2)), view=bool(r.integers(0, 2)))


# ====================================================================== large cases


def large_rope(s):
    yield rope(s(), 64, 16, 64, "f32", interleaved=1, yarn=True)


# ====================================================================== the ops of this family (collected by cases/__init__.py)


OPS = {
    "rope": OpCases(gen_rope, lambda: rope(1, 2, 2, 8, "f32"), large_rope),
}
