"""The dtypes of the ABI: DLPack (code, bits) pairs and their NumPy / ml_dtypes equivalents.

One table, read by the tensor descriptors, the reference backend and the conformance suite.
4-bit types are stored packed two per byte along the last dimension (low nibble first); their
`np` entry is the unpacked element type used by the reference when it unpacks them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from . import abi


@dataclass(frozen=True)
class DType:
    name: str
    code: int
    bits: int
    np_name: str  # element type after unpacking (for 4-bit types, one element per byte), by name
    is_float: bool
    max: float  # largest finite magnitude, used by quantizers

    @property
    def np(self) -> np.dtype:
        return _numpy_dtype(self.np_name)

    @property
    def packed(self) -> bool:
        return self.bits == 4

    def nbytes(self, numel: int) -> int:
        return (numel * self.bits + 7) // 8

    def __repr__(self) -> str:
        return self.name


def _c(name: str) -> int:
    return abi.const(name)


# ml_dtypes costs 0.5-1.6 s to import, so its types are named here and resolved on first use:
# `deepinfer --help`, `deepinfer backends` and every argument check run without it.
_ML_DTYPES = {"bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float4_e2m1fn", "int4", "uint4"}


@functools.lru_cache(maxsize=None)
def _numpy_dtype(name: str) -> np.dtype:
    if name in _ML_DTYPES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


_TABLE = [
    # name     code                     bits  element type      float   max
    ("f32",    _c("DI_DTYPE_FLOAT"),      32, "float32",         True,  float(np.finfo(np.float32).max)),
    ("f16",    _c("DI_DTYPE_FLOAT"),      16, "float16",         True,  65504.0),
    ("bf16",   _c("DI_DTYPE_BFLOAT"),     16, "bfloat16",        True,  3.3895313892515355e38),  # (2 - 2^-7) * 2^127
    ("e4m3",   _c("DI_DTYPE_F8_E4M3FN"),   8, "float8_e4m3fn",   True,  448.0),
    ("e5m2",   _c("DI_DTYPE_F8_E5M2"),     8, "float8_e5m2",     True,  57344.0),
    ("e8m0",   _c("DI_DTYPE_F8_E8M0FNU"),  8, "float8_e8m0fnu",  True,  float(2.0 ** 127)),
    ("e2m1",   _c("DI_DTYPE_F4_E2M1FN"),   4, "float4_e2m1fn",   True,  6.0),
    ("int4",   _c("DI_DTYPE_INT"),         4, "int4",            False, 7.0),
    ("uint4",  _c("DI_DTYPE_UINT"),        4, "uint4",           False, 15.0),
    ("int8",   _c("DI_DTYPE_INT"),         8, "int8",            False, 127.0),
    ("uint8",  _c("DI_DTYPE_UINT"),        8, "uint8",           False, 255.0),
    ("int32",  _c("DI_DTYPE_INT"),        32, "int32",           False, float(2**31 - 1)),
    ("int64",  _c("DI_DTYPE_INT"),        64, "int64",           False, float(2**63 - 1)),
    ("uint64", _c("DI_DTYPE_UINT"),       64, "uint64",          False, float(2**64 - 1)),
]

BY_NAME: dict[str, DType] = {}
BY_CODE: dict[tuple[int, int], DType] = {}
for _row in _TABLE:
    _dt = DType(*_row)
    BY_NAME[_dt.name] = _dt
    BY_CODE[(_dt.code, _dt.bits)] = _dt
    globals()[_dt.name] = _dt

FLOAT_ACTIVATIONS = ("f32", "bf16")


def get(name_or_dtype) -> DType:
    """Look up a DType by name, DType, or NumPy dtype."""
    if isinstance(name_or_dtype, DType):
        return name_or_dtype
    if isinstance(name_or_dtype, str):
        try:
            return BY_NAME[name_or_dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {name_or_dtype!r}; known: {', '.join(BY_NAME)}") from None
    npd = np.dtype(name_or_dtype)
    for dt in BY_NAME.values():
        if dt.np == npd:
            return dt
    raise ValueError(f"NumPy dtype {npd} has no deepinfer equivalent")


def from_code(code: int, bits: int) -> DType:
    try:
        return BY_CODE[(code, bits)]
    except KeyError:
        raise ValueError(f"no deepinfer dtype with DLPack code {code} and {bits} bits") from None
