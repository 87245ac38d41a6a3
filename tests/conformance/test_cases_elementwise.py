"""The conformance cases of silu_mul's clipped SwiGLU (1.3): a library that ignores the limit ("a
mutant") fails at least one case of the quick profile, and so does one that leaves an output element
unwritten; a 1.2 library is not held to the limit."""
from __future__ import annotations

import numpy as np
import pytest

from deepinfer.conformance import cases as C
from deepinfer.conformance.harness import ReferenceCache, check_case
from deepinfer.reference import ReferenceBackend
from mutant_backends import Lazy, Mutant, _drop, quick


MUTANTS = {
    "silu_mul ignores limit": ("silu_mul", _drop("limit")),
}


@pytest.mark.parametrize("what", sorted(MUTANTS))
def test_a_library_breaking_one_rule_fails(what):
    op, change = MUTANTS[what]
    ref = ReferenceCache(ReferenceBackend())
    outcomes = [check_case(Mutant(op, change), c, ref) for c in quick(op)]
    assert not [o for o in outcomes if o.status == "error"], [o.message for o in outcomes if o.status == "error"]
    assert any(o.status == "fail" for o in outcomes), f"{what}: every case passed"


@pytest.mark.parametrize("op", ["silu_mul"])
def test_an_element_left_unwritten_fails(op):
    out = C.a_valid_case(op).check[0]
    ref = ReferenceCache(ReferenceBackend())
    # outputs that start poisoned (not accumulate's initial values) and have an element
    cases = [c for c in quick(op) if c.tensors[out].values is None and np.prod(c.tensors[out].shape)]
    outcomes = [check_case(Lazy(op, out), c, ref) for c in cases]
    assert outcomes and all(o.status == "fail" for o in outcomes), [(o.case, o.status) for o in outcomes]


def test_a_1_2_library_is_not_held_to_1_3_fields():
    """A library of an older minor gets "unsupported" for a case that sets a newer field to a non-zero
    value (the runtime never sends it), and runs the cases that leave it at zero."""
    class Old(ReferenceBackend):
        @property
        def abi_minor(self):
            return 2

    ref = ReferenceCache(ReferenceBackend())
    with_limit = C.silu_mul(1, 2, 8, "f32", limit=1.0)
    assert check_case(Old(), with_limit, ref).status == "unsupported"
    zero = C.silu_mul(1, 2, 8, "f32")
    zero.scalars["limit"] = 0.0
    assert check_case(Old(), zero, ref).status == "pass"
