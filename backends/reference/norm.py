"""rmsnorm and layernorm (abi/README.md section 8)."""
from __future__ import annotations

import numpy as np

from .common import check_arg, check_dim, check_shape, f32, read, write


def rmsnorm(x=None, weight=None, residual=None, out=None, residual_out=None, eps=None) -> None:
    """s = x + residual (an f32 sum); residual_out = s; out = s * rsqrt(mean(s^2) + eps) * weight."""
    op = "rmsnorm"
    check_arg(op, "x", x)
    check_arg(op, "weight", weight)
    check_arg(op, "out", out)
    eps = f32(eps, op, "eps")
    T, H = x.shape
    check_dim(op, "weight.shape[0]", weight.shape[0], H, "x.shape[1]")
    check_shape(op, "out", out, (T, H))
    if residual is not None:
        check_arg(op, "residual", residual)
        check_shape(op, "residual", residual, (T, H))
    if residual_out is not None:
        check_arg(op, "residual_out", residual_out)
        check_shape(op, "residual_out", residual_out, (T, H))
    if eps < 0:
        raise ValueError(f"{op}: eps={eps} is negative")

    s = read(x, np.float32)
    if residual is not None:
        s = (s + read(residual, np.float32)).astype(np.float32)  # the README's sum is an f32 sum
    s64 = s.astype(np.float64)
    inv_rms = 1.0 / np.sqrt(np.mean(s64 * s64, axis=-1, keepdims=True) + eps)
    y = s64 * inv_rms * read(weight)[None, :]
    if residual_out is not None:
        write(residual_out, s)
    write(out, y)


def layernorm(x=None, weight=None, bias=None, out=None, eps=None) -> None:
    """out = (x - mean) * rsqrt(var + eps) * weight (+ bias) over the last dim, population variance."""
    op = "layernorm"
    check_arg(op, "x", x)
    check_arg(op, "weight", weight)
    check_arg(op, "out", out)
    eps = f32(eps, op, "eps")
    T, H = x.shape
    check_dim(op, "weight.shape[0]", weight.shape[0], H, "x.shape[1]")
    check_shape(op, "out", out, (T, H))
    if bias is not None:
        check_arg(op, "bias", bias)
        check_dim(op, "bias.shape[0]", bias.shape[0], H, "x.shape[1]")
    if not (np.isfinite(eps) and eps >= 0):
        raise ValueError(f"{op}: eps={eps} must be finite and >= 0")
    if H == 0:
        return   # nothing to normalise (and nothing to write)
    v = read(x)
    c = v - v.mean(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):   # a constant row with eps 0 is NaN, as in torch
        y = c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + eps) * read(weight)[None, :]
    if bias is not None:
        y = y + read(bias)[None, :]
    write(out, y)
