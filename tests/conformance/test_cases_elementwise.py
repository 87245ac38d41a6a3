"""The conformance cases of silu_mul's clipped SwiGLU (1.3): a library that ignores the limit ("a
mutant") fails at least one case of the quick profile, and so does one that leaves an output element
unwritten; a 1.2 library is not held to the limit."""
from __future__ import annotations

import pytest

from deepinfer.conformance import cases as C
from deepinfer.conformance.harness import ReferenceCache, check_case
from deepinfer.reference import ReferenceBackend
from mutant_backends import assert_mutant_fails, assert_unwritten_element_fails, Mutant, _drop


MUTANTS = {
    "silu_mul ignores limit": ("silu_mul", _drop("limit")),
}


@pytest.mark.parametrize("what", sorted(MUTANTS))
def test_a_library_breaking_one_rule_fails(what):
    op, change = MUTANTS[what]
    assert_mutant_fails(what, op, Mutant(op, change))


@pytest.mark.parametrize("op", ["silu_mul"])
def test_an_element_left_unwritten_fails(op):
    assert_unwritten_element_fails(op)


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
