"""Backends for the conformance cases' tests (test_cases_<family>.py): the reference with one rule of one
op broken ("a mutant", which must fail at least one case of the quick profile) or with one output
element left unwritten, and the small argument transformations the mutants are made of."""
from __future__ import annotations

import numpy as np

from deepinfer.conformance import cases as C
from deepinfer.reference import ReferenceBackend
from deepinfer.tensor import Tensor


def quick(op):
    return C.cases_for(op, "quick")


class Mutant(ReferenceBackend):
    """The reference with one rule of one op broken (a transformation of the call's arguments)."""

    def __init__(self, op, change):
        self.mop, self.change = op, change

    def _run(self, op, kwargs):
        if op == self.mop:
            kwargs = self.change(dict(kwargs))
        super()._run(op, kwargs)


def _drop(*names):
    def f(kw):
        for n in names:
            kw.pop(n, None)
        return kw
    return f


def _set(**values):
    def f(kw):
        kw.update(values)
        return kw
    return f


def _map(name, fn):
    def f(kw):
        if kw.get(name) is not None:
            kw[name] = Tensor.from_numpy(np.ascontiguousarray(fn(np.array(kw[name].numpy()))), kw[name].dtype)
        return kw
    return f


class Lazy(ReferenceBackend):
    """The reference, except that the first element of one output keeps what it held before (poison)."""

    def __init__(self, op, out):
        self.lop, self.out = op, out

    def _run(self, op, kwargs):
        t = kwargs.get(self.out) if op == self.lop else None
        first = (0,) * t.ndim if t is not None else None
        before = np.array(t.numpy()[first]) if t is not None and t.numel else None
        super()._run(op, kwargs)
        if before is not None:
            t.numpy()[first] = before
