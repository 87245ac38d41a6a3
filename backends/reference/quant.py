"""Block quantization (abi/README.md section 5) and the quantize / dequantize ops.

    real[..., r, c] = (q[..., r, c] - zeros[..., r / br, c / bc]) * scales[..., r / br, c / bc]

over the last two dims [R, C] of a tensor (a 1-d tensor is one row and its scales are 1-d too),
with br = block_rows or R, bc = block_cols or C. Dequantization is defined in f32 and is
bit-exact; quantization computes in f32 with each scale as stored in its own dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deepinfer import abi
from deepinfer import dtypes as D
from deepinfer.tensor import Quant, Tensor

from .common import cast, check_arg, check_tensor, i32, read, unsupported, write
# the op table's sets (deepinfer_abi.h): quantized storage, scales, and the quantize op's outputs
Q_DTYPES = tuple(sorted(abi.DTYPE_SETS["DI_DTS_WEIGHT_Q"]))
SCALE_DTYPES = tuple(sorted(abi.DTYPE_SETS["DI_DTS_SCALES"]))
QUANTIZE_OUT_DTYPES = tuple(sorted(abi.QMAX))     # DI_QMAX: the formats quantize writes, with their qmax
ASYMMETRIC_DTYPES = tuple(sorted({f.q_dtype for f in abi.FORMATS if f.asymmetric} | {"uint8"}))


@dataclass
class Blocking:
    """How the last two dims of a quantized tensor split into scale blocks."""

    lead: tuple          # leading dims, shared one to one with the scales
    rows: int            # R (1 for a 1-d tensor)
    cols: int            # C
    br: int
    bc: int

    @property
    def grid(self) -> tuple:
        """Shape of the scales as a 2-d-or-more array: lead + (ceil(R/br), ceil(C/bc))."""
        return self.lead + (-(-self.rows // self.br), -(-self.cols // self.bc))


def blocking(op: str, name: str, shape: tuple, block) -> Blocking:
    if len(shape) == 0:
        raise ValueError(f"{op}: {name} is 0-d; a quantized tensor needs at least one dimension")
    try:
        block_rows, block_cols = (int(b) for b in block)
    except (TypeError, ValueError):
        raise TypeError(f"{op}: {name}.quant.block must be a pair of integers, got {block!r}") from None
    if block_rows < 0 or block_cols < 0:
        raise ValueError(f"{op}: {name}.quant.block=({block_rows}, {block_cols}) is negative")
    rows, cols = (1, shape[0]) if len(shape) == 1 else (shape[-2], shape[-1])
    lead = tuple(shape[:-2])
    # 0 means "the whole dimension"; max(.., 1) keeps an empty dimension from dividing by zero
    br = block_rows or max(rows, 1)
    bc = block_cols or max(cols, 1)
    return Blocking(lead, rows, cols, br, bc)


def scales_shape(shape: tuple, b: Blocking) -> tuple:
    """The shape the scales tensor must have: a 1-d tensor has 1-d scales."""
    return b.grid[-1:] if len(shape) == 1 else b.grid


def expand(blocks: np.ndarray, b: Blocking) -> np.ndarray:
    """Per-block values [..., nr, nc] repeated onto the element grid [..., R, C]."""
    full = np.repeat(np.repeat(blocks, b.br, axis=-2), b.bc, axis=-1)
    return full[..., : b.rows, : b.cols]


def block_reduce(x: np.ndarray, b: Blocking, fn) -> np.ndarray:
    """fn (np.max / np.min) over each block of x [..., R, C]; partial edge blocks are padded with
    zeros, which is harmless because every caller's reduction already includes 0."""
    nr, nc = b.grid[-2:]
    pad = [(0, 0)] * (x.ndim - 2) + [(0, nr * b.br - b.rows), (0, nc * b.bc - b.cols)]
    xp = np.pad(x, pad)
    xp = xp.reshape(x.shape[:-2] + (nr, b.br, nc, b.bc))
    return fn(xp, axis=(-3, -1))


def check_quantized(op: str, name: str, t: Tensor) -> Blocking:
    """Validates a quantized tensor and its Quant descriptor; returns its blocking."""
    check_tensor(op, name, t, quant_ok=True)
    if t.quant is None:
        raise ValueError(f"{op}: {name} has no quantization descriptor (dtype {t.dtype.name})")
    q = t.quant
    if t.dtype.name not in Q_DTYPES:
        raise unsupported(op, f"{name}: quantized dtype {t.dtype.name} is not supported (known: {', '.join(Q_DTYPES)})")
    b = blocking(op, name, t.shape, q.block)
    want = scales_shape(t.shape, b)
    check_tensor(op, f"{name}.scales", q.scales)
    if q.scales.dtype.name not in SCALE_DTYPES:
        if q.scales.dtype.is_float:
            raise unsupported(op, f"{name}.scales dtype {q.scales.dtype.name} is not supported "
                                  f"(known: {', '.join(SCALE_DTYPES)})")
        raise TypeError(f"{op}: {name}.scales.dtype={q.scales.dtype.name}, expected a float dtype")
    if tuple(q.scales.shape) != want:
        raise ValueError(f"{op}: {name}.scales.shape={list(q.scales.shape)}, expected {list(want)} "
                         f"for {name}.shape={list(t.shape)} and block {tuple(q.block)}")
    if q.zeros is not None:
        check_tensor(op, f"{name}.zeros", q.zeros)
        if tuple(q.zeros.shape) != want:
            raise ValueError(f"{op}: {name}.zeros.shape={list(q.zeros.shape)}, expected {list(want)}")
    return b


def dequantize_array(t: Tensor, op: str = "dequantize", name: str = "x") -> np.ndarray:
    """The f32 values of a quantized host tensor: (q - zero) * scale, each step in f32."""
    b = check_quantized(op, name, t)
    grid = b.grid
    q = np.asarray(t.numpy()).astype(np.float32).reshape(b.lead + (b.rows, b.cols))
    scales = read(t.quant.scales, np.float32).reshape(grid)
    if t.quant.zeros is not None:
        zeros = read(t.quant.zeros, np.float32).reshape(grid)
        q = q - expand(zeros, b)
    real = q * expand(scales, b)
    return real.reshape(t.shape).astype(np.float32)


def dequantize(x=None, out=None) -> None:
    op = "dequantize"
    check_arg(op, "x", x)
    check_arg(op, "out", out)
    if x.quant is None:
        raise ValueError(f"{op}: x has no quantization descriptor (dtype {x.dtype.name})")
    if tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"{op}: out.shape={list(out.shape)} != x.shape={list(x.shape)}")
    write(out, dequantize_array(x, op, "x"))


# ---------------------------------------------------------------------------- quantization


def pow2_ceil(scale: np.ndarray) -> np.ndarray:
    """2^ceil(log2(s)) for s > 0, exactly (frexp gives s = m * 2^e with 0.5 <= m < 1)."""
    m, e = np.frexp(scale)
    return np.where(m == 0.5, scale, np.ldexp(np.ones_like(scale), e)).astype(scale.dtype)


def store_scales(scale: np.ndarray, scale_dtype, op: str) -> np.ndarray:
    """Scales as stored in their dtype, read back as f32 (the number q is computed with)."""
    stored = cast(scale, scale_dtype)
    back = stored.astype(np.float32)
    if np.any(back == 0) or not np.all(np.isfinite(back)):
        raise ValueError(f"{op}: a block scale is 0 or not finite once stored as {D.get(scale_dtype).name} "
                         f"(input values too small, too large or not finite)")
    return stored


def quantize_symmetric(x32: np.ndarray, qdtype, b: Blocking, scale_dtype, scale_pow2: bool, op: str):
    """(q element values, stored scales) of x [..., R, C] in f32, per the quantize op of the README."""
    qdt = D.get(qdtype)
    qmax = np.float32(qdt.max)
    amax = block_reduce(np.abs(x32), b, np.max).astype(np.float32)
    scale = (amax / qmax).astype(np.float32)
    if scale_pow2:
        scale = pow2_ceil(np.where(amax == 0, np.float32(1), scale))
    scale = np.where(amax == 0, np.float32(1), scale).astype(np.float32)
    stored = store_scales(scale, scale_dtype, op)
    v = (x32 / expand(stored.astype(np.float32), b)).astype(np.float32)
    if qdt.is_float:
        q = cast(v, qdt)  # round to nearest even, saturating at +-qmax
    else:
        q = np.clip(np.rint(v), -qmax, qmax).astype(np.int8)  # np.rint rounds half to even
    return q, stored


def quantize_asymmetric(x32: np.ndarray, qdtype, b: Blocking, scale_dtype, zero_dtype, op: str):
    """(q, stored scales, zeros) with scale = (max - min) / levels over a range that includes 0,
    zero = round(-min / scale) (so 0.0 is exactly representable and zero stays in [0, levels])."""
    levels = np.float32(D.get(qdtype).max)
    hi = block_reduce(x32, b, np.max).astype(np.float32)
    lo = block_reduce(x32, b, np.min).astype(np.float32)
    hi, lo = np.maximum(hi, np.float32(0)), np.minimum(lo, np.float32(0))
    scale = ((hi - lo) / levels).astype(np.float32)
    scale = np.where(hi == lo, np.float32(1), scale).astype(np.float32)
    stored = store_scales(scale, scale_dtype, op)
    s = stored.astype(np.float32)
    zero = np.clip(np.rint(-lo / s), 0, levels).astype(np.float32)
    v = (x32 / expand(s, b)).astype(np.float32)
    q = np.clip(np.rint(v) + expand(zero, b), 0, levels).astype(np.uint8)
    return q, stored, cast(zero, zero_dtype)


def quantize_array(x: np.ndarray, qdtype, block, scale_dtype, scale_pow2: bool = False,
                   symmetric: bool = True, zero_dtype="uint8") -> Tensor:
    """Quantizes a host array into a new quantized Tensor (the quantizer tool and the tests use it).

    Symmetric: int8, int4, e4m3, e5m2, e2m1 (the quantize op's rule). Asymmetric: uint4, uint8
    with zeros of `zero_dtype`, used offline by the quantizer.
    """
    op = "quantize_array"
    x = np.asarray(x)
    qdt, sdt = D.get(qdtype), D.get(scale_dtype)
    if sdt.name not in SCALE_DTYPES:
        raise ValueError(f"{op}: scale dtype {sdt.name} is not one of {', '.join(SCALE_DTYPES)}")
    b = blocking(op, "x", x.shape, block)
    x32 = x.astype(np.float32).reshape(b.lead + (b.rows, b.cols))
    zeros = None
    if symmetric:
        if qdt.name not in ("int8", "int4", "e4m3", "e5m2", "e2m1"):
            raise ValueError(f"{op}: symmetric quantization to {qdt.name} is not supported")
        q, stored = quantize_symmetric(x32, qdt, b, sdt, scale_pow2, op)
    else:
        if qdt.name not in ASYMMETRIC_DTYPES:
            raise ValueError(f"{op}: asymmetric quantization needs uint4 or uint8, got {qdt.name}")
        q, stored, z = quantize_asymmetric(x32, qdt, b, sdt, zero_dtype, op)
        zeros = Tensor.from_numpy(z.reshape(scales_shape(x.shape, b)), dtype=zero_dtype)
    scales = Tensor.from_numpy(stored.reshape(scales_shape(x.shape, b)), dtype=sdt)
    return Tensor.from_numpy(q.reshape(x.shape), dtype=qdt, quant=Quant(scales, tuple(int(v) for v in block), zeros))


def quantize(x=None, out=None, scale_pow2=None) -> None:
    op = "quantize"
    check_arg(op, "x", x)
    check_arg(op, "out", out)
    pow2 = i32(scale_pow2, op, "scale_pow2") != 0
    if tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"{op}: out.shape={list(out.shape)} != x.shape={list(x.shape)}")
    if out.quant is None:
        raise ValueError(f"{op}: out has no quantization descriptor (it must say the block and hold the scales)")
    if out.dtype.name not in QUANTIZE_OUT_DTYPES:
        raise unsupported(op, f"out dtype {out.dtype.name} is not supported (takes {', '.join(QUANTIZE_OUT_DTYPES)})")
    if out.quant.zeros is not None:
        raise unsupported(op, "asymmetric output (out.quant.zeros present); the quantize op is symmetric")
    b = check_quantized(op, "out", out)
    x32 = read(x, np.float32).reshape(b.lead + (b.rows, b.cols))
    q, stored = quantize_symmetric(x32, out.dtype, b, out.quant.scales.dtype, pow2, op)
    write(out, q.reshape(out.shape))
    write(out.quant.scales, stored.astype(np.float32).reshape(out.quant.scales.shape))
