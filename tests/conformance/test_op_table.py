"""The op table of deepinfer_abi.h (DI_OPS / DI_ARGS_<op>) is the one statement of every op's
arguments. These tests fail when any consumer disagrees with it: the C expansion in
deepinfer_abi_check.h, the Python parse, the reference backend, the CPU backend, the planner and the
conformance suite's cases; and they show that a header whose table contradicts its structs is
refused both by the C compiler and by the Python loader."""
from __future__ import annotations

import json
import re
import subprocess

import cffi
import numpy as np
import pytest

from deepinfer import abi
from deepinfer import dtypes as D
from deepinfer.conformance import cases as C
from deepinfer.conformance.harness import Materialized
from deepinfer.errors import BackendCallError, UnsupportedOpError
from deepinfer.loader import load_library
from deepinfer.model import plan as P
from deepinfer.reference import ReferenceBackend
from deepinfer.tensor import Tensor
from plugin_build import ABI_DIR

ffi = abi.ffi


def _dts_names(mask: int) -> set:
    return {name for name, i in abi.DTYPE_IDS.items() if mask & (1 << i)}


C_DUMP = r"""
#include <stdio.h>
#include "deepinfer_abi_check.h"
int main(void) {
    printf("[[");   /* [ops, DI_ARGS_SINCE rows] */
    for (int32_t op = 0; op < DI_OP_COUNT_V1_7; op++) {
        const DI_OpInfo* o = di_op_info(op);
        printf("%s{\"id\": %d, \"name\": \"%s\", \"struct\": \"%s\", \"size\": %u, \"minor\": %u, "
               "\"min_size\": %u, \"args\": [", op ? ", " : "", o->id, o->name, o->struct_name, o->struct_size,
               o->since_minor, di_args_min_size(op));
        for (int32_t i = 0; i < o->n_args; i++) {
            const DI_ArgInfo* a = &o->args[i];
            printf("%s[\"%s\", %u, %d, %u, %d, %d, %u, %u, %d]", i ? ", " : "", a->name, a->offset, a->role,
                   a->flags, a->ndim_lo, a->ndim_hi, a->plain, a->quant, a->count_offset);
        }
        printf("]}");
    }
    int32_t n;
    const DI_FieldSince* since = di_fields_since(&n);
    printf("], [");
    for (int32_t i = 0; i < n; i++)
        printf("%s[\"%s\", \"%s\", %u, %u]", i ? ", " : "", since[i].op, since[i].field, since[i].offset,
               since[i].minor);
    printf("]]\n");
    return di_op_info(DI_OP_COUNT_V1_7) == NULL ? 0 : 1;
}
"""


def _compile(cc, tmp_path, source: str, include_dir, name="prog") -> subprocess.CompletedProcess:
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    exe = tmp_path / name
    return subprocess.run([cc, "-std=c99", "-Wall", "-Werror", "-I", str(include_dir), str(src), "-o", str(exe)],
                          capture_output=True, text=True)


def test_c_and_python_read_the_same_table(cc, tmp_path):
    p = _compile(cc, tmp_path, C_DUMP, ABI_DIR)
    assert p.returncode == 0, p.stderr
    dump, since = json.loads(subprocess.run([str(tmp_path / "prog")], capture_output=True, text=True,
                                            check=True).stdout)
    roles = {1: "in", 2: "out", 3: "inout"}
    assert [o["name"] for o in dump] == abi.OP_NAMES
    assert since == [[op, f, ffi.offsetof(abi.OP_SPECS[op].struct, f), m] for op in abi.OP_NAMES
                     for f, m in abi.OP_SPECS[op].appended]
    for o in dump:
        spec = abi.OP_SPECS[o["name"]]
        assert (o["id"], o["struct"], o["size"], o["minor"]) == (spec.id, spec.struct, ffi.sizeof(spec.struct),
                                                                 spec.since_minor)
        assert o["min_size"] == abi.args_struct_size(o["name"], spec.since_minor)
        assert [a[0] for a in o["args"]] == [a.name for a in spec.args]
        for (name, off, role, flags, lo, hi, plain, quant, count_off), a in zip(o["args"], spec.args):
            assert off == ffi.offsetof(spec.struct, name)
            assert roles[role] == a.role and bool(flags & 1) == a.optional and bool(flags & 2) == a.is_array
            assert (lo, hi) == a.ndim
            assert _dts_names(plain) == a.plain and _dts_names(quant) == a.quant, (o["name"], name)
            assert count_off == (ffi.offsetof(spec.struct, a.count) if a.is_array else -1)


def _mutated_header(tmp_path, old: str, new: str):
    text = (ABI_DIR / "deepinfer_abi.h").read_text()
    assert old in text
    d = tmp_path / "mutated"
    d.mkdir(exist_ok=True)
    (d / "deepinfer_abi.h").write_text(text.replace(old, new, 1))
    (d / "deepinfer_abi_check.h").write_text((ABI_DIR / "deepinfer_abi_check.h").read_text())
    return d, text.replace(old, new, 1)


MUTATIONS = {
    # a row naming a field the struct lacks
    "unknown field": ("T(S, w, IN, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_WEIGHT_Q)",
                      "T(S, weights, IN, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_WEIGHT_Q)"),
    # two ops swapped in DI_OPS (the positional mistake a hand-written table can make)
    "swapped ops": ("    X(DI_OP_ADD, add, DI_BinaryArgs, 0) \\\n    X(DI_OP_MUL, mul, DI_BinaryArgs, 0) \\",
                    "    X(DI_OP_ADD, mul, DI_BinaryArgs, 0) \\\n    X(DI_OP_MUL, add, DI_BinaryArgs, 0) \\"),
    # an op whose row says the wrong args struct
    "wrong struct": ("X(DI_OP_SILU_MUL, silu_mul, DI_SiluMulArgs, 0)", "X(DI_OP_SILU_MUL, silu_mul, DI_ConcatArgs, 0)"),
    # an appended field named on the wrong struct (DI_ARGS_SINCE)
    "since names a field the struct lacks": ("F(sample, DI_SampleArgs, probs, 2)", "F(sample, DI_SampleArgs, prob, 2)"),
    # a 1.2 op claimed by 1.0 (its DI_Api entry sits after the 1.1 entries)
    "1.2 op said to be 1.0": ("X(DI_OP_SPEC_VERIFY, spec_verify, DI_SpecVerifyArgs, 2)",
                              "X(DI_OP_SPEC_VERIFY, spec_verify, DI_SpecVerifyArgs, 0)"),
    # a 1.4 op with another op's args struct (both have a comm, an x and an out)
    "1.4 op with the wrong struct": ("X(DI_OP_ALL_GATHER, all_gather, DI_AllGatherArgs, 4)",
                                     "X(DI_OP_ALL_GATHER, all_gather, DI_AllReduceArgs, 4)"),
}
# contradictions only the Python loader catches (deepinfer_abi_check.h does not compare a DI_ARGS_SINCE
# row's minor with its op's)
LOADER_MUTATIONS = {
    # a 1.3 field said to have arrived with its op (1.0)
    "1.3 field said to be its op's": ("F(mla_decode, DI_MLADecodeArgs, indices, 3)",
                                      "F(mla_decode, DI_MLADecodeArgs, indices, 0)"),
    # a 1.5 field said to be older than the 1.3 field before it (fields are in minor order)
    "1.5 field out of minor order": ("F(moe_experts, DI_MoEExpertsArgs, expert_map, 5)",
                                     "F(moe_experts, DI_MoEExpertsArgs, expert_map, 2)"),
    # an appended tensor made required (a caller of 1.4 cannot send it)
    "1.5 field required": ("T(S, misses, OUT, OPT, 2, 2, DI_DTS_INDEX, DI_DTS_NONE)",
                           "T(S, misses, OUT, REQ, 2, 2, DI_DTS_INDEX, DI_DTS_NONE)"),
}


@pytest.mark.parametrize("what", sorted(MUTATIONS))
def test_a_table_that_contradicts_the_structs_does_not_compile(cc, tmp_path, what):
    d, _ = _mutated_header(tmp_path, *MUTATIONS[what])
    p = _compile(cc, tmp_path, C_DUMP, d)
    assert p.returncode != 0, f"{what}: the C compiler accepted an inconsistent op table"


@pytest.mark.parametrize("what", sorted(MUTATIONS) + sorted(LOADER_MUTATIONS) + ["missing row"])
def test_a_table_that_contradicts_the_structs_is_refused_by_the_loader(tmp_path, what):
    old, new = {**MUTATIONS, **LOADER_MUTATIONS}.get(
        what, ("    T(S, bias, IN, OPT, 1, 1, DI_DTS_FLOAT, DI_DTS_NONE) \\\n", ""))
    _, text = _mutated_header(tmp_path, old, new)
    f = cffi.FFI()
    f.cdef(abi._cdef_text(text))
    # parsing the table already refuses some (a DI_ARGS_SINCE row whose struct is not its op's), binding
    # it to DI_Api the rest
    with pytest.raises(RuntimeError, match="deepinfer_abi.h"):
        abi.bind_ops(f, abi._parse_optable(text)[0])


def test_every_args_struct_field_is_in_the_table_or_a_scalar():
    """... or a collective's communicator (1.4): `DI_Comm* comm`, the one pointer an args struct holds."""
    comm = ffi.typeof("DI_Comm*")
    for op, (_, struct, fields) in abi.OPS.items():
        tensors = {a.name for a in abi.OP_SPECS[op].args}
        for name, ctype in fields:
            assert name in tensors or ctype.kind == "primitive" or (name == "comm" and ctype is comm), (op, name)
    assert [op for op in abi.OP_NAMES if "comm" in abi.op_fields(op)] == ["all_reduce", "all_gather", "all_to_all"]


def test_planner_and_conformance_cases_follow_the_table():
    for op in abi.OP_NAMES:
        spec = abi.OP_SPECS[op]
        assert P.OUTPUT_FIELDS[op] == {a.name for a in spec.args if a.role in ("out", "inout")}
        case = C.a_valid_case(op)
        outs = {n for n, t in case.tensors.items() if isinstance(t, C.TSpec) and t.out}
        assert outs <= {a.name for a in spec.args if a.written}, (op, outs)
        for a in spec.args:
            if not a.optional and not a.is_array:
                assert a.name in case.tensors, f"the conformance case of {op} lacks required {a.name}"


def test_format_registry_agrees_with_the_dtypes_and_the_conformance_formats():
    for q, m in abi.QMAX.items():
        assert D.get(q).max == m
    for label, f in {**C.WEIGHT_FORMATS, **C.ACT_FORMATS, **C.QUANTIZE_FORMATS}.items():
        rows = [r for r in abi.FORMATS if r.q_dtype == f.qdtype and r.block_rows == f.block[0] and
                (r.block_cols == f.block[1] or (r.block_cols == -1 and f.block[1] in abi.GROUP_SIZES))]
        assert rows, f"conformance format {label} is not a format of the header's DI_FORMATS table"
        assert any(f.sdtype in r.scale_dtypes for r in rows), label


# ------------------------------------------------------------------ the backends reject what the table rejects

def _outside(a: abi.ArgSpec) -> list[str]:
    """Dtypes no wider than the argument's own that its row does not allow (so a backend that failed
    to check cannot be led past the end of a buffer)."""
    allowed = a.plain or a.quant
    width = min(D.get(d).bits for d in allowed)
    out = [d for d in ("f16", "bf16", "f32", "int8", "uint8", "int32", "e5m2") if d not in allowed and
           D.get(d).bits <= width and not (a.quant and d in a.quant)]
    if allowed == {"int32"}:
        out.append("int64")   # wider, but both sides must refuse it before reading (CUDA once took it)
    return out


def _with_dtype(t: Tensor, dtype: str) -> Tensor:
    return Tensor(t.buffer, t.shape, dtype, t.strides, t.offset, t.quant)


def _status(backend, op, kwargs):
    try:
        backend.call(op, **kwargs)
    except UnsupportedOpError:
        return "UNIMPLEMENTED"
    except BackendCallError as e:
        return e.status_name
    except (ValueError, TypeError):
        return "INVALID_ARGUMENT"
    return "OK"


def _want(dtype: str, allowed: frozenset) -> str:
    floats = any(D.get(d).is_float for d in allowed)
    return "UNIMPLEMENTED" if D.get(dtype).is_float and floats else "INVALID_ARGUMENT"


@pytest.mark.parametrize("op", abi.OP_NAMES)
def test_reference_and_cpu_reject_every_dtype_outside_the_table(op, cpu_lib):
    cpu = load_library(cpu_lib)
    ref = ReferenceBackend()
    try:
        tried = 0
        for a in abi.OP_SPECS[op].args:
            if a.is_array:
                continue
            case = C.a_full_case(op)   # with the fields appended after the op (sample's probs)
            if a.name not in case.tensors or not isinstance(case.tensors[a.name], C.TSpec):
                continue
            if case.tensors[a.name].quant is not None or any(
                    isinstance(s, C.TSpec) and s.alias == a.name for s in case.tensors.values()):
                continue   # quantized operands: their storage dtype is L0's quant_checks' business
            for dt in _outside(a):
                got = {}
                for name, be in (("reference", ref), ("cpu", cpu)):
                    m = Materialized(be, case)
                    kw = dict(m.kwargs)
                    kw[a.name] = _with_dtype(kw[a.name], dt)
                    got[name] = _status(be, op, kw)
                want = _want(dt, a.plain)
                assert got == {"reference": want, "cpu": want}, f"{op}.{a.name} as {dt}: {got}, table says {want}"
                tried += 1
        assert tried, f"no argument of {op} was tried"
    finally:
        cpu.close()


def test_quantized_operand_where_the_table_says_plain_is_unimplemented_everywhere(cpu_lib):
    """rmsnorm.x takes plain values only: a quant descriptor is a format the op lacks."""
    cpu = load_library(cpu_lib)
    try:
        case = C.a_valid_case("rmsnorm")
        for be in (ReferenceBackend(), cpu):
            m = Materialized(be, case)
            kw = dict(m.kwargs)
            x = kw["x"]
            scales = Tensor.from_numpy(np.ones((x.shape[0], 1), np.float32))
            from deepinfer.tensor import Quant
            kw["x"] = Tensor(x.buffer, x.shape, "int8", x.strides, x.offset, Quant(scales, (1, 0)))
            assert _status(be, "rmsnorm", kw) == "UNIMPLEMENTED", be.name
    finally:
        cpu.close()


def test_header_text_has_one_row_per_line():
    """The Python parser reads one row per line; a row split over lines would be silently dropped."""
    block = abi._optable_text(abi.HEADER_TEXT)
    rows = re.findall(r"^\s*[TA]\(S, ", block, re.M)
    assert len(rows) == sum(len(s.args) for s in abi.OP_SPECS.values())
