"""The conformance cases of layernorm (1.3) fail a library that ignores its bias or its eps ("a mutant"
fails at least one case of the quick profile) or leaves an output element unwritten."""
from __future__ import annotations

import numpy as np
import pytest

from deepinfer.conformance import cases as C
from deepinfer.conformance.harness import ReferenceCache, check_case
from deepinfer.reference import ReferenceBackend
from mutant_backends import Lazy, Mutant, _drop, _set, quick


MUTANTS = {
    "layernorm ignores bias": ("layernorm", _drop("bias")),
    "layernorm with eps 1": ("layernorm", _set(eps=1.0)),
}


@pytest.mark.parametrize("what", sorted(MUTANTS))
def test_a_library_breaking_one_rule_fails(what):
    op, change = MUTANTS[what]
    ref = ReferenceCache(ReferenceBackend())
    outcomes = [check_case(Mutant(op, change), c, ref) for c in quick(op)]
    assert not [o for o in outcomes if o.status == "error"], [o.message for o in outcomes if o.status == "error"]
    assert any(o.status == "fail" for o in outcomes), f"{what}: every case passed"


@pytest.mark.parametrize("op", ["layernorm"])
def test_an_element_left_unwritten_fails(op):
    out = C.a_valid_case(op).check[0]
    ref = ReferenceCache(ReferenceBackend())
    # outputs that start poisoned (not accumulate's initial values) and have an element
    cases = [c for c in quick(op) if c.tensors[out].values is None and np.prod(c.tensors[out].shape)]
    outcomes = [check_case(Lazy(op, out), c, ref) for c in cases]
    assert outcomes and all(o.status == "fail" for o in outcomes), [(o.case, o.status) for o in outcomes]
