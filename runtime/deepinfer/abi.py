"""The C ABI as Python sees it: a cffi FFI built from abi/deepinfer_abi.h itself.

The header is the single source of truth: struct layouts, constants, the op list and each op's
args struct are all read from it here, never restated by hand.
"""
from __future__ import annotations

import numbers
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
    since_minor: int = 0    # the minor version that added the field (DI_ARGS_SINCE; else its op's)

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
    appended: tuple = ()    # (field, minor) of DI_ARGS_SINCE: fields added after the op, in field order

    def arg(self, name: str) -> ArgSpec:
        for a in self.args:
            if a.name == name:
                return a
        raise KeyError(f"{self.name} has no tensor argument {name!r}")

    def field_since(self, field: str) -> int:
        """The minor version that added `field` (any field of the args struct) to this op."""
        return dict(self.appended).get(field, self.since_minor)


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
    since: dict[str, list] = {}
    m = re.search(r"#define DI_ARGS_SINCE\(F\)((?:\s*\\\n\s*F\([^)]*\))+)", block)
    for op, struct, field, minor in re.findall(r"F\((\w+), (\w+), (\w+), (\d+)\)", m.group(1) if m else ""):
        since.setdefault(op, []).append((struct, field, int(minor)))
    ops = []
    for enum, name, struct, minor in re.findall(r"^\s*X\((DI_OP_\w+), (\w+), (\w+), (\d+)\)", block, re.M):
        m = re.search(rf"#define DI_ARGS_{name}\(T, A, S\)((?:\s*\\\n\s*[TA]\(S,[^)]*\))+)", block)
        if not m:
            raise RuntimeError(f"deepinfer_abi.h: no DI_ARGS_{name}(T, A, S) rows")
        appended = []
        for s_struct, field, fminor in since.pop(name, []):
            if s_struct != struct or fminor <= int(minor):
                raise RuntimeError(f"deepinfer_abi.h: DI_ARGS_SINCE row ({name}, {s_struct}, {field}, {fminor}) "
                                   f"does not fit DI_OPS ({struct}, minor {minor})")
            appended.append((field, fminor))
        added = dict(appended)
        rows = []
        for kind, body in re.findall(r"([TA])\(S, ([^)]*)\)", m.group(1)):
            f = [x.strip() for x in body.split(",")]
            rows.append(ArgSpec(name=f[0], role=f[1].lower(), optional=f[2] == "OPT", ndim=(int(f[3]), int(f[4])),
                                plain=sets[f[5]], quant=sets[f[6]], count=f[7] if kind == "A" else None,
                                since_minor=added.get(f[0], int(minor))))
        ops.append(OpSpec(const(enum), name, struct, int(minor), tuple(rows), tuple(appended)))
    if since:
        raise RuntimeError(f"deepinfer_abi.h: DI_ARGS_SINCE names ops not in DI_OPS: {sorted(since)}")
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
    against the op table: every op has its DI_Api entry, the entries are in id order (the ops of one
    minor version side by side; 1.0's from `embedding`), the args structs agree, one table row per
    DI_Tensor field of each struct, and fields appended in a later minor (DI_ARGS_SINCE) are optional
    and come last in minor order. Any disagreement raises (the header is inconsistent)."""
    api = the_ffi.typeof("DI_Api")
    api_fields = [name for name, _ in api.fields]
    first = api_fields.index("embedding")
    ops = {}
    prev_pos = prev_minor = None
    for i, spec in enumerate(specs):
        if spec.id != i:
            raise RuntimeError(f"deepinfer_abi.h: DI_OPS row {i} is {spec.name} with id {spec.id}")
        if spec.name not in api_fields:
            raise RuntimeError(f"deepinfer_abi.h: DI_OPS names {spec.name} but DI_Api has no such entry")
        pos = api_fields.index(spec.name)
        in_order = (pos == first + i) if spec.since_minor == 0 else (
            prev_pos is not None and (pos == prev_pos + 1 if spec.since_minor == prev_minor else pos > prev_pos))
        if not in_order:
            raise RuntimeError(f"deepinfer_abi.h: DI_Api entry {spec.name} (op {i}, minor {spec.since_minor}) is out "
                               f"of place (position {pos}; ops of one minor sit side by side in id order)")
        prev_pos, prev_minor = pos, spec.since_minor
        field = dict(api.fields)[spec.name]
        name = spec.name
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
        names = [fn for fn, _ in fields]
        minors = [spec.field_since(fn) for fn in names]
        if minors != sorted(minors):
            raise RuntimeError(f"deepinfer_abi.h: the fields of {struct.cname} are not in DI_ARGS_SINCE minor order "
                               f"{list(zip(names, minors))}")
        for fn, _minor in spec.appended:
            if fn not in names:
                raise RuntimeError(f"deepinfer_abi.h: DI_ARGS_SINCE names {struct.cname}.{fn}, which does not exist")
            if fn in tensor_fields and not spec.arg(fn).optional:
                raise RuntimeError(f"deepinfer_abi.h: {struct.cname}.{fn} was appended in a minor version, so it must "
                                   f"be OPT")
        ops[name] = (i, struct.cname, fields)
    return ops


OPS: dict[str, tuple[int, str, list]] = bind_ops(ffi, _OPSPECS)
for _name, (_i, _s, _f) in OPS.items():
    if const("DI_OP_" + _name.upper()) != _i:
        raise RuntimeError(f"DI_OP_{_name.upper()} does not match the order of DI_Api in deepinfer_abi.h")
_API_FIELDS = [name for name, _ in ffi.typeof("DI_Api").fields]


def _api_since(text: str) -> dict:
    """DI_Api entry -> the minor version that added it, from the `---- v1.N` section markers."""
    body = re.search(r"typedef struct DI_Api \{(.*?)\} DI_Api;", text, re.S).group(1)
    minor, since = 0, {}
    for line in body.splitlines():
        m = re.search(r"---- v\d+\.(\d+)", line)
        if m:
            minor = int(m.group(1))
        for entry in re.findall(r"\(\*(\w+)\)", line):
            since[entry] = minor
    return since


OP_NAMES = list(OPS)
API_ENTRY_SINCE: dict[str, int] = _api_since(_cdef_text(HEADER_TEXT))
for _op in _OPSPECS:
    if API_ENTRY_SINCE.get(_op.name) != _op.since_minor:
        raise RuntimeError(f"deepinfer_abi.h: {_op.name} sits in the v1.{API_ENTRY_SINCE.get(_op.name)} section of "
                           f"DI_Api but DI_OPS says minor {_op.since_minor}")
API_NON_OP_FIELDS = [f for f in _API_FIELDS[4:] if f not in OPS]
# entries appended in 1.1 (a 1.0 library's table ends before them), in 1.2, ...
API_V1_1_FIELDS = [f for f in _API_FIELDS if API_ENTRY_SINCE.get(f) == 1]
API_V1_2_FIELDS = [f for f in _API_FIELDS if API_ENTRY_SINCE.get(f) == 2]
API_V1_3_FIELDS = [f for f in _API_FIELDS if API_ENTRY_SINCE.get(f) == 3]
API_V1_4_FIELDS = [f for f in _API_FIELDS if API_ENTRY_SINCE.get(f) == 4]


def field_is_set(value) -> bool:
    """Whether a keyword argument sets its args-struct field: a tensor or descriptor array given, or a
    scalar other than zero. A zero scalar is exactly what a caller of an older minor leaves there (its
    struct ends before the field, which the library reads as zero), so it never needs a newer library."""
    if value is None:
        return False
    if isinstance(value, numbers.Number):   # Python and NumPy scalars alike
        return bool(value != 0)   # NaN != 0: set (and invalid, which the library is left to say)
    return True


def args_struct_size(op: str, minor: int = ABI_MINOR) -> int:
    """The size of op's args struct as a caller of ABI 1.`minor` compiles it (fields appended in a
    later minor left out); the smallest struct_size a library accepts is args_struct_size(op, 0)."""
    spec = OP_SPECS[op]
    later = [ffi.offsetof(spec.struct, f) for f, m in spec.appended if m > minor]
    return min(later) if later else ffi.sizeof(spec.struct)


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
