"""The C ABI as Python sees it: a cffi FFI built from abi/deepinfer_abi.h itself.

The header is the single source of truth: struct layouts, constants, the op list and each op's
args struct are all read from it here, never restated by hand.
"""
from __future__ import annotations

import re
from pathlib import Path

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

_API_FIELDS = [name for name, _ in ffi.typeof("DI_Api").fields]
_FIRST_OP = _API_FIELDS.index("embedding")

# op name -> (op id, args struct C name, [(field name, ctype), ...] without the header)
OPS: dict[str, tuple[int, str, list]] = {}
for _i, (_name, _field) in enumerate(ffi.typeof("DI_Api").fields[_FIRST_OP:]):
    _args_ptr = _field.type.args[1]
    _struct = _args_ptr.item
    _fields = [(fn, ff.type) for fn, ff in _struct.fields if fn != "header"]
    OPS[_name] = (_i, _struct.cname, _fields)
    _enum_name = "DI_OP_" + _name.upper()
    if const(_enum_name) != _i:
        raise RuntimeError(f"{_enum_name} does not match the order of DI_Api in deepinfer_abi.h")

OP_NAMES = list(OPS)
API_NON_OP_FIELDS = _API_FIELDS[4:_FIRST_OP]


def op_fields(op: str) -> list[str]:
    """The keyword names an op takes (its args struct's fields after the header)."""
    return [n for n, _ in OPS[op][2]]


def api_offset(field: str) -> int:
    return ffi.offsetof("DI_Api", field)
