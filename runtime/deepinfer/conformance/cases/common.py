"""The data model of a conformance case and the helpers every op family's cases are built from.

A Case is host NumPy data: tensors (TSpec, with a QSpec for quantized ones), scalars, what is
compared and how. The value helpers draw tensors from a case's own seed (plain, randn, a Format's
codes and scales); Profile and _Seeds say how many cases a generator draws and on which seeds.
OpCases is what each family module declares per op, and what the package collects.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import ml_dtypes
import numpy as np

from ... import abi
from ... import dtypes as D


# ====================================================================== data model


@dataclass
class QSpec:
    block: tuple[int, int]
    scales: "TSpec"
    zeros: Optional["TSpec"] = None


@dataclass
class TSpec:
    """One tensor argument. values: logical elements (dtype's NumPy type, 4-bit types unpacked);
    None for an output, which the harness poisons. pad=(lo, hi): the tensor is a column slice of a
    buffer lo + C + hi wide (a strided view); row_pad: the tensor [T, ...] is the first columns of a
    [T, prod(...) + row_pad] buffer, its inner dims contiguous (only dim 0's stride is wider: the
    runtime's q heads inside a fused projection's rows); alias: the name of another argument this one *is*."""

    dtype: str
    shape: tuple
    values: Optional[np.ndarray] = None
    quant: Optional[QSpec] = None
    out: bool = False
    pad: tuple[int, int] = (0, 0)
    alias: Optional[str] = None
    row_pad: int = 0


TArg = Union[TSpec, list]   # a list of Optional[TSpec] for the expert arrays of moe_experts


@dataclass
class Case:
    op: str
    name: str                  # human-readable, includes the shapes
    fmt: str                   # the format label the certificate groups results by
    tensors: dict[str, TArg]
    scalars: dict = field(default_factory=dict)
    check: list = field(default_factory=lambda: ["out"])   # outputs compared ("out.scales": quantize)
    tol_key: str = "f32"
    tol_keys: dict = field(default_factory=dict)   # per-output overrides of tol_key (hc_pre's f32 post, comb)
    compare: str = "close"     # close | exact | router | sample | spec_verify | indexer
    expect: str = "OK"         # a status name for cases that must fail (FAILED_PRECONDITION, ...)
    seed: int = 0
    # 1.4: the op takes a communicator; the harness passes a one-rank one of the backend it runs on
    comm: bool = False
    # 1.4: outputs [N, C, ...] compared only on the rows below a counts output ([N], the reference's):
    # {"recv": "recv_counts"}; the rows past the counts are unspecified
    counted: dict = field(default_factory=dict)

    def kwargs_names(self) -> list[str]:
        return list(self.tensors) + list(self.scalars)


# ====================================================================== value helpers


QMAX = abi.QMAX   # DI_QMAX of deepinfer_abi.h


def np_dtype(name: str) -> np.dtype:
    return D.get(name).np


def randn(rng: np.random.Generator, shape, dtype: str, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(np_dtype(dtype))


def _random_codes(rng, shape, qdtype: str) -> np.ndarray:
    """Random elements of a quantized storage type covering its whole code space."""
    shape = tuple(shape)
    if qdtype == "int4":
        return rng.integers(-8, 8, shape).astype(ml_dtypes.int4)
    if qdtype == "uint4":
        return rng.integers(0, 16, shape).astype(ml_dtypes.uint4)
    if qdtype == "int8":
        return rng.integers(-128, 128, shape).astype(np.int8)
    if qdtype == "e4m3":
        b = rng.integers(0, 256, shape).astype(np.uint8)
        b[(b & 0x7F) == 0x7F] = 0x3C          # no NaNs among the weights
        return b.view(ml_dtypes.float8_e4m3fn)
    if qdtype == "e2m1":
        return rng.integers(0, 16, shape).astype(np.uint8).view(ml_dtypes.float4_e2m1fn)
    raise ValueError(qdtype)


def _random_scales(rng, shape, sdtype: str, qdtype: str) -> np.ndarray:
    shape = tuple(shape)
    if sdtype == "e8m0":
        return rng.integers(122, 130, shape).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
    if sdtype == "e4m3":
        v = rng.uniform(0.05, 2.0, shape)
    else:
        # keeps dequantized weights around unit size whatever the code range
        mag = {"int4": 1 / 8, "uint4": 1 / 8, "int8": 1 / 64, "e4m3": 1 / 64, "e2m1": 1 / 4}[qdtype]
        v = rng.uniform(0.5, 1.5, shape) * mag
    return v.astype(np.float32).astype(np_dtype(sdtype))


def scale_shape(shape, block) -> tuple:
    br, bc = block
    if len(shape) == 1:
        return (math.ceil(shape[0] / (bc or shape[0])) if shape[0] else 0,)
    r, c = shape[-2], shape[-1]
    nr = math.ceil(r / (br or r)) if r else 0
    nc = math.ceil(c / (bc or c)) if c else 0
    return tuple(shape[:-2]) + (nr, nc)


@dataclass(frozen=True)
class Format:
    """A quantized storage format: q dtype, block, scale dtype, and zero points for asymmetric ones."""

    label: str
    qdtype: str
    block: tuple[int, int]
    sdtype: str
    zdtype: Optional[str] = None

    def random(self, rng, shape) -> TSpec:
        codes = _random_codes(rng, shape, self.qdtype)
        ss = scale_shape(shape, self.block)
        scales = TSpec(self.sdtype, ss, _random_scales(rng, ss, self.sdtype, self.qdtype))
        zeros = None
        if self.zdtype is not None:
            z = rng.uniform(4.0, 11.0, ss)
            z = np.round(z) if D.get(self.zdtype).is_float is False else z
            zeros = TSpec(self.zdtype, ss, z.astype(np.float32).astype(np_dtype(self.zdtype)))
        return TSpec(self.qdtype, tuple(shape), codes, QSpec(self.block, scales, zeros))

    def poisoned_output(self, shape) -> TSpec:
        ss = scale_shape(shape, self.block)
        return TSpec(self.qdtype, tuple(shape), None, QSpec(self.block, TSpec(self.sdtype, ss, None, out=True)),
                     out=True)


# every weight format of abi/README.md section 5, with the scale dtypes it lists
WEIGHT_FORMATS: dict[str, Format] = {f.label: f for f in [
    Format("int4/g32/sym/f32", "int4", (1, 32), "f32"),
    Format("int4/g64/sym/bf16", "int4", (1, 64), "bf16"),
    Format("int4/g128/sym/f16", "int4", (1, 128), "f16"),
    Format("uint4/g32/asym/f32", "uint4", (1, 32), "f32", "f32"),
    Format("uint4/g64/asym/bf16", "uint4", (1, 64), "bf16", "bf16"),
    Format("uint4/g128/asym/f16+u8", "uint4", (1, 128), "f16", "uint8"),
    Format("int8/channel/f32", "int8", (1, 0), "f32"),
    Format("e4m3/128x128/f32", "e4m3", (128, 128), "f32"),
    Format("e2m1/g16/e4m3", "e2m1", (1, 16), "e4m3"),
    Format("e2m1/g32/e8m0", "e2m1", (1, 32), "e8m0"),
]}


ACT_FORMATS: dict[str, Format] = {f.label: f for f in [
    Format("int8/token/f32", "int8", (1, 0), "f32"),
    Format("e4m3/1x128/f32", "e4m3", (1, 128), "f32"),
]}


# formats the quantize op writes (symmetric only)
QUANTIZE_FORMATS: dict[str, Format] = {f.label: f for f in [
    Format("int8/token/f32", "int8", (1, 0), "f32"),
    Format("int4/g32/f32", "int4", (1, 32), "f32"),
    Format("int4/g128/bf16", "int4", (1, 128), "bf16"),
    Format("e4m3/1x128/f32", "e4m3", (1, 128), "f32"),
    Format("e4m3/128x128/f32", "e4m3", (128, 128), "f32"),
    Format("e2m1/g16/e4m3", "e2m1", (1, 16), "e4m3"),
    Format("e2m1/g32/e8m0", "e2m1", (1, 32), "e8m0"),
]}


def plain(rng, shape, dtype, scale=1.0, pad=(0, 0)) -> TSpec:
    return TSpec(dtype, tuple(shape), randn(rng, shape, dtype, scale), pad=pad)


def out(shape, dtype, pad=(0, 0), alias=None) -> TSpec:
    return TSpec(dtype, tuple(shape), None, out=True, pad=pad, alias=alias)


def ints(values, dtype="int32") -> TSpec:
    a = np.asarray(values, dtype=np_dtype(dtype))
    return TSpec(dtype, a.shape, a)


def _shape_str(**dims) -> str:
    return " ".join(f"{k}={v}" for k, v in dims.items())


def _tol(op_out: str, quantized: bool) -> str:
    return ("q/" if quantized else "") + op_out


def _sparse_indices(rng, visible, K: int) -> np.ndarray:
    """[T, K] int32 selections of positions (or entries) below visible[t]: mostly valid ones, plus -1,
    values at and far past visible[t] and repeats, which every consumer skips or counts once. The last
    row of several holds no valid entry at all (a zero row without a window or a sink)."""
    T = len(visible)
    idx = np.empty((T, K), np.int64)
    for t in range(T):
        n = int(visible[t])
        row = list(rng.permutation(n)[: K - K // 4])
        while len(row) < K:
            junk = [-1, n, n + 3, 10**6] + ([row[int(rng.integers(0, len(row)))]] if row else [])
            row.append(junk[int(rng.integers(0, len(junk)))])
        idx[t] = rng.permutation(np.asarray(row, np.int64))
    if T > 2:
        idx[-1] = rng.choice(np.array([-1, -5, int(visible[-1]), 2**31 - 1]), K)
    return idx.astype(np.int32)


# ====================================================================== profiles and seeds


@dataclass(frozen=True)
class Profile:
    name: str
    random_draws: int      # random shapes per (op, dtype/format) on top of the fixed edge cases
    formats: str           # "some": one group size per family; "all": every format


PROFILES = {
    "quick": Profile("quick", 0, "some"),
    "default": Profile("default", 1, "all"),
    "thorough": Profile("thorough", 4, "all"),
}


FLOATS = ("f32", "bf16")


def _pick(profile: Profile, labels):
    labels = list(labels)
    if profile.formats == "all":
        return labels
    seen, out = set(), []
    for lab in labels:  # one per family in the quick profile
        fam = lab.split("/")[0]
        if fam not in seen:
            seen.add(fam)
            out.append(lab)
    return out


class _Seeds:
    def __init__(self, base: int):
        self.base = base
        self.rng = np.random.default_rng(base)

    def __call__(self) -> int:
        return int(self.rng.integers(0, 2**31))

    def fork(self, tag: int) -> "_Seeds":
        """Seeds of their own for cases a later ABI minor added to a generator, drawn without touching
        this sequence: every case that was there before keeps its seed (and a certificate's names)."""
        return _Seeds(self.base * 1000 + tag)


# ====================================================================== what a family module declares per op


@dataclass(frozen=True)
class OpCases:
    """One op's cases, declared by its family module (cases/<family>.py) in a dict OPS, op -> OpCases.

    generate(profile, seeds): the generator, fixed edge cases first, then profile.random_draws seeded
    random draws. valid(): a small, ordinary, successful call (the L0 checks mutate it). large(seeds):
    a few cases big enough to reach a library's threaded and vectorised paths (blocked loops, work split
    across threads, tails of SIMD widths), drawn on the same seeds after generate's. full(): a small
    successful call that also sets every field appended after the op (DI_ARGS_SINCE); valid when None."""

    generate: Callable
    valid: Callable[[], Case]
    large: Optional[Callable] = None
    full: Optional[Callable[[], Case]] = None
