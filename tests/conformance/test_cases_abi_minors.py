"""What spans the op families of the conformance cases: every op an ABI minor added has cases, a
valid case and a tolerance; the 1.3 fields appended to older ops are set by their cases; each op's
full case sets every field appended to it (DI_ARGS_SINCE)."""
from __future__ import annotations

import numpy as np

from deepinfer import abi
from deepinfer.conformance import cases as C
from deepinfer.conformance import tolerances as TOL
from mutant_backends import quick

NEW_OPS = ["hc_pre", "hc_post", "kv_compress", "indexer_topk", "sparse_attention", "layernorm"]


def test_every_1_3_op_has_cases_a_valid_case_and_a_tolerance():
    assert abi.API_V1_3_FIELDS == NEW_OPS
    for op in NEW_OPS:
        assert quick(op), op
        assert op in TOL.TOLERANCES_V3 and op not in TOL.TOLERANCES_V2
        C.a_valid_case(op)


def test_extended_op_cases_set_the_1_3_fields():
    dec = [c for c in quick("mla_decode") if "indices" in c.tensors]
    assert dec and any(np.any(np.asarray(c.tensors["indices"].values) == -1) and
                       np.any(np.asarray(c.tensors["indices"].values) >= 10**6) for c in dec)
    routers = {c.fmt: c for c in quick("moe_router")}
    assert {"v4", "v4-hash", "v4-large-logits", "hash-softmax"} <= set(routers)
    assert np.asarray(routers["v4-large-logits"].tensors["logits"].values).max() > 20   # softplus's threshold
    assert any(c.scalars.get("swiglu_limit") for c in quick("moe_experts"))
    assert any(c.scalars.get("limit") for c in quick("silu_mul"))
    assert any(c.tensors["x"].dtype == "bf16" and c.scalars.get("swiglu_limit") for c in quick("moe_experts"))


def test_full_cases_set_every_appended_field():
    for op in abi.OP_NAMES:
        case = C.a_full_case(op)
        given = {**case.tensors, **case.scalars}
        for field, _minor in abi.OP_SPECS[op].appended:
            assert abi.field_is_set(given.get(field)), (op, field)
