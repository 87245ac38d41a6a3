"""Argument checking, reading and writing of host tensors, shared by every op of the reference.

The reference mirrors the C status codes with Python exceptions:

    INVALID_ARGUMENT    -> ValueError (bad shape, stride, value) or TypeError (wrong kind of dtype)
    UNIMPLEMENTED       -> deepinfer.errors.UnsupportedOpError (a valid dtype/format this op lacks)
    FAILED_PRECONDITION -> deepinfer.errors.BackendCallError with status FAILED_PRECONDITION

Every op validates all of its arguments before it writes anything, reads its inputs into fresh
arrays (so outputs may alias inputs) and writes each output once, rounded once to its dtype.
"""
from __future__ import annotations

from typing import Iterable, Optional

import numpy as np

from deepinfer import abi
from deepinfer import dtypes as D
from deepinfer.errors import BackendCallError, UnsupportedOpError
from deepinfer.tensor import Tensor

# The dtype sets of the op table in deepinfer_abi.h (DI_DTS_*), never restated here.
FLOAT = tuple(sorted(abi.DTYPE_SETS["DI_DTS_FLOAT"]))     # "float" in abi/README.md section 8
INDEX = tuple(sorted(abi.DTYPE_SETS["DI_DTS_INDEX"]))
SCALE_DTYPES = abi.DTYPE_SETS["DI_DTS_SCALES"]
ZERO_DTYPES = abi.DTYPE_SETS["DI_DTS_ZEROS"]


def unsupported(op: str, message: str) -> UnsupportedOpError:
    return UnsupportedOpError(op, abi.UNIMPLEMENTED, "UNIMPLEMENTED", f"{op}: {message}")


def failed_precondition(op: str, message: str) -> BackendCallError:
    return BackendCallError(op, abi.FAILED_PRECONDITION, "FAILED_PRECONDITION", f"{op}: {message}")


def f32(value, op: str, name: str) -> float:
    """A float scalar argument as the C struct holds it (an f32)."""
    if value is None:
        value = 0.0  # the C args struct is zero-filled
    try:
        return float(np.float32(value))
    except (TypeError, ValueError):
        raise TypeError(f"{op}: {name} must be a number, got {value!r}") from None


def i32(value, op: str, name: str) -> int:
    """An int32 scalar argument as the C struct holds it."""
    if value is None:
        return 0
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if not isinstance(value, (int, np.integer)):
        raise TypeError(f"{op}: {name} must be an integer, got {value!r}")
    if not -(2**31) <= int(value) < 2**31:
        raise ValueError(f"{op}: {name}={value} does not fit in int32")
    return int(value)


def present(t) -> bool:
    return t is not None


def check_tensor(op: str, name: str, t, ndim: Optional[Iterable[int] | int] = None, quant_ok: bool = False) -> Tensor:
    """The layout rules every descriptor obeys (sections 3 and 4 of the README); dtypes are the op
    table's business (check_arg)."""
    if t is None:
        raise ValueError(f"{op}: {name} is required")
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: {name} must be a deepinfer Tensor, got {type(t).__name__}")
    if not t.on_host:
        where = t.device if t.buffer is not None else "no memory (data NULL)"
        raise ValueError(f"{op}: {name} lives on {where}; the reference backend reads host memory only")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.ndim not in allowed:
            want = " or ".join(str(n) for n in allowed)
            raise ValueError(f"{op}: {name}.ndim={t.ndim}, expected {want} (shape {list(t.shape)})")
    if t.ndim > abi.MAX_DIMS:
        raise ValueError(f"{op}: {name}.ndim={t.ndim} > {abi.MAX_DIMS}")
    if any(n < 0 for n in t.shape):
        raise ValueError(f"{op}: {name} has a negative dimension {list(t.shape)}")
    if t.ndim and t.strides[-1] != 1:
        raise ValueError(f"{op}: {name}.strides[{t.ndim - 1}]={t.strides[-1]}, the last stride must be 1")
    if any(s < 0 for s in t.strides):
        raise ValueError(f"{op}: {name} has a negative stride {list(t.strides)}")
    if t.dtype.packed and any(s % 2 for s in t.strides[:-1]):
        raise ValueError(f"{op}: {name} is 4-bit packed and has an odd stride {list(t.strides)}")
    if t.numel and t.offset + span_bytes(t) > t.buffer.nbytes:
        raise ValueError(f"{op}: {name} (shape {list(t.shape)}, strides {list(t.strides)}, byte offset {t.offset}) "
                         f"reaches past the end of its {t.buffer.nbytes}-byte buffer")
    if t.quant is not None and not quant_ok:
        raise unsupported(op, f"{name} is quantized ({t.quant.describe(t.dtype)}); this argument takes plain values")
    return t


def _check_dtype_in(op: str, name: str, dt, allowed) -> None:
    """README section 8: another float where floats are taken is UNIMPLEMENTED, else INVALID."""
    if dt.name in allowed:
        return
    names = sorted(allowed, key=lambda n: list(abi.DTYPE_IDS).index(n))
    if dt.is_float and any(D.get(a).is_float for a in allowed):
        raise unsupported(op, f"{name}.dtype={dt.name} is not supported (takes {', '.join(names)})")
    raise TypeError(f"{op}: {name}.dtype={dt.name}, expected {' or '.join(names)}")


def check_arg(op: str, name: str, t, label: Optional[str] = None) -> Optional[Tensor]:
    """Checks tensor argument `name` of `op` against its row of the op table (DI_ARGS_<op> in
    deepinfer_abi.h): presence, rank, dtype, and the quantization descriptor's own rules.
    `label` names an element of a descriptor array in messages ("w_gate[3]")."""
    spec = abi.OP_SPECS[op].arg(name)
    label = label or name
    if t is None:
        if spec.optional:
            return None
        raise ValueError(f"{op}: {label} is required")
    lo, hi = spec.ndim
    check_tensor(op, label, t, ndim=range(lo, hi + 1), quant_ok=True)
    q = t.quant
    if q is None:
        if not spec.plain:
            raise ValueError(f"{op}: {label} has no quantization descriptor (dtype {t.dtype.name}); it must be quantized")
        _check_dtype_in(op, label, t.dtype, spec.plain)
        return t
    if not spec.quant:
        raise unsupported(op, f"{label} is quantized ({q.describe(t.dtype)}); this argument takes plain values")
    if t.dtype.name not in spec.quant:
        raise unsupported(op, f"{label}: quantized storage dtype {t.dtype.name} is not a format of this argument "
                              f"(takes {', '.join(sorted(spec.quant))})")
    for part, s, allowed in (("scales", q.scales, SCALE_DTYPES), ("zeros", q.zeros, ZERO_DTYPES)):
        if s is None:
            continue
        check_tensor(op, f"{label}.{part}", s, ndim=t.ndim)
        _check_dtype_in(op, f"{label}.{part}", s.dtype, allowed)
    return t


def check_op_args(op: str, kwargs: dict) -> None:
    """Every tensor argument of one call against the op table (the ops' own checks add the shape rules)."""
    for spec in abi.OP_SPECS[op].args:
        v = kwargs.get(spec.name)
        if spec.is_array:
            for i, t in enumerate(v or ()):
                if t is not None and (not isinstance(t, Tensor) or t.buffer is not None):
                    check_arg(op, spec.name, t, f"{spec.name}[{i}]")
        else:
            check_arg(op, spec.name, v)


def span_bytes(t: Tensor) -> int:
    """Bytes from the first element of a view to the end of its last one."""
    if t.dtype.packed:
        rows = sum((n - 1) * (s // 2) for n, s in zip(t.shape[:-1], t.strides[:-1]))
        return rows + (t.shape[-1] + 1) // 2
    return t.dtype.np.itemsize * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.strides)))


def check_shape(op: str, name: str, t: Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name}.shape={list(t.shape)}, expected {list(shape)}")


def check_dim(op: str, what: str, got: int, expected: int, against: str) -> None:
    """Raises "linear: w.shape[1]=64 != x.shape[1]=96"."""
    if got != expected:
        raise ValueError(f"{op}: {what}={got} != {against}={expected}")


def read(t: Tensor, dtype=np.float64) -> np.ndarray:
    """A fresh copy of a tensor's elements (plain values only), converted to `dtype`."""
    return np.array(t.numpy(), dtype=dtype, copy=True)


def read_index(t: Tensor) -> np.ndarray:
    return np.array(t.numpy(), dtype=np.int64, copy=True)


def cast(values: np.ndarray, dtype) -> np.ndarray:
    """Round once to an ABI dtype (ml_dtypes rounds float64 directly, to nearest even)."""
    dt = D.get(dtype)
    v = np.asarray(values)
    if dt.name in ("e4m3", "e2m1"):
        # these formats have no infinity: saturate instead of producing NaN
        v = np.clip(v, -dt.max, dt.max)
    return v.astype(dt.np)


def write(t: Tensor, values: np.ndarray) -> None:
    """Writes `values` into the memory of `t` in place (strided views and 4-bit packing included)."""
    values = np.broadcast_to(np.asarray(values), t.shape)
    if t.dtype.packed:
        write_4bit(t, values)
        return
    t.numpy()[...] = cast(values, t.dtype)


def codes_4bit(values: np.ndarray, dtype) -> np.ndarray:
    """The 4-bit codes (0..15) of int4 / uint4 / e2m1 element values."""
    dt = D.get(dtype)
    v = np.asarray(values)
    if dt.name == "e2m1":
        return cast(v, dt).view(np.uint8) & 0xF
    return v.astype(np.int64).astype(np.uint8) & 0xF  # int4: two's complement in the low nibble


def write_4bit(t: Tensor, values: np.ndarray) -> None:
    """Packs elements of a 4-bit tensor into its bytes, element 2i in the low nibble of byte i.

    Only the tensor's own nibbles change: the padding nibble of an odd-length row and any bytes
    between strided rows keep their contents.
    """
    if t.ndim == 0:
        raise ValueError("a 4-bit tensor needs at least one dimension")
    codes = codes_4bit(np.broadcast_to(values, t.shape), t.dtype)
    n = t.shape[-1]
    nb = (n + 1) // 2
    base = t.buffer.view(np.uint8).reshape(-1)
    byte_strides = tuple(s // 2 for s in t.strides[:-1]) + (1,)
    rows = t.shape[:-1]
    if t.numel == 0:
        return
    span = 1 + sum((d - 1) * s for d, s in zip(tuple(rows) + (nb,), byte_strides))
    dest = np.lib.stride_tricks.as_strided(base[t.offset:t.offset + span], shape=tuple(rows) + (nb,),
                                           strides=byte_strides, writeable=True)
    packed = np.array(dest, dtype=np.uint8)
    low, high = codes[..., 0::2], codes[..., 1::2]
    packed = (packed & 0xF0) | low
    nh = high.shape[-1]
    packed[..., :nh] = (packed[..., :nh] & 0x0F) | (high << 4)
    dest[...] = packed


def sigmoid(v: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-v)), written so that exp never overflows (no warnings for large |v|)."""
    e = np.exp(-np.abs(v))
    return np.where(v >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def softmax(scores: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(scores - scores.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def check_pow2(op: str, name: str, value: int) -> None:
    """The 1.3 paged layouts (kv_compress, indexer_topk, sparse_attention) need block sizes and
    ratios that are powers of two: only then does one divide the other, so that an entry's slot
    (pe % BS) / ratio always falls inside its block of max(1, BS / ratio) entries."""
    if value < 1 or value & (value - 1):
        raise ValueError(f"{op}: {name}={value} must be a power of two (abi/README.md section 8)")


def check_nonneg_finite(op: str, name: str, value: float) -> None:
    if not (np.isfinite(value) and value >= 0):
        raise ValueError(f"{op}: {name}={value} must be finite and >= 0")


def blocks_of(op: str, table: np.ndarray, seq: int, pos: np.ndarray, BS: int, NB: int, what: str) -> np.ndarray:
    """The cache blocks holding positions `pos` of sequence `seq` (block_table[seq, pos // BS]),
    checked: a block id outside [0, NB) is INVALID_ARGUMENT, never a read out of bounds."""
    pos = np.asarray(pos, np.int64)
    b = table[seq, pos // BS]
    bad = (b < 0) | (b >= NB)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{op}: block_table[{seq}, {pos[i] // BS}]={b[i]} outside [0, {NB}) ({what} {pos[i]})")
    return b
