"""linear (abi/README.md section 8): out = dequant(x) @ dequant(w)^T (+ bias)."""
from __future__ import annotations

import numpy as np

from deepinfer import abi
from deepinfer.tensor import Tensor

from .common import check_arg, check_dim, check_shape, read, unsupported, write
from .quant import dequantize_array

# activation formats of x: (q dtype, block) pairs, symmetric; the "A" rows of DI_FORMATS in the header
X_FORMATS = {(f.q_dtype, (f.block_rows, f.block_cols)) for f in abi.FORMATS if f.use == "A"}


def weight_values(op: str, name: str, w: Tensor) -> np.ndarray:
    """The float64 values of a weight in any format linear accepts (plain f32/bf16 or quantized)."""
    if w.quant is not None:
        return dequantize_array(w, op, name).astype(np.float64)
    return read(w)


def linear(x=None, w=None, bias=None, out=None) -> None:
    op = "linear"
    check_arg(op, "x", x)
    check_arg(op, "w", w)
    check_arg(op, "out", out)
    (M, K), N = x.shape, w.shape[0]
    check_dim(op, "w.shape[1]", w.shape[1], K, "x.shape[1]")
    check_shape(op, "out", out, (M, N))
    if bias is not None:
        check_arg(op, "bias", bias)
        check_dim(op, "bias.shape[0]", bias.shape[0], N, "w.shape[0]")
    if x.quant is not None:
        fmt = (x.dtype.name, tuple(int(b) for b in x.quant.block))
        if fmt not in X_FORMATS or x.quant.zeros is not None:
            raise unsupported(op, f"activation format {x.quant.describe(x.dtype)} (x takes f32, bf16, "
                                  f"int8 block (1,0) or e4m3 block (1,128), symmetric)")
    xv = weight_values(op, "x", x)
    wv = weight_values(op, "w", w)
    y = xv @ wv.T
    if bias is not None:
        y = y + read(bias)[None, :]
    write(out, y)
