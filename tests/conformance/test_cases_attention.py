"""The conformance cases of mla_decode's sparse form (1.3, V3.2's indices) fail a library that ignores
the indices ("a mutant" fails at least one case of the quick profile) or leaves an output element
unwritten."""
from __future__ import annotations

import pytest

from mutant_backends import assert_mutant_fails, assert_unwritten_element_fails, Mutant, _drop


MUTANTS = {
    "mla_decode ignores indices": ("mla_decode", _drop("indices")),
}


@pytest.mark.parametrize("what", sorted(MUTANTS))
def test_a_library_breaking_one_rule_fails(what):
    op, change = MUTANTS[what]
    assert_mutant_fails(what, op, Mutant(op, change))


@pytest.mark.parametrize("op", ["mla_decode"])
def test_an_element_left_unwritten_fails(op):
    assert_unwritten_element_fails(op)
