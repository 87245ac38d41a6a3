"""Manifold-constrained hyper-connections (DeepSeek V4's mHC): hc_pre and hc_post (abi/README.md
section 8). The residual of a token is N streams x [T, N, H]; hc_pre turns them into mixing weights
and the block's input, hc_post recombines the block's output with the streams.

All math is float64 (the README asks for f32 or better); each output is rounded once.
"""
from __future__ import annotations

import numpy as np

from .common import (check_arg, check_dim, check_nonneg_finite, check_shape, f32, i32, read, sigmoid, softmax,
                     write)


def hc_pre(x=None, fn=None, base=None, scale=None, out=None, post=None, comb=None, eps=None, hc_eps=None,
           sinkhorn_iters=None) -> None:
    """out[t] = sum_n pre[t, n] * x[t, n]; with M = (2 + N) * N also post [T, N] and comb [T, N, N]
    (Sinkhorn-normalised); with M = N (the model's head) pre only."""
    op = "hc_pre"
    for name, t in (("x", x), ("fn", fn), ("base", base), ("scale", scale), ("out", out)):
        check_arg(op, name, t)
    eps, hc_eps = f32(eps, op, "eps"), f32(hc_eps, op, "hc_eps")
    iters = i32(sinkhorn_iters, op, "sinkhorn_iters")
    T, N, H = x.shape
    if N < 1 or H < 1:
        raise ValueError(f"{op}: x.shape={list(x.shape)} needs at least one stream and one feature")
    M = fn.shape[0]
    check_dim(op, "fn.shape[1]", fn.shape[1], N * H, "N * H (x.shape[1] * x.shape[2])")
    block = M == (2 + N) * N
    if not block and M != N:
        raise ValueError(f"{op}: fn.shape[0]={M} must be (2 + N) * N = {(2 + N) * N} (a block: pre, post, comb) or "
                         f"N = {N} (the head: pre only)")
    check_shape(op, "base", base, (M,))
    check_shape(op, "scale", scale, (3,) if block else (1,))
    check_shape(op, "out", out, (T, H))
    if block:
        for name, t, shape in (("post", post, (T, N)), ("comb", comb, (T, N, N))):
            if t is None:
                raise ValueError(f"{op}: {name} is required when fn.shape[0] = (2 + N) * N = {M}")
            check_arg(op, name, t)
            check_shape(op, name, t, shape)
        if iters < 1:
            raise ValueError(f"{op}: sinkhorn_iters={iters} must be >= 1")
    else:
        for name, t in (("post", post), ("comb", comb)):
            if t is not None:
                raise ValueError(f"{op}: {name} must be absent when fn.shape[0] = N = {M} (the head has pre only)")
    check_nonneg_finite(op, "eps", eps)
    check_nonneg_finite(op, "hc_eps", hc_eps)

    xv = read(x)                                          # [T, N, H]
    f = xv.reshape(T, N * H)
    with np.errstate(divide="ignore", invalid="ignore"):  # an all-zero row with eps 0 is NaN, as in torch
        f = f / np.sqrt(np.mean(f * f, axis=-1, keepdims=True) + eps)
    mix = f @ read(fn).T                                  # [T, M]
    b, s = read(base), read(scale)
    pre = sigmoid(mix[:, :N] * s[0] + b[:N]) + hc_eps
    y = np.einsum("tn,tnh->th", pre, xv)
    if block:
        p = 2.0 * sigmoid(mix[:, N:2 * N] * s[1] + b[N:2 * N])
        c = softmax((mix[:, 2 * N:] * s[2] + b[2 * N:]).reshape(T, N, N), axis=-1) + hc_eps
        # Sinkhorn-Knopp towards a doubly stochastic matrix: columns first, then (rows, columns)
        # iters - 1 more times; hc_eps keeps every denominator away from zero
        c = c / (c.sum(axis=-2, keepdims=True) + hc_eps)
        for _ in range(iters - 1):
            c = c / (c.sum(axis=-1, keepdims=True) + hc_eps)
            c = c / (c.sum(axis=-2, keepdims=True) + hc_eps)
        write(post, p)
        write(comb, c)
    write(out, y)


# numpy < 1.25 has it at the top level
_TOO_HARD = getattr(getattr(np, "exceptions", np), "TooHardError")


def _overlaps(a, b) -> bool:
    """Whether two host tensors share any byte (exactly, where NumPy can decide it cheaply)."""
    if a.buffer is not b.buffer and not np.may_share_memory(a.buffer, b.buffer):
        return False
    try:
        return bool(np.shares_memory(a.numpy(), b.numpy(), max_work=100_000))
    except _TOO_HARD:   # undecided within the budget: treat as overlapping
        return True


def hc_post(x=None, y=None, post=None, comb=None, out=None) -> None:
    """out[t, k] = post[t, k] * y[t] + sum_j comb[t, j, k] * x[t, j] (comb applied transposed)."""
    op = "hc_post"
    for name, t in (("x", x), ("y", y), ("post", post), ("comb", comb), ("out", out)):
        check_arg(op, name, t)
    T, N, H = x.shape
    check_shape(op, "y", y, (T, H))
    check_shape(op, "post", post, (T, N))
    check_shape(op, "comb", comb, (T, N, N))
    check_shape(op, "out", out, (T, N, H))
    # every stream of the input feeds every stream of the output: a library working in place would
    # overwrite x[t, j] before the other output streams have read it, so the README forbids overlap
    if out.numel and _overlaps(out, x):
        raise ValueError(f"{op}: out overlaps x (the op does not allow it)")
    xv, yv, pv, cv = read(x), read(y), read(post), read(comb)
    write(out, pv[:, :, None] * yv[:, None, :] + np.einsum("tjk,tjh->tkh", cv, xv))
