"""Writes abi/OPS.md: every op of the ABI with its five homes (header rows, reference function, CPU
file, CUDA file, conformance cases) and the tests that exercise it.

    python tools/gen_ops_md.py            write abi/OPS.md
    python tools/gen_ops_md.py --check    exit 1 with a diff when abi/OPS.md is stale

Each column is read from the place that decides it, not from a hand-kept list: the header's op enum
and args structs, the reference backend's OPS table, the function each native dispatch table names
(plugin.c and api.cu call op_<name>), and deepinfer.conformance.cases.GENERATORS. An op of the ABI
without a reference function, or without a body that a native dispatch table names, is an error.
"""
from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "runtime"))

from deepinfer import abi  # noqa: E402
from deepinfer.conformance.cases import GENERATORS  # noqa: E402
from deepinfer.reference import OPS as REFERENCE_OPS  # noqa: E402

OUT = ROOT / "abi" / "OPS.md"
HEADER = ROOT / "abi" / "deepinfer_abi.h"
CPU_SRC = ROOT / "backends" / "cpu" / "src"
CUDA_SRC = ROOT / "backends" / "cuda" / "src"
TESTS = ROOT / "tests"
NONE = "—"

# Ops whose names are also common method names of Python, NumPy or torch objects (set.add,
# random.sample, nn.functional.linear, ...): a test names one of these only as a string, or through a
# backend or the reference (`be.add(`, `ref.add(`, `backend.add(`).
COMMON_WORDS = {"add", "mul", "sample", "concat", "linear", "embedding"}
BACKEND_RECEIVERS = ("ref", "be", "backend", "lib_backend")
# Ops whose names tests also quote for other reasons: `"quantize"` is the CLI's subcommand
# (main(["quantize", ...])), `"rope"` a field of ModelConfig. A quoted name counts for these only as
# the first argument of a call, `("op"`, as for the common words.
QUOTED_ELSEWHERE = {"quantize", "rope"}


class OpsTableError(RuntimeError):
    """An op lacks a home that it must have."""


def _rel(path: Path) -> str:
    """A link target relative to abi/, where OPS.md lives."""
    return "../" + path.relative_to(ROOT).as_posix()


def header_rows(op: str, lines: list[str]) -> str:
    """Links to the op's enum entry and the definition of its args struct in deepinfer_abi.h."""
    struct = _di_ops()[op]
    enum = f"DI_OP_{op.upper()}"
    enum_line = next(i for i, s in enumerate(lines, 1) if re.match(rf"\s*{enum}\s*=", s))
    struct_line = next(i for i, s in enumerate(lines, 1) if s.startswith(f"typedef struct {struct} {{"))
    return f"[{enum}](deepinfer_abi.h#L{enum_line}), [{struct}](deepinfer_abi.h#L{struct_line})"


_DI_OPS_ROW = re.compile(r"X\((DI_OP_\w+), (\w+), (\w+), (\d+)\)")


def _di_ops() -> dict[str, str]:
    """op name -> args struct, from the header's DI_OPS table."""
    return {m.group(2): m.group(3) for m in _DI_OPS_ROW.finditer(HEADER.read_text())}


def reference_function(op: str) -> str:
    fn = REFERENCE_OPS.get(op)
    if fn is None:
        raise OpsTableError(f"{op}: the reference backend has no function for it (backends/reference/__init__.py OPS)")
    module = fn.__module__.rsplit(".", 1)[-1]
    path = ROOT / "backends" / "reference" / f"{module}.py"
    # no line number: it would make every edit of the module restale this file
    return f"[{module}:{fn.__name__}]({_rel(path)})"


def _dispatch_names(src: Path, pattern: str) -> str:
    """The function-name prefix a dispatch table's row macro calls (op_ for `op_##name`)."""
    m = re.search(pattern, src.read_text())
    if m is None:
        raise OpsTableError(f"{src.relative_to(ROOT)}: its op dispatch table (DI_OPS row macro) was not found")
    return m.group(1)


def _definitions(src_dir: Path, suffix: str, prefix: str) -> dict[str, list[Path]]:
    """function name -> the files that define it (a line starting `DI_Status <prefix><op>(`)."""
    found: dict[str, list[Path]] = {}
    pat = re.compile(rf"^DI_Status ({prefix}\w+)\(", re.M)
    for path in sorted(src_dir.glob(f"*{suffix}")):
        for m in pat.finditer(path.read_text()):
            found.setdefault(m.group(1), []).append(path)
    return found


def native_files(op: str, table: Path, defs: dict[str, list[Path]], prefix: str, with_cuh: bool) -> str:
    paths = defs.get(prefix + op)
    if not paths:
        raise OpsTableError(f"{op}: {table.relative_to(ROOT)}'s dispatch table names {prefix}{op}, "
                            f"which no file of {table.parent.relative_to(ROOT)} defines")
    links = []
    for p in paths:
        links.append(f"[{p.name}]({_rel(p)})")
        cuh = p.with_suffix(".cuh")
        if with_cuh and cuh.exists():  # the family's kernels, in a header tests/gpu_emu compiles too
            links.append(f"[{cuh.name}]({_rel(cuh)})")
    return ", ".join(links)


def conformance_module(op: str) -> str:
    gen = GENERATORS.get(op)
    if gen is None:
        return NONE
    path = Path(sys.modules[gen.__module__].__file__).resolve()
    return f"[{gen.__module__.rsplit('.', 1)[-1]}]({_rel(path)})"


def family(op: str) -> str:
    """The op's family: the reference module that holds it (norm, rope, moe, ...)."""
    return REFERENCE_OPS[op].__module__.rsplit(".", 1)[-1]


# Tests about tooling, not ops, that name ops only as text: test_device_runner.py passes
# `--ops moe_router,moe_experts` to a device command, test_ops_md.py checks this table.
NOT_OP_TESTS = {"test_device_runner.py", "test_ops_md.py"}
EMU = TESTS / "gpu_emu"
EMU_SUFFIXES = (".cpp", ".cu", ".h")


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py")
                  if "__pycache__" not in p.parts and p.name not in NOT_OP_TESTS)


def _emu_sources(text: str) -> str:
    """The text of the tests/gpu_emu C++ sources a test names: it builds them, so the ops they run
    show up there (check_layernorm, k_layernorm), not in the .py."""
    named = [p for p in sorted(EMU.iterdir())
             if p.suffix in EMU_SUFFIXES and re.search(rf"(?<![\w.]){re.escape(p.name)}\b", text)]
    return "\n".join(p.read_text(errors="replace") for p in named)


def _names_op(stem: str, op: str) -> bool:
    tokens = stem.split("_")
    want = op.split("_")
    return any(tokens[i:i + len(want)] == want for i in range(len(tokens)))


def _calls_op(text: str, op: str) -> bool:
    """A Python test's text uses the op by name: `"op"` / `'op'` anywhere (a case list, quick("op")) or
    `.op(`; for an op named like a common method only `("op"` and calls through a backend."""
    if re.search(rf"""\(\s*["']{op}["']""", text):
        return True
    if op in COMMON_WORDS:
        receivers = "|".join(BACKEND_RECEIVERS)
        return re.search(rf"\b(?:{receivers})\.{op}\(", text) is not None
    if op in QUOTED_ELSEWHERE:
        return re.search(rf"\.{op}\(", text) is not None
    return re.search(rf"""["']{op}["']|\.{op}\(""", text) is not None


def _runs_op(cpp: str, op: str) -> bool:
    """A gpu_emu C++ source runs the op: its name, or its kernel or check (k_op, check_op), in the code;
    comments don't count (test_lanes_and_sort.cpp mentions moe_experts as a user of its scans)."""
    if op in COMMON_WORDS:
        return False  # C++ has no ("op" or backend call: the strict rule never holds there
    code = re.sub(r"//[^\n]*", "", cpp)
    return re.search(rf"\b(?:k_|check_)?{op}\b", code) is not None


def _mentions_op(text: str, op: str) -> bool:
    """The op's name as a word (underscores are word characters: q_a_layernorm is not layernorm);
    for an op named like a common method, the strict rule of _calls_op."""
    if op in COMMON_WORDS:
        return _calls_op(text, op)
    return re.search(rf"\b{op}\b", text) is not None


def _tests_op(path: Path, text: str, cpp: str, op: str) -> bool:
    if _names_op(path.stem, op):
        return True
    if _names_op(path.stem, family(op)) and _mentions_op(text + "\n" + cpp, op):
        return True
    return _calls_op(text, op) or _runs_op(cpp, op)


def tests_for(op: str, files: list[tuple[Path, str, str]]) -> str:
    hits = [p for p, text, cpp in files if _tests_op(p, text, cpp, op)]
    if not hits:
        return NONE
    return ", ".join(f"[{p.relative_to(TESTS).as_posix()}]({_rel(p)})" for p in hits)


PREAMBLE = """# The ops of the ABI and where each one lives

Generated by `tools/gen_ops_md.py` from the header, the reference backend's op table, the CPU and
CUDA dispatch tables and the conformance generators; do not edit by hand. After adding, moving or
renaming an op, its implementation or its tests, run `python tools/gen_ops_md.py`
(`tests/test_ops_md.py` fails while this file is stale).

- **header**: the op's enum entry and the definition of its args struct in `deepinfer_abi.h`.
- **reference**: `module:function` in `backends/reference`, from its `OPS` table; the module is
  the op's family, and the C and CUDA files of a family carry the same name.
- **CPU** / **CUDA**: the file defining `op_<name>`, the function that the dispatch table of
  `backends/cpu/src/plugin.c` / `backends/cuda/src/api.cu` calls for the op; for CUDA also the
  family's kernel header (`<family>.cuh`) where there is one.
- **conformance**: the module of `deepinfer.conformance.cases.GENERATORS[op]`.
- **tests**: test files `tests/**/test_*.py` that exercise the op; a file's text is its own plus
  that of the `tests/gpu_emu` C++ sources (`.cpp`, `.cu`, `.h`) it names, which it builds. A file
  counts when its name carries the op (split at `_`); or its name carries the op's family and its
  text names the op as a word (`_` is a word character: `q_a_layernorm` is not `layernorm`); or its
  Python quotes the op, `"op"` / `'op'` anywhere, or calls `.op(`; or the C++ it builds names the op
  or its kernel or check (`k_op`, `check_op`) outside comments. For ops named like common methods
  (add, mul, sample, concat, linear, embedding) only `("op"` and `ref.` / `be.` / `backend.` /
  `lib_backend.` calls count, for a family match too; for `quantize` (a CLI subcommand) and `rope`
  (a config field) a quoted name counts only as `("op"`. `test_device_runner.py` and
  `test_ops_md.py` are about tooling and are left out.
"""


def render() -> str:
    lines = HEADER.read_text().splitlines()
    cpu_table = CPU_SRC / "plugin.c"
    cuda_table = CUDA_SRC / "api.cu"
    cpu_prefix = _dispatch_names(cpu_table, r"\(op_impl\)(\w+)##name")
    cuda_prefix = _dispatch_names(cuda_table, r"return (\w+)##name\(ctx, &local\.name")
    cpu_defs = _definitions(CPU_SRC, ".c", cpu_prefix)
    cuda_defs = _definitions(CUDA_SRC, ".cu", cuda_prefix)
    files = []
    for p in _test_files():
        text = p.read_text(errors="replace")
        files.append((p, text, _emu_sources(text)))
    out = [PREAMBLE, "| op | header | reference | CPU | CUDA | conformance | tests |",
           "|---|---|---|---|---|---|---|"]
    for op in abi.OP_NAMES:
        row = [f"`{op}`", header_rows(op, lines), reference_function(op),
               native_files(op, cpu_table, cpu_defs, cpu_prefix, False),
               native_files(op, cuda_table, cuda_defs, cuda_prefix, True),
               conformance_module(op), tests_for(op, files)]
        out.append("| " + " | ".join(row) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 with a diff when abi/OPS.md is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        old = OUT.read_text() if OUT.exists() else ""
        if old == text:
            return 0
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                   "abi/OPS.md (committed)", "abi/OPS.md (generated)"))
        print("abi/OPS.md is stale: run python tools/gen_ops_md.py", file=sys.stderr)
        return 1
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
