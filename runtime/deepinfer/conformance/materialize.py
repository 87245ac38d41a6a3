"""A Case's tensors as a backend's arguments, and what the harness reads back from them.

Inputs are fresh host arrays; outputs are poisoned (NaN for floats, 0x7F bytes otherwise) before
each run, and the padding around strided views holds a sentinel the op must leave alone. The
library and the reference each get their own copy of every buffer, so an op that writes its inputs
is caught and aliasing (out = a, residual_out = x) is reproduced exactly on both sides. The
collective cases (1.4) get the backend's one-rank communicator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import dtypes as D
from ..errors import UnsupportedOpError
from ..tensor import Quant, Tensor
from .cases import Case, QSpec, TSpec

POISON_BYTE = 0x7F
PAD_BYTE = 0x5A      # sentinel of the columns around a strided view


# ====================================================================== materialising tensors


@dataclass
class _Held:
    """A tensor handed to the op, with what is needed to read it back and check its padding."""

    view: Tensor
    base: Tensor                   # the whole buffer (== view unless padded)
    lo: int = 0
    hi: int = 0
    base_before: Optional[np.ndarray] = None


def _poison(arr: np.ndarray, dtype: str) -> None:
    dt = D.get(dtype)
    if dt.is_float and dtype not in ("e8m0",):
        arr[...] = np.nan
    else:
        arr.view(np.uint8)[...] = POISON_BYTE


def _host(spec: TSpec) -> tuple[Tensor, Tensor, int, int]:
    dt = D.get(spec.dtype)
    quant = None
    if spec.quant is not None:
        quant = _host_quant(spec.quant)
    if dt.packed:
        if spec.values is None:
            n = spec.shape[-1]
            buf = np.full(tuple(spec.shape[:-1]) + ((n + 1) // 2,), POISON_BYTE, np.uint8)
            t = Tensor(buf, spec.shape, dt, quant=quant)
        else:
            t = Tensor.from_numpy(np.asarray(spec.values), dt, quant=quant)
        return t, t, 0, 0
    lo, hi = spec.pad
    shape = tuple(spec.shape)
    if spec.row_pad:
        return _host_row_padded(spec, dt, quant)
    if lo or hi:
        wide = np.empty(shape[:-1] + (lo + shape[-1] + hi,), dt.np)
        wide.view(np.uint8)[...] = PAD_BYTE
        inner = wide[..., lo:lo + shape[-1]]
    else:
        wide = np.empty(shape, dt.np)
        inner = wide
    if spec.values is None:
        _poison(inner, spec.dtype)
    else:
        inner[...] = np.asarray(spec.values, dt.np).reshape(shape)
    base = Tensor(wide, wide.shape, dt, quant=None if (lo or hi) else quant)
    if lo or hi:
        view = Tensor(wide, shape, dt, base.strides, dt.nbytes(lo), quant)
        return view, base, lo, hi
    return base, base, 0, 0


def _host_row_padded(spec: TSpec, dt, quant) -> tuple[Tensor, Tensor, int, int]:
    """A [T, ...] view over the first columns of a [T, inner + row_pad] buffer (TSpec.row_pad): the
    padding is the last row_pad columns of the 2-d base, so padding_damage checks it as any pad."""
    shape = tuple(spec.shape)
    inner = int(np.prod(shape[1:]))
    wide = np.empty((shape[0], inner + spec.row_pad), dt.np)
    wide.view(np.uint8)[...] = PAD_BYTE
    part = wide[:, :inner]
    if spec.values is None:
        _poison(part, spec.dtype)
    else:
        part[...] = np.asarray(spec.values, dt.np).reshape(shape[0], inner)
    base = Tensor(wide, wide.shape, dt)
    strides = (inner + spec.row_pad,) + tuple(Tensor(None, shape[1:], dt).strides)
    return Tensor(wide, shape, dt, strides, 0, quant), base, 0, spec.row_pad


def _host_quant(q: QSpec) -> Quant:
    s, _, _, _ = _host(q.scales)
    z = _host(q.zeros)[0] if q.zeros is not None else None
    return Quant(s, tuple(q.block), z)


# ====================================================================== communicators (ABI 1.4)

# backend id -> its one-rank communicator, made on first use and kept until release_comm (the Comm
# holds its backend, so an id stays that backend's while it is here)
_COMMS: dict = {}


def one_rank_comm(backend):
    """The backend's communicator of one rank (rank 0 of 1), the `comm` of every collective case run on
    it: made once from the backend's own id (comm_unique_id, comm_create), as a process of a one-rank job
    would. Raises what the backend raises when it cannot make one (UnsupportedOpError: no communicators)."""
    c = _COMMS.get(id(backend))
    if c is None or c.handle is None or c.backend is not backend:
        c = backend.comm_create(backend.comm_unique_id(), 1, 0)
        _COMMS[id(backend)] = c
    return c


def release_comm(backend) -> None:
    """Destroy the backend's one-rank communicator, if it made one (before the backend is closed)."""
    c = _COMMS.pop(id(backend), None)
    if c is not None and c.backend is backend:
        c.close()


def comm_unavailable(backend) -> Optional[str]:
    """Why the collective cases cannot run on this backend, or None: it has no communicators (an older
    ABI, or a library that implements none), or making a one-rank one is UNIMPLEMENTED here (a GPU
    library whose NCCL is missing)."""
    if not getattr(backend, "supports_comm", False):
        return "the library has no communicators (comm_unique_id, comm_create, comm_destroy): collectives not run"
    try:
        one_rank_comm(backend)
    except UnsupportedOpError as e:
        return f"no communicator here: {e.message or 'comm_create is UNIMPLEMENTED'}"
    return None


class Materialized:
    """The kwargs of one call on one backend, and the handles to read its outputs back."""

    def __init__(self, backend, case: Case):
        self.backend = backend
        self.case = case
        self.held: dict[str, _Held] = {}
        self.kwargs: dict = {}
        device = getattr(backend, "device", "cpu") != "cpu"
        for name, spec in case.tensors.items():
            if isinstance(spec, list):
                self.kwargs[name] = [None if s is None else self._one(f"{name}[{i}]", s, device)
                                     for i, s in enumerate(spec)]
                continue
            if spec.alias:
                self.held[name] = self.held[spec.alias]
                self.kwargs[name] = self.kwargs[spec.alias]
                continue
            self.kwargs[name] = self._one(name, spec, device)
        self.kwargs.update(case.scalars)
        if case.comm:   # a backend without communicators gets NULL (it must say INVALID_ARGUMENT or lack the op)
            self.kwargs["comm"] = one_rank_comm(backend) if getattr(backend, "supports_comm", False) else None

    def _one(self, name: str, spec: TSpec, device: bool) -> Tensor:
        view, base, lo, hi = _host(spec)
        before = np.array(base.numpy()) if (lo or hi) else None
        if device:
            # padded views never carry a quant descriptor (the cases do not build such views)
            base_d = self.backend.upload(base)
            view = base_d if view is base else Tensor(base_d.buffer, view.shape, view.dtype, view.strides,
                                                      view.offset)
            base = base_d
        self.held[name] = _Held(view, base, lo, hi, before)
        return view

    def read(self, name: str) -> np.ndarray:
        """Logical elements of an output (name or 'name.scales')."""
        if name.endswith(".scales"):
            t = self.held[name[: -len(".scales")]].view.quant.scales
            return np.array(self.backend.to_numpy(t))
        h = self.held[name]
        whole = np.array(self.backend.to_numpy(h.base))
        if h.lo or h.hi:
            part = np.ascontiguousarray(whole[..., h.lo:whole.shape[-1] - h.hi])
            return part.reshape(h.view.shape)   # a row-padded view's base is 2-d (TSpec.row_pad)
        return whole

    def padding_damage(self) -> list[str]:
        """Arguments whose padding columns changed (an op wrote outside its view)."""
        bad = []
        for name, h in self.held.items():
            if h.base_before is None:
                continue
            now = np.array(self.backend.to_numpy(h.base))
            cols = list(range(h.lo)) + list(range(now.shape[-1] - h.hi, now.shape[-1]))
            if now[..., cols].tobytes() != h.base_before[..., cols].tobytes():
                bad.append(name)
        return sorted(set(bad))

    def inputs_changed(self) -> list[str]:
        """Read-only inputs the op modified (compared with the values the case gave)."""
        bad = []
        outs = {n for n, s in self.case.tensors.items() if isinstance(s, TSpec) and (s.out or s.alias)}
        aliased = {s.alias for s in self.case.tensors.values() if isinstance(s, TSpec) and s.alias}
        for name, spec in self.case.tensors.items():
            if not isinstance(spec, TSpec) or name in outs or name in aliased or spec.values is None:
                continue
            if D.get(spec.dtype).packed:
                continue
            now = self.read(name)
            want = np.asarray(spec.values, D.get(spec.dtype).np).reshape(now.shape)
            if np.ascontiguousarray(now).tobytes() != np.ascontiguousarray(want).tobytes():
                bad.append(name)
        return bad
