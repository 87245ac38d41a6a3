"""The runtime's imports point down: no cycles, no upward imports, no function-local import that dodges a cycle.

Every module under runtime/deepinfer (and the reference backend, which installs as deepinfer/reference)
is parsed with `ast`; relative imports are resolved; `import a.b` and `from a import b` become edges
to the deepest deepinfer module they name. Imports under `if TYPE_CHECKING:` never run and are left
out. An import in a function body is a *local* edge, anything else (class bodies, try blocks) a
*module-level* edge. The test reports

  (a) import cycles: strongly connected components of the module-level graph, and of the whole graph
      (a cycle that only exists through local imports is one that the local imports dodge);
  (b) upward imports according to LAYERS below;
  (c) function-local imports of deepinfer modules: each either dodges a cycle (the imported module
      reaches the importer at module level), points upward, or defers a heavy but downward import;
      only the last kind is allowed, and only where DEFERRED says why.

Run it as a script for the full report: `python tests/test_layering.py`.

KNOWN_* below are the violations still on this branch in files that other people are restructuring;
each names who fixes it. They are exact: a violation that disappears must be removed from the list
(the test fails on stale entries), so the lists only shrink.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG_DIR = ROOT / "runtime" / "deepinfer"
REFERENCE_DIR = ROOT / "backends" / "reference"

# ----------------------------------------------------------------------------------- the layer table
# A module may import only from its own layer or a lower one. The longest matching prefix decides.
LAYERS = {
    # 0: facts with no deepinfer dependencies of their own: the error types, the ABI header's tables
    # (abi), element types (dtypes), value checks shared by every config parser (validate), the
    # version, how much host memory there is (host_memory)
    "deepinfer.errors": 0,
    "deepinfer.abi": 0,
    "deepinfer.dtypes": 0,
    "deepinfer.validate": 0,
    "deepinfer._version": 0,
    "deepinfer.host_memory": 0,
    # 1: host tensors and their quantization descriptors (tensor), and the checkpoint formats, which
    # say how a format's tensors look (quant_formats) but run no op
    "deepinfer.tensor": 1,
    "deepinfer.quant_formats": 1,
    # 2: the Backend object and everything that finds, validates and binds one: the NumPy reference
    # (an implementation of Backend), the loader and its probe child; the per-format quantize math,
    # which is backend-level array code (it reads the reference's dequantization as the definition)
    "deepinfer.backend": 2,
    "deepinfer.backend_base": 2,
    "deepinfer.native_backend": 2,
    "deepinfer.native_calls": 2,
    "deepinfer.fallback_backend": 2,
    "deepinfer.reference": 2,
    "deepinfer.library": 2,
    "deepinfer.discovery": 2,
    "deepinfer.probe_answer": 2,
    "deepinfer.probe_cache": 2,
    "deepinfer.loader": 2,
    "deepinfer._probe_child": 2,
    "deepinfer.weight_quant": 2,
    # 3: several processes on one model: the mpirun launcher, communicator groups and weight
    # sharding, which the model's weight loading uses (the worker that runs an engine per rank sits
    # above the engine, below)
    "deepinfer.parallel": 3,
    # 4: the model: configs, checkpoints, weights, graphs and plans, the expert cache
    "deepinfer.model": 4,
    # 5: policy over a model: which precision path fits the memory (precision) and every engine knob
    # (config: EngineConfig, which validates the model's expert-cache settings). Above model/, whose
    # facts they read; below engine/, which they configure
    "deepinfer.precision": 5,
    "deepinfer.config": 5,
    # 6: the engine: tokenizer, sampler, scheduler, KV manager, model runner, speculation
    "deepinfer.engine": 6,
    # 7: what drives an engine: one engine per rank (parallel.worker), the server,
    # the vendor certification suite (it runs the tiny model end to end), checkpoint tools that load
    # models (quantizer, calibration), the perplexity evaluation
    "deepinfer.parallel.worker": 7,
    "deepinfer.serve": 7,
    "deepinfer.conformance": 7,
    "deepinfer.quantizer": 7,
    "deepinfer.calibration": 7,
    "deepinfer.evaluate": 7,
    # 8: the entry points: the command line and the package facade (deepinfer.run / deepinfer.load)
    "deepinfer.cli": 8,
    "deepinfer": 8,
}

# Local imports of deepinfer modules that are downward and dodge no cycle, but are deferred on
# purpose: the entry points import a subcommand's machinery only when it runs, so that `deepinfer
# --help`, `deepinfer backends` and the probe child (which imports the package) start without
# numpy, ml_dtypes, the engine or the server. (importer, imported) -> why.
_CLI_LAZY = "a subcommand loads its machinery only when it runs (start-up of --help and `backends`)"
DEFERRED = {
    ("deepinfer", "deepinfer.engine"): "deepinfer.load(): `import deepinfer` stays light (the probe child imports it)",
    ("deepinfer", "deepinfer.loader"): "deepinfer.get_backend / candidates, bound on first use: the same reason",
    ("deepinfer.cli", "deepinfer.conformance.cli"): _CLI_LAZY,
    ("deepinfer.cli", "deepinfer.engine"): _CLI_LAZY,
    ("deepinfer.cli", "deepinfer.engine.llm_engine"): _CLI_LAZY,
    ("deepinfer.cli", "deepinfer.config"): _CLI_LAZY,
    ("deepinfer.cli", "deepinfer.serve"): _CLI_LAZY,
    ("deepinfer.cli", "deepinfer.serve.app"): _CLI_LAZY,
    ("deepinfer.cli", "deepinfer.evaluate"): _CLI_LAZY,
    ("deepinfer.cli", "deepinfer.quantizer"): _CLI_LAZY,
    ("deepinfer.cli", "deepinfer.parallel.launch"): _CLI_LAZY,
    ("deepinfer.cli", "deepinfer.parallel.worker"): _CLI_LAZY,
    ("deepinfer.cli", "deepinfer.loader"): _CLI_LAZY,
    # `deepinfer conformance`'s parser (conformance.cli, conformance.levels) is built by every CLI
    # start; the suite itself (runner: cases, harness, ml_dtypes) loads when a certification runs
    ("deepinfer.conformance.cli", "deepinfer.conformance.runner"): _CLI_LAZY,
    ("deepinfer.conformance", "deepinfer.conformance.runner"): "the package's run_conformance / summary, bound on "
                                                             "first use: importing conformance.cli runs this "
                                                             "package first, " + _CLI_LAZY,
}

# ----------------------------------------------------------------------------------- known violations
# (importer, imported) pairs that still break a rule, each with who fixes it and how. They are exact:
# the test fails on an entry that no longer applies, so the lists only shrink.
KNOWN_CYCLE_EDGES: dict = {}
KNOWN_UPWARD: dict = {}
KNOWN_CYCLE_DODGING: dict = {}
KNOWN_UNDECLARED_LOCAL: dict = {}


# ----------------------------------------------------------------------------------- the import graph


def _module_files() -> dict[str, Path]:
    """deepinfer module name -> its source file."""
    files: dict[str, Path] = {}

    def add(base: Path, prefix: str) -> None:
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            files[".".join([prefix, *parts])] = path

    add(PKG_DIR, "deepinfer")
    # runtime/deepinfer/reference is a link to backends/reference, which rglob does not follow
    if not any(m.startswith("deepinfer.reference") for m in files):
        add(REFERENCE_DIR, "deepinfer.reference")
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    """Collects (target, lineno, local) of every import statement that runs."""

    def __init__(self, module: str, is_package: bool):
        self.package = module if is_package else module.rpartition(".")[0]
        self.depth = 0
        self.found: list[tuple[str, int, bool]] = []     # (dotted name, line, inside a function)

    def _function(self, node) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        # importlib.import_module("x.y") / import_module(".y", __name__): an import all the same
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
        if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            target = node.args[0].value
            if target.startswith("."):
                level = len(target) - len(target.lstrip("."))
                base = self.package.split(".")
                base = base[:len(base) - (level - 1)]
                target = ".".join(base + ([target.lstrip(".")] if target.lstrip(".") else []))
            self.found.append((target, node.lineno, self.depth > 0))
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name, node.lineno, self.depth > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[:len(base) - (node.level - 1)]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        for alias in node.names:
            # `from m import x` imports the module m.x when there is one, else the name x of m
            self.found.append((mod if alias.name == "*" else f"{mod}.{alias.name}", node.lineno, self.depth > 0))


def _resolve(name: str, modules) -> str | None:
    """The deepest deepinfer module that `name` (a module or a name in one) lies in; None outside deepinfer."""
    parts = name.split(".")
    if parts[0] != "deepinfer":
        return None
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in modules:
            return cand
    return None


def build_graph():
    """(module-level edges, local edges): {(importer, imported): [line, ...]}, and the third-party
    modules each module imports locally."""
    files = _module_files()
    top: dict = defaultdict(list)
    local: dict = defaultdict(list)
    third_party_local: dict = defaultdict(set)
    for mod, path in files.items():
        visitor = _Imports(mod, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(), str(path)))
        for name, line, is_local in visitor.found:
            target = _resolve(name, files)
            if target is None:
                top_name = name.split(".")[0]
                if is_local and top_name and top_name != "deepinfer" and top_name not in sys.stdlib_module_names:
                    third_party_local[mod].add(top_name)
                continue
            if target == mod:
                continue
            lines = (local if is_local else top)[(mod, target)]
            if line not in lines:
                lines.append(line)
    modules = set(files)
    return modules, dict(top), dict(local), dict(third_party_local)


def strongly_connected(nodes, edges) -> list[set]:
    """Tarjan's algorithm; the components of more than one module (a module importing itself is skipped)."""
    succ = defaultdict(set)
    for a, b in edges:
        succ[a].add(b)
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def layer_of(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in LAYERS:
            return LAYERS[key]
    raise KeyError(f"{module} has no layer: add it (or its package) to LAYERS in {__file__}")


def _reaches(start: str, goal: str, edges) -> bool:
    succ = defaultdict(set)
    for a, b in edges:
        succ[a].add(b)
    seen, todo = {start}, [start]
    while todo:
        v = todo.pop()
        if v == goal:
            return True
        for w in succ[v] - seen:
            seen.add(w)
            todo.append(w)
    return False


def analyse():
    modules, top, local, third = build_graph()
    every = set(top) | set(local)
    cycles_top = strongly_connected(modules, top)
    cycles_all = strongly_connected(modules, every)
    cycle_edges = {(a, b) for comp in cycles_all for (a, b) in every if a in comp and b in comp}
    upward = {(a, b) for (a, b) in every if layer_of(b) > layer_of(a)}
    dodging = {(a, b) for (a, b) in local if _reaches(b, a, top)}
    undeclared = {(a, b) for (a, b) in local if (a, b) not in dodging and (a, b) not in upward
                  and (a, b) not in DEFERRED}
    lines = {k: sorted(set(top.get(k, []) + local.get(k, []))) for k in every}
    return {"modules": modules, "top": top, "local": local, "lines": lines, "third_party_local": third,
            "cycles_top": cycles_top, "cycles_all": cycles_all, "cycle_edges": cycle_edges,
            "upward": upward, "dodging": dodging, "undeclared": undeclared}


_RESULT = None


def _result():
    global _RESULT
    if _RESULT is None:
        _RESULT = analyse()
    return _RESULT


def _where(pairs, edges) -> str:
    return "\n".join(f"  {a} -> {b}  (line {', '.join(map(str, edges.get((a, b), [])))})" for a, b in sorted(pairs))


def _check_exact(found: set, known: set, what: str, edges: dict) -> None:
    new, stale = found - known, known - found
    msg = []
    if new:
        msg.append(f"{what}:\n{_where(new, edges)}")
    if stale:
        msg.append(f"fixed, so remove them from the known list in tests/test_layering.py ({what}):\n"
                   + "\n".join(f"  {a} -> {b}" for a, b in sorted(stale)))
    assert not msg, "\n".join(msg)


# ----------------------------------------------------------------------------------- the tests


def test_every_module_has_a_layer():
    for m in _result()["modules"]:
        layer_of(m)


def test_no_import_cycles():
    r = _result()
    assert not r["cycles_top"], "import cycles at module level: " + "; ".join(
        "{" + ", ".join(sorted(c)) + "}" for c in r["cycles_top"])
    modules, every = r["modules"], set(r["top"]) | set(r["local"])
    left = strongly_connected(modules, every - set(KNOWN_CYCLE_EDGES))
    assert not left, ("import cycles (counting function-local imports); every edge inside them:\n" + _where(
        {(a, b) for c in left for (a, b) in every if a in c and b in c}, r["lines"]))
    stale = {e for e in KNOWN_CYCLE_EDGES if e not in r["cycle_edges"]}
    assert not stale, f"these closed a cycle and no longer do: remove them from KNOWN_CYCLE_EDGES: {sorted(stale)}"


def test_no_upward_imports():
    r = _result()
    _check_exact(r["upward"], set(KNOWN_UPWARD), "imports of a higher layer", r["lines"])


def test_no_function_local_import_dodges_a_cycle():
    r = _result()
    _check_exact(r["dodging"], set(KNOWN_CYCLE_DODGING),
                 "function-local imports of a module that imports the importer (import it at module level "
                 "and break the cycle)", r["local"])


def test_other_function_local_imports_are_declared():
    r = _result()
    _check_exact(r["undeclared"], set(KNOWN_UNDECLARED_LOCAL),
                 "function-local imports of deepinfer modules (import them at module level, or say in "
                 "DEFERRED why one must wait)", r["local"])
    stale = {k for k in DEFERRED if k not in r["local"]}
    assert not stale, f"DEFERRED lists imports that are not local imports any more: {sorted(stale)}"


def test_the_graph_sees_known_imports():
    """The parser is not vacuous: imports that certainly exist are found."""
    r = _result()
    assert ("deepinfer.backend", "deepinfer.abi") in r["top"] or any(
        a.startswith("deepinfer.backend") and b == "deepinfer.abi" for a, b in r["top"])
    assert ("deepinfer.engine.llm_engine", "deepinfer.config") in r["top"]


def test_the_reference_backend_is_found_without_a_path_hack():
    """backends/reference installs as deepinfer/reference (pyproject.toml's wheel.packages); a source
    tree (PYTHONPATH=runtime, as on the device machines) finds it through the committed link
    runtime/deepinfer/reference -> ../../backends/reference, not by editing the package's __path__."""
    assert "__path__" not in (PKG_DIR / "__init__.py").read_text()
    link = PKG_DIR / "reference"
    assert link.is_symlink() and link.resolve() == REFERENCE_DIR.resolve()
    # a source-tree run: no editable-install finder, runtime/ first on the path
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in type(f).__module__]; "
            f"sys.path.insert(0, {str(PKG_DIR.parent)!r}); "
            "import deepinfer.reference as r; print(r.__file__); print(r.ReferenceBackend().name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    where, name = out.stdout.split()
    assert Path(where) == link / "__init__.py" and name == "reference"


def report(r) -> str:
    lines = [f"{len(r['modules'])} modules, {len(r['top'])} module-level and {len(r['local'])} local import edges"]
    for title, comps in (("cycles (module-level imports)", r["cycles_top"]),
                         ("cycles (module-level and local imports)", r["cycles_all"])):
        lines.append(f"\n{title}: {len(comps)}")
        for c in comps:
            lines.append("  {" + ", ".join(sorted(c)) + "}")
    for title, key, edges in (("upward imports", "upward", r["lines"]),
                              ("cycle-dodging local imports", "dodging", r["local"]),
                              ("undeclared local imports of deepinfer modules", "undeclared", r["local"])):
        lines.append(f"\n{title}: {len(r[key])}")
        lines.append(_where(r[key], edges) if r[key] else "  (none)")
    lines.append("\ndeclared deferred imports: " + str(sum(1 for k in DEFERRED if k in r["local"])))
    lines.append("\nthird-party modules imported in functions (lazily loaded dependencies; allowed):")
    for m in sorted(r["third_party_local"]):
        lines.append(f"  {m}: {', '.join(sorted(r['third_party_local'][m]))}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(analyse()))
