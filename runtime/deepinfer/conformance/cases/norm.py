"""Cases of the normalisations: rmsnorm (with the residual add and its aliases) and layernorm (V4)."""
from __future__ import annotations

import numpy as np

from .common import FLOATS, Case, OpCases, _shape_str, np_dtype, out, plain


# ====================================================================== builders


def rmsnorm(seed, T, H, dtype, variant="plain", view=False, eps=1e-6) -> Case:
    """variant: plain | residual | residual_out_alias_residual | residual_out_alias_x | out_alias_x"""
    rng = np.random.default_rng(seed)
    pad = (3, 1) if view else (0, 0)
    t = {"x": plain(rng, (T, H), dtype, pad=pad), "weight": plain(rng, (H,), dtype)}
    check = ["out"]
    if variant == "plain":
        t["out"] = out((T, H), dtype)
    elif variant == "out_alias_x":
        t["out"] = out((T, H), dtype, alias="x")
    else:
        t["residual"] = plain(rng, (T, H), dtype)
        t["out"] = out((T, H), dtype, pad=pad)
        if variant == "residual":
            t["residual_out"] = out((T, H), dtype)
        elif variant == "residual_out_alias_residual":
            t["residual_out"] = out((T, H), dtype, alias="residual")
        elif variant == "residual_out_alias_x":
            t["residual_out"] = out((T, H), dtype, alias="x")
        else:
            raise ValueError(variant)
        check.append("residual_out")
    return Case("rmsnorm", f"rmsnorm {dtype} {_shape_str(T=T, H=H)} {variant}{' view' if view else ''}", dtype, t,
                {"eps": eps}, check=check, tol_key=dtype, seed=seed)


def layernorm(seed, T, H, dtype, bias=True, wdtype=None, offset=0.0, view=False, eps=1e-6) -> Case:
    """offset: added to every x (a mean far from zero: a one-pass variance loses precision)."""
    rng = np.random.default_rng(seed)
    wdtype = wdtype or dtype
    x = plain(rng, (T, H), dtype, pad=(3, 1) if view else (0, 0))
    if offset:
        x.values = (np.asarray(x.values, np.float32) + offset).astype(np_dtype(dtype))
    t = {"x": x, "weight": plain(rng, (H,), wdtype)}
    if bias:
        t["bias"] = plain(rng, (H,), wdtype)
    t["out"] = out((T, H), dtype)
    name = f"layernorm {dtype} w={wdtype} {_shape_str(T=T, H=H)}{' bias' if bias else ''}" \
           f"{f' offset={offset:g}' if offset else ''}{' view' if view else ''}"
    return Case("layernorm", name, dtype, t, {"eps": eps}, tol_key=dtype, seed=seed)


# ====================================================================== generators


def gen_rmsnorm(p, s):
    for dt in FLOATS:
        yield rmsnorm(s(), 0, 16, dt)
        yield rmsnorm(s(), 1, 1, dt)
        yield rmsnorm(s(), 3, 67, dt, view=True)
        for v in ("residual", "residual_out_alias_residual", "residual_out_alias_x", "out_alias_x"):
            yield rmsnorm(s(), 5, 40, dt, v)
        for _ in range(p.random_draws):
            r = s.rng
            yield rmsnorm(s(), int(r.integers(1, 12)), int(r.integers(1, 300)), dt,
                          ["plain", "residual"][int(r.integers(0, 2))], view=bool(r.integers(0, 2)))


def gen_layernorm(p, s):
    for dt in FLOATS:
        yield layernorm(s(), 0, 16, dt)
        yield layernorm(s(), 1, 1, dt)
        yield layernorm(s(), 3, 67, dt, view=True)
        yield layernorm(s(), 5, 40, dt, bias=False)
        yield layernorm(s(), 4, 128, dt, wdtype="f32" if dt == "bf16" else "bf16")   # V3.2: f32 weights
        yield layernorm(s(), 4, 96, dt, offset=8.0)
        for _ in range(p.random_draws):
            r = s.rng
            yield layernorm(s(), int(r.integers(1, 12)), int(r.integers(1, 300)), dt, bias=bool(r.integers(0, 2)),
                            view=bool(r.integers(0, 2)))


# ====================================================================== large cases


def large_rmsnorm(s):
    yield rmsnorm(s(), 64, 2049, "bf16", "residual")


def large_layernorm(s):
    yield layernorm(s(), 64, 2049, "bf16")


# ====================================================================== the ops of this family (collected by cases/__init__.py)


OPS = {
    "rmsnorm": OpCases(gen_rmsnorm, lambda: rmsnorm(1, 3, 16, "f32"), large_rmsnorm),
    "layernorm": OpCases(gen_layernorm, lambda: layernorm(1, 3, 16, "f32"), large_layernorm),
}
