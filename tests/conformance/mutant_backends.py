"""Backends for the conformance cases' tests (test_cases_<family>.py): the reference with one rule of one
op broken ("a mutant", which must fail at least one case of the quick profile) or with one output
element left unwritten, and the small argument transformations the mutants are made of."""
from __future__ import annotations

import numpy as np

from deepinfer.conformance import cases as C
from deepinfer.conformance.harness import ReferenceCache, check_case
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


def assert_mutant_fails(what, op, backend) -> None:
    """`backend` (a mutant of op) errs on no case of op's quick profile and fails at least one."""
    ref = ReferenceCache(ReferenceBackend())
    outcomes = [check_case(backend, c, ref) for c in quick(op)]
    assert not [o for o in outcomes if o.status == "error"], [o.message for o in outcomes if o.status == "error"]
    assert any(o.status == "fail" for o in outcomes), f"{what}: every case passed"


def assert_unwritten_element_fails(op, lazy=Lazy) -> None:
    """A library that leaves the first element of op's checked output unwritten fails every quick case
    whose output starts poisoned (not accumulate's initial values) and has an element."""
    out = C.a_valid_case(op).check[0]
    ref = ReferenceCache(ReferenceBackend())
    cases = [c for c in quick(op) if c.tensors[out].values is None and np.prod(c.tensors[out].shape)]
    outcomes = [check_case(lazy(op, out), c, ref) for c in cases]
    assert outcomes and all(o.status == "fail" for o in outcomes), [(o.case, o.status) for o in outcomes]
