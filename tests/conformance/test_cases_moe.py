"""The conformance cases of the moe family (moe_router, moe_experts).

1.5: moe_experts with an expert cache's table (expert_map) and its
misses. They cover what the spec names (a permuting map over more model experts than descriptors,
entries -1, E and far past it, a descriptor the map names that is not resident, ids outside [0, M)
that are skipped but not flagged, a map under which every pair is resident, f32 and bf16 x, quantized
weights, accumulate, the SwiGLU limit, no tokens), misses are compared exactly, and they fail a library
that gets any of it wrong (a reference with one rule broken, "a mutant", fails at least one case of the
quick profile), while a library that reaches the same descriptors another way (rewriting topk_ids
itself) passes bit for bit. A library older than 1.5 is not held to them.

1.3: hash routing and sqrtsoftplus scores (moe_router) and the SwiGLU limit (moe_experts): a mutant that
ignores one fails, hash routing's ids are compared exactly, and an output element left unwritten fails."""
from __future__ import annotations

import numpy as np
import pytest

from deepinfer import abi
from deepinfer.conformance import cases as C
from deepinfer.conformance import tolerances as TOL
from deepinfer.conformance.harness import Materialized, ReferenceCache, _cmp_router, check_case
from deepinfer.reference import ReferenceBackend
from deepinfer.tensor import Tensor
import mutant_backends as MB

NEW_FIELDS = [("expert_map", 5), ("misses", 5)]


def quick(op="moe_experts"):
    return C.cases_for(op, "quick")


def mapped(cases):
    return [c for c in cases if "expert_map" in c.tensors]


def vals(c, name):
    return np.asarray(c.tensors[name].values).astype(np.int64)


def _resident(w) -> bool:
    return w is not None


def _pair_kinds(c) -> np.ndarray:
    """[T, K] what each pair of a mapped case is, from the case's data alone: "outside" (id outside
    [0, M)), "entry<0", "entry>=E", "absent" (a descriptor that is not resident) or "resident"."""
    ids, table = vals(c, "topk_ids"), vals(c, "expert_map")
    E, M = int(c.scalars["num_experts"]), len(table)
    here = [_resident(w) for w in c.tensors["w_gate"]]
    kinds = np.empty(ids.shape, object)
    for (t, k), i in np.ndenumerate(ids):
        if not 0 <= i < M:
            kinds[t, k] = "outside"
        elif table[i] < 0:
            kinds[t, k] = "entry<0"
        elif table[i] >= E:
            kinds[t, k] = "entry>=E"
        else:
            kinds[t, k] = "resident" if here[table[i]] else "absent"
    return kinds


# ---------------------------------------------------------------------------- coverage


def test_1_5_appends_two_moe_experts_fields_and_nothing_else():
    assert abi.ABI_MINOR >= 5
    assert not [op for op in abi.OP_NAMES if abi.OP_SPECS[op].since_minor == 5]
    assert not [f for f, m in abi.API_ENTRY_SINCE.items() if m == 5]
    assert abi.const("DI_OP_COUNT_V1_5") == abi.const("DI_OP_COUNT_V1_4")
    assert [(op, f, m) for op in abi.OP_NAMES for f, m in abi.OP_SPECS[op].appended if m == 5] == \
        [("moe_experts", f, m) for f, m in NEW_FIELDS]
    spec = abi.OP_SPECS["moe_experts"]
    assert not spec.arg("expert_map").written and spec.arg("misses").written
    # a 1.4 caller's struct ends where expert_map begins
    assert abi.args_struct_size("moe_experts", 4) == abi.ffi.offsetof("DI_MoEExpertsArgs", "expert_map")
    assert TOL.lookup("moe_experts", "exact").exact and TOL.TOLERANCES_V5["moe_experts"]["exact"].exact


def test_the_mapped_cases_cover_what_the_spec_names():
    seen = set()
    for c in mapped(quick()):
        t = c.tensors
        E, M = int(c.scalars["num_experts"]), len(vals(c, "expert_map"))
        assert "misses" in t and t["misses"].out and t["misses"].dtype == "int32"
        assert t["misses"].shape == t["topk_ids"].shape and t["expert_map"].dtype == "int32"
        assert c.check == ["out", "misses"] and c.tol_keys == {"misses": "exact"} and c.expect == "OK"
        seen.add(t["x"].dtype)
        seen.add("M>E" if M > E else "M=E")
        table, ids = vals(c, "expert_map"), vals(c, "topk_ids")
        if np.any(table == E):
            seen.add("an entry E")
        if np.any(table >= 1 << 30):
            seen.add("an entry far past E")
        if np.any(table < -1):
            seen.add("an entry below -1")
        named = table[(table >= 0) & (table < E)]
        if E > 1 and len(named) == E and not np.array_equal(table[:E], np.arange(E)):
            seen.add("every descriptor named, not in order")
        kinds = set(_pair_kinds(c).ravel().tolist())
        seen |= {f"pair {k}" for k in kinds}
        if ids.size and kinds == {"resident"}:
            seen.add("every pair resident")
        if np.any(ids == -1) and np.any(ids == M):
            seen.add("ids -1 and M")
        if c.scalars.get("accumulate"):
            seen.add("accumulate")
        if c.scalars.get("swiglu_limit"):
            seen.add("swiglu_limit")
        if "/" in c.fmt:
            seen.add("quantized weights")
        if ids.shape[0] == 0:
            seen.add("no tokens")
        if ids.shape[0] >= 150:
            seen.add("prefill-sized")
    for want in ["f32", "bf16", "M>E", "M=E", "an entry E", "an entry far past E", "an entry below -1",
                 "every descriptor named, not in order", "pair outside", "pair entry<0", "pair entry>=E",
                 "pair absent", "pair resident", "every pair resident", "ids -1 and M", "accumulate",
                 "swiglu_limit", "quantized weights", "no tokens", "prefill-sized"]:
        assert want in seen, want


def test_the_reference_flags_exactly_the_pairs_the_spec_names():
    """misses = 1 for entries < 0, >= E and non-resident descriptors, 0 for resident pairs and for ids
    outside [0, M): the reference against the case data, on every mapped case of the thorough profile."""
    ref = ReferenceCache(ReferenceBackend())
    cases = mapped(C.cases_for("moe_experts", "thorough"))
    assert len(cases) > len(mapped(quick()))
    for c in cases:
        want = np.isin(_pair_kinds(c), ["entry<0", "entry>=E", "absent"]).astype(np.int32)
        np.testing.assert_array_equal(ref.results(c)["misses"], want, err_msg=c.name)


def test_the_full_case_sets_the_map_and_is_valid_without_it():
    """L0 sends a_full_case with a 1.4 caller's struct_size and compares with the same call without the
    1.5 fields: that call must succeed (no id names a missing descriptor) and differ from the mapped one."""
    case = C.a_full_case("moe_experts")
    assert abi.field_is_set(case.tensors.get("expert_map")) and case.tensors["misses"].out
    ref = ReferenceBackend()
    m = Materialized(ref, case)
    ref.call("moe_experts", **m.kwargs)
    assert not np.any(m.read("misses"))
    plain = C.without_fields(case, ["expert_map", "misses"])
    m2 = Materialized(ref, plain)
    ref.call("moe_experts", **m2.kwargs)
    assert not np.array_equal(m.read("out"), m2.read("out")), "the full case's map must change the result"


# ---------------------------------------------------------------------------- mutants fail


class Mutant(ReferenceBackend):
    """The reference with one rule of moe_experts broken: the call's arguments changed before it runs
    (`before`) or its outputs after (`after`, given the arguments)."""

    def __init__(self, before=None, after=None):
        self.before, self.after = before, after

    def _run(self, op, kwargs):
        if op == "moe_experts" and self.before:
            kwargs = self.before(dict(kwargs))
        keep = None
        if op == "moe_experts" and self.after == "keep misses" and kwargs.get("misses") is not None:
            keep = np.array(kwargs["misses"].numpy())
        super()._run(op, kwargs)
        if keep is not None:
            kwargs["misses"].numpy()[...] = keep
        elif op == "moe_experts" and callable(self.after) and kwargs.get("misses") is not None:
            self.after(kwargs)


def _np(kw, name):
    return np.asarray(kw[name].numpy()).astype(np.int64)


def _with_map(fn):
    def f(kw):
        if kw.get("expert_map") is not None:
            kw["expert_map"] = Tensor.from_numpy(np.ascontiguousarray(fn(_np(kw, "expert_map"), kw)).astype(np.int32))
        return kw
    return f


def _descriptor_ids(kw) -> np.ndarray:
    """topk_ids rewritten to the descriptor each pair uses, -1 for pairs the map skips."""
    ids, table = _np(kw, "topk_ids"), _np(kw, "expert_map")
    E, M = len(kw["w_gate"]), len(table)
    d = np.where((ids >= 0) & (ids < M), table[np.clip(ids, 0, max(M - 1, 0))] if M else -1, -1)
    here = np.array([w is not None and getattr(w, "buffer", None) is not None for w in kw["w_gate"]], bool)
    ok = (d >= 0) & (d < E)
    ok[ok] = here[d[ok]]
    return np.where(ok, d, -1)


def _no_map_fail_missing(kw):
    """the map applied, but a descriptor that is not resident refused (FAILED_PRECONDITION) as without a
    map, instead of skipping and flagging the pair."""
    if kw.get("expert_map") is None:
        return kw
    ids, table = _np(kw, "topk_ids"), _np(kw, "expert_map")
    M, E = len(table), len(kw["w_gate"])
    d = np.where((ids >= 0) & (ids < M), table[np.clip(ids, 0, max(M - 1, 0))] if M else -1, -1)
    d[(d < 0) | (d >= E)] = -1
    kw["topk_ids"] = Tensor.from_numpy(d.astype(np.int32))
    kw.pop("expert_map"), kw.pop("misses")
    return kw


def _set_misses(where):
    def f(kw):
        ids, table = _np(kw, "topk_ids"), _np(kw, "expert_map")
        E, M = len(kw["w_gate"]), len(table)
        inside = (ids >= 0) & (ids < M)
        entry = np.where(inside, table[np.clip(ids, 0, max(M - 1, 0))] if M else -1, -1)
        mask, value = where(ids, entry, inside, E, M)
        kw["misses"].numpy()[mask] = value
    return f


MUTANTS = {
    # the map's contents ignored: topk_ids taken as descriptor ids (a library that reads nothing past 1.4)
    "moe_experts ignores expert_map": (_with_map(lambda m, kw: np.arange(len(m))), None),
    "moe_experts never writes misses": (None, "keep misses"),
    "moe_experts flags nothing": (None, _set_misses(lambda ids, e, inside, E, M: (np.ones(ids.shape, bool), 0))),
    "moe_experts flags ids outside [0, M)": (None, _set_misses(lambda ids, e, inside, E, M: (~inside, 1))),
    "moe_experts does not flag entries past the descriptors":
        (None, _set_misses(lambda ids, e, inside, E, M: (inside & (e >= E), 0))),
    "moe_experts does not flag entries below 0":
        (None, _set_misses(lambda ids, e, inside, E, M: (inside & (e < 0), 0))),
    "moe_experts does not flag descriptors that are not resident":
        (None, _set_misses(lambda ids, e, inside, E, M: (inside & (e >= 0) & (e < E), 0))),
    # entries past the descriptors wrapped onto one (a library that reads the map without bounds)
    "moe_experts wraps map entries past the descriptors":
        (_with_map(lambda m, kw: np.where(m >= len(kw["w_gate"]), m % max(len(kw["w_gate"]), 1), m)), None),
    "moe_experts refuses a descriptor the map names that is not resident": (_no_map_fail_missing, None),
    # the map read by position k instead of by expert id
    "moe_experts looks up the map by slot instead of by id":
        (lambda kw: dict(kw, topk_ids=Tensor.from_numpy(np.ascontiguousarray(np.where(
            _np(kw, "topk_ids") >= 0, np.arange(_np(kw, "topk_ids").shape[1])[None, :],
            _np(kw, "topk_ids")).astype(np.int32)))) if kw.get("expert_map") is not None else kw, None),
}


@pytest.mark.parametrize("what", sorted(MUTANTS))
def test_a_library_breaking_one_rule_fails(what):
    before, after = MUTANTS[what]
    ref = ReferenceCache(ReferenceBackend())
    outcomes = [check_case(Mutant(before, after), c, ref) for c in quick()]
    assert not [o for o in outcomes if o.status == "error"], [o.message for o in outcomes if o.status == "error"]
    failed = [o for o in outcomes if o.status == "fail"]
    assert failed, f"{what}: every case passed"
    # only the 1.5 cases see it: every case without a map still passes
    names = {c.name for c in mapped(quick())}
    assert all(o.case in names for o in failed), [o.case for o in failed if o.case not in names]


class Lazy(ReferenceBackend):
    """The reference, except that the first element of misses keeps what it held before (poison)."""

    def _run(self, op, kwargs):
        t = kwargs.get("misses")
        before = np.array(t.numpy()[0, 0]) if t is not None and t.numel else None
        super()._run(op, kwargs)
        if before is not None:
            t.numpy()[0, 0] = before


def test_a_misses_element_left_unwritten_fails():
    ref = ReferenceCache(ReferenceBackend())
    cases = [c for c in mapped(quick()) if np.prod(c.tensors["misses"].shape)]
    outcomes = [check_case(Lazy(), c, ref) for c in cases]
    assert outcomes and all(o.status == "fail" and "misses" in o.message for o in outcomes), \
        [(o.case, o.status) for o in outcomes]


# ---------------------------------------------------------------------------- what the spec allows passes


class Rewriting(ReferenceBackend):
    """A library that applies the map itself: topk_ids rewritten to descriptor ids (-1 for the pairs it
    skips), the 1.4 op on them, misses computed on the side. The numbering-invariance promise makes its
    out bit-identical to the reference's with the map."""

    def _run(self, op, kwargs):
        if op != "moe_experts" or kwargs.get("expert_map") is None:
            return super()._run(op, kwargs)
        ids = _np(kwargs, "topk_ids")
        M = len(_np(kwargs, "expert_map"))
        d = _descriptor_ids(kwargs)
        misses = (((ids >= 0) & (ids < M)) & (d < 0)).astype(np.int32)
        kw = {k: v for k, v in kwargs.items() if k not in ("expert_map", "misses")}
        kw["topk_ids"] = Tensor.from_numpy(np.ascontiguousarray(d.astype(np.int32)))
        super()._run(op, kw)
        kwargs["misses"].numpy()[...] = misses


def test_rewriting_topk_ids_instead_of_a_map_gives_the_same_bits():
    ref = ReferenceCache(ReferenceBackend())
    for c in mapped(C.cases_for("moe_experts", "default")):
        o = check_case(Rewriting(), c, ref)
        assert o.status == "pass", (c.name, o.message)
        m = Materialized(Rewriting(), c)
        Rewriting().call("moe_experts", **m.kwargs)
        want = ref.results(c)
        for name in ("out", "misses"):
            assert m.read(name).tobytes() == want[name].tobytes(), (c.name, name)


def test_a_1_4_library_is_not_held_to_1_5_fields():
    """A library of an older minor gets "unsupported" for every case that sets expert_map (the runtime
    never sends it) and runs every other moe_experts case."""
    class Old(ReferenceBackend):
        @property
        def abi_minor(self):
            return 4

    ref = ReferenceCache(ReferenceBackend())
    outcomes = {c.name: (c, check_case(Old(), c, ref)) for c in quick()}
    for name, (c, o) in outcomes.items():
        if "expert_map" in c.tensors:
            assert o.status == "unsupported" and "expert_map, misses: newer than the library's ABI 1.4" in o.message, \
                (name, o.status, o.message)
        else:
            assert o.status == "pass", (name, o.message)


# ---------------------------------------------------------------------------- 1.3: routing and the SwiGLU limit


MUTANTS_1_3 = {
    "moe_router ignores hash routing": ("moe_router", MB._drop("token_ids", "hash_table")),
    "moe_router scores sqrtsoftplus as sigmoid": ("moe_router", lambda kw: MB._set(scoring=1)(kw) if kw["scoring"] == 2 else kw),
    "moe_experts ignores swiglu_limit": ("moe_experts", MB._drop("swiglu_limit")),
}


@pytest.mark.parametrize("what", sorted(MUTANTS_1_3))
def test_a_library_breaking_one_1_3_rule_fails(what):
    op, change = MUTANTS_1_3[what]
    MB.assert_mutant_fails(what, op, MB.Mutant(op, change))


@pytest.mark.parametrize("op", ["moe_router", "moe_experts"])
def test_an_element_left_unwritten_fails(op):
    MB.assert_unwritten_element_fails(op)


def test_hash_routing_ids_must_be_exact():
    case = C.moe_router(3, 4, "v4-hash")
    ref = ReferenceBackend()
    from deepinfer.conformance.harness import Materialized
    m = Materialized(ref, case)
    ref.call("moe_router", **m.kwargs)
    want = {n: m.read(n) for n in case.check}
    got = {n: v.copy() for n, v in want.items()}
    assert _cmp_router(case, got, want)[0] is None
    got["topk_ids"][1] = got["topk_ids"][1][::-1]          # the same experts, not in table order
    assert "table order" in _cmp_router(case, got, want)[0]
