"""Cases of the elementwise ops: embedding, add, mul, silu_mul (with V4's clip, 1.3) and concat."""
from __future__ import annotations

import numpy as np

from .common import FLOATS, Case, OpCases, Profile, _Seeds, _shape_str, ints, out, plain


# ====================================================================== builders


def embedding(seed, T, V, H, dtype, view=False) -> Case:
    rng = np.random.default_rng(seed)
    ids = rng.integers(-2, V + 3, T) if V else np.full(T, -1)
    pad = (1, 2) if view else (0, 0)
    return Case("embedding", f"embedding {dtype} {_shape_str(T=T, V=V, H=H)}{' view' if view else ''}", dtype,
                {"ids": ints(ids), "table": plain(rng, (V, H), dtype, pad=pad), "out": out((T, H), dtype, pad=pad)},
                tol_key="exact", compare="exact", seed=seed)


def binary(op, seed, shape, dtype, alias=None, view=False) -> Case:
    rng = np.random.default_rng(seed)
    pad = (2, 3) if view else (0, 0)
    t = {"a": plain(rng, shape, dtype, pad=pad), "b": plain(rng, shape, dtype),
         "out": out(shape, dtype, alias=alias, pad=(0, 0) if alias else pad)}
    return Case(op, f"{op} {dtype} shape={list(shape)}{' out=' + alias if alias else ''}{' view' if view else ''}",
                dtype, t, tol_key=dtype, seed=seed)


def silu_mul(seed, T, I, dtype, view=False, limit=0.0) -> Case:
    """limit > 0: V4's clipped SwiGLU (1.3); gate and up are drawn wide enough that many values clip."""
    rng = np.random.default_rng(seed)
    t = {"gate": plain(rng, (T, I), dtype, scale=3.0, pad=(0, I) if view else (0, 0)),
         "up": plain(rng, (T, I), dtype, scale=2.0 if limit else 1.0, pad=(I, 0) if view else (0, 0)),
         "out": out((T, I), dtype)}
    scal = {"limit": limit} if limit else {}
    return Case("silu_mul", f"silu_mul {dtype} {_shape_str(T=T, I=I)}{' view' if view else ''}"
                f"{f' limit={limit:g}' if limit else ''}", dtype + (" limit" if limit else ""), t, scal,
                tol_key=dtype, seed=seed)


def concat(seed, T, A, B, dtype, view=False) -> Case:
    rng = np.random.default_rng(seed)
    t = {"a": plain(rng, (T, A), dtype, pad=(0, 3) if view else (0, 0)),
         "b": plain(rng, (T, B), dtype, pad=(5, 0) if view else (0, 0)),
         "out": out((T, A + B), dtype, pad=(1, 1) if view else (0, 0))}
    return Case("concat", f"concat {dtype} {_shape_str(T=T, A=A, B=B)}{' view' if view else ''}", dtype, t,
                tol_key="exact", compare="exact", seed=seed)


# ====================================================================== generators


def gen_embedding(p: Profile, s: _Seeds):
    for dt in FLOATS:
        yield embedding(s(), 0, 5, 8, dt)
        yield embedding(s(), 7, 11, 33, dt, view=True)
        yield embedding(s(), 1, 1, 1, dt)
        for _ in range(p.random_draws):
            r = s.rng
            yield embedding(s(), int(r.integers(1, 20)), int(r.integers(1, 50)), int(r.integers(1, 70)), dt,
                            view=bool(r.integers(0, 2)))


def _gen_binary(op):
    def gen(p, s):
        for dt in FLOATS:
            yield binary(op, s(), (0, 4), dt)
            yield binary(op, s(), (3, 37), dt, view=True)
            yield binary(op, s(), (2, 3, 5), dt)
            yield binary(op, s(), (7,), dt)
            yield binary(op, s(), (4, 9), dt, alias="a")
            yield binary(op, s(), (4, 9), dt, alias="b")
            for _ in range(p.random_draws):
                r = s.rng
                yield binary(op, s(), (int(r.integers(1, 9)), int(r.integers(1, 200))), dt,
                             view=bool(r.integers(0, 2)))
    return gen


def gen_silu_mul(p, s):
    for dt in FLOATS:
        yield silu_mul(s(), 0, 8, dt)
        yield silu_mul(s(), 3, 33, dt, view=True)
        yield silu_mul(s(), 1, 1, dt)
        yield silu_mul(s(), 5, 70, dt, limit=1.5)    # 1.3: V4's clipped SwiGLU
        yield silu_mul(s(), 3, 33, dt, view=True, limit=0.25)
        for _ in range(p.random_draws):
            yield silu_mul(s(), int(s.rng.integers(1, 9)), int(s.rng.integers(1, 200)), dt,
                           view=bool(s.rng.integers(0, 2)))


def gen_concat(p, s):
    for dt in FLOATS:
        yield concat(s(), 0, 3, 4, dt)
        yield concat(s(), 4, 512, 64, dt, view=True)
        yield concat(s(), 3, 1, 7, dt)
        for _ in range(p.random_draws):
            yield concat(s(), int(s.rng.integers(1, 9)), int(s.rng.integers(1, 50)), int(s.rng.integers(1, 50)), dt,
                         view=bool(s.rng.integers(0, 2)))


# ====================================================================== large cases


def large_embedding(s):
    yield embedding(s(), 300, 1000, 513, "bf16")


def large_add(s):
    yield binary("add", s(), (64, 4099), "bf16")


def large_mul(s):
    yield binary("mul", s(), (64, 4099), "bf16")


def large_silu_mul(s):
    yield silu_mul(s(), 64, 4099, "f32")


# ====================================================================== the ops of this family (collected by cases/__init__.py)


OPS = {
    "embedding": OpCases(gen_embedding, lambda: embedding(1, 3, 5, 8, "f32"), large_embedding),
    "add": OpCases(_gen_binary("add"), lambda: binary("add", 1, (2, 8), "f32"), large_add),
    "mul": OpCases(_gen_binary("mul"), lambda: binary("mul", 1, (2, 8), "f32"), large_mul),
    "silu_mul": OpCases(gen_silu_mul, lambda: silu_mul(1, 2, 8, "f32"), large_silu_mul,
                        full=lambda: silu_mul(1, 2, 8, "f32", limit=1.0)),
    "concat": OpCases(gen_concat, lambda: concat(1, 2, 3, 4, "f32")),
}
