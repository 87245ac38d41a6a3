"""Tensors as the ABI sees them: a buffer, a shape, a dtype, element strides, a byte offset and an
optional block-quantization descriptor.

Host tensors are backed by a NumPy array (the reference and CPU backends use them directly);
device tensors by a DeviceBuffer that a native backend allocated through the ABI. Views (reshape,
row and column slices) never copy: they only change the descriptor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from . import dtypes as D
from .dtypes import DType


class DeviceBuffer:
    """Memory a native backend allocated with mem_alloc; freed when the last tensor drops it."""

    __slots__ = ("ptr", "nbytes", "backend", "__weakref__")

    def __init__(self, ptr: int, nbytes: int, backend):
        self.ptr, self.nbytes, self.backend = ptr, nbytes, backend

    def __del__(self):
        b = self.backend
        if b is not None and self.ptr:
            try:
                b._free(self.ptr)
            except Exception:  # interpreter shutdown: the library may be gone already
                pass
            self.ptr = 0


@dataclass
class Quant:
    """real = (q - zeros) * scales, one scale per (block_rows, block_cols) block; 0 = whole dim."""

    scales: "Tensor"
    block: tuple[int, int]
    zeros: Optional["Tensor"] = None

    def describe(self, q_dtype: DType) -> str:
        br, bc = self.block
        z = "asym" if self.zeros is not None else "sym"
        return f"{q_dtype.name} block({br},{bc}) {z} scales={self.scales.dtype.name}"


def contiguous_strides(shape: Sequence[int], packed: bool = False) -> tuple[int, ...]:
    """Row-major strides; 4-bit rows are padded to whole bytes so every other stride is even."""
    strides, acc = [], 1
    for i, n in enumerate(reversed(shape)):
        strides.append(acc)
        n = max(int(n), 1)
        acc *= (n + 1) // 2 * 2 if (packed and i == 0) else n
    return tuple(reversed(strides))


def pack_4bit(values: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes (any integer array, values taken mod 16) two per byte, low nibble first."""
    v = np.asarray(values).astype(np.int64) & 0xF
    if v.shape[-1] % 2:
        v = np.concatenate([v, np.zeros(v.shape[:-1] + (1,), np.int64)], axis=-1)
    return (v[..., 0::2] | (v[..., 1::2] << 4)).astype(np.uint8)


def unpack_4bit(packed: np.ndarray, n: int) -> np.ndarray:
    """The 4-bit codes (0..15) of a packed uint8 array; n = logical length of the last dim."""
    p = np.asarray(packed, dtype=np.uint8)
    out = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = p >> 4
    return out[..., :n]


def codes_to_dtype(codes: np.ndarray, dtype: DType) -> np.ndarray:
    """4-bit codes (0..15) -> elements of the 4-bit dtype (int4 sign-extends, e2m1 decodes)."""
    c = np.asarray(codes).astype(np.uint8)
    if dtype.name == "int4":
        return np.where(c >= 8, c.astype(np.int8) - 16, c.astype(np.int8)).astype(dtype.np)
    return c.view(dtype.np)  # uint4 and e2m1: the code is the bit pattern of a 1-byte element


class Tensor:
    """A strided view of a buffer, plus an optional Quant. Shapes and strides are in elements."""

    # __weakref__: backends cache a tensor's marshalled C descriptor for as long as the tensor lives
    __slots__ = ("buffer", "shape", "dtype", "strides", "offset", "quant", "__weakref__")

    def __init__(self, buffer, shape, dtype, strides=None, offset: int = 0, quant: Optional[Quant] = None):
        self.buffer = buffer
        self.shape = tuple(int(s) for s in shape)
        self.dtype = D.get(dtype)
        self.strides = (
            tuple(int(s) for s in strides) if strides is not None else contiguous_strides(self.shape, self.dtype.packed)
        )
        self.offset = int(offset)  # bytes
        self.quant = quant

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_numpy(cls, arr: np.ndarray, dtype=None, quant: Optional[Quant] = None) -> "Tensor":
        """Wrap a host array without copying (a non-contiguous one is copied first).

        For 4-bit dtypes pass the *unpacked* elements (or codes); they are packed into a new array.
        """
        arr = np.asarray(arr)
        dt = D.get(dtype) if dtype is not None else D.get(arr.dtype)
        if dt.packed:
            codes = (arr.view(np.uint8) if arr.dtype.itemsize == 1 else arr.astype(np.int64)) & 0xF
            packed = np.ascontiguousarray(pack_4bit(codes))
            return cls(packed, arr.shape, dt, quant=quant)
        if arr.dtype != dt.np:
            arr = arr.astype(dt.np)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        return cls(arr, arr.shape, dt, quant=quant)

    @classmethod
    def empty(cls, shape, dtype, fill: Optional[float] = None) -> "Tensor":
        """A new host tensor; `fill` poisons it (NaN for floats is how tests catch unwritten output)."""
        dt = D.get(dtype)
        shape = tuple(int(s) for s in shape)
        if dt.packed:
            n_last = shape[-1] if shape else 1
            buf = np.zeros(shape[:-1] + ((n_last + 1) // 2,), np.uint8)
            return cls(buf, shape, dt)
        buf = np.empty(shape, dt.np)
        if fill is not None:
            buf[...] = fill
        return cls(buf, shape, dt)

    # ------------------------------------------------------------------ properties
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def on_host(self) -> bool:
        return isinstance(self.buffer, np.ndarray)

    @property
    def device(self) -> str:
        return "cpu" if self.on_host else self.buffer.backend.device

    @property
    def data_ptr(self) -> int:
        if self.on_host:
            return self.buffer.ctypes.data
        return self.buffer.ptr

    @property
    def nbytes(self) -> int:
        """Bytes a contiguous tensor of this shape occupies (4-bit rows padded to whole bytes)."""
        if self.dtype.packed and self.ndim:
            return math.prod(self.shape[:-1]) * ((self.shape[-1] + 1) // 2)
        return self.dtype.nbytes(self.numel)

    def is_contiguous(self) -> bool:
        return self.strides == contiguous_strides(self.shape, self.dtype.packed)

    def __repr__(self) -> str:
        q = f", quant={self.quant.describe(self.dtype)}" if self.quant else ""
        return f"Tensor({list(self.shape)}, {self.dtype.name}, {self.device}{q})"

    # ------------------------------------------------------------------ views (no copies)
    def view(self, *shape) -> "Tensor":
        """Reshape a contiguous tensor (one dim may be -1)."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = list(shape)
        if -1 in shape:
            i = shape.index(-1)
            rest = math.prod(s for j, s in enumerate(shape) if j != i)
            shape[i] = self.numel // rest if rest else 0
        if math.prod(shape) != self.numel:
            raise ValueError(f"cannot view {list(self.shape)} as {shape}")
        if not self.is_contiguous():
            raise ValueError(f"view of a non-contiguous tensor {self!r}")
        return Tensor(self.buffer, shape, self.dtype, None, self.offset, self.quant)

    def narrow(self, dim: int, start: int, length: int) -> "Tensor":
        """Elements [start, start+length) of one dimension; shares the buffer."""
        dim = dim % self.ndim
        if start < 0 or start + length > self.shape[dim]:
            raise ValueError(f"narrow({dim}, {start}, {length}) out of range for {list(self.shape)}")
        if self.quant is not None:
            raise ValueError("narrow of a quantized tensor is not supported")
        shape = list(self.shape)
        shape[dim] = length
        elem_off = start * self.strides[dim]
        if self.dtype.packed and elem_off % 2:
            raise ValueError("a 4-bit view must start on a byte boundary")
        return Tensor(self.buffer, shape, self.dtype, self.strides, self.offset + self.dtype.nbytes(elem_off))

    def byte_view(self, start: int = 0, nbytes: Optional[int] = None) -> "Tensor":
        """Bytes [start, start + nbytes) of this tensor's storage (default: all nbytes of it) as a
        1-D uint8 Tensor of the same buffer: what raw copies and byte-level slicing use."""
        n = self.nbytes - start if nbytes is None else nbytes
        return Tensor(self.buffer, (n,), "uint8", None, self.offset + start)

    # ------------------------------------------------------------------ host access
    def numpy(self) -> np.ndarray:
        """A NumPy view of a host tensor's elements (for 4-bit dtypes: the unpacked elements, a copy)."""
        if not self.on_host:
            raise ValueError(f"{self!r} lives on {self.device}; use backend.to_numpy()")
        base = self.buffer.view(np.uint8).reshape(-1)
        if self.dtype.packed:
            if self.ndim == 0:
                raise ValueError("0-d 4-bit tensor")
            rows = self.shape[:-1]
            n = self.shape[-1]
            nb = (n + 1) // 2
            byte_strides = [s // 2 for s in self.strides[:-1]] + [1]
            packed = np.lib.stride_tricks.as_strided(
                base[self.offset:], shape=tuple(rows) + (nb,), strides=tuple(byte_strides), writeable=False
            )
            return codes_to_dtype(unpack_4bit(packed, n), self.dtype)
        item = self.dtype.np.itemsize
        typed = base[self.offset:]
        n_bytes_needed = item * (1 + sum((s - 1) * st for s, st in zip(self.shape, self.strides))) if self.numel else 0
        typed = typed[: max(n_bytes_needed, 0)].view(self.dtype.np) if n_bytes_needed else np.empty(0, self.dtype.np)
        return np.lib.stride_tricks.as_strided(
            typed, shape=self.shape, strides=tuple(s * item for s in self.strides)
        )

    def packed_bytes(self) -> np.ndarray:
        """The raw packed uint8 storage of a contiguous host 4-bit tensor."""
        assert self.dtype.packed and self.on_host
        nb = (self.shape[-1] + 1) // 2
        return self.buffer.view(np.uint8).reshape(-1)[self.offset:].reshape(-1)[: math.prod(self.shape[:-1]) * nb].reshape(
            self.shape[:-1] + (nb,)
        )
