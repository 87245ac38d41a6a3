"""ABI 1.6's fused op mla_rope_cache_write: the header's statement of it, its cases on the CPU library,
libraries that break one of its rules (they fail), and the libraries that lack it: a 1.5 build of the
tiny plugin and the CPU library presented as 1.5 (the op is unsupported there, the runtime's graph
runs the four unfused ops, and a host of 1.5 still uses the 1.6 library)."""
from __future__ import annotations

import numpy as np
import pytest

from deepinfer import abi
from deepinfer.conformance import cases as C
from deepinfer.conformance import run_conformance, summary
from deepinfer.conformance.harness import ReferenceCache, check_case
from deepinfer.loader import load_library, probe
from deepinfer.model.graph import native_fused_ops
from deepinfer.reference import ReferenceBackend
from mutant_backends import Mutant, _drop, _map, _set, assert_mutant_fails
from plugin_build import PROFILE
from test_abi_versions import V1_5_TEXT, _cpu_presented_as, _ffi

OP = "mla_rope_cache_write"


def test_1_6_adds_one_fused_op_after_the_communicators():
    spec = abi.OP_SPECS[OP]
    assert abi.ABI_MINOR >= 6 and spec.since_minor == 6 and not spec.appended
    assert abi.OP_NAMES[-1] == OP and abi.const("DI_OP_COUNT_V1_6") == len(abi.OP_NAMES) == 29
    fields = [n for n, _ in abi.ffi.typeof("DI_Api").fields]
    assert fields[fields.index("comm_destroy") + 1] == OP and fields[-1] == OP
    assert [a.name for a in spec.args if a.written] == ["q", "cache", "kv_out"]
    assert spec.arg("kv_out").optional and not spec.arg("q").optional
    # rope's scalars in rope's order, after eps
    rope = [n for n, _ in abi.OPS["rope"][2] if n not in ("x", "positions", "out")]
    mine = abi.op_fields(OP)
    assert mine[mine.index("eps") + 1:mine.index("eps") + 1 + len(rope)] == rope


def test_the_cpu_library_passes_every_case(cpu_lib):
    be = load_library(cpu_lib)
    ref = ReferenceCache(ReferenceBackend())
    try:
        assert OP in be.ops() and native_fused_ops(be) == {OP}
        outcomes = [check_case(be, c, ref) for c in C.cases_for(OP, "thorough")]
        assert outcomes and all(o.status == "pass" for o in outcomes), \
            [(o.name, o.message) for o in outcomes if o.status != "pass"]
    finally:
        be.close()


def test_the_reference_is_the_composition_of_the_unfused_ops():
    """The oracle's fused call equals rope, rmsnorm, rope and mla_cache_write run one after another,
    bit for bit (what the runtime's graph computes without the fused op)."""
    from deepinfer.conformance.materialize import Materialized

    ref = ReferenceBackend()
    for case in C.cases_for(OP, "quick"):
        if "kv_out" in case.tensors or not case.tensors["q"].shape[0]:
            continue
        fused, loose = Materialized(ref, case), Materialized(ref, case)
        ref.call(OP, **fused.kwargs)
        kw, s = loose.kwargs, case.scalars
        rot = {k: s[k] for k in abi.op_fields("rope") if k in s}
        Dc, (T, H, Dq) = kw["norm_weight"].shape[0], kw["q"].shape
        Dr = kw["kv"].shape[1] - Dc
        q_pe, kpe = kw["q"].narrow(2, Dq - Dr, Dr), kw["kv"].narrow(1, Dc, Dr)
        from deepinfer.tensor import Tensor
        latent = Tensor.empty((T, Dc), kw["cache"].dtype)
        kpe_c = Tensor.empty((T, Dr), kw["cache"].dtype)
        ref.rope(x=q_pe, positions=kw["positions"], out=q_pe, **rot)
        ref.rmsnorm(x=kw["kv"].narrow(1, 0, Dc), weight=kw["norm_weight"], out=latent, eps=s["eps"])
        ref.rope(x=kpe, positions=kw["positions"], out=kpe_c, **rot)
        slots = np.array(kw["slots"].numpy())
        NB, BS = kw["cache"].shape[:2]
        slots[slots >= NB * BS] = -1
        ref.mla_cache_write(latent=latent, k_pe=kpe_c, slots=Tensor.from_numpy(slots), cache=kw["cache"])
        for name in ("q", "cache"):
            assert fused.read(name).tobytes() == loose.read(name).tobytes(), (case.name, name)


class _QLeftAlone(ReferenceBackend):
    """The op without its rotation of q (a kernel that forgot the heads)."""

    def _run(self, op, kwargs):
        q = kwargs.get("q") if op == OP else None
        before = np.array(q.numpy()) if q is not None else None
        super()._run(op, kwargs)
        if before is not None:
            q.numpy()[...] = before


def _wrap_slots(kw):
    """A library that writes an out-of-range slot modulo the cache's size instead of skipping it."""
    n = kw["cache"].shape[0] * kw["cache"].shape[1]
    return _map("slots", lambda s: np.where(s >= n, s % n, s).astype(np.int32))(kw)


MUTANTS = {
    "kv_out never written": _drop("kv_out"),
    "eps ignored (1.0)": _set(eps=1.0),
    "the other pair layout": lambda kw: dict(kw, interleaved=1 - kw["interleaved"]),
    "norm weight ignored": _map("norm_weight", np.ones_like),
    "every token at position 0": _map("positions", np.zeros_like),
    "yarn ignored": lambda kw: dict(kw, scaling=0),
    "out-of-range slots wrapped": _wrap_slots,
}


@pytest.mark.parametrize("what", sorted(MUTANTS))
def test_a_library_breaking_one_rule_fails(what):
    assert_mutant_fails(what, OP, Mutant(OP, MUTANTS[what]))


def test_a_library_that_leaves_q_unrotated_fails():
    assert_mutant_fails("q left alone", OP, _QLeftAlone())


# ---------------------------------------------------------------------------- 1.6 against 1.5


def test_a_1_5_build_of_the_tiny_plugin_loads_and_passes_under_1_6(plugin_factory):
    """The tiny plugin built against the frozen 1.5 header says 1.5, offers no fused op, and passes L0
    and L1 under this runtime; the fused op's cases are "unsupported" on it, never failures."""
    lib = plugin_factory("libdeepinfer_tiny15.so", abi="1.5", TEST_NAME='"tiny15"', TEST_COMM=None)
    c = probe(lib)
    assert c.ok and c.abi_version == "1.5", c.reason
    assert OP not in c.ops
    cert = run_conformance(str(lib), levels=("L0", "L1"), profile=PROFILE, isolate=False, only_ops=["silu_mul", OP])
    assert cert["passed"], summary(cert)
    l1 = cert["levels"]["L1"]["results"]
    assert {r["op"] for r in l1 if r["status"] == "unsupported"} == {OP}
    be = load_library(lib)
    try:
        assert be.abi_minor == 5 and native_fused_ops(be) == frozenset()
    finally:
        be.close()


def test_a_1_5_table_has_no_fused_op_and_the_graph_keeps_the_unfused_ops(cpu_lib):
    """The CPU library's table presented as a 1.5 library's (its table ends at comm_destroy): the fused
    op is not offered, the suite calls its cases unsupported, and the runtime uses none."""
    be = _cpu_presented_as(cpu_lib, 5, _ffi(V1_5_TEXT).sizeof("DI_Api"))
    try:
        assert be.abi_minor == 5 and OP not in be.ops() and native_fused_ops(be) == frozenset()
        o = check_case(be, C.a_valid_case(OP), ReferenceCache(ReferenceBackend()))
        assert o.status == "unsupported", o.message
    finally:
        be.close()


def test_a_1_5_runtime_runs_the_current_library(cpu_lib):
    """A host with the 1.5 header reads the 1.6 table's prefix: its entries keep their offsets and the
    library says 1.6 or later with a larger table."""
    f = _ffi(V1_5_TEXT)
    lib = f.dlopen(str(cpu_lib))
    info = lib.deepinfer_plugin_info()
    assert (info.abi_major, info.abi_minor) == (1, abi.ABI_MINOR)
    api = info.get_api(1)
    assert api.struct_size == abi.ffi.sizeof("DI_Api") == f.sizeof("DI_Api") + abi.ffi.sizeof("void*")
    for name, _ in f.typeof("DI_Api").fields:
        assert f.offsetof("DI_Api", name) == abi.ffi.offsetof("DI_Api", name), name
