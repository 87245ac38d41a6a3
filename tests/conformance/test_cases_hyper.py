"""The conformance cases of the hyper family (1.3: hc_pre, hc_post) fail a library that gets V4's
hyper-connections wrong: a reference with one rule broken ("a mutant": a Sinkhorn iteration less,
hc_eps forgotten, comb untransposed) fails at least one case of the quick profile, and so does one
that leaves an output element unwritten."""
from __future__ import annotations

import numpy as np
import pytest

from deepinfer.conformance import cases as C
from deepinfer.conformance.harness import ReferenceCache, check_case
from deepinfer.reference import ReferenceBackend
from mutant_backends import Lazy, Mutant, _map, _set, quick


MUTANTS = {
    "hc_pre runs one Sinkhorn iteration less": ("hc_pre", lambda kw: _set(sinkhorn_iters=max(1, kw["sinkhorn_iters"] - 1))(kw)),
    "hc_pre forgets hc_eps": ("hc_pre", _set(hc_eps=0.0)),
    "hc_post applies comb untransposed": ("hc_post", _map("comb", lambda c: np.swapaxes(c, 1, 2))),
}


@pytest.mark.parametrize("what", sorted(MUTANTS))
def test_a_library_breaking_one_rule_fails(what):
    op, change = MUTANTS[what]
    ref = ReferenceCache(ReferenceBackend())
    outcomes = [check_case(Mutant(op, change), c, ref) for c in quick(op)]
    assert not [o for o in outcomes if o.status == "error"], [o.message for o in outcomes if o.status == "error"]
    assert any(o.status == "fail" for o in outcomes), f"{what}: every case passed"


@pytest.mark.parametrize("op", ["hc_pre", "hc_post"])
def test_an_element_left_unwritten_fails(op):
    out = C.a_valid_case(op).check[0]
    ref = ReferenceCache(ReferenceBackend())
    # outputs that start poisoned (not accumulate's initial values) and have an element
    cases = [c for c in quick(op) if c.tensors[out].values is None and np.prod(c.tensors[out].shape)]
    outcomes = [check_case(Lazy(op, out), c, ref) for c in cases]
    assert outcomes and all(o.status == "fail" for o in outcomes), [(o.case, o.status) for o in outcomes]
