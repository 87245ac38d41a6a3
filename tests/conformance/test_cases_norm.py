"""The conformance cases of layernorm (1.3) fail a library that ignores its bias or its eps ("a mutant"
fails at least one case of the quick profile) or leaves an output element unwritten."""
from __future__ import annotations

import pytest

from mutant_backends import assert_mutant_fails, assert_unwritten_element_fails, Mutant, _drop, _set


MUTANTS = {
    "layernorm ignores bias": ("layernorm", _drop("bias")),
    "layernorm with eps 1": ("layernorm", _set(eps=1.0)),
}


@pytest.mark.parametrize("what", sorted(MUTANTS))
def test_a_library_breaking_one_rule_fails(what):
    op, change = MUTANTS[what]
    assert_mutant_fails(what, op, Mutant(op, change))


@pytest.mark.parametrize("op", ["layernorm"])
def test_an_element_left_unwritten_fails(op):
    assert_unwritten_element_fails(op)
