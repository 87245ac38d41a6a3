"""The C ABI as Python sees it: a cffi FFI built from abi/deepinfer_abi.h itself.

The header is the single source of truth: struct layouts, constants, the op list and each op's
args struct are all read from it here, never restated by hand.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import cffi

_HERE = Path(__file__).resolve().parent


def header_path() -> Path:
    """The installed copy of the header, or the source tree's when running from a checkout."""
    candidates = [_HERE / "include" / "deepinfer_abi.h", _HERE.parents[1] / "abi" / "deepinfer_abi.h"]
    for p in candidates:
        if p.is_file():
            return p
    # an editable install keeps the package files in the source tree but the header in site-packages
    import sysconfig

    p = Path(sysconfig.get_paths()["platlib"]) / "deepinfer" / "include" / "deepinfer_abi.h"
    if p.is_file():
        return p
    raise FileNotFoundError(
        "deepinfer_abi.h not found next to the package or in abi/; reinstall deepinfer (pip install -e .)"
    )


def _cdef_text(text: str) -> str:
    m = re.search(r"/\* DI_CDEF_BEGIN \*/(.*)/\* DI_CDEF_END \*/", text, re.S)
    if not m:
        raise RuntimeError("deepinfer_abi.h lacks the DI_CDEF_BEGIN/END markers")
    return m.group(1)


HEADER_TEXT = header_path().read_text()
ffi = cffi.FFI()
ffi.cdef(_cdef_text(HEADER_TEXT))
# ABI mode on the process itself: gives the header's enum and #define constants by name.
C = ffi.dlopen(None)


def const(name: str) -> int:
    return getattr(C, name)


ABI_MAJOR: int = const("DI_ABI_MAJOR")
ABI_MINOR: int = const("DI_ABI_MINOR")
MAX_DIMS: int = const("DI_MAX_DIMS")

STATUS_NAMES = {
    const(n): n[3:]
    for n in ("DI_OK", "DI_INVALID_ARGUMENT", "DI_UNIMPLEMENTED", "DI_RESOURCE_EXHAUSTED",
              "DI_FAILED_PRECONDITION", "DI_INTERNAL", "DI_VERSION_MISMATCH")
}
OK = const("DI_OK")
INVALID_ARGUMENT = const("DI_INVALID_ARGUMENT")
UNIMPLEMENTED = const("DI_UNIMPLEMENTED")
RESOURCE_EXHAUSTED = const("DI_RESOURCE_EXHAUSTED")
FAILED_PRECONDITION = const("DI_FAILED_PRECONDITION")

SUPPORT_NO = const("DI_SUPPORT_NO")
SUPPORT_YES = const("DI_SUPPORT_YES")
SUPPORT_SLOW = const("DI_SUPPORT_SLOW")

# ---------------------------------------------------------------------------- the op table
# DI_OPS and DI_ARGS_<op> (after DI_CDEF_END) are the one statement of every op's arguments; the
# same lines drive deepinfer_abi_check.h in C. Parsed here, cross-checked against the cdef.

DT_ID_NAMES = {  # enum DI_DTypeId -> the runtime's dtype names (deepinfer.dtypes)
    "F32": "f32", "F16": "f16", "BF16": "bf16", "E4M3": "e4m3", "E5M2": "e5m2", "E8M0": "e8m0",
    "E2M1": "e2m1", "I4": "int4", "U4": "uint4", "I8": "int8", "U8": "uint8", "I32": "int32",
    "I64": "int64", "U64": "uint64",
}
DTYPE_IDS = {DT_ID_NAMES[k]: const("DI_DT_" + k) for k in DT_ID_NAMES}


@dataclass(frozen=True)
class ArgSpec:
    """One row of DI_ARGS_<op>: a DI_Tensor field (or an array of them) and what it may hold."""

    name: str
    role: str               # "in", "out", "inout"
    optional: bool
    ndim: tuple             # (lo, hi)
    plain: frozenset        # dtype names without a quant descriptor (empty: must be quantized)
    quant: frozenset        # storage dtype names with one (empty: plain values only)
    count: Optional[str] = None   # arrays: the int field holding the number of descriptors

    @property
    def is_array(self) -> bool:
        return self.count is not None

    @property
    def written(self) -> bool:
        return self.role in ("out", "inout")


@dataclass(frozen=True)
class OpSpec:
    id: int
    name: str
    struct: str
    since_minor: int
    args: tuple             # ArgSpec rows in field order

    def arg(self, name: str) -> ArgSpec:
        for a in self.args:
            if a.name == name:
                return a
        raise KeyError(f"{self.name} has no tensor argument {name!r}")


@dataclass(frozen=True)
class QuantFormat:
    """One row of DI_FORMATS: a named block-quantization format of abi/README.md section 5."""

    name: str
    q_dtype: str
    block_rows: int         # 0: the whole dimension
    block_cols: int         # 0: the whole dimension; -1: any of GROUP_SIZES
    scale_dtypes: frozenset
    asymmetric: bool
    use: str                # "W" weights, "A" activations


def _optable_text(text: str) -> str:
    m = re.search(r"/\* DI_OPTABLE_BEGIN(.*)/\* DI_OPTABLE_END \*/", text, re.S)
    if not m:
        raise RuntimeError("deepinfer_abi.h lacks the DI_OPTABLE_BEGIN/END block")
    return m.group(1)


def _dtype_sets(block: str) -> dict[str, frozenset]:
    sets = {}
    for name, body in re.findall(r"#define (DI_DTS_\w+)\s+(.*)", block):
        sets[name] = frozenset(DT_ID_NAMES[d] for d in re.findall(r"DI_DT_(\w+)", body))
    return sets


def _parse_optable(text: str):
    block = _optable_text(text)
    sets = _dtype_sets(block)
    ops = []
    for enum, name, struct, minor in re.findall(r"^\s*X\((DI_OP_\w+), (\w+), (\w+), (\d+)\)", block, re.M):
        m = re.search(rf"#define DI_ARGS_{name}\(T, A, S\)((?:\s*\\\n\s*[TA]\(S,[^)]*\))+)", block)
        if not m:
            raise RuntimeError(f"deepinfer_abi.h: no DI_ARGS_{name}(T, A, S) rows")
        rows = []
        for kind, body in re.findall(r"([TA])\(S, ([^)]*)\)", m.group(1)):
            f = [x.strip() for x in body.split(",")]
            rows.append(ArgSpec(name=f[0], role=f[1].lower(), optional=f[2] == "OPT", ndim=(int(f[3]), int(f[4])),
                                plain=sets[f[5]], quant=sets[f[6]], count=f[7] if kind == "A" else None))
        ops.append(OpSpec(const(enum), name, struct, int(minor), tuple(rows)))
    formats = []
    for row in re.findall(r"^\s*F\((\w+), DI_DT_(\w+), (-?\d+), (-?\d+), (DI_DTS_\w+), ([01]), ([WA])\)", block, re.M):
        formats.append(QuantFormat(row[0], DT_ID_NAMES[row[1]], int(row[2]), int(row[3]), sets[row[4]],
                                   row[5] == "1", row[6]))
    qmax = {DT_ID_NAMES[d]: float(v) for d, v in re.findall(r"^\s*Q\(DI_DT_(\w+), (\d+)\)", block, re.M)}
    groups = tuple(int(g) for g in re.findall(r"G\((\d+)\)", re.search(r"#define DI_GROUP_SIZES\(G\)(.*)", block).group(1)))
    return ops, sets, formats, qmax, groups


_OPSPECS, DTYPE_SETS, FORMATS, QMAX, GROUP_SIZES = _parse_optable(HEADER_TEXT)
OP_SPECS: dict[str, OpSpec] = {o.name: o for o in _OPSPECS}

def bind_ops(the_ffi, specs: list) -> dict:
    """op name -> (op id, args struct C name, [(field, ctype), ...]) from DI_Api, checked row by row
    against the op table: same order, same ids, same args structs, and one table row per DI_Tensor
    field of each struct. Any disagreement raises (the header is inconsistent)."""
    api_fields = [name for name, _ in the_ffi.typeof("DI_Api").fields]
    first = api_fields.index("embedding")
    entries = the_ffi.typeof("DI_Api").fields[first:first + len(specs)]
    if len(entries) != len(specs):
        raise RuntimeError(f"deepinfer_abi.h: DI_OPS has {len(specs)} rows but DI_Api only {len(entries)} op entries")
    ops = {}
    for i, (name, field) in enumerate(entries):
        spec = specs[i]
        if spec.name != name or spec.id != i:
            raise RuntimeError(f"deepinfer_abi.h: DI_OPS row {i} is {spec.name} (id {spec.id}) but DI_Api entry "
                               f"{first + i} is {name}")
        struct = field.type.args[1].item
        if struct.cname != spec.struct:
            raise RuntimeError(f"deepinfer_abi.h: DI_OPS says {name} takes {spec.struct}, DI_Api says {struct.cname}")
        # named `reserved` fields are padding made explicit (always zero): not arguments
        fields = [(fn, ff.type) for fn, ff in struct.fields if fn != "header" and not fn.startswith("reserved")]
        tensor_fields = [fn for fn, ft in fields if ft.cname == "DI_Tensor" or
                         (ft.kind == "pointer" and ft.item.cname == "DI_Tensor")]
        if tensor_fields != [a.name for a in spec.args]:
            raise RuntimeError(f"deepinfer_abi.h: DI_ARGS_{name} rows {[a.name for a in spec.args]} do not match the "
                               f"DI_Tensor fields of {struct.cname} {tensor_fields}")
        for a in spec.args:
            is_array = dict(fields)[a.name].kind == "pointer"
            if is_array != a.is_array:
                raise RuntimeError(f"deepinfer_abi.h: DI_ARGS_{name}: {a.name} is {'an array' if is_array else 'a tensor'}"
                                   f" in {struct.cname} but a{'n A' if a.is_array else ' T'} row in the table")
        ops[name] = (i, struct.cname, fields)
    return ops


OPS: dict[str, tuple[int, str, list]] = bind_ops(ffi, _OPSPECS)
for _name, (_i, _s, _f) in OPS.items():
    if const("DI_OP_" + _name.upper()) != _i:
        raise RuntimeError(f"DI_OP_{_name.upper()} does not match the order of DI_Api in deepinfer_abi.h")
_API_FIELDS = [name for name, _ in ffi.typeof("DI_Api").fields]
_FIRST_OP = _API_FIELDS.index("embedding")
_LAST_OP = _FIRST_OP + len(_OPSPECS)

OP_NAMES = list(OPS)
API_NON_OP_FIELDS = _API_FIELDS[4:_FIRST_OP] + _API_FIELDS[_LAST_OP:]
# entries appended in 1.1 (a 1.0 library's table ends before them)
API_V1_1_FIELDS = _API_FIELDS[_LAST_OP:]


def output_fields(op: str) -> list[str]:
    """Tensor fields the op writes (role OUT or INOUT)."""
    return [a.name for a in OP_SPECS[op].args if a.written]


def op_fields(op: str) -> list[str]:
    """The keyword names an op takes (its args struct's fields after the header)."""
    return [n for n, _ in OPS[op][2]]


def api_offset(field: str) -> int:
    return ffi.offsetof("DI_Api", field)


def has_entry(api, entry: str) -> bool:
    """Whether a library's DI_Api table fills `entry` (an older library's table ends before it)."""
    return api_offset(entry) < api.struct_size and getattr(api, entry) != ffi.NULL


# the attributes deepinfer reads from a context (abi/README.md section 7)
ATTRIBUTE_KEYS = ("name", "version", "abi.version", "device.type", "device.name", "device.sm_count",
                  "device.memory_bytes", "device.memory_free_bytes", "device.memory_total_bytes", "device.arch",
                  "cpu.features", "threads")


def read_attributes(api, ctx) -> dict:
    """Every attribute of ATTRIBUTE_KEYS the context answers, as strings."""
    out: dict = {}
    if not has_entry(api, "get_attribute"):
        return out
    buf = ffi.new("char[]", 512)
    for key in ATTRIBUTE_KEYS:
        if api.get_attribute(ctx, key.encode(), buf, 512) == OK:
            out[key] = ffi.string(buf).decode("utf-8", "replace")
    return out
