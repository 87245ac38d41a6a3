"""The suite itself must have teeth: results that are wrong, unwritten, written out of bounds, or
computed on modified inputs fail; ties in sampling and routing do not. The reference checked
against itself is the smoke test of the machinery (trivially true, but every case must run)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from deepinfer import abi
from deepinfer.backend import Backend
from deepinfer.conformance import (TOLERANCES_V1, TOLERANCES_V2, TOLERANCES_V3, TOLERANCES_V4, TOLERANCES_V5,
                                   TOLERANCES_V6, TOLERANCES_V7, main, run_conformance, summary)
from deepinfer.conformance import cases as C
from deepinfer.conformance import tolerances as TOL
from deepinfer.conformance.harness import ReferenceCache, _cmp_sample, check_case, compare_close
from deepinfer.errors import UnsupportedOpError
from deepinfer.reference import ReferenceBackend

ROOT = Path(__file__).resolve().parents[2]


class Mutant(Backend):
    """The reference with one deliberate defect."""

    def __init__(self, defect: str):
        self.ref = ReferenceBackend()
        self.info = self.ref.info
        self.defect = defect

    def ops(self):
        return self.ref.ops()

    def _run(self, op, kw):
        if self.defect == "unimplemented":
            raise UnsupportedOpError(op, abi.UNIMPLEMENTED, "UNIMPLEMENTED", f"{op}: no such format here")
        if self.defect == "silent-unimplemented":
            raise UnsupportedOpError(op, abi.UNIMPLEMENTED, "UNIMPLEMENTED", "")
        if self.defect == "input":
            kw["a"].numpy()[...] = 0
        if self.defect != "skip":
            self.ref._run(op, kw)
        out = kw["out"]
        if self.defect == "noise":
            out.numpy()[...] *= np.float32(1.03)
        if self.defect == "one-ulp":
            v = out.numpy()
            v[...] = np.nextafter(v, np.float32(np.inf))
        if self.defect == "pad":
            out.buffer[..., 0] = 0  # the column just left of the view


@pytest.fixture(scope="module")
def ref_cache():
    return ReferenceCache(ReferenceBackend())


@pytest.mark.parametrize("defect, case, message", [
    ("skip", C.binary("add", 3, (3, 7), "f32"), "non-finite"),
    ("skip", C.concat(3, 2, 3, 4, "f32"), "differ"),
    ("noise", C.binary("mul", 3, (3, 7), "f32"), "outside rtol"),
    ("noise", C.linear(3, 2, 40, 5, "bf16", "bf16"), "outside rtol"),
    ("one-ulp", C.concat(3, 2, 3, 4, "f32"), "bit-exact"),
    ("pad", C.binary("add", 3, (3, 7), "f32", view=True), "wrote outside the view of out"),
    ("input", C.binary("add", 3, (3, 7), "f32"), "modified read-only input(s) a"),
    ("silent-unimplemented", C.binary("add", 3, (3, 7), "f32"), "without a last_error message"),
])
def test_defects_fail(defect, case, message, ref_cache):
    o = check_case(Mutant(defect), case, ref_cache)
    assert o.status == "fail", o
    assert message in o.message, o.message


def test_one_ulp_passes_a_float_tolerance(ref_cache):
    o = check_case(Mutant("one-ulp"), C.linear(3, 2, 40, 5, "f32", "f32"), ref_cache)
    assert o.status == "pass", o.message


def test_unimplemented_format_is_unsupported_not_failed(ref_cache):
    o = check_case(Mutant("unimplemented"), C.linear(3, 2, 40, 5, "f32", "int4/g32/sym/f32"), ref_cache)
    assert o.status == "unsupported" and "no such format" in o.message


def test_compare_nan_never_passes():
    want = np.ones(5, np.float32)
    got = want.copy()
    got[2] = np.nan
    msg, _, _ = compare_close(got, want, TOL.Tol(1.0, 1.0, 1.0), "out")
    assert msg and "non-finite" in msg


def test_exact_distinguishes_signed_zero():
    msg, _, _ = compare_close(np.array([-0.0], np.float32), np.array([0.0], np.float32), TOL.EXACT, "out")
    assert msg and "bit-exact" in msg


def test_sampling_mismatch_fails_unless_tied():
    case = C.sample(11, 6, 50, "mixed")
    temps = case.tensors["temperature"].values
    b = int(np.nonzero(temps > 0)[0][0]) if np.any(temps > 0) else None
    assert b is not None
    want = np.zeros(6, np.int32)
    got = want.copy()
    # greedy rows: any difference fails
    g = int(np.nonzero(temps <= 0)[0][0])
    got[g] = 1
    assert "greedy" in _cmp_sample(case, got, want)
    # a sampled row: two tokens of (exactly) equal logits are a tie, so either is accepted
    logits = case.tensors["logits"].values
    logits[b, 7] = logits[b, 3]
    got, want = np.zeros(6, np.int32), np.zeros(6, np.int32)
    got[b], want[b] = 7, 3
    assert _cmp_sample(case, got, want) is None
    logits[b, 7] = logits[b, 3] - 2.0
    assert "not a tie" in _cmp_sample(case, got, want)


def test_tolerance_table_covers_every_op_and_is_versioned():
    assert TOL.TOLERANCES_VERSION == "v7" and TOL.CURRENT is TOLERANCES_V7
    assert set(TOLERANCES_V6) == set(abi.OP_NAMES) == set(TOLERANCES_V7)
    assert set(TOLERANCES_V5) == {op for op in abi.OP_NAMES if abi.OP_SPECS[op].since_minor <= 5}
    assert set(TOLERANCES_V2) == {op for op in abi.OP_NAMES if abi.OP_SPECS[op].since_minor <= 2}
    assert set(TOLERANCES_V3) == {op for op in abi.OP_NAMES if abi.OP_SPECS[op].since_minor <= 3}
    assert set(TOLERANCES_V4) == set(TOLERANCES_V5)      # 1.5 added no op
    # v2 only added what ABI 1.2 added, v3 what 1.3 added, v4 what 1.4 added, v5 what 1.5 added (moe_experts'
    # integer misses, exact), v6 what 1.6 added (the fused mla_rope_cache_write): every earlier bound is unchanged
    for old, new in ((TOLERANCES_V1, TOLERANCES_V2), (TOLERANCES_V2, TOLERANCES_V3), (TOLERANCES_V3, TOLERANCES_V4),
                     (TOLERANCES_V4, TOLERANCES_V5), (TOLERANCES_V5, TOLERANCES_V6)):
        assert set(old) <= set(new)
        for op, per in old.items():
            for key, t in per.items():
                assert new[op][key] == t, (op, key)
    # v7 changed one bound only: linear's quantized bf16 output allows a bf16 rounding in the middle
    changed = {(op, k) for op, per in TOLERANCES_V6.items() for k, t in per.items() if TOLERANCES_V7[op][k] != t}
    assert changed == {("linear", "q/bf16")}
    assert TOLERANCES_V7["linear"]["q/bf16"] == TOLERANCES_V7["moe_experts"]["q/bf16"]
    assert TOLERANCES_V7["linear"]["q/f32"] == TOLERANCES_V6["linear"]["q/f32"]
    assert "exact" not in TOLERANCES_V4["moe_experts"] and TOLERANCES_V5["moe_experts"]["exact"].exact
    for op, per in TOLERANCES_V5.items():
        for key, t in per.items():
            assert t.rtol >= 0 and t.atol_rel >= 0 and t.nmse >= 0, (op, key)
    assert TOLERANCES_V1["linear"]["f32"].rtol <= 1e-5
    assert TOLERANCES_V1["linear"]["bf16"].rtol <= 1e-2
    assert TOLERANCES_V1["dequantize"]["exact"].exact


def test_every_case_runs_on_the_reference(tmp_path):
    """Self-check of the machinery: 'reference' certifies against itself, every case executes."""
    cert = run_conformance("reference", levels=("L0", "L1", "L2", "L3"), out=str(tmp_path / "r.json"),
                           profile="default", isolate=False)
    assert cert["passed"], summary(cert)
    assert cert["ops_passed"]["L1"] == abi.OP_NAMES
    assert cert["levels"]["L0"]["counts"] == {"skipped": 1}
    assert cert["levels"]["L1"]["counts"] == {"pass": sum(cert["levels"]["L1"]["counts"].values())}
    assert json.loads((tmp_path / "r.json").read_text())["library"]["name"] == "reference"


def test_cases_cover_the_edge_shapes():
    names = [c.name for op in abi.OP_NAMES for c in C.cases_for(op, "quick")]
    assert any("T=0" in n or "M=0" in n or "shape=[0" in n or "B=0" in n or "seqlens=[0]" in n for n in names)
    assert any("view" in n for n in names)
    assert any("routing=one" in n for n in names) and any("routing=skip" in n for n in names)
    # every quantized weight format meets a K that is not a multiple of its group (the tails), and
    # the tensor-core shapes: K a multiple of 128 at the decode widths, a batch, split K and a GEMM
    linear = C.cases_for("linear", "default")
    tails, aligned = set(), {}
    for c in linear:
        w = c.tensors["w"]
        if w.quant is not None and w.quant.block[1]:
            if w.shape[1] % w.quant.block[1] != 0 or w.shape[1] < w.quant.block[1]:
                tails.add(c.fmt.split(" w=")[1])
        if c.tensors["x"].dtype == "bf16" and w.shape[1] % 128 == 0:
            aligned.setdefault(c.fmt.split(" w=")[1], set()).add(c.tensors["x"].shape[0])
    grouped = {name for name, f in C.WEIGHT_FORMATS.items() if f.block and f.block[1]}
    assert tails >= grouped, grouped - tails
    for wf in ("bf16", "e4m3/128x128/f32", "int8/channel/f32", "int4/g128/sym/f16", "int4/g32/sym/f32",
               "uint4/g32/asym/f32"):
        assert {1, 8, 13, 40, 2} <= aligned.get(wf, set()), (wf, aligned.get(wf))
    assert 300 in aligned["e4m3/128x128/f32"] and 260 in aligned["int4/g128/sym/f16"]
    # every weight format is swept bit-exactly by L2, with f32 and bf16 outputs
    l2 = {c.fmt for c in C.l2_cases()}
    for f in C.WEIGHT_FORMATS:
        assert f"{f} -> f32" in l2 and f"{f} -> bf16" in l2


def test_cli_reference_quick(tmp_path, capsys):
    out = tmp_path / "cert.json"
    rc = main(["reference", "--quick", "--in-process", "--level", "L1", "--ops", "add,rope", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "RESULT    PASS" in text and str(out) in text
    cert = json.loads(out.read_text())
    assert cert["levels_run"] == ["L1"] and cert["ops_passed"]["L1"] == ["rope", "add"]


def test_cli_errors():
    assert main(["/no/such/libdeepinfer_x.so"]) == 2
    assert main(["reference", "--level", "L9"]) == 2


def test_python_dash_m_entry_point():
    p = subprocess.run([sys.executable, "-m", "deepinfer.conformance", "reference", "--quick", "--no-out",
                        "--level", "L1", "--ops", "silu_mul"], capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT / "runtime"), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "RESULT    PASS" in p.stdout
