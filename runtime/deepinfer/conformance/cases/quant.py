"""Cases of quantize and dequantize; gen_dequantize_l2 is level L2's exhaustive bit-exact sweep of
every format."""
from __future__ import annotations

import numpy as np

from .common import (ACT_FORMATS, FLOATS, QUANTIZE_FORMATS, WEIGHT_FORMATS, Case, OpCases, _pick, np_dtype, out,
                     plain)


# ====================================================================== builders


def quantize(seed, shape, xdtype, qfmt, scale_pow2=0, zero_row=False) -> Case:
    rng = np.random.default_rng(seed)
    f = QUANTIZE_FORMATS[qfmt]
    x = plain(rng, shape, xdtype, scale=3.0)
    # an e4m3-stored scale underflows to 0 below amax = qmax * 2^-9; such a block is a malformed
    # request (INVALID_ARGUMENT), so keep every value well above it
    v = np.asarray(x.values, np.float32)
    x.values = (np.sign(v) * (np.abs(v) + 0.1)).astype(np_dtype(xdtype))
    if zero_row and shape[-2] > 0:
        x.values[..., 0, :] = 0
    return Case("quantize", f"quantize {xdtype} -> {qfmt}{' pow2' if scale_pow2 else ''} shape={list(shape)}"
                f"{' zero-row' if zero_row else ''}", f"{qfmt}{' pow2' if scale_pow2 else ''}",
                {"x": x, "out": f.poisoned_output(shape)}, {"scale_pow2": scale_pow2},
                check=["out", "out.scales"], tol_key="exact", compare="exact", seed=seed)


def dequantize(seed, shape, fmt, out_dtype="f32", act=False) -> Case:
    rng = np.random.default_rng(seed)
    f = (ACT_FORMATS if act else WEIGHT_FORMATS)[fmt]
    return Case("dequantize", f"dequantize {fmt} -> {out_dtype} shape={list(shape)}", f"{fmt} -> {out_dtype}",
                {"x": f.random(rng, shape), "out": out(shape, out_dtype)}, tol_key="exact", compare="exact",
                seed=seed)


# ====================================================================== generators


def gen_quantize(p, s):
    for qf in _pick(p, QUANTIZE_FORMATS):
        for xd in FLOATS:
            yield quantize(s(), (5, 200), xd, qf, zero_row=True)
        yield quantize(s(), (2, 3, 70), "f32", qf)
        if qf.startswith("e4m3") or qf.startswith("int8"):
            yield quantize(s(), (130, 150) if "128x128" in qf else (4, 150), "f32", qf, scale_pow2=1)
        for _ in range(p.random_draws):
            r = s.rng
            yield quantize(s(), (int(r.integers(1, 9)), int(r.integers(1, 300))), "bf16", qf)


def gen_dequantize(p, s):
    # L1 keeps a few; L2 (gen_dequantize_l2) is the exhaustive bit-exact sweep
    for wf in _pick(p, WEIGHT_FORMATS):
        yield dequantize(s(), (3, 100), wf, "f32")


def gen_dequantize_l2(p, s):
    for wf, f in WEIGHT_FORMATS.items():
        g = f.block[1] or 50
        shapes = [(130, 300), (1, 1), (0, 64)] if f.block[0] == 128 else [(5, 2 * g + 7), (3, g), (2, 1), (0, 8)]
        shapes.append((2, 3, 2 * g + 1) if f.block[0] != 128 else (2, 129, 131))
        for shape in shapes:
            for od in FLOATS:
                yield dequantize(s(), shape, wf, od)
    for af in ACT_FORMATS:
        for od in FLOATS:
            yield dequantize(s(), (4, 300), af, od, act=True)
    for _ in range(p.random_draws):
        for wf in WEIGHT_FORMATS:
            r = s.rng
            lead = tuple(int(d) for d in r.integers(1, 3, int(r.integers(0, 2))))
            yield dequantize(s(), lead + (int(r.integers(0, 260)), int(r.integers(1, 400))), wf,
                             FLOATS[int(r.integers(0, 2))])


# ====================================================================== large cases


def large_quantize(s):
    yield quantize(s(), (260, 1000), "f32", "e4m3/128x128/f32")


def large_dequantize(s):
    yield dequantize(s(), (300, 1000), "e4m3/128x128/f32", "bf16")


# ====================================================================== the ops of this family (collected by cases/__init__.py)


OPS = {
    "quantize": OpCases(gen_quantize, lambda: quantize(1, (2, 64), "f32", "int8/token/f32"), large_quantize),
    "dequantize": OpCases(gen_dequantize, lambda: dequantize(1, (2, 64), "int8/channel/f32"), large_dequantize),
}
