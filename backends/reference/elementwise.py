"""embedding, add, mul, silu_mul, concat (abi/README.md section 8)."""
from __future__ import annotations

import numpy as np

from .common import check_arg, check_dim, f32, read, read_index, write


def silu(v: np.ndarray) -> np.ndarray:
    """v / (1 + exp(-v)), written so that exp never overflows for large negative v."""
    e = np.exp(-np.abs(v))
    return np.where(v >= 0, v / (1.0 + e), v * e / (1.0 + e))


def swiglu_limit(op: str, name: str, value) -> float:
    """A 1.3 clipping limit (silu_mul.limit, moe_experts.swiglu_limit): 0 = none, else > 0."""
    v = f32(value, op, name)
    if not (np.isfinite(v) and v >= 0):
        raise ValueError(f"{op}: {name}={v} must be finite and >= 0 (0 = no clipping)")
    return v


def clipped_swiglu(gate: np.ndarray, up: np.ndarray, limit: float) -> np.ndarray:
    """silu(gate) * up; with limit > 0 (V4's clipped SwiGLU) gate = min(gate, limit) and
    up = clamp(up, -limit, limit) first. gate has no lower clip: silu of a large negative is 0."""
    if limit > 0:
        gate = np.minimum(gate, limit)
        up = np.clip(up, -limit, limit)
    return silu(gate) * up


def embedding(ids=None, table=None, out=None) -> None:
    """out[t] = table[ids[t]]; an id outside [0, V) gives a zero row."""
    op = "embedding"
    check_arg(op, "ids", ids)
    check_arg(op, "table", table)
    check_arg(op, "out", out)
    (T,), (V, H) = ids.shape, table.shape
    check_dim(op, "out.shape[0]", out.shape[0], T, "ids.shape[0]")
    check_dim(op, "out.shape[1]", out.shape[1], H, "table.shape[1]")
    idx = read_index(ids)
    valid = (idx >= 0) & (idx < V)
    rows = np.zeros((T, H), np.float64)
    rows[valid] = read(table)[idx[valid]]
    write(out, rows)


def _same_shapes(op: str, **tensors) -> tuple:
    for name, t in tensors.items():
        check_arg(op, name, t)
    names = list(tensors)
    first = tensors[names[0]]
    for name in names[1:]:
        if tuple(tensors[name].shape) != tuple(first.shape):
            raise ValueError(f"{op}: {name}.shape={list(tensors[name].shape)} != {names[0]}.shape={list(first.shape)}")
    return first.shape


def add(a=None, b=None, out=None) -> None:
    _same_shapes("add", a=a, b=b, out=out)
    write(out, read(a) + read(b))


def mul(a=None, b=None, out=None) -> None:
    _same_shapes("mul", a=a, b=b, out=out)
    write(out, read(a) * read(b))


def silu_mul(gate=None, up=None, out=None, limit=None) -> None:
    """out = silu(gate) * up, gate and up clipped first when limit > 0 (1.3)."""
    op = "silu_mul"
    for name, t in (("gate", gate), ("up", up), ("out", out)):
        check_arg(op, name, t)
    _same_shapes(op, gate=gate, up=up, out=out)
    write(out, clipped_swiglu(read(gate), read(up), swiglu_limit(op, "limit", limit)))


def concat(a=None, b=None, out=None) -> None:
    op = "concat"
    check_arg(op, "a", a)
    check_arg(op, "b", b)
    check_arg(op, "out", out)
    T = a.shape[0]
    check_dim(op, "b.shape[0]", b.shape[0], T, "a.shape[0]")
    check_dim(op, "out.shape[0]", out.shape[0], T, "a.shape[0]")
    check_dim(op, "out.shape[1]", out.shape[1], a.shape[1] + b.shape[1], "a.shape[1] + b.shape[1]")
    write(out, np.concatenate([read(a), read(b)], axis=-1))
