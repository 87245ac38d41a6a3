"""The conformance cases of the hyper family (1.3: hc_pre, hc_post) fail a library that gets V4's
hyper-connections wrong: a reference with one rule broken ("a mutant": a Sinkhorn iteration less,
hc_eps forgotten, comb untransposed) fails at least one case of the quick profile, and so does one
that leaves an output element unwritten."""
from __future__ import annotations

import numpy as np
import pytest

from mutant_backends import assert_mutant_fails, assert_unwritten_element_fails, Mutant, _map, _set


MUTANTS = {
    "hc_pre runs one Sinkhorn iteration less": ("hc_pre", lambda kw: _set(sinkhorn_iters=max(1, kw["sinkhorn_iters"] - 1))(kw)),
    "hc_pre forgets hc_eps": ("hc_pre", _set(hc_eps=0.0)),
    "hc_post applies comb untransposed": ("hc_post", _map("comb", lambda c: np.swapaxes(c, 1, 2))),
}


@pytest.mark.parametrize("what", sorted(MUTANTS))
def test_a_library_breaking_one_rule_fails(what):
    op, change = MUTANTS[what]
    assert_mutant_fails(what, op, Mutant(op, change))


@pytest.mark.parametrize("op", ["hc_pre", "hc_post"])
def test_an_element_left_unwritten_fails(op):
    assert_unwritten_element_fails(op)
