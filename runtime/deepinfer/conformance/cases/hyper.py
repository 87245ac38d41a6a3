"""Cases of V4's hyper-connections (1.3): hc_pre (a block's and the head's) and hc_post."""
from __future__ import annotations

import math

import numpy as np

from .common import FLOATS, Case, OpCases, TSpec, _shape_str, out, plain


# ====================================================================== builders


def hc_pre(seed, T, N, H, dtype, head=False, iters=20, view=False, hc_eps=1e-6) -> Case:
    """A block's hyper-connection (M = (2 + N) * N: pre, post, comb) or the head's (M = N: pre only).
    fn is scaled so that the mixes are O(1): the sigmoids and the softmax stay away from saturation.
    hc_eps: V4's 1e-6 is below f32 resolution in every term it enters; a larger one makes it count."""
    rng = np.random.default_rng(seed)
    M = N if head else (2 + N) * N
    t = {"x": plain(rng, (T, N, H), dtype, pad=(2, 3) if view else (0, 0)),
         "fn": plain(rng, (M, N * H), "f32", scale=1 / math.sqrt(N * H)),
         "base": plain(rng, (M,), "f32", scale=0.5),
         "scale": TSpec("f32", (1 if head else 3,), rng.uniform(0.5, 2.0, 1 if head else 3).astype(np.float32)),
         "out": out((T, H), dtype)}
    check = ["out"]
    if not head:
        t["post"] = out((T, N), "f32")
        t["comb"] = out((T, N, N), "f32")
        check += ["post", "comb"]
    # the head passes the model's Sinkhorn count too (the runtime fills it from the config); it is unused
    name = f"hc_pre {dtype} {_shape_str(T=T, N=N, H=H)} {'head' if head else f'block iters={iters}'}" \
           f"{' view' if view else ''}{f' hc_eps={hc_eps:g}' if hc_eps != 1e-6 else ''}"
    return Case("hc_pre", name, f"{dtype} {'head' if head else 'block'}", t,
                {"eps": 1e-6, "hc_eps": hc_eps, "sinkhorn_iters": iters}, check=check, tol_key=dtype,
                tol_keys={"post": "f32", "comb": "f32"}, seed=seed)


def hc_post(seed, T, N, H, dtype, ydtype=None, view=False) -> Case:
    rng = np.random.default_rng(seed)
    ydtype = ydtype or dtype
    comb = rng.uniform(0.0, 1.0, (T, N, N))
    comb = comb / comb.sum(axis=1, keepdims=True)      # roughly what Sinkhorn leaves (not symmetric)
    t = {"x": plain(rng, (T, N, H), dtype, pad=(1, 4) if view else (0, 0)),
         "y": plain(rng, (T, H), ydtype, pad=(3, 0) if view else (0, 0)),
         "post": TSpec("f32", (T, N), rng.uniform(0.0, 2.0, (T, N)).astype(np.float32)),
         "comb": TSpec("f32", (T, N, N), comb.astype(np.float32)),
         "out": out((T, N, H), dtype, pad=(0, 2) if view else (0, 0))}
    name = f"hc_post x={dtype} y={ydtype} {_shape_str(T=T, N=N, H=H)}{' view' if view else ''}"
    return Case("hc_post", name, f"{dtype} y={ydtype}", t, tol_key=dtype, seed=seed)


# ====================================================================== generators


def gen_hc_pre(p, s):
    for dt in FLOATS:
        yield hc_pre(s(), 0, 4, 16, dt)
        yield hc_pre(s(), 5, 4, 64, dt)                     # V4's N = 4
        yield hc_pre(s(), 5, 4, 64, dt, head=True)
        yield hc_pre(s(), 3, 1, 8, dt)                      # one stream: comb is 1x1
        yield hc_pre(s(), 4, 2, 33, dt, iters=1, view=True)  # Sinkhorn's first column pass only
        yield hc_pre(s(), 2, 3, 40, dt, iters=3, head=True, view=True)
        yield hc_pre(s(), 4, 4, 24, dt, iters=4, hc_eps=0.02)
        yield hc_pre(s(), 3, 4, 24, dt, head=True, hc_eps=0.02)
        for _ in range(p.random_draws):
            r = s.rng
            yield hc_pre(s(), int(r.integers(1, 9)), int(r.integers(1, 6)), int(r.integers(1, 130)), dt,
                         head=bool(r.integers(0, 2)), iters=int(r.integers(1, 25)), view=bool(r.integers(0, 2)))


def gen_hc_post(p, s):
    for dt in FLOATS:
        yield hc_post(s(), 0, 4, 16, dt)
        yield hc_post(s(), 5, 4, 64, dt)
        yield hc_post(s(), 3, 1, 7, dt, view=True)
        yield hc_post(s(), 4, 3, 33, dt, ydtype="f32" if dt == "bf16" else "bf16", view=True)
        for _ in range(p.random_draws):
            r = s.rng
            yield hc_post(s(), int(r.integers(1, 9)), int(r.integers(1, 6)), int(r.integers(1, 200)), dt,
                          view=bool(r.integers(0, 2)))


# ====================================================================== large cases


def large_hc_pre(s):
    yield hc_pre(s(), 16, 4, 4096, "bf16")                      # V4-Flash's hidden size


def large_hc_post(s):
    yield hc_post(s(), 16, 4, 4096, "bf16")


# ====================================================================== the ops of this family (collected by cases/__init__.py)


OPS = {
    # with every optional argument (so that the L0 checks reach them)
    "hc_pre": OpCases(gen_hc_pre, lambda: hc_pre(1, 2, 2, 8, "f32", iters=3), large_hc_pre),
    "hc_post": OpCases(gen_hc_post, lambda: hc_post(1, 2, 2, 8, "f32"), large_hc_post),
}
